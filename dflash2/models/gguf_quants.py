"""GGUF quantized tensors in a logical group form: integer codes, one scale and an optional offset per group.

GGUF stores a quantized 2-D weight as rows of fixed-size byte blocks (ggml's block layouts). This module
unpacks those bytes, for the types in ``SUPPORTED_TYPES``, into a layout-free form that a kernel can consume
directly::

    w[n, k] = scales[n, k // G] * q[n, k] + offsets[n, k // G]      (offsets omitted when None)

computed in float32, with ``G`` the group size. The conversion is lossless: ``dequantize(to_group_form(...))``
equals ``gguf.quants.dequantize(data, qtype)`` exactly (see "Exactness" below).

Per type (``d``, ``dmin``, ``m`` are the block's float16 fields, ``sc``, ``mn`` ggml's 6-bit sub-block
scales and mins, ``s`` Q6_K's int8 sub-block scales):

=======  ====================  ====  ==  ====================  =============  ==============
type     ggml formula          bits  G   q                     scales         offsets
=======  ====================  ====  ==  ====================  =============  ==============
Q4_0     d * (q - 8)           4     32  q in 0..15 (uint8)    d              -8 * d
Q4_1     d * q + m             4     32  q in 0..15 (uint8)    d              m
Q5_0     d * (q - 16)          8     32  q - 16 in -16..15     d              None
Q5_1     d * q + m             8     32  q in 0..31            d              m
Q8_0     d * q                 8     32  q in -128..127        d              None
Q4_K     d*sc * q - dmin*mn    4     32  q in 0..15 (uint8)    d * sc         -(dmin * mn)
Q5_K     d*sc * q - dmin*mn    8     32  q in 0..31            d * sc         -(dmin * mn)
Q6_K     d*s * (q - 32)        8     16  q - 32 in -32..31     d * s          None
=======  ====================  ====  ==  ====================  =============  ==============

Exactness: every product above is exact in float32 (a float16 significand has 11 bits; times a 6-bit
K-quant scale, or Q6_K's 8-bit one, times a code of at most 6 bits stays within float32's 24), so
``scales * q`` is exact however it is evaluated, and the only rounding is at the final add, the same single
rounding the ``gguf`` package's numpy dequantizers do (``d * q + m``, ``d*sc * q - dmin*mn``). Hence the
results are bit for bit identical, with or without a fused multiply-add. The one representation choice is
Q4_0, kept at 4 bits by moving the ``-8`` into the offset: ``d * q + (-8 * d)`` has the same value as ggml's
``d * (q - 8)`` everywhere, and the same bits except for the sign of a zero (an element with code 8 in a
block with negative ``d`` is ``-0.0`` in ggml and ``+0.0`` here), which no product or sum can tell apart.
Blocks whose float16 fields are infinite or NaN (never written by a quantizer) are not guaranteed to
dequantize identically.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from dflash2.models.quant import GroupQuantized, dequantize

__all__ = [
    "SUPPORTED_TYPES",
    "GroupQuantized",
    "UnsupportedGGUFType",
    "dequantize",
    "to_group_form",
]

#: Names of the ``GGMLQuantizationType`` members ``to_group_form`` converts.
SUPPORTED_TYPES: tuple[str, ...] = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")

# Super-block size of the K-quants.
_QK_K = 256
# Bytes of the packed 6-bit scales and mins of Q4_K / Q5_K.
_K_SCALE_SIZE = 12


class UnsupportedGGUFType(ValueError):
    """A GGUF tensor type that has no group form here; the message says how to serve such a model instead."""


def _unsupported(qtype: GGMLQuantizationType) -> UnsupportedGGUFType:
    name = getattr(qtype, "name", str(qtype))
    return UnsupportedGGUFType(
        f"GGUF tensor type {name} has no quantized kernel in dflash2 (supported: {', '.join(SUPPORTED_TYPES)}); "
        "serve the model dequantized with --quantization none, or use a GGUF file quantized to a supported type"
    )


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 field at byte ``start`` of every block, as float32 [n_blocks]."""
    return np.ascontiguousarray(blocks[:, start : start + 2]).view(np.float16)[:, 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n_blocks, 16] packed bytes -> [n_blocks, 32] codes: byte j holds elements j (low) and j + 16 (high)."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """[n_blocks, 4] little-endian uint32 -> [n_blocks, 32]: bit i of the word is the 5th bit of element i."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K packed scales [n_blocks, 12] -> (sc, mn), each [n_blocks, 8] uint8 in 0..63.

    Bytes 0-3 hold sc[0..3] in their low 6 bits, bytes 4-7 mn[0..3]; bytes 8-11 hold the low 4 bits of
    sc[4..7] (low nibble) and mn[4..7] (high nibble), whose top 2 bits are the top bits of bytes 0-3 and 4-7.
    """
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    # block (18 bytes): d f16, qs[16]
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:18])
    return q, d[:, None], (np.float32(-8) * d)[:, None]


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    # block (20 bytes): d f16, m f16, qs[16]
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 4:20])
    return q, d[:, None], m[:, None]


def _q5_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    # block (22 bytes): d f16, qh u32, qs[16]
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 6:22]) | (_high_bits32(blocks[:, 2:6]) << np.uint8(4))
    return q.view(np.int8) - np.int8(16), d[:, None], None


def _q5_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    # block (24 bytes): d f16, m f16, qh u32, qs[16]
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 8:24]) | (_high_bits32(blocks[:, 4:8]) << np.uint8(4))
    return q.view(np.int8), d[:, None], m[:, None]


def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    # block (34 bytes): d f16, qs[32] int8
    d = _f16(blocks, 0)
    return blocks[:, 2:34].view(np.int8), d[:, None], None


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K sub-block scales ``d * sc`` and offsets ``-(dmin * mn)``, each float32 [n_blocks, 8]."""
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scale_min(blocks[:, 4 : 4 + _K_SCALE_SIZE])
    return d[:, None] * sc.astype(np.float32), -(dmin[:, None] * mn.astype(np.float32))


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    # block (144 bytes): d f16, dmin f16, scales[12], qs[128]. qs holds 4 chunks of 32 bytes; chunk j holds
    # sub-block 2j in its low nibbles and sub-block 2j + 1 in its high nibbles.
    n = blocks.shape[0]
    scales, offsets = _k_scales(blocks)
    qs = blocks[:, 16:144].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & np.uint8(0x0F)).reshape(n, _QK_K)
    return q, scales, offsets


