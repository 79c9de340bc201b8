"""Tool calling in text: parse a model's output into OpenAI tool calls, prompt for tools, and force calls by grammar.

Three formats, named as vLLM's ``--tool-call-parser`` names them:

* ``hermes`` (NousResearch Hermes 2 Pro, Qwen 2.5/3): ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``
  blocks, any number, anywhere in the text.
* ``llama3_json`` (Llama 3.1/3.2 JSON tool calling): the whole output is ``{"name": "f", "parameters": {...}}``,
  optionally after ``<|python_tag|>``, or several such objects separated by ``;``.
* ``pythonic`` (Llama 3.2/4 pythonic): the whole output is a Python list of calls, ``[f(a=1, b="x"), g()]``.

Each parser also renders tools into a system prompt (for chat templates that ignore ``tools``), renders earlier
calls and their results into history text, and builds an llguidance grammar (lark syntax, inline ``%json`` schemas)
that constrains generation to valid calls. Nothing here raises on model output: what is not a valid call is content.
"""

from __future__ import annotations

import ast
import json
import keyword
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from dflash2.grammar import JSON_FORMAT as _X_GUIDANCE  # JSON as json.dumps writes it, no free whitespace
from dflash2.grammar import close_objects


@dataclass(frozen=True)
class FunctionTool:
    """A function tool as the parsers need it (the ``function`` of an OpenAI ``{"type": "function"}`` tool).

    ``parameters`` is the JSON Schema of the arguments object (``{}`` accepts any object); ``strict`` asks for the
    arguments to be constrained to that schema even when the model may also answer in text.

    A ``custom`` tool (OpenAI's free-text or grammar tools) is presented as a function of one string parameter
    ``input``; ``lark`` is its Lark grammar, whose text a forced call writes raw (``HermesToolParser``) because a
    context-free language cannot be enforced inside a JSON string.
    """

    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    strict: bool = False
    custom: bool = False
    lark: str | None = None

    @property
    def subgrammar(self) -> str:
        """The name of the llguidance subgrammar that holds ``lark`` (``@<name>`` in the call's rule)."""
        return f"input_{self.name}"


@dataclass(frozen=True)
class ParsedToolCall:
    """One tool call: the function name and its arguments as JSON text (``json.dumps(..., ensure_ascii=False)``).

    ``input`` is set on a call of a custom tool (``ToolPlan.parse``): the text the tool receives.
    """

    name: str
    arguments: str
    input: str | None = None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _json_call(obj: Any, args_keys: tuple[str, str]) -> ParsedToolCall | None:
    """A call from a decoded ``{"name": str, <args key>: object}``, trying ``args_keys`` in order; None if invalid."""
    if not isinstance(obj, dict):
        return None
    return _make_call(obj.get("name"), next((obj[key] for key in args_keys if key in obj), None))


def _make_call(name: Any, args: Any) -> ParsedToolCall | None:
    """A call if ``name`` is a non-empty string and ``args`` a dict, both valid Unicode (a JSON or Python
    ``"\\ud800"`` escape decodes to a lone surrogate, which no response can encode); else None."""
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    arguments = json.dumps(args, ensure_ascii=False)
    try:
        (name + arguments).encode()
    except UnicodeEncodeError:
        return None
    return ParsedToolCall(name, arguments)


def _load_args(arguments: str) -> Any:
    """Arguments JSON text as an object for re-rendering; text that is not a JSON object is kept as a string."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def _schema(schema: Any, defs_from: dict[str, Any] | None = None) -> str:
    """``%json {...}`` for a schema (``{}`` or ``True``: any value), with the whitespace settings, undeclared
    keys closed off (``dflash2.grammar.close_objects``) and the ``$defs``/``definitions`` of ``defs_from``
    hoisted to its top level so that ``#/$defs/...`` refs resolve."""
    top = dict(schema) if isinstance(schema, dict) else {}
    for key in ("$defs", "definitions"):
        if defs_from and key in defs_from:
            top[key] = defs_from[key]
    top = close_objects(top)
    top["x-guidance"] = _X_GUIDANCE
    return "%json " + json.dumps(top)


