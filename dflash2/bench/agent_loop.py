"""The agent-loop workload: a tool-using agent's turns replayed against several servers, per turn kind.

Each conversation is a fixed script (``build_scripts``) of an agent that works with five tools
(``TOOLS``: flights, files, commands, a nested hotel booking with enum arguments). Its turns are of
three kinds:

- ``tool_call``: ``tool_choice`` ``required``, ``auto`` or a named tool; the calls the model writes
  are run by a deterministic fake environment (``run_tool``) and their results go back as
  ``role: tool`` messages with the call's ``tool_call_id``. Scripts repeat calls (the same search,
  command or booking in a later turn) and file contents (a file read earlier is written back or
  edited slightly), as agents do;
- ``json``: ``response_format`` ``json_schema`` (a person record; a plan of steps with enums);
- ``text``: plain answers that quote earlier outputs ("repeat the command you ran"), or the
  answer right after a tool result.

Every request carries the whole history and the same tools (``tool_choice: none`` on json and text
turns), at T = 0, ``max_tokens`` = ``agent_loop_max_tokens``, not streamed. The servers
(``AGENT_LOOP_SERVERS`` in ``config.py``: autoregressive, the speculative default, with drafts from
earlier outputs added, and without some draft sources) are started one after another; each runs the
conversations one after another after one warm-up request.

Reported per server and turn kind: τ = (accepted + verify steps) / verify steps from the response's
``dflash2`` object, output tok/s p50 (completion tokens / request seconds), tokens, verify steps and
accepted tokens by draft source (``accepted_tokens_by_source`` where the server reports it); per
server the end-to-end seconds of all conversations; the ratios against the autoregressive server
and against ``dflash2-base``; and the turns whose output (content and calls) differs from the
autoregressive server's, which at T = 0 should be none (a conversation whose outputs differ goes on
with its own history, so its later turns are compared on different prompts).
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from dflash2.bench.config import AGENT_LOOP_BASE, AGENT_LOOP_SERVERS, AR, BenchConfig
from dflash2.bench.serving import ServerSpec, process_peak_rss_bytes, started_server
from dflash2.bench.stats import median, ratio
from dflash2.outputs import DRAFT_SOURCE_NAMES

Progress = Callable[[str], None]
Message = dict[str, Any]
#: Sends one chat request; returns the response body and the request's seconds (raises on failure).
Send = Callable[[dict[str, Any]], tuple[dict[str, Any], float]]

TOOL_CALL, JSON, TEXT = "tool_call", "json", "text"
TURN_KINDS = (TOOL_CALL, JSON, TEXT)
DRAFT_SOURCES = DRAFT_SOURCE_NAMES


def _function(name: str, description: str, properties: dict[str, Any], required: Sequence[str]) -> dict[str, Any]:
    parameters = {"type": "object", "properties": properties, "required": list(required)}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


_STRING = {"type": "string"}
TOOLS: list[dict[str, Any]] = [
    _function(
        "search_flights",
        "Search flights between two airports on a date.",
        {
            "origin": {"type": "string", "description": "IATA code"},
            "destination": {"type": "string", "description": "IATA code"},
            "date": {"type": "string", "description": "YYYY-MM-DD"},
            "passengers": {"type": "integer"},
            "cabin": {"type": "string", "enum": ["economy", "premium", "business", "first"]},
        },
        ["origin", "destination", "date", "passengers", "cabin"],
    ),
    _function("read_file", "Read a text file of the workspace.", {"path": _STRING}, ["path"]),
    _function(
        "write_file", "Write a text file of the workspace.", {"path": _STRING, "content": _STRING}, ["path", "content"]
    ),
    _function(
        "run_command",
        "Run a shell command in the workspace.",
        {"command": _STRING, "timeout": {"type": "integer", "description": "seconds"}},
        ["command", "timeout"],
    ),
    _function(
        "book_hotel",
        "Book a hotel room.",
        {
            "guest": {
                "type": "object",
                "properties": {"name": _STRING, "email": _STRING},
                "required": ["name", "email"],
            },
            "stay": {
                "type": "object",
                "properties": {"check_in": _STRING, "check_out": _STRING},
                "required": ["check_in", "check_out"],
            },
            "room": {"type": "string", "enum": ["single", "double", "suite"]},
        },
        ["guest", "stay", "room"],
    ),
]

PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": _STRING,
        "email": _STRING,
        "age": {"type": "integer"},
        "role": {"type": "string", "enum": ["traveller", "engineer", "manager", "other"]},
    },
    "required": ["name", "email", "age", "role"],
}
PLAN_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "goal": _STRING,
        "steps": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "action": {"type": "string", "enum": ["search", "book", "read", "write", "run", "review"]},
                    "detail": _STRING,
                    "priority": {"type": "string", "enum": ["low", "medium", "high"]},
                },
                "required": ["action", "detail", "priority"],
            },
        },
    },
    "required": ["goal", "steps"],
}

#: The fake workspace's files (``read_file``); any other path is an error result.
FILES: dict[str, str] = {
    "config.yaml": (
        "server:\n  host: 0.0.0.0\n  port: 8080\n  workers: 4\n"
        "database:\n  url: postgres://app@db:5432/app\n  pool_size: 10\n"
        "logging:\n  level: info\n  format: json\n"
    ),
    "/var/log/app.log": (
        "2026-03-02 09:14:07 INFO  api started on port 8080\n"
        "2026-03-02 09:15:31 WARN  disk /data at 91% capacity\n"
        "2026-03-02 09:16:02 ERROR backup job failed: no space left on device\n"
        "2026-03-02 09:16:05 INFO  paged on-call: Maria Chen <maria.chen@example.com>\n"
    ),
}


def run_tool(name: str, arguments: str) -> str:
    """The fake environment's result of one call (a deterministic function of the name and arguments)."""
    try:
        args = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return f"error: the arguments of {name} are not JSON"
    if not isinstance(args, dict):
        return f"error: the arguments of {name} are not an object"
    code = f"{zlib.crc32(f'{name}:{arguments}'.encode()) % 100000:05d}"
    if name == "search_flights":
        route = f"{args.get('origin', '?')}-{args.get('destination', '?')}"
        flights = [
            {"flight": f"DF{code[:3]}", "route": route, "date": args.get("date"), "depart": "08:40", "price_usd": 412},
            {"flight": f"DF{code[2:]}", "route": route, "date": args.get("date"), "depart": "17:05", "price_usd": 389},
        ]
        return json.dumps({"cabin": args.get("cabin"), "passengers": args.get("passengers"), "flights": flights})
    if name == "read_file":
        path = str(args.get("path", ""))
        return FILES.get(path, f"error: {path}: no such file")
    if name == "write_file":
        return f"wrote {len(str(args.get('content', '')).encode())} bytes to {args.get('path', '?')}"
    if name == "run_command":
        command = str(args.get("command", ""))
        if "pytest" in command:
            failure = "FAILED tests/test_config.py::test_port - assert 8081 == 8080"
            return f"$ {command}\n........F.\n{failure}\n1 failed, 9 passed"
        if command.startswith("df"):
            return (
                f"$ {command}\nFilesystem  Size  Used Avail Use% Mounted on\n"
                "/dev/sda1    50G   46G  4.0G  91% /data\n/dev/sdb1   200G   80G  120G  40% /home"
            )
        return f"$ {command}\nok"
    if name == "book_hotel":
        guest = args.get("guest")
        guest_name = guest.get("name") if isinstance(guest, dict) else None
        return json.dumps({"confirmation": f"HB-{code}", "guest": guest_name, "room": args.get("room")})
    return f"error: unknown tool {name}"


