"""The adaptive speculation policy on synthetic acceptance and cost models (plain Python)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from dflash2.engine.policy import one_hot_proposal
from dflash2.spec import adaptive
from dflash2.spec.adaptive import (
    AcceptanceEstimate,
    AcceptanceTracker,
    CostModel,
    choose_width,
    expected_tokens,
    expected_tokens_with_branch,
)


def at_widths(draft: dict[int, float], widths: tuple[int, ...]) -> dict[tuple[int, int], float]:
    """Start-up drafting times by row count, the same at every drafted width."""
    return {(rows, w): seconds for rows, seconds in draft.items() for w in widths if w > 1}


def test_expected_tokens_is_one_plus_the_survival_sums():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens([1.0, 0.0, 1.0], 3) == 2.0
    assert expected_tokens([0.9], 4) == pytest.approx(1.9)  # positions never estimated count as rejected


def test_a_lookup_branch_adds_the_depths_where_it_survives_more_likely_than_the_tree():
    tree, branch = [0.5, 0.5, 0.5], [0.9, 0.2]
    assert expected_tokens_with_branch(tree, 3, branch, 0) == expected_tokens(tree, 3)
    assert expected_tokens_with_branch(tree, 0, branch, 2) == pytest.approx(expected_tokens(branch, 2))
    # depth 1: the branch (0.9); depth 2: the tree (0.25 > 0.18); depth 3: the tree alone (0.125)
    assert expected_tokens_with_branch(tree, 3, branch, 2) == pytest.approx(1 + 0.9 + 0.25 + 0.125)
    assert expected_tokens_with_branch(tree, 1, branch, 2) == pytest.approx(1 + 0.9 + 0.18)


def test_a_tree_step_with_branches_is_priced_on_both_sources():
    """Each row's tree prediction counts its lookup branch, cut to the width like its drafts."""
    model = CostModel(2, (1, 2, 3))
    model.seed({(2, w): 0.010 * w for w in (1, 2, 3)}, at_widths({2: 0.001}, (1, 2, 3)))
    trees, limits = [[0.3, 0.3], [0.5, 0.5]], [2, 2]
    alone = choose_width(trees, limits, (2, 3), model.seconds)
    branched = choose_width(trees, limits, (2, 3), model.seconds, branches=[([0.9, 0.9], 2), ((), 0)])
    assert branched.rates[2] == pytest.approx((1.9 + 1.5) / 0.021)
    assert branched.rates[3] == pytest.approx((1 + 0.9 + 0.81 + 1.75) / 0.031)
    assert branched.rates[3] > alone.rates[3]
    assert branched.width == 2 and branched.predicted_tokens == pytest.approx(1.9 + 1.5)


def test_acceptance_estimate_observes_the_accepted_prefix_and_the_first_rejection():
    estimate = AcceptanceEstimate([0.5, 0.5, 0.5, 0.5], alpha=0.5)
    estimate.observe(num_drafts=4, num_accepted=1)  # draft 1 accepted, draft 2 rejected, 3-4 unseen
    assert estimate.values == [0.75, 0.25, 0.5, 0.5]
    estimate.observe(num_drafts=2, num_accepted=2)  # both drafted positions accepted, nothing rejected
    assert estimate.values == [0.875, 0.625, 0.5, 0.5]
    estimate.observe(num_drafts=0, num_accepted=0)  # an autoregressive step observes nothing
    assert estimate.values == [0.875, 0.625, 0.5, 0.5]


def test_relax_moves_an_estimate_back_toward_the_engine_wide_one():
    estimate = AcceptanceEstimate([0.0, 0.2])
    estimate.relax([0.5, 0.4], rate=0.5)
    assert estimate.values == pytest.approx([0.25, 0.3])


