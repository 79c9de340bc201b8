"""Pre-packed oneDNN linears (CPU, bfloat16; ``DFLASH2_CPU_KERNEL=onednn``): same outputs as ``nn.Linear``,
same tokens from the engine."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dflash2.runner.compile
import dflash2.runner.model_runner
from dflash2 import LLM, SamplingParams
from dflash2.config import EngineConfig
from dflash2.engine import Engine
from dflash2.models.layers import PackedLinear, can_prepack, onednn_bf16
from dflash2.models.loader import save_drafter
from dflash2.train.data import TokenDataset
from dflash2.train.evaluate import teacher_forced
from tests.tiny import tiny_drafter, tiny_target

pytestmark = pytest.mark.skipif(
    not onednn_bf16(torch.device("cpu"), torch.bfloat16), reason="this CPU / PyTorch build has no oneDNN bfloat16"
)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12, 13], [3, 1, 4, 1, 5, 9, 2, 6]]


@pytest.fixture(autouse=True)
def onednn_backend(monkeypatch):
    """oneDNN's pre-packed linears, also where the CPU's default is the project's AVX512-BF16 kernel."""
    monkeypatch.setenv("DFLASH2_CPU_KERNEL", "onednn")


def test_can_prepack_only_cpu_bfloat16():
    assert not can_prepack(torch.device("cpu"), torch.float32)
    assert not can_prepack(torch.device("meta"), torch.bfloat16)


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_linear_bit_for_bit(bias):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(linear.weight, linear.bias)
    assert packed.weight is None and (packed.in_features, packed.out_features) == (64, 96)
    for x in (
        torch.randn(1, 64),
        torch.randn(3, 9, 64),
        torch.randn(2, 12, 64)[:, 1:],  # strided, like hidden[:, 1:]
        torch.randn(80, 1, 64),
    ):
        x = x.to(torch.bfloat16)
        with torch.inference_mode():
            assert torch.equal(packed(x), linear(x))


def _bf16_models(seed: int):
    target = tiny_target("qwen3", seed=seed).to(torch.bfloat16)
    drafter = tiny_drafter(target, version=2, block_size=8).to(torch.bfloat16)
    drafter.set_draft_vocab(torch.arange(0, 80))
    drafter.bind_target(*target.embedding_weights())
    return target, drafter


def _decode(target, drafter, block_size: int) -> list[list[int]]:
    # Full blocks: adaptive widths follow measured timings, and in bfloat16 a different block width can
    # break a near-tie differently, so the two runs would not be comparable.
    config = EngineConfig(
        block_size=block_size,
        max_num_seqs=4,
        max_model_len=128,
        device="cpu",
        dtype="bfloat16",
        enforce_eager=True,
        speculative_adaptive=False,
    )
    llm = LLM.from_engine(Engine(config, target, None, drafter if block_size > 1 else None))
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0))
    sampled = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=1.0, seed=7))
    return [c.token_ids for c in greedy + sampled]


@pytest.mark.parametrize("block_size", [1, 8])
def test_prepacked_engine_decodes_the_same_tokens(monkeypatch, block_size):
    with monkeypatch.context() as patch:
        patch.setattr(dflash2.runner.compile, "can_prepack", lambda device, dtype: False)
        patch.setattr(dflash2.runner.compile, "linear_backend", lambda device, dtype: None)
        patch.setattr(dflash2.runner.model_runner, "linear_backend", lambda device, dtype: None)
        target, drafter = _bf16_models(seed=3)
        reference = _decode(target, drafter, block_size)
        assert isinstance(target.layers[0].mlp.gate_proj, nn.Linear)
    target, drafter = _bf16_models(seed=3)
    assert _decode(target, drafter, block_size) == reference
    assert isinstance(target.layers[0].mlp.gate_proj, PackedLinear)
    assert isinstance(target.lm_head, PackedLinear)
    if block_size > 1:
        assert isinstance(drafter.layers[0].mlp.gate_proj, PackedLinear)
        assert drafter._packed_draft_head is not None
        assert isinstance(drafter.candidate_selector.hidden_projection, nn.Linear)  # the walk reads its weight


def test_prepack_keeps_the_shared_lm_head_and_is_idempotent(tmp_path):
    target, drafter = _bf16_models(seed=4)
    embed, head = target.embedding_weights()
    num_linears = sum(isinstance(m, nn.Linear) for m in target.modules())
    assert target.prepack() == num_linears
    assert target.prepack() == 0
    assert target.embedding_weights()[0] is embed and target.embedding_weights()[1] is head
    assert drafter.prepack() > 0
    assert drafter.prepack() == 0
    with pytest.raises(RuntimeError, match="save it before prepack"):
        save_drafter(drafter, tmp_path / "drafter")


def test_teacher_forced_eval_runs_on_a_prepacked_drafter():
    """``dflash2 eval`` scores the drafter the engine packed: same recall and τ as unpacked."""
    generator = torch.Generator().manual_seed(5)
    lengths = [40, 33, 51]
    tokens = torch.randint(0, 90, (sum(lengths),), generator=generator, dtype=torch.int32)
    loss_mask = torch.ones(sum(lengths), dtype=torch.uint8)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    for start in offsets[:-1].tolist():
        loss_mask[start : start + 8] = 0  # a prompt of 8 tokens
    dataset = TokenDataset(tokens, loss_mask, offsets, torch.ones(len(lengths), dtype=torch.bool))
    features = torch.randn(sum(lengths), 128, generator=generator).to(torch.bfloat16)
    results = []
    for pack in (False, True):
        _, drafter = _bf16_models(seed=6)
        if pack:
            assert drafter.prepack() > 0
        forced = teacher_forced(drafter, dataset, features, anchors_per_sequence=16)
        results.append((forced.recall, forced.tau, forced.num_blocks))
    assert results[0] == results[1] and results[0][2] > 0
