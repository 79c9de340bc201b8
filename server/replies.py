"""A choice's output read back as a reply: its content and tool calls under the request's ``ToolPlan``, whole once
the choice finished (``parse_reply``) or as it streams (``ReplyStream``). Chat completions and the Responses API
both read replies here."""

from __future__ import annotations

from dflash2.outputs import RequestOutput
from server.generation import ChoiceState, visible_text
from server.tool_calling import ToolPlan
from server.tool_parsers import ParsedToolCall


def parse_reply(plan: ToolPlan, state: ChoiceState) -> tuple[str | None, list[ParsedToolCall]]:
    """The content and tool calls of a finished choice.

    Args:
        plan: the request's tools and structured outputs.
        state: the choice's whole output.

    Returns:
        The content (None when a calls-only reply has none) and the calls; a call that ``max_tokens`` cut short
        is neither.
    """
    return plan.parse(state.text, cut=state.is_cut)


class ReplyStream:
    """One streamed choice split into content deltas and completed tool calls, as its outputs arrive.

    Text that may be the start of a call is held back until it is decided; ``num_calls`` counts the calls
    passed on so far.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self._streamer = plan.streamer()
        self.num_calls = 0

    def feed(self, output: RequestOutput) -> tuple[str, list[ParsedToolCall]]:
        """The text to send now and the calls completed by ``output`` (all that is left once it is the last)."""
        text, calls = visible_text(output), list[ParsedToolCall]()
        if self._streamer is not None:
            text, calls = self._streamer.feed(text)
            if output.finished:
                tail, more = self._streamer.finish(cut=output.finish_reason == "length")
                text, calls = text + tail, calls + more
        self.num_calls += len(calls)
        return text, calls


def tool_finish_reason(finish_reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's ``tool_calls`` when a choice that stopped normally made calls; otherwise unchanged
    (a reply cut by ``length`` stays ``length``)."""
    return "tool_calls" if has_calls and finish_reason == "stop" else finish_reason
