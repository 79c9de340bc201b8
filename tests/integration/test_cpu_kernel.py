"""The project's bfloat16 CPU linear kernels (``torch.ops.dflash2.bf16_linear``, AVX2, and
``torch.ops.dflash2.bf16_dot_linear``, AVX512-BF16): numerics, layouts, batch independence, the ops'
registration, and the compiled runner built on them. Each kernel's tests run where its CPU features are."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dflash2.models.layers
import dflash2.runner.model_setup
from dflash2.models import cpu_kernels
from dflash2.models.layers import PackedLinear, linear_backend
from dflash2.spec.tree import TokenTree
from tests.tiny import tiny_drafter, tiny_engine, tiny_target

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no AVX2 + FMA CPU or no C++ compiler")


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


def test_avx2_layout_has_blocks_of_24():
    weight = torch.randn(33, 5).to(torch.bfloat16)
    assert cpu_kernels.pack(weight).shape == (2, 24 * 5)


def test_pack_refuses_other_dtypes():
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_kernels.pack(torch.randn(16, 8))


KERNELS = [
    pytest.param(kernel, id=kernel.name, marks=pytest.mark.skipif(not kernel.available(), reason=f"no {kernel.name}"))
    for kernel in (cpu_kernels.AVX2, cpu_kernels.AVX512_BF16, cpu_kernels.AMX)
]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(("n", "k"), [(1, 1), (15, 7), (16, 64), (33, 130), (100, 9), (960, 576)])
def test_each_layout_round_trips_and_pads_with_zeros(kernel, n, k):
    weight = torch.randn(n, k).to(torch.bfloat16)
    packed = kernel.pack(weight)
    assert packed.shape[0] == -(-n // kernel.block) and packed.dtype == torch.bfloat16
    assert torch.equal(kernel.unpack(packed, n, k), weight)
    assert int(packed.count_nonzero()) == int(weight.count_nonzero())  # the padding is zeros


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [*range(1, 18), 33, 70])
@pytest.mark.parametrize(("n", "k"), [(1, 1), (17, 7), (48, 64), (100, 130), (33, 577), (70, 160)])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_accumulation_matches_a_float64_reference(kernel, rows, n, k, bias):
    """Odd shapes (K and N not multiples of a block or of 2), every tile size up to 17 rows."""
    generator = torch.Generator().manual_seed(rows * 1000 + n + k)
    weight = torch.randn(n, k, generator=generator).to(torch.bfloat16)
    b = torch.randn(n, generator=generator).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, k, generator=generator)
    packed = kernel.pack(weight)
    # float32 input, float32 output: only float32 rounding of the sum (and of the bias add). The
    # AVX512-BF16 kernel multiplies bfloat16 pairs, so it first rounds a float32 input to bfloat16.
    xr = x if kernel is cpu_kernels.AVX2 else x.to(torch.bfloat16).float()
    expected = _reference(xr, weight, b)
    got = kernel.linear(x, packed, b, n)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    bound = 4 * k * 2.0**-24 * (xr.double().abs() @ weight.double().abs().T) + 2.0**-23 * expected.abs()
    assert bool(((got.double() - expected).abs() <= bound + 1e-30).all())
    # bfloat16 input: the output is the float32 sum rounded once to bfloat16 (within one unit).
    xb = x.to(torch.bfloat16)
    got_bf16 = kernel.linear(xb, packed, b, n)
    expected_bf16 = _reference(xb, weight, b)
    assert got_bf16.dtype == torch.bfloat16
    assert bool(((got_bf16.double() - expected_bf16).abs() <= 2.0**-8 * expected_bf16.abs() + 1e-6 * k).all())


@pytest.mark.parametrize("kernel", KERNELS)
def test_leading_dimensions_and_strided_inputs(kernel):
    weight = torch.randn(40, 24).to(torch.bfloat16)
    packed = kernel.pack(weight)
    x = torch.randn(2, 12, 24).to(torch.bfloat16)[:, 1:]  # strided, like hidden[:, 1:]
    got = kernel.linear(x, packed, None, 40)
    assert got.shape == (2, 11, 40)
    assert torch.equal(got, kernel.linear(x.contiguous().view(22, 24), packed, None, 40).view(2, 11, 40))
    assert kernel.linear(x[:0], packed, None, 40).shape == (0, 11, 40)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_rows_result_does_not_depend_on_the_batch(kernel):
    """Every output is one float32 sum in a fixed order, whatever the row count or the row's place:
    a row alone gives the same bits as among 7 others, in every place of every tile."""
    weight = torch.randn(72, 96).to(torch.bfloat16)
    bias = torch.randn(72).to(torch.bfloat16)
    packed = kernel.pack(weight)
    x = torch.randn(41, 96).to(torch.bfloat16)
    whole = kernel.linear(x, packed, bias, 72)
    for start, stop in [(0, 1), (5, 6), (2, 9), (3, 7), (0, 41), (37, 41), (10, 40), (0, 8), (33, 41)]:
        assert torch.equal(kernel.linear(x[start:stop], packed, bias, 72), whole[start:stop])
    for place in range(8):
        rows = torch.randn(8, 96).to(torch.bfloat16)
        rows[place] = x[4]
        assert torch.equal(kernel.linear(rows, packed, bias, 72)[place], whole[4])


def test_bad_shapes_raise():
    packed = cpu_kernels.pack(torch.randn(32, 16).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="last dimension must be 16"):
        cpu_kernels.linear(torch.randn(2, 15), packed, None, 32)
    with pytest.raises(RuntimeError, match="out_features does not match"):
        cpu_kernels.linear(torch.randn(2, 16), packed, None, 56)  # 3 blocks of 24, not 2


@pytest.mark.skipif(not cpu_kernels.AVX512_BF16.available(), reason="no AVX512-BF16 CPU or no C++ compiler")
def test_bad_shapes_raise_on_the_avx512_bf16_kernel():
    packed = cpu_kernels.pack_dot(torch.randn(32, 16).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="last dimension must be 16"):
        torch.ops.dflash2.bf16_dot_linear(torch.randn(2, 15), packed, None, 16, 32)
    with pytest.raises(RuntimeError, match="in_features does not match"):
        torch.ops.dflash2.bf16_dot_linear(torch.randn(2, 18), packed, None, 18, 32)
    with pytest.raises(RuntimeError, match="out_features does not match"):
        torch.ops.dflash2.bf16_dot_linear(torch.randn(2, 16), packed, None, 16, 33)  # 2 blocks of 32, not 1
    with pytest.raises(RuntimeError, match="bias must hold"):
        torch.ops.dflash2.bf16_dot_linear(torch.randn(2, 16), packed, torch.randn(31), 16, 32)


@pytest.mark.skipif(not cpu_kernels.AMX.available(), reason="no AMX CPU, no permission for its tiles, or no compiler")
def test_the_amx_op_checks_shapes_and_passes_torch_library_checks():
    packed = cpu_kernels.pack_dot(torch.randn(40, 64).to(torch.bfloat16))
    odd = cpu_kernels.pack_dot(torch.randn(40, 48).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.dflash2.bf16_amx_linear(torch.randn(2, 48), odd, None, 48, 40)
    with pytest.raises(RuntimeError, match="out_features does not match"):
        torch.ops.dflash2.bf16_amx_linear(torch.randn(2, 64), packed, None, 64, 65)
    x = torch.randn(3, 5, 64).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.dflash2.bf16_amx_linear.default, (x, packed, None, 64, 40))
    bias = torch.randn(40).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.dflash2.bf16_amx_linear.default, (x[0], packed, bias, 64, 40))


def test_the_op_passes_torch_library_checks():
    """Schema, shape function (fake tensors, used when graphs are traced) and dispatch agree."""
    packed = cpu_kernels.pack(torch.randn(40, 24).to(torch.bfloat16))
    x = torch.randn(3, 5, 24).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.dflash2.bf16_linear.default, (x, packed, None, 40))
    bias = torch.randn(40).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.dflash2.bf16_linear.default, (x[0], packed, bias, 40))


@pytest.mark.skipif(not cpu_kernels.AVX512_BF16.available(), reason="no AVX512-BF16 CPU or no C++ compiler")
def test_the_avx512_bf16_op_passes_torch_library_checks():
    packed = cpu_kernels.pack_dot(torch.randn(40, 24).to(torch.bfloat16))
    x = torch.randn(3, 5, 24).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.dflash2.bf16_dot_linear.default, (x, packed, None, 24, 40))
    bias = torch.randn(40).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.dflash2.bf16_dot_linear.default, (x[0], packed, bias, 24, 40))


@pytest.mark.parametrize("kernel", KERNELS)
def test_packed_linear_in_a_compiled_graph_equals_eager(kernel):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 100).to(torch.bfloat16)
    packed = PackedLinear(linear.weight, linear.bias, backend=kernel.name)
    assert packed.backend == kernel.name and packed.weight is None

    def block(x: torch.Tensor) -> torch.Tensor:
        return F.silu(packed(x)) * 2

    compiled = torch.compile(block, fullgraph=True, dynamic=False)
    x = torch.randn(3, 8, 64).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(compiled(x), block(x))
        torch.testing.assert_close(packed(x).float(), linear(x).float(), atol=0.05, rtol=0.02)


@pytest.fixture(params=KERNELS)
def kernel_backend(request, monkeypatch):
    """Each of the project's kernels as the backend (``DFLASH2_CPU_KERNEL``), whatever the CPU's default."""
    monkeypatch.setenv("DFLASH2_CPU_KERNEL", request.param.name)
    assert linear_backend(torch.device("cpu"), torch.bfloat16) == request.param.name
    return request.param.name


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
            modules += [runner._target_forward.module, runner.drafting.forward.module]
        for module in modules:
            linears = [m for m in module.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))]
            assert linears and all(isinstance(m, PackedLinear) and m.backend == kernel_backend for m in linears)
        prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1]]
        runner.prefill([0, 1], prompts, [0, 0])
        rows = [[5, 3, 5, 8], [8, 2, 8, 1, 8, 2, 8, 4]]
        logits, features = runner.verify([0, 1], [TokenTree.chain(row) for row in rows], [8, 3])
        assert features is not None
        results.append([(logits[r, : len(row)], features[r, : len(row)]) for r, row in enumerate(rows)])
    for (eager_logits, eager_features), (fast_logits, fast_features) in zip(*results):
        scale = float(eager_logits.abs().max())
        torch.testing.assert_close(fast_logits, eager_logits, atol=0.03 * scale, rtol=0)
        torch.testing.assert_close(fast_features.float(), eager_features.float(), atol=0.1, rtol=0.05)


def test_auto_dtype_follows_the_kernel_for_the_engine_not_for_training(monkeypatch):
    """``--dtype auto``: bfloat16 for the engine where the AVX2 kernel runs (it packs the linears),
    float32 for ``train`` / ``eval``, which run the target's plain ``nn.Linear`` layers; bfloat16 for
    both where the CPU has native bfloat16 (PyTorch's own ``nn.Linear`` runs it through oneDNN)."""
    from dflash2 import cli
    from dflash2.config import EngineConfig

    monkeypatch.setenv("DFLASH2_CPU_KERNEL", "avx2")
    monkeypatch.setattr(dflash2.runner.model_setup, "cpu_has_native_bf16", lambda: False)
    auto = EngineConfig(device="cpu")
    assert dflash2.runner.model_setup.resolve_dtype(auto) == torch.bfloat16
    assert cli._offline_dtype(auto) == torch.float32
    assert cli._offline_dtype(EngineConfig(device="cpu", dtype="bfloat16")) == torch.bfloat16
    monkeypatch.setenv("DFLASH2_CPU_KERNEL", "onednn")
    monkeypatch.setattr(dflash2.models.layers, "onednn_bf16", lambda device, dtype: True)
    monkeypatch.setattr(dflash2.runner.model_setup, "cpu_has_native_bf16", lambda: True)
    assert cli._offline_dtype(EngineConfig(device="cpu")) == torch.bfloat16
