"""The error table over ASGI with a fake engine: every bad input maps to one status and one envelope."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import httpx
import jinja2.exceptions
import pytest

from server.app import create_app
from server.chat_template import template_error_message
from server.engine_client import EngineClient
from server.settings import ServerSettings
from tests.live_server import ServerThread
from tests.server.conftest import asgi_client, wait_for
from tests.server.fakes import FakeEngine

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": MESSAGES, "max_tokens": 3, **fields}


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


async def test_malformed_json_is_400():
    async with asgi_client() as (client, _):
        response = await client.post(CHAT, content=b'{"messages": [', headers={"content-type": "application/json"})
        error = assert_error(response, 400)
        assert error["type"] == "invalid_request_error"
        assert "malformed JSON" in error["message"]
        assert_error(await client.post(CHAT, json=["not", "an", "object"]), 400)
        assert_error(await client.post(CHAT, content=b"", headers={"content-type": "application/json"}), 400)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),  # no silent coercion from strings
        ({"n": True}, "n"),
        ({"stop": [1, 2]}, "stop"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
    ],
)
async def test_wrong_types_are_400_naming_the_field(fields, param):
    async with asgi_client() as (client, _):
        assert_error(await client.post(CHAT, json=chat_body(**fields)), 400, param=param)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 100000}, "top_k"),  # above the vocabulary
        ({"top_k": 2**70}, "top_k"),  # beyond int64
        ({"min_p": 1.5}, "min_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"seed": -1}, "seed"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"100000": 1}}, "logit_bias"),
        ({"stop_token_ids": [100000]}, "stop_token_ids"),
        ({"stop": [""]}, "stop"),
        ({"min_tokens": 5}, "min_tokens"),  # above max_tokens=3
        ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # needs stream: true
        ({"max_tokens": 3, "max_completion_tokens": 4}, "max_tokens"),
        ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"chat_template": "{% for i in range(9) %}{% endfor %}"}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"padding": "max_length", "max_length": 10**7}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"enable_thinking": {"nested": True}}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"enable_thinking": "x" * 257}}, "chat_template_kwargs"),
    ],
)
async def test_out_of_range_values_are_400_naming_the_field(fields, param):
    async with asgi_client() as (client, _):
        assert_error(await client.post(CHAT, json=chat_body(**fields)), 400, param=param)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, chat_body(functions=[{"name": "f"}]), "functions"),  # the legacy form of tools
        (CHAT, chat_body(modalities=["text", "audio"]), "modalities"),
        (CHAT, chat_body(echo=True), "echo"),  # a completions-only field
        (CHAT, chat_body(messages=[{"role": "user", "content": "hi", "audio": {}}]), "messages[0].audio"),
        (CHAT, chat_body(stream_options={"include_usage": True, "continuous_usage_stats": True}, stream=True),
         "stream_options.continuous_usage_stats"),
        (COMPLETIONS, {"prompt": "hi", "suffix": "!"}, "suffix"),
        (COMPLETIONS, {"prompt": "hi", "best_of": 2}, "best_of"),
    ],
)  # fmt: skip
async def test_unknown_fields_are_400_naming_the_field(path, body, param):
    async with asgi_client() as (client, _):
        error = assert_error(await client.post(path, json=body), 400, param=param)
        assert param in error["message"]


async def test_non_text_content_parts_are_rejected():
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    async with asgi_client() as (client, _):
        response = await client.post(CHAT, json=chat_body(messages=[{"role": "user", "content": [image]}]))
        error = assert_error(response, 400, param="messages[0].content")
        assert "image_url" in error["message"]
        parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
        ok = await client.post(CHAT, json=chat_body(messages=[{"role": "user", "content": parts}]))
        assert ok.status_code == 200, ok.text


async def test_empty_prompt_and_messages_are_400():
    async with asgi_client() as (client, _):
        assert_error(await client.post(CHAT, json=chat_body(messages=[])), 400, param="messages")
        assert_error(await client.post(COMPLETIONS, json={"prompt": ""}), 400, param="prompt")
        assert_error(await client.post(COMPLETIONS, json={"prompt": []}), 400, param="prompt")
        assert_error(await client.post(COMPLETIONS, json={"prompt": [1, 99999]}), 400, param="prompt")
        assert_error(await client.post(COMPLETIONS, json={}), 400, param="prompt")


async def test_context_length_exceeded_is_400_never_truncated():
    async with asgi_client(FakeEngine(max_model_len=64)) as (client, _):
        response = await client.post(COMPLETIONS, json={"prompt": "x" * 40, "max_tokens": 30})
        error = assert_error(response, 400, code="context_length_exceeded")
        assert "64" in error["message"]
        # No max_tokens: a prompt that leaves no room is rejected too, not truncated.
        response = await client.post(CHAT, json={"messages": [{"role": "user", "content": "x" * 80}]})
        assert_error(response, 400, code="context_length_exceeded")
        # Exactly at the limit is fine.
        response = await client.post(COMPLETIONS, json={"prompt": "x" * 40, "max_tokens": 24})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 24


async def test_unknown_model_is_404_and_known_names_work():
    async with asgi_client(served_model_name="my-model") as (client, _):
        assert_error(await client.post(CHAT, json=chat_body(model="gpt-4")), 404, param="model", code="model_not_found")
        for name in ("my-model", "fake-model", None):
            response = await client.post(CHAT, json=chat_body(model=name))
            assert response.status_code == 200, response.text
            assert response.json()["model"] == "my-model"
        models = (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["my-model"]
        assert models["data"][0]["max_model_len"] == 64
        assert models["data"][0]["quantization"] == "none"


async def test_the_weights_format_is_reported_on_models_and_metrics():
    engine = FakeEngine()
    engine.quantization = "gguf:Q4_1+Q8_0"  # type: ignore[attr-defined]
    async with asgi_client(engine) as (client, _):
        card = (await client.get("/v1/models/fake-model")).json()
        assert card["quantization"] == "gguf:Q4_1+Q8_0"
        metrics = (await client.get("/metrics")).text
        assert 'dflash2_model_info{model_name="fake-model",quantization="gguf:Q4_1+Q8_0"} 1.0' in metrics


async def test_api_key_is_enforced_on_the_api_only():
    async with asgi_client(api_key="s3cret") as (client, _):
        assert_error(await client.post(CHAT, json=chat_body()), 401, code="invalid_api_key")
        wrong = {"Authorization": "Bearer nope"}
        assert_error(await client.post(CHAT, json=chat_body(), headers=wrong), 401)
        assert_error(await client.get("/v1/models"), 401)
        assert_error(await client.post("/tokenize", json={"prompt": "hi"}), 401)
        right = {"Authorization": "Bearer s3cret"}
        assert (await client.post(CHAT, json=chat_body(), headers=right)).status_code == 200
        for path in ("/health", "/health/ready", "/metrics", "/version", "/openapi.json"):
            assert (await client.get(path)).status_code == 200, path


async def test_over_the_concurrency_limit_is_429():
    async with asgi_client(FakeEngine(step_delay=0.02), max_concurrency=1) as (client, state):
        slow = asyncio.create_task(client.post(COMPLETIONS, json={"prompt": "a", "max_tokens": 30}))
        await wait_for(lambda: state.admission.num_in_flight == 1)
        response = await client.post(COMPLETIONS, json={"prompt": "b", "max_tokens": 1})
        error = assert_error(response, 429, code="rate_limit_exceeded")
        assert error["type"] == "rate_limit_error"
        assert response.headers["retry-after"]
        assert (await slow).status_code == 200
        assert state.admission.num_in_flight == 0
        assert (await client.post(COMPLETIONS, json={"prompt": "b", "max_tokens": 1})).status_code == 200


async def test_body_over_the_size_limit_is_413():
    async with asgi_client(max_body_bytes=1000) as (client, _):
        big = {"prompt": "x" * 2000, "max_tokens": 1}
        assert_error(await client.post(COMPLETIONS, json=big), 413, code="request_too_large")

        async def chunks():  # no Content-Length: the limit applies while reading
            payload = json.dumps(big).encode()
            for i in range(0, len(payload), 256):
                yield payload[i : i + 256]

        response = await client.post(COMPLETIONS, content=chunks(), headers={"content-type": "application/json"})
        assert_error(response, 413, code="request_too_large")
        assert (await client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 1})).status_code == 200


async def test_engine_failure_is_500_for_that_request_only():
    async with asgi_client() as (client, state):
        error = assert_error(await client.post(COMPLETIONS, json={"prompt": "FAIL", "max_tokens": 4}), 500)
        assert error["type"] == "server_error" and error["code"] == "engine_error"
        response = await client.post(COMPLETIONS, json={"prompt": "fine", "max_tokens": 4})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == "abcd"
        # A stream that hits a failure gets an error event, then [DONE].
        async with client.stream("POST", COMPLETIONS, json={"prompt": "FAIL", "stream": True}) as stream:
            assert stream.status_code == 200
            events = [line async for line in stream.aiter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "engine_error"
        assert state.client.is_alive
        await wait_for(lambda: not state.client.engine.has_unfinished_requests())
        assert state.client.engine.scheduler.running == []


async def test_template_variables_the_template_reads_are_accepted():
    async with asgi_client() as (client, _):
        response = await client.post(CHAT, json=chat_body(chat_template_kwargs={"enable_thinking": False}))
        assert response.status_code == 200, response.text
        tokenized = await client.post(
            "/tokenize", json={"messages": MESSAGES, "chat_template_kwargs": {"padding": True}}
        )
        assert_error(tokenized, 400, param="chat_template_kwargs")


async def test_chat_template_failure_is_400_with_only_the_template_authors_words():
    async with asgi_client() as (client, _):
        response = await client.post(CHAT, json=chat_body(chat_template_kwargs={"explode": "raise_exception"}))
        error = assert_error(response, 400, param="messages")
        assert error["message"].endswith(": Conversation roles must alternate user/assistant")
        response = await client.post(CHAT, json=chat_body(chat_template_kwargs={"explode": "internal"}))
        error = assert_error(response, 400, param="messages")
        assert "UndefinedError" in error["message"]
        assert "dict object" not in error["message"] and "/srv" not in error["message"]


def test_template_error_message_is_escaped_and_bounded():
    long = jinja2.exceptions.TemplateError("\ud800 bad \x1b[31m" + "x" * 1000)
    message = template_error_message(long)
    assert all(c.isprintable() for c in message) and len(message) < 400 and message.endswith(" …")
    assert "\\ud800 bad \\x1b[31m" in message


async def test_unknown_route_and_method_use_the_envelope():
    async with asgi_client() as (client, _):
        assert_error(await client.get("/v1/nothing"), 404)
        response = await client.get(CHAT)
        assert_error(response, 405)
        assert response.headers["allow"] == "POST"


async def test_not_ready_while_loading_and_while_draining():
    release = threading.Event()
    engine = FakeEngine()

    def load():
        release.wait(10)
        return engine

    app = create_app(EngineClient(load), ServerSettings())
    state = app.state.server
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            assert (await client.get("/health")).status_code == 200
            ready = await client.get("/health/ready")
            assert ready.status_code == 503 and ready.json()["status"] == "loading"
            assert_error(await client.post(CHAT, json=chat_body()), 503)
            release.set()
            await wait_for(lambda: state.serving is not None)
            assert (await client.get("/health/ready")).status_code == 200
            assert (await client.post(CHAT, json=chat_body())).status_code == 200
            state.admission.begin_drain()
            ready = await client.get("/health/ready")
            assert ready.status_code == 503 and ready.json()["status"] == "draining"
            assert_error(await client.post(CHAT, json=chat_body()), 503)
            assert (await client.get("/health")).status_code == 200


async def test_a_model_that_fails_to_load_is_reported():
    def load():
        raise RuntimeError("no weights")

    app = create_app(EngineClient(load), ServerSettings())
    async with app.router.lifespan_context(app):
        await wait_for(lambda: app.state.server.client.load_error is not None)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            assert (await client.get("/health")).status_code == 503
            assert (await client.get("/health/ready")).json()["status"] == "failed"


async def test_an_engine_that_stops_for_good_fails_health_and_requests():
    # A tensor-parallel engine whose worker rank exited: the engine thread ends, /health turns 503, the
    # request in flight gets an error naming the rank, and the engine is closed at shutdown.
    engine = FakeEngine(max_model_len=4096, step_delay=0.05)
    app = create_app(EngineClient(lambda: engine), ServerSettings())
    state = app.state.server
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            await wait_for(lambda: state.serving is not None)
            pending = asyncio.create_task(client.post(CHAT, json=chat_body(max_tokens=40)))
            await wait_for(lambda: engine.num_steps > 0)
            engine.fail_for_good("tensor-parallel worker rank 1 (pid 123) was killed by signal 9")
            response = await pending
            assert response.status_code == 500 and "rank 1" in response.json()["error"]["message"]
            await wait_for(lambda: not state.client.is_alive)
            assert (await client.get("/health")).status_code == 503
            assert (await client.get("/health/ready")).json()["status"] == "failed"
            assert "rank 1" in state.client.fatal_error
    assert engine.closed


LONE_SURROGATE = b'"a\\ud800b"'  # a JSON escape Python's json module decodes into a lone surrogate


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        (COMPLETIONS, b'{"model": "fake-model", "prompt": %s, "max_tokens": 2}', 400, "prompt"),
        ("/tokenize", b'{"prompt": %s}', 400, "prompt"),
        (CHAT, b'{"messages": [{"role": "user", "content": %s}], "max_tokens": 2}', 400, "messages[0].content"),
        (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "stop": [%s], "max_tokens": 2}', 400, "stop[0]"),
        (COMPLETIONS, b'{"model": %s, "prompt": "hi", "max_tokens": 2}', 404, "model"),
    ],
)
def test_lone_surrogates_are_client_errors_and_keep_the_connection(path, body, status, param):
    """A real server on loopback: the error is 4xx, and the same keep-alive connection serves the next request."""
    with ServerThread(FakeEngine()) as server, httpx.Client(base_url=server.url, trust_env=False) as client:
        response = client.post(path, content=body % LONE_SURROGATE, headers={"content-type": "application/json"})
        assert_error(response, status, param=param)
        assert "\\ud800" not in response.text or status == 404  # the 404 names the model, escaped
        again = client.post(COMPLETIONS, json={"model": "fake-model", "prompt": "hi", "max_tokens": 2})
        assert again.status_code == 200, again.text


async def test_openapi_declares_bearer_security_and_event_streams():
    async with asgi_client() as (client, _):
        schema = (await client.get("/openapi.json")).json()
    assert schema["components"]["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "the server's --api-key, if any",
    }
    chat = schema["paths"]["/v1/chat/completions"]["post"]
    assert chat["security"] == [{"bearer": []}] and "text/event-stream" in chat["responses"]["200"]["content"]
    assert "security" not in schema["paths"]["/health"]["get"]