def test_tracker_keeps_a_recent_estimate_and_the_long_run_rate():
    tracker = AcceptanceTracker(3, prior=0.5, prior_observations=2)
    assert tracker.long_run == [0.5, 0.5, 0.5] and tracker.values == [0.5, 0.5, 0.5]
    tracker.observe(num_drafts=3, num_accepted=1)  # position 1 accepted, 2 rejected, 3 unseen
    tracker.observe(num_drafts=3, num_accepted=3)
    assert tracker.long_run == pytest.approx([3 / 4, 2 / 4, 2 / 3])
    assert tracker.values == pytest.approx([0.54875, 0.50125, 0.525])  # recent: exponential averages (α 0.05)
    tracker.recent.values = [0.0, 0.0, 0.0]
    tracker.idle_step(rate=0.5)  # no row drafted: halfway back to the long run
    assert tracker.values == pytest.approx([3 / 8, 2 / 8, 2 / 6])
    assert tracker.long_run == pytest.approx([3 / 4, 2 / 4, 2 / 3])  # idle steps observe nothing


def simulate_one_row(idle_steps: bool, seed: int = 0) -> list[int]:
    """One row decoding through a hard stretch (every draft rejected) into easy text (each draft accepted
    with probability 0.7), the engine's updates in between; returns the width chosen at every step."""
    rng = random.Random(seed)
    tracker = AcceptanceTracker(7)
    row = AcceptanceEstimate(list(tracker.values))
    cost = lambda rows, width: 0.010 + 0.0005 * width + (0.003 if width > 1 else 0.0)  # noqa: E731
    widths = []
    for step in range(400):
        width = choose_width([row.values], [7], range(1, 9), cost).width
        widths.append(width)
        if width == 1:
            row.relax(tracker.values)
            if idle_steps:
                tracker.idle_step()
            continue
        rate = 0.0 if step < 100 else 0.7
        accepted = next((i for i in range(width - 1) if rng.random() >= rate), width - 1)
        row.observe(width - 1, accepted)
        tracker.observe(width - 1, accepted)
    return widths


def test_a_hard_stretch_does_not_lock_the_policy_out_of_drafting():
    """After a stretch where every draft is rejected the row stops drafting; once the text is easy again
    it must draft again. With the engine-wide estimate frozen where the hard stretch left it (the old
    behaviour, no idle-step recovery), it never does."""
    widths = simulate_one_row(idle_steps=True)
    assert widths[0] > 1  # the prior: speculate from the start
    assert 1 in widths[:100]  # the hard stretch stops drafting
    easy = widths[150:]
    assert sum(w > 1 for w in easy) > 0.8 * len(easy)
    assert all(w == 1 for w in simulate_one_row(idle_steps=False)[150:])


def test_cost_model_interpolates_between_measured_row_counts_and_learns():
    model = CostModel(max_rows=8, widths=(1, 4))
    model.seed(
        {(1, 1): 0.010, (4, 1): 0.040, (1, 4): 0.020, (4, 4): 0.080}, at_widths({1: 0.005, 4: 0.008}, model.widths)
    )
    assert model.verify[(2, 1)] == pytest.approx(0.020)
    assert model.verify[(8, 4)] == pytest.approx(0.160)  # proportional beyond the last measurement
    assert model.seconds(2, 4) == pytest.approx(0.040 + 0.006)
    assert model.seconds(2, 1) == pytest.approx(0.020)  # no drafter forward at width 1
    assert math.isinf(model.seconds(2, 3))


