"""``POST /v1/responses`` over ASGI with the fake engine: conversion to chat, Response objects, stream events,
the ``openai`` client parsing both, and the 400s (stored responses: ``test_stored_responses.py``)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import httpx
import openai
import pytest

from dflash2.outputs import RequestOutput, StepStats
from dflash2.sampling import SamplingParams
from server.protocol import UsageInfo
from server.responses.convert import chat_conversion, responses_param
from server.responses.protocol import (
    OutputFunctionCall,
    OutputMessage,
    OutputReasoning,
    ResponseObject,
    ResponsesRequest,
    output_items,
)
from server.responses.stream import ResponseStream
from server.tool_parsers import ParsedToolCall
from tests.server.conftest import asgi_client, wait_for
from tests.server.fakes import FakeEngine, FakeRequest

pytestmark = pytest.mark.anyio

PATH = "/v1/responses"
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TOOL_CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class ScriptedEngine(FakeEngine):
    """The fake engine writing ``script`` one character per step and then stopping (finish reason "stop"),
    unless ``max_tokens`` comes first; it records the prompt text of every request."""

    def __init__(self, script: str = "abc", max_model_len: int = 4096) -> None:
        super().__init__(max_model_len=max_model_len)
        self.script = script
        self.prompts: list[str] = []

    def add_request(self, prompt: Any, params: SamplingParams, request_id: str | None = None) -> str:
        request_id = super().add_request(prompt, params, request_id)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.prompts.append(self.tokenizer.decode(ids))
        return request_id

    def _advance(self, request: FakeRequest, stats: StepStats) -> RequestOutput:
        output = super()._advance(request, stats)
        position = len(request.output_ids) - 1
        token = ord(self.script[position]) if position < len(self.script) else output.new_token_ids[0]
        request.output_ids[position] = token
        output = dataclasses.replace(output, new_token_ids=[token], new_text=chr(token))
        if output.finished or position + 1 < len(self.script):
            return output
        self.scheduler.running.remove(request)
        return dataclasses.replace(output, finished=True, finish_reason="stop")


def sdk_client(client: httpx.AsyncClient) -> openai.AsyncOpenAI:
    """The official client over the same ASGI transport."""
    return openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)


async def sse(client: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of a stream, decoded; checks the framing (``event:`` names the data's type, no ``[DONE]``)."""
    async with client.stream("POST", PATH, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = (await response.aread()).decode()
    events = []
    for frame in (f for f in raw.split("\n\n") if f and not f.startswith(":")):
        name, data = frame.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), frame
        event = json.loads(data.removeprefix("data: "))
        assert event["type"] == name.removeprefix("event: ")
        events.append(event)
    assert "[DONE]" not in raw
    return events


def error_of(response: httpx.Response, param: str) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    return error


# ---- non-stream -------------------------------------------------------------------------------------------


