"""Stops inside an accepted block, min_tokens, and aborts in the middle of a batch."""

from __future__ import annotations

import pytest

from dflash2 import LLM, SamplingParams
from tests.tiny import oracle_drafter, tiny_drafter, tiny_engine, tiny_target

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10] * 6, [3, 1, 4, 1, 5]]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab_size=96, seed=11)


@pytest.fixture(scope="module")
def reference(target):
    return [c.token_ids for c in LLM.from_engine(tiny_engine(target, None)).generate(PROMPTS, GREEDY)]


def _oracle_llm(target, reference, eos=(), block_size=8, error_rate=0.0):
    refs = {i: PROMPTS[i] + reference[i] for i in range(len(PROMPTS))}
    return LLM.from_engine(
        tiny_engine(target, oracle_drafter(target, refs, block_size, error_rate), block_size, eos=eos)
    )


def _new_token_at(ref: list[int], min_index: int) -> tuple[int, int]:
    """A token whose first occurrence in ``ref`` is at index ≥ min_index: (index, token)."""
    for i in range(min_index, len(ref)):
        if ref[i] not in ref[:i]:
            return i, ref[i]
    raise AssertionError("reference too repetitive")


def test_max_tokens_inside_a_block(target, reference):
    llm = _oracle_llm(target, reference)
    for max_tokens in (1, 2, 5, 11):
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        for out, ref in zip(outs, reference):
            assert out.token_ids == ref[:max_tokens]
            assert out.finish_reason == "length"


def test_eos_inside_a_block_truncates_and_counts(target, reference):
    index, eos = _new_token_at(reference[0], 3)
    llm = _oracle_llm(target, reference, eos=(eos,))
    results = []
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=32, temperature=0.0), on_step=results.append)[0]
    assert out.token_ids == reference[0][: index + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    # Counters only include committed tokens: accepted ≤ emitted − verify steps (one bonus-or-correction each).
    assert out.num_accepted_tokens <= len(out.token_ids) - 1
    assert sum(r.stats.num_generated_tokens for r in results) == len(out.token_ids)
    assert sum(sum(r.stats.acceptance_lengths) for r in results) == len(out.token_ids) - 1  # minus prefill token
    ignored = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))[0]
    assert ignored.token_ids == reference[0]


def test_stop_token_id_inside_a_block(target, reference):
    index, stop_id = _new_token_at(reference[1], 4)
    llm = _oracle_llm(target, reference)
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=32, temperature=0.0, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == reference[1][: index + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_min_tokens_masks_eos(target, reference):
    index, eos = _new_token_at(reference[0], 1)
    llm = _oracle_llm(target, reference, eos=(eos,), error_rate=0.2)
    min_tokens = index + 4
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=32, temperature=0.0, min_tokens=min_tokens))[0]
    assert eos not in out.token_ids[:min_tokens]
    assert len(out.token_ids) >= min_tokens
    assert out.token_ids[:index] == reference[0][:index]
    # the same under sampling: EOS never appears before min_tokens
    for seed in range(5):
        sampled = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=20, seed=seed, min_tokens=10))[0]
        assert eos not in sampled.token_ids[:10]


def test_logprobs_align_with_tokens(target, reference):
    llm = _oracle_llm(target, reference, error_rate=0.3)
    out = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=20, temperature=0.0, logprobs=3, ignore_eos=True))[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 20
    for lp, token in zip(out.logprobs, out.token_ids):
        assert lp.token_id == token and len(lp.top) == 3
        assert lp.top[0][0] == token  # greedy: the chosen token is the target's best
        assert lp.logprob == pytest.approx(lp.top[0][1])


def test_abort_in_the_middle_of_a_batch(target, reference):
    engine = tiny_engine(target, tiny_drafter(target, 2, 8), 8, max_num_seqs=4)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    finished: dict[str, str] = {}
    for _ in range(3):
        for out in engine.step().outputs:
            tokens[out.request_id] += out.new_token_ids
    engine.abort(ids[1])
    result = engine.step()
    aborted = [o for o in result.outputs if o.request_id == ids[1]]
    assert aborted and aborted[0].finished and aborted[0].finish_reason == "abort"
    assert engine.scheduler.num_running == 3 and len(engine.scheduler.free_slots) == 1
    for out in result.outputs:
        tokens[out.request_id] += out.new_token_ids
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finished[out.request_id] = out.finish_reason or ""
    for i, rid in enumerate(ids):
        if i != 1:
            assert tokens[rid] == reference[i] and finished[rid] == "length"
    assert engine.scheduler.num_running == 0 and sorted(engine.scheduler.free_slots) == [0, 1, 2, 3]


def test_requests_join_between_steps(target, reference):
    engine = tiny_engine(target, tiny_drafter(target, 2, 8), 8, max_num_seqs=2)
    llm = LLM.from_engine(engine)
    # 4 prompts, 2 slots: the last two join when the first ones finish.
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference


def test_bad_requests_are_rejected_at_the_boundary(target):
    engine = tiny_engine(target, None)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([1, 500], GREEDY)
    with pytest.raises(ValueError, match="maximum context length"):
        engine.add_request([1] * 250, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="stop strings"):
        engine.add_request([1], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
