"""``/metrics`` over ASGI with the fake engine: every documented metric, its labels, and that it moves."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.metrics import metric_specs
from tests.server.conftest import asgi_client

pytestmark = pytest.mark.anyio

COUNTERS = [
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos",
    "prompt_tokens",
    "generation_tokens",
    "request_success",
]
GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"]
HISTOGRAMS = [
    "acceptance_length",
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "generation_tokens_per_second",
]
VLLM_NAMES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:prompt_tokens",
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
    assert counter("spec_decode_num_accepted_tokens") == 0
    assert [counter("spec_decode_num_accepted_tokens_per_pos", position=str(p)) for p in range(3)] == [0, 0, 0]
    assert counter("prompt_tokens") == 5
    assert counter("generation_tokens") == 3
    assert counter("request_success", finished_reason="length") == 1
    assert counter("request_success", finished_reason="abort") == 0
    for gauge in GAUGES:
        assert value(after[f"dflash2_{gauge}"], f"dflash2_{gauge}") == 0
    counts = {h: value(after[f"dflash2_{h}"], f"dflash2_{h}_count") for h in HISTOGRAMS}
    assert counts == {
        "acceptance_length": 2,
        "time_to_first_token_seconds": 1,
        "inter_token_latency_seconds": 2,
        "e2e_request_latency_seconds": 1,
        "request_queue_time_seconds": 1,
        "generation_tokens_per_second": 1,
    }
    assert value(after["dflash2_acceptance_length"], "dflash2_acceptance_length_sum") == 2  # τ = 1 each step
    assert "process_resident_memory_bytes" in after


async def test_vllm_compat_exports_vllm_names_with_model_name_and_engine():
    async with asgi_client(metrics_compat="vllm") as (client, _):
        await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        exported = families((await client.get("/metrics")).text)
    for name in VLLM_NAMES:
        assert name in exported, name
        assert all(s.labels["model_name"] == "fake-model" and s.labels["engine"] == "0" for s in exported[name])
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
