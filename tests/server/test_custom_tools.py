"""Custom tools (free text, Lark and regex grammars) and hosted tool types, over ASGI against a real engine: a tiny
random target over SmolLM2's vocabulary with its tokenizer and chat template, and an untrained drafter (speculation
on). At temperature 1 the random model writes whatever the grammar allows, so every forced call's input is checked
against the tool's grammar by an independent parser (``re`` for regexes, a fresh llguidance matcher of the tool's own
Lark grammar)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import llguidance
import llguidance.hf
import pytest

from dflash2.config import EngineConfig
from dflash2.engine import Engine
from dflash2.grammar import GrammarBackend, lark_grammar
from dflash2.models import loader, source
from server.responses.serving import IGNORED_TOOLS_HEADER
from tests.server.conftest import asgi_client
from tests.server.test_responses_api import sdk_client, sse
from tests.tiny import tiny_drafter, tiny_target

pytestmark = pytest.mark.anyio

SMOLLM2_VOCAB = 49152
# Arithmetic over numbers and quoted words: nesting, and a quote a JSON string would have to escape.
CALC_LARK = (
    'start: expr\nexpr: term (("+" | "-") term)*\nterm: NUMBER | WORD | "(" expr ")"\n'
    'NUMBER: /[0-9]{1,3}/\nWORD: /"[a-z]{0,4}"/\n'
)
# A quote and an optional newline: both need escaping inside the JSON string the call writes.
CODE_REGEX = '[A-Z]{2,3}"[0-9]{1,3}\\n?'
CALC = {
    "type": "custom",
    "custom": {
        "name": "calc",
        "description": "Evaluates arithmetic",
        "format": {"type": "grammar", "grammar": {"syntax": "lark", "definition": CALC_LARK}},
    },
}
CODE = {
    "type": "custom",
    "custom": {
        "name": "code",
        "description": "Looks up a code",
        "format": {"type": "grammar", "grammar": {"syntax": "regex", "definition": CODE_REGEX}},
    },
}
NOTE = {"type": "custom", "custom": {"name": "note", "description": "Saves a note", "format": {"type": "text"}}}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}},
    },
}
USER = [{"role": "user", "content": "Go."}]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return loader.load_tokenizer(source.resolve_model(None))


@pytest.fixture(scope="module")
def target() -> Any:
    return tiny_target(vocab_size=SMOLLM2_VOCAB, seed=5, scale=0.3)


@pytest.fixture
def engine(target: Any, tokenizer: Any) -> Engine:
    """A fresh engine per test (the app's shutdown closes it) over the shared target."""
    config = EngineConfig(
        block_size=8,
        max_num_seqs=4,
        max_model_len=512,
        device="cpu",
        dtype="float32",
        enforce_eager=True,
        speculative_adaptive=False,
        adaptive_threads=False,
    )
    return Engine(config, target, tokenizer, tiny_drafter(target, 2, 8), model_name="tiny")


@pytest.fixture
async def client(engine: Engine) -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(engine) as (client, _):
        yield client


def lark_accepts(tokenizer: Any, lark: str, text: str) -> bool:
    """An independent check: a fresh llguidance matcher of ``lark`` alone accepts ``text`` whole."""
    llg_tokenizer = llguidance.hf.from_tokenizer(tokenizer)
    matcher = llguidance.LLMatcher(llg_tokenizer, lark_grammar(lark), log_level=0)
    ids = llg_tokenizer.tokenize_str(text)
    return bool(matcher.consume_tokens(ids)) and matcher.is_accepting()


async def chat(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    response = await client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 80, **body})
    assert response.status_code == 200, response.text
    return response.json()


# ---- grammars hold on every sampled call -------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(10))
async def test_a_forced_lark_tool_call_input_parses_with_its_grammar(client, tokenizer, seed):
    choice = {"type": "custom", "custom": {"name": "calc"}}
    body = await chat(client, tools=[CALC, NOTE], tool_choice=choice, temperature=1.0, seed=seed)
    (call,) = body["choices"][0]["message"]["tool_calls"]
    assert call["type"] == "custom" and call["id"].startswith("call_") and call["custom"]["name"] == "calc"
    assert lark_accepts(tokenizer, CALC_LARK, call["custom"]["input"]), call


