"""The arithmetic of the summary on synthetic samples: medians, speedups, τ, cost split, overhead share."""

from __future__ import annotations

import pytest

from dflash2.bench.report import render_markdown, speed_table
from dflash2.bench.runners import GenerationSample
from dflash2.bench.stats import ALL, RunRecord, overhead_share, percentile, summarize


def _sample(tokens: int, seconds: float, **engine: float | int | list[int]) -> GenerationSample:
    return GenerationSample(num_prompt_tokens=10, num_output_tokens=tokens, seconds=seconds, ttft=0.1, **engine)


def _records(method: str, speeds: list[float], temperature: float = 0.0) -> list[RunRecord]:
    """One record per repetition; ``speeds`` are tokens/s of 100 tokens over two prompts."""
    return [
        RunRecord(method, temperature, "math", rep, [_sample(50, 50 / tps), _sample(50, 50 / tps)])
        for rep, tps in enumerate(speeds)
    ]


def test_speedup_is_the_ratio_of_median_tokens_per_second() -> None:
    records = (
        _records("ar", [10.0, 12.0, 11.0]) + _records("dflash2-b8", [36.0, 30.0, 33.0]) + _records("hf", [5.5] * 3)
    )
    rows = {r.method: r for r in summarize(records, ["ar", "dflash2-b8", "hf"]) if r.scope == ALL}
    assert rows["ar"].tokens_per_second == pytest.approx(11.0)
    assert rows["dflash2-b8"].tokens_per_second == pytest.approx(33.0)
    assert (rows["dflash2-b8"].tokens_per_second_min, rows["dflash2-b8"].tokens_per_second_max) == pytest.approx(
        (30.0, 36.0)
    )
    assert rows["dflash2-b8"].ms_per_token == pytest.approx(1000 / 33.0)
    assert rows["dflash2-b8"].speedups["ar"] == pytest.approx(3.0)
    assert rows["dflash2-b8"].speedups["hf"] == pytest.approx(6.0)
    assert rows["ar"].speedups["ar"] == pytest.approx(1.0)
    assert rows["hf"].speedups["ar"] == pytest.approx(0.5)
    assert rows["ar"].speedups["llama.cpp"] is None  # not measured: no ratio


def test_speedups_compare_the_same_temperature_only() -> None:
    records = _records("ar", [10.0]) + _records("ar", [20.0], 1.0) + _records("dflash-b8", [40.0], 1.0)
    rows = [r for r in summarize(records, ["ar", "dflash-b8"]) if r.scope == ALL]
    dflash = next(r for r in rows if r.method == "dflash-b8")
    assert dflash.temperature == 1.0
    assert dflash.speedups["ar"] == pytest.approx(2.0)


def test_tpot_and_ttft_leave_the_first_token_out() -> None:
    records = [RunRecord("ar", 0.0, "math", 0, [GenerationSample(5, 11, seconds=1.1, ttft=0.1)])]
    row = summarize(records, ["ar"])[0]
    assert row.tpot_ms == pytest.approx(100.0)  # (1.1 − 0.1) s / (11 − 1) tokens
    assert row.ttft_ms == pytest.approx(100.0)
    assert row.tokens_per_second == pytest.approx(10.0)


def test_tau_per_position_acceptance_and_cost_split() -> None:
    sample = _sample(
        9,
        1.0,
        num_verify_steps=4,
        num_accepted_tokens=6,
        accepted_per_position=[4, 2, 0],
        drafted_per_position=[4, 4, 4],
        num_decode_steps=3,
        draft_time=0.03,
        select_time=0.006,
        verify_time=0.09,
        decode_time=0.15,
    )
    row = summarize([RunRecord("dflash2-b4", 0.0, "math", 0, [sample])], ["dflash2-b4"])[0]
    assert row.tau == pytest.approx(2.5)  # (6 + 4) / 4
    assert row.acceptance_per_position == pytest.approx([1.0, 0.5, 0.0])
    assert (row.draft_ms, row.select_ms, row.verify_ms, row.other_ms) == pytest.approx((10.0, 2.0, 30.0, 8.0))
    assert row.cycle_ms == pytest.approx(50.0)
    assert overhead_share(row, conv_overhead_ms=3.0) == pytest.approx(0.1)  # (2 + 3) / 50


