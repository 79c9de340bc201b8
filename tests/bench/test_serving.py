"""Serving benchmark pieces: loopback-only URLs, SSE chunk parsing, level statistics, /metrics deltas, and one
real ``dflash2 serve`` subprocess on the tiny folder (started, loaded at concurrency 1, drained)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from dflash2.bench import serving
from dflash2.bench.config import BenchConfig
from dflash2.bench.serving import (
    RequestResult,
    ServerSpec,
    _chunk_events,
    acceptance_from_counters,
    add_serving_speedups,
    is_loopback_url,
    process_peak_rss_bytes,
    run_serving,
    serve_command,
    server_specs,
    started_server,
    summarize_level,
)
from dflash2.bench.single_stream import worker_spec
from dflash2.config import EngineConfig
from tests.bench.conftest import TinyFolders


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://127.0.0.1:8000", True),
        ("http://127.3.4.5:1", True),
        ("http://localhost:8000/", True),
        ("http://[::1]:8000", True),
        ("http://10.0.0.1:8000", False),
        ("http://192.168.1.2", False),
        ("http://example.com", False),
    ],
)
def test_only_loopback_urls(url: str, expected: bool) -> None:
    assert is_loopback_url(url) is expected


def test_a_non_loopback_url_is_refused_without_traffic(tmp_path: Path) -> None:
    result = run_serving(BenchConfig(url="http://10.1.2.3:8000"), [], tmp_path, lambda _: None)
    assert result.levels == [] and "loopback" in result.notes[0]


def test_chunk_parsing() -> None:
    result = RequestResult(ok=True)
    assert not _chunk_events({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, result)
    assert _chunk_events({"choices": [{"index": 0, "delta": {"content": "Hi"}}]}, result)
    assert _chunk_events({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}, result)
    usage = {"completion_tokens": 7, "prompt_tokens": 3, "total_tokens": 10}
    info = {"draft_tokens": 21, "accepted_tokens": 4, "verify_steps": 3, "mean_acceptance_length": 2.33}
    assert not _chunk_events({"choices": [], "usage": usage, "dflash2": info}, result)
    assert (result.num_output_tokens, result.num_verify_steps, result.num_accepted_tokens) == (7, 3, 4)
    _chunk_events({"error": {"message": "boom"}}, result)
    assert not result.ok and result.error == "boom"


def test_level_statistics() -> None:
    results = [
        RequestResult(
            ok=True,
            seconds=1.0,
            ttft=0.1,
            num_output_tokens=10,
            chunk_gaps=[0.1] * 9,
            num_verify_steps=3,
            num_accepted_tokens=6,
        ),
        RequestResult(
            ok=True,
            seconds=2.0,
            ttft=0.3,
            num_output_tokens=18,
            chunk_gaps=[0.2] * 5,
            num_verify_steps=5,
            num_accepted_tokens=12,
        ),
        RequestResult(ok=False, error="HTTP 500: x"),
    ]
    level = summarize_level("dflash2-b8", 2, results, seconds=4.0)
    assert (level.num_requests, level.num_errors, level.errors) == (3, 1, ["HTTP 500: x"])
    assert level.output_tokens_per_second == pytest.approx(7.0)  # 28 tokens / 4 s
    assert level.ttft_p50_ms == pytest.approx(200.0)
    assert level.itl_p50_ms == pytest.approx(100.0)
    assert level.tau == pytest.approx((18 + 8) / 8)
    assert level.tpot_mean_ms == pytest.approx((0.9 / 9 + 1.7 / 17) / 2 * 1e3)
    ar = summarize_level("ar", 2, [RequestResult(ok=True, seconds=1, ttft=0.1, num_output_tokens=14)], seconds=4.0)
    add_serving_speedups([ar, level])
    assert level.speedup_vs_ar == pytest.approx(2.0) and ar.speedup_vs_ar == pytest.approx(1.0)


def test_acceptance_from_metric_deltas() -> None:
    name = "dflash2_spec_decode_num_accepted_tokens_per_pos_total"
    before = {"dflash2_spec_decode_num_drafts_total": 10, "dflash2_spec_decode_num_accepted_tokens_total": 5}
    before |= {f"{name}{{0}}": 4, f"{name}{{1}}": 1}
    after = {"dflash2_spec_decode_num_drafts_total": 20, "dflash2_spec_decode_num_accepted_tokens_total": 20}
    after |= {f"{name}{{0}}": 12, f"{name}{{1}}": 6, f"{name}{{2}}": 2}
    tau, per_position = acceptance_from_counters(before, after)
    assert tau == pytest.approx(2.5)
    assert per_position == pytest.approx([0.8, 0.5, 0.2])
    assert acceptance_from_counters(after, after) == (None, [])


def test_server_specs_follow_the_methods() -> None:
    config = BenchConfig(methods=("ar", "dflash2", "hf"), block_sizes=(16, 8))
    assert server_specs(config) == [ServerSpec("ar", 1), ServerSpec("dflash2-b16", 16, True)]
    assert server_specs(BenchConfig(methods=("dflash",), block_sizes=(8,))) == [ServerSpec("dflash-b8", 8, False)]
    assert server_specs(BenchConfig(url="http://127.0.0.1:9/")) == [ServerSpec("url", url="http://127.0.0.1:9")]
    command = serve_command(BenchConfig(engine=EngineConfig(num_threads=1)), ServerSpec("dflash-b8", 8, False), 1234)
    assert command[3:8] == ["serve", "--host", "127.0.0.1", "--port", "1234"]
    assert "--no-selector" in command and "--model" not in command
    assert command[command.index("--max-num-seqs") + 1] == "8"
    assert "--enforce-eager" not in command
    eager = serve_command(BenchConfig(engine=EngineConfig(enforce_eager=True)), ServerSpec("ar", 1), 1234)
    assert "--enforce-eager" in eager
    # Prompt lookup: the run's bounds go to the speculative server only (the engine's default unless given).
    assert not any(flag.startswith("--prompt-lookup") for flag in command + eager)
    lookup = BenchConfig(engine=EngineConfig(prompt_lookup_max=6, prompt_lookup_min=3))
    command = serve_command(lookup, ServerSpec("dflash2-b8", 8), 1234)
    assert command[command.index("--prompt-lookup-max") + 1] == "6"
    assert command[command.index("--prompt-lookup-min") + 1] == "3"


def test_a_real_dflash2_serve_subprocess(tiny_folders: TinyFolders, tmp_path: Path) -> None:
    engine = EngineConfig(model=str(tiny_folders.model), num_threads=1, max_model_len=512)
    config = BenchConfig(engine=engine, max_tokens=4, concurrency=(1,), serving_requests=1, serving_seconds=30)
    messages = [[{"role": "user", "content": "Hello"}]]
    with started_server(config, ServerSpec("ar", 1), tmp_path / "serve.log") as server:
        assert server.url.startswith("http://127.0.0.1:")
        model = serving._model_name(server.url)
        serving.warm_up(server.url, model, messages, config)
        results, seconds = serving.run_server_round(config, "ar", server.url, model, messages, 1, lambda _: None)
        levels = [serving.summarize_level("ar", 1, results, seconds)]
        assert (process_peak_rss_bytes(server.process.pid) or 0) > 10e6
    assert server.process.returncode is not None  # stopped (SIGTERM, drained)
    assert len(levels) == 1 and levels[0].num_errors == 0, levels[0].errors
    assert levels[0].tau == pytest.approx(1.0)


def test_eager_rows_sit_beside_their_compiled_method() -> None:
    config = BenchConfig(methods=("ar", "dflash2", "llama.cpp"), block_sizes=(8,), adaptive_rows=False, tree_nodes=())
    specs = config.method_specs()
    assert [s.id for s in specs] == ["ar", "ar-eager", "dflash2-b8", "dflash2-b8-eager", "llama.cpp"]
    assert [s.enforce_eager for s in specs[:4]] == [False, True, False, True]
    assert specs[3].label.endswith(", eager") and config.engine_config(8, True, enforce_eager=True).enforce_eager
    assert [s.id for s in BenchConfig(methods=("ar",), eager_rows=False).method_specs()] == ["ar"]
    eager_run = BenchConfig(methods=("ar",), engine=EngineConfig(enforce_eager=True)).method_specs()
    assert [(s.id, s.enforce_eager) for s in eager_run] == [("ar", True)]


def test_adaptive_rows_run_the_policy_beside_full_blocks() -> None:
    """The engine's default (the policy chooses the verify width up to B) beside the full-block rows,
    compiled only; the worker's engine config says which."""
    config = BenchConfig(methods=("dflash", "dflash2"), block_sizes=(8, 16))
    specs = {s.id: s for s in config.method_specs()}
    assert list(specs) == [
        "dflash-b8",
        "dflash-b8-eager",
        "dflash-b16",
        "dflash-b16-eager",
        "dflash2-b8",
        "dflash2-b8-eager",
        "dflash2-b8-tree-16",
        "dflash2-b8-adaptive",
        "dflash2-b8-adaptive-no-lookup",
        "dflash2-b8-adaptive-tree-16",
        "dflash2-b16",
        "dflash2-b16-eager",
        "dflash2-b16-tree-16",
        "dflash2-b16-adaptive",
        "dflash2-b16-adaptive-no-lookup",
        "dflash2-b16-adaptive-tree-16",
    ]
    adaptive = specs["dflash2-b8-adaptive"]
    assert adaptive.adaptive and adaptive.use_selector and adaptive.prompt_lookup
    assert adaptive.label == "DFlash 2, selector on (B≤8, adaptive, prompt lookup)"
    assert specs["dflash2-b8-adaptive-no-lookup"].label == "DFlash 2, selector on (B≤8, adaptive)"
    tree = specs["dflash2-b8-tree-16"]  # full blocks, no policy: the tree's own acceptance
    assert (tree.tree_topk, tree.tree_nodes, tree.adaptive) == (4, 16, False)
    assert tree.label == "DFlash 2, token tree (B=8, K=4, N=16)"
    adaptive_tree = specs["dflash2-b8-adaptive-tree-16"]  # the default with trees on
    assert (adaptive_tree.tree_topk, adaptive_tree.tree_nodes) == (4, 16)
    assert adaptive_tree.adaptive and adaptive_tree.prompt_lookup
    assert adaptive_tree.label == "DFlash 2, token tree or chain (B≤8, K=4, N=16, adaptive, prompt lookup)"
    workload = types.SimpleNamespace(folder=Path("unused"))
    engines = {
        id_: worker_spec(config, specs[id_], workload, [], None)["engine"]  # type: ignore[arg-type]
        for id_ in (
            "dflash2-b8",
            "dflash2-b8-adaptive",
            "dflash2-b8-adaptive-no-lookup",
            "dflash2-b8-tree-16",
            "dflash2-b8-adaptive-tree-16",
        )
    }
    assert engines["dflash2-b8-adaptive-tree-16"]["speculative_adaptive"] is True
    assert engines["dflash2-b8-adaptive-tree-16"]["speculative_num_draft_tokens"] == 16
    assert engines["dflash2-b8-adaptive-tree-16"]["prompt_lookup_max"] is None
    tree_engine = engines["dflash2-b8-tree-16"]
    assert (tree_engine["speculative_topk"], tree_engine["speculative_num_draft_tokens"]) == (4, 16)
    assert (
        engines["dflash2-b8"]["speculative_topk"] == 1 and engines["dflash2-b8"]["speculative_num_draft_tokens"] is None
    )
    assert engines["dflash2-b8-adaptive"]["speculative_adaptive"] is True
    assert engines["dflash2-b8"]["speculative_adaptive"] is False
    assert engines["dflash2-b8-adaptive"]["block_size"] == 8
    # The adaptive row keeps the engine's default (None: on); the others run without lookup.
    assert engines["dflash2-b8-adaptive"]["prompt_lookup_max"] is None
    assert engines["dflash2-b8-adaptive-no-lookup"]["prompt_lookup_max"] == 0
    assert engines["dflash2-b8"]["prompt_lookup_max"] == 0
    bounds = BenchConfig(engine=EngineConfig(prompt_lookup_min=3), methods=("dflash2",), block_sizes=(8,))
    by_id = {s.id: s for s in bounds.method_specs()}
    assert worker_spec(bounds, by_id["dflash2-b8-adaptive"], workload, [], None)["engine"]["prompt_lookup_min"] == 3
    assert worker_spec(bounds, by_id["dflash2-b8"], workload, [], None)["engine"]["prompt_lookup_min"] is None
    # A run without prompt lookup has one adaptive row per B.
    no_lookup = EngineConfig(prompt_lookup_max=0)
    off = BenchConfig(engine=no_lookup, methods=("dflash2",), block_sizes=(8,), eager_rows=False, tree_nodes=())
    assert [s.id for s in off.method_specs()] == ["dflash2-b8", "dflash2-b8-adaptive"]
    no_rows = BenchConfig(methods=("dflash2",), block_sizes=(8,), adaptive_rows=False, eager_rows=False, tree_nodes=())
    assert [s.id for s in no_rows.method_specs()] == ["dflash2-b8"]


