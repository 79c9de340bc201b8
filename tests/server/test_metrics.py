"""``/metrics`` over ASGI with the fake engine: every documented metric, its labels, and that it moves."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from server.metrics import TOKEN_COUNT_BUCKETS, Metrics, metric_specs, token_count_buckets
from server.timings import RequestTimings
from tests.server.conftest import asgi_client
from tests.server.fakes import FAKE_THREADS, FakeEngine

pytestmark = pytest.mark.anyio

COUNTERS = [
    "spec_decode_num_drafts",
    "spec_decode_num_lookup_drafts",
    "spec_decode_num_tree_nodes",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos",
    "spec_decode_num_draft_tokens_by_source",
    "spec_decode_num_accepted_tokens_by_source",
    "prompt_tokens",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "generation_tokens",
    "request_success",
    "stored_responses_evicted",
]
GAUGES = [
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "cpu_threads",
    "model_info",
    "num_stored_responses",
    "stored_responses_bytes",
    "compiled",
    "compiled_graphs",
    "compile_seconds",
    "compile_failed",
]
HISTOGRAMS = [
    "spec_decode_draft_length",
    "spec_decode_prediction_error",
    "acceptance_length",
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "generation_tokens_per_second",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_inference_time_seconds",
    "request_time_per_output_token_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "request_params_max_tokens",
    "iteration_tokens_total",
]
VLLM_NAMES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_params_max_tokens",
    "vllm:iteration_tokens_total",
    "vllm:prompt_tokens",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
]


def families(text: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(samples: list, name: str, **labels: str) -> float:
    matches = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, (name, labels, samples)
    return matches[0]


def test_the_table_lists_exactly_the_documented_metrics():
    assert sorted(s.name for s in metric_specs(8)) == sorted(COUNTERS + GAUGES + HISTOGRAMS)


async def test_every_metric_is_exported_with_model_name_and_moves_after_a_request():
    async with asgi_client(served_model_name="served") as (client, _):
        before = families((await client.get("/metrics")).text)
        for name in COUNTERS + GAUGES + HISTOGRAMS:
            assert f"dflash2_{name}" in before, name
            assert all(s.labels["model_name"] == "served" for s in before[f"dflash2_{name}"]), name
        response = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert response.status_code == 200
        after = families((await client.get("/metrics")).text)

    def counter(name: str, **labels: str) -> float:
        return value(after[f"dflash2_{name}"], f"dflash2_{name}_total", model_name="served", **labels)

    assert counter("spec_decode_num_drafts") == 2  # the fake verifies once per token after the first
    assert counter("spec_decode_num_draft_tokens") == 6
    assert counter("spec_decode_num_lookup_drafts") == 0  # the fake drafts every step
    assert counter("spec_decode_num_accepted_tokens") == 0
    assert [counter("spec_decode_num_accepted_tokens_per_pos", position=str(p)) for p in range(3)] == [0, 0, 0]
    assert counter("prompt_tokens") == 5
    assert counter("generation_tokens") == 3
    assert counter("request_success", finished_reason="length") == 1
    assert counter("request_success", finished_reason="abort") == 0
    for gauge in GAUGES:
        expected = FAKE_THREADS if gauge == "cpu_threads" else 1 if gauge == "model_info" else 0
        assert value(after[f"dflash2_{gauge}"], f"dflash2_{gauge}") == expected, gauge
    # The fake engine holds dense weights.
    assert value(after["dflash2_model_info"], "dflash2_model_info", quantization="none") == 1
    counts = {h: value(after[f"dflash2_{h}"], f"dflash2_{h}_count") for h in HISTOGRAMS}
    assert counts == {
        "spec_decode_draft_length": 2,
        "spec_decode_prediction_error": 2,
        "acceptance_length": 2,
        "time_to_first_token_seconds": 1,
        "inter_token_latency_seconds": 2,
        "e2e_request_latency_seconds": 1,
        "request_queue_time_seconds": 1,
        "generation_tokens_per_second": 1,
        "request_prefill_time_seconds": 1,
        "request_decode_time_seconds": 1,
        "request_inference_time_seconds": 1,
        "request_time_per_output_token_seconds": 1,
        "request_prompt_tokens": 1,
        "request_generation_tokens": 1,
        "request_params_max_tokens": 1,
        "iteration_tokens_total": 3,  # prefill step, then one step per further token
    }
    assert value(after["dflash2_acceptance_length"], "dflash2_acceptance_length_sum") == 2  # τ = 1 each step
    error = after["dflash2_spec_decode_prediction_error"]  # 1 committed, 1.5 predicted: -0.5 twice (no _sum:
    bucket = "dflash2_spec_decode_prediction_error_bucket"  # prometheus omits it with negative buckets)
    assert value(error, bucket, le="-0.5") == 2 and value(error, bucket, le="-1.0") == 0
    assert "process_resident_memory_bytes" in after


def histogram(samples: list, name: str) -> dict[str, float]:
    """``{"sum": …, "count": …, "le=…": …}`` of one histogram's samples."""
    out = {"sum": value(samples, f"{name}_sum"), "count": value(samples, f"{name}_count")}
    out.update({f"le={s.labels['le']}": s.value for s in samples if s.name == f"{name}_bucket"})
    return out


