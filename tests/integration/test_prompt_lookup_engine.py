"""Prompt lookup beside the drafter: the policy's choice, exact greedy output, the target's distribution."""

from __future__ import annotations

import pytest

from dflash2 import LLM, SamplingParams
from dflash2.config import DEFAULT_PROMPT_LOOKUP_MAX, EngineConfig
from dflash2.engine import Engine
from dflash2.spec.adaptive import CostModel
from tests.integration.test_engine_sampling import SAMPLING_CASES, VOCAB, _chi_square_pvalue, _exact_joint
from tests.tiny import tiny_drafter, tiny_engine, tiny_target

# Repeats inside the prompts, and the loops a random tiny model falls into, give lookup matches.
PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [7, 8, 9, 7, 8], [10] * 20, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


class FixedCosts(CostModel):
    """Every verify forward costs 10 ms, whatever its rows and width; drafting ``draft`` seconds.
    Timings from steps are ignored, so the choice depends on acceptance alone."""

    def __init__(self, max_rows: int, widths: tuple[int, ...], draft: float) -> None:
        super().__init__(max_rows, widths)
        for rows in range(1, max_rows + 1):
            for width in widths:
                self.verify[(rows, width)] = 0.010
                if width > 1:
                    self.draft[(rows, width)] = draft

    def observe(self, rows, width, verify_seconds, draft_seconds) -> None:
        pass


def lookup_engine(target, drafter, draft_cost: float, **kwargs):
    engine = tiny_engine(target, drafter, drafter.config.block_size, speculative_adaptive=True, **kwargs)
    engine.policy.cost_model = FixedCosts(engine.config.max_num_seqs, engine.cost_model.widths, draft_cost)
    return engine


def decode_steps(llm, prompts, params):
    steps = []
    outputs = llm.generate(prompts, params, on_step=lambda r: steps.append(r.stats))
    return outputs, [s for s in steps if s.num_decode_rows]


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab_size=16, seed=5)


def test_greedy_with_lookup_and_drafter_steps_equals_autoregressive(target):
    """Drafting at 2 ms against lookup's free drafts: the policy mixes lookup steps, drafted steps and
    plain ones, and every row's text is the target's own, in a batch and alone (float32)."""
    engine = lookup_engine(target, tiny_drafter(target, 2, 8), draft_cost=0.002, prompt_lookup_min=1)
    assert engine.prompt_lookup_max == DEFAULT_PROMPT_LOOKUP_MAX
    reference = LLM.from_engine(tiny_engine(target, None)).generate(PROMPTS, GREEDY)
    llm = LLM.from_engine(engine)
    batch, steps = decode_steps(llm, PROMPTS, GREEDY)
    assert [b.token_ids for b in batch] == [r.token_ids for r in reference]
    alone, alone_steps = decode_steps(llm, PROMPTS[1], GREEDY)
    assert alone[0].token_ids == reference[1].token_ids
    steps += alone_steps
    lookup = [s for s in steps if s.num_lookup_drafts]
    drafted = [s for s in steps if not s.num_lookup_drafts and s.verify_width > 1]
    assert lookup and drafted, (len(lookup), len(drafted))
    assert all(s.num_lookup_drafts == s.num_decode_rows and s.draft_time == 0.0 for s in lookup)
    assert sum(s.num_accepted_tokens for s in lookup) > 0  # the lookup drafts were accepted, not just tried


def test_without_a_match_for_every_row_the_step_drafts(target):
    """Lookup steps need a draft for every row: a batch with a row that has no match drafts."""
    engine = lookup_engine(target, tiny_drafter(target, 2, 8), draft_cost=0.002, prompt_lookup_min=2)
    # Every "9 t" occurred in the first prompt, so its first decode step matches whatever t the prefill
    # sampled; "7 t" never occurred in the second.
    prompts = [[x for t in range(16) for x in (9, t)] + [9], [5, 6, 7]]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    _, steps = decode_steps(LLM.from_engine(engine), prompts, params)
    assert steps[0].num_decode_rows == 2 and steps[0].num_lookup_drafts == 0 and steps[0].verify_width > 1
    _, steps = decode_steps(LLM.from_engine(engine), prompts[:1], params)
    assert steps[0].num_lookup_drafts == 1  # alone, the first prompt looks up


