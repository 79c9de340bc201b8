"""The bfloat16 CPU linear kernel (``torch.ops.dflash2.bf16_linear``, AVX2): numerics, layout,
batch independence, the op's registration, and the compiled runner built on it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dflash2.config
import dflash2.models.layers
from dflash2.models import cpu_kernels
from dflash2.models.layers import PackedLinear, linear_backend
from tests.tiny import tiny_drafter, tiny_engine, tiny_target

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no AVX2 + FMA CPU or no C++ compiler")


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


@pytest.mark.parametrize(("n", "k"), [(1, 1), (15, 7), (16, 64), (24, 5), (33, 130), (100, 9)])
def test_pack_round_trips_and_pads_with_zeros(n, k):
    weight = torch.randn(n, k).to(torch.bfloat16)
    packed = cpu_kernels.pack(weight)
    assert packed.shape == (-(-n // 24), 24 * k) and packed.dtype == torch.bfloat16
    assert torch.equal(cpu_kernels.unpack(packed, n), weight)
    assert int(packed.count_nonzero()) == int(weight.count_nonzero())  # the padding rows are zeros


def test_pack_refuses_other_dtypes():
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_kernels.pack(torch.randn(16, 8))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 33, 70])
@pytest.mark.parametrize(("n", "k"), [(1, 1), (17, 7), (48, 64), (100, 130)])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_accumulation_matches_a_float64_reference(rows, n, k, bias):
    generator = torch.Generator().manual_seed(rows * 1000 + n + k)
    weight = torch.randn(n, k, generator=generator).to(torch.bfloat16)
    b = torch.randn(n, generator=generator).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, k, generator=generator)
    packed = cpu_kernels.pack(weight)
    expected = _reference(x, weight, b)
    # float32 input, float32 output: only float32 rounding of the sum (and of the bias add).
    got = cpu_kernels.linear(x, packed, b, n)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    bound = 4 * k * 2.0**-24 * (x.double().abs() @ weight.double().abs().T) + 2.0**-23 * expected.abs()
    assert bool(((got.double() - expected).abs() <= bound + 1e-30).all())
    # bfloat16 input: the output is the float32 sum rounded once to bfloat16 (within one unit).
    xb = x.to(torch.bfloat16)
    got_bf16 = cpu_kernels.linear(xb, packed, b, n)
    expected_bf16 = _reference(xb, weight, b)
    assert got_bf16.dtype == torch.bfloat16
    assert bool(((got_bf16.double() - expected_bf16).abs() <= 2.0**-8 * expected_bf16.abs() + 1e-6 * k).all())


def test_leading_dimensions_and_strided_inputs():
    weight = torch.randn(40, 24).to(torch.bfloat16)
    packed = cpu_kernels.pack(weight)
    x = torch.randn(2, 12, 24).to(torch.bfloat16)[:, 1:]  # strided, like hidden[:, 1:]
    got = cpu_kernels.linear(x, packed, None, 40)
    assert got.shape == (2, 11, 40)
    assert torch.equal(got, cpu_kernels.linear(x.contiguous().view(22, 24), packed, None, 40).view(2, 11, 40))


def test_a_rows_result_does_not_depend_on_the_batch():
    """Every output is one float32 sum in k order, whatever the row count or the row's place."""
    weight = torch.randn(72, 96).to(torch.bfloat16)
    packed = cpu_kernels.pack(weight)
    x = torch.randn(41, 96).to(torch.bfloat16)
    whole = cpu_kernels.linear(x, packed, None, 72)
    for start, stop in [(0, 1), (5, 6), (2, 9), (3, 7), (0, 41), (37, 41), (10, 40)]:
        assert torch.equal(cpu_kernels.linear(x[start:stop], packed, None, 72), whole[start:stop])


def test_bad_shapes_raise():
    packed = cpu_kernels.pack(torch.randn(32, 16).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="last dimension must be 16"):
        cpu_kernels.linear(torch.randn(2, 15), packed, None, 32)
    with pytest.raises(RuntimeError, match="out_features does not match"):
        cpu_kernels.linear(torch.randn(2, 16), packed, None, 56)  # 3 blocks of 24, not 2