@pytest.mark.parametrize("seed", range(10))
async def test_a_forced_regex_tool_call_input_matches_the_whole_regex(client, seed):
    body = await chat(client, tools=[CODE], tool_choice="required", temperature=1.0, seed=seed)
    (call,) = body["choices"][0]["message"]["tool_calls"]
    assert call["custom"]["name"] == "code"
    assert re.fullmatch(CODE_REGEX, call["custom"]["input"]), call


async def test_required_over_mixed_tools_gives_a_call_of_its_kind(client):
    kinds = set()
    for seed in range(6):
        body = await chat(client, tools=[WEATHER, CODE, NOTE], tool_choice="required", temperature=1.0, seed=seed)
        (call,) = body["choices"][0]["message"]["tool_calls"]
        kinds.add(call["type"])
        if call["type"] == "function":
            assert call["function"]["name"] == "get_weather" and isinstance(
                json.loads(call["function"]["arguments"]), dict
            )
        elif call["custom"]["name"] == "code":
            assert re.fullmatch(CODE_REGEX, call["custom"]["input"])
        else:
            assert call["custom"]["name"] == "note" and isinstance(call["custom"]["input"], str)
    assert kinds <= {"function", "custom"} and kinds


# ---- Responses: items, round trip, streaming ----------------------------------------------------------------


def responses_tool(chat_tool: dict[str, Any]) -> dict[str, Any]:
    """A chat custom tool in the Responses' flat shape."""
    custom = dict(chat_tool["custom"])
    fmt = custom.get("format", {})
    if fmt.get("type") == "grammar":
        custom["format"] = {"type": "grammar", **fmt["grammar"]}
    return {"type": "custom", **custom}


async def test_free_text_custom_tool_round_trip_in_responses(client, engine, monkeypatch):
    tools = [responses_tool(NOTE)]
    first = await client.post(
        "/v1/responses",
        json={
            "input": "Save it.",
            "tools": tools,
            "tool_choice": {"type": "custom", "name": "note"},
            "max_output_tokens": 40,
        },
    )
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["tool_choice"] == {"type": "custom", "name": "note"}
    (item,) = [item for item in body["output"] if item["type"] == "custom_tool_call"]
    assert item["id"].startswith("ctc_") and item["call_id"].startswith("call_") and item["status"] == "completed"
    assert item["name"] == "note" and isinstance(item["input"], str)

    prompts: list[str] = []
    add_request = engine.add_request

    def recording(prompt: Any, params: Any, request_id: str | None = None) -> str:
        prompts.append(engine.tokenizer.decode(prompt))
        return add_request(prompt, params, request_id)

    monkeypatch.setattr(engine, "add_request", recording)
    history = [
        {"role": "user", "content": "Save it."},
        {"type": "custom_tool_call", "call_id": item["call_id"], "name": "note", "input": "buy milk", "id": item["id"]},
        {"type": "custom_tool_call_output", "call_id": item["call_id"], "output": "saved as #7"},
    ]
    second = await client.post(
        "/v1/responses", json={"input": history, "tools": tools, "tool_choice": "none", "max_output_tokens": 5}
    )
    assert second.status_code == 200, second.text
    (prompt,) = prompts
    assert '"input": "buy milk"' in prompt and "saved as #7" in prompt


async def test_chat_history_with_custom_tool_calls_reaches_the_prompt(client, engine, monkeypatch):
    prompts: list[str] = []
    add_request = engine.add_request

    def recording(prompt: Any, params: Any, request_id: str | None = None) -> str:
        prompts.append(engine.tokenizer.decode(prompt))
        return add_request(prompt, params, request_id)

    monkeypatch.setattr(engine, "add_request", recording)
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "custom", "custom": {"name": "calc", "input": "1+(2-3)"}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "0"},
    ]
    await chat(client, messages=messages, tools=[CALC], max_tokens=20, temperature=0)
    (prompt,) = prompts
    assert (
        '{"name": "calc", "arguments": {"input": "1+(2-3)"}}' in prompt
        and "<tool_response>\n0\n</tool_response>" in prompt
    )


