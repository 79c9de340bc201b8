"""``ToolPlan``: what ``tool_choice`` and ``parallel_tool_calls`` (or the server's default for it) ask of
the grammar, the engine's repeat check and the parsing (no model: the plan only)."""

from __future__ import annotations

import pytest

from server.protocol import ChatCompletionRequest
from server.tool_calling import ToolPlan
from server.tool_parsers import ParsedToolCall, get_tool_parser

WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


def plan(default_parallel: bool = False, parser: str = "hermes", **fields) -> ToolPlan:
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], tools=[WEATHER], **fields)
    return ToolPlan.for_request(request, get_tool_parser(parser), default_parallel)


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_the_server_default_stands_for_a_missing_parallel_tool_calls(choice):
    one, several = plan(tool_choice=choice), plan(True, tool_choice=choice)
    assert not one.parallel and one.repeat_marker is None
    assert several.parallel and several.repeat_marker == "</tool_call>"
    assert one.grammar is not None  # auto too: the grammar ends the reply after one call
    assert plan(True, tool_choice=choice, parallel_tool_calls=False).parallel is False
    assert plan(False, tool_choice=choice, parallel_tool_calls=True).parallel is True


def test_formats_without_a_closing_tag_have_no_repeat_marker():
    assert plan(True, parser="llama3_json", tool_choice="required").repeat_marker is None
    named = plan(True, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert not named.parallel and named.repeat_marker is None


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "pythonic"])
def test_a_repeated_call_is_read_back_once(parser):
    p = plan(True, parser=parser, tool_choice="required", parallel_tool_calls=True)
    paris = ParsedToolCall("get_weather", '{"city": "Paris"}')
    rome = ParsedToolCall("get_weather", '{"city": "Rome"}')
    text = p.parser.format_calls([paris, rome, paris])
    assert p.parse(text) == (None, [paris, rome])
    streamer = p.streamer()
    calls = [call for char in text for call in streamer.feed(char)[1]] + streamer.finish()[1]
    assert calls == [paris, rome]


def test_without_a_grammar_engine_an_auto_reply_keeps_its_first_call():
    """A model with no tokenizer has no grammar engine: ``auto`` still works, the grammar that would
    have ended the reply after one call is dropped and the reply's first call is its only one."""
    auto = plan(tool_choice="auto")
    assert auto.one_call_grammar and auto.grammar is not None
    auto.without_grammar_engine()
    assert auto.grammar is None
    paris = ParsedToolCall("get_weather", '{"city": "Paris"}')
    rome = ParsedToolCall("get_weather", '{"city": "Rome"}')
    assert auto.parse("Sure. " + auto.parser.format_calls([paris, rome])) == ("Sure.", [paris])
    required = plan(tool_choice="required")
    required.without_grammar_engine()
    assert required.grammar is not None  # enforced: a model without a grammar engine gets a 400 for it
