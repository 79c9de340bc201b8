"""Stored responses over ASGI with the fake engine: ``previous_response_id`` chains (what the engine received),
``GET`` / ``DELETE /v1/responses/{id}``, ``input_items`` pages, the store's bounds (time to live, entries,
bytes), ``store: false``, streams, a disabled store, metrics and the errors. The prefix-cache hit of a continued
turn is checked on the real model in ``test_prefix_cache_http.py``."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from server.responses.convert import chat_conversion
from server.responses.protocol import ResponsesRequest
from server.responses.retrieval import continued
from server.responses.serving import _with_context_sources
from server.responses.store import ResponseStore
from tests.server.conftest import asgi_client
from tests.server.test_metrics import families, value
from tests.server.test_responses_api import PATH, ScriptedEngine, sdk_client, sse

pytestmark = pytest.mark.anyio


class Clock:
    """A settable clock for the store's time to live."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def create(client: httpx.AsyncClient, **fields: Any) -> dict[str, Any]:
    response = await client.post(PATH, json={"input": "hi", **fields})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def not_found(client: httpx.AsyncClient, response_id: str, why: str) -> None:
    """GET answers 404 naming the id and saying why; continuing from it is OpenAI's 400."""
    response = await client.get(f"{PATH}/{response_id}")
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["code"] == "response_not_found" and error["param"] == "response_id"
    assert f"'{response_id}'" in error["message"] and why in error["message"], error
    continued = await client.post(PATH, json={"input": "more", "previous_response_id": response_id})
    assert continued.status_code == 400, continued.text
    error = continued.json()["error"]
    assert error["code"] == "previous_response_not_found" and error["param"] == "previous_response_id"
    assert f"'{response_id}'" in error["message"] and why in error["message"], error


def texts(items: list[Any]) -> list[tuple[str, str]]:
    """(role, text) of message items."""
    return [(item.role, "".join(part.text for part in item.content)) for item in items]


async def test_openai_client_chain_of_three_turns_retrieve_list_and_delete():
    engine = ScriptedEngine()
    async with asgi_client(engine) as (client, _):
        sdk = sdk_client(client)
        engine.script = "Paris."
        first = await sdk.responses.create(model="fake-model", instructions="Be brief.", input="Capital of France?")
        engine.script = "Rome."
        second = await sdk.responses.create(
            model="fake-model", instructions="Be brief.", input="And of Italy?", previous_response_id=first.id
        )
        engine.script = "Welcome."
        third = await sdk.responses.create(
            model="fake-model", input=[{"role": "user", "content": "Thanks"}], previous_response_id=second.id
        )
        assert (first.output_text, second.output_text, third.output_text) == ("Paris.", "Rome.", "Welcome.")
        assert first.store and third.store and third.previous_response_id == second.id
        # What the engine received: each turn starts with the previous prompt and its output; instructions are
        # not carried over (the third turn gave none).
        assert engine.prompts == [
            "<system>Be brief.<user>Capital of France?<assistant>",
            "<system>Be brief.<user>Capital of France?<assistant>Paris.<user>And of Italy?<assistant>",
            "<user>Capital of France?<assistant>Paris.<user>And of Italy?<assistant>Rome.<user>Thanks<assistant>",
        ]
        assert engine.prompts[1].startswith(engine.prompts[0] + "Paris.")
        assert third.usage is not None and third.usage.input_tokens == len(engine.prompts[2])

        retrieved = await sdk.responses.retrieve(second.id)
        assert retrieved.model_dump() == second.model_dump()

        asc = await sdk.responses.input_items.list(third.id, order="asc")
        assert texts(asc.data) == [
            ("user", "Capital of France?"),
            ("assistant", "Paris."),
            ("user", "And of Italy?"),
            ("assistant", "Rome."),
            ("user", "Thanks"),
        ]
        assert asc.data[1].id == first.output[0].id and asc.data[3].id == second.output[0].id
        assert asc.data[0].id.startswith("msg_") and not asc.has_more
        newest_first = await sdk.responses.input_items.list(third.id)  # OpenAI's default order: desc
        assert [item.id for item in newest_first.data] == [item.id for item in reversed(asc.data)]

        assert await sdk.responses.delete(second.id) is None
        with pytest.raises(openai.NotFoundError) as raised:
            await sdk.responses.retrieve(second.id)
        assert second.id in str(raised.value) and "deleted" in str(raised.value)
        with pytest.raises(openai.BadRequestError) as raised_400:
            await sdk.responses.create(model="fake-model", input="Again?", previous_response_id=second.id)
        assert raised_400.value.code == "previous_response_not_found" and second.id in str(raised_400.value)
        # The third response holds its whole conversation: it stays retrievable and continuable.
        engine.script = "Bye."
        fourth = await sdk.responses.create(model="fake-model", input="Bye", previous_response_id=third.id)
        assert fourth.output_text == "Bye." and engine.prompts[-1].startswith(engine.prompts[2] + "Welcome.")