def _q5_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    # block (176 bytes): d f16, dmin f16, scales[12], qh[32], qs[128]. The low nibbles are laid out as in
    # Q4_K; bit i of qh[l] is the 5th bit of element l of sub-block i.
    n = blocks.shape[0]
    scales, offsets = _k_scales(blocks)
    ql = blocks[:, 48:176].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    qh = blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = (ql & np.uint8(0x0F)).reshape(n, 8, 32) | ((qh & np.uint8(0x01)) << np.uint8(4))
    return q.reshape(n, _QK_K).view(np.int8), scales, offsets


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    # block (210 bytes): ql[128], qh[64], scales[16] int8, d f16. Each half of 128 elements takes 64 bytes
    # of ql (low nibbles of elements 0-63, high nibbles of elements 64-127) and 32 bytes of qh (2 bits per
    # element, element 32 * i + l in bits 2i..2i+1 of byte l).
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & np.uint8(0x0F)).reshape(n, 8, 32)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & np.uint8(0x03)).reshape(n, 8, 32)
    q = (ql | (qh << np.uint8(4))).view(np.int8) - np.int8(32)
    s = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(blocks, 208)
    return q.reshape(n, _QK_K), d[:, None] * s, None


# name -> (unpacker, bits, group size)
_CONVERTERS = {
    "Q4_0": (_q4_0, 4, 32),
    "Q4_1": (_q4_1, 4, 32),
    "Q5_0": (_q5_0, 8, 32),
    "Q5_1": (_q5_1, 8, 32),
    "Q8_0": (_q8_0, 8, 32),
    "Q4_K": (_q4_k, 4, 32),
    "Q5_K": (_q5_k, 8, 32),
    "Q6_K": (_q6_k, 8, 16),
}
assert tuple(_CONVERTERS) == SUPPORTED_TYPES


def to_group_form(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> GroupQuantized:
    """Unpack a GGUF quantized 2-D tensor into its group form, losslessly.

    Args:
        data: The tensor's raw bytes as ``gguf.GGUFReader`` exposes them (``tensor.data``): uint8, normally
            [N, bytes_per_row]; any shape holding exactly the tensor's bytes in row-major order is accepted.
        qtype: The tensor's ``GGMLQuantizationType`` (``tensor.tensor_type``); one of ``SUPPORTED_TYPES``.
        shape: The logical weight shape (N output features, K input features), the shape
            ``gguf.quants.dequantize(data, qtype)`` returns. K must be a multiple of the type's block size
            (32, or 256 for the K-quants).

    Returns:
        A ``GroupQuantized`` whose ``dequantize`` equals ``gguf.quants.dequantize(data, qtype)`` (see the
        module docstring for the representation of each type and the one caveat, Q4_0's sign of zero).
        ``q`` is a new tensor (it does not alias ``data``).

    Raises:
        UnsupportedGGUFType: ``qtype`` is not one of ``SUPPORTED_TYPES`` (including unquantized F32/F16/BF16).
        ValueError: ``data`` or ``shape`` does not fit the type's block layout.
    """
    name = getattr(qtype, "name", None)
    if name not in _CONVERTERS:
        raise _unsupported(qtype)
    unpack, bits, group_size = _CONVERTERS[name]
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]

    if len(shape) != 2:
        raise ValueError(f"{name} tensor: expected a 2-D shape (N, K), got {tuple(shape)}")
    n_rows, k = (int(x) for x in shape)
    if n_rows <= 0 or k <= 0 or k % block_size != 0:
        raise ValueError(f"{name} tensor of shape {(n_rows, k)}: K must be a positive multiple of {block_size}")
    if data.dtype != np.uint8:
        raise ValueError(f"{name} tensor: expected raw uint8 block data, got dtype {data.dtype}")
    n_blocks = n_rows * (k // block_size)
    if data.size != n_blocks * type_size:
        raise ValueError(
            f"{name} tensor of shape {(n_rows, k)} needs {n_blocks * type_size} bytes "
            f"({n_blocks} blocks of {type_size}), got {data.size} (data shape {tuple(data.shape)})"
        )

    blocks = np.ascontiguousarray(data).reshape(n_blocks, type_size)
    q, scales, offsets = unpack(blocks)
    n_groups = k // group_size
    q_t = torch.from_numpy(np.ascontiguousarray(q).reshape(n_rows, k))
    scales_t = torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32).reshape(n_rows, n_groups))
    offsets_t = None
    if offsets is not None:
        offsets_t = torch.from_numpy(np.ascontiguousarray(offsets, dtype=np.float32).reshape(n_rows, n_groups))
    if bits == 4:
        q_t = q_t.to(torch.uint8)
    else:
        q_t = q_t.to(torch.int8)
    return GroupQuantized(bits=bits, group_size=group_size, q=q_t, scales=scales_t, offsets=offsets_t)
