"""What the engine hands back: finish reasons, token logprobs, per-request outputs and ``StepStats``.

These types cross from the engine to the server, the offline API and the benchmarks; the
request's own mutable state lives in ``dflash2/engine/request.py``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


def mean_acceptance_length(num_accepted_tokens: int, num_verify_steps: int) -> float:
    """τ = committed tokens per verify step, bonus included: ``1 + accepted / steps`` (0 with no steps)."""
    return (num_accepted_tokens + num_verify_steps) / num_verify_steps if num_verify_steps else 0.0


class FinishReason(str, enum.Enum):
    """Why a request ended (OpenAI values plus ``abort``)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


# Where a verified draft can come from (dflash2.engine.policy.DraftSource): the labels of the per-source counts.
DRAFT_SOURCE_NAMES = ("drafter", "lookup", "suffix", "grammar")


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
        accepted_by_source: committed accepted drafts so far by where they came from: ``drafter``,
            ``lookup`` (the request's own tokens), ``suffix`` (earlier outputs), ``grammar`` (forced by its
            grammar); sources that contributed none are absent.
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
    accepted_by_source: dict[str, int] = field(default_factory=dict)

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
        drafted_by_source, accepted_by_source: verified drafts and committed accepted drafts by where they
            came from (``drafter``, ``lookup``, ``suffix``, ``grammar``).
        acceptance_lengths: per row, tokens committed by its verify step (bonus included).
        num_generated_tokens: all tokens committed this step (prefill first tokens included).
        draft_time, select_time, verify_time, total_time: seconds.
        select_in_draft: the choice of the drafted path ran inside the drafting forward (compiled on
            CPU), so its time is part of ``draft_time`` and ``select_time`` is 0.
        grammar_time: seconds spent computing grammar masks (part of verify or prefill time).
        verify_width: tokens per row of the step's verify forward (1: no drafts; 0: no decode step).
        draft_lengths: per decode row, the drafts it verified (adaptive speculation chooses them).
        num_lookup_drafts: decode rows whose drafts came from prompt lookup (no drafter forward;
            ``dflash2/spec/prompt_lookup.py``); their drafts count in the acceptance figures too.
        num_tree_nodes: drafted nodes verified as token trees (``EngineConfig.speculative_topk`` > 1;
            ``dflash2/spec/tree.py``); the acceptance figures count each tree row as the chain of its depth.
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
    drafted_by_source: dict[str, int] = field(default_factory=dict)
    accepted_by_source: dict[str, int] = field(default_factory=dict)
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
    num_tree_nodes: int = 0
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
