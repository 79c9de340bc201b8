"""What one chat request asks of tools and structured outputs: the grammar, the prompt, the parsing.

``ToolPlan.for_request`` turns ``tools``, ``tool_choice``, ``parallel_tool_calls`` and
``response_format`` into:

- the grammar the engine enforces (``dflash2.grammar``), or None:
  ``required`` / named choice → only calls (each valid for its tool's ``parameters``);
  ``auto`` → free text, with a call constrained once it starts for ``strict`` tools; with a JSON
  ``response_format`` as well → either the answer JSON or calls; no tools → the answer JSON;
- how the tools reach the prompt: the chat template's ``tools`` argument when the template reads
  it, otherwise the parser's system prompt (``ToolParser.system_prompt``);
- how the output is read back: ``ToolParser.parse`` (unless ``tool_choice`` is ``none``).

Custom tools (``{"type": "custom"}``: free text, or text in a Lark or regex grammar) reach the template and the
parsers as functions of one string parameter ``input`` (``custom_function``), always constrained once a call starts
(as ``strict`` function tools are): a free-text tool's input is any JSON string, a regex tool's a JSON string whose
value matches the whole regex (a JSON-schema ``pattern``, which llguidance enforces through the string's escaping),
and a Lark tool's input is written raw after ``{"name": …}`` in a Hermes block and enforced by the grammar itself as
an llguidance subgrammar (a context-free language cannot be enforced inside a JSON string; the other formats refuse
Lark tools). Calls of custom tools are read back with their ``input`` (``ParsedToolCall.input``).

A turn always ends: with ``parallel_tool_calls`` false (the server's default unless
``--default-parallel-tool-calls``) the grammar ends after one call, also in ``auto`` mode; a turn of
parallel calls ends before a call that repeats an earlier one (``SamplingParams.repeat_marker`` in
formats with a closing tag, and any repeat is dropped when the calls are read back); a reply cut by
``max_tokens`` keeps its complete calls and drops the one it was writing.

Schemas are checked against the loaded tokenizer before anything is submitted, so a schema the
engine cannot compile is a 400 that names the field.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from dflash2.grammar import (
    JSON_FORMAT,
    GrammarBackend,
    GrammarError,
    close_objects,
    json_schema_grammar,
    lark_grammar,
)
from server.errors import InvalidRequestError
from server.protocol import ChatCompletionRequest, ChatTool, NamedToolChoice, ResponseFormat
from server.reasoning import Reasoning, StartState
from server.tool_parsers import FunctionTool, ParsedToolCall, ToolCallStreamer, ToolParser


def new_tool_call_id() -> str:
    """A tool-call id in OpenAI's style (``call_`` + 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def answer_schema(response_format: ResponseFormat | None) -> dict[str, Any] | None:
    """The JSON Schema a ``response_format`` imposes on the answer (``{}``-like object for
    ``json_object``), or None for ``text`` / no format."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object" or response_format.json_schema is None:
        return {"type": "object"}
    return response_format.json_schema.schema_ or {"type": "object"}


def custom_function(tool: ChatTool) -> FunctionTool:
    """A chat ``tools`` entry as the parsers see it: a function tool as it is, a custom tool as a function of one
    string parameter ``input`` (described with the tool's grammar), ``strict`` so a started call is constrained."""
    if tool.function is not None:
        function = tool.function
        return FunctionTool(
            name=function.name,
            description=function.description,
            parameters=function.parameters or {"type": "object"},
            strict=bool(function.strict),
        )
    custom = tool.custom
    assert custom is not None  # ChatTool checks that its body matches its type
    grammar = custom.grammar
    text: dict[str, Any] = {"type": "string", "description": "The text this tool takes (free-form)."}
    if grammar is not None and grammar.syntax == "regex":
        text = {
            "type": "string",
            "description": f"Text matching this regular expression as a whole: {grammar.definition}",
            "pattern": f"^(?:{grammar.definition})$",
        }
    elif grammar is not None:
        text = {"type": "string", "description": f"Text in the language of this Lark grammar:\n{grammar.definition}"}
    return FunctionTool(
        name=custom.name,
        description=custom.description,
        parameters={"type": "object", "properties": {"input": text}, "required": ["input"]},
        strict=True,
        custom=True,
        lark=grammar.definition if grammar is not None and grammar.syntax == "lark" else None,
    )


def _inline(schema: dict[str, Any]) -> str:
    """A schema as a Lark ``%json`` expression, written in json.dumps style (``JSON_FORMAT``)."""
    return "%json " + json.dumps({**close_objects(schema), "x-guidance": JSON_FORMAT})


@dataclass
class ToolPlan:
    """Tools and structured outputs of one chat request (see the module docstring).

    Attributes:
        tools: the request's function tools (all of them go to the prompt).
        parser: reads calls back from the output; None when ``tool_choice`` is ``none`` or no tools.
        grammar: the llguidance grammar for the engine, or None (unconstrained).
        checks: ``(field, schema)`` pairs to compile before submission, so errors name the field.
        grammar_checks: ``(field, grammar)`` pairs likewise (the Lark grammars of custom tools).
        calls_only: ``required`` or a named tool: the grammar allows nothing but calls, so a reply cut
            by ``max_tokens`` in the middle of a call has no content, only its complete calls.
        parallel: several calls may follow each other (``parallel_tool_calls``, or the server's default).
        one_call_grammar: the grammar only ends the reply after its one call (``auto``, no ``strict`` tool,
            no JSON answer): without a grammar engine it is dropped, and the first call is the reply's.
        repeat_marker: ``SamplingParams.repeat_marker`` for the engine (the format's closing tag of a
            call), or None.
        reasoning: the server's reasoning parser, and where this request's reply starts relative to the
            thinking block (``with_reasoning``); None without one.
    """

    tools: list[FunctionTool] = field(default_factory=list)
    parser: ToolParser | None = None
    grammar: str | None = None
    checks: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    grammar_checks: list[tuple[str, str]] = field(default_factory=list)
    calls_only: bool = False
    parallel: bool = False
    repeat_marker: str | None = None
    one_call_grammar: bool = False
    reasoning: tuple[Reasoning, StartState] | None = None

    @classmethod
    def for_request(
        cls, request: ChatCompletionRequest, parser: ToolParser, default_parallel: bool = False
    ) -> ToolPlan:
        """Plan a validated chat request (``request.check()`` already ran); ``default_parallel`` stands
        for ``parallel_tool_calls`` when the request leaves it out.

        Raises:
            InvalidRequestError: a schema that is not a JSON object (names the field).
        """
        tools = [custom_function(t) for t in request.tools or ()]
        plan = cls(tools=tools)
        answer = answer_schema(request.response_format)
        if answer is not None:
            plan.checks.append(("response_format.json_schema.schema", answer))
        choice = request.effective_tool_choice
        parallel = default_parallel if request.parallel_tool_calls is None else request.parallel_tool_calls
        if choice == "none" or not tools:
            plan.grammar = _json_grammar(answer, "response_format.json_schema.schema") if answer else None
            return plan
        plan.parser = parser
        plan.calls_only = choice == "required" or isinstance(choice, NamedToolChoice)
        plan.parallel = parallel and not isinstance(choice, NamedToolChoice)
        plan.repeat_marker = parser.CALL_END if plan.parallel else None
        try:
            if isinstance(choice, NamedToolChoice):
                forced = [t for t in tools if t.name == choice.name]
                lark = parser.grammar(forced, required=True, parallel=False)
            elif choice == "required":
                forced = tools
                lark = parser.grammar(forced, required=True, parallel=parallel)
            else:  # auto
                forced = [t for t in tools if t.strict]
                plan.one_call_grammar = not parallel and not forced and answer is None
                lark = parser.grammar(
                    tools, required=False, parallel=parallel, answer=_inline(answer) if answer else None
                )
        except ValueError as exc:  # e.g. a name the pythonic format cannot write
            raise InvalidRequestError(f"tools: {exc}", "tools") from exc
        in_grammar = forced if isinstance(choice, NamedToolChoice) else tools
        subgrammars = {t.subgrammar: t.lark for t in in_grammar if t.lark is not None}
        plan.grammar = lark_grammar(lark, subgrammars) if lark is not None else None
        for t in forced:
            i = tools.index(t)
            if t.lark is not None:
                plan.grammar_checks.append((f"tools[{i}].custom.format", lark_grammar(t.lark)))
            else:
                plan.checks.append(
                    (f"tools[{i}].custom.format" if t.custom else f"tools[{i}].function.parameters", t.parameters)
                )
        return plan

    def without_grammar_engine(self) -> None:
        """For a model without a grammar engine (no tokenizer): drop a grammar that only ends the reply
        after one call (the reply's first call is then its only one); ``check`` refuses any other."""
        if self.one_call_grammar:
            self.grammar = None

    def check(self, backend: GrammarBackend | None) -> None:
        """Compile every constrained schema, then the whole grammar, against the loaded tokenizer.

        Raises:
            InvalidRequestError: naming the field whose schema does not compile, or ``tools`` when only
                their combination fails; also when the model has no tokenizer for a grammar.
        """
        if self.grammar is None:
            return
        if backend is None:
            raise InvalidRequestError("structured outputs and tool choices need a tokenizer", "response_format")
        for param, schema in self.checks:
            try:
                backend.check(_json_grammar(schema, param))
            except GrammarError as exc:
                what = "grammar" if param.endswith(".custom.format") else "JSON schema"
                raise InvalidRequestError(f"{param}: this {what} cannot be enforced: {exc}", param) from exc
        for param, grammar in self.grammar_checks:
            try:
                backend.check(grammar)
            except GrammarError as exc:
                raise InvalidRequestError(f"{param}: this grammar cannot be enforced: {exc}", param) from exc
        try:
            backend.check(self.grammar)
        except GrammarError as exc:
            raise InvalidRequestError(f"the tools cannot be enforced together: {exc}", "tools") from exc

    def with_reasoning(self, reasoning: Reasoning, state: StartState, backend: GrammarBackend | None) -> None:
        """Read the reply's thinking block apart, and start the grammar after it (``server/reasoning.py``);
        ``check`` has already compiled the request's own grammar.

        Raises:
            InvalidRequestError: the grammar behind a thinking block does not compile (naming ``tools``).
        """
        self.reasoning = (reasoning, state)
        wrapped = reasoning.wrap_grammar(self.grammar, state)
        if wrapped is None or wrapped == self.grammar or backend is None:
            return
        try:
            backend.check(wrapped)
        except GrammarError as exc:
            raise InvalidRequestError(f"the grammar cannot follow a thinking block: {exc}", "tools") from exc
        self.grammar = wrapped

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools in the shape chat templates take (``apply_chat_template(tools=…)``)."""
        return [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    **({"description": t.description} if t.description else {}),
                    "parameters": t.parameters,
                },
            }
            for t in self.tools
        ]

    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ParsedToolCall]]:
        """Content and tool calls of one choice's output (no calls when tools are not parsed); ``cut``:
        the output ended by ``max_tokens`` (a call it was writing is dropped). A call that repeats an
        earlier one (name and arguments) is dropped."""
        if self.parser is None:
            return text, []
        content, calls = self.parser.parse(text, cut)
        calls = _distinct(self.with_inputs(calls), [])
        return (None if self.calls_only else content), (calls if self.parallel else calls[:1])

    def streamer(self) -> ToolCallStreamer | None:
        """An incremental parser for one streamed choice (None when tools are not parsed)."""
        if self.parser is None:
            return None
        return _Distinct(self, drop_content=self.calls_only, max_calls=None if self.parallel else 1)

    def with_inputs(self, calls: list[ParsedToolCall]) -> list[ParsedToolCall]:
        """The calls, those of custom tools with their ``input``: the ``input`` argument when the arguments are
        ``{"input": <string>}`` (always so when the call was constrained), else the arguments' JSON text."""
        custom = {t.name for t in self.tools if t.custom}
        return [dataclasses.replace(c, input=_input_of(c.arguments)) if c.name in custom else c for c in calls]


class _Distinct(ToolCallStreamer):
    """A streamer that passes each call once (a repeat of an earlier call is dropped) and, with
    ``drop_content`` (a calls-only grammar, where text outside complete calls can only be a call cut
    short by ``max_tokens``), no content."""

    def __init__(self, plan: ToolPlan, drop_content: bool, max_calls: int | None = None) -> None:
        super().__init__()
        assert plan.parser is not None
        self.plan = plan
        self.inner = plan.parser.streamer()
        self.drop_content = drop_content
        self.max_calls = max_calls
        self.seen: list[ParsedToolCall] = []

    def _feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        content, calls = self.inner.feed(text)
        return ("" if self.drop_content else content), self._new(calls)

    def _finish(self, cut: bool) -> tuple[str, list[ParsedToolCall]]:
        content, calls = self.inner.finish(cut)
        return ("" if self.drop_content else content), self._new(calls)

    def _new(self, calls: list[ParsedToolCall]) -> list[ParsedToolCall]:
        room = None if self.max_calls is None else max(0, self.max_calls - len(self.seen))
        return _distinct(self.plan.with_inputs(calls), self.seen)[:room]


def _input_of(arguments: str) -> str:
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict) and set(value) == {"input"} and isinstance(value["input"], str):
        return value["input"]
    return arguments