async def test_responses_stream_events_of_a_custom_tool_call(client):
    body = {
        "input": "Compute.",
        "tools": [responses_tool(CALC)],
        "tool_choice": "required",
        "max_output_tokens": 80,
        "temperature": 1.0,
        "stream": True,
    }
    events = await sse(client, body)
    kinds = [e["type"] for e in events]
    start = kinds.index("response.output_item.added")
    assert kinds[start:] == [
        "response.output_item.added",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
        kinds[-1],
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    added, delta, done, item_done, final = events[start:]
    assert added["item"]["type"] == "custom_tool_call" and added["item"]["input"] == ""
    assert added["item"]["status"] == "in_progress" and added["item"]["name"] == "calc"
    assert delta["item_id"] == done["item_id"] == added["item"]["id"] == item_done["item"]["id"]
    assert delta["output_index"] == done["output_index"] == added["output_index"]
    assert done["input"] == delta["delta"] == item_done["item"]["input"]
    assert item_done["item"]["status"] == "completed"
    assert final["response"]["output"][-1] == item_done["item"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


async def test_chat_stream_deltas_of_a_custom_tool_call(client):
    body = {
        "messages": USER,
        "tools": [CODE],
        "tool_choice": {"type": "custom", "custom": {"name": "code"}},
        "max_tokens": 60,
        "temperature": 1.0,
        "seed": 1,
        "stream": True,
    }
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        raw = (await response.aread()).decode()
    chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    deltas = [d for c in chunks for choice in c["choices"] for d in choice["delta"].get("tool_calls", [])]
    head, rest = deltas[0], deltas[1:]
    assert head["index"] == 0 and head["type"] == "custom" and head["id"].startswith("call_")
    assert head["custom"] == {"name": "code", "input": ""} and "function" not in head
    assert all(d == {"index": 0, "custom": {"input": d["custom"]["input"]}} for d in rest)
    assert re.fullmatch(CODE_REGEX, "".join(d["custom"]["input"] for d in rest))
    assert chunks[-1]["choices"] == [] or chunks[-1]["choices"][0]["finish_reason"] in ("tool_calls", "length")


# ---- hosted tool types (Codex-style requests) -------------------------------------------------------------

CODEX_TOOLS = [
    {"type": "function", "name": "shell", "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
    responses_tool(CALC),
    {"type": "web_search", "external_web_access": False},
    {
        "type": "namespace",
        "name": "mcp__docs__",
        "description": "Docs server",
        "tools": [{"type": "function", "name": "search", "parameters": {"type": "object"}}],
    },
    {"type": "image_generation", "output_format": "png"},
    {"type": "web_search"},
]


@pytest.mark.parametrize("stream", [False, True])
async def test_codex_style_mixed_tools_are_served_with_hosted_ones_left_out(client, stream):
    body = {
        "input": "Compute.",
        "tools": CODEX_TOOLS,
        "tool_choice": "required",
        "max_output_tokens": 80,
        "stream": stream,
    }
    response = await client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    assert response.headers[IGNORED_TOOLS_HEADER] == "web_search, namespace, image_generation"
    if stream:
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
        final = events[-1]["response"]
    else:
        final = response.json()
    assert final["tools"] == CODEX_TOOLS  # echoed as sent
    (call,) = [item for item in final["output"] if item["type"] in ("function_call", "custom_tool_call")]
    assert call["name"] in ("shell", "calc")  # never a tool of a namespace or a hosted tool


async def test_a_request_without_hosted_tools_has_no_ignored_tools_header(client):
    body = {"input": "Hi", "tools": [responses_tool(NOTE)], "tool_choice": "none", "max_output_tokens": 3}
    response = await client.post("/v1/responses", json=body)
    assert response.status_code == 200 and IGNORED_TOOLS_HEADER not in response.headers


async def test_only_hosted_tools_make_a_plain_reply(client):
    body = {"input": "Hi", "tools": [{"type": "web_search"}], "max_output_tokens": 3}
    response = await client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    assert [item["type"] for item in response.json()["output"]] == ["message"]


# ---- errors name the field ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {
                "tools": [
                    {
                        "type": "custom",
                        "custom": {
                            "name": "x",
                            "format": {
                                "type": "grammar",
                                "grammar": {"syntax": "lark", "definition": "start: nothing"},
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools[0].custom.format",
        ),
        (
            "/v1/chat/completions",
            {
                "tools": [
                    {
                        "type": "custom",
                        "custom": {
                            "name": "x",
                            "format": {"type": "grammar", "grammar": {"syntax": "regex", "definition": "(unclosed"}},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools[0].custom.format",
        ),
        (
            "/v1/chat/completions",
            {"tools": [CALC], "tool_choice": {"type": "function", "function": {"name": "calc"}}},
            "tool_choice",
        ),
        ("/v1/chat/completions", {"tools": [{"type": "custom", "function": {"name": "f"}}]}, "tools[0]"),
        ("/v1/chat/completions", {"tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            "/v1/responses",
            {
                "tools": [
                    {"type": "web_search"},
                    {
                        "type": "custom",
                        "name": "x",
                        "format": {"type": "grammar", "syntax": "lark", "definition": "start: nothing"},
                    },
                ],
                "tool_choice": "required",
            },
            "tools[1].format",
        ),
        (
            "/v1/responses",
            {
                "tools": [
                    {"type": "custom", "name": "x", "format": {"type": "grammar", "syntax": "peg", "definition": "a"}}
                ]
            },
            "tools[0].format",
        ),
        ("/v1/responses", {"tools": [responses_tool(NOTE)], "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ],
)
async def test_bad_custom_tools_are_400s_naming_the_field(client, path, body, param):
    body = {**body, **({"messages": USER} if "chat" in path else {"input": "Hi"})}
    response = await client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param or error["param"].startswith(param), error


async def test_a_lark_tool_needs_the_hermes_format(engine):
    async with asgi_client(engine, tool_call_parser="llama3_json") as (client, _):
        response = await client.post(
            "/v1/chat/completions", json={"messages": USER, "tools": [CALC], "tool_choice": "required"}
        )
        assert response.status_code == 400 and "hermes" in response.json()["error"]["message"]
        regex = await client.post(
            "/v1/chat/completions",
            json={"messages": USER, "tools": [CODE], "tool_choice": "required", "max_tokens": 60, "seed": 0},
        )
        assert regex.status_code == 200, regex.text
        (call,) = regex.json()["choices"][0]["message"]["tool_calls"]
        assert re.fullmatch(CODE_REGEX, call["custom"]["input"])


# ---- the budget closes a grammar's input ---------------------------------------------------------------------

SUM_REGEX = "[0-9]+\\+[0-9]+"


def test_the_closing_walk_leaves_an_unbounded_run(tokenizer):
    """The first walk ("0" before other printable bytes) never ends ``[0-9]+``; the second takes "+" first."""
    backend = GrammarBackend(tokenizer, SMOLLM2_VOCAB)
    matcher = backend.matcher(lark_grammar(f"start: /{SUM_REGEX}/"))
    assert matcher.consume_tokens(tokenizer.encode("2222", add_special_tokens=False))
    path = backend.closing_bytes(matcher)
    assert path is not None and re.fullmatch(SUM_REGEX, "2222" + path.decode())


@pytest.mark.parametrize("seed", range(3))
async def test_a_regex_input_with_an_unbounded_run_closes_within_max_tokens(client, seed):
    tool = {
        "type": "custom",
        "custom": {
            "name": "add",
            "format": {"type": "grammar", "grammar": {"syntax": "regex", "definition": SUM_REGEX}},
        },
    }
    body = await chat(client, tools=[tool], tool_choice="required", temperature=1.0, seed=seed, max_tokens=32)
    (call,) = body["choices"][0]["message"]["tool_calls"]
    assert re.fullmatch(SUM_REGEX, call["custom"]["input"]), call


async def test_the_openai_sdk_parses_custom_tool_calls_and_their_events(client):
    from openai.types.responses import (
        ResponseCustomToolCall,
        ResponseCustomToolCallInputDeltaEvent,
        ResponseCustomToolCallInputDoneEvent,
    )

    sdk = sdk_client(client)
    fields: dict[str, Any] = {
        "model": "tiny",
        "input": "Compute.",
        "tools": [responses_tool(CALC)],
        "tool_choice": {"type": "custom", "name": "calc"},
        "max_output_tokens": 60,
    }
    response = await sdk.responses.create(**fields)
    (call,) = response.output
    assert isinstance(call, ResponseCustomToolCall) and call.name == "calc" and call.input
    events = [event async for event in await sdk.responses.create(**fields, stream=True)]
    deltas = [e for e in events if isinstance(e, ResponseCustomToolCallInputDeltaEvent)]
    (done,) = [e for e in events if isinstance(e, ResponseCustomToolCallInputDoneEvent)]
    assert "".join(d.delta for d in deltas) == done.input
