"""Greedy speculative decoding equals greedy autoregressive decoding token for token."""

from __future__ import annotations

import math

import pytest
import torch

from dflash2 import LLM, SamplingParams
from tests.tiny import oracle_drafter, tiny_drafter, tiny_engine, tiny_target

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10] * 20, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target(request):
    return tiny_target(request.param)


@pytest.fixture(scope="module")
def reference(target):
    ar = LLM.from_engine(tiny_engine(target, None))
    return [c.token_ids for c in ar.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("block_size", [2, 8, 16])
@pytest.mark.parametrize("batch", [1, 4])
def test_random_drafter_matches_autoregressive(target, reference, version, block_size, batch):
    llm = LLM.from_engine(
        tiny_engine(target, tiny_drafter(target, version, block_size), block_size, max_num_seqs=batch)
    )
    outputs = llm.generate(PROMPTS[:batch] if batch == 1 else PROMPTS, GREEDY)
    assert [c.token_ids for c in outputs] == reference[: len(outputs)]


@pytest.mark.parametrize("block_size", [2, 8, 16])
@pytest.mark.parametrize("error_rate", [0.0, 0.3])
def test_high_acceptance_drafter_matches_autoregressive(target, reference, block_size, error_rate):
    # Slots are assigned in admission order, so slot i holds prompt i.
    refs = {i: PROMPTS[i] + reference[i] for i in range(len(PROMPTS))}
    drafter = oracle_drafter(target, refs, block_size, error_rate)
    llm = LLM.from_engine(tiny_engine(target, drafter, block_size, max_num_seqs=4))
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in outputs] == reference
    tau = sum(c.mean_acceptance_length for c in outputs) / len(outputs)
    assert tau > (1.5 if block_size == 2 else 2.0 if error_rate else 4.0)  # the accept path really ran
    if error_rate == 0.0:  # every verify step but the last commits a full block (the prefill gives token 1)
        assert all(c.num_verify_steps == math.ceil((len(c.token_ids) - 1) / block_size) for c in outputs)


def test_selector_off_matches_autoregressive(target, reference):
    llm = LLM.from_engine(tiny_engine(target, tiny_drafter(target, 2, 8), 8, use_selector=False))
    assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY)] == reference


def test_step_stats_are_consistent(target):
    llm = LLM.from_engine(tiny_engine(target, tiny_drafter(target, 2, 8), 8))
    for result in llm.stream(PROMPTS, GREEDY):
        s = result.stats
        assert len(s.accepted_per_position) in (0, 7)
        assert sum(s.accepted_per_position) == s.num_accepted_tokens <= s.num_draft_tokens
        assert s.num_generated_tokens == sum(len(o.new_token_ids) for o in result.outputs)
        assert s.num_running + s.num_waiting <= len(PROMPTS)


@pytest.mark.parametrize("version", [1, 2])
def test_draft_vocabulary_matches_autoregressive(target, reference, version):
    # A drafter restricted to half the vocabulary still decodes exactly what the target alone does.
    drafter = tiny_drafter(target, version, 8)
    drafter.set_draft_vocab(torch.arange(0, target.config.vocab_size, 2))
    llm = LLM.from_engine(tiny_engine(target, drafter, 8))
    assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY)] == reference


def test_a_limited_draft_vocabulary_matches_autoregressive(target, reference):
    # Cut to its 12 most frequent tokens (--speculative-draft-vocab-size): drafts change, output does not.
    drafter = tiny_drafter(target, 2, 8)
    ids = torch.arange(0, target.config.vocab_size, 2)
    drafter.set_draft_vocab(ids, torch.randint(0, 100, ids.shape, generator=torch.Generator().manual_seed(0)))
    drafter.limit_draft_vocab(12)
    assert len(drafter.draft_vocab) == 12
    llm = LLM.from_engine(tiny_engine(target, drafter, 8))
    assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY)] == reference