def _call_schema(tool: FunctionTool, args_key: str, constrain: bool) -> str:
    """``%json`` of ``{"name": <tool name>, <args_key>: <arguments>}``, arguments per schema or any object."""
    args = tool.parameters if constrain and tool.parameters else {"type": "object"}
    obj = {
        "type": "object",
        "properties": {"name": {"const": tool.name}, args_key: args},
        "required": ["name", args_key],
        "additionalProperties": False,
    }
    return _schema(obj, tool.parameters)


class ToolCallStreamer(ABC):
    """Incremental parsing of one generation: feed text deltas, get content safe to show and completed calls.

    Content is trimmed as ``ToolParser.parse`` trims it (leading whitespace dropped, trailing whitespace held until
    more content follows), so the concatenated content and calls of all ``feed`` calls plus ``finish`` equal
    ``parse(full_text)`` (content None there when the concatenation is empty).
    """

    def __init__(self) -> None:
        self._started = False  # some content has been emitted
        self._blank = ""  # trailing whitespace of the content so far, held back

    def _trim(self, raw: str) -> str:
        text = self._blank + raw
        if not self._started:
            text = text.lstrip()
        shown = text.rstrip()
        self._blank = text[len(shown) :]
        self._started = self._started or bool(shown)
        return shown

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        """One text delta -> (content to show now, calls this delta completed). Possible call text is held back."""
        content, calls = self._feed(text)
        return self._trim(content), calls

    def finish(self, cut: bool = False) -> tuple[str, list[ParsedToolCall]]:
        """End of generation -> (remaining content, remaining calls); trailing whitespace is dropped.
        ``cut``: the generation was cut by its token limit, so a call it was writing is dropped (see
        ``ToolParser.parse``)."""
        content, calls = self._finish(cut)
        return self._trim(content), calls

    @abstractmethod
    def _feed(self, text: str) -> tuple[str, list[ParsedToolCall]]: ...

    @abstractmethod
    def _finish(self, cut: bool) -> tuple[str, list[ParsedToolCall]]: ...


class _HermesStreamer(ToolCallStreamer):
    """Streams text outside ``<tool_call>`` blocks; a block is decided when ``</tool_call>`` (or the end) arrives."""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""  # starts with "<tool_call>" when inside a block, else a possible prefix of it
        self._in_call = False

    def _feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        self._buf += text
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        while True:
            if not self._in_call:
                start = self._buf.find(HermesToolParser.OPEN)
                if start < 0:
                    keep = _partial_suffix(self._buf, HermesToolParser.OPEN)
                    content.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                content.append(self._buf[:start])
                self._buf, self._in_call = self._buf[start:], True
            end = self._buf.find(HermesToolParser.CLOSE, len(HermesToolParser.OPEN))
            if end < 0:
                break
            end += len(HermesToolParser.CLOSE)
            self._decide(self._buf[:end], content, calls)
            self._buf, self._in_call = self._buf[end:], False
        return "".join(content), calls

    def _finish(self, cut: bool) -> tuple[str, list[ParsedToolCall]]:
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        if self._in_call:
            if not cut:  # a block cut by the token limit is neither a call nor content
                self._decide(self._buf, content, calls)
        elif not cut:
            content.append(self._buf)
        else:  # the held text is at most the start of "<tool_call>", which the limit cut
            content.append(self._buf[: len(self._buf) - _partial_suffix(self._buf, HermesToolParser.OPEN)])
        self._buf, self._in_call = "", False
        return "".join(content), calls

    @staticmethod
    def _decide(block: str, content: list[str], calls: list[ParsedToolCall]) -> None:
        call = HermesToolParser.parse_block(block)
        if call is None:
            content.append(block)
        else:
            calls.append(call)


