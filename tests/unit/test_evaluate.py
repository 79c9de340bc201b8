"""Evaluation bookkeeping and prompt sets."""

from __future__ import annotations

import pytest

from dflash2.outputs import StepResult, StepStats
from dflash2.train.evaluate import AcceptanceResult, load_prompt_sets, markdown_table


def test_acceptance_rates_from_step_stats():
    result = AcceptanceResult()
    # Two rows: one accepted 3 of 3 drafts, one accepted 1 of 3.
    stats = StepStats(
        block_size=4,
        num_accepted_tokens=4,
        accepted_per_position=[2, 1, 1],
        drafted_per_position=[2, 2, 2],
        acceptance_lengths=[4, 2],
        num_generated_tokens=6,
    )
    result.add(StepResult([], stats))
    assert result.tau == pytest.approx(3.0)
    assert result.acceptance_per_position == [1.0, 0.5, 0.5]
    assert result.conditional_acceptance == [1.0, 0.5, 1.0]
    table = markdown_table({"math/0/4": result.to_dict()}, {1: [0.5, 0.25, 0.125]})
    assert "| math | 0 | 4 | 3.00 |" in table and "Recall@1 | 0.500 | 0.250 | 0.125 |" in table
    assert table.splitlines()[2].endswith("| 1.00 0.50 1.00 |")


def test_prompt_sets_ship_with_the_package():
    sets = load_prompt_sets(None, limit=5)
    assert set(sets) == {"humaneval", "math", "multiturn"}
    assert all(len(v) == 5 for v in sets.values())
    assert "def " in sets["humaneval"][0][0]["content"]
    assert [m["role"] for m in sets["multiturn"][0]] == ["user", "assistant", "user"]