def test_a_live_step_rescales_every_drafted_width_at_its_row_count():
    model = CostModel(max_rows=4, widths=(1, 2, 4))
    model.seed(
        {(1, w): 0.010 * w for w in (1, 2, 4)} | {(2, w): 0.020 * w for w in (1, 2, 4)},
        at_widths({1: 0.005, 2: 0.008}, model.widths),
    )
    model.observe(2, 4, verify_seconds=0.160, draft_seconds=0.016)  # twice the start-up figures
    scale = 1 + 0.1 * (2 - 1)  # one step moves the factor a tenth of the way
    assert model.seconds(2, 2) == pytest.approx(0.040 * scale + 0.008 * scale)  # a width never run: rescaled too
    assert model.seconds(2, 4) == pytest.approx(0.080 * scale + 0.008 * scale)
    assert model.seconds(2, 1) == pytest.approx(0.020)  # autoregressive steps have their own factor
    # Another row count keeps its own verify factor but borrows the drafter's until it drafts itself.
    assert model.seconds(1, 4) == pytest.approx(0.040 + 0.005 * scale)
    model.observe(1, 4, verify_seconds=0.040, draft_seconds=0.005)  # learning starts from the borrowed factor
    assert model.seconds(1, 4) == pytest.approx(0.040 + 0.005 * (scale + 0.1 * (1 - scale)))
    for _ in range(100):
        model.observe(2, 1, verify_seconds=0.030, draft_seconds=0.0)
    assert model.seconds(2, 1) == pytest.approx(0.030, rel=1e-4)
    # No drafted step: the drafting factors only drift toward the autoregressive one (1.5), slowly.
    drift = 100 * adaptive.COST_RELAX * (1.5 - scale)  # the most 100 steps can move them
    assert 0.088 * scale < model.seconds(2, 4) < 0.088 * (scale + drift)


def test_drafting_cost_depends_on_the_width_and_one_factor_rescales_every_width():
    """The drafter runs only the verified block, so a narrow step drafts for less; the start-up times
    are made non-decreasing in the width (a 3-token block timed slower than a 4-token one by chance),
    and a live drafted step at one width rescales the drafting cost of every width."""
    model = CostModel(max_rows=2, widths=(1, 2, 3, 4))
    verify = {(r, w): 0.010 * r for r in (1, 2) for w in (1, 2, 3, 4)}
    model.seed(verify, {(1, 2): 0.002, (1, 3): 0.004, (1, 4): 0.003, (2, 2): 0.003, (2, 3): 0.005, (2, 4): 0.007})
    assert [model.draft[(1, w)] for w in (2, 3, 4)] == pytest.approx([0.002, 0.0035, 0.0035])
    assert model.seconds(2, 2) == pytest.approx(0.020 + 0.003)
    assert model.seconds(2, 4) == pytest.approx(0.020 + 0.007)
    assert model.seconds(1, 1) == pytest.approx(0.010)  # width 1 drafts nothing
    model.observe(2, 4, verify_seconds=0.020, draft_seconds=2 * 0.007)  # the drafter at twice its start-up time
    assert model.seconds(2, 2) == pytest.approx(0.020 + 0.003 * 1.1)  # a width not run is rescaled too
    # Many narrow steps would draft expensive wide blocks if the table had one cost for every width.
    acceptance = [[0.3, 0.1, 0.1]]
    wide = CostModel(max_rows=1, widths=(1, 2, 3, 4))
    wide.seed({(1, w): 0.010 for w in (1, 2, 3, 4)}, at_widths({1: 0.004}, wide.widths))
    narrow = CostModel(max_rows=1, widths=(1, 2, 3, 4))
    narrow.seed({(1, w): 0.010 for w in (1, 2, 3, 4)}, {(1, 2): 0.002, (1, 3): 0.003, (1, 4): 0.004})
    assert choose_width(acceptance, [3], wide.widths, wide.seconds).width == 1  # 1.3 tokens / 14 ms loses
    assert choose_width(acceptance, [3], narrow.widths, narrow.seconds).width == 2  # 1.3 / 12 ms wins


def test_one_slow_step_moves_a_factor_by_at_most_the_clip():
    model = CostModel(max_rows=1, widths=(1, 8))
    model.seed({(1, 1): 0.016, (1, 8): 0.017}, at_widths({1: 0.004}, model.widths))
    model.observe(1, 8, verify_seconds=5 * 0.017, draft_seconds=5 * 0.004)  # a host hiccup: 5× slower
    assert model.seconds(1, 8) == pytest.approx(1.1 * 0.021)  # counted as 2×: a tenth of the way to 2
    model.observe(1, 1, verify_seconds=0.016 / 5, draft_seconds=0.0)  # and 5× faster counts as ½
    assert model.seconds(1, 1) == pytest.approx(0.95 * 0.016)


