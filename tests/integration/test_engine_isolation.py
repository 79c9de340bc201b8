"""One request's failure inside an engine step ends that request alone; its neighbours go on unchanged."""

from __future__ import annotations

import pytest

from dflash2 import LLM, SamplingParams
from tests.tiny import tiny_drafter, tiny_engine, tiny_target

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10] * 12]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
SAMPLED = SamplingParams(max_tokens=24, temperature=0.9, seed=7)


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


def _engine(target, block_size):
    drafter = tiny_drafter(target, 2, block_size) if block_size > 1 else None
    return tiny_engine(target, drafter, block_size, max_num_seqs=4)


def _run(engine, break_after_steps: int | None):
    """The three neighbours plus a request whose ``top_k`` is corrupted after validation (the
    engine's own check would refuse it), so that it raises inside the step."""
    ids = [engine.add_request(p, params) for p, params in zip(PROMPTS, [GREEDY, SAMPLED, GREEDY])]
    bad = SamplingParams(max_tokens=24, temperature=1.0, top_k=5, seed=3)
    bad_id = engine.add_request([4, 4, 4], bad)
    results: dict[str, list[int]] = {i: [] for i in [*ids, bad_id]}
    errors: dict[str, str | None] = {}
    steps = 0
    while engine.has_unfinished_requests():
        if steps == (break_after_steps or 0):
            object.__setattr__(bad, "top_k", 10**6)  # torch.topk fails: k > vocabulary
        result = engine.step()
        steps += 1
        for out in result.outputs:
            results[out.request_id] += out.new_token_ids
            if out.finished:
                errors[out.request_id] = out.error
    return [results[i] for i in ids], [errors[i] for i in ids], errors[bad_id]


@pytest.mark.parametrize("block_size", [1, 8])
@pytest.mark.parametrize("break_after_steps", [0, 2], ids=["in-prefill", "in-decode"])
def test_a_failing_request_ends_alone(target, block_size, break_after_steps):
    reference = LLM.from_engine(_engine(target, block_size)).generate(PROMPTS, [GREEDY, SAMPLED, GREEDY])
    outputs, errors, bad_error = _run(_engine(target, block_size), break_after_steps)
    assert bad_error is not None and "RuntimeError" in bad_error
    assert errors == [None, None, None]
    assert outputs == [c.token_ids for c in reference]


def test_engine_refuses_top_k_above_the_vocabulary(target):
    engine = _engine(target, 8)
    with pytest.raises(ValueError, match="top_k"):
        engine.add_request([1, 2], SamplingParams(top_k=target.config.vocab_size + 1))
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request([1, 2], SamplingParams(logit_bias={10**6: 1.0}))