@dataclass(frozen=True)
class ToolCall:
    """A call as the script expects it: the tool's name and its arguments."""

    name: str
    arguments: dict[str, Any]

    def matches(self, name: str, arguments: str) -> bool:
        """True when a reply's call (name, arguments as JSON text) is this call."""
        try:
            return name == self.name and json.loads(arguments) == self.arguments
        except json.JSONDecodeError:
            return False


@dataclass(frozen=True)
class ScriptTurn:
    """One measured request of a script.

    Attributes:
        kind: ``tool_call``, ``json`` or ``text``.
        user: the user message sent before the request; None: the model goes on after the tool results.
        tool_choice: ``required``, ``auto``, a tool's name (a named choice) or ``none``.
        schema: ``json`` turns: the ``response_format`` JSON schema.
        call: ``tool_call`` turns: the call the user message asks for (the turn's record says whether
            the model made it; the model's own calls are what the loop runs and feeds back).
        is_repeat: ``call`` equals an earlier call of the conversation (the history's or a turn's).
    """

    kind: str
    user: str | None
    tool_choice: str = "none"
    schema: dict[str, Any] | None = None
    call: ToolCall | None = None
    is_repeat: bool = False

    def payload(self, model: str, messages: list[Message], max_tokens: int) -> dict[str, Any]:
        """The chat request of this turn on ``messages`` (the whole history, this turn's user message included)."""
        payload: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "tools": TOOLS,
        }
        if self.tool_choice in ("required", "auto", "none"):
            payload["tool_choice"] = self.tool_choice
        else:
            payload["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice}}
        if self.schema is not None:
            name = "person" if self.schema is PERSON_SCHEMA else "plan"
            payload["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": name, "schema": self.schema, "strict": True},
            }
        return payload


