"""Adaptive speculation in the engine: the chosen width follows the cost model, outputs stay exact."""

from __future__ import annotations

import time

from dflash2 import LLM, SamplingParams
from dflash2.spec.adaptive import CostModel
from tests.tiny import tiny_drafter, tiny_engine, tiny_target

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11]]


class FixedCosts(CostModel):
    """A synthetic machine: launch-bound for one row (every width costs the same), compute-bound
    beyond (verify time grows with rows × width); timings from steps are ignored."""

    def __init__(self, max_rows: int, widths: tuple[int, ...]) -> None:
        super().__init__(max_rows, widths)
        for rows in range(1, max_rows + 1):
            for width in widths:
                self.draft[(rows, width)] = 0.001
                self.verify[(rows, width)] = 0.010 + (0.0 if rows == 1 else 0.010 * rows * width)

    def observe(self, rows: int, width: int, verify_seconds: float, draft_seconds: float) -> None:
        pass


def engines(**kwargs):
    target = tiny_target(vocab_size=12, seed=11)  # a small vocabulary: an untrained drafter gets some accepted
    drafter = tiny_drafter(target, 2, block_size=8)
    adaptive = tiny_engine(target, drafter, 8, max_num_seqs=4, speculative_adaptive=True, **kwargs)
    fixed = tiny_engine(target, drafter, 8, max_num_seqs=4, speculative_adaptive=False, **kwargs)
    ar = tiny_engine(target, None, max_num_seqs=4, **kwargs)
    return adaptive, fixed, ar


def test_start_up_measures_every_width_and_the_drafter():
    adaptive, fixed, _ = engines()
    assert fixed.cost_model is None
    model = adaptive.cost_model
    assert model.widths == tuple(range(1, 9))
    assert all(model.verify[(rows, w)] > 0 for rows in range(1, 5) for w in model.widths)
    assert all(model.draft[(rows, w)] > 0 for rows in range(1, 5) for w in model.widths if w > 1)
    assert (1, 1) not in model.draft  # width 1 drafts nothing


def test_start_up_drafting_cost_includes_the_selector(monkeypatch):
    """A step's drafting cost is the drafter's block and the selector's walk; the start-up table
    measures both (a selector made 20 ms slower shows in every row count's entry)."""
    import dflash2.runner.draft_runner as draft_runner

    propose = draft_runner.draft_path_of

    def slow_propose(*args, **kwargs):
        time.sleep(0.020)
        return propose(*args, **kwargs)

    monkeypatch.setattr(draft_runner, "draft_path_of", slow_propose)
    adaptive, _, _ = engines()
    model = adaptive.cost_model
    assert all(model.draft[(rows, w)] >= 0.020 for rows in range(1, 5) for w in model.widths if w > 1)


def test_width_follows_the_cost_and_greedy_output_equals_autoregressive():
    adaptive, _, ar = engines()
    adaptive.policy.cost_model = FixedCosts(4, adaptive.cost_model.widths)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    steps = []
    batch = LLM.from_engine(adaptive).generate(PROMPTS, params, on_step=lambda r: steps.append(r.stats))
    alone = LLM.from_engine(adaptive).generate(PROMPTS[2], params, on_step=lambda r: steps.append(r.stats))[0]
    reference = LLM.from_engine(ar).generate(PROMPTS, params)
    assert [b.token_ids for b in batch] == [r.token_ids for r in reference]
    assert alone.token_ids == reference[2].token_ids
    widths = {(s.num_decode_rows, s.verify_width) for s in steps if s.num_decode_rows}
    assert (4, 1) in widths and (1, 8) in widths  # a compute-bound batch stops drafting; one row drafts fully
    assert all(width == 1 for rows, width in widths if rows >= 3)
    assert all(s.predicted_tokens > 0 for s in steps if s.num_decode_rows)
    assert alone.num_draft_tokens > 0


def test_a_seeded_sampled_request_keeps_the_full_block_and_its_text():
    adaptive, fixed, _ = engines()
    adaptive.policy.cost_model = FixedCosts(4, adaptive.cost_model.widths)
    seeded = SamplingParams(max_tokens=20, temperature=1.0, seed=42)
    free = SamplingParams(max_tokens=20, temperature=1.0)

    def first_width(params) -> int:
        steps = []
        outputs = LLM.from_engine(adaptive).generate(PROMPTS, params, on_step=lambda r: steps.append(r.stats))
        return next(s.verify_width for s in steps if s.num_decode_rows == 4), outputs

    width, mixed = first_width([free, seeded, free, free])
    assert width == 8  # the whole batch verifies full blocks while the seeded request runs
    assert first_width([free] * 4)[0] == 1  # without it, this compute-bound batch would not draft
    assert mixed[1].token_ids == LLM.from_engine(fixed).generate(PROMPTS[1], seeded)[0].token_ids
    # A seed asks for the same text on a greedy request too (in bfloat16 a width can break a near-tie).
    greedy = SamplingParams(max_tokens=20, temperature=0.0, seed=1)
    assert first_width([free, greedy, free, free])[0] == 8


def test_start_up_costs_are_timed_in_interleaved_rounds(monkeypatch):
    """Each round times every (rows, width) once, so a stretch of load from another process touches one
    sample of many shapes, not every sample of one shape (which skewed the table's shape across widths)."""
    adaptive, _, _ = engines()
    runner = adaptive.runner
    order: list[tuple[str, int, int]] = []
    monkeypatch.setattr(runner, "verify", lambda slots, rows, starts: order.append(("v", len(slots), len(rows[0]))))
    monkeypatch.setattr(runner.drafting, "propose", lambda slots, *args: order.append(("d", len(slots), args[-2])))
    verify, draft = runner.measure_costs([1, 2], [1, 2, 4], repeats=3)
    assert set(verify) == {(r, w) for r in (1, 2) for w in (1, 2, 4)}
    assert set(draft) == {(r, w) for r in (1, 2) for w in (2, 4)}
    one_round = len(verify) + len(draft)
    assert len(order) == 4 * one_round  # a warm-up round, then three timed rounds
    rounds = [order[i * one_round : (i + 1) * one_round] for i in range(4)]
    assert all(r == rounds[0] for r in rounds) and len(set(rounds[0])) == one_round