def test_the_op_passes_torch_library_checks():
    """Schema, shape function (fake tensors, used when graphs are traced) and dispatch agree."""
    packed = cpu_kernels.pack(torch.randn(40, 24).to(torch.bfloat16))
    x = torch.randn(3, 5, 24).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.dflash2.bf16_linear.default, (x, packed, None, 40))
    bias = torch.randn(40).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.dflash2.bf16_linear.default, (x[0], packed, bias, 40))


def test_packed_linear_in_a_compiled_graph_equals_eager():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 100).to(torch.bfloat16)
    packed = PackedLinear(linear.weight, linear.bias, backend="kernel")
    assert packed.backend == "kernel" and packed.weight is None

    def block(x: torch.Tensor) -> torch.Tensor:
        return F.silu(packed(x)) * 2

    compiled = torch.compile(block, fullgraph=True, dynamic=False)
    x = torch.randn(3, 8, 64).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(compiled(x), block(x))
        torch.testing.assert_close(packed(x).float(), linear(x).float(), atol=0.05, rtol=0.02)


@pytest.fixture()
def kernel_backend(monkeypatch):
    """The kernel backend even on a CPU where oneDNN runs bfloat16."""
    monkeypatch.setattr(dflash2.models.layers, "onednn_bf16", lambda device, dtype: False)
    assert linear_backend(torch.device("cpu"), torch.bfloat16) == "kernel"


def test_compiled_runner_runs_the_kernel_and_matches_eager(kernel_backend):
    """bfloat16 with the kernel: every linear of the eager and the compiled forwards is packed, the
    graphs compile with the op inside, and the compiled verify's logits and features match the eager
    ones up to bfloat16 rounding (the compiled graphs fuse the other ops differently)."""
    results = []
    for enforce_eager in (True, False):
        target = tiny_target("qwen3", seed=3).to(torch.bfloat16)
        drafter = tiny_drafter(target, 2, 8).to(torch.bfloat16)
        engine = tiny_engine(target, drafter, 8, max_num_seqs=2, enforce_eager=enforce_eager, dtype="bfloat16")
        runner = engine.runner
        assert runner.compiled is not enforce_eager
        modules = [target, drafter.layers]
        if not enforce_eager:
            modules += [runner._target_forward.module, runner._draft_forward.module]
        for module in modules:
            linears = [m for m in module.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))]
            assert linears and all(isinstance(m, PackedLinear) and m.backend == "kernel" for m in linears)
        prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1]]
        runner.prefill([0, 1], prompts, [0, 0])
        rows = [[5, 3, 5, 8], [8, 2, 8, 1, 8, 2, 8, 4]]
        logits, features = runner.verify([0, 1], rows, [8, 3])
        assert features is not None
        results.append([(logits[r, : len(row)], features[r, : len(row)]) for r, row in enumerate(rows)])
    for (eager_logits, eager_features), (fast_logits, fast_features) in zip(*results):
        scale = float(eager_logits.abs().max())
        torch.testing.assert_close(fast_logits, eager_logits, atol=0.03 * scale, rtol=0)
        torch.testing.assert_close(fast_features.float(), eager_features.float(), atol=0.1, rtol=0.05)


def test_auto_dtype_follows_the_kernel_for_the_engine_not_for_training(monkeypatch):
    """``--dtype auto``: bfloat16 for the engine where the kernel runs (it packs the linears), float32
    for ``train`` / ``eval``, which run the target's plain ``nn.Linear`` layers."""
    from dflash2 import cli
    from dflash2.config import EngineConfig

    monkeypatch.setattr(dflash2.models.layers, "onednn_bf16", lambda device, dtype: False)
    monkeypatch.setattr(dflash2.config, "cpu_has_native_bf16", lambda: False)
    auto = EngineConfig(device="cpu")
    assert auto.torch_dtype == torch.bfloat16
    assert cli._offline_dtype(auto) == torch.float32
    assert cli._offline_dtype(EngineConfig(device="cpu", dtype="bfloat16")) == torch.bfloat16
    monkeypatch.setattr(dflash2.models.layers, "onednn_bf16", lambda device, dtype: True)
    monkeypatch.setattr(dflash2.config, "cpu_has_native_bf16", lambda: True)
    assert cli._offline_dtype(EngineConfig(device="cpu")) == torch.bfloat16
