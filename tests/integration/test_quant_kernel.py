"""The weight-only quantized linear kernel (``dflash2::quant_linear``): against a float64 reference of
the dequantized weight, row invariance bit for bit, the packed layout, and inside a compiled graph."""

from __future__ import annotations

import pytest
import torch

from dflash2.models import cpu_kernels
from dflash2.models.quant import (
    KERNEL_FORMATS,
    GroupQuantized,
    QuantizedLinear,
    dequantize,
    fuse_quantized,
    pack,
    quantize_rtn,
    unpack,
)

pytestmark = pytest.mark.skipif(not cpu_kernels.QUANT.available(), reason="needs AVX2, FMA, F16C and a compiler")

ROWS = [*range(1, 18), 33]
SHAPES = [(37, 64), (8, 32), (200, 96), (9, 128)]  # odd output counts: a partly filled last block


def random_group(bits: int, group_size: int, n: int, k: int, offsets: bool, seed: int = 0) -> GroupQuantized:
    """Random codes over their whole range, float32 scales (not all float16) and offsets."""
    g = torch.Generator().manual_seed(seed)
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    else:
        q = torch.randint(-128, 128, (n, k), generator=g).to(torch.int8)
    scales = torch.rand(n, k // group_size, generator=g) * 0.05 + 1e-3
    shift = torch.randn(n, k // group_size, generator=g) * 0.1 if offsets else None
    return GroupQuantized(bits, group_size, q, scales, shift)


FORMATS = [(bits, size, offsets) for bits, size in KERNEL_FORMATS for offsets in (True, False) if bits == 8 or offsets]


@pytest.mark.parametrize(("bits", "group_size", "offsets"), FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_pack_and_unpack_are_inverse(bits, group_size, offsets, shape):
    n, k = shape
    g = random_group(bits, group_size, n, k, offsets)
    qweight, scales, shift = pack(g)
    assert qweight.shape == (-(-n // 8), k // group_size, group_size * bits // 32, 32)
    back = unpack(qweight, scales, shift, bits, group_size, n)
    assert torch.equal(back.q, g.q) and torch.equal(back.scales, g.scales)
    assert (back.offsets is None) == (g.offsets is None)
    if g.offsets is not None:
        assert back.offsets is not None and torch.equal(back.offsets, g.offsets)


def test_scales_are_float16_only_where_exact():
    g = quantize_rtn(torch.randn(16, 64), 4)  # round to nearest stores float16-exact scales
    assert pack(g)[1].dtype == torch.float16
    odd = GroupQuantized(4, 32, g.q, g.scales + 1e-7, g.offsets)
    assert pack(odd)[1].dtype == torch.float32
    assert torch.equal(dequantize(unpack(*pack(odd), 4, 32, 16)), dequantize(odd))


@pytest.mark.parametrize(("bits", "group_size", "offsets"), FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_a_float64_reference(bits, group_size, offsets, shape, dtype):
    n, k = shape
    layer = QuantizedLinear(random_group(bits, group_size, n, k, offsets), torch.randn(n))
    weight = layer.dequantized().double()
    x = torch.randn(max(ROWS), k).to(dtype)
    expected_full = x.double() @ weight.T + layer.bias.double()
    for rows in ROWS:
        out = layer(x[:rows])
        assert out.dtype == dtype and out.shape == (rows, n)
        expected = expected_full[:rows]
        if dtype == torch.float32:
            torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4 * expected.abs().max().item())
        else:  # one rounding of the float32 sum to bfloat16
            torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


@pytest.mark.parametrize(("bits", "group_size", "offsets"), FORMATS)
def test_a_rows_result_does_not_depend_on_the_others(bits, group_size, offsets):
    layer = QuantizedLinear(random_group(bits, group_size, 70, 128, offsets))
    x = torch.randn(40, 128).to(torch.bfloat16)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    for rows in ROWS:
        for start in (0, 3):
            block = x[start : start + rows]
            assert torch.equal(layer(block), alone[start : start + len(block)]), (rows, start)
    batched = layer(x.view(4, 10, 128))  # any leading shape
    assert torch.equal(batched.view(40, -1), alone)


def test_round_to_nearest_error_is_bounded():
    w = torch.randn(64, 256).view(64, 8, 32)
    for bits in (8, 4):
        err = (dequantize(quantize_rtn(w.reshape(64, 256), bits)).view(64, 8, 32) - w).abs()
        if bits == 8:
            step = w.abs().amax(-1, keepdim=True) / 127
        else:
            step = (w.amax(-1, keepdim=True) - w.amin(-1, keepdim=True)) / 15
        # Half a step, and the float16 rounding of the scale (and offset) the codes were chosen against.
        assert (err <= 0.55 * step).all(), bits
        assert err.max() > 0.4 * step.max(), bits  # the bound is not vacuous


def test_fusing_concatenates_outputs_and_refuses_mixed_formats():
    parts = [QuantizedLinear(quantize_rtn(torch.randn(n, 64), 4), torch.randn(n)) for n in (24, 12, 12)]
    fused = fuse_quantized(parts)
    assert fused is not None
    x = torch.randn(3, 64)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))
    mixed = [parts[0], QuantizedLinear(quantize_rtn(torch.randn(8, 64), 8))]
    assert fuse_quantized(mixed) is None


def test_bad_inputs_are_clear_errors():
    layer = QuantizedLinear(quantize_rtn(torch.randn(16, 64), 4))
    with pytest.raises(RuntimeError, match="last dimension must be 64"):
        layer(torch.randn(2, 32))
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        layer(torch.randn(2, 64).half())
    with pytest.raises(ValueError, match="groups of 64"):
        QuantizedLinear(quantize_rtn(torch.randn(16, 128), 4, group_size=64))


def test_compiled_graph_calls_the_op():
    layer = QuantizedLinear(quantize_rtn(torch.randn(48, 64), 4), torch.randn(48))
    module = torch.nn.Sequential(layer, torch.nn.ReLU()).eval()
    compiled = torch.compile(module, fullgraph=True)
    x = torch.randn(5, 64).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(compiled(x), module(x))