@dataclass(frozen=True)
class Script:
    """One conversation: the history it starts from (system prompt, earlier calls and results) and its turns."""

    name: str
    history: tuple[Message, ...]
    turns: tuple[ScriptTurn, ...]


def _seed_call(call_id: str, call: ToolCall) -> list[Message]:
    """An earlier assistant call and its result, as a resumed agent's history holds them."""
    text = json.dumps(call.arguments)
    message = {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": text}}
    return [
        {"role": "assistant", "content": None, "tool_calls": [message]},
        {"role": "tool", "tool_call_id": call_id, "content": run_tool(call.name, text)},
    ]


def _tool_turn(user: str, tool_choice: str, call: ToolCall, is_repeat: bool = False) -> ScriptTurn:
    return ScriptTurn(TOOL_CALL, user, tool_choice, call=call, is_repeat=is_repeat)


def build_scripts() -> list[Script]:
    """The workload's conversations (fixed; ``agent_loop_conversations`` takes the first N)."""
    lisbon = ToolCall(
        "search_flights",
        {"origin": "BOS", "destination": "LIS", "date": "2026-05-14", "passengers": 2, "cabin": "economy"},
    )
    ana = ToolCall(
        "book_hotel",
        {
            "guest": {"name": "Ana Silva", "email": "ana.silva@example.com"},
            "stay": {"check_in": "2026-05-14", "check_out": "2026-05-18"},
            "room": "double",
        },
    )
    travel = Script(
        "travel",
        ({"role": "system", "content": "You are a travel agent. Use the tools to search and book."},),
        (
            _tool_turn("Find flights from BOS to LIS on 2026-05-14 for 2 passengers in economy.", "required", lisbon),
            ScriptTurn(TEXT, None),
            _tool_turn(
                "Book a double room for Ana Silva (ana.silva@example.com), check in 2026-05-14, check out 2026-05-18.",
                "book_hotel",
                ana,
            ),
            ScriptTurn(JSON, "Give the traveller record of Ana Silva, 34, as JSON.", schema=PERSON_SCHEMA),
            _tool_turn(
                "Search the same flights again (BOS to LIS, 2026-05-14, 2 passengers, economy): prices change.",
                "search_flights",
                lisbon,
                is_repeat=True,
            ),
            ScriptTurn(JSON, "Plan the rest of the trip as JSON steps.", schema=PLAN_SCHEMA),
            ScriptTurn(TEXT, "Repeat the exact flight search you ran, word for word."),
        ),
    )
    read_config = ToolCall("read_file", {"path": "config.yaml"})
    tests = ToolCall("run_command", {"command": "pytest -q tests/test_config.py", "timeout": 120})
    coding = Script(
        "coding",
        (
            {
                "role": "system",
                "content": "You are a coding agent in a repository. Use the tools to read, edit and test.",
            },
            {"role": "user", "content": "Show me config.yaml."},
            *_seed_call("call_seed_config", read_config),
        ),
        (
            _tool_turn(
                "Write config.yaml back with the port changed from 8080 to 8081; keep every other line the same.",
                "write_file",
                ToolCall(
                    "write_file", {"path": "config.yaml", "content": FILES["config.yaml"].replace("8080", "8081")}
                ),
            ),
            _tool_turn(
                "Run the tests: `pytest -q tests/test_config.py` with a timeout of 120 seconds.", "required", tests
            ),
            ScriptTurn(TEXT, "Repeat the command you ran."),
            _tool_turn("Read config.yaml again.", "required", read_config, is_repeat=True),
            _tool_turn("Run the same test command again, with the same timeout.", "run_command", tests, is_repeat=True),
            ScriptTurn(JSON, "Plan the remaining work as JSON steps.", schema=PLAN_SCHEMA),
        ),
    )
    disk = ToolCall("run_command", {"command": "df -h", "timeout": 10})
    log = "/var/log/app.log"
    ops = Script(
        "ops",
        ({"role": "system", "content": "You are an operations agent on a Linux server. Use the tools."},),
        (
            _tool_turn("Check disk usage with `df -h` (timeout 10 seconds).", "required", disk),
            _tool_turn(f"Read the file {log}.", "auto", ToolCall("read_file", {"path": log})),
            ScriptTurn(TEXT, None),
            ScriptTurn(JSON, "Extract the on-call engineer named in the log as a person record.", schema=PERSON_SCHEMA),
            _tool_turn("Run `df -h` again with the same timeout.", "run_command", disk, is_repeat=True),
            _tool_turn(
                f"Write the log you read back to {log}.bak, unchanged.",
                "write_file",
                ToolCall("write_file", {"path": f"{log}.bak", "content": FILES[log]}),
            ),
            ScriptTurn(TEXT, "Quote the last line of the log."),
        ),
    )
    li = ToolCall(
        "book_hotel",
        {
            "guest": {"name": "Li Wei", "email": "li.wei@example.com"},
            "stay": {"check_in": "2026-06-01", "check_out": "2026-06-04"},
            "room": "suite",
        },
    )
    booking = Script(
        "booking",
        ({"role": "system", "content": "You are a booking assistant. Use the tools."},),
        (
            _tool_turn(
                "Search flights from SFO to JFK on 2026-06-01 for 1 passenger in business.",
                "required",
                ToolCall(
                    "search_flights",
                    {"origin": "SFO", "destination": "JFK", "date": "2026-06-01", "passengers": 1, "cabin": "business"},
                ),
            ),
            _tool_turn("Book a suite for Li Wei (li.wei@example.com) from 2026-06-01 to 2026-06-04.", "auto", li),
            ScriptTurn(JSON, "Plan the trip as JSON steps.", schema=PLAN_SCHEMA),
            _tool_turn(
                "Book the same hotel again for the same guest, dates and room: the first booking timed out.",
                "book_hotel",
                li,
                is_repeat=True,
            ),
            ScriptTurn(TEXT, "Repeat the booking details you sent, exactly."),
            ScriptTurn(JSON, "Give the guest's record as JSON (Li Wei is 41).", schema=PERSON_SCHEMA),
        ),
    )
    return [travel, coding, ops, booking]


@dataclass
class LoopTurn:
    """One request of a conversation as the client saw it."""

    conversation: int
    turn: int
    kind: str
    ok: bool
    seconds: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    verify_steps: int = 0
    accepted_tokens: int = 0
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    finish_reason: str = ""
    output: str = ""
    calls: list[str] = field(default_factory=list)
    made_expected_call: bool | None = None
    error: str = ""

    @property
    def tokens_per_second(self) -> float:
        """Completion tokens / request seconds (0 for a failed or instant request)."""
        return self.output_tokens / self.seconds if self.ok and self.seconds > 0 else 0.0


def reply_text(message: Message) -> str:
    """What a reply said, for comparing servers: its content, then each call's name and arguments (not ids)."""
    parts = [message.get("content") or ""]
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        parts.append(f"<call {function.get('name')}>{function.get('arguments')}")
    return "\n".join(parts)


def _record(conversation: int, index: int, step: ScriptTurn, body: dict[str, Any], seconds: float) -> LoopTurn:
    choice = body["choices"][0]
    usage = body.get("usage") or {}
    info = body.get("dflash2") or {}
    by_source = info.get("accepted_tokens_by_source") or {}
    message = choice.get("message") or {}
    calls = [c.get("function") or {} for c in message.get("tool_calls") or []]
    expected = step.call
    return LoopTurn(
        conversation,
        index,
        step.kind,
        ok=True,
        seconds=seconds,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
        output_tokens=int(usage.get("completion_tokens", 0)),
        verify_steps=int(info.get("verify_steps", 0)),
        accepted_tokens=int(info.get("accepted_tokens", 0)),
        accepted_by_source={str(k): int(v) for k, v in by_source.items()},
        finish_reason=str(choice.get("finish_reason") or ""),
        output=reply_text(message),
        calls=[str(c.get("name")) for c in calls],
        made_expected_call=None
        if expected is None
        else any(expected.matches(str(c.get("name")), str(c.get("arguments") or "")) for c in calls),
    )


def run_script(
    send: Send, model: str, script: Script, conversation: int, max_tokens: int
) -> tuple[list[LoopTurn], list[Message]]:
    """Every turn of ``script`` in order through ``send``: each reply joins the history, and each call
    it makes is run (``run_tool``) and answered with a ``role: tool`` message of the call's id. A failed
    request ends the conversation. Returns the turns and the final history."""
    messages: list[Message] = [dict(m) for m in script.history]
    turns: list[LoopTurn] = []
    for index, step in enumerate(script.turns):
        if step.user is not None:
            messages.append({"role": "user", "content": step.user})
        try:
            body, seconds = send(step.payload(model, list(messages), max_tokens))
            turn = _record(conversation, index, step, body, seconds)
        except (httpx.HTTPError, RuntimeError, ValueError, KeyError, IndexError) as exc:
            turns.append(LoopTurn(conversation, index, step.kind, ok=False, error=f"{type(exc).__name__}: {exc}"))
            break
        turns.append(turn)
        message = body["choices"][0].get("message") or {}
        calls = message.get("tool_calls") or []
        reply: Message = {"role": "assistant", "content": message.get("content")}
        if calls:
            reply["tool_calls"] = calls
        elif reply["content"] is None:
            reply["content"] = ""
        messages.append(reply)
        for call in calls:
            function = call.get("function") or {}
            result = run_tool(str(function.get("name")), str(function.get("arguments") or ""))
            messages.append({"role": "tool", "tool_call_id": call.get("id"), "content": result})
    return turns, messages


def http_send(client: httpx.Client, url: str) -> Send:
    """``Send`` over ``client`` to ``url``'s ``/v1/chat/completions`` (raises ``RuntimeError`` on a non-200)."""

    def send(payload: dict[str, Any]) -> tuple[dict[str, Any], float]:
        start = time.perf_counter()
        response = client.post(f"{url}/v1/chat/completions", json=payload)
        seconds = time.perf_counter() - start
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        return response.json(), seconds

    return send


# ---- summaries ---------------------------------------------------------------------------------


def kind_summary(turns: Sequence[LoopTurn]) -> dict[str, Any]:
    """τ, output tok/s p50, tokens, verify steps and accepted tokens by source of ``turns`` (one kind)."""
    ok = [t for t in turns if t.ok]
    steps = sum(t.verify_steps for t in ok)
    accepted = sum(t.accepted_tokens for t in ok)
    by_source: dict[str, int] = {}
    for turn in ok:
        for source, count in turn.accepted_by_source.items():
            by_source[source] = by_source.get(source, 0) + count
    return {
        "num_turns": len(turns),
        "num_errors": len(turns) - len(ok),
        "tau": ratio(accepted + steps, steps),
        "tokens_per_second_p50": median(t.tokens_per_second for t in ok) if ok else None,
        "output_tokens": sum(t.output_tokens for t in ok),
        "verify_steps": steps,
        "accepted_tokens": accepted,
        "accepted_by_source": by_source or None,
        "seconds": sum(t.seconds for t in ok),
        "expected_calls": sum(bool(t.made_expected_call) for t in ok),
    }


def server_summary(server: str, turns: Sequence[LoopTurn], seconds: float) -> dict[str, Any]:
    """One server's run: per turn kind (``kind_summary``) and over every turn, end-to-end ``seconds``."""
    return {
        "server": server,
        "seconds": seconds,
        "num_turns": len(turns),
        "num_errors": sum(not t.ok for t in turns),
        "kinds": {kind: kind_summary([t for t in turns if t.kind == kind]) for kind in TURN_KINDS},
        "all": kind_summary(turns),
    }


def mismatches(reference: Sequence[LoopTurn], turns: Sequence[LoopTurn]) -> list[dict[str, Any]]:
    """The turns whose output differs from ``reference``'s same turn (both answered), in order."""
    expected = {(t.conversation, t.turn): t for t in reference if t.ok}
    found = []
    for turn in turns:
        other = expected.get((turn.conversation, turn.turn))
        if turn.ok and other is not None and other.output != turn.output:
            found.append(
                {
                    "conversation": turn.conversation,
                    "turn": turn.turn,
                    "kind": turn.kind,
                    "reference": other.output[:300],
                    "output": turn.output[:300],
                }
            )
    return found


def add_comparisons(servers: list[dict[str, Any]], turns: dict[str, list[LoopTurn]]) -> None:
    """Per server: end-to-end speedups (reference seconds ÷ seconds) and per-kind tok/s and τ ratios against
    ``ar`` and ``dflash2-base`` where they ran, and the turns whose output differs from ``ar``'s."""
    by_name = {s["server"]: s for s in servers}
    for server in servers:
        for reference, suffix in ((AR, "ar"), (AGENT_LOOP_BASE, "base")):
            base = by_name.get(reference)
            server[f"speedup_vs_{suffix}"] = ratio(base["seconds"], server["seconds"]) if base else None
            for kind, summary in server["kinds"].items():
                other = base["kinds"][kind] if base else {}
                summary[f"tokens_per_second_vs_{suffix}"] = ratio(
                    summary["tokens_per_second_p50"], other.get("tokens_per_second_p50")
                )
                summary[f"tau_vs_{suffix}"] = ratio(summary["tau"], other.get("tau"))
        if AR in turns and server["server"] != AR:
            found = mismatches(turns[AR], turns[server["server"]])
            server["num_mismatches"] = len(found)
            server["mismatches"] = found
        else:
            server["num_mismatches"] = None
            server["mismatches"] = []


# ---- the workload ------------------------------------------------------------------------------


def agent_loop_max_model_len(config: BenchConfig) -> int:
    """Context for the workload's servers: the tools' prompt, every turn's reply and tool result, and slack."""
    longest = max(len(s.turns) for s in build_scripts()[: config.agent_loop_conversations])
    needed = 1536 + longest * (config.agent_loop_max_tokens + 320)
    return max(config.engine.max_model_len or 0, -(-needed // 256) * 256)


def run_agent_loop(config: BenchConfig, log_dir: Path, progress: Progress) -> dict[str, Any]:
    """The workload against every server of ``config.agent_loop_servers``, started one after another."""
    scripts = build_scripts()[: config.agent_loop_conversations]
    result: dict[str, Any] = {
        "conversations": [s.name for s in scripts],
        "turns": sum(len(s.turns) for s in scripts),
        "max_tokens": config.agent_loop_max_tokens,
        "servers": [],
        "notes": [],
    }
    if config.url is not None:
        result["notes"].append("the agent-loop workload starts its own servers; skipped with --url")
        return result
    engine = replace(config.engine, max_model_len=agent_loop_max_model_len(config), max_num_seqs=1)
    run_config = replace(config, engine=engine, concurrency=(1,))
    has_drafter = config.engine.model is None or bool(config.engine.drafter)
    turns: dict[str, list[LoopTurn]] = {}
    for name in config.agent_loop_servers:
        speculative, extra = AGENT_LOOP_SERVERS[name]
        if speculative and not has_drafter:
            result["notes"].append(f"agent-loop {name}: needs --drafter for this model; not served")
            continue
        spec = ServerSpec(name, config.serving_block_size if speculative else 1, config.engine.use_selector)
        args = [*extra, "--max-model-len", str(engine.max_model_len), "--max-num-seqs", "1"]
        try:
            with started_server(run_config, spec, log_dir / f"agent-loop-{name}.log", extra_args=args) as running:
                summary, turns[name] = _run_server(running.url, name, scripts, config.agent_loop_max_tokens)
                summary["command"] = " ".join(["dflash2", *running.command[3:]])
                summary["peak_rss_bytes"] = process_peak_rss_bytes(running.process.pid)
                result["servers"].append(summary)
                everything = summary["all"]
                progress(
                    f"agent-loop {name}: {summary['seconds']:.1f} s end to end, τ {_num(everything['tau'])}, "
                    f"{_num(everything['tokens_per_second_p50'], 1)} tok/s p50, {summary['num_errors']} errors"
                )
        except (RuntimeError, httpx.HTTPError, OSError) as exc:
            result["notes"].append(f"agent-loop {name}: {str(exc).splitlines()[0]}")
            progress(f"agent-loop {name} failed: {exc}")
    add_comparisons(result["servers"], turns)
    for server in result["servers"]:
        if server["num_mismatches"]:
            progress(f"agent-loop {server['server']}: {server['num_mismatches']} turns differ from {AR} at T = 0")
    return result


def _run_server(
    url: str, name: str, scripts: Sequence[Script], max_tokens: int
) -> tuple[dict[str, Any], list[LoopTurn]]:
    """One warm-up request, then every script in turn; the summary (turn records included) and the turns."""
    with httpx.Client(timeout=600, trust_env=False) as client:
        model = str(client.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"])
        send = http_send(client, url)
        warm_up = ScriptTurn(TOOL_CALL, "Read config.yaml.", "required")
        send(warm_up.payload(model, [{"role": "user", "content": warm_up.user}], max_tokens))
        turns: list[LoopTurn] = []
        start = time.perf_counter()
        for index, script in enumerate(scripts):
            turns += run_script(send, model, script, index, max_tokens)[0]
        seconds = time.perf_counter() - start
    summary = server_summary(name, turns, seconds)
    summary["turn_records"] = [asdict(t) for t in turns]
    return summary, turns


def _num(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"
