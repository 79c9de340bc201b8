"""Prompt lookup: n-gram matching over a request's own tokens, and the policy's costs for it."""

from __future__ import annotations

import math

import pytest

from dflash2.spec.adaptive import CostModel, choose_lookup_width, choose_width
from dflash2.spec.prompt_lookup import PromptLookup


def lookup(tokens, min_n=1, max_n=3) -> PromptLookup:
    index = PromptLookup(min_n, max_n)
    index.extend(tokens)
    return index


def brute_force(tokens, k, min_n, max_n):
    """The definition: the longest suffix (max_n … min_n) with an earlier occurrence; the latest one."""
    last = len(tokens) - 1
    for n in range(min(max_n, last + 1), min_n - 1, -1):
        suffix = tokens[last - n + 1 :]
        for end in range(last - 1, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


def test_the_latest_earlier_occurrence_of_the_longest_suffix():
    # "7 8 9" occurs once before the end; "8 9" twice (the latest is followed by 4).
    tokens = [7, 8, 9, 1, 2, 8, 9, 4, 5, 7, 8, 9]
    assert lookup(tokens).propose(3) == [1, 2, 8]  # the 3-gram wins over the later 2-gram
    assert lookup(tokens, max_n=2).propose(3) == [4, 5, 7]  # the latest "8 9"
    assert lookup(tokens).propose(1) == [1]


def test_no_match_below_the_minimum_and_nothing_for_no_room():
    assert lookup([1, 2, 3, 4], min_n=1).propose(4) == []  # 4 never occurred before
    assert lookup([1, 2, 5, 2], min_n=2).propose(4) == []  # only the 1-gram "2" matches
    assert lookup([1, 2, 5, 2], min_n=1).propose(4) == [5, 2]  # ... which min_n = 1 takes: up to the end
    assert lookup([1, 2, 1, 2], min_n=1).propose(0) == []
    assert PromptLookup(1, 3).propose(3) == []


def test_a_repeated_token_proposes_itself():
    assert lookup([3, 3, 3], min_n=2).propose(4) == [3]  # "3 3" ended at 1; what followed is the last 3


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 4), (2, 4), (3, 5)])
def test_incremental_indexing_agrees_with_the_definition(min_n, max_n):
    import random

    rng = random.Random(min_n * 10 + max_n)
    tokens = [rng.randrange(5) for _ in range(300)]
    index = PromptLookup(min_n, max_n)
    for i, token in enumerate(tokens):
        index.extend([token])
        for k in (1, 3, 7):
            assert index.propose(k) == brute_force(tokens[: i + 1], k, min_n, max_n)


def test_sync_catches_up_with_prompt_then_output():
    prompt, output = [5, 6, 7, 5], [6, 1, 5, 6]
    index = PromptLookup(2, 3, prompt)
    index.sync(output[:1])
    assert index.tokens == [5, 6, 7, 5, 6] and index.propose(2) == [7, 5]
    index.sync(output)
    assert index.tokens == prompt + output
    assert index.propose(3) == brute_force(prompt + output, 3, 2, 3) == [1, 5, 6]


@pytest.mark.parametrize("bounds", [(0, 2), (3, 2), (-1, 4)])
def test_bad_bounds_are_rejected(bounds):
    with pytest.raises(ValueError, match="1 <= min <= max"):
        PromptLookup(*bounds)


def flat_costs(draft: float) -> CostModel:
    """Every verify width costs 10 ms at one row; drafting ``draft`` seconds."""
    model = CostModel(1, (1, 2, 3, 4))
    model.seed({(1, w): 0.010 for w in model.widths}, {(1, w): draft for w in model.widths if w > 1})
    return model


def test_a_lookup_step_costs_the_verify_forward_alone():
    model = flat_costs(draft=0.005)
    assert model.verify_seconds(1, 4) == pytest.approx(0.010)
    assert model.seconds(1, 4) == pytest.approx(0.015)
    assert model.verify_seconds(1, 9) == math.inf  # never measured


def test_a_lookup_step_teaches_only_the_verify_factor():
    model = flat_costs(draft=0.005)
    model.observe(1, 3, 0.005, 0.010)  # a drafted step: drafting twice as slow as measured
    draft_factor = model.draft_scale[1]
    model.observe(1, 3, 0.020, None)  # a lookup step: slow verify, no drafter
    assert model.draft_scale[1] == draft_factor
    assert model.verify_scale[(1, True)] > model.verify_scale.get((1, False), 1.0)


def test_lookup_beats_the_drafter_when_it_costs_less_for_as_many_tokens():
    model = flat_costs(draft=0.005)
    acceptance = [[0.6, 0.6, 0.6]]
    drafter = choose_width(acceptance, [3], model.widths, model.seconds)
    same = choose_lookup_width(acceptance, [3], model.widths, model.verify_seconds)
    assert same.width == 4 and same.rates[4] > drafter.rates[drafter.width]
    assert same.rates[4] == pytest.approx(drafter.rates[4] * 0.015 / 0.010)
    # A lookup draft of one token, rarely accepted: the drafter's wider block wins.
    poor = choose_lookup_width([[0.1, 0.6, 0.6]], [1], model.widths, model.verify_seconds)
    assert poor.width == 2 and poor.rates[2] < drafter.rates[drafter.width]