async def test_delete_answers_openais_deletion_object_once():
    async with asgi_client(ScriptedEngine()) as (client, _):
        response_id = (await create(client))["id"]
        deleted = await client.delete(f"{PATH}/{response_id}")
        assert deleted.status_code == 200 and deleted.json() == {
            "id": response_id,
            "object": "response",
            "deleted": True,
        }
        again = await client.delete(f"{PATH}/{response_id}")
        assert again.status_code == 404 and "was deleted" in again.json()["error"]["message"]
        await not_found(client, response_id, "was deleted")
        await not_found(client, "resp_never", "no response with this id is stored on this server")


async def test_input_items_pages_with_limit_and_after():
    async with asgi_client(ScriptedEngine("ok")) as (client, _):
        items = [{"role": "user", "content": f"message {i}"} for i in range(5)]
        response_id = (await create(client, input=items))["id"]
        url = f"{PATH}/{response_id}/input_items"
        first = (await client.get(url, params={"limit": 2, "order": "asc"})).json()
        assert first["object"] == "list" and first["has_more"] is True
        assert [item["content"] for item in first["data"]] == [
            [{"type": "input_text", "text": f"message {i}"}] for i in range(2)
        ]
        assert first["first_id"] == first["data"][0]["id"] and first["last_id"] == first["data"][1]["id"]
        second = (await client.get(url, params={"limit": 2, "order": "asc", "after": first["last_id"]})).json()
        third = (await client.get(url, params={"limit": 2, "order": "asc", "after": second["last_id"]})).json()
        assert second["has_more"] is True and third["has_more"] is False and len(third["data"]) == 1
        ids = [item["id"] for page in (first, second, third) for item in page["data"]]
        assert len(set(ids)) == 5
        # The openai client pages on with after=last_id until has_more is false.
        sdk = sdk_client(client)
        paged = [item.id async for item in sdk.responses.input_items.list(response_id, limit=2, order="asc")]
        assert paged == ids
        for params, param in (
            ({"limit": 0}, "limit"),
            ({"limit": 101}, "limit"),
            ({"order": "sideways"}, "order"),
            ({"after": "msg_unknown"}, "after"),
            ({"before": ids[2]}, "before"),
            ({"include": "message.output_text.logprobs"}, "include[0]"),
        ):
            bad = await client.get(url, params=params)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (params, bad.text)
        missing = await client.get(f"{PATH}/resp_unknown/input_items")
        assert missing.status_code == 404 and "resp_unknown" in missing.json()["error"]["message"]


async def test_retrieve_options():
    async with asgi_client(ScriptedEngine()) as (client, _):
        sdk = sdk_client(client)
        response = await sdk.responses.create(model="fake-model", input="hi")
        # include entries that cannot apply here are accepted, as in POST (sent as include[]=…)
        again = await sdk.responses.retrieve(response.id, include=["reasoning.encrypted_content"])
        assert again.id == response.id
        for params, param in (
            ({"stream": "true"}, "stream"),
            ({"starting_after": "3"}, "starting_after"),
            ({"include": "message.output_text.logprobs"}, "include[0]"),
            ({"unknown": "1"}, "unknown"),
        ):
            bad = await client.get(f"{PATH}/{response.id}", params=params)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (params, bad.text)


