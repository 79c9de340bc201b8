"""Weight-only quantized linear layers: 4- and 8-bit codes with a scale (and offset) per group of inputs.

One format holds every quantized weight the server runs (docs/engine.md, "Quantized weights"):
output feature ``n``, inputs ``k`` of group ``g = k // G``::

    w[n, k] = scales[n, g] · q[n, k] + offsets[n, g]      (offsets = 0 when the format has none)

* 4-bit: unsigned codes 0 … 15, groups of 32, with offsets — GGUF's Q4_0 (offset ``−8·d``), Q4_1,
  the sub-blocks of Q4_K, and ``--quantization int4`` (asymmetric round to nearest);
* 8-bit: signed codes −128 … 127, groups of 16 or 32, offsets optional — Q8_0, Q5_0, Q5_1, the
  sub-blocks of Q5_K and Q6_K, and ``--quantization int8`` (symmetric round to nearest).

Scales and offsets are float16 where every value is a float16 (Q4_0, Q4_1, Q8_0, Q5_0/1 and the
round-to-nearest formats) and float32 where they are not (a K-quant's ``d · sc`` products), so a
GGUF file is repacked without changing one weight (:mod:`dflash2.models.gguf_quants`). Activations
are not quantized: the kernel dequantizes each weight in registers to the float32 value above and
multiplies in float32 (``csrc/quant_linear.cpp``, op ``dflash2::quant_linear``; AVX2, FMA and F16C).
Each row's result is independent of the other rows, as with the bfloat16 kernels.

Dimension letters: N output features, K inputs, G group size, R rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

BLOCK = 8  # output features per packed block (kBlock in quant_linear.cpp)
# (bits, group size) pairs the kernel runs.
KERNEL_FORMATS = ((4, 32), (8, 32), (8, 16))


@dataclass(frozen=True)
class GroupQuantized:
    """A quantized ``[N, K]`` weight in logical form (before packing).

    Attributes:
        bits: 4 (codes 0 … 15) or 8 (codes −128 … 127).
        group_size: G, inputs per scale (K is a multiple of it).
        q: ``[N, K]`` codes: uint8 when ``bits == 4``, int8 when ``bits == 8``.
        scales: ``[N, K / G]`` float32.
        offsets: ``[N, K / G]`` float32, or None (symmetric).
    """

    bits: int
    group_size: int
    q: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)``."""
        return int(self.q.shape[0]), int(self.q.shape[1])


def dequantize(g: GroupQuantized) -> torch.Tensor:
    """The float32 ``[N, K]`` weight ``scales · q + offsets``, computed in float32 (one rounding, at the
    add: every product of a scale and a code is exact in float32, as in GGUF's reference dequantization)."""
    n, k = g.q.shape
    w = g.q.reshape(n, k // g.group_size, g.group_size).float() * g.scales.float().unsqueeze(-1)
    if g.offsets is not None:
        w = w + g.offsets.float().unsqueeze(-1)
    return w.reshape(n, k)


def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int = 32) -> GroupQuantized:
    """Round-to-nearest group-wise quantization of a float ``[N, K]`` weight (K a multiple of ``group_size``).

    * ``bits == 8``: symmetric, ``scale = max|w| / 127`` per group, codes ``round(w / scale)``
      (gpt-fast's and torchao's int8 weight-only, per group instead of per channel);
    * ``bits == 4``: asymmetric, ``scale = (max − min) / 15``, ``offset = min``, codes
      ``round((w − min) / scale)`` clamped to 0 … 15 (GGUF's Q4_1 rule).

    Scales and offsets are rounded to float16 first and the codes computed against the rounded
    values, so the stored format is exactly what is served.

    Raises:
        ValueError: ``bits`` not 4 or 8, or K not a multiple of ``group_size``.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"{k} inputs are not a multiple of the group size {group_size}")
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    if bits == 8:
        scales = (w.abs().amax(-1) / 127).half().float()
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(w / safe[..., None]).clamp(-127, 127).to(torch.int8)
        return GroupQuantized(8, group_size, q.reshape(n, k), scales, None)
    low, high = w.amin(-1), w.amax(-1)
    offsets = low.half().float()
    scales = ((high - offsets) / 15).half().float()
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((w - offsets[..., None]) / safe[..., None]).clamp(0, 15).to(torch.uint8)
    return GroupQuantized(4, group_size, q.reshape(n, k), scales, offsets)


def _scale_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float16 when every value round-trips through float16 exactly, else float32."""
    for t in tensors:
        if t is not None and not torch.equal(t.half().float(), t.float()):
            return torch.float32
    return torch.float16