def test_startup_table_reports_ready_and_compiled_times() -> None:
    from dflash2.bench.report import startup_table

    results = {
        "startup": {
            "block_size": 8,
            "max_num_seqs": 8,
            "cold": {"seconds": 90.5, "compiled": True, "compile_seconds": {"t": 60.0}},
            "warm": {"error": "not ready within 1800 s"},
        }
    }
    table = "\n".join(startup_table(results))
    assert "| cold | 90.5 | yes | t 60.0 s |" in table and "not ready within 1800 s" in table
    results["startup"]["warm"] = {
        "seconds": 20.0,
        "compiled": True,
        "compile_seconds": {"t": 1.5},
        "graph_sources": {"t": "loaded"},
    }
    assert "| warm | 20.0 | yes | t 1.5 s (loaded) |" in "\n".join(startup_table(results))
    assert startup_table({}) == []


@pytest.mark.parametrize("adaptive", [True, False])
def test_startup_runs_the_servers_engine_cold_then_warm(monkeypatch: pytest.MonkeyPatch, adaptive: bool) -> None:
    """Both starts share one fresh cache folder and build the speculative server's engine: its slots and
    its adaptive policy (whose step-cost timing is part of getting ready)."""
    import json
    import subprocess

    from dflash2.bench import startup

    calls: list[tuple[dict, str]] = []

    def fake_run(command, env, **kwargs):
        calls.append((json.loads(command[-1]), env["TORCHINDUCTOR_CACHE_DIR"]))
        report = {"seconds": 1.0 + len(calls), "compiled": True, "compile_seconds": {}}
        return subprocess.CompletedProcess(command, 0, stdout=json.dumps(report) + "\n", stderr="")

    monkeypatch.setattr(startup.subprocess, "run", fake_run)
    config = BenchConfig(engine=EngineConfig(max_num_seqs=8, speculative_adaptive=adaptive), block_sizes=(8,))
    result = startup.measure_startup(config, lambda message: None)
    assert [run["seconds"] for run in (result["cold"], result["warm"])] == [2.0, 3.0]
    (first, cache), (second, cache_again) = calls
    assert first == second and cache == cache_again
    assert first["max_num_seqs"] == 8 and first["block_size"] == 8
    assert first["speculative_adaptive"] is adaptive