class _WholeOutputStreamer(ToolCallStreamer):
    """For formats where the whole output is the calls: once the output (after whitespace) starts with one of
    ``markers``, hold everything and parse it at the end; otherwise it is all content, streamed directly."""

    def __init__(self, parser: ToolParser, markers: tuple[str, ...]) -> None:
        super().__init__()
        self._parser, self._markers = parser, markers
        self._buf = ""
        self._mode = "undecided"  # -> "hold" | "content"

    def _feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        if self._mode == "content":
            return text, []
        self._buf += text
        head = self._buf.lstrip()
        if any(head.startswith(m) for m in self._markers):
            self._mode = "hold"
        elif head and not any(m.startswith(head) for m in self._markers):
            self._mode = "content"
            text, self._buf = self._buf, ""
            return text, []
        return "", []

    def _finish(self, cut: bool) -> tuple[str, list[ParsedToolCall]]:
        content, calls = self._parser.parse(self._buf, cut) if self._mode != "content" else (None, [])
        self._buf = ""
        return content or "", calls


def _starts_like(text: str, markers: tuple[str, ...]) -> bool:
    """True when ``text`` (after whitespace) starts with one of ``markers`` or is the start of one."""
    head = text.lstrip()
    return any(head.startswith(m) or (head and m.startswith(head)) for m in markers)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (0 if none)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ToolParser(ABC):
    """One tool-call text format: parsing, streaming, prompting and grammar. Instances hold no state."""

    name: ClassVar[str]
    _INSTRUCTIONS: ClassVar[str]  # how to write calls, placed after the tool listing in system_prompt
    # The text that ends every call, when the format has one (SamplingParams.repeat_marker: a call that
    # repeats an earlier one of the same reply ends the reply before it).
    CALL_END: ClassVar[str | None] = None

    def system_prompt(self, tools: Sequence[FunctionTool]) -> str:
        """System-message text for templates that do not render ``tools``: each tool as one JSON line
        ``{"type": "function", "function": {name, description, parameters}}`` in ``<tools>`` tags, then this
        format's instructions for writing calls."""
        functions = [{"name": t.name, "description": t.description or "", "parameters": t.parameters} for t in tools]
        listing = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions)
        return (
            "# Tools\n\nYou may call one or more functions to help with the user's request. The functions are "
            f"described by JSON signatures within <tools></tools> XML tags:\n<tools>\n{listing}\n</tools>\n\n"
            f"{self._INSTRUCTIONS}\nResults of function calls are given back within <tool_response></tool_response>"
            " XML tags."
        )

    @abstractmethod
    def format_calls(self, calls: Sequence[ParsedToolCall]) -> str:
        """Assistant-message text for earlier calls (templates that do not render ``tool_calls``); parses back."""

    def format_result(self, content: str) -> str:
        """Text of a ``role: "tool"`` message for templates that do not render it (Hermes ``<tool_response>``)."""
        return f"<tool_response>\n{content}\n</tool_response>"

    @abstractmethod
    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ParsedToolCall]]:
        """Whole generated text -> (content outside the calls, stripped, None when empty; calls in order).
        Text that does not form a valid call (arguments must be a JSON object) stays content; never raises.
        ``cut``: the text was cut by the token limit, so a call it ends in the middle of (or the start of
        one) is dropped: neither a call nor content; the complete calls before it are kept."""

    @abstractmethod
    def streamer(self) -> ToolCallStreamer:
        """A fresh incremental parser for one generation (agrees with ``parse`` on the whole text)."""

    def grammar(
        self, tools: Sequence[FunctionTool], *, required: bool, parallel: bool, answer: str | None = None
    ) -> str | None:
        """An llguidance lark grammar constraining the output, or None when generation is unconstrained.

        ``required``: only tool calls (exactly one unless ``parallel``), every tool's arguments valid for its schema.
        Otherwise ("auto"): free text or calls (at most one unless ``parallel``), a call's arguments constrained
        for ``strict`` tools only (others: any object); None when calls may be parallel, no tool is strict and
        ``answer`` is None. ``answer`` (a lark expression such as
        ``%json {...}``) replaces free text in auto mode, so the output is either the answer or calls.
        Raises ValueError when ``required`` with no tools, or when the format cannot express a tool (pythonic).
        """
        if not tools:
            if required:
                raise ValueError("a required tool call needs at least one tool")
            return None if answer is None else f"%llguidance {{}}\nstart: answer\nanswer: {answer}\n"
        if not required and answer is None and parallel and not any(t.strict for t in tools):
            return None
        lines = ["%llguidance {}"]
        lines += self._start(required, parallel, answer is not None and not required)
        if answer is not None and not required:
            lines.append(f"answer: {answer}")
        lines.append("tool: " + " | ".join(f"tool_{i}" for i in range(len(tools))))
        for i, tool in enumerate(tools):
            lines += self._tool_rules(i, tool, required or tool.strict)
        return "\n".join(lines) + "\n"

    @abstractmethod
    def _start(self, required: bool, parallel: bool, answer: bool) -> list[str]:
        """Lark rules from ``start`` down to the rule ``tool`` (one call of any tool)."""

    @abstractmethod
    def _tool_rules(self, index: int, tool: FunctionTool, constrain: bool) -> list[str]:
        """Lark rules defining ``tool_<index>``: one call of ``tool``, arguments per schema when ``constrain``."""