async def test_request_and_step_histograms_hold_the_measured_values():
    step_delay = 0.02
    async with asgi_client(FakeEngine(step_delay=step_delay)) as (client, _):
        response = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert response.status_code == 200
        after = families((await client.get("/metrics")).text)

    def h(name: str) -> dict[str, float]:
        return histogram(after[f"dflash2_{name}"], f"dflash2_{name}")

    # Token counts: 5 prompt tokens, 3 output tokens, max_tokens 3; buckets 1-2-5… cut at max_model_len (64).
    assert h("request_prompt_tokens") == {
        "sum": 5, "count": 1, "le=1.0": 0, "le=2.0": 0, "le=5.0": 1, "le=10.0": 1, "le=20.0": 1, "le=50.0": 1,
        "le=64.0": 1, "le=+Inf": 1,
    }  # fmt: skip
    assert (h("request_generation_tokens")["sum"], h("request_generation_tokens")["le=2.0"]) == (3, 0)
    assert (h("request_generation_tokens")["le=5.0"], h("request_generation_tokens")["count"]) == (1, 1)
    assert (h("request_params_max_tokens")["sum"], h("request_params_max_tokens")["count"]) == (3, 1)
    # Per step: 5 prompt + 1 output token, then 1 output token twice.
    steps = h("iteration_tokens_total")
    assert (steps["sum"], steps["count"], steps["le=1.0"], steps["le=8.0"]) == (8, 3, 2, 3)
    tokens_total = value(after["dflash2_prompt_tokens"], "dflash2_prompt_tokens_total") + value(
        after["dflash2_generation_tokens"], "dflash2_generation_tokens_total"
    )
    assert steps["sum"] == tokens_total

    # Phases: inference = prefill + decode, TTFT = queue + prefill, TPOT = decode / (3 - 1).
    prefill, decode = h("request_prefill_time_seconds")["sum"], h("request_decode_time_seconds")["sum"]
    inference, tpot = h("request_inference_time_seconds")["sum"], h("request_time_per_output_token_seconds")["sum"]
    queue, ttft = h("request_queue_time_seconds")["sum"], h("time_to_first_token_seconds")["sum"]
    e2e = h("e2e_request_latency_seconds")["sum"]
    assert prefill >= step_delay  # the prefill step sleeps once before its token is delivered
    assert inference >= 3 * step_delay  # three steps from the prefill step's start to the last token
    assert decode > 0
    assert math.isclose(inference, prefill + decode, rel_tol=1e-9)
    assert math.isclose(ttft, queue + prefill, rel_tol=1e-9)
    assert math.isclose(tpot, decode / 2, rel_tol=1e-9)
    assert inference <= e2e
    tokens_per_second = h("generation_tokens_per_second")["sum"]
    assert math.isclose(tokens_per_second, 2 / decode, rel_tol=1e-9)