async def test_string_input_is_a_completed_response_with_usage():
    async with asgi_client(ScriptedEngine("abc")) as (client, _):
        response = await client.post(PATH, json={"model": "fake-model", "input": "hi"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("resp_") and body["object"] == "response" and body["model"] == "fake-model"
    assert body["status"] == "completed" and body["incomplete_details"] is None and body["error"] is None
    (message,) = body["output"]
    assert message["type"] == "message" and message["id"].startswith("msg_")
    assert message["status"] == "completed" and message["role"] == "assistant"
    assert message["content"] == [{"type": "output_text", "text": "abc", "annotations": [], "logprobs": []}]
    assert body["usage"] == {
        "input_tokens": len("<user>hi<assistant>"),
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 19 + 3,
    }
    assert body["store"] is True and body["previous_response_id"] is None and body["truncation"] == "disabled"
    assert body["text"] == {"format": {"type": "text"}} and body["tools"] == [] and body["tool_choice"] == "none"
    assert "output_text" not in body


async def test_max_output_tokens_reached_is_incomplete():
    engine = FakeEngine()
    async with asgi_client(engine) as (client, _):
        body = (await client.post(PATH, json={"input": "hi", "max_output_tokens": 4})).json()
    assert engine.submitted[0].max_tokens == 4
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["max_output_tokens"] == 4
    assert body["output"][0]["status"] == "incomplete" and body["output"][0]["content"][0]["text"] == "abcd"
    assert body["usage"]["output_tokens"] == 4


async def test_items_instructions_tool_history_and_developer_reach_the_prompt():
    engine = ScriptedEngine("ok")
    items = [
        {"type": "message", "role": "developer", "content": "Use metric."},
        {"role": "user",
         "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}',
         "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "21C"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "18C and 21C.", "annotations": [], "logprobs": []}]},
        {"role": "user", "content": "Thanks"},
    ]  # fmt: skip
    async with asgi_client(engine) as (client, _):
        response = await client.post(PATH, json={"input": items, "instructions": "Be brief.", "tools": [WEATHER_TOOL]})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["instructions"] == "Be brief." and body["tools"] == [WEATHER_TOOL] and body["tool_choice"] == "auto"
    (prompt,) = engine.prompts
    assert body["usage"]["input_tokens"] == len(prompt)
    assert prompt.startswith("<system>Be brief.") and prompt.endswith("<user>Thanks<assistant>")
    parts = ["<system>Use metric.", "<user>Weather in Paris?", '"city": "Paris"', '"city": "Lyon"', "18C", "21C",
             "<assistant>18C and 21C.", "<user>Thanks"]  # fmt: skip
    positions = [prompt.find(part) for part in parts]
    assert -1 not in positions and positions == sorted(positions), prompt
    assert prompt.count("<assistant>") == 3  # both calls in one assistant message, the reply, the generation prompt
    assert prompt.count("<tool>") == 2 and "opaque" not in prompt


def test_conversion_to_chat_messages():
    request = ResponsesRequest.model_validate(
        {
            "instructions": "sys",
            "input": [
                {"role": "user", "content": "q"},
                {"type": "reasoning", "summary": []},
                {"type": "message", "role": "assistant", "content": "let me look"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
                {"type": "function_call_output", "call_id": "c1", "output": "one"},
                {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
            ],
            "max_output_tokens": 7,
            "temperature": 0.5,
            "tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "g", "strict": True}],
            "tool_choice": {"type": "function", "name": "g"},
            "parallel_tool_calls": False,
            "text": {"format": {"type": "json_schema", "name": "answer", "schema": {"type": "object"}}},
        }
    )
    conversion = chat_conversion(request)
    chat = conversion.request
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assistant = chat.messages[2]
    assert assistant.content == "let me look"
    assert [c["id"] for c in assistant.tool_calls or []] == ["c1", "c2"]
    assert assistant.tool_calls and assistant.tool_calls[1]["function"] == {"name": "g", "arguments": '{"x": 1}'}
    assert chat.messages[3].tool_call_id == "c1" and chat.messages[3].content == "one"
    assert conversion.sources == ["instructions", "input[0]", "input[2]", "input[5]", "input[6]"]
    assert chat.max_completion_tokens == 7 and chat.temperature == 0.5 and chat.parallel_tool_calls is False
    assert chat.tools and chat.tools[1].function.name == "g" and chat.tools[1].function.strict is True
    assert chat.tool_choice is not None and not isinstance(chat.tool_choice, str)
    assert chat.tool_choice.function.name == "g"
    assert chat.response_format and chat.response_format.json_schema
    assert chat.response_format.json_schema.name == "answer"
    assert chat.response_format.json_schema.schema_ == {"type": "object"}


def test_chat_params_are_named_as_responses_fields():
    sources = ["instructions", "input[0]", "input[3]"]
    assert responses_param("messages[2].content", sources) == "input[3]"
    assert responses_param("messages[0]", sources) == "instructions"
    assert responses_param("messages", sources) == "input"
    assert responses_param("max_tokens", sources) == "max_output_tokens"
    assert responses_param("max_completion_tokens", sources) == "max_output_tokens"
    assert responses_param("response_format.json_schema.schema", sources) == "text.format.schema"
    assert responses_param("response_format", sources) == "text.format"
    assert responses_param("tools[1].function.parameters", sources) == "tools[1].parameters"
    assert responses_param("tool_choice", sources) == "tool_choice"
    assert responses_param(None, sources) is None


async def test_tool_calls_become_function_call_items():
    engine = ScriptedEngine("Let me check." + TOOL_CALL_TEXT)
    async with asgi_client(engine) as (client, _):
        response = await client.post(PATH, json={"input": "Weather in Paris?", "tools": [WEATHER_TOOL]})
    body = response.json()
    assert body["status"] == "completed", body
    message, call = body["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == "Let me check."
    assert call["type"] == "function_call" and call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    assert (call["name"], json.loads(call["arguments"]), call["status"]) == (
        "get_weather",
        {"city": "Paris"},
        "completed",
    )
    assert "get_weather" in engine.prompts[0]  # the tools reached the prompt


async def test_output_items_sent_back_as_input_with_the_call_result():
    """The agent loop: the previous output, then the tool's result, as the next request's input."""
    engine = ScriptedEngine("Let me check." + TOOL_CALL_TEXT)
    async with asgi_client(engine) as (client, _):
        first = (await client.post(PATH, json={"input": "Weather in Paris?", "tools": [WEATHER_TOOL]})).json()
        call_id = first["output"][1]["call_id"]
        result = {"type": "function_call_output", "call_id": call_id, "output": "18 degrees"}
        history = [{"role": "user", "content": "Weather in Paris?"}, *first["output"], result]
        second = await client.post(PATH, json={"input": history, "tools": [WEATHER_TOOL]})
    assert second.status_code == 200, second.text
    prompt = engine.prompts[1]
    assert prompt.count("<assistant>") == 2 and "Let me check." in prompt and '"city": "Paris"' in prompt
    assert prompt.index('"city": "Paris"') < prompt.index("<tool>") < prompt.index("18 degrees")


# ---- stream -----------------------------------------------------------------------------------------------


async def test_stream_event_order_and_final_response():
    async with asgi_client(ScriptedEngine("abc")) as (client, state):
        events = await sse(client, {"input": "hi", "stream": True})
        await wait_for(lambda: state.admission.num_in_flight == 0)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    created, final = events[0]["response"], events[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
    assert created["id"] == final["id"] and created["id"].startswith("resp_")
    added = events[2]
    assert added["output_index"] == 0 and added["item"]["status"] == "in_progress" and added["item"]["content"] == []
    item_id = added["item"]["id"]
    assert events[3]["part"] == {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    deltas = events[4:7]
    assert [d["delta"] for d in deltas] == ["a", "b", "c"]
    assert all(d["item_id"] == item_id and d["output_index"] == 0 and d["content_index"] == 0 for d in deltas)
    assert all(d["logprobs"] == [] for d in deltas)
    assert events[7]["text"] == "abc" and events[8]["part"]["text"] == "abc"
    assert events[9]["item"]["status"] == "completed" and events[9]["item"]["id"] == item_id
    assert final["status"] == "completed" and final["output"] == [events[9]["item"]]
    assert final["usage"]["input_tokens"] == 19 and final["usage"]["output_tokens"] == 3


async def test_stream_cut_by_max_output_tokens_ends_incomplete():
    async with asgi_client() as (client, _):
        events = await sse(client, {"input": "hi", "stream": True, "max_output_tokens": 2})
    final = events[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["status"] == "incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["output"][0]["status"] == "incomplete"
    assert final["response"]["output"][0]["content"][0]["text"] == "ab"


async def test_stream_tool_calls():
    engine = ScriptedEngine("Checking." + TOOL_CALL_TEXT)
    async with asgi_client(engine) as (client, _):
        events = await sse(client, {"input": "Weather in Paris?", "tools": [WEATHER_TOOL], "stream": True})
    kinds = [e["type"] for e in events]
    assert kinds[-5:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Checking."
    assert kinds.index("response.output_item.done") < kinds.index("response.function_call_arguments.delta")
    added, delta, done, item_done, completed = events[-5:]
    assert added["output_index"] == 1 and added["item"]["arguments"] == "" and added["item"]["status"] == "in_progress"
    assert json.loads(delta["delta"]) == {"city": "Paris"} and done["arguments"] == delta["delta"]
    assert delta["item_id"] == done["item_id"] == added["item"]["id"]
    assert item_done["item"] == {**added["item"], "arguments": delta["delta"], "status": "completed"}
    assert [i["type"] for i in completed["response"]["output"]] == ["message", "function_call"]
    assert completed["response"]["output"][1] == item_done["item"]


async def test_engine_failure_after_the_stream_started_is_response_failed():
    async with asgi_client() as (client, state):
        events = await sse(client, {"input": "FAIL", "stream": True})
        await wait_for(lambda: state.admission.num_in_flight == 0)
    assert [e["type"] for e in events][:2] == ["response.created", "response.in_progress"]
    failed = events[-1]
    assert failed["type"] == "response.failed" and failed["sequence_number"] == len(events) - 1
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "server_error" and failed["response"]["error"]["message"]


def test_stream_builder_with_text_calls_and_more_text():
    response = ResponseObject(
        id="resp_x", created_at=0, status="in_progress", model="m", tool_choice="auto",
        parallel_tool_calls=True, temperature=1.0, top_p=1.0, text={"format": {"type": "text"}},
    )  # fmt: skip
    stream = ResponseStream(response)
    sent = [*stream.start(), *stream.text("Hi "), *stream.text("there")]
    sent += stream.calls([ParsedToolCall("f", '{"a": 1}'), ParsedToolCall("g", "{}")])
    sent += stream.text("after") + stream.finish(
        UsageInfo(prompt_tokens=5, completion_tokens=9, total_tokens=14), False
    )
    events = [(e.event, json.loads(e.data)) for e in sent]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert all(name == data["type"] for name, data in events)
    final = events[-1][1]["response"]
    assert [(i["type"], i["status"]) for i in final["output"]] == [
        ("message", "completed"),
        ("function_call", "completed"),
        ("function_call", "completed"),
        ("message", "completed"),
    ]
    assert (
        final["output"][0]["content"][0]["text"] == "Hi there" and final["output"][3]["content"][0]["text"] == "after"
    )
    indexes = [data["output_index"] for name, data in events if name == "response.output_item.added"]
    assert indexes == [0, 1, 2, 3]
    assert final["usage"]["total_tokens"] == 14 and final["status"] == "completed"


def test_output_items_of_a_reply():
    items = output_items(None, "hello", [ParsedToolCall("f", "{}")], incomplete=False)
    assert isinstance(items[0], OutputMessage) and isinstance(items[1], OutputFunctionCall)
    assert items[1].call_id.startswith("call_") and items[1].arguments == "{}"
    calls_only = output_items(None, None, [ParsedToolCall("f", "{}")], incomplete=False)
    assert [type(i) for i in calls_only] == [OutputFunctionCall]
    assert output_items(None, "cut", [], incomplete=True)[0].status == "incomplete"
    # A thinking block comes first; cut inside it, the reasoning item is the incomplete one.
    thought = output_items("hmm", "hi", [], incomplete=False)
    assert [type(i) for i in thought] == [OutputReasoning, OutputMessage]
    assert thought[0].content[0].text == "hmm"
    assert output_items("hm", None, [], incomplete=True)[0].status == "incomplete"


# ---- the openai client ------------------------------------------------------------------------------------


async def test_openai_client_parses_responses_and_streams():
    async with asgi_client(ScriptedEngine("Sunny." + TOOL_CALL_TEXT)) as (client, _):
        sdk = sdk_client(client)
        response = await sdk.responses.create(model="fake-model", input="Weather?", tools=[WEATHER_TOOL])
        assert response.status == "completed" and response.output_text == "Sunny."
        call = response.output[1]
        assert call.type == "function_call" and call.name == "get_weather"
        assert response.usage is not None and response.usage.output_tokens == len("Sunny." + TOOL_CALL_TEXT)
        events = [e async for e in await sdk.responses.create(model="fake-model", input="Weather?", stream=True)]
        assert events[0].type == "response.created" and events[-1].type == "response.completed"
        assert events[-1].response.output_text == "".join(
            e.delta for e in events if e.type == "response.output_text.delta"
        )
        async with sdk.responses.stream(model="fake-model", input="Weather?", tools=[WEATHER_TOOL]) as stream:
            final = await stream.get_final_response()
        assert final.output_text == "Sunny." and final.output[1].type == "function_call"
        # As agent SDKs continue: the output items sent back (as the SDK dumps them) with the call's result.
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "18C"}
        history = [
            {"role": "user", "content": "Weather?"},
            *(i.model_dump(exclude_unset=True) for i in response.output),
        ]
        again = await sdk.responses.create(model="fake-model", input=[*history, result], tools=[WEATHER_TOOL])
        assert again.status == "completed"


async def test_openai_client_incomplete_and_errors():
    async with asgi_client() as (client, _):
        sdk = sdk_client(client)
        response = await sdk.responses.create(model="fake-model", input="hi", max_output_tokens=2)
        assert response.status == "incomplete" and response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens" and response.output_text == "ab"
        with pytest.raises(openai.BadRequestError) as raised:
            await sdk.responses.create(model="fake-model", input="hi", previous_response_id="resp_1")
        assert raised.value.code == "previous_response_not_found" and "'resp_1'" in str(raised.value)


# ---- errors and ignored fields ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"store": "yes"}, "store"),
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"role": "user", "content": "a"}, {"type": "input_file", "file_id": "f"}]}, "input[1].type"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": "a", "extra": 1}]}, "input[0].extra"),
        ({"input": []}, "input"),
        ({"tools": [{"type": "teleport"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]}, "tools[0].parameters"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"seed": 1}, "seed"),
        ({"text": {"format": {"type": "json_schema", "name": "a", "schema": "object"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_object"}}}, "text.format"),  # the fake has no grammar backend
        ({"include": ["message.output_text.logprobs"]}, "include[0]"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 1000}, "max_output_tokens"),  # context_length_exceeded, named as Responses names it
        ({"temperature": 3}, "temperature"),
    ],
)
async def test_bad_requests_name_the_responses_field(fields, param):
    async with asgi_client() as (client, _):
        response = await client.post(PATH, json={"input": "hi", **fields})
    error = error_of(response, param)
    if param == "previous_response_id":
        assert error["code"] == "previous_response_not_found" and "'resp_123'" in error["message"]
    if param == "conversation":
        assert "continue with previous_response_id" in error["message"]
    if param == "background":
        assert "use stream: true" in error["message"]


async def test_ignored_fields_are_accepted():
    async with asgi_client(ScriptedEngine("ok")) as (client, _):
        body = {
            "input": "hi",
            "metadata": {"k": "v"},
            "reasoning": {"effort": "low", "summary": "auto"},
            "truncation": "auto",
            "service_tier": "auto",
            "prompt_cache_key": "key",
            "prompt_cache_retention": "24h",
            "safety_identifier": "someone",
            "store": False,
            "previous_response_id": None,
            "background": False,
            "include": ["reasoning.encrypted_content"],
            "text": {"format": {"type": "text"}, "verbosity": "low"},
            "user": "u1",
        }
        response = await client.post(PATH, json=body)
    assert response.status_code == 200, response.text
    echoed = response.json()
    assert echoed["metadata"] == {"k": "v"} and echoed["user"] == "u1" and echoed["reasoning"] is None
    assert echoed["text"] == {"format": {"type": "text"}, "verbosity": "low"}
    assert echoed["output"][0]["content"][0]["text"] == "ok"


async def test_openapi_schema_lists_the_route():
    async with asgi_client() as (client, _):
        schema = (await client.get("/openapi.json")).json()
    operation = schema["paths"][PATH]["post"]
    assert "text/event-stream" in operation["responses"]["200"]["content"]
    assert {"ResponsesRequest", "ResponseObject"} <= set(schema["components"]["schemas"])