def test_lookup_sampling_matches_target_distribution():
    """Chi-square over the 3 tokens one verify step decides, as ``test_engine_sampling`` does, with every
    decode step a lookup step: a deterministic (one-hot) draft keeps the target's distribution."""
    target = tiny_target(vocab_size=VOCAB, seed=7)
    drafter = tiny_drafter(target, 2, block_size=4)
    prompt = [1, 5, 2, 7, 0, 3, 6, 4, 2, 5]  # every token occurs, so a 1-gram always matches
    engine = lookup_engine(target, drafter, draft_cost=1.0, max_num_seqs=64, prompt_lookup_min=1)
    base = SAMPLING_CASES["temperature"]  # unseeded: a seeded request never looks up
    outputs, steps = decode_steps(LLM.from_engine(engine), [prompt] * 3000, [base] * 3000)
    # Every step that verifies drafts takes them from lookup (the last steps of a row may have no room).
    assert steps[0].num_lookup_drafts == steps[0].num_decode_rows == 64
    assert all(s.num_lookup_drafts for s in steps if s.verify_width > 1)
    assert sum(o.num_accepted_tokens for o in outputs) > 0
    exact4 = _exact_joint(target, base, 4, prompt=prompt)
    exact: dict[tuple[int, ...], float] = {}
    for k, p in exact4.items():
        exact[k[1:]] = exact.get(k[1:], 0.0) + p
    assert _chi_square_pvalue([tuple(o.token_ids[1:]) for o in outputs], exact) > 1e-3


def test_a_seeded_sampled_request_never_looks_up(target):
    engine = lookup_engine(target, tiny_drafter(target, 2, 8), draft_cost=1.0, prompt_lookup_min=1)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=3)
    _, steps = decode_steps(LLM.from_engine(engine), PROMPTS, [GREEDY, seeded, GREEDY, GREEDY])
    # While the seeded request runs (12 tokens), the batch's steps never look up; after it, they do.
    assert not any(s.num_lookup_drafts for s in steps if s.num_decode_rows == 4)
    assert any(s.num_lookup_drafts for s in steps if s.num_decode_rows == 3)


def test_default_on_only_with_adaptive_speculation(target):
    drafter = tiny_drafter(target, 2, 8)
    assert tiny_engine(target, drafter, 8, speculative_adaptive=True).prompt_lookup_max == DEFAULT_PROMPT_LOOKUP_MAX
    assert tiny_engine(target, drafter, 8, speculative_adaptive=True, prompt_lookup_min=6).prompt_lookup_max == 6
    assert tiny_engine(target, drafter, 8).prompt_lookup_max == 0  # full blocks: no policy to choose
    assert tiny_engine(target, None, speculative_adaptive=True).prompt_lookup_max == 0
    assert tiny_engine(target, drafter, 8, speculative_adaptive=True, prompt_lookup_max=0).prompt_lookup_max == 0
    request = tiny_engine(target, drafter, 8, speculative_adaptive=True, prompt_lookup_max=0)
    request.add_request([1, 2, 3], GREEDY)
    assert request._inbox[0][1].lookup is None


def test_asked_for_where_it_cannot_run_is_an_error(target):
    with pytest.raises(ValueError, match="needs adaptive speculation"):
        EngineConfig(prompt_lookup_max=4, speculative_adaptive=False)
    with pytest.raises(ValueError, match="block size 1 decodes without one"):
        EngineConfig(block_size=1, prompt_lookup_max=4)
    config = EngineConfig(speculative_adaptive=True, prompt_lookup_max=4, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="this engine does not speculate"):
        Engine(config, target, None, None)  # no drafter: decided before anything is compiled
    with pytest.raises(ValueError, match="at least prompt_lookup_min"):
        EngineConfig(prompt_lookup_max=2, prompt_lookup_min=3)
    with pytest.raises(ValueError, match="--prompt-lookup-min"):
        EngineConfig(prompt_lookup_min=0)
    with pytest.raises(ValueError, match="--prompt-lookup-max"):
        EngineConfig(prompt_lookup_max=-1)
    with pytest.raises(ValueError, match=r"0 \(off\) … 16"):
        EngineConfig(prompt_lookup_max=17)
    with pytest.raises(ValueError, match="needs adaptive speculation"):
        EngineConfig(prompt_lookup_min=3, speculative_adaptive=False)  # a bound alone asks for lookup too
    with pytest.raises(ValueError, match="turns lookup off"):
        EngineConfig(prompt_lookup_max=0, prompt_lookup_min=3)
    assert EngineConfig(prompt_lookup_min=6).prompt_lookup_bounds == (6, 6)
    assert EngineConfig().prompt_lookup_bounds == (4, 2) and not EngineConfig().prompt_lookup_requested
    assert EngineConfig(speculative_adaptive=False, prompt_lookup_max=0).prompt_lookup_bounds[0] == 0