def pack(g: GroupQuantized) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Lay ``g`` out for the kernel (``csrc/quant_linear.cpp``): ``(qweight [⌈N/8⌉, K/G, G·bits/32, 32]
    uint8, scales [⌈N/8⌉, K/G, 8], offsets like scales or None)``; features past N are zero.

    Blocks of 8 output features, group after group; in a group, 32-byte vectors whose 32-bit lane ``n``
    holds feature ``n``'s codes for a step of inputs: 4-bit, vector ``t`` = inputs ``8t … 8t + 7``
    (input ``8t + i`` in bits ``4i … 4i + 3``); 8-bit, vector ``t`` = inputs ``4t … 4t + 3`` (one byte each).

    Raises:
        ValueError: a (bits, group size) the kernel does not run (:data:`KERNEL_FORMATS`).
    """
    if (g.bits, g.group_size) not in KERNEL_FORMATS:
        raise ValueError(f"no kernel for {g.bits}-bit codes in groups of {g.group_size}")
    n, k = g.shape
    size, groups, blocks = g.group_size, k // g.group_size, -(-n // BLOCK)
    codes = torch.zeros(blocks * BLOCK, k, dtype=torch.uint8)
    codes[:n] = g.q.view(torch.uint8) if g.bits == 8 else g.q
    if g.bits == 4:  # [blocks, n, groups, t, byte j, nibble h]: input 8t + 2j + h
        split = codes.view(blocks, BLOCK, groups, size // 8, 4, 2)
        lanes = split[..., 0] | (split[..., 1] << 4)
    else:  # [blocks, n, groups, t, byte i]: input 4t + i
        lanes = codes.view(blocks, BLOCK, groups, size // 4, 4)
    qweight = lanes.permute(0, 2, 3, 1, 4).reshape(blocks, groups, size * g.bits // 32, 32).contiguous()
    dtype = _scale_dtype(g.scales, g.offsets)

    def lay_out(values: torch.Tensor) -> torch.Tensor:
        padded = torch.zeros(blocks * BLOCK, groups, dtype=torch.float32)
        padded[:n] = values.float()
        return padded.view(blocks, BLOCK, groups).transpose(1, 2).contiguous().to(dtype)

    offsets = None if g.offsets is None else lay_out(g.offsets)
    return qweight, lay_out(g.scales), offsets


def unpack(
    qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, bits: int, group_size: int, n: int
) -> GroupQuantized:
    """:func:`pack`'s inverse: the logical form of the first ``n`` output features."""
    blocks, groups = qweight.shape[:2]
    steps = group_size // 8 if bits == 4 else group_size // 4
    lanes = qweight.view(blocks, groups, steps, BLOCK, 4).permute(0, 3, 1, 2, 4)  # [blocks, n, groups, t, byte]
    if bits == 4:
        lanes = torch.stack([lanes & 0x0F, lanes >> 4], dim=-1)
    q = lanes.reshape(blocks * BLOCK, groups * group_size)[:n].contiguous()
    q = q.view(torch.int8) if bits == 8 else q

    def logical(values: torch.Tensor) -> torch.Tensor:
        return values.float().transpose(1, 2).reshape(blocks * BLOCK, groups)[:n].contiguous()

    return GroupQuantized(bits, group_size, q, logical(scales), None if offsets is None else logical(offsets))


