"""Response shapes and SSE framing over ASGI with the fake engine (one token per step: a, b, c, …)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.server.conftest import asgi_client
from tests.server.fakes import FakeEngine

pytestmark = pytest.mark.anyio

NO_CACHE = {"prompt_tokens_details": {"cached_tokens": 0}}  # the fake engine has no prefix cache


async def sse_events(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[Any]:
    """The ``data:`` payloads of a stream, JSON-decoded ([DONE] kept as a string); checks the framing."""
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = (await response.aread()).decode()
    frames = [f for f in raw.split("\n\n") if f and not f.startswith(":")]
    assert all(f.startswith("data: ") and "\n" not in f for f in frames), raw
    payloads = [f.removeprefix("data: ") for f in frames]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]] + ["[DONE]"]


async def test_chat_stream_order_role_deltas_finish_usage_done():
    async with asgi_client() as (client, _):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        events = await sse_events(client, "/v1/chat/completions", body)
    chunks, done = events[:-1], events[-1]
    assert done == "[DONE]"
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "fake-model" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"] for c in chunks[1:4]] == [{"content": "a"}, {"content": "b"}, {"content": "c"}]
    finish = chunks[4]
    assert finish["choices"][0]["delta"] == {} and finish["choices"][0]["finish_reason"] == "length"
    assert finish["dflash2"] == {"draft_tokens": 6, "accepted_tokens": 0, "verify_steps": 2,
                                 "mean_acceptance_length": 1.0, "accepted_tokens_by_source": {}}  # fmt: skip
    usage = chunks[5]
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 19, "completion_tokens": 3, "total_tokens": 22, **NO_CACHE}
    assert len(chunks) == 6
    assert all("usage" not in c for c in chunks[:5])


async def test_completion_stream_with_echo_and_two_choices():
    async with asgi_client() as (client, _):
        body = {"prompt": "hey", "max_tokens": 2, "n": 2, "echo": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        events = await sse_events(client, "/v1/completions", body)
    chunks = events[:-1]
    texts: dict[int, str] = {0: "", 1: ""}
    finishes = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "heyab", 1: "heyab"}
    assert finishes == {0: "length", 1: "length"}
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7, **NO_CACHE}


async def test_n_choices_sum_usage_and_seed_increments():
    engine = FakeEngine()
    async with asgi_client(engine) as (client, _):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 3, "seed": 7}
        response = (await client.post("/v1/chat/completions", json=body)).json()
    assert [p.seed for p in engine.submitted] == [7, 8, 9]
    assert [c["index"] for c in response["choices"]] == [0, 1, 2]
    assert response["usage"] == {"prompt_tokens": 19, "completion_tokens": 12, "total_tokens": 31, **NO_CACHE}
    assert response["dflash2"]["verify_steps"] == 9


async def test_logprobs_shapes():
    async with asgi_client() as (client, _):
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 2}
        content = (await client.post("/v1/chat/completions", json=chat)).json()["choices"][0]["logprobs"]["content"]
        assert [t["token"] for t in content] == ["a", "b"]
        assert content[0]["bytes"] == [97] and [t["token"] for t in content[0]["top_logprobs"]] == ["a", "z"]
        completion = {"prompt": "hi", "max_tokens": 3, "logprobs": 0}
        logprobs = (await client.post("/v1/completions", json=completion)).json()["choices"][0]["logprobs"]
        assert logprobs["tokens"] == ["a", "b", "c"]
        assert logprobs["text_offset"] == [0, 1, 2]
        assert logprobs["top_logprobs"] == [{"a": -0.5}, {"b": -0.5}, {"c": -0.5}]
        plain = (await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})).json()
        assert plain["choices"][0]["logprobs"] is None


async def test_token_id_prompts_and_tokenize_round_trip():
    async with asgi_client() as (client, _):
        ids = (await client.post("/tokenize", json={"prompt": "hey"})).json()
        assert ids == {"count": 3, "max_model_len": 64, "tokens": [104, 101, 121]}
        assert (await client.post("/detokenize", json={"tokens": ids["tokens"]})).json() == {"prompt": "hey"}
        by_text = (await client.post("/v1/completions", json={"prompt": "hey", "max_tokens": 2, "echo": True})).json()
        by_ids = await client.post("/v1/completions", json={"prompt": ids["tokens"], "max_tokens": 2, "echo": True})
        assert by_ids.json()["choices"][0]["text"] == by_text["choices"][0]["text"] == "heyab"
        assert (await client.post("/tokenize", json={"prompt": "a", "messages": []})).status_code == 400
        assert (await client.post("/detokenize", json={"tokens": [-1]})).status_code == 400


async def test_openapi_schema_lists_every_endpoint():
    async with asgi_client() as (client, _):
        schema = (await client.get("/openapi.json")).json()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/health/ready", "/metrics",
                 "/tokenize", "/detokenize", "/version"):  # fmt: skip
        assert path in schema["paths"], path
    assert "ChatCompletionRequest" in schema["components"]["schemas"]
    assert "ErrorResponse" in schema["components"]["schemas"]