def simulate_hiccup(monkeypatch: pytest.MonkeyPatch, relax: float, clip: float) -> list[int]:
    """One row whose drafting pays (start-up: 21 ms per drafted step committing 1.8 tokens against 16 ms
    per token): its first 4 drafted steps run 5× slow (a hiccup); every other step runs at the start-up
    figures."""
    monkeypatch.setattr(adaptive, "COST_RELAX", relax)
    monkeypatch.setattr(adaptive, "COST_CLIP", clip)
    model = CostModel(max_rows=1, widths=(1, 8))
    model.seed({(1, 1): 0.016, (1, 8): 0.017}, at_widths({1: 0.004}, model.widths))
    acceptance = [[0.45] * 7]
    chosen: list[int] = []
    for _ in range(1500):
        width = choose_width(acceptance, [7], (1, 8), model.seconds).width
        slow = 5.0 if width > 1 and sum(w > 1 for w in chosen) < 4 else 1.0
        chosen.append(width)
        model.observe(1, width, slow * (0.017 if width > 1 else 0.016), slow * 0.004 if width > 1 else 0.0)
    return chosen


def test_slow_drafted_steps_do_not_stop_drafting_for_good(monkeypatch: pytest.MonkeyPatch):
    """Drafted steps inflated by a hiccup make drafting look worse than it is, so the row stops drafting;
    the steps without drafts then draw the drafting factors back, and it drafts again. Without that pull
    (and without the clip) the factors stay where the hiccup left them and the row never drafts again."""
    chosen = simulate_hiccup(monkeypatch, adaptive.COST_RELAX, adaptive.COST_CLIP)
    assert chosen[0] == 8 and 1 in chosen[:50]  # it drafted, then the hiccup stopped it
    assert all(w == 8 for w in chosen[-500:])  # back to drafting for good
    old = simulate_hiccup(monkeypatch, relax=0.0, clip=math.inf)
    assert all(w == 1 for w in old[-500:])


def test_a_row_count_that_never_drafted_borrows_drafting_costs_but_never_lends_them():
    model = CostModel(max_rows=4, widths=(1, 4))
    model.seed({(r, w): 0.010 * r * w for r in (1, 4) for w in (1, 4)}, at_widths({1: 0.002, 4: 0.005}, model.widths))
    for _ in range(100):  # autoregressive steps at 3 rows run 1.5× their start-up time
        model.observe(3, 1, verify_seconds=0.045, draft_seconds=0.0)
    assert model.seconds(3, 4) == pytest.approx(1.5 * 0.120 + 0.004, rel=1e-3)  # the verify factor is borrowed
    for _ in range(100):  # drafted steps at 3 rows: the verify forward at its start-up time, the drafter 2×
        model.observe(3, 4, verify_seconds=0.120, draft_seconds=0.008)
    assert model.seconds(3, 4) == pytest.approx(0.120 + 0.008, rel=1e-3)  # learned: its own factors now
    assert model.seconds(3, 1) == pytest.approx(0.045, rel=1e-3)  # autoregressive steps never borrow
    assert model.seconds(2, 4) == pytest.approx(0.080 + 2 * 0.003, rel=1e-3)  # the drafter's factor is borrowed
    assert model.seconds(2, 1) == pytest.approx(0.020)


def test_optimistic_start_up_costs_under_load_are_corrected_and_drafting_stops():
    """Start-up timed a 4-row drafted step at 25 ms against 20 ms for an autoregressive one; live, with
    longer contexts, the drafted steps take 60 ms. A few drafted steps correct every width and the policy
    stops drafting (a per-width table, which kept the start-up figure of each width until that width
    was tried, drafted 19 of these 40 steps, trying the widths one after another)."""
    widths = tuple(range(1, 9))
    model = CostModel(max_rows=4, widths=widths)
    model.seed({(4, w): 0.020 + 0.0007 * (w - 1) for w in widths}, at_widths({4: 0.003}, model.widths))
    acceptance = [[0.5] * 7] * 4
    chosen = []
    for _ in range(40):
        width = choose_width(acceptance, [7] * 4, widths, model.seconds).width
        chosen.append(width)
        real = 0.020 if width == 1 else 0.050 + 0.002 * (width - 1)
        model.observe(4, width, real, 0.008 if width > 1 else 0.0)
    assert chosen[0] > 1  # the start-up figures say drafting pays
    assert sum(w > 1 for w in chosen) <= 5
    assert all(w == 1 for w in chosen[-30:])