class HermesToolParser(ToolParser):
    """Hermes 2 Pro format: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks among text
    (``"parameters"`` accepted for ``"arguments"``; an unclosed last block counts when its JSON is valid)."""

    name = "hermes"
    OPEN: ClassVar[str] = "<tool_call>"
    CLOSE: ClassVar[str] = "</tool_call>"
    CALL_END = CLOSE
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
    _INSTRUCTIONS = (
        "For each function call, return a JSON object with the function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call>"
    )

    @classmethod
    def parse_block(cls, block: str) -> ParsedToolCall | None:
        """The call in one ``<tool_call>...</tool_call>`` block (closing tag optional), or None if invalid.

        Besides ``{"name": ..., "arguments": {...}}``, a block may hold a raw-input call, the form grammar-forced
        calls of a Lark custom tool take: ``\\n{"name": ...}\\n<input>\\n`` in a closed block (the input
        exactly as written; its arguments become ``{"input": <input>}``).
        """
        body = block[len(cls.OPEN) :].removesuffix(cls.CLOSE)
        try:
            call = _json_call(_DECODER.decode(body.strip()), ("arguments", "parameters"))
        except (ValueError, RecursionError):
            call = None
        if call is None and block.endswith(cls.CLOSE):
            return cls._raw_input_call(body)
        return call

    @staticmethod
    def _raw_input_call(body: str) -> ParsedToolCall | None:
        if not body.startswith("\n{"):
            return None
        try:
            head, end = _DECODER.raw_decode(body, 1)
        except (ValueError, RecursionError):
            return None
        rest = body[end:]  # "\n" <input> "\n"
        if not isinstance(head, dict) or set(head) != {"name"} or len(rest) < 2 or rest[0] + rest[-1] != "\n\n":
            return None
        return _make_call(head["name"], {"input": rest[1:-1]})

    def format_calls(self, calls: Sequence[ParsedToolCall]) -> str:
        """One ``<tool_call>`` block per call, joined by newlines."""
        return "\n".join(
            f"{self.OPEN}\n{json.dumps({'name': c.name, 'arguments': _load_args(c.arguments)}, ensure_ascii=False)}"
            f"\n{self.CLOSE}"
            for c in calls
        )

    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ParsedToolCall]]:
        """Blocks with a valid call become calls; the text around them (and invalid blocks) is content.
        With ``cut``, an unclosed last block (or the start of ``<tool_call>`` at the end) is dropped."""
        if cut:
            text = text[: len(text) - _partial_suffix(text, self.OPEN)]
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        last = 0
        for match in self._BLOCK.finditer(text):
            if cut and match.group(2) is not None:
                text = text[: match.start()]
                break
            call = self.parse_block(match.group(0))
            if call is not None:
                content.append(text[last : match.start()])
                calls.append(call)
                last = match.end()
        content.append(text[last:])
        return "".join(content).strip() or None, calls

    def streamer(self) -> ToolCallStreamer:
        """Streams content, holding a possible ``<tool_call>`` prefix; a call completes at ``</tool_call>``."""
        return _HermesStreamer()

    def _start(self, required: bool, parallel: bool, answer: bool) -> list[str]:
        block = '"<tool_call>\\n" tool "\\n</tool_call>"'
        if required or answer:
            calls = 'call ("\\n" call)*' if parallel else "call"
            return [f"start: {'answer | ' if answer else ''}{calls}", f"call: {block}"]
        # Free text; the lazy lexeme ends at the first "<tool_call>", after which the call is constrained.
        return [
            "start: TEXT (call_trig call)*" if parallel else "start: TEXT | call_trig call",
            "TEXT: /(.|\\n)*/",
            'call_trig[lazy]: TEXT "<tool_call>"',
            'call: "\\n" tool "\\n</tool_call>"' + (" TEXT" if parallel else ""),
        ]

    def _tool_rules(self, index: int, tool: FunctionTool, constrain: bool) -> list[str]:
        if tool.lark is not None and constrain:  # the input raw, then the block's "\n</tool_call>"
            head = json.dumps(json.dumps({"name": tool.name}) + "\n")
            return [f"tool_{index}: {head} @{tool.subgrammar}"]
        return [f"tool_{index}: {_call_schema(tool, 'arguments', constrain)}"]


