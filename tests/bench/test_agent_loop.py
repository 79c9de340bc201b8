"""The agent-loop workload of ``dflash2 bench`` without a server: its scripts, the loop's history (tool
results fed back under their calls' ids) through a fake chat endpoint, and the summary math."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from dflash2.bench.agent_loop import (
    FILES,
    JSON,
    TEXT,
    TOOL_CALL,
    TOOLS,
    TURN_KINDS,
    LoopTurn,
    Script,
    ScriptTurn,
    add_comparisons,
    build_scripts,
    kind_summary,
    mismatches,
    run_script,
    run_tool,
    server_summary,
)
from dflash2.bench.config import AGENT_LOOP_MAX_CONVERSATIONS, AGENT_LOOP_SERVERS, BenchConfig
from dflash2.bench.report import agent_loop_table


class ScriptedModel:
    """A chat endpoint that answers each turn as the script expects (its call, a JSON object or text)."""

    def __init__(self, script: Script) -> None:
        self.steps = iter(script.turns)
        self.ids = itertools.count()
        self.payloads: list[dict[str, Any]] = []

    def __call__(self, payload: dict[str, Any]) -> tuple[dict[str, Any], float]:
        self.payloads.append(json.loads(json.dumps(payload)))  # a copy, as the wire would carry
        step = next(self.steps)
        message: dict[str, Any] = {"role": "assistant", "content": None}
        if step.call is not None:
            call = {"name": step.call.name, "arguments": json.dumps(step.call.arguments)}
            message["tool_calls"] = [{"id": f"call_{next(self.ids)}", "type": "function", "function": call}]
        else:
            message["content"] = json.dumps({"answer": len(self.payloads)}) if step.kind == JSON else "done"
        body = {
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if step.call else "stop"}],
            "usage": {"prompt_tokens": 100, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 50}},
            "dflash2": {"draft_tokens": 16, "accepted_tokens": 4, "verify_steps": 4, "mean_acceptance_length": 2.0},
        }
        return body, 0.5


def _calls(messages: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for m in messages
        if m["role"] == "assistant"
        for c in m.get("tool_calls") or []
    ]


def test_scripts_have_every_kind_and_tool_choice_and_rich_tools() -> None:
    scripts = build_scripts()
    assert len(scripts) == AGENT_LOOP_MAX_CONVERSATIONS
    assert all(5 <= len(s.turns) <= 8 for s in scripts)
    steps = [t for s in scripts for t in s.turns]
    assert {t.kind for t in steps} == set(TURN_KINDS)
    choices = {t.tool_choice for t in steps if t.kind == TOOL_CALL}
    assert {"required", "auto"} <= choices and choices & {t["function"]["name"] for t in TOOLS}
    assert all(t.call is not None for t in steps if t.kind == TOOL_CALL)
    assert all(t.schema is not None for t in steps if t.kind == JSON)
    assert any(t.user is None for t in steps if t.kind == TEXT)  # an answer right after a tool result
    parameters = [t["function"]["parameters"]["properties"] for t in TOOLS]
    assert len(TOOLS) >= 4
    assert any(p.get("type") == "object" for props in parameters for p in props.values())
    assert any("enum" in p for props in parameters for p in props.values())


def test_payloads_carry_the_tools_the_choice_and_the_schema() -> None:
    step = ScriptTurn(TOOL_CALL, "x", "book_hotel")
    payload = step.payload("m", [{"role": "user", "content": "x"}], 96)
    assert payload["tool_choice"] == {"type": "function", "function": {"name": "book_hotel"}}
    assert payload["temperature"] == 0.0 and payload["max_tokens"] == 96 and payload["tools"] == TOOLS
    json_step = next(t for s in build_scripts() for t in s.turns if t.kind == JSON)
    payload = json_step.payload("m", [], 96)
    assert payload["tool_choice"] == "none" and payload["response_format"]["type"] == "json_schema"
    assert payload["response_format"]["json_schema"]["schema"] is json_step.schema


@pytest.mark.parametrize("index", range(AGENT_LOOP_MAX_CONVERSATIONS))
def test_the_loop_feeds_results_back_under_their_ids_and_sends_the_whole_history(index: int) -> None:
    script = build_scripts()[index]
    model = ScriptedModel(script)
    turns, messages = run_script(model, "m", script, index, 128)
    assert [t.turn for t in turns] == list(range(len(script.turns))) and all(t.ok for t in turns)
    assert all(t.made_expected_call for t, s in zip(turns, script.turns) if s.call is not None)
    # every tool message answers a call of the assistant message before it, by id, with the tool's result
    for position, message in enumerate(messages):
        if message["role"] != "tool":
            continue
        owner = next(m for m in reversed(messages[:position]) if m["role"] == "assistant")
        calls = {c["id"]: c for c in owner["tool_calls"]}
        call = calls[message["tool_call_id"]]
        assert message["content"] == run_tool(call["function"]["name"], call["function"]["arguments"])
    answered = [m["tool_call_id"] for m in messages if m["role"] == "tool"]
    made = [c["id"] for m in messages if m["role"] == "assistant" for c in m.get("tool_calls") or []]
    assert answered == made
    # later turns resend the whole history: each request's messages start with the previous one's
    for earlier, later in zip(model.payloads, model.payloads[1:]):
        assert later["messages"][: len(earlier["messages"])] == earlier["messages"]
    assert model.payloads[-1]["messages"] == messages[: len(model.payloads[-1]["messages"])]


def test_scripts_repeat_calls_and_file_contents() -> None:
    repeated, rewritten = 0, 0
    for index, script in enumerate(build_scripts()):
        _, messages = run_script(ScriptedModel(script), "m", script, index, 128)
        calls = _calls(messages)
        for step in script.turns:
            if step.is_repeat:
                assert step.call is not None
                assert calls.count((step.call.name, step.call.arguments)) >= 2
                repeated += 1
        results = [m["content"] for m in messages if m["role"] == "tool"]
        for name, arguments in calls:
            if name == "write_file":
                # written back as read, or with one small edit: most of its lines were in a tool result
                source = next(text for text in FILES.values() if text in results)
                kept = set(arguments["content"].splitlines()) & set(source.splitlines())
                assert len(kept) >= len(source.splitlines()) - 1
                rewritten += 1
    assert repeated >= 4 and rewritten >= 2


def test_a_failed_request_ends_the_conversation() -> None:
    script = build_scripts()[0]

    def failing(payload: dict[str, Any]) -> tuple[dict[str, Any], float]:
        raise RuntimeError("HTTP 500: boom")

    turns, _ = run_script(failing, "m", script, 0, 64)
    assert len(turns) == 1 and not turns[0].ok and "boom" in turns[0].error


def test_tools_results_are_deterministic_functions_of_the_call() -> None:
    args = json.dumps({"origin": "BOS", "destination": "LIS", "date": "d", "passengers": 2, "cabin": "economy"})
    assert run_tool("search_flights", args) == run_tool("search_flights", args)
    other = args.replace("LIS", "OPO")
    assert run_tool("search_flights", other) != run_tool("search_flights", args)
    assert run_tool("read_file", '{"path": "config.yaml"}') == FILES["config.yaml"]
    assert run_tool("read_file", '{"path": "nope"}').startswith("error")
    assert run_tool("write_file", "{not json").startswith("error")


def _turn(kind: str, conversation: int, turn: int, tokens: int, seconds: float, steps: int, accepted: int, **kw: Any):
    return LoopTurn(conversation, turn, kind, True, seconds, 0, 0, tokens, steps, accepted, **kw)


def test_kind_summary_tau_rate_and_sources() -> None:
    turns = [
        _turn(TOOL_CALL, 0, 0, 30, 1.0, 10, 20, accepted_by_source={"drafter": 15, "grammar": 5}),
        _turn(TOOL_CALL, 0, 1, 10, 0.5, 6, 4, accepted_by_source={"drafter": 1, "suffix": 3}),
        _turn(TOOL_CALL, 0, 2, 12, 3.0, 8, 3),
        LoopTurn(1, 0, TOOL_CALL, False, error="x"),
    ]
    summary = kind_summary(turns)
    assert summary["tau"] == pytest.approx((20 + 4 + 3 + 10 + 6 + 8) / (10 + 6 + 8))
    assert summary["tokens_per_second_p50"] == pytest.approx(20.0)  # median of 30, 20 and 4 tok/s
    assert summary["output_tokens"] == 52 and summary["verify_steps"] == 24 and summary["num_errors"] == 1
    assert summary["accepted_by_source"] == {"drafter": 16, "grammar": 5, "suffix": 3}
    turns[1].made_expected_call = True
    assert kind_summary(turns)["expected_calls"] == 1
    assert kind_summary([_turn(TEXT, 0, 0, 5, 1.0, 0, 0)])["tau"] is None  # autoregressive: no verify steps


def test_comparisons_ratios_and_mismatches() -> None:
    def run(seconds: float, rate: float, outputs: list[str]) -> list[LoopTurn]:
        return [_turn(TEXT, 0, i, int(rate), 1.0, 4, 4, output=text) for i, text in enumerate(outputs)]

    turns = {
        "ar": run(40.0, 20, ["a", "b", "c"]),
        "dflash2": run(10.0, 60, ["a", "b", "c"]),
        "dflash2-base": run(20.0, 40, ["a", "B", "c"]),
    }
    servers = [
        server_summary("ar", turns["ar"], 40.0),
        server_summary("dflash2", turns["dflash2"], 10.0),
        server_summary("dflash2-base", turns["dflash2-base"], 20.0),
    ]
    add_comparisons(servers, turns)
    by_name = {s["server"]: s for s in servers}
    assert by_name["dflash2"]["speedup_vs_ar"] == pytest.approx(4.0)
    assert by_name["dflash2"]["speedup_vs_base"] == pytest.approx(2.0)
    assert by_name["dflash2"]["kinds"][TEXT]["tokens_per_second_vs_ar"] == pytest.approx(3.0)
    assert by_name["dflash2"]["kinds"][TEXT]["tokens_per_second_vs_base"] == pytest.approx(1.5)
    assert by_name["dflash2"]["kinds"][JSON]["tokens_per_second_vs_ar"] is None  # no json turns here
    assert by_name["dflash2"]["num_mismatches"] == 0 and by_name["ar"]["num_mismatches"] is None
    assert by_name["dflash2-base"]["num_mismatches"] == 1
    assert by_name["dflash2-base"]["mismatches"][0]["turn"] == 1
    lines = agent_loop_table({"agent_loop": {"conversations": ["x"], "turns": 3, "max_tokens": 96, "servers": servers}})
    assert any("| dflash2 | text | 3 |" in line and "3.00×" in line for line in lines)
    assert any(line.startswith("| dflash2 | 10.0 | 4.00× | 2.00× | 0 |") for line in lines)
    header = next(line for line in lines if line.startswith("| server | turn kind"))
    column = [c.strip() for c in header.split("|")].index("calls as asked")
    text_row = next(line for line in lines if line.startswith("| dflash2 | text |"))
    assert [c.strip() for c in text_row.split("|")][column] == "–"  # no call asked for


def test_mismatches_skip_failed_and_missing_turns() -> None:
    reference = [_turn(TEXT, 0, 0, 1, 1, 0, 0, output="a"), _turn(TEXT, 0, 1, 1, 1, 0, 0, output="b")]
    other = [_turn(TEXT, 0, 0, 1, 1, 0, 0, output="x"), LoopTurn(0, 1, TEXT, False), _turn(TEXT, 1, 0, 1, 1, 0, 0)]
    assert [(m["conversation"], m["turn"]) for m in mismatches(reference, other)] == [(0, 0)]


def test_config_checks_the_agent_loop_servers() -> None:
    assert BenchConfig().agent_loop_servers == tuple(AGENT_LOOP_SERVERS)
    with pytest.raises(ValueError, match="agent-loop servers"):
        BenchConfig(agent_loop_servers=("ar", "eagle"))
    with pytest.raises(ValueError, match="agent_loop_conversations"):
        BenchConfig(agent_loop_conversations=AGENT_LOOP_MAX_CONVERSATIONS + 1)