def test_peers_have_no_speculative_columns() -> None:
    row = summarize(_records("hf", [10.0]), ["hf"])[0]
    assert row.tau is None and row.cycle_ms is None and row.acceptance_per_position == []


def test_percentile_interpolates_between_order_statistics() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([], 50) == 0.0


def _results(rows: list) -> dict:
    methods = [
        {"id": m, "label": m.upper(), "family": m.split("-")[0], "status": "ok", "info": {}, "peak_rss_bytes": 2e9}
        for m in dict.fromkeys(r.method for r in rows)
    ]
    return {
        "command": "dflash2 bench",
        "date": "today",
        "config": {"model": None, "drafter": None, "device": "cpu", "dtype": "float32", "max_tokens": 8, "repeats": 3},
        "machine": {
            "cpu_model": "cpu",
            "cpus": "2",
            "cpu_flags": [],
            "cuda": None,
            "torch": "x",
            "torch_threads": 1,
            "transformers": "y",
            "llama_cpp_python": None,
            "python": "3",
            "os": "linux",
        },
        "single_stream": {"methods": methods, "rows": [r.to_dict() for r in rows]},
    }


def test_markdown_speed_table_shows_the_computed_speedups() -> None:
    records = _records("ar", [10.0, 12.0, 11.0]) + _records("dflash2-b8", [36.0, 30.0, 33.0])
    results = _results(summarize(records, ["ar", "dflash2-b8"]))
    lines = speed_table(results)
    assert "× our AR" in lines[0] and "× HF" not in lines[0]  # only measured baselines get a column
    dflash_line = next(line for line in lines if line.startswith("| DFLASH2-B8 "))
    cells = [c.strip() for c in dflash_line.strip("|").split("|")]
    assert cells[1] == "0" and cells[2] == "33.0" and cells[-1] == "3.00×"
    assert cells[8] == "2000"  # peak RSS in MB
    markdown = render_markdown(results)
    assert "## Single stream" in markdown and "| AR | 0 | 11.0 |" in markdown


def test_a_selector_inside_the_drafting_graph_is_reported_as_part_of_drafting() -> None:
    """Compiled on CPU the walk runs in the drafting graph: the report says so instead of a 0 ms select
    and leaves the overhead headline to the eager row, which times the selector apart."""
    fused = _sample(9, 1.0, num_verify_steps=4, num_decode_steps=3, draft_time=0.03, verify_time=0.09)
    fused.select_in_draft, fused.decode_time = True, 0.15
    timed = _sample(9, 1.0, num_verify_steps=4, num_decode_steps=3, draft_time=0.03, select_time=0.006)
    timed.verify_time, timed.decode_time = 0.09, 0.15
    rows = summarize(
        [RunRecord("dflash2-b8", 0.0, "math", 0, [fused]), RunRecord("dflash2-b8-eager", 0.0, "math", 0, [timed])],
        ["dflash2-b8", "dflash2-b8-eager"],
    )
    compiled, eager = (
        next(r for r in rows if r.method == m and r.scope == ALL) for m in ("dflash2-b8", "dflash2-b8-eager")
    )
    assert compiled.select_in_draft and overhead_share(compiled, conv_overhead_ms=None) is None
    assert not eager.select_in_draft and overhead_share(eager, conv_overhead_ms=None) == pytest.approx(0.04)
    markdown = render_markdown(_results(rows))
    assert "| in draft |" in markdown
    assert "DFLASH2-B8, T=0: the selector runs inside the compiled drafting graph" in markdown
    assert "DFLASH2-B8-EAGER, T=0: selector + convolution overhead 4.0%" in markdown
