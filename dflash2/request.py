"""Request state, finish reasons, per-step outputs and ``StepStats``."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dflash2.sampling import SamplingParams

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from dflash2.adaptive import AcceptanceEstimate
    from dflash2.detokenize import IncrementalDetokenizer
    from dflash2.prompt_lookup import PromptLookup


def mean_acceptance_length(num_accepted_tokens: int, num_verify_steps: int) -> float:
    """τ = committed tokens per verify step, bonus included: ``1 + accepted / steps`` (0 with no steps)."""
    return (num_accepted_tokens + num_verify_steps) / num_verify_steps if num_verify_steps else 0.0


class FinishReason(str, enum.Enum):
    """Why a request ended (OpenAI values plus ``abort``)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class RequestStatus(enum.Enum):
    """Lifecycle of a request inside the engine."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    """Log-probability of one emitted token under the target, with the top alternatives.

    Attributes:
        token_id: the emitted token.
        logprob: its natural-log probability under the raw target distribution.
        top: ``[(token_id, logprob), …]`` best-first (length = the request's ``logprobs``).
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class PendingContext:
    """Committed tokens' target features not yet written as drafter context (spec §5.4).

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
    lookup: PromptLookup | None = None  # the n-gram index over its tokens (prompt lookup on)
    lookup_acceptance: AcceptanceEstimate | None = None  # of its prompt-lookup drafts
    pending_context: PendingContext = field(default_factory=PendingContext)
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

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


@dataclass
class RequestOutput:
    """What one step produced for one request: a delta plus cumulative counts.

    Attributes:
        request_id: the request.
        new_token_ids: tokens committed this step (already truncated at a stop).
        new_text: text that is safe to emit now (partial UTF-8 and partial stop strings held back).
        new_logprobs: one ``TokenLogprob`` per new token when requested, else None.
        finished / finish_reason / stop_reason: set on the last output of a request;
            ``stop_reason`` is the matched stop string or stop token id (None for EOS).
        num_prompt_tokens, num_output_tokens: cumulative token counts.
        num_draft_tokens, num_accepted_tokens, num_verify_steps: cumulative speculative stats.
        num_cached_tokens: prompt tokens served from the prefix cache (not recomputed).
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    new_logprobs: list[TokenLogprob] | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_verify_steps: int
    error: str | None = None
    num_cached_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        """Committed tokens per verify step so far (bonus included)."""
        return mean_acceptance_length(self.num_accepted_tokens, self.num_verify_steps)


@dataclass
class StepStats:
    """What one engine step did, for metrics and benchmarks.

    Only committed tokens are counted: a stop inside an accepted block truncates the counts.

    Attributes:
        block_size: B used for this step (1 = autoregressive).
        num_prefills: requests prefilled this step; num_prefill_tokens: their prompt tokens (cached
            ones included).
        num_prefix_cache_queries, num_prefix_cache_hits: prompt tokens of the requests admitted this
            step, and how many of them came from the prefix cache.
        num_decode_rows: rows that took part in the draft–verify cycle.
        num_drafts: verify steps with at least one drafted token.
        num_draft_tokens: drafted tokens that were verified.
        num_accepted_tokens: accepted drafted tokens that were committed.
        accepted_per_position: length B−1; count of committed acceptances at each draft slot.
        drafted_per_position: length B−1; count of drafts verified at each draft slot.
        acceptance_lengths: per row, tokens committed by its verify step (bonus included).
        num_generated_tokens: all tokens committed this step (prefill first tokens included).
        draft_time, select_time, verify_time, total_time: seconds.
        select_in_draft: the choice of the drafted path ran inside the drafting forward (compiled on
            CPU), so its time is part of ``draft_time`` and ``select_time`` is 0.
        grammar_time: seconds spent computing grammar masks (part of verify or prefill time).
        verify_width: tokens per row of the step's verify forward (1: no drafts; 0: no decode step).
        draft_lengths: per decode row, the drafts it verified (adaptive speculation chooses them).
        num_lookup_drafts: decode rows whose drafts came from prompt lookup (no drafter forward;
            ``dflash2/prompt_lookup.py``); their drafts count in the acceptance figures too.
        predicted_tokens: tokens the adaptive policy expected the decode rows to commit (0: fixed block).
        num_running, num_waiting: queue sizes after the step.
        kv_cache_usage: fraction (0–1) of target KV positions in use after the step.
        num_threads: torch CPU threads the step ran with (0 on CUDA; ``dflash2/threads.py``).
    """

    block_size: int = 1
    num_prefills: int = 0
    num_prefill_tokens: int = 0
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    num_decode_rows: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)
    num_generated_tokens: int = 0
    draft_time: float = 0.0
    select_time: float = 0.0
    select_in_draft: bool = False
    verify_time: float = 0.0
    grammar_time: float = 0.0
    verify_width: int = 0
    draft_lengths: list[int] = field(default_factory=list)
    num_lookup_drafts: int = 0
    predicted_tokens: float = 0.0
    total_time: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_threads: int = 0


@dataclass
class StepResult:
    """The outputs and statistics of one ``Engine.step``."""

    outputs: list[RequestOutput]
    stats: StepStats