async def test_max_tokens_histogram_records_the_limit_the_engine_applied():
    engine = FakeEngine()
    async with asgi_client(engine) as (client, _):
        body = {"messages": [{"role": "user", "content": "hi"}]}  # no max_tokens: the rest of the context
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        response = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "n": 2})
        assert response.status_code == 200
        after = families((await client.get("/metrics")).text)
    (applied, *_) = (p.max_tokens for p in engine.submitted)
    assert applied == 64 - len("<user>hi<assistant>")

    def h(name: str) -> dict[str, float]:
        return histogram(after[f"dflash2_{name}"], f"dflash2_{name}")

    assert h("request_params_max_tokens")["sum"] == applied + 2 + 2  # n=2: one observation per choice
    assert h("request_params_max_tokens")["count"] == 3
    assert h("request_prompt_tokens")["sum"] == len("<user>hi<assistant>") + 5 + 5
    assert h("request_generation_tokens")["sum"] == applied + 2 + 2
    assert h("request_generation_tokens")["le=50.0"] == 3  # 45 tokens ≤ 50
    assert h("request_generation_tokens")["le=20.0"] == 2


async def test_a_failed_request_counts_its_sizes_but_has_no_phases():
    async with asgi_client() as (client, _):
        assert (await client.post("/v1/completions", json={"prompt": "FAIL", "max_tokens": 4})).status_code == 500
        after = families((await client.get("/metrics")).text)

    def h(name: str) -> dict[str, float]:
        return histogram(after[f"dflash2_{name}"], f"dflash2_{name}")

    assert value(after["dflash2_request_success"], "dflash2_request_success_total", finished_reason="error") == 1
    assert (h("request_prompt_tokens")["sum"], h("request_prompt_tokens")["count"]) == (4, 1)
    assert (h("request_generation_tokens")["sum"], h("request_generation_tokens")["count"]) == (0, 1)
    assert (h("request_params_max_tokens")["sum"], h("request_params_max_tokens")["count"]) == (4, 1)
    for name in (
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "request_time_per_output_token_seconds",
        "iteration_tokens_total",
    ):
        assert h(name)["count"] == 0, name


def test_every_finished_request_is_observed_once_phases_only_when_measured():
    registry = CollectorRegistry()
    metrics = Metrics(registry, "m", block_size=4, max_model_len=100)
    one_token = RequestTimings(arrival=10.0, num_prompt_tokens=7, max_tokens=9, scheduled=10.5, first_token=11.0)
    one_token.last_token, one_token.num_output_tokens = 11.25, 1
    metrics.on_first_token(one_token)
    aborted = RequestTimings(arrival=10.0, num_prompt_tokens=3, max_tokens=4)  # gone before its first token
    for timings, reason in ((one_token, "stop"), (aborted, "abort")):
        timings.finished, timings.finish_reason = 12.0, reason
        metrics.on_request_finished(timings)
    exported = families(generate_latest(registry).decode())

    def h(name: str) -> dict[str, float]:
        return histogram(exported[f"dflash2_{name}"], f"dflash2_{name}")

    assert (h("request_prompt_tokens")["sum"], h("request_prompt_tokens")["count"]) == (10, 2)
    assert (h("request_generation_tokens")["sum"], h("request_generation_tokens")["count"]) == (1, 2)
    assert (h("request_params_max_tokens")["sum"], h("request_params_max_tokens")["count"]) == (13, 2)
    assert h("request_params_max_tokens")["le=100.0"] == 2  # the last finite bucket is max_model_len
    assert (h("request_prefill_time_seconds")["sum"], h("request_prefill_time_seconds")["count"]) == (0.5, 1)
    assert (h("request_decode_time_seconds")["sum"], h("request_decode_time_seconds")["count"]) == (0.25, 1)
    assert (h("request_inference_time_seconds")["sum"], h("request_inference_time_seconds")["count"]) == (0.75, 1)
    assert h("request_time_per_output_token_seconds")["count"] == 0  # fewer than two tokens
    assert aborted.prefill_time is aborted.decode_time is aborted.inference_time is None