def fake_servers(monkeypatch: pytest.MonkeyPatch, server, round_) -> None:
    """``run_serving`` against stand-ins: ``server`` for ``started_server``, ``round_`` for each round."""
    monkeypatch.setattr(serving, "started_server", server)
    monkeypatch.setattr(serving, "warm_up", lambda url, model, prompts, config: None)
    monkeypatch.setattr(serving, "_model_name", lambda url: "m")
    monkeypatch.setattr(serving, "run_server_round", round_)
    monkeypatch.setattr(serving, "scrape_counters", lambda url: {})
    monkeypatch.setattr(serving, "process_peak_rss_bytes", lambda pid: None)


def test_servers_run_side_by_side_and_levels_interleave(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every server is up before the first level; then c = 1 on each server, c = 2 on each, …; the
    report keeps the servers' order. A server that fails a level is dropped from later ones."""
    import contextlib

    calls: list[tuple[str, int]] = []
    running: set[str] = set()

    @contextlib.contextmanager
    def fake_server(config, spec, log_path, extra_args=()):
        running.add(spec.id)
        yield serving.RunningServer(f"http://127.0.0.1:1/{spec.id}", type("P", (), {"pid": 1})(), ["py", "-m", "x"])
        running.discard(spec.id)

    def fake_round(config, server, url, model, prompts, concurrency, progress):
        assert running == {"ar", "dflash2-b8"}  # both servers are up for every level
        calls.append((server, concurrency))
        if server == "ar" and concurrency == 4:
            raise RuntimeError("the server went away")
        return [], 1.0

    fake_servers(monkeypatch, fake_server, fake_round)
    config = BenchConfig(methods=("ar", "dflash2"), block_sizes=(8,), concurrency=(1, 2, 4, 8))
    result = serving.run_serving(config, [], tmp_path, lambda _: None)
    assert calls == [
        ("ar", 1), ("dflash2-b8", 1), ("ar", 2), ("dflash2-b8", 2), ("ar", 4), ("dflash2-b8", 4), ("dflash2-b8", 8)
    ]  # fmt: skip
    assert [(lv.server, lv.concurrency) for lv in result.levels] == [
        ("ar", 1), ("ar", 2), ("dflash2-b8", 1), ("dflash2-b8", 2), ("dflash2-b8", 4), ("dflash2-b8", 8)
    ]  # fmt: skip
    assert result.notes == ["ar: the server went away"]
    assert set(result.servers) == {"ar", "dflash2-b8"} and not running


def test_rounds_alternate_the_servers_and_report_the_median(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Three rounds per level: order A B, B A, A B; tokens/s is the median round, × AR the median of
    the paired ratios (not the ratio of the medians), latencies over every round's requests."""
    import contextlib

    calls: list[str] = []
    # tokens per round: (ar, dflash2) — the host slows down in round 2 for both
    tokens = {"ar": [100, 50, 90], "dflash2-b8": [110, 60, 80]}

    @contextlib.contextmanager
    def fake_server(config, spec, log_path, extra_args=()):
        yield serving.RunningServer(f"http://127.0.0.1:1/{spec.id}", type("P", (), {"pid": 1})(), ["py", "-m", "x"])

    def fake_round(config, server, url, model, prompts, concurrency, progress):
        round_index = sum(1 for c in calls if c == server)
        calls.append(server)
        result = RequestResult(
            ok=True, seconds=1.0, ttft=0.1 * (round_index + 1), num_output_tokens=tokens[server][round_index]
        )
        return [result], 1.0

    fake_servers(monkeypatch, fake_server, fake_round)
    config = BenchConfig(methods=("ar", "dflash2"), block_sizes=(8,), concurrency=(2,), serving_rounds=3)
    result = serving.run_serving(config, [], tmp_path, lambda _: None)
    assert calls == ["ar", "dflash2-b8", "dflash2-b8", "ar", "ar", "dflash2-b8"]
    ar, spec = result.levels
    assert (ar.server, spec.server) == ("ar", "dflash2-b8")
    assert ar.round_tokens_per_second == [100, 50, 90] and ar.output_tokens_per_second == 90
    assert spec.output_tokens_per_second == 80 and spec.num_requests == 3
    assert spec.speedup_vs_ar == pytest.approx(1.1)  # median of 1.1, 1.2, 0.889; the medians' ratio is 0.889
    assert ar.speedup_vs_ar == pytest.approx(1.0)
    assert spec.ttft_p50_ms == pytest.approx(200.0)  # over the three rounds' requests


def test_serving_rounds_flag_reaches_the_config() -> None:
    from dflash2.cli import build_parser

    args = build_parser().parse_args(["bench", "--serving-rounds", "3"])
    assert args.serving_rounds == 3 and not args.adaptive_threads  # the bench compares at fixed threads
    assert build_parser().parse_args(["bench", "--adaptive-threads"]).adaptive_threads
    assert build_parser().parse_args(["serve"]).adaptive_threads
    fixed = BenchConfig(engine=EngineConfig(adaptive_threads=False))
    assert "--no-adaptive-threads" in serve_command(fixed, ServerSpec("ar", 1), 1234)
    assert not fixed.engine_config(8, True).adaptive_threads  # the single-stream workers too
    assert "--no-adaptive-threads" in serve_command(BenchConfig(), ServerSpec("ar", 1), 1234)  # the default
    governed = BenchConfig(engine=EngineConfig(adaptive_threads=True))
    assert "--adaptive-threads" in serve_command(governed, ServerSpec("ar", 1), 1234)
    with pytest.raises(ValueError, match="serving_rounds"):
        BenchConfig(serving_rounds=0)


def test_a_server_that_fails_mid_level_is_dropped_and_ratios_against_it_are_none(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The AR server fails in round 2 of 3: it runs no further round or level, reports no level at
    c = 2, and the other server's levels there have no × AR (no paired rounds to compare)."""
    import contextlib

    calls: list[tuple[str, int]] = []

    @contextlib.contextmanager
    def fake_server(config, spec, log_path, extra_args=()):
        yield serving.RunningServer(f"http://127.0.0.1:1/{spec.id}", type("P", (), {"pid": 1})(), ["py", "-m", "x"])

    def fake_round(config, server, url, model, prompts, concurrency, progress):
        calls.append((server, concurrency))
        if server == "ar" and calls.count(("ar", 2)) == 2:
            raise RuntimeError("the server went away")
        return [RequestResult(ok=True, seconds=1.0, ttft=0.1, num_output_tokens=10)], 1.0

    fake_servers(monkeypatch, fake_server, fake_round)
    config = BenchConfig(methods=("ar", "dflash2"), block_sizes=(8,), concurrency=(1, 2, 4), serving_rounds=3)
    result = serving.run_serving(config, [], tmp_path, lambda _: None)
    at_two = [server for server, c in calls if c == 2]
    assert at_two == ["ar", "dflash2-b8", "dflash2-b8", "ar", "dflash2-b8"]  # round 3: only the survivor
    assert [server for server, c in calls if c == 4] == ["dflash2-b8"] * 3
    assert [(lv.server, lv.concurrency) for lv in result.levels] == [
        ("ar", 1), ("dflash2-b8", 1), ("dflash2-b8", 2), ("dflash2-b8", 4)
    ]  # fmt: skip
    assert result.levels[1].speedup_vs_ar == pytest.approx(1.0)
    assert result.levels[2].speedup_vs_ar is None and result.levels[3].speedup_vs_ar is None
    assert result.notes == ["ar: the server went away"]


def test_the_report_says_when_serving_figures_are_medians_over_rounds() -> None:
    from dflash2.bench.report import render_markdown

    level = summarize_level("ar", 1, [RequestResult(ok=True, seconds=1, ttft=0.1, num_output_tokens=5)], 1.0, [4, 5, 6])
    from tests.bench.test_stats import _results

    results = _results([])
    results["config"]["serving_rounds"] = 3
    results["serving"] = {"levels": [level.to_dict()], "servers": {}, "notes": []}
    markdown = render_markdown(results)
    assert "3 rounds per level" in markdown and "| ar | 1 | 1 | 0 | 5.0 |" in markdown
    results["config"]["serving_rounds"] = 1
    assert "rounds per level" not in render_markdown(results)


def test_tensor_parallel_rows_split_the_baseline_and_the_default() -> None:
    config = BenchConfig(methods=("ar", "dflash2"), block_sizes=(8,), tree_nodes=(), tensor_parallel_rows=(2,))
    specs = {s.id: s for s in config.method_specs()}
    assert [i for i in specs if i.endswith("-tp2")] == ["ar-tp2", "dflash2-b8-adaptive-tp2"]
    assert specs["ar-tp2"].label == "dflash2 engine, autoregressive (B=1), TP 2"
    workload = types.SimpleNamespace(folder=Path("unused"))
    engines = {i: worker_spec(config, specs[i], workload, [], None)["engine"] for i in specs}  # type: ignore[arg-type]
    assert engines["ar-tp2"]["tensor_parallel_size"] == 2 and engines["ar"]["tensor_parallel_size"] == 1
    assert engines["dflash2-b8-adaptive-tp2"]["speculative_adaptive"] is True
    # The run's own --tensor-parallel-size reaches every engine row and the servers.
    split = BenchConfig(methods=("ar",), engine=EngineConfig(tensor_parallel_size=2))
    assert split.engine_config(1, True).tensor_parallel_size == 2
    server = serving.serve_command(split, serving.ServerSpec("ar"), 8000)
    assert server[server.index("--tensor-parallel-size") + 1] == "2"
    trees = BenchConfig(engine=EngineConfig(speculative_topk=4, speculative_num_draft_tokens=16))
    speculative = serving.serve_command(trees, serving.ServerSpec("dflash2-b8", 8), 8000)
    assert speculative[speculative.index("--speculative-topk") + 1] == "4"
    assert speculative[speculative.index("--speculative-num-draft-tokens") + 1] == "16"
    assert "--speculative-topk" not in serving.serve_command(trees, serving.ServerSpec("ar"), 8000)
    with pytest.raises(ValueError, match="tensor-parallel rows"):
        BenchConfig(tensor_parallel_rows=(1,))


def test_quantization_rows_hold_the_baseline_and_the_default_each_way() -> None:
    config = BenchConfig(
        methods=("ar", "dflash2", "llama.cpp"),
        block_sizes=(8,),
        tree_nodes=(),
        quantization_rows=("none", "int8"),
        gguf_types=("Q4_1", "Q8_0"),
    )
    specs = {s.id: s for s in config.method_specs()}
    assert [i for i in specs if "-quant-" in i] == [
        "ar-quant-none",
        "dflash2-b8-adaptive-quant-none",
        "ar-quant-int8",
        "dflash2-b8-adaptive-quant-int8",
    ]
    assert [i for i in specs if i.startswith("llama.cpp")] == ["llama.cpp", "llama.cpp-Q4_1", "llama.cpp-Q8_0"]
    assert specs["ar-quant-int8"].label == "dflash2 engine, autoregressive (B=1), weights int8"
    assert specs["llama.cpp-Q8_0"].label == "llama.cpp (llama-cpp-python) on Q8_0"
    workload = types.SimpleNamespace(folder=Path("unused"))
    engines = {
        i: worker_spec(config, specs[i], workload, [], None)["engine"] for i in specs if specs[i].runner == "engine"
    }  # type: ignore[arg-type]
    assert engines["ar-quant-none"]["quantization"] == "none" and engines["ar"]["quantization"] == "auto"
    assert engines["dflash2-b8-adaptive-quant-int8"]["speculative_adaptive"] is True
    server = serving.serve_command(
        BenchConfig(engine=EngineConfig(quantization="int4")), serving.ServerSpec("ar"), 8000
    )
    assert server[server.index("--quantization") + 1] == "int4"
    with pytest.raises(ValueError, match="quantization-rows"):
        BenchConfig(quantization_rows=("fp8",))
    with pytest.raises(ValueError, match="--gguf-types"):
        BenchConfig(gguf_types=("Q2_K",))


def test_serving_requests_carry_no_seed_so_the_adaptive_policy_runs():
    """A seeded request verifies full blocks without lookup whatever the load: the serving load leaves
    the seed to each server's --seed."""
    payload = serving.request_payload("m", [{"role": "user", "content": "hi"}], 32, 0.0)
    assert "seed" not in payload
    assert payload["stream"] is True and payload["max_tokens"] == 32 and payload["temperature"] == 0.0
