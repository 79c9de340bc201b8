"""The commit phase of a step: the accepted tokens into each request (stops, grammar, logprobs), the KV
caches rolled back to what was committed, the counts, and one ``RequestOutput`` per request."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from dflash2.config import EngineSpec
from dflash2.engine.drafter_context import MAX_PENDING_CONTEXT, write_context
from dflash2.engine.executor import Prefilled
from dflash2.engine.plan import DraftSource, Verified
from dflash2.engine.policy import SpeculationPolicy
from dflash2.engine.request import Request
from dflash2.outputs import FinishReason, RequestOutput, StepStats, TokenLogprob
from dflash2.runner import ModelRunner

logger = logging.getLogger(__name__)


class Postprocessor:
    """Commits what a step's forwards decided.

    Args:
        spec: the engine's resolved settings; runner: writes the committed drafter context;
        policy: learns from each verify outcome; eos_token_ids: ids that end a request;
        probing: True while the thread governor tries another thread count (a step's timings then do
            not describe the cost table's).
    """

    def __init__(
        self,
        spec: EngineSpec,
        runner: ModelRunner,
        policy: SpeculationPolicy,
        eos_token_ids: tuple[int, ...],
        probing: Callable[[], bool],
    ) -> None:
        self.spec, self.runner, self.policy, self.eos_token_ids = spec, runner, policy, eos_token_ids
        self.probing = probing

    def prefill(self, requests: list[Request], result: Prefilled, stats: StepStats) -> list[RequestOutput]:
        """Commit the prompts and each request's first token."""
        stats.grammar_time += result.grammar_seconds
        stats.num_prefills += len(requests)
        stats.num_prefill_tokens += sum(len(r.prompt_ids) for r in requests)
        stats.num_prefix_cache_queries += sum(len(r.prompt_ids) for r in requests)
        stats.num_prefix_cache_hits += sum(r.num_cached_prompt_tokens for r in requests)
        outputs = []
        for i, request in enumerate(requests):
            request.num_cached = len(request.prompt_ids)
            logprob_rows = result.logits[i, :1] if request.params.logprobs is not None else None
            committed = self.commit_tokens(request, [result.first_ids[i]], logprob_rows, stats)
            outputs.append(output(request, *committed))
        return outputs

    def decode(self, rows: list[Request], verified: Verified, stats: StepStats) -> list[RequestOutput]:
        """Roll back each row to its accepted prefix, apply stops, count, learn, and keep the committed
        tokens' features as drafter context."""
        self._step_stats(len(rows), verified, stats)
        outputs = []
        for i, (request, acc) in enumerate(zip(rows, verified.num_accepted)):
            # Keep the anchor and the accepted drafts; the new anchor (bonus or correction) is not cached yet.
            request.num_cached += acc + 1
            emitted = [*verified.draft_lists[i][:acc], verified.next_ids[i]]
            logprob_rows = verified.logits[i, : acc + 1] if request.params.logprobs is not None else None
            committed, text, logprobs = self.commit_tokens(request, emitted, logprob_rows, stats)
            _count_acceptance(request, acc, len(committed), _draft_sources(verified, i), stats)
            outputs.append(output(request, committed, text, logprobs))  # cumulative counts include this step
        self.policy.learn(rows, verified, self.probing())
        if self.spec.speculative and verified.features is not None:
            self._keep_context(rows, verified)
        return outputs

    def _step_stats(self, num_rows: int, verified: Verified, stats: StepStats) -> None:
        """The decode step's phase times and plan into ``stats``, its timings into the cost table."""
        plan = verified.plan
        stats.num_decode_rows += num_rows
        stats.draft_time += verified.draft_seconds
        stats.select_time += verified.select_seconds
        stats.select_in_draft = stats.select_in_draft or verified.select_in_draft
        stats.verify_time += verified.verify_seconds
        stats.grammar_time += verified.grammar_seconds
        stats.predicted_tokens += plan.predicted_tokens
        num_drafts = verified.drafts_per_row
        stats.verify_width, stats.draft_lengths = max(num_drafts) + 1, list(num_drafts)
        if plan.source is DraftSource.LOOKUP:
            stats.num_lookup_drafts += sum(1 for n in num_drafts if n)
        stats.num_tree_nodes += verified.tree_nodes
        if self.spec.speculative and not stats.drafted_per_position:
            stats.accepted_per_position = [0] * (self.spec.block_size - 1)
            stats.drafted_per_position = [0] * (self.spec.block_size - 1)

    def _keep_context(self, rows: list[Request], verified: Verified) -> None:
        """The anchor's and accepted drafts' features become drafter context (docs/dflash2-spec.md §5.4),
        written when the row drafts next (a step without drafts needs none) or when it ends. One copy of the
        committed rows for the whole step (a CUDA graph overwrites its outputs at the next replay); each
        request keeps a view of its part."""
        assert verified.features is not None
        device = verified.features.device
        counts = [acc + 1 for acc in verified.num_accepted]
        offsets = torch.arange(verified.features.shape[1], device=device)
        keep = offsets[None] < torch.tensor(counts, device=device)[:, None]
        kept = verified.features[keep].split(counts)
        for i, request in enumerate(rows):
            if request.finish_reason is not FinishReason.ABORT:
                request.pending_context.add(verified.starts[i], kept[i])
        write_context(self.runner, [r for r in rows if r.pending_context.num_tokens >= MAX_PENDING_CONTEXT])

    def commit_tokens(
        self, request: Request, token_ids: list[int], logits: torch.Tensor | None, stats: StepStats
    ) -> tuple[list[int], str, list[TokenLogprob] | None]:
        """Append tokens up to the first stop; returns the committed tokens, text and logprobs.

        Stops, in order for each token: a stop string it completes (or a repeated unit, see
        ``SamplingParams.repeat_marker``), a stop token id, EOS (unless ``ignore_eos``), ``max_tokens``,
        the end of the request's grammar. Tokens after the stop are dropped with their text and logprobs.
        """
        params = request.params
        grammar_reason = None
        if request.matcher is not None:  # a completed grammar ends the block (and the request) first
            token_ids, grammar_reason = advance_grammar(request, token_ids)
        # The first token that ends the request by its id or by the length limit, if any.
        end = len(token_ids)
        reason: tuple[FinishReason, str | int | None] | None = None
        for i, token in enumerate(token_ids):
            if token in params.stop_token_ids:
                end, reason = i + 1, (FinishReason.STOP, token)
            elif token in self.eos_token_ids and not params.ignore_eos:
                end, reason = i + 1, (FinishReason.STOP, None)
            elif len(request.output_ids) + i + 1 >= params.max_tokens:
                end, reason = i + 1, (FinishReason.LENGTH, None)
            if reason is not None:
                break
        reason = reason or grammar_reason
        committed = token_ids[:end]
        text = ""
        if request.detokenizer is not None:
            result = request.detokenizer.add_tokens(committed)
            text = result.text
            if result.stop_index is not None:  # a stop string (or a repeat) at or before that token wins
                committed = committed[: result.stop_index + 1]
                reason = (FinishReason.STOP, result.stop_string)
        request.output_ids.extend(committed)
        if reason is not None:
            request.finish_reason, request.stop_reason = reason
            if request.detokenizer is not None and not isinstance(request.stop_reason, str):
                text += request.detokenizer.flush()  # release text held back for a stop string that never came
        logprobs = token_logprobs(committed, logits, params.logprobs) if logits is not None else None
        stats.num_generated_tokens += len(committed)
        return committed, text, logprobs


def advance_grammar(
    request: Request, token_ids: list[int]
) -> tuple[list[int], tuple[FinishReason, str | int | None] | None]:
    """Advance the request's matcher token by token; returns the tokens it took and why it ended.

    A grammar that completes (``is_stopped``: nothing may follow) ends the request there with ``stop``,
    so where the block boundaries fall never changes the output; with ``length`` when a token was
    sampled under the budget rule (the budget, not the model, closed it). Every token was sampled under
    the masks, so a refusal is a bug: logged, and that request alone ends (``abort``).
    """
    matcher = request.matcher
    assert matcher is not None
    for i, token in enumerate(token_ids):
        if not matcher.consume_token(token) or matcher.is_error():
            error = matcher.get_error()
            logger.error("request %s: the grammar refused a committed token: %s", request.request_id, error)
            return token_ids[:i], (FinishReason.ABORT, None)
        if request.closing_from is not None and i >= request.closing_from:
            request.budget_closed = True
        if matcher.is_stopped():
            reason = FinishReason.LENGTH if request.budget_closed else FinishReason.STOP
            return token_ids[: i + 1], (reason, None)
    return token_ids, None


def token_logprobs(token_ids: list[int], logits: torch.Tensor, num_top: int | None) -> list[TokenLogprob]:
    """Raw target log-probabilities of the committed tokens: ``logits [≥n, V]``, the top ``num_top``
    alternatives of each."""
    n = len(token_ids)
    logprobs = torch.log_softmax(logits[:n].float(), dim=-1)
    chosen = logprobs.gather(-1, torch.tensor(token_ids, device=logits.device)[:, None])[:, 0].tolist()
    top_values, top_ids = logprobs.topk(num_top or 1, dim=-1)
    out = []
    for i, token in enumerate(token_ids):
        top = list(zip(top_ids[i].tolist(), top_values[i].tolist()))[: num_top or 0]
        out.append(TokenLogprob(token, chosen[i], top))
    return out


def _draft_sources(verified: Verified, row: int) -> list[DraftSource]:
    """Where each of a row's verified drafts came from (a tree row: along its accepted path, then the rest of
    its depth as the drafter's): the grammar where it forced the draft, else the step's source (a free-draft
    step's row source; on a tree step the nodes after the drafter's accepted ones are the branch's)."""
    plan = verified.plan
    num_drafts = verified.drafts_per_row[row]
    sources = [plan.source_of(row)] * num_drafts
    if verified.tree_accepted is not None and plan.row_sources is not None and plan.branches is not None:
        branch = plan.row_sources[row]
        for j in range(verified.tree_accepted[row], min(verified.num_accepted[row], num_drafts)):
            sources[j] = branch
    if verified.forced is not None:
        sources = [DraftSource.GRAMMAR if f else s for s, f in zip(sources, verified.forced[row])]
    return sources


def _count_acceptance(
    request: Request, acc: int, num_committed: int, sources: list[DraftSource], stats: StepStats
) -> None:
    """Count only the accepted prefix that was committed (a stop may truncate the block); ``sources``: where
    each verified draft came from."""
    num_drafts = len(sources)
    accepted = min(acc, num_committed)
    request.num_verify_steps += 1
    request.num_draft_tokens += num_drafts
    request.num_accepted_tokens += accepted
    stats.acceptance_lengths.append(num_committed)
    for source in sources[:accepted]:
        request.accepted_by_source[source.value] = request.accepted_by_source.get(source.value, 0) + 1
        stats.accepted_by_source[source.value] = stats.accepted_by_source.get(source.value, 0) + 1
    for source in sources:
        stats.drafted_by_source[source.value] = stats.drafted_by_source.get(source.value, 0) + 1
    if num_drafts:
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += accepted
        for position in range(num_drafts):
            stats.drafted_per_position[position] += 1
        for position in range(accepted):
            stats.accepted_per_position[position] += 1


def output(request: Request, token_ids: list[int], text: str, logprobs: list[TokenLogprob] | None) -> RequestOutput:
    """The request's ``RequestOutput`` for this step: the delta and its cumulative counts."""
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=token_ids,
        new_text=text,
        finished=request.is_finished,
        finish_reason=request.finish_reason.value if request.finish_reason else None,
        stop_reason=request.stop_reason,
        new_logprobs=logprobs,
        num_prompt_tokens=len(request.prompt_ids),
        num_output_tokens=request.num_output_tokens,
        num_draft_tokens=request.num_draft_tokens,
        num_accepted_tokens=request.num_accepted_tokens,
        num_verify_steps=request.num_verify_steps,
        num_cached_tokens=request.num_cached_prompt_tokens,
        accepted_by_source=dict(request.accepted_by_source),
    )


def error_output(request: Request, message: str) -> RequestOutput:
    """A request's last output when it ends with an engine error (nothing committed this step)."""
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=[],
        new_text="",
        finished=True,
        finish_reason=FinishReason.ABORT.value,
        stop_reason=None,
        new_logprobs=None,
        num_prompt_tokens=len(request.prompt_ids),
        num_output_tokens=0,
        num_draft_tokens=0,
        num_accepted_tokens=0,
        num_verify_steps=0,
        error=message,
    )