def test_time_per_output_token_is_decode_time_per_token_after_the_first():
    timings = RequestTimings(arrival=0.0, num_prompt_tokens=1, max_tokens=8, scheduled=0.5, first_token=1.0)
    timings.last_token, timings.num_output_tokens = 2.5, 4
    assert timings.time_per_output_token == 0.5
    timings.last_token = 1.0  # every token in one delivery
    assert timings.time_per_output_token == 0.0


def test_token_buckets_follow_the_1_2_5_ladder_up_to_max_model_len():
    assert token_count_buckets(64) == (1, 2, 5, 10, 20, 50, 64)
    assert token_count_buckets(4096) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 4096)
    assert token_count_buckets(1000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    assert token_count_buckets(None) == TOKEN_COUNT_BUCKETS
    specs = {s.name: s for s in metric_specs(8, max_model_len=64)}
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens"):
        assert specs[name].buckets == (1, 2, 5, 10, 20, 50, 64), name


async def test_vllm_compat_exports_vllm_names_with_model_name_and_engine():
    async with asgi_client(metrics_compat="vllm") as (client, _):
        await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        exported = families((await client.get("/metrics")).text)
    for name in VLLM_NAMES:
        assert name in exported, name
        assert all(s.labels["model_name"] == "fake-model" and s.labels["engine"] == "0" for s in exported[name])
    # Each vLLM name carries exactly the observations of its dflash2 metric.
    aliases = {f"vllm:{v}": f"dflash2_{s.name}" for s in metric_specs(4) for v in s.vllm_names}
    assert sorted(aliases) == sorted(VLLM_NAMES)

    def series(name: str) -> dict:
        """Samples by (suffix, labels without ``engine``), ``_created`` timestamps left out."""
        return {
            (s.name.removeprefix(name), tuple(sorted((k, v) for k, v in s.labels.items() if k != "engine"))): s.value
            for s in exported[name]
            if not s.name.endswith("_created")
        }

    for vllm_name, ours in aliases.items():
        assert series(vllm_name) == series(ours), vllm_name
    assert aliases["vllm:time_per_output_token_seconds"] == "dflash2_inter_token_latency_seconds"
    assert value(exported["vllm:request_prompt_tokens"], "vllm:request_prompt_tokens_sum") == 5
    assert value(exported["vllm:request_generation_tokens"], "vllm:request_generation_tokens_sum") == 3
    assert value(exported["vllm:request_params_max_tokens"], "vllm:request_params_max_tokens_sum") == 3
    assert value(exported["vllm:iteration_tokens_total"], "vllm:iteration_tokens_total_sum") == 8
    assert value(exported["vllm:iteration_tokens_total"], "vllm:iteration_tokens_total_count") == 3
    assert value(exported["vllm:time_per_output_token_seconds"], "vllm:time_per_output_token_seconds_count") == 2
    assert value(exported["vllm:spec_decode_num_drafts"], "vllm:spec_decode_num_drafts_total") == 2
    assert value(exported["vllm:generation_tokens"], "vllm:generation_tokens_total") == 3
    positions = {s.labels["position"] for s in exported["vllm:spec_decode_num_accepted_tokens_per_pos"]}
    assert positions == {"0", "1", "2"}
    assert value(exported["vllm:num_requests_running"], "vllm:num_requests_running") == 0
    assert "dflash2_num_requests_running" in exported  # ours stay


async def test_without_compat_there_are_no_vllm_names():
    async with asgi_client() as (client, _):
        text = (await client.get("/metrics")).text
    assert "vllm:" not in text