async def test_store_false_is_not_retrievable():
    async with asgi_client(ScriptedEngine()) as (client, state):
        body = await create(client, store=False)
        assert body["store"] is False
        assert state.responses is not None and state.responses.num_responses == 0
        await not_found(client, body["id"], "store: false")


async def test_streamed_response_is_stored_before_its_final_event():
    engine = ScriptedEngine("streamed")
    async with asgi_client(engine) as (client, _):
        events = await sse(client, {"input": "hi", "stream": True})
        final = events[-1]["response"]
        assert events[-1]["type"] == "response.completed" and final["store"] is True
        stored = await client.get(f"{PATH}/{final['id']}")
        assert stored.status_code == 200 and stored.json() == final
        engine.script = "next"
        body = await create(client, input="more", previous_response_id=final["id"])
        assert body["output"][0]["content"][0]["text"] == "next"
        assert engine.prompts[-1] == "<user>hi<assistant>streamed<user>more<assistant>"


async def test_expiry_after_the_time_to_live():
    clock = Clock()
    async with asgi_client(ScriptedEngine(), responses_store_ttl=10) as (client, state):
        assert state.responses is not None
        state.responses.clock = clock
        kept = await create(client)
        clock.now += 9.9
        assert (await client.get(f"{PATH}/{kept['id']}")).status_code == 200  # a read does not extend it
        clock.now += 0.2
        await not_found(client, kept["id"], "it expired (responses are kept 10 s after they are created)")
        metrics = families((await client.get("/metrics")).text)
    assert value(
        metrics["dflash2_stored_responses_evicted"], "dflash2_stored_responses_evicted_total", reason="expired"
    )
    assert value(metrics["dflash2_num_stored_responses"], "dflash2_num_stored_responses") == 0


async def test_entry_bound_evicts_the_least_recently_used():
    async with asgi_client(ScriptedEngine(), responses_store_max_entries=2) as (client, state):
        first, second = await create(client), await create(client)
        assert (await client.get(f"{PATH}/{first['id']}")).status_code == 200  # first is now the most recent
        third = await create(client, previous_response_id=first["id"])  # a continuation also uses first
        assert (await client.get(f"{PATH}/{first['id']}")).status_code == 200
        assert (await client.get(f"{PATH}/{third['id']}")).status_code == 200
        await not_found(client, second["id"], "evicted to keep the store within 2 responses")
        assert state.responses is not None and state.responses.num_responses == 2
        metrics = families((await client.get("/metrics")).text)
    evicted = metrics["dflash2_stored_responses_evicted"]
    assert value(evicted, "dflash2_stored_responses_evicted_total", reason="max_entries") == 1
    assert value(metrics["dflash2_num_stored_responses"], "dflash2_num_stored_responses") == 2


