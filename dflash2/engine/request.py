"""A request's state inside the engine: pending drafter context and ``Request`` (its lifecycle is the
scheduler's queue it is in)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dflash2.outputs import FinishReason, mean_acceptance_length
from dflash2.sampling import SamplingParams

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from dflash2.detokenize import IncrementalDetokenizer
    from dflash2.spec.adaptive import AcceptanceEstimate
    from dflash2.spec.prompt_lookup import PromptLookup


@dataclass
class PendingContext:
    """Committed tokens' target features not yet written as drafter context (docs/dflash2-spec.md §5.4).

    A verify step appends the features of the tokens it committed (always contiguous positions);
    they are written in one call just before the request drafts again, or when it ends, so steps
    without drafts skip the drafter entirely.

    Attributes:
        start: the position of the first pending token (meaningless while empty).
        chunks: ``[n_i, F·H]`` feature rows, in position order.
        num_tokens: Σ n_i.
    """

    start: int = 0
    chunks: list[torch.Tensor] = field(default_factory=list)
    num_tokens: int = 0

    def __bool__(self) -> bool:
        return self.num_tokens > 0

    def add(self, start: int, features: torch.Tensor) -> None:
        """Append ``features [n, F·H]`` of the tokens at positions ``start ..``."""
        if not self.chunks:
            self.start = start
        self.chunks.append(features)
        self.num_tokens += len(features)

    def features(self) -> torch.Tensor:
        """All pending rows, ``[num_tokens, F·H]``."""
        return self.chunks[0] if len(self.chunks) == 1 else torch.cat(self.chunks)

    def clear(self) -> None:
        """Drop every pending row (written, or the slot's context is no longer trusted)."""
        self.chunks.clear()
        self.num_tokens = 0


@dataclass
class Request:
    """One generation request and everything the engine tracks for it.

    ``output_ids[-1]`` is the anchor: the last verified token, not yet in the target cache.
    The target cache of the slot holds ``num_cached`` tokens (prompt + output[:-1]).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    detokenizer: IncrementalDetokenizer | None  # None when the engine has no tokenizer
    matcher: LLMatcher | None = None  # at the committed state, for requests with a grammar
    # The budget rule (dflash2.grammar): the first position of this step's block whose mask it restricted
    # (None: none), and whether a committed token was sampled under it (the request then ends by length).
    closing_from: int | None = None
    budget_closed: bool = False
    acceptance: AcceptanceEstimate | None = None  # of this request's drafter drafts (adaptive mode)
    tree_acceptance: AcceptanceEstimate | None = None  # per depth, of its token trees (adaptive mode with trees)
    lookup: PromptLookup | None = None  # the n-gram index over its tokens (prompt lookup on)
    lookup_acceptance: AcceptanceEstimate | None = None  # of its prompt-lookup drafts
    suffix_acceptance: AcceptanceEstimate | None = None  # of its drafts from earlier outputs (suffix decoding)
    pending_context: PendingContext = field(default_factory=PendingContext)
    slot: int | None = None
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Committed accepted drafts by where they came from (drafter, lookup, suffix, grammar).
    accepted_by_source: dict[str, int] = field(default_factory=dict)

    @property
    def is_finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finish_reason is not None

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.output_ids)

    @property
    def remaining_tokens(self) -> int:
        """Tokens still allowed by ``max_tokens``."""
        return self.params.max_tokens - len(self.output_ids)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per verify step (accepted drafts + bonus), 0 before the first step."""
        return mean_acceptance_length(self.num_accepted_tokens, self.num_verify_steps)


def committed_tokens(request: Request) -> list[int]:
    """The tokens whose target KV and drafter context a request's slot holds: prompt + output, up to
    ``num_cached`` (the anchor, the last output token, is not in the cache yet)."""
    return [*request.prompt_ids, *request.output_ids][: request.num_cached]


def slot_of(request: Request) -> int:
    """The slot of a running request."""
    assert request.slot is not None
    return request.slot