class _WholeOutputParser(ToolParser):
    """A format whose whole output is either text or the calls, told apart by how it starts (``_MARKERS``)."""

    _MARKERS: ClassVar[tuple[str, ...]]
    _CALLS: ClassVar[tuple[str, str]]  # lark for one call, for one or more calls (of the rule ``tool``)
    _TEXT: ClassVar[str]  # lark regex for free text: anything that does not start (after whitespace) like calls

    def streamer(self) -> ToolCallStreamer:
        """Holds everything once the output starts like calls (``_MARKERS``), else streams content."""
        return _WholeOutputStreamer(self, self._MARKERS)

    def _start(self, required: bool, parallel: bool, answer: bool) -> list[str]:
        calls = f"calls: {self._CALLS[parallel]}"
        if required or answer:
            return [f"start: {'answer | ' if answer else ''}calls", calls]
        return ["start: TEXT | calls", calls, f"TEXT: {self._TEXT}"]


class Llama3JsonToolParser(_WholeOutputParser):
    """Llama 3 JSON format: the whole output (after whitespace and an optional ``<|python_tag|>``) is
    ``{"name": ..., "parameters": {...}}`` objects separated by ``;`` (``"arguments"`` accepted too)."""

    name = "llama3_json"
    PYTHON_TAG: ClassVar[str] = "<|python_tag|>"
    _MARKERS = ("{", PYTHON_TAG)
    _CALLS = ("tool", 'tool ("; " tool)*')
    _TEXT = "/(\\s*[^\\s{](.|\\n)*)?/"
    _INSTRUCTIONS = (
        "To call a function, reply with only a JSON object of the form "
        '{"name": <function-name>, "parameters": <args-json-object>} and nothing else; for several calls, separate '
        'the objects with "; ". When no function is needed, answer in plain text.'
    )

    def format_calls(self, calls: Sequence[ParsedToolCall]) -> str:
        """The calls' JSON objects joined by ``"; "``."""
        return "; ".join(
            json.dumps({"name": c.name, "parameters": _load_args(c.arguments)}, ensure_ascii=False) for c in calls
        )

    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ParsedToolCall]]:
        """All calls, or (when any part is not a valid call) the whole text as content. With ``cut``, text
        that starts like calls gives its complete calls and nothing else."""
        rest = text.lstrip().removeprefix(self.PYTHON_TAG).lstrip()
        calls: list[ParsedToolCall] = []
        pos = 0
        while rest.startswith("{", pos):
            try:
                obj, pos = _DECODER.raw_decode(rest, pos)
            except (ValueError, RecursionError):
                break
            call = _json_call(obj, ("parameters", "arguments"))
            if call is None:
                break
            calls.append(call)
            pos = len(rest) - len(rest[pos:].lstrip())
            if pos == len(rest):
                return None, calls
            if rest[pos] != ";":
                break
            pos = len(rest) - len(rest[pos + 1 :].lstrip())
        if cut and _starts_like(text, self._MARKERS):
            return None, calls
        return text.strip() or None, []

    def _tool_rules(self, index: int, tool: FunctionTool, constrain: bool) -> list[str]:
        _check_no_lark(self.name, tool, constrain)
        return [f"tool_{index}: {_call_schema(tool, 'parameters', constrain)}"]