def linear_cost(per_token: float, fixed: float, draft: float):
    """A compute-bound target: verify time grows with rows × width."""
    return lambda rows, width: fixed + per_token * rows * width + (draft * rows if width > 1 else 0.0)


GOOD = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]
POOR = [0.3, 0.1, 0.05, 0.0, 0.0, 0.0, 0.0]


def test_one_row_with_good_acceptance_on_a_launch_bound_machine_takes_the_full_block():
    choice = choose_width([GOOD], [7], range(1, 9), lambda rows, width: 0.020 + 0.0001 * width)
    assert choice.width == 8
    assert choice.predicted_tokens == pytest.approx(expected_tokens(GOOD, 7))


def test_a_full_compute_bound_batch_with_poor_acceptance_stops_drafting():
    choice = choose_width([POOR] * 8, [7] * 8, range(1, 9), linear_cost(0.002, 0.005, 0.001))
    assert choice.width == 1 and choice.predicted_tokens == 8.0


def test_the_width_is_the_rate_maximiser_between_the_extremes():
    """By hand: 4 rows, acceptance GOOD (E = 1, 1.9, 2.62, 3.124 … tokens per row), a step of 5 ms + 1 ms
    per verified token + 0.5 ms per drafted row: W=1 4/9 = 0.444, W=2 7.6/15 = 0.507, W=3 10.48/19 = 0.552,
    W=4 12.50/23 = 0.543 tokens/ms: W = 3."""
    choice = choose_width([GOOD] * 4, [7] * 4, range(1, 9), linear_cost(0.001, 0.005, 0.0005))
    assert choice.width == 3
    assert choice.predicted_tokens == pytest.approx(10.48)
    assert choice.rates[3] == pytest.approx(10.48 / 0.019) and choice.rates[4] == pytest.approx(12.496 / 0.023)


def test_rows_near_their_limits_make_wide_blocks_pointless():
    cost = linear_cost(0.001, 0.005, 0.0005)
    assert choose_width([GOOD] * 4, [1] * 4, range(1, 9), cost).width == 2


def test_min_width_keeps_the_full_block():
    choice = choose_width([POOR] * 8, [7] * 8, range(1, 9), linear_cost(0.002, 0.005, 0.001), min_width=8)
    assert choice.width == 8


def test_nothing_measured_means_the_full_block():
    assert choose_width([POOR], [7], (1, 8), lambda rows, width: math.inf).width == 8


def test_monotone_pools_each_decreasing_run_into_its_mean():
    assert adaptive.monotone([18.4, 20.9, 22.3, 20.7, 21.5, 23.0, 24.3, 24.0]) == pytest.approx(
        [18.4, 20.9, 21.5, 21.5, 21.5, 23.0, 24.15, 24.15]
    )
    assert adaptive.monotone([3.0, 2.0, 1.0]) == pytest.approx([2.0, 2.0, 2.0])
    assert adaptive.monotone([1.0, 2.0, 2.0, 5.0]) == [1.0, 2.0, 2.0, 5.0]  # already monotone: unchanged
    assert adaptive.monotone([]) == []


