"""``usage`` reports prompt tokens served from the prefix cache on every generation endpoint, and the
metrics count them (the embedded SmolLM2 behind uvicorn, prefix caching on by default)."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.live_server import ServerThread, scrape

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


def counter(url: str, name: str) -> float:
    return sum(v for (metric, _), v in scrape(url).items() if metric == name)


def long_text() -> str:
    return f"Session {uuid.uuid4().hex}. " + "Notes about the sea, the sky and the mountains. " * 20


def test_cached_tokens_on_chat_completions_and_responses(real_server: ServerThread):
    url = real_server.url
    hits_before = counter(url, "dflash2_prefix_cache_hits_total")
    messages = [{"role": "system", "content": long_text()}, {"role": "user", "content": "Say hi."}]
    with httpx.Client(base_url=url, timeout=120) as client:
        body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
        first = client.post("/v1/chat/completions", json=body).json()["usage"]
        second = client.post("/v1/chat/completions", json=body).json()["usage"]
        assert second["prompt_tokens"] == first["prompt_tokens"]
        assert second["prompt_tokens_details"]["cached_tokens"] == second["prompt_tokens"] - 1
        assert first["prompt_tokens_details"]["cached_tokens"] < first["prompt_tokens"] // 2

        prompt = long_text()
        completion = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
        cold = client.post("/v1/completions", json=completion).json()["usage"]
        warm = client.post("/v1/completions", json=completion).json()["usage"]
        assert (
            warm["prompt_tokens_details"]["cached_tokens"]
            == warm["prompt_tokens"] - 1
            > cold["prompt_tokens_details"]["cached_tokens"]
        )

        responses = {"model": MODEL, "input": messages[1]["content"], "instructions": messages[0]["content"]}
        usage = client.post("/v1/responses", json={**responses, "max_output_tokens": 4}).json()["usage"]
        assert usage["input_tokens_details"]["cached_tokens"] >= first["prompt_tokens"] - 8  # the same history
    assert counter(url, "dflash2_prefix_cache_hits_total") - hits_before >= 2 * (second["prompt_tokens"] - 1)


def test_a_continued_response_reuses_the_previous_turn(real_server: ServerThread):
    """With previous_response_id, the next turn's prompt starts with the previous prompt and output, so the
    prefix cache serves at least the whole previous prompt."""
    instructions = long_text()
    with httpx.Client(base_url=real_server.url, timeout=120) as client:
        body = {"model": MODEL, "instructions": instructions, "max_output_tokens": 6, "temperature": 0}
        first = client.post("/v1/responses", json={**body, "input": "Say hi."}).json()
        second = client.post(
            "/v1/responses", json={**body, "input": "And bye?", "previous_response_id": first["id"]}
        ).json()
    assert second["previous_response_id"] == first["id"]
    previous = first["usage"]["input_tokens"]
    assert second["usage"]["input_tokens"] > previous + first["usage"]["output_tokens"]
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= previous