class PythonicToolParser(_WholeOutputParser):
    """Pythonic format: the whole output is a Python list of calls with keyword arguments, ``[f(a=1), g()]``,
    values being Python literals (JSON's ``true``/``false``/``null`` accepted), parsed with ``ast``."""

    name = "pythonic"
    _CONSTANTS: ClassVar[dict[str, Any]] = {"true": True, "false": False, "null": None}
    _MARKERS = ("[",)
    _CALLS = ('"[" tool "]"', '"[" tool (", " tool)* "]"')
    _TEXT = "/(\\s*[^\\s\\[](.|\\n)*)?/"
    _INSTRUCTIONS = (
        "To call functions, reply with only a Python list of calls with keyword arguments, such as "
        "[func_name1(param1=value1, param2=value2), func_name2()], where each value is a JSON literal (string, "
        "number, true/false/null, array or object). When no function is needed, answer in plain text."
    )

    def format_calls(self, calls: Sequence[ParsedToolCall]) -> str:
        """``[f(a=<json>, ...), ...]`` (arguments that are not a JSON object are left out)."""
        rendered = []
        for c in calls:
            args = _load_args(c.arguments)
            pairs = args.items() if isinstance(args, dict) else ()
            kwargs = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in pairs)
            rendered.append(f"{c.name}({kwargs})")
        return "[" + ", ".join(rendered) + "]"

    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ParsedToolCall]]:
        """All calls of a non-empty list, or (when the text is anything else) the whole text as content.
        With ``cut``, a list the limit cut gives the calls complete before the cut and nothing else."""
        stripped = text.strip()
        calls = self._calls(stripped)
        if calls is not None:
            return None, calls
        if cut and stripped.startswith("["):
            ends = [i for i, char in enumerate(stripped) if char == ")"]
            for end in reversed(ends):  # the longest prefix of whole calls, closed
                calls = self._calls(stripped[: end + 1] + "]")
                if calls is not None:
                    return None, calls
            return None, []
        return stripped or None, []

    @classmethod
    def _calls(cls, text: str) -> list[ParsedToolCall] | None:
        """The calls of ``text`` when it is a non-empty list of valid calls, else None."""
        if not text.startswith("["):
            return None
        try:
            tree = ast.parse(text, mode="eval").body
            if isinstance(tree, ast.List) and tree.elts:
                return [cls._call(node) for node in tree.elts]
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            pass
        return None

    @classmethod
    def _call(cls, node: ast.expr) -> ParsedToolCall:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise ValueError("not a call by name with keyword arguments")
        args: dict[str, Any] = {}
        for kw in node.keywords:
            if kw.arg is None or kw.arg in args:
                raise ValueError("** or repeated argument")
            args[kw.arg] = cls._literal(kw.value)
        call = _make_call(node.func.id, args)
        if call is None:
            raise ValueError("not valid Unicode")
        return call

    @classmethod
    def _literal(cls, node: ast.expr) -> Any:
        """The JSON value of a literal expression; ValueError for anything else (names, calls, non-finite floats)."""
        if isinstance(node, ast.Name) and node.id in cls._CONSTANTS:
            return cls._CONSTANTS[node.id]
        if isinstance(node, (ast.List, ast.Tuple)):
            return [cls._literal(e) for e in node.elts]
        if isinstance(node, ast.Dict):
            keys = [cls._literal(k) if k is not None else None for k in node.keys]
            if not all(isinstance(k, str) for k in keys):
                raise ValueError("dict keys must be strings")
            return {k: cls._literal(v) for k, v in zip(keys, node.values)}
        if isinstance(node, (ast.Constant, ast.UnaryOp)):
            value = ast.literal_eval(node)  # ValueError for operators other than a sign on a number
            if value is None or isinstance(value, (str, int)) or (isinstance(value, float) and math.isfinite(value)):
                return value
        raise ValueError("not a JSON literal")

    def _tool_rules(self, index: int, tool: FunctionTool, constrain: bool) -> list[str]:
        """``name(`` keyword arguments ``)``: with ``constrain``, the schema's properties in order (required ones
        mandatory), each value ``%json`` of its schema; else any identifiers with any JSON values."""
        t = f"tool_{index}"
        _check_no_lark(self.name, tool, constrain)
        _check_identifier(tool.name, f"tool name {tool.name!r}")
        opening = json.dumps(f"{tool.name}(")
        if not constrain:
            kwarg = f'/[A-Za-z_][A-Za-z0-9_]*/ "=" {_schema({})}'
            return [f'{t}: {opening} ({t}_kw (", " {t}_kw)*)? ")"', f"{t}_kw: {kwarg}"]
        props = list((tool.parameters.get("properties") or {}).items())
        if not props:
            return [f'{t}: {opening} ")"']
        required = set(tool.parameters.get("required") or ())
        lines = []
        for k, (prop, schema) in enumerate(props):
            _check_identifier(prop, f"parameter {prop!r} of tool {tool.name!r}")
            lines.append(f"{t}_p{k}: {json.dumps(prop + '=')} {_schema(schema, tool.parameters)}")

        def rest(start: int) -> str:  # the arguments from position start on, each after ", "
            return " ".join(
                f'", " {t}_p{j}' if props[j][0] in required else f'(", " {t}_p{j})?' for j in range(start, len(props))
            )

        # {t}_f{k}: a non-empty argument list whose first argument is at position >= k.
        for k in range(len(props)):
            first = f"{t}_p{k} {rest(k + 1)}".rstrip()
            if props[k][0] in required or k + 1 == len(props):
                lines.append(f"{t}_f{k}: {first}")
                break
            lines.append(f"{t}_f{k}: {first} | {t}_f{k + 1}")
        optional = "" if required & {p for p, _ in props} else "?"
        return [f'{t}: {opening} {t}_f0{optional} ")"', *lines]


def _check_no_lark(parser: str, tool: FunctionTool, constrain: bool) -> None:
    """Formats that write the input inside JSON or Python literals cannot enforce a context-free grammar there."""
    if tool.lark is not None and constrain:
        raise ValueError(
            f"the {parser} tool format cannot enforce the Lark grammar of custom tool {tool.name!r} "
            "(a grammar is enforced on raw input, which only the hermes format writes; use --tool-call-parser hermes "
            "or a regex grammar)"
        )


def _check_identifier(name: str, what: str) -> None:
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"the pythonic tool format cannot express {what}: not a Python identifier")


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, PythonicToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser called ``name`` (vLLM's ``--tool-call-parser`` names); ValueError naming the known ones."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None
