"""Tests for server.tool_parsers: parsing, streaming, prompts and llguidance grammars (real SmolLM2 tokenizer)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from server.tool_parsers import (
    TOOL_PARSERS,
    FunctionTool,
    ParsedToolCall,
    ToolParser,
    get_tool_parser,
)

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city"],
}
WEATHER = FunctionTool("get_weather", "Current weather in a city.", WEATHER_SCHEMA, strict=True)
CLOCK = FunctionTool("get_time2", None, {})  # not strict, no schema
DASHED = FunctionTool("get-time-2", "A name that is no Python identifier.", {})

ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
ANSWER = "%json " + json.dumps(
    {
        **ANSWER_SCHEMA,
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "},
    }
)


def call(name: str, **args: Any) -> ParsedToolCall:
    return ParsedToolCall(name, json.dumps(args, ensure_ascii=False))


def tool_call(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


ESCAPED_UNICODE_ARGS = '{"city": "Z\\u00fcrich 東京 \\ud83d\\ude80", "unit": "c"}'  # JSON escapes, a surrogate pair
PARIS = call("get_weather", city="Paris")
UNICODE = call("get_weather", city="Zürich 東京 🚀", unit="c")


# --- parsing ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", (None, [])),
        ("  Just text.\n", ("Just text.", [])),
        (tool_call('{"name": "get_weather", "arguments": {"city": "Paris"}}'), (None, [PARIS])),
        (
            "Let me check.\n" + tool_call('{"name": "get_weather", "arguments": {"city": "Paris"}}'),
            ("Let me check.", [PARIS]),
        ),
        (
            tool_call('{"name": "get_weather", "parameters": {"city": "Paris"}}')
            + "\n"
            + tool_call('{"name": "get_time2", "arguments": {}}')
            + "\nDone.",
            ("Done.", [PARIS, call("get_time2")]),
        ),
        (tool_call('{"name": "get_weather", "arguments": ' + ESCAPED_UNICODE_ARGS + "}"), (None, [UNICODE])),
        ("A " + tool_call('{"name": "get_weather", "arguments": {"city": "Paris"}}'), ("A", [PARIS])),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', (None, [PARIS])),  # unclosed
    ],
)
def test_hermes_parse(text: str, expected: tuple[str | None, list[ParsedToolCall]]) -> None:
    assert get_tool_parser("hermes").parse(text) == expected


@pytest.mark.parametrize(
    "bad",
    [
        tool_call('{"name": "f", "arguments": "{}"}'),  # arguments not an object
        tool_call('{"name": "f"}'),  # no arguments
        tool_call('{"arguments": {}}'),  # no name
        tool_call('{"name": 3, "arguments": {}}'),
        tool_call('{"name": "f", "arguments": {"x": NaN}}'),
        tool_call('{"name": "f", "arguments": {"x": "\\ud800"}}'),  # a lone surrogate
        tool_call("not json"),
        tool_call("[1, 2]"),
        '<tool_call>\n{"name": "f", "arguments": {',  # unclosed and not JSON
        "<tool_call",
    ],
)
def test_hermes_malformed_calls_stay_content(bad: str) -> None:
    parser = get_tool_parser("hermes")
    assert parser.parse(bad) == (bad, [])
    assert parser.parse(f"{bad}\n\n") == (bad, [])
    if bad.endswith("</tool_call>"):  # a closed block does not take the next one with it
        good = tool_call('{"name": "get_weather", "arguments": {"city": "Paris"}}')
        assert parser.parse(f"Before {bad} {good} after") == (f"Before {bad}  after", [PARIS])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', (None, [PARIS])),
        ('\n <|python_tag|> {"name": "get_weather", "arguments": {"city": "Paris"}} \n', (None, [PARIS])),
        (
            '{"name": "get_weather", "parameters": {"city": "Paris"}};{"name": "get_time2", "parameters": {}} ;\n '
            '{"name": "get_weather", "parameters": {"city": "Z\\u00fcrich 東京 🚀", "unit": "c"}}',
            (None, [PARIS, call("get_time2"), UNICODE]),
        ),
        ("  Hello there. ", ("Hello there.", [])),
        ('Sure: {"name": "get_weather", "parameters": {}}', ('Sure: {"name": "get_weather", "parameters": {}}', [])),
        ('{"name": "f", "parameters": {}} and more', ('{"name": "f", "parameters": {}} and more', [])),
        ('{"name": "f", "parameters": {}}; oops', ('{"name": "f", "parameters": {}}; oops', [])),
        ('{"name": "f", "parameters": []}', ('{"name": "f", "parameters": []}', [])),
        ('{"name": "f\\udc00", "parameters": {}}', ('{"name": "f\\udc00", "parameters": {}}', [])),
        ('{"city": "Paris"}', ('{"city": "Paris"}', [])),
        ('{"name": "f", "parameters": {', ('{"name": "f", "parameters": {', [])),
        ("<|python_tag|>print(1)", ("<|python_tag|>print(1)", [])),
        ("", (None, [])),
    ],
)
def test_llama3_json_parse(text: str, expected: tuple[str | None, list[ParsedToolCall]]) -> None:
    assert get_tool_parser("llama3_json").parse(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[get_weather(city="Paris")]', [PARIS]),
        (" [get_weather(city='Paris'), get_time2()]\n", [PARIS, call("get_time2")]),
        ('[get_weather(city="Zürich 東京 🚀", unit="c")]', [UNICODE]),
        (
            "[f(a=true, b=null, c=[1, -2.5, {'k': False}], d=(1, 2), e=None, f=-3, g={})]",
            [call("f", a=True, b=None, c=[1, -2.5, {"k": False}], d=[1, 2], e=None, f=-3, g={})],
        ),
    ],
)
def test_pythonic_parse(text: str, expected: list[ParsedToolCall]) -> None:
    assert get_tool_parser("pythonic").parse(text) == (None, expected)


@pytest.mark.parametrize(
    "bad",
    [
        "[]",
        "[f(1)]",
        "[f(a=x)]",
        "[f(a=1)",
        "[a.b(c=1)]",
        "[f(a=1 + 2)]",
        "[f(**k)]",
        '[f(a={1: "x"})]',
        "[f(a=b'x')]",
        "[f(a=1e999)]",
        "[f(a=-'x')]",
        "[f(a=1), 3]",
        "[f(a=1, a=2)]",
        '[f(a="\\ud800")]',
        "Sure: [f(a=1)]",
        "[1, 2, 3] are numbers",
    ],
)
def test_pythonic_malformed_is_content(bad: str) -> None:
    assert get_tool_parser("pythonic").parse(f" {bad}\n") == (bad, [])


# --- streaming -------------------------------------------------------------------------------------------------------

STREAM_TEXTS = {
    "hermes": [
        "Plain answer with <b>tags</b> and <tool_ but no call. ",
        "Checking.\n" + tool_call('{"name": "get_weather", "arguments": {"city": "Zürich 🚀"}}') + "\n",
        tool_call('{"name": "a", "arguments": {}}') + "  mid  " + tool_call('{"name": "b", "parameters": {"x": 1}}'),
        "x " + tool_call("broken") + " y " + tool_call('{"name": "ok", "arguments": {"s": "</tool"}}') + " <tool_cal",
        ' <tool_call>\n{"name": "open", "arguments": {"k": [1, 2]}}\n',
        "<tool_call>\n{unclosed and broken",
        "   \n ",
    ],
    "llama3_json": [
        "Hello, no tools here.",
        '  {"name": "a", "parameters": {"x": "é"}}; {"name": "b", "arguments": {}}',
        '<|python_tag|>{"name": "a", "parameters": {}}',
        '{"name": "a", "parameters": {}} trailing',
        "<|python_ta",
        "<|not the tag",
        " ",
    ],
    "pythonic": [
        "No calls, only [brackets] later.",
        "\n[get_weather(city=\"Paris\", unit='c'), get_time2()] ",
        "[broken(",
        "[",
        "",
    ],
}


def run_stream(parser: ToolParser, chunks: list[str]) -> tuple[str | None, list[ParsedToolCall]]:
    streamer = parser.streamer()
    content: list[str] = []
    calls: list[ParsedToolCall] = []
    for chunk in chunks:
        text, new = streamer.feed(chunk)
        content.append(text)
        calls += new
    text, new = streamer.finish()
    return "".join([*content, text]) or None, calls + new


@pytest.mark.parametrize(("name", "text"), [(n, t) for n, texts in STREAM_TEXTS.items() for t in texts])
def test_streaming_equals_parse(name: str, text: str) -> None:
    parser = get_tool_parser(name)
    expected = parser.parse(text)
    assert run_stream(parser, [text]) == expected
    assert run_stream(parser, list(text)) == expected  # one character at a time
    for cut in range(len(text) + 1):
        assert run_stream(parser, [text[:cut], text[cut:]]) == expected, cut
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(4, len(text) + 1)))
        assert run_stream(parser, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]) == expected


def test_hermes_streaming_holds_back_only_possible_calls() -> None:
    streamer = get_tool_parser("hermes").streamer()
    assert streamer.feed("Hello <tool_") == ("Hello", [])  # the space waits for more content too
    assert streamer.feed("x> more") == (" <tool_x> more", [])  # not a call after all: released
    assert streamer.feed(" <tool_call>\n{") == ("", [])
    assert streamer.feed('"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call') == ("", [])
    assert streamer.feed(">\n") == ("", [PARIS])
    assert streamer.finish() == ("", [])


def test_whole_output_formats_stream_plain_text_at_once() -> None:
    for name, opening in [("llama3_json", '{"name": "get_weather", '), ("pythonic", "[get_weather(")]:
        streamer = get_tool_parser(name).streamer()
        assert streamer.feed("  Hi") == ("Hi", [])
        assert streamer.feed(" there") == (" there", [])
        held = get_tool_parser(name).streamer()
        assert held.feed(opening) == ("", [])
    held = get_tool_parser("llama3_json").streamer()
    assert held.feed("<|python") == ("", [])
    assert held.feed('_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}') == ("", [])
    assert held.finish() == ("", [PARIS])


# --- prompts and history ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_system_prompt_lists_tools(name: str) -> None:
    tools = [WEATHER, CLOCK, DASHED]
    prompt = get_tool_parser(name).system_prompt(tools)
    for tool in tools:
        assert json.dumps(tool.name) in prompt
        assert json.dumps(tool.parameters) in prompt
    assert json.dumps(WEATHER.description) in prompt
    marker = {"hermes": "<tool_call>", "llama3_json": '"parameters"', "pythonic": "[func_name1("}[name]
    assert marker in prompt


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_format_calls_round_trips(name: str) -> None:
    parser = get_tool_parser(name)
    calls = [PARIS, UNICODE, call("get_time2"), call("f", a=True, b=None, c=[1, -2.5, {"k": 'v\n"q"'}])]
    assert parser.parse(parser.format_calls(calls)) == (None, calls)
    assert parser.parse(parser.format_calls(calls[:1])) == (None, calls[:1])


def test_format_result_and_hermes_calls() -> None:
    parser = get_tool_parser("hermes")
    assert parser.format_result('{"temp": 21}') == '<tool_response>\n{"temp": 21}\n</tool_response>'
    assert parser.format_calls([PARIS]) == tool_call('{"name": "get_weather", "arguments": {"city": "Paris"}}')


def test_get_tool_parser() -> None:
    assert {name: type(get_tool_parser(name)).name for name in TOOL_PARSERS} == {
        "hermes": "hermes",
        "llama3_json": "llama3_json",
        "pythonic": "pythonic",
    }
    with pytest.raises(ValueError, match=r"hermes.*llama3_json.*pythonic"):
        get_tool_parser("nope")


# --- grammars --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def matcher() -> Any:
    """A function (lark, text) -> whether the grammar accepts exactly the text, with the SmolLM2 tokenizer."""
    llguidance = pytest.importorskip("llguidance")
    llguidance_hf = pytest.importorskip("llguidance.hf")

    from dflash2.models import loader, source

    tok = loader.load_tokenizer(source.resolve_model(None))
    llt = llguidance_hf.from_tokenizer(tok, n_vocab=49152)

    def accepts(lark: str | None, text: str) -> bool:
        assert lark is not None
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        assert llguidance.LLMatcher.validate_grammar_with_warnings(grammar, llt) == (False, []), lark
        m = llguidance.LLMatcher(llt, grammar)
        ids = tok.encode(text, add_special_tokens=False)
        return bool(m.try_consume_tokens(ids) == len(ids) and m.is_accepting())

    def ends_after(lark: str | None, text: str) -> bool:
        """Whether the grammar accepts the text and allows nothing after it (the engine ends the request)."""
        assert lark is not None
        m = llguidance.LLMatcher(llt, llguidance.LLMatcher.grammar_from_lark(lark))
        ids = tok.encode(text, add_special_tokens=False)
        return bool(m.try_consume_tokens(ids) == len(ids) and m.is_stopped() and not m.is_error())

    accepts.ends_after = ends_after  # type: ignore[attr-defined]
    return accepts


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_required_grammar(name: str, matcher: Any) -> None:
    parser = get_tool_parser(name)
    tools = [WEATHER, CLOCK] if name == "pythonic" else [WEATHER, CLOCK, DASHED]
    lark = parser.grammar(tools, required=True, parallel=False)
    assert matcher(lark, parser.format_calls([PARIS]))
    assert matcher(lark, parser.format_calls([UNICODE]))
    assert matcher(lark, parser.format_calls([call("get_time2")]))
    assert not matcher(lark, parser.format_calls([call("get_wether", city="Paris")]))
    assert not matcher(lark, parser.format_calls([call("get_weather", city=3)]))
    assert not matcher(lark, parser.format_calls([call("get_weather", city="Paris", unit="kelvin")]))
    assert not matcher(lark, parser.format_calls([call("get_weather", unit="c")]))  # required property missing
    assert not matcher(lark, parser.format_calls([PARIS, PARIS]))
    assert not matcher(lark, "The weather is nice.")
    parallel = parser.grammar(tools, required=True, parallel=True)
    assert matcher(parallel, parser.format_calls([PARIS, call("get_time2"), UNICODE]))
    assert not matcher(parallel, parser.format_calls([PARIS, call("get_weather", city=3)]))
    if name != "pythonic":
        assert matcher(lark, parser.format_calls([call("get-time-2")]))
        # JSON is written as json.dumps writes it, with no free whitespace.
        assert not matcher(lark, parser.format_calls([PARIS]).replace(": ", ":  ", 1))
        assert not matcher(lark, parser.format_calls([PARIS]).replace(": ", ":", 1))
        assert parser.parse(parser.format_calls([call("get-time-2")])) == (None, [call("get-time-2")])


def test_hermes_auto_grammar(matcher: Any) -> None:
    parser = get_tool_parser("hermes")
    lark = parser.grammar([WEATHER, CLOCK], required=False, parallel=True)
    assert matcher(lark, "The weather is nice, no tool needed.\n")
    assert matcher(lark, "Let me check.\n" + parser.format_calls([PARIS, UNICODE]) + "\nDone.")
    assert matcher(lark, parser.format_calls([call("get_time2", anything=[1, {"x": None}])]))  # not strict
    assert not matcher(lark, "Let me check.\n" + parser.format_calls([call("get_weather", city=3)]))
    assert not matcher(lark, parser.format_calls([call("unknown", city="Paris")]))
    assert not matcher(lark, "<tool_call>\nnot json\n</tool_call>")
    single = parser.grammar([WEATHER, CLOCK], required=False, parallel=False)
    assert matcher(single, "Sure.\n" + parser.format_calls([PARIS]))
    assert not matcher(single, parser.format_calls([PARIS, PARIS]))


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_auto_grammar_without_strict_tools_or_answer_is_none(name: str) -> None:
    parser = get_tool_parser(name)
    assert parser.grammar([CLOCK, DASHED], required=False, parallel=True) is None
    assert parser.grammar([], required=False, parallel=True) is None
    with pytest.raises(ValueError):
        parser.grammar([], required=True, parallel=True)


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_answer_grammar(name: str, matcher: Any) -> None:
    parser = get_tool_parser(name)
    lark = parser.grammar([WEATHER, CLOCK], required=False, parallel=True, answer=ANSWER)
    assert matcher(lark, '{"answer": "It is sunny."}')
    assert matcher(lark, parser.format_calls([PARIS]))
    assert matcher(lark, parser.format_calls([PARIS, call("get_time2", tz="UTC")]))
    assert not matcher(lark, "It is sunny.")
    assert not matcher(lark, '{"answer": 3}')
    assert not matcher(lark, parser.format_calls([call("get_weather", city=3)]))
    assert matcher(parser.grammar([], required=False, parallel=True, answer=ANSWER), '{"answer": "x"}')


@pytest.mark.parametrize("name", ["llama3_json", "pythonic"])
def test_whole_output_auto_grammar(name: str, matcher: Any) -> None:
    parser = get_tool_parser(name)
    lark = parser.grammar([WEATHER, CLOCK], required=False, parallel=True)
    assert matcher(lark, "It is sunny in Paris.")
    assert matcher(lark, "")
    calls = [PARIS, call("get_time2", tz="UTC"), UNICODE]
    text = parser.format_calls(calls)
    assert matcher(lark, text)
    assert parser.parse(text) == (None, calls)
    assert not matcher(lark, parser.format_calls([call("get_weather", city=3)]))
    assert not matcher(lark, parser.format_calls([call("get_weather", city=3)]).replace("", " ", 1))


def test_pythonic_argument_order_and_optional_arguments(matcher: Any) -> None:
    parser = get_tool_parser("pythonic")
    schema = {"type": "object", "properties": {p: {"type": "integer"} for p in "abc"}, "required": ["b"]}
    some = FunctionTool("f", None, schema)
    none_required = FunctionTool("g", None, {"type": "object", "properties": {"x": {}, "y": {"type": "boolean"}}})
    lark = parser.grammar([some, none_required, FunctionTool("h")], required=True, parallel=True)
    good = ["f(b=1)", "f(a=1, b=2)", "f(b=1, c=2)", "f(a=1, b=2, c=3)", "g()", "g(y=true)", 'g(x={"k": []}, y=false)']
    for ok in good:
        assert matcher(lark, f"[{ok}]"), ok
        assert parser.parse(f"[{ok}]")[1][0].name == ok[0]
    for bad in [
        "f()",
        "f(a=1)",
        "f(b=1, a=2)",
        "f(b=1,c=2)",
        "f(b=1, )",
        "f(b=1.5)",
        "g(y=1)",
        "h(x=1)",
        "g(, y=1)",
        'g(x={"k":1})',
    ]:
        assert not matcher(lark, f"[{bad}]"), bad
    assert matcher(lark, "[h(), f(b=-4)]")
    with pytest.raises(ValueError, match="identifier"):
        parser.grammar([DASHED], required=True, parallel=False)
    with pytest.raises(ValueError, match="identifier"):
        parser.grammar([FunctionTool("f", None, {"properties": {"from": {}}})], required=True, parallel=False)


def test_grammar_resolves_schema_refs(matcher: Any) -> None:
    schema = {
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
        "type": "object",
        "properties": {"at": {"$ref": "#/$defs/point"}},
        "required": ["at"],
    }
    tool = FunctionTool("move", None, schema, strict=True)
    for name in sorted(TOOL_PARSERS):
        parser = get_tool_parser(name)
        lark = parser.grammar([tool], required=True, parallel=False)
        assert matcher(lark, parser.format_calls([call("move", at={"x": 1.5})])), name
        assert not matcher(lark, parser.format_calls([call("move", at={"x": "1"})])), name


# --- replies cut by max_tokens ---------------------------------------------------------------------------------------

CUT_TEXTS = {
    # (text, the complete calls before the cut): the call being written when the limit hit is dropped.
    "hermes": [
        (
            tool_call('{"name": "get_weather", "arguments": {"city": "Paris"}}') + '\n<tool_call>\n{"name": "get_',
            [PARIS],
        ),
        (tool_call('{"name": "get_weather", "arguments": {"city": "Paris"}}') + "\n<tool_c", [PARIS]),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', []),  # valid JSON, no closing tag
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time2", "param', [PARIS]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Par', []),
    ],
    "pythonic": [
        ('[get_weather(city="Paris"), get_time2(zone="Europe/', [PARIS]),
        ('[get_weather(city="Par', []),
    ],
}


@pytest.mark.parametrize(("name", "text", "calls"), [(n, t, c) for n, cases in CUT_TEXTS.items() for t, c in cases])
def test_a_reply_cut_by_the_limit_keeps_complete_calls_and_drops_the_cut_one(
    name: str, text: str, calls: list[ParsedToolCall]
) -> None:
    parser = get_tool_parser(name)
    assert parser.parse(text, cut=True) == (None, calls)
    for size in (1, 7, len(text)):
        streamer = parser.streamer()
        content, streamed = "", []
        for start in range(0, len(text), size):
            delta, new = streamer.feed(text[start : start + size])
            content, streamed = content + delta, streamed + new
        delta, new = streamer.finish(cut=True)
        assert (content + delta, streamed + new) == ("", calls)


def test_text_before_a_cut_call_stays_content() -> None:
    text = "Let me check.\n" + '<tool_call>\n{"name": "get_weather", "argu'
    assert get_tool_parser("hermes").parse(text, cut=True) == ("Let me check.", [])
    assert get_tool_parser("hermes").parse(text) == (text, [])  # not cut (a model that stopped): content


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_one_call_auto_grammar_exists_without_strict_tools_and_ends_after_the_call(name: str, matcher: Any) -> None:
    parser = get_tool_parser(name)
    one = parser.format_calls([call("get_time2", zone="UTC")])
    lark = parser.grammar([CLOCK], required=False, parallel=False)
    assert matcher(lark, one) and matcher.ends_after(lark, one)
    assert matcher(lark, "No tool is needed.")
    assert not matcher(lark, parser.format_calls([call("get_time2"), call("get_time2", zone="UTC")]))
    required = parser.grammar([CLOCK, WEATHER], required=True, parallel=False)
    assert matcher.ends_after(required, parser.format_calls([PARIS]))
    if name != "pythonic":  # its list ends with "]" either way
        parallel = parser.grammar([CLOCK, WEATHER], required=True, parallel=True)
        assert matcher(parallel, parser.format_calls([PARIS])) and not matcher.ends_after(
            parallel, parser.format_calls([PARIS])
        )


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        ('<tool_call>\n{"name": "calc"}\n1+ "2"\n\n</tool_call>', call("calc", input='1+ "2"\n')),
        ('<tool_call>\n{"name": "calc"}\n\n</tool_call>', call("calc", input="")),
        ('<tool_call>\n{"name": "calc"}\n</tool_call>', None),  # no input line: not a raw-input call
        ('<tool_call>\n{"name": "calc", "x": 1}\nabc\n</tool_call>', None),
        ('<tool_call>\n{"name": "calc"}\nabc', None),  # unclosed
    ],
)
def test_hermes_raw_input_calls(block: str, expected: ParsedToolCall | None) -> None:
    from server.tool_parsers import HermesToolParser

    assert HermesToolParser.parse_block(block) == expected


def test_a_lark_tool_is_raw_in_hermes_and_refused_by_the_other_formats() -> None:
    calc = FunctionTool("calc", None, {"type": "object"}, strict=True, custom=True, lark="start: /[0-9]+/")
    lark = get_tool_parser("hermes").grammar([calc], required=True, parallel=False)
    assert lark is not None and '"{\\"name\\": \\"calc\\"}\\n" @input_calc' in lark
    for name in ("llama3_json", "pythonic"):
        with pytest.raises(ValueError, match="hermes"):
            get_tool_parser(name).grammar([calc], required=True, parallel=False)
