"""A choice's output read back as a reply: its reasoning, content and tool calls under the request's ``ToolPlan``,
whole once the choice finished (``parse_reply``) or as it streams (``ReplyStream``). Chat completions and the
Responses API both read replies here."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash2.outputs import RequestOutput
from server.generation import ChoiceState, visible_text
from server.reasoning import ReasoningSplitter
from server.tool_calling import ToolPlan
from server.tool_parsers import ParsedToolCall


@dataclass
class Reply:
    """A reply, or what one streamed output adds to it.

    Attributes:
        reasoning: the thinking block's text (``--reasoning-parser``); None (whole reply) or ``""`` (a delta)
            when there is none.
        content: the answer's text; None when a calls-only reply has none.
        calls: the tool calls (a delta: the calls completed by this output).
    """

    reasoning: str | None = None
    content: str | None = None
    calls: list[ParsedToolCall] = field(default_factory=list)


def parse_reply(plan: ToolPlan, state: ChoiceState) -> Reply:
    """The reasoning, content and tool calls of a finished choice.

    Args:
        plan: the request's tools, structured outputs and reasoning parser.
        state: the choice's whole output.

    Returns:
        The reply; a call that ``max_tokens`` cut short is neither a call nor content, and tool calls are read
        from the text after the thinking block only.
    """
    reasoning, text = None, state.text
    if plan.reasoning is not None:
        reasoner, start = plan.reasoning
        reasoning, text = reasoner.parser.split(text, start)
    content, calls = plan.parse(text, cut=state.is_cut)
    return Reply(reasoning, content, calls)


class ReplyStream:
    """One streamed choice split into reasoning deltas, content deltas and completed tool calls, as its outputs
    arrive.

    Text that may be the start of a call (or of a thinking block's tag) is held back until it is decided;
    ``num_calls`` counts the calls passed on so far.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self._streamer = plan.streamer()
        self._splitter = ReasoningSplitter(plan.reasoning[0].parser, plan.reasoning[1]) if plan.reasoning else None
        self.num_calls = 0

    def feed(self, output: RequestOutput) -> Reply:
        """What ``output`` adds: reasoning and content deltas (``""`` when none) and the calls it completes (all
        that is left once it is the last)."""
        reasoning, text, calls = "", visible_text(output), list[ParsedToolCall]()
        if self._splitter is not None:
            reasoning, text = self._splitter.feed(text)
            if output.finished:
                more_reasoning, more_text = self._splitter.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
        if self._streamer is not None:
            text, calls = self._streamer.feed(text)
            if output.finished:
                tail, more = self._streamer.finish(cut=output.finish_reason == "length")
                text, calls = text + tail, calls + more
        self.num_calls += len(calls)
        return Reply(reasoning, text, calls)


def tool_finish_reason(finish_reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's ``tool_calls`` when a choice that stopped normally made calls; otherwise unchanged
    (a reply cut by ``length`` stays ``length``)."""
    return "tool_calls" if has_calls and finish_reason == "stop" else finish_reason
