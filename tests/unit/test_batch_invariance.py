"""Batch-invariant kernels (deterministic mode): each token's result depends only on its own inputs."""

from __future__ import annotations

import threading

import pytest
import torch

import dflash2.config
import dflash2.engine
import dflash2.runner.model_runner
from dflash2.models import cpu_kernels, layers
from dflash2.models.layers import (
    PackedLinear,
    attention,
    batch_invariant,
    batch_invariant_enabled,
    invariant_kernel_available,
    onednn_bf16,
)
from dflash2.spec.selector import SelectorWeights, lattice_scores
from tests.tiny import tiny_target

needs_onednn_bf16 = pytest.mark.skipif(
    not onednn_bf16(torch.device("cpu"), torch.bfloat16), reason="this CPU / PyTorch build has no oneDNN bfloat16"
)
needs_invariant_kernel = pytest.mark.skipif(
    not invariant_kernel_available(), reason="no AVX512-BF16 kernel library here (deterministic mode's attention)"
)
HEAD_DIM, KV_HEADS, GROUP = 64, 3, 3


def _mask(starts: list[int], width: int, num_keys: int) -> torch.Tensor:
    """Causal ``[R, 1, L, T]``: query i of row r sits at position starts[r] + i."""
    positions = torch.tensor(starts)[:, None] + torch.arange(width)[None]
    return (torch.arange(num_keys)[None, None, :] <= positions[:, :, None])[:, None]


@pytest.fixture
def kv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shape = (4, KV_HEADS, 400, HEAD_DIM)
    keys = torch.randn(shape, generator=generator).to(torch.bfloat16)
    values = torch.randn(shape, generator=generator).to(torch.bfloat16)
    queries = torch.randn(4, KV_HEADS * GROUP, 16, HEAD_DIM, generator=generator).to(torch.bfloat16)
    return queries, keys, values


def test_invariant_attention_is_attention(kv):
    queries, keys, values = kv
    q, k, v = queries[:2, :, :8].float(), keys[:2, :, :150].float(), values[:2, :, :150].float()
    mask = _mask([100, 130], 8, 150)
    expected = attention(q, k, v, mask)
    assert torch.allclose(layers.invariant_attention(q, k, v, mask), expected, atol=1e-5, rtol=1e-5)


@needs_invariant_kernel
def test_invariant_attention_in_bfloat16_is_attention(kv):
    queries, keys, values = kv
    q, k, v = queries[:2, :, :8], keys[:2, :, :150], values[:2, :, :150]
    mask = _mask([100, 130], 8, 150)
    expected = attention(q.float(), k.float(), v.float(), mask)
    out = layers.invariant_attention(q, k, v, mask)
    assert out.dtype == torch.bfloat16 and out.shape == expected.shape
    assert torch.allclose(out.float(), expected, atol=1e-2, rtol=1e-2)


@needs_invariant_kernel
def test_invariant_attention_ignores_neighbours_offsets_and_key_length(kv):
    """Query (row 2, position 300) computed alone with exactly its keys, then: at every offset of a
    block of 3, 8 and 16 queries (the widths of a verify block and a token tree; 9 to 48 rows of one
    query head group), among 4 rows, with 1–100 masked keys after it."""
    queries, keys, values = kv
    query = queries[2, :, 0]
    own_keys, own_values = keys[2:3, :, :301], values[2:3, :, :301]
    alone = layers.invariant_attention(query[None, :, None], own_keys, own_values, _mask([300], 1, 301))
    seen = 0
    for width in (3, 8, 16):
        for offset in range(width):
            q = queries.clone()[:, :, :width]
            q[2, :, offset] = query
            starts = [250, 310, 300 - offset, 90]
            for num_keys in (300 - offset + width, 320, 364, 400):
                mask = _mask(starts, width, num_keys)
                out = layers.invariant_attention(q, keys[:, :, :num_keys], values[:, :, :num_keys], mask)
                assert torch.equal(out[2, offset], alone[0, 0]), (width, offset, num_keys)
                seen += 1
    assert seen == 4 * (3 + 8 + 16)