async def test_byte_bound_evicts_and_a_response_larger_than_the_store_is_not_kept():
    async with asgi_client(ScriptedEngine()) as (client, state):
        await create(client)
        assert state.responses is not None
        size = state.responses.num_bytes
    max_bytes = size * 5 // 2  # room for two responses of this size, not three
    async with asgi_client(ScriptedEngine(), responses_store_max_bytes=max_bytes) as (client, state):
        ids = [(await create(client))["id"] for _ in range(3)]
        assert state.responses is not None and state.responses.num_responses == 2
        assert size * 2 - 8 <= state.responses.num_bytes <= max_bytes
        await not_found(client, ids[0], f"evicted to keep the store within {max_bytes} bytes")
        assert (await client.get(f"{PATH}/{ids[2]}")).status_code == 200
        metrics = families((await client.get("/metrics")).text)
        assert value(metrics["dflash2_stored_responses_bytes"], "dflash2_stored_responses_bytes") == (
            state.responses.num_bytes
        )
        evicted = metrics["dflash2_stored_responses_evicted"]
        assert value(evicted, "dflash2_stored_responses_evicted_total", reason="max_bytes") == 1
    async with asgi_client(ScriptedEngine(), responses_store_max_bytes=size // 2) as (client, state):
        body = await create(client)
        assert body["store"] is True and state.responses is not None and state.responses.num_responses == 0
        await not_found(client, body["id"], f"within {size // 2} bytes")


async def test_a_disabled_store_serves_store_true_without_storing():
    async with asgi_client(ScriptedEngine(), responses_store_max_entries=0) as (client, _):
        body = await create(client, store=True)
        assert body["store"] is False and body["output"][0]["content"][0]["text"] == "abc"
        await not_found(client, body["id"], "this server stores no responses (--responses-store-max-entries 0)")


async def test_continuing_with_tool_results_and_error_names():
    """A tool-call turn continued with only the call's output (what agent SDKs send with previous_response_id);
    errors in the new input keep their own indices."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    engine = ScriptedEngine(call)
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    async with asgi_client(engine) as (client, _):
        first = await create(client, input="Weather?", tools=[tool])
        (function_call,) = first["output"]
        assert function_call["type"] == "function_call"
        engine.script = "Sunny."
        result = {"type": "function_call_output", "call_id": function_call["call_id"], "output": "18C"}
        second = await create(client, input=[result], tools=[tool], previous_response_id=first["id"])
        assert second["output"][0]["content"][0]["text"] == "Sunny."
        prompt = engine.prompts[-1]
        assert prompt.startswith(engine.prompts[0]) and '"city": "Paris"' in prompt and "18C" in prompt
        bad = await client.post(
            PATH,
            json={"input": [{"role": "user", "content": "a"}, {"role": "tool"}], "previous_response_id": first["id"]},
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "input[1].role", bad.text
        # Errors the chat path raises about a message name the stored items as previous_response_id and the
        # request's own items by their own index.
        request = ResponsesRequest.model_validate({"input": [{"role": "user", "content": "x"}] * 2})
        context = ({"id": "msg_1", "type": "message", "role": "user", "content": "old"},)
        conversion = _with_context_sources(chat_conversion(continued(request, context)), 1, request)
        assert [conversion.param(f"messages[{k}].content") for k in range(3)] == [
            "previous_response_id",
            "input[0]",
            "input[1]",
        ]


def test_store_unit_bounds_and_reasons():
    clock = Clock()
    evictions: list[str] = []
    store = ResponseStore(max_entries=3, max_bytes=10_000, ttl=60, clock=clock, on_evict=evictions.append)
    for i in range(3):
        store.put({"id": f"resp_{i}", "output": []}, [{"id": f"msg_{i}", "type": "message"}])
        clock.now += 10
    assert store.get("resp_0") is not None  # touched: resp_1 is now the least recently used
    store.put({"id": "resp_3", "output": []}, [])
    assert store.get("resp_1") is None and "evicted" in store.why_missing("resp_1")
    clock.now += 35  # resp_0 was stored 65 s ago, resp_2 45 s ago
    assert store.get("resp_0") is None and "expired" in store.why_missing("resp_0")
    assert store.get("resp_2") is not None and store.num_responses == 2
    assert evictions == ["max_entries", "expired"]
    assert store.delete("resp_2") and not store.delete("resp_2") and store.why_missing("resp_2") == "it was deleted"
    entry = store.get("resp_3")
    assert entry is not None and entry.context == () and store.num_bytes == entry.num_bytes


async def test_the_endpoints_need_the_api_key_and_are_in_the_schema():
    async with asgi_client(ScriptedEngine(), api_key="secret") as (client, _):
        for method, path in (("GET", "/resp_x"), ("DELETE", "/resp_x"), ("GET", "/resp_x/input_items")):
            assert (await client.request(method, PATH + path)).status_code == 401, (method, path)
        schema = (await client.get("/openapi.json")).json()
    item = schema["paths"][PATH + "/{response_id}"]
    assert set(item) == {"get", "delete"} and item["get"]["security"] == [{"bearer": []}]
    listing = schema["paths"][PATH + "/{response_id}/input_items"]["get"]
    assert {p["name"] for p in listing["parameters"]} == {"response_id", "limit", "order", "after"}
    assert {"ResponseItemList", "DeletedResponse"} <= set(schema["components"]["schemas"])
