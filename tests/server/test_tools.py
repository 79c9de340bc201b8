"""Tool calling and structured outputs over HTTP with the openai client, against the embedded SmolLM2
(float32, untrained drafter, block size 8: speculation is on, drafts are mostly rejected).

Forced tool choices and JSON formats are enforced by grammar, so even a 135M model returns a valid
call or document on every request; ``auto`` leaves the choice to the model.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.live_server import ServerThread

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER_PARAMETERS},
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 24}}},
    },
}
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(real_server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{real_server.url}/v1", api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, **fields):
    return client.chat.completions.create(model=MODEL, messages=fields.pop("messages", PARIS), **fields)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_tool_choice_returns_a_valid_call(client, temperature):
    response = chat(
        client,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=temperature,
        seed=3,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    schema = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME["function"]["parameters"]}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_named_tool_choice_calls_that_tool(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    response = chat(client, tools=[WEATHER, TIME], tool_choice=named, max_tokens=40, temperature=0)
    calls = response.choices[0].message.tool_calls
    assert calls and all(c.function.name == "get_time" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_outputs_validate_when_sampled(client, seed):
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True},
    }
    response = chat(client, response_format=response_format, max_tokens=60, temperature=1.0, seed=seed)
    assert response.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(response.choices[0].message.content), ANSWER_SCHEMA)


def test_json_object_output_is_an_object(client):
    response = chat(client, response_format={"type": "json_object"}, max_tokens=80, temperature=0)
    assert isinstance(json.loads(response.choices[0].message.content), dict)


CATS = [{"role": "user", "content": "Give me a JSON object about cats."}]
CAT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "facts": {"type": "array", "items": {"type": "string"}},
        "legs": {"type": "integer"},
    },
    "required": ["name", "facts", "legs"],
}


@pytest.mark.parametrize("max_tokens", [32, 64, 96])
def test_json_outputs_parse_however_they_end(client, max_tokens):
    """The budget-aware grammar: a sampled reply closes its JSON in time even when ``max_tokens`` ends it
    (``finish_reason`` then says ``length``, and usage counts every token)."""
    formats = {
        "json_object": ({"type": "json_object"}, {"type": "object"}),
        "json_schema": ({"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT_SCHEMA}}, CAT_SCHEMA),
    }
    lengths = 0
    for response_format, schema in formats.values():

        def ask(seed: int, response_format=response_format):
            return chat(
                client,
                messages=CATS,
                response_format=response_format,
                max_tokens=max_tokens,
                temperature=0.8,
                seed=seed,
            )

        with ThreadPoolExecutor(10) as pool:  # ten at once: the engine batches them
            responses = list(pool.map(ask, range(10)))
        for response in responses:
            choice = response.choices[0]
            assert choice.finish_reason in ("stop", "length")
            jsonschema.validate(json.loads(choice.message.content), schema)
            assert response.usage.completion_tokens <= max_tokens
            lengths += choice.finish_reason == "length"
    if max_tokens == 32:
        assert lengths > 0  # the budget closed some of them


def test_auto_with_a_json_answer_gives_either_a_call_or_the_answer(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
    strict_weather = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    for seed in range(3):
        choice = chat(
            client, tools=[strict_weather], response_format=response_format, max_tokens=60, temperature=1.0, seed=seed
        ).choices[0]
        if choice.message.tool_calls:
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)
        else:
            jsonschema.validate(json.loads(choice.message.content), ANSWER_SCHEMA)


def test_streamed_tool_call_deltas(client):
    stream = chat(
        client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=60, stream=True
    )
    deltas, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    first, *rest = deltas
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather" and first.function.arguments == ""
    assert all(d.index == 0 and d.id is None for d in rest)
    jsonschema.validate(json.loads("".join(d.function.arguments for d in rest)), WEATHER_PARAMETERS)


def test_tool_history_round_trip(client):
    """The assistant's call and the tool's result go back through the template; the reply is text."""
    first = chat(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=60)
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *PARIS,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    second = chat(client, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=16, temperature=0)
    assert second.choices[0].message.tool_calls is None
    assert second.choices[0].message.content
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "frob"}}},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"$ref": "#/nope"}}}},
            "response_format.json_schema.schema",
        ),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools[0].function.parameters",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
    ],
)
def test_bad_tools_and_schemas_are_400s_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, max_tokens=4, **fields)
    assert caught.value.body["param"] == param, caught.value.body


def test_fields_without_effect_are_accepted(client):
    response = chat(
        client,
        messages=[
            {"role": "developer", "content": "Answer briefly."},
            {"role": "user", "content": "Hi", "name": "ann"},
        ],
        max_completion_tokens=4,
        store=False,
        metadata={"run": "1"},
        reasoning_effort="low",
        service_tier="auto",
        prompt_cache_key="k",
        verbosity="low",
        safety_identifier="user-1",
    )
    assert response.usage.completion_tokens <= 4


def test_retrieve_model(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def stream_choice(client: openai.OpenAI, **fields) -> tuple[str, str, list]:
    """A streamed chat turn: (finish_reason, content, calls as (name, arguments) in index order)."""
    finish, content, calls = None, "", {}
    for chunk in chat(client, stream=True, **fields):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                name, arguments = calls.get(delta.index, ("", ""))
                calls[delta.index] = (name + (delta.function.name or ""), arguments + (delta.function.arguments or ""))
    return finish, content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_max_tokens_is_neither_a_call_nor_content(client, stream):
    """12 tokens cannot hold a whole call: the reply is cut, keeps ``length`` and returns nothing."""
    fields = {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 12, "temperature": 0}
    if stream:
        finish, content, calls = stream_choice(client, **fields)
    else:
        choice = chat(client, **fields).choices[0]
        finish, content, calls = choice.finish_reason, choice.message.content, choice.message.tool_calls
    assert finish == "length" and not content and not calls


@pytest.mark.parametrize("stream", [False, True])
def test_required_turns_end_with_one_valid_call_by_default(client, stream):
    """``parallel_tool_calls`` left out (the server's default, false): six sampled required turns at
    ``max_tokens`` 96 each end after one schema-valid call, instead of writing calls until the limit."""
    schemas = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME["function"]["parameters"]}
    for seed in range(6):
        fields = {"tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 96, "temperature": 1.0}
        if stream:
            finish, content, calls = stream_choice(client, seed=seed, **fields)
        else:
            choice = chat(client, seed=seed, **fields).choices[0]
            finish, content = choice.finish_reason, choice.message.content
            calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        assert finish == "tool_calls" and not content, (seed, calls)
        ((name, arguments),) = calls
        jsonschema.validate(json.loads(arguments), schemas[name])


PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_parallel_turn_ends_before_it_repeats_a_call(client, stream):
    """``ping`` takes no arguments, so every second call of a parallel turn repeats the first: the turn
    ends there (``tool_calls``, well before ``max_tokens``) with the one call."""
    for seed in range(3):
        fields = {"tools": [PING], "tool_choice": "required", "parallel_tool_calls": True, "max_tokens": 96}
        if stream:
            finish, _, calls = stream_choice(client, seed=seed, temperature=1.0, **fields)
        else:
            response = chat(client, seed=seed, temperature=1.0, **fields)
            finish = response.choices[0].finish_reason
            calls = [(c.function.name, c.function.arguments) for c in response.choices[0].message.tool_calls or []]
            assert response.usage.completion_tokens < 96
        assert finish == "tool_calls" and calls == [("ping", "{}")], seed


def test_responses_errors_name_the_responses_field_in_param_and_message(real_server):
    import httpx

    bad = {"type": "object", "properties": {"a": {"type": "frob"}}}
    cases = [
        ({"text": {"format": {"type": "json_schema", "name": "a", "schema": bad}}}, "text.format.schema"),
        ({"tools": [{"type": "function", "name": "f", "parameters": bad}], "tool_choice": "required"},
         "tools[0].parameters"),
    ]  # fmt: skip
    for fields, param in cases:
        response = httpx.post(f"{real_server.url}/v1/responses", json={"input": "hi", **fields}, timeout=60)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == param and error["message"].startswith(param), error
