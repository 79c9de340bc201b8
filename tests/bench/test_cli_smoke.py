"""``dflash2 bench`` end to end on the tiny folders: every engine method and transformers in worker
processes (a few tokens, one repetition), serving at concurrency 1 and 2 against a server on loopback,
and the report files. Nothing here asserts a speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash2.cli import main
from dflash2.config import EngineConfig
from dflash2.engine import Engine
from tests.bench.conftest import TinyFolders
from tests.live_server import ServerThread

METHOD_IDS = [
    "ar",
    "dflash-b4",
    "dflash2-b4",
    "dflash2-b4-tree-6",
    "dflash2-b4-adaptive",
    "dflash2-b4-adaptive-no-lookup",
    "dflash2-b4-adaptive-tree-6",
    "hf",
]


@pytest.fixture(scope="module")
def bench_run(tiny_folders: TinyFolders, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
    out = tmp_path_factory.mktemp("bench-out")
    engine = Engine.from_config(
        EngineConfig(
            model=str(tiny_folders.model),
            drafter=str(tiny_folders.drafter),
            block_size=4,
            max_num_seqs=2,
            device="cpu",
            dtype="float32",
            enforce_eager=True,
            speculative_adaptive=False,  # full blocks, so acceptance shows up in the serving numbers
        )
    )
    argv = ["bench", "--model", str(tiny_folders.model), "--drafter", str(tiny_folders.drafter), "--threads", "1"]
    argv += ["--out", str(out), "--sets", "math", "multiturn", "--num-prompts", "1", "--max-tokens", "6"]
    argv += [
        "--repeats",
        "1",
        "--block-sizes",
        "4",
        "--temperatures",
        "0",
        "1",
        "--tree-nodes",
        "6",
        "--tree-topk",
        "2",
    ]
    argv += ["--methods", "ar", "dflash", "dflash2", "hf", "llama.cpp", "--enforce-eager", "--no-startup"]
    with ServerThread(engine, max_concurrency=8) as server:
        argv += ["--url", server.url, "--concurrency", "1", "2", "--serving-requests", "2", "--serving-seconds", "30"]
        status = main(argv)
    return status, out


def test_writes_every_file(bench_run: tuple[int, Path]) -> None:
    status, out = bench_run
    assert status == 0
    for name in ["results.json", "results.md", "speed_by_method.png", "speedup_vs_concurrency.png", "acceptance.png"]:
        assert (out / name).stat().st_size > 0, name
    for method in METHOD_IDS:
        assert (out / "logs" / f"{method}.log").is_file()


def test_every_method_ran_or_says_why_not(bench_run: tuple[int, Path]) -> None:
    results = json.loads((bench_run[1] / "results.json").read_text())
    methods = {m["id"]: m for m in results["single_stream"]["methods"]}
    assert [m for m in methods if m != "llama.cpp"] == METHOD_IDS
    for method in METHOD_IDS:
        assert methods[method]["status"] == "ok", methods[method]["message"]
        assert methods[method]["peak_rss_bytes"] > 10e6
    # llama.cpp: not installed here, or installed but the tiny folder has no GGUF; either way a clear skip
    assert methods["llama.cpp"]["status"] == "skipped"
    assert "llama-cpp-python" in methods["llama.cpp"]["message"] or "--gguf" in methods["llama.cpp"]["message"]
    assert methods["dflash2-b4"]["conv_probe"]["overhead_ms"] is not None
    assert methods["dflash2-b4"]["info"]["has_selector"] and not methods["dflash-b4"]["info"]["use_selector"]
    assert methods["dflash2-b4-adaptive"]["adaptive"] and not methods["dflash2-b4"]["adaptive"]
    # The adaptive row runs the engine's default, prompt lookup on; its twin shows what lookup adds.
    assert methods["dflash2-b4-adaptive"]["prompt_lookup"] and methods["dflash2-b4-adaptive-no-lookup"]["adaptive"]
    assert not methods["dflash2-b4-adaptive-no-lookup"]["prompt_lookup"] and not methods["dflash2-b4"]["prompt_lookup"]
    tree = methods["dflash2-b4-tree-6"]
    assert (tree["tree_topk"], tree["tree_nodes"], tree["adaptive"]) == (2, 6, False)
    assert methods["dflash2-b4"]["tree_topk"] == 1


def test_rows_and_speedups_come_from_the_measured_numbers(bench_run: tuple[int, Path]) -> None:
    results = json.loads((bench_run[1] / "results.json").read_text())
    rows = [r for r in results["single_stream"]["rows"] if r["scope"] == "all"]
    assert [(r["method"], r["temperature"]) for r in rows] == [(m, t) for t in (0.0, 1.0) for m in METHOD_IDS]
    for row in rows:
        ar = next(r for r in rows if r["method"] == "ar" and r["temperature"] == row["temperature"])
        hf = next(r for r in rows if r["method"] == "hf" and r["temperature"] == row["temperature"])
        assert row["tokens_per_second"] > 0
        assert row["speedups"]["ar"] == pytest.approx(row["tokens_per_second"] / ar["tokens_per_second"])
        assert row["speedups"]["hf"] == pytest.approx(row["tokens_per_second"] / hf["tokens_per_second"])
        assert row["speedups"]["llama.cpp"] is None
    for row in rows:
        if row["method"].startswith("dflash"):
            assert row["tau"] >= 1.0 and len(row["acceptance_per_position"]) == 3
            assert row["cycle_ms"] > 0 and row["verify_ms"] > 0
            # The adaptive policy may verify without drafts on a tiny random model (a random drafter).
            assert row["draft_ms"] > 0 or "-adaptive" in row["method"]
    records = results["single_stream"]["records"]
    assert len(records) == 2 * 2 * len(METHOD_IDS)  # 2 temperatures × 2 sets × methods, one repetition
    assert all(1 <= s["num_output_tokens"] <= 6 for r in records for s in r["samples"])


def test_markdown_has_the_expected_tables(bench_run: tuple[int, Path]) -> None:
    markdown = (bench_run[1] / "results.md").read_text()
    assert "- Command: `dflash2 bench --model" in markdown
    assert "## Machine" in markdown and "torch " in markdown
    for label in [  # the run passes --enforce-eager: its engine rows say so
        "dflash2 engine, autoregressive (B=1), eager",
        "DFlash, selector off (B=4), eager",
        "DFlash 2, selector on (B=4), eager",
        "DFlash 2, selector on (B≤4, adaptive, prompt lookup), eager",
        "DFlash 2, selector on (B≤4, adaptive), eager",
        "transformers generate",
    ]:
        assert f"| {label} | 0 |" in markdown and f"| {label} | 1 |" in markdown
    assert "selector + convolution overhead" in markdown
    assert "### Cost per draft–verify cycle" in markdown and "## Serving" in markdown


def test_serving_levels(bench_run: tuple[int, Path]) -> None:
    results = json.loads((bench_run[1] / "results.json").read_text())
    levels = results["serving"]["levels"]
    assert [(lv["server"], lv["concurrency"]) for lv in levels] == [("url", 1), ("url", 2)]
    for level in levels:
        assert level["num_requests"] == 2 and level["num_errors"] == 0, level["errors"]
        assert level["output_tokens_per_second"] > 0 and level["ttft_p50_ms"] > 0
        assert level["tau"] >= 1.0 and level["tau_metrics"] >= 1.0
        assert len(level["acceptance_per_position"]) == 3