def _distinct(calls: list[ParsedToolCall], seen: list[ParsedToolCall]) -> list[ParsedToolCall]:
    """The calls whose name and arguments (as JSON values: key order aside) are not those of a call in
    ``seen`` or earlier in ``calls``; ``seen`` grows by them."""
    new = []
    for call in calls:
        if not any(call.name == old.name and _same_arguments(call, old) for old in seen):
            seen.append(call)
            new.append(call)
    return new


def _same_arguments(a: ParsedToolCall, b: ParsedToolCall) -> bool:
    if a.arguments == b.arguments:
        return True
    try:
        return bool(json.loads(a.arguments) == json.loads(b.arguments))
    except ValueError:
        return False


def with_tool_prompt(messages: list[dict[str, Any]], prompt: str) -> list[dict[str, Any]]:
    """The messages with ``prompt`` (tool instructions) added to the first system message, or in a
    new system message at the front."""
    messages = copy.copy(messages)
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}
    else:
        messages.insert(0, {"role": "system", "content": prompt})
    return messages


def render_tool_history(messages: list[dict[str, Any]], parser: ToolParser) -> list[dict[str, Any]]:
    """For templates that do not render ``tool_calls``: earlier calls become assistant text in the
    parser's format and tool results its result text, so the model sees its own format."""
    rendered = []
    for message in messages:
        calls = message.get("tool_calls")
        if message["role"] == "assistant" and calls:
            parsed = [_history_call(call) for call in calls]
            text = "\n".join(part for part in (message.get("content") or "", parser.format_calls(parsed)) if part)
            message = {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}
        elif message["role"] == "tool":
            message = {**message, "content": parser.format_result(message.get("content") or "")}
        rendered.append(message)
    return rendered


def _history_call(call: dict[str, Any]) -> ParsedToolCall:
    function = call.get("function") or {}
    arguments = function.get("arguments", "{}")
    return ParsedToolCall(
        name=str(function.get("name", "")), arguments=arguments if isinstance(arguments, str) else json.dumps(arguments)
    )


def _json_grammar(schema: dict[str, Any], param: str) -> str:
    try:
        return json_schema_grammar(schema)
    except GrammarError as exc:
        raise InvalidRequestError(f"{param}: {exc}", param) from exc