def test_invariant_attention_refuses_what_its_kernel_cannot_take():
    if not invariant_kernel_available():
        pytest.skip("no AVX512-BF16 kernel library here")
    q = torch.zeros(1, 3, 1, 40, dtype=torch.bfloat16)  # head dim not a multiple of 16
    k = torch.zeros(1, 1, 4, 40, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="head dim must be a multiple of 16"):
        layers.invariant_attention(q, k, k, torch.ones(1, 1, 1, 4, dtype=torch.bool))


@needs_onednn_bf16
@pytest.mark.parametrize(
    "backend",
    [
        "onednn",
        pytest.param(
            "avx512bf16",
            marks=pytest.mark.skipif(not cpu_kernels.AVX512_BF16.available(), reason="no AVX512-BF16 kernel here"),
        ),
    ],
)
def test_packed_linear_row_is_the_same_in_any_batch_inside_batch_invariant(backend):
    generator = torch.Generator().manual_seed(1)
    weight = (torch.randn(576, 1536, generator=generator) * 0.05).to(torch.bfloat16)  # a down-projection's shape
    linear = PackedLinear(weight, backend=backend)
    x = torch.randn(64, 1536, generator=generator).to(torch.bfloat16)
    with torch.inference_mode(), batch_invariant():
        alone = [linear(x[i : i + 1]) for i in range(64)]
        for rows in (2, 3, 8, 64):
            batch = linear(x[:rows])
            for i in range(rows):
                assert torch.equal(batch[i : i + 1], alone[i]), (rows, i)
        assert linear(x[3]).shape == (576,) and torch.equal(linear(x[3]), alone[3][0])  # 1-D input


def test_batch_invariant_is_scoped_to_the_block_and_the_thread():
    assert not batch_invariant_enabled()
    seen_elsewhere = []
    with batch_invariant():
        assert batch_invariant_enabled()
        with batch_invariant(False):
            assert not batch_invariant_enabled()
        assert batch_invariant_enabled()
        thread = threading.Thread(target=lambda: seen_elsewhere.append(batch_invariant_enabled()))
        thread.start()
        thread.join()
    assert not batch_invariant_enabled() and seen_elsewhere == [False]


def test_lattice_scores_row_by_row_equal_the_batched_scores():
    generator = torch.Generator().manual_seed(2)
    rows, slots, k, hidden_size, rank, vocab = 5, 7, 4, 32, 8, 50
    weights = SelectorWeights(
        hidden_projection=torch.randn(rank, hidden_size, generator=generator),
        predecessor_codebook=torch.randn(vocab, rank, generator=generator),
        successor_codebook=torch.randn(vocab, rank, generator=generator),
    )
    hidden = torch.randn(rows, slots, hidden_size, generator=generator)
    anchors = torch.randint(0, vocab, (rows,), generator=generator)
    candidates = torch.randint(0, vocab, (rows, slots, k), generator=generator)
    unary = torch.randn(rows, slots, k, generator=generator)
    batched = lattice_scores(hidden, anchors, candidates, unary, weights)
    with batch_invariant():
        invariant = lattice_scores(hidden, anchors, candidates, unary, weights)
        row = lattice_scores(hidden[3:4], anchors[3:4], candidates[3:4], unary[3:4], weights)
    assert torch.allclose(invariant, batched, atol=1e-5)
    assert torch.equal(invariant[3:4], row)


def test_refused_on_the_avx2_kernel_with_the_reason(monkeypatch):
    # bfloat16 on a CPU without AVX512-BF16 / AMX runs on the project's kernel: say so, not "runs bfloat16".
    monkeypatch.setattr(dflash2.runner.model_runner, "invariant_kernel_available", lambda: False)
    monkeypatch.setattr(cpu_kernels.CpuKernel, "supported_cpu", lambda self: False)
    target = tiny_target("qwen3", seed=0).to(torch.bfloat16)
    config = dflash2.config.EngineConfig(
        block_size=1, max_num_seqs=1, max_model_len=64, device="cpu", dtype="bfloat16", deterministic=True
    )
    with pytest.raises(ValueError, match="this CPU has neither, so bfloat16 runs on the project's AVX2 kernel"):
        dflash2.engine.Engine(config, target, None, None)