class QuantizedLinear(nn.Module):
    """An inference-only linear layer with a weight-only quantized weight (:class:`GroupQuantized`).

    ``forward`` runs ``dflash2::quant_linear`` (CPU, AVX2 + FMA + F16C; float32 accumulation, each row
    independent of the others) on bfloat16 or float32 inputs; a custom op with a shape function, so
    compiled graphs call it with the packed tensors as graph inputs.

    Args:
        g: the weight; bias: ``[N]`` or None.
        format_name: what the weight came from, for reports (``"Q4_1"``, ``"int4"``, …).
        weight: a dense copy to keep for code that reads ``.weight`` (a tied LM head the drafter
            shares), or None.

    Raises:
        ValueError: a (bits, group size) the kernel does not run.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None

    def __init__(
        self,
        g: GroupQuantized,
        bias: torch.Tensor | None = None,
        format_name: str = "",
        weight: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = g.shape
        self.bits, self.group_size = g.bits, g.group_size
        self.format_name = format_name or f"int{g.bits}"
        qweight, scales, offsets = pack(g)
        self.register_buffer("qweight", qweight, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("offsets", offsets, persistent=False)
        self.bias: torch.Tensor | None
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)
        self.weight = weight
        from dflash2.models.cpu_kernels import QUANT

        self.kernel = QUANT.available()  # builds and loads the op the first time

    @property
    def nbytes(self) -> int:
        """Bytes of codes, scales and offsets."""
        tensors = [self.qweight, self.scales] + ([] if self.offsets is None else [self.offsets])
        return sum(t.numel() * t.element_size() for t in tensors)

    def group_form(self) -> GroupQuantized:
        """The weight in logical form (see :func:`unpack`)."""
        return unpack(self.qweight, self.scales, self.offsets, self.bits, self.group_size, self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float32 ``[N, K]`` weight the layer multiplies by."""
        return dequantize(self.group_form())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` bfloat16 or float32 → ``[..., N]`` in ``x``'s dtype."""
        if x.device.type != "cpu" or not self.kernel:  # dense product of the same weight (slow; checks, GPUs)
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self.dequantized().to(x.device, x.dtype), bias)
        return torch.ops.dflash2.quant_linear(
            x, self.qweight, self.scales, self.offsets, self.bias, self.bits, self.group_size, self.out_features
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, format={self.format_name}, "
            f"bits={self.bits}, group_size={self.group_size}, bias={self.bias is not None}"
        )


def same_format(parts: Sequence[nn.Module]) -> bool:
    """Whether ``parts`` can be fused into one matrix: all dense, or all :class:`QuantizedLinear` of one
    format (bits, group size, offsets or not; a GGUF mix can hold Q4_K and Q6_K in one layer)."""
    formats = {(p.bits, p.group_size, p.offsets is None) if isinstance(p, QuantizedLinear) else None for p in parts}
    return len(formats) == 1


def fuse_quantized(parts: list[QuantizedLinear]) -> QuantizedLinear | None:
    """One :class:`QuantizedLinear` whose output is the concatenation of ``parts``' outputs, or None
    when their formats differ (:func:`same_format`)."""
    first = parts[0]
    if not same_format(parts):
        return None
    forms = [p.group_form() for p in parts]
    fused = GroupQuantized(
        first.bits,
        first.group_size,
        torch.cat([f.q for f in forms]),
        torch.cat([f.scales for f in forms]),
        None if first.offsets is None else torch.cat([f.offsets for f in forms if f.offsets is not None]),
    )
    biases = [p.bias for p in parts]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else torch.zeros(p.out_features) for p, b in zip(parts, biases)])
    names = sorted({p.format_name for p in parts})
    return QuantizedLinear(fused, bias, "+".join(names))
