"""One admitted generation request: its engine requests, what each choice has produced so far, and the usage and
speculative statistics of its choices."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from dflash2.outputs import RequestOutput, TokenLogprob, mean_acceptance_length
from server.admission import Ticket
from server.engine_client import RequestGroup
from server.protocol import PromptTokensDetails, SpecDecodeInfo, UsageInfo

_REPLACEMENT_CHAR = "\ufffd"


def visible_text(output: RequestOutput) -> str:
    """The text of one engine output as clients see it.

    NOTE: when a request ends (max_tokens, EOS) in the middle of a multi-byte character, the
    detokenizer's final flush releases the incomplete bytes as U+FFFD. A response never ends in a
    broken character, so that tail is dropped here (its tokens still count in usage and logprobs).
    """
    if output.finished and not isinstance(output.stop_reason, str):
        return output.new_text.rstrip(_REPLACEMENT_CHAR)
    return output.new_text


@dataclass
class ChoiceState:
    """Everything one choice has produced so far."""

    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    last: RequestOutput | None = None

    @property
    def is_cut(self) -> bool:
        """True when ``max_tokens`` ended the choice (``finish_reason`` ``length``)."""
        return self.finish_reason == "length"

    def add(self, output: RequestOutput) -> None:
        """Fold in one engine output."""
        self.text += visible_text(output)
        self.num_tokens += len(output.new_token_ids)
        self.logprobs.extend(output.new_logprobs or ())
        self.finish_reason, self.stop_reason, self.last = output.finish_reason, output.stop_reason, output


@dataclass
class Generation:
    """One admitted HTTP generation request: its id, engine requests and concurrency ticket."""

    id: str
    created: int
    num_prompt_tokens: int
    group: RequestGroup
    ticket: Ticket
    states: list[ChoiceState]

    def close(self) -> None:
        """Abort what is unfinished and give the concurrency slot back (idempotent)."""
        self.group.close()
        self.ticket.release()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Engine outputs as they arrive, folded into ``states`` first."""
        async for index, output in self.group:
            self.states[index].add(output)
            yield index, output

    async def collect(self) -> list[ChoiceState]:
        """Run to completion (closing the generation either way)."""
        try:
            async for _ in self.outputs():
                pass
        finally:
            self.close()
        return self.states


def usage_info(num_prompt_tokens: int, states: Sequence[ChoiceState]) -> UsageInfo:
    """Prompt counted once, completion tokens summed over the choices; cached prompt tokens are the
    fewest any choice reused (each choice is an engine request over the same prompt)."""
    completion = sum(s.num_tokens for s in states)
    cached = min((s.last.num_cached_tokens for s in states if s.last is not None), default=0)
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=completion,
        total_tokens=num_prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def spec_decode_info(states: Sequence[ChoiceState]) -> SpecDecodeInfo:
    """Speculative statistics summed over the choices; τ includes the bonus token."""
    drafted = sum(s.last.num_draft_tokens for s in states if s.last)
    accepted = sum(s.last.num_accepted_tokens for s in states if s.last)
    steps = sum(s.last.num_verify_steps for s in states if s.last)
    by_source: dict[str, int] = {}
    for state in states:
        for source, count in (state.last.accepted_by_source if state.last else {}).items():
            by_source[source] = by_source.get(source, 0) + count
    return SpecDecodeInfo(
        draft_tokens=drafted,
        accepted_tokens=accepted,
        verify_steps=steps,
        mean_acceptance_length=mean_acceptance_length(accepted, steps),
        accepted_tokens_by_source=by_source,
    )