def test_a_width_timed_fast_by_chance_is_not_preferred_for_good():
    """Start-up timings at one row with a dip at width 4 (measured: 20.7 ms between 22.3 and 21.5): on
    the raw table a row with acceptance 0.4 per position verifies width 4, the width that happened to be
    timed fast; on the monotone table widths 3–5 cost the same (their mean) and the policy takes 5, the
    most tokens for that cost."""
    raw = dict(zip(range(1, 9), [0.0184, 0.0209, 0.0223, 0.0207, 0.0215, 0.0230, 0.0243, 0.0240]))
    acceptance = [[0.4] * 7]
    model = CostModel(max_rows=1, widths=tuple(range(1, 9)))
    model.seed({(1, w): t for w, t in raw.items()}, at_widths({1: 0.004}, model.widths))
    assert [model.verify[(1, w)] for w in range(1, 9)] == sorted(model.verify[(1, w)] for w in range(1, 9))
    assert model.verify[(1, 4)] == pytest.approx(0.0215)
    unsmoothed = choose_width(acceptance, [7], range(1, 9), lambda r, w: raw[w] + (0.004 if w > 1 else 0.0))
    assert unsmoothed.width == 4
    assert choose_width(acceptance, [7], range(1, 9), model.seconds).width == 5


def test_width_one_keeps_its_own_start_up_time():
    """Only the drafted widths are pooled: width 1 has its own live factor, and pooling a slow width-1
    timing into width 2 would lower the autoregressive base and raise every drafted width's."""
    model = CostModel(max_rows=1, widths=(1, 2, 3))
    model.seed({(1, 1): 0.030, (1, 2): 0.020, (1, 3): 0.019}, at_widths({1: 0.004}, model.widths))
    assert model.verify[(1, 1)] == pytest.approx(0.030)
    assert model.verify[(1, 2)] == pytest.approx(0.0195) and model.verify[(1, 3)] == pytest.approx(0.0195)


def test_tree_costs_borrow_the_chain_factors_until_a_tree_step_is_timed():
    """A token-tree step has its own tables (a wider verify, the lattice's drafting); until one is timed
    live it borrows the chain's drafted factors at its row count; its own factors never feed the chain's,
    and autoregressive steps draw them back slowly as they do the chain's."""
    model = CostModel(max_rows=2, widths=(1, 4))
    model.seed({(1, 1): 0.010, (1, 4): 0.012}, at_widths({1: 0.003}, model.widths))
    model.seed_tree({(1, 4): 0.016}, {(1, 4): 0.004})
    assert model.tree_seconds(1, 4) == pytest.approx(0.016 + 0.004)
    assert model.tree_seconds(1, 1) == model.seconds(1, 1) == pytest.approx(0.010)
    assert model.tree_seconds(2, 4) == pytest.approx(0.032 + 0.008)  # proportional beyond the last row count
    model.observe(1, 4, verify_seconds=0.024, draft_seconds=0.006)  # a chain step at twice its table
    chain = 1 + 0.1 * (2 - 1)
    assert model.tree_seconds(1, 4) == pytest.approx((0.016 + 0.004) * chain)  # borrowed
    model.observe_tree(1, 4, verify_seconds=0.016, draft_seconds=0.004)  # a tree step at its table
    tree = chain + 0.1 * (1 - chain)
    assert model.tree_seconds(1, 4) == pytest.approx((0.016 + 0.004) * tree)
    assert model.seconds(1, 4) == pytest.approx((0.012 + 0.003) * chain)  # not lent to chains
    model.observe(1, 1, verify_seconds=0.010, draft_seconds=0.0)
    assert model.tree_seconds(1, 4) == pytest.approx((0.016 + 0.004) * (tree + adaptive.COST_RELAX * (1 - tree)))


def test_a_one_hot_proposal_of_no_drafts_has_integer_ids():
    """Rows near their limits may all propose nothing: the ids stay int64 (acceptance counts are slice
    indices), shaped [R, 0]; shorter rows are padded to the longest."""
    empty = one_hot_proposal([[], []], torch.device("cpu"))
    assert empty.draft_ids.dtype == torch.long and tuple(empty.draft_ids.shape) == (2, 0)
    padded = one_hot_proposal([[5, 6], []], torch.device("cpu"))
    assert padded.draft_ids.tolist() == [[5, 6], [0, 0]]
    assert padded.draft_probs.shape == (2, 2, 1) and bool((padded.candidate_ids[..., 0] == padded.draft_ids).all())
