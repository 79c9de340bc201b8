"""The speculative engine: continuous batching over the DFlash 2 draft–select–verify step.

``Engine.step`` reads like the algorithm (DESIGN.md, spec §9): admit and prefill new
requests, draft one block for every running row in one drafter forward, walk the selector,
verify every row's block in one target forward, then accept, commit and roll back.

Dimension letters: R rows, B block size, J ≤ B−1 drafted slots (the step's verify width − 1), k candidates, V vocab,
F·H captured target features.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash2.adaptive import (
    AcceptanceEstimate,
    AcceptanceTracker,
    CostModel,
    WidthChoice,
    choose_lookup_width,
    choose_width,
)
from dflash2.config import EngineConfig
from dflash2.errors import ContextLengthExceededError
from dflash2.grammar import GrammarBackend
from dflash2.models.base import Target
from dflash2.models.drafter import DEFAULT_TOP_K, DFlashDrafter
from dflash2.models.layers import batch_invariant
from dflash2.prefix_cache import PrefixCache
from dflash2.prompt_lookup import PromptLookup
from dflash2.request import (
    FinishReason,
    Request,
    RequestOutput,
    StepResult,
    StepStats,
    TokenLogprob,
    mean_acceptance_length,
)
from dflash2.runner import ModelRunner, PendingWrites
from dflash2.sampling import (
    LogitsContext,
    SamplingParams,
    check_token_ids,
    process_logits,
    sample_from_probs,
    target_probs,
)
from dflash2.scheduler import Scheduler
from dflash2.selector import Proposal
from dflash2.threads import ThreadGovernor
from dflash2.verify import greedy_accept, rejection_accept

logger = logging.getLogger(__name__)


# Pending drafter context is written once a request holds this many positions of it, so a request that
# decodes without drafts for long keeps little memory and a later draft step little work.
MAX_PENDING_CONTEXT = 64
# Tokens of context each row has when the adaptive policy's step costs are timed at start-up: a chat
# request's prompt and some answer, so attention's share of the cost is not that of an empty cache.
COST_CONTEXT = 256


@dataclass
class _Verified:
    """What one verify forward decided, for the commit phase."""

    slots: list[int]
    starts: list[int]  # cached length of each row before the verify forward
    logits: torch.Tensor  # [R, L, V] raw target logits
    features: torch.Tensor | None  # [R, L, F·H]
    draft_lists: list[list[int]]
    num_drafts: list[int]
    num_accepted: list[int]
    next_ids: list[int]
    lookup: bool = False  # the drafts came from prompt lookup, not the drafter


class Engine:
    """Synchronous engine: ``add_request`` / ``abort`` from any thread, ``step`` on one thread.

    Args:
        config: the frozen engine configuration.
        target: a loaded target (``TargetModel`` or the transformers fallback).
        tokenizer: Hugging Face tokenizer, or None (then no text and no stop strings).
        drafter: a drafter bound to the target, or None (autoregressive decoding only).
        eos_token_ids: ids that end a request unless ``ignore_eos``.
        model_name: the name reported to clients.
    """

    def __init__(
        self,
        config: EngineConfig,
        target: Target,
        tokenizer: Any | None,
        drafter: DFlashDrafter | None,
        eos_token_ids: Sequence[int] = (),
        model_name: str = "model",
    ) -> None:
        self.config = config
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.eos_token_ids = tuple(eos_token_ids)
        self.model_name = model_name
        embed_weight = target.embedding_weights()[0]
        self.device: torch.device = embed_weight.device
        self.vocab_size = int(embed_weight.shape[0])
        self.grammar = GrammarBackend(tokenizer, self.vocab_size) if tokenizer is not None else None
        self.block_size = self._resolve_block_size()
        self.prompt_lookup_max = self._resolve_prompt_lookup()
        self.max_model_len = config.max_model_len or self._default_max_model_len()
        self.threads = self._thread_governor()
        if self.threads is not None:
            self.threads.settle()  # start-up (compiling, timing step costs) at a count that fits the free cores
        self.runner = ModelRunner(
            target,
            drafter if self.is_speculative else None,
            config.max_num_seqs,
            self.max_model_len,
            self.block_size,
            enforce_eager=config.enforce_eager,
            deterministic=config.deterministic,
            dynamic_threads=self.threads is not None,
            use_selector=config.use_selector,
        )
        self.scheduler = Scheduler(config.max_num_seqs)
        self.cost_model = self._measure_costs() if self.is_speculative and config.speculative_adaptive else None
        self.acceptance = AcceptanceTracker(self.block_size - 1)
        self.lookup_acceptance = AcceptanceTracker(self.block_size - 1)
        self.prefix_cache = PrefixCache(
            config.max_num_seqs, enabled=config.enable_prefix_caching and self.runner.supports_prefix_copy
        )
        self._seed_source = torch.Generator().manual_seed(config.seed)
        self._inbox: deque[tuple[str, Any]] = deque()
        self._lock = threading.Lock()
        self._log_memory()

    # ---- construction ---------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        """Resolve and load target, tokenizer and drafter as ``config`` says.

        Raises:
            dflash2.models.source.ModelSourceError / dflash2.models.loader.ModelLoadError: with
                a message that says what to do.
        """
        from dflash2.models import loader, source
        from dflash2.platform import configure_threads

        configure_threads(config.num_threads)
        folder = source.resolve_model(config.model)
        device, dtype = config.torch_device, config.torch_dtype
        tokenizer = loader.load_tokenizer(folder)
        target = loader.load_target(folder, dtype, device)
        drafter = None
        drafter_path = resolve_drafter_path(config)
        if config.block_size != 1:
            if drafter_path is not None:
                drafter = loader.load_drafter(
                    Path(drafter_path), target, dtype, device, config.speculative_draft_vocab_size
                )
            elif config.model is None:
                drafter = untrained_default_drafter(target, dtype, device)
                if config.speculative_draft_vocab_size is not None:
                    drafter.limit_draft_vocab(config.speculative_draft_vocab_size)
        name = source.EMBEDDED_MODEL_NAME if config.model is None else config.model
        return cls(config, target, tokenizer, drafter, loader.eos_token_ids(folder, tokenizer), name)

    def _resolve_block_size(self) -> int:
        if self.drafter is None:
            if self.config.block_size not in (None, 1):
                raise ValueError("block_size > 1 needs a drafter (pass a drafter path)")
            return 1
        if self.config.block_size is None:
            return self.drafter.config.block_size
        if self.config.block_size != self.drafter.config.block_size:
            logger.warning(
                "block size %d differs from the drafter's trained block size %d",
                self.config.block_size,
                self.drafter.config.block_size,
            )
        return self.config.block_size

    def _resolve_prompt_lookup(self) -> int:
        """The longest n-gram prompt lookup matches (0: off): on by default where the engine
        speculates adaptively (``EngineConfig`` rejects the flags without adaptive speculation); asked
        for explicitly without a drafter, a ``ValueError`` (before anything is compiled)."""
        adaptive = self.is_speculative and self.config.speculative_adaptive
        if self.config.prompt_lookup_requested and not adaptive:
            raise ValueError(
                "prompt lookup (--prompt-lookup-max/--prompt-lookup-min) runs beside a drafter: this engine does "
                "not speculate (block size 1 or no drafter); drop the prompt lookup flags"
            )
        return self.config.prompt_lookup_bounds[0] if adaptive else 0

    def _default_max_model_len(self) -> int:
        """The model's own context limit (``max_position_embeddings``), halved while the KV caches of
        every slot at that length would take more than half of the free memory (down to 2048)."""
        limit = int(getattr(self.target.config, "max_position_embeddings", 0) or 2048)
        per_token = self._kv_bytes_per_token() * (self.config.max_num_seqs + 1)  # + the scratch slot
        if self.device.type == "cuda":
            free: int | None = torch.cuda.mem_get_info(self.device)[0]
        else:
            from dflash2.platform import available_memory_bytes

            free = available_memory_bytes()
        length = limit
        while free is not None and length > 2048 and per_token * length > free // 2:
            length //= 2
        if length < limit:
            logger.warning(
                "max_model_len %d (the model's limit is %d, but %d slots at that length need %.1f GiB of KV "
                "cache and %.1f GiB is free); set --max-model-len to choose",
                length,
                limit,
                self.config.max_num_seqs,
                per_token * limit / 2**30,
                (free or 0) / 2**30,
            )
        return length

    def _kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token takes in one slot: target (+ drafter context)."""

        def per_token(config: Any, dtype: torch.dtype) -> int:
            heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
            head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
            return 2 * int(config.num_hidden_layers) * heads * head_dim * dtype.itemsize

        total = per_token(self.target.config, self.target.embedding_weights()[0].dtype)
        if self.drafter is not None and self.is_speculative:
            total += per_token(self.drafter.config, self.drafter.dtype)
        return total

    def _thread_governor(self) -> ThreadGovernor | None:
        """The thread-count chooser (CPU, more than one thread, not deterministic), or None."""
        threads = torch.get_num_threads()
        if not self.config.adaptive_threads or self.device.type != "cpu" or threads < 2 or self.config.deterministic:
            return None
        from dflash2.platform import CpuLoad

        load = CpuLoad()
        return ThreadGovernor(threads, set_threads=torch.set_num_threads, load=load.others, num_cpus=load.num_cpus)

    def _measure_costs(self) -> CostModel:
        """The adaptive policy's cost table: every verify width and the drafter's block, timed now at
        1, 2, 4, … rows up to ``max_num_seqs``, each row :data:`COST_CONTEXT` tokens in (a few seconds)."""
        start = time.perf_counter()
        slots = self.config.max_num_seqs
        row_counts = sorted({*(2**i for i in range(slots.bit_length()) if 2**i <= slots), slots})
        verify, draft = self.runner.measure_costs(row_counts, self.runner.verify_widths, context=COST_CONTEXT)
        model = CostModel(slots, self.runner.verify_widths)
        model.seed(verify, draft)
        logger.info(
            "adaptive speculation: step costs measured in %.1f s; ms per verify at 1 row by width: %s; "
            "drafter block + selector by width: %s",
            time.perf_counter() - start,
            ", ".join(f"{w}: {1000 * model.verify[(1, w)]:.1f}" for w in model.widths),
            ", ".join(f"{w}: {1000 * model.draft[(1, w)]:.1f}" for w in model.widths if w > 1),
        )
        return model

    @property
    def is_speculative(self) -> bool:
        """True when steps draft blocks (block size > 1)."""
        return self.block_size > 1

    @property
    def target_cache(self) -> Any:
        """The target's KV cache (owned by the runner)."""
        return self.runner.target_cache

    @property
    def draft_cache(self) -> Any:
        """The drafter's context cache (owned by the runner), or None without speculation."""
        return self.runner.draft_cache

    def _log_memory(self) -> None:
        target_bytes = self.target_cache.nbytes
        draft_bytes = self.draft_cache.nbytes if self.draft_cache is not None else 0
        logger.info(
            "KV caches for %d slots x %d tokens: target %.1f MiB, drafter context %.1f MiB; block size %d",
            self.config.max_num_seqs,
            self.max_model_len,
            target_bytes / 2**20,
            draft_bytes / 2**20,
            self.block_size,
        )

    # ---- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> str:
        """Validate and queue a request; thread-safe. Returns its id.

        Raises:
            ValueError: empty prompt, token ids outside the vocabulary (prompt, logit bias, stop
                ids), top_k above the vocabulary size, stop strings or a grammar without a tokenizer.
            dflash2.grammar.GrammarError: a grammar that does not compile (a ValueError).
            ContextLengthExceededError: prompt + max_tokens > max_model_len.
        """
        prompt_ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        check_token_ids(prompt_ids, self.vocab_size, "prompt")
        params.check_vocabulary(self.vocab_size)
        if (params.stop or params.repeat_marker) and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        if params.grammar is not None and self.grammar is None:
            raise ValueError("grammar: structured outputs need a tokenizer")
        matcher = self.grammar.matcher(params.grammar) if self.grammar and params.grammar is not None else None
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ContextLengthExceededError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(prompt_ids)} tokens and max_tokens is {params.max_tokens}"
            )
        request_id = request_id or uuid.uuid4().hex
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._seed_source))
        request = Request(
            request_id=request_id,
            prompt_ids=prompt_ids,
            params=params,
            generator=torch.Generator().manual_seed(seed),
            detokenizer=self._new_detokenizer(prompt_ids, params),
            matcher=matcher,
            acceptance=AcceptanceEstimate(list(self.acceptance.values)) if self.cost_model else None,
        )
        if self.prompt_lookup_max:
            request.lookup = PromptLookup(self.config.prompt_lookup_bounds[1], self.prompt_lookup_max, prompt_ids)
            request.lookup_acceptance = AcceptanceEstimate(list(self.lookup_acceptance.values))
        with self._lock:
            self._inbox.append(("add", request))
        return request_id

    def abort(self, request_id: str) -> None:
        """Abort a queued or running request; its slot is freed at the start of the next step."""
        with self._lock:
            self._inbox.append(("abort", request_id))

    def encode(self, text: str) -> list[int]:
        """Tokenize a prompt (no special tokens added beyond what the tokenizer adds by default).

        Raises:
            ValueError: when the engine has no tokenizer.
        """
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: pass token ids")
        return list(self.tokenizer.encode(text))

    def _new_detokenizer(self, prompt_ids: list[int], params: SamplingParams) -> Any:
        if self.tokenizer is None:
            return None
        from dflash2.detokenize import IncrementalDetokenizer

        return IncrementalDetokenizer(
            self.tokenizer,
            prompt_ids,
            stop=params.stop,
            skip_special_tokens=params.skip_special_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
            repeat_marker=params.repeat_marker,
        )

    def running_request_ids(self) -> list[str]:
        """Ids of the requests holding a KV slot (the ones a failed step was running)."""
        return [r.request_id for r in self.scheduler.running]

    def has_unfinished_requests(self) -> bool:
        """True while anything is queued, running or waiting in the inbox."""
        with self._lock:
            pending = bool(self._inbox)
        return pending or bool(self.scheduler.running) or bool(self.scheduler.waiting)

    # ---- the step -----------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> StepResult:
        """One engine iteration: schedule → prefill → draft → select → verify → commit → emit."""
        if self.threads is not None:
            # A seeded request's text must not follow the load: while one is queued or running, steps run
            # at the configured count (the count decides how reductions are split, so their rounding).
            threads = self.threads.before_step(hold=self._has_seeded_work())
        else:
            threads = torch.get_num_threads() if self.device.type == "cpu" else 0
        if self.config.deterministic:
            with batch_invariant():
                result = self._step(threads)
        else:
            result = self._step(threads)
        if self.threads is not None:
            stats = result.stats
            comparable = stats.num_prefills == 0 and stats.num_decode_rows > 0
            shape = (stats.num_decode_rows, stats.verify_width) if comparable else None
            self.threads.after_step(shape, stats.total_time)
        return result

    def _has_seeded_work(self) -> bool:
        """True when a request with a seed is queued (inbox or waiting) or running."""
        with self._lock:
            if any(kind == "add" and item.params.seed is not None for kind, item in self._inbox):
                return True
        return _seeded(self.scheduler.running) or _seeded(self.scheduler.waiting)

    def _step(self, threads: int) -> StepResult:
        start = time.perf_counter()
        stats = StepStats(block_size=self.block_size, num_threads=threads)
        outputs = self._drain_inbox()
        admitted = self.scheduler.admit(self._choose_slot)
        if admitted:
            outputs += self._isolated(admitted, self._prefill_forward, self._prefill_commit, stats)
        # Rows in slot order: when the running slots are contiguous (a full batch), the KV cache
        # reads are views instead of gathers.
        rows = sorted((r for r in self.scheduler.running if not r.is_finished), key=self._slot)
        if rows:
            outputs += self._isolated(rows, self._speculate, self._commit, stats)
        for request in [r for r in self.scheduler.running if r.is_finished]:
            self._release(request)
        stats.total_time = time.perf_counter() - start
        stats.num_running, stats.num_waiting = self.scheduler.num_running, self.scheduler.num_waiting
        stats.kv_cache_usage = self.kv_cache_usage
        return StepResult(outputs, stats)

    @property
    def num_candidates(self) -> int:
        """Candidates per slot the drafted path is chosen from (the drafter's; spec §4)."""
        return self.drafter.num_candidates if self.drafter is not None else DEFAULT_TOP_K

    @property
    def kv_cache_usage(self) -> float:
        """Fraction (0–1) of target KV positions holding committed tokens."""
        return self.runner.kv_cache_usage

    def _drain_inbox(self) -> list[RequestOutput]:
        with self._lock:
            items, self._inbox = list(self._inbox), deque()
        outputs: list[RequestOutput] = []
        for kind, item in items:
            if kind == "add":
                if self.scheduler.find(item.request_id) is not None:
                    outputs.append(_error_output(item, f"duplicate request id {item.request_id!r}"))
                else:
                    self.scheduler.add(item)
            else:
                request = self.scheduler.find(item)
                if request is not None:
                    request.finish_reason = FinishReason.ABORT
                    self._release(request)
                    outputs.append(self._output(request, [], "", None))
        return outputs

    def _choose_slot(self, request: Request, free_slots: list[int]) -> int:
        """Admission: the slot for ``request`` and the cached part of its prompt (copied here when it
        lives in another slot); ``request.num_cached`` is set to it."""
        running = {r.slot: r for r in self.scheduler.running if r.slot is not None}
        # Copy sources only matter with the cache on: no token lists are built on every admission otherwise.
        busy = {slot: _committed_tokens(r) for slot, r in running.items()} if self.prefix_cache.enabled else {}
        match = self.prefix_cache.choose(request.prompt_ids, free_slots, busy)
        if match.source is not None:
            if match.source in running:  # its drafter context must be complete before it is copied
                self._write_context([running[match.source]])
            self.runner.copy_prefix(match.source, match.slot, match.num_cached)
        else:
            self.runner.rollback(match.slot, match.num_cached)
        self.prefix_cache.assign(match.slot, request.prompt_ids, match.num_cached)
        request.num_cached = request.num_cached_prompt_tokens = match.num_cached
        return match.slot

    def _release(self, request: Request) -> None:
        """Free a finished request's slot; what it committed stays there for the prefix cache, unless it
        was aborted or failed (then nothing in the slot is trusted)."""
        if request.slot is not None:
            if request.finish_reason is FinishReason.ABORT:
                self.prefix_cache.clear(request.slot)
            else:
                if self.prefix_cache.enabled:
                    self._write_context([request])
                    self.prefix_cache.record(request.slot, _committed_tokens(request))
            self.runner.free(request.slot)
        request.pending_context.clear()
        self.scheduler.remove(request)

    def _write_context(self, requests: Sequence[Request]) -> None:
        """Write the drafter context still pending for ``requests`` (one batched call)."""
        pending = [r for r in requests if r.pending_context and r.slot is not None]
        writes = self._pending_writes(pending)
        if writes is None or self.drafter is None:
            return
        self.runner.append_context([self._slot(r) for r in pending], writes.starts, writes.features, writes.lengths)
        for request in pending:
            request.pending_context.clear()

    @staticmethod
    def _pending_writes(rows: Sequence[Request]) -> PendingWrites | None:
        """The drafter context ``rows`` committed since they last drafted, as one batch padded to the
        longest (a row with nothing pending has length 0), or None when no row has any."""
        segments = [r.pending_context.features() if r.pending_context else None for r in rows]
        some = next((s for s in segments if s is not None), None)
        if some is None:
            return None
        return PendingWrites(
            torch.nn.utils.rnn.pad_sequence([some[:0] if s is None else s for s in segments], batch_first=True),
            [r.pending_context.num_tokens for r in rows],
            [r.pending_context.start for r in rows],
        )

    # ---- per-request failure isolation ----------------------------------------------------------

    def _isolated(
        self,
        requests: list[Request],
        forward: Callable[[list[Request], StepStats], Any],
        commit: Callable[[list[Request], Any, StepStats], list[RequestOutput]],
        stats: StepStats,
    ) -> list[RequestOutput]:
        """``commit(requests, forward(requests))``, where one request's failure ends only that request.

        ``forward`` changes nothing but cache entries past the committed lengths (rewritten alike
        on a rerun) and the requests' generators, whose states are restored. When it raises for the
        batch, each request runs alone: the ones that fail again end with the error, the others
        get exactly the tokens they would have got (the same uniforms, the same target logits in
        float32).
        """
        # Greedy requests draw no uniforms (see _uniforms): only sampled ones have state to restore.
        states = [None if r.params.is_greedy else r.generator.get_state() for r in requests]
        try:
            result = forward(requests, stats)
        except Exception as error:
            if len(requests) == 1:
                return [self._fail(requests[0], error)]
            logger.warning("a step over %d requests failed (%s); running each alone", len(requests), error)
            outputs = []
            for request, state in zip(requests, states):
                if state is not None:
                    request.generator.set_state(state)
                try:
                    alone = forward([request], stats)
                except Exception as request_error:
                    outputs.append(self._fail(request, request_error))
                    continue
                outputs += commit([request], alone, stats)
            return outputs
        return commit(requests, result, stats)

    def _fail(self, request: Request, error: Exception) -> RequestOutput:
        """End one request with an engine error (its slot is released at the end of the step)."""
        logger.error("request %s failed in the engine: %r", request.request_id, error, exc_info=error)
        request.finish_reason = FinishReason.ABORT
        return _error_output(request, f"{type(error).__name__}: {str(error)[:200]}")

    # ---- prefill --------------------------------------------------------------------------------

    def _prefill_forward(self, requests: list[Request], stats: StepStats) -> tuple[torch.Tensor, list[int]]:
        """Run the prompts through the target, write drafter context and sample each first token:
        the logits ``[R, 1, V]`` and the first token ids."""
        slots = [self._slot(r) for r in requests]
        starts = [r.num_cached_prompt_tokens for r in requests]  # a cached prefix is not recomputed
        rest = [r.prompt_ids[start:] for r, start in zip(requests, starts)]
        logits, features = self.runner.prefill(slots, rest, starts)
        if features is not None:
            self.runner.append_context(slots, starts, features, [len(tokens) for tokens in rest])
        no_drafts = logits.new_zeros(len(requests), 0).long()
        allowed = self._grammar_masks(requests, [[] for _ in requests], 1, stats)
        probs = target_probs(logits, self._logits_context(requests), no_drafts, allowed)
        uniforms = torch.stack([self._uniforms(r, 1) for r in requests])[:, 0].to(self.device)
        return logits, sample_from_probs(probs[:, 0], uniforms).tolist()

    def _prefill_commit(
        self, requests: list[Request], result: tuple[torch.Tensor, list[int]], stats: StepStats
    ) -> list[RequestOutput]:
        """Commit the prompts and each request's first token."""
        logits, first_ids = result
        stats.num_prefills += len(requests)
        stats.num_prefill_tokens += sum(len(r.prompt_ids) for r in requests)
        stats.num_prefix_cache_queries += sum(len(r.prompt_ids) for r in requests)
        stats.num_prefix_cache_hits += sum(r.num_cached_prompt_tokens for r in requests)
        outputs = []
        for i, request in enumerate(requests):
            request.num_cached = len(request.prompt_ids)
            self.runner.rollback(self._slot(request), request.num_cached)
            logprob_rows = logits[i, :1] if request.params.logprobs is not None else None
            outputs.append(self._output(request, *self._commit_tokens(request, [first_ids[i]], logprob_rows, stats)))
        return outputs

    def _speculate(self, rows: list[Request], stats: StepStats) -> _Verified:
        """Draft, select and verify every row's block (the autoregressive step at block size 1, or
        when the adaptive policy chooses width 1)."""
        limits = self._num_drafts(rows)
        choice = self._choose_width(rows, limits)
        lookup = self._lookup_proposal(rows, limits, choice)
        if lookup is not None:  # drafts copied from the rows' own tokens: no drafter forward
            choice, proposal, limits = lookup
            stats.num_lookup_drafts += sum(1 for limit in limits if limit)
        width = self.block_size if choice is None else choice.width
        stats.predicted_tokens += 0.0 if choice is None else choice.predicted_tokens
        num_drafts = [min(limit, width - 1) for limit in limits]
        draft_before, verify_before = stats.draft_time + stats.select_time, stats.verify_time
        if lookup is None and self.is_speculative and width > 1:
            # A backlog of context (rows that decoded without drafts) is not part of the drafted step's
            # cost: it is due whenever the rows draft next, and charging it here would make each draft
            # after a pause look dearer, so the policy would pause longer. One step's worth is written
            # by the drafting forward itself (_draft).
            self._write_context([r for r in rows if r.pending_context.num_tokens > self.block_size])
            proposal = self._draft(rows, width, stats)
        elif lookup is None:
            proposal = self._no_proposal(len(rows))
        verified = self._verify(rows, proposal, num_drafts, stats)
        verified.lookup = lookup is not None
        stats.verify_width, stats.draft_lengths = max(num_drafts) + 1, num_drafts
        # A step at a probed thread count is not what the cost table describes.
        if self.cost_model is not None and not (self.threads is not None and self.threads.probing):
            self.cost_model.observe(
                len(rows),
                max(num_drafts) + 1,
                stats.verify_time - verify_before,
                None if verified.lookup else stats.draft_time + stats.select_time - draft_before,
            )
        return verified

    def _choose_width(self, rows: list[Request], limits: list[int]) -> WidthChoice | None:
        """The adaptive policy's choice of this step's verify width with the drafter (None: the full
        block, without the policy). A seeded request keeps the full block, so its text does not depend
        on timings (in bfloat16 the width changes the rounding)."""
        if self.cost_model is None or not self.is_speculative:
            return None
        return choose_width(
            [r.acceptance.values for r in rows],
            limits,
            self.cost_model.widths,
            self.cost_model.seconds,
            min_width=self.block_size if _seeded(rows) else 1,
        )

    def _lookup_proposal(
        self, rows: list[Request], limits: list[int], choice: WidthChoice | None
    ) -> tuple[WidthChoice, Proposal, list[int]] | None:
        """This step's prompt-lookup drafts (``dflash2/prompt_lookup.py``) when every row that may draft
        has one and the adaptive policy predicts more tokens per second from verifying them, with no drafter
        forward, than from its ``choice`` with the drafter: ``(choice, proposal, limits)``, the
        limits cut to each row's lookup draft; its proposal is one-hot on the copied tokens. None
        otherwise, when prompt lookup is off, and for a seeded row (its text must not depend on
        timings)."""
        if choice is None or not self.prompt_lookup_max or _seeded(rows):  # choice None: no adaptive policy
            return None
        assert self.cost_model is not None
        drafts = []
        for request, limit in zip(rows, limits):
            request.lookup.sync(request.output_ids)
            drafts.append(request.lookup.propose(limit))
        if not all(d for d, limit in zip(drafts, limits) if limit):
            return None
        lookup_limits = [len(d) for d in drafts]
        lookup = choose_lookup_width(
            [r.lookup_acceptance.values for r in rows],
            lookup_limits,
            self.cost_model.widths,
            self.cost_model.verify_seconds,
        )
        if not lookup.rates or lookup.rates[lookup.width] <= choice.rates.get(choice.width, 0.0):
            return None
        span = lookup.width - 1
        draft_ids = torch.tensor([(d + [d[-1] if d else 0] * span)[:span] for d in drafts], device=self.device)
        ones = torch.ones(len(rows), span, 1, device=self.device)
        return lookup, Proposal(draft_ids, draft_ids[..., None], ones), lookup_limits

    # ---- draft + select -------------------------------------------------------------------------

    def _num_drafts(self, rows: list[Request]) -> list[int]:
        """Drafts each row may verify: never past ``max_tokens`` or the end of its KV slot."""
        limit = self.block_size - 1
        return [max(0, min(limit, r.remaining_tokens - 1, self.max_model_len - r.num_cached - 1)) for r in rows]

    def _draft(self, rows: list[Request], width: int, stats: StepStats) -> Proposal:
        """Each row's drafted path over the step's ``width``-token block: ONE drafter forward from the
        rows' last tokens (the anchors), after writing the context they committed since they last
        drafted, then top-k candidates per slot, lattice scores (DFlash 2 selector) and the walk. On
        CPU one compiled graph does all of it, timed as drafting (``select_time`` stays 0)."""
        assert self.drafter is not None and self.draft_cache is not None
        start = time.perf_counter()
        anchors = torch.tensor([r.output_ids[-1] for r in rows], device=self.device)
        starts = torch.tensor([r.num_cached for r in rows], device=self.device)
        context = self._pending_writes(rows)
        temperatures = torch.tensor([r.params.temperature for r in rows], device=self.device)
        # B − 1 per row whatever the width: a row's random stream advances the same on every step.
        uniforms = self._step_uniforms(rows, self.block_size - 1)
        slots = [self._slot(r) for r in rows]
        if self.runner.draft_selects:
            proposal = self.runner.draft_proposal(slots, anchors, starts, temperatures, uniforms, width, context)
            stats.draft_time += self._phase_end() - start
            stats.select_in_draft = True
        else:
            hidden, logits = self.runner.draft(slots, anchors, starts, width, context)
            selecting = self._phase_end()
            stats.draft_time += selecting - start
            proposal = self.runner.propose(hidden, logits, anchors, temperatures, uniforms[:, : width - 1])
            stats.select_time += self._phase_end() - selecting
        for request in rows:
            request.pending_context.clear()
        return proposal

    def _phase_end(self) -> float:
        """``time.perf_counter()`` at the end of a timed phase of the step (a subclass that times a
        GPU's phases waits for their queued kernels first)."""
        return time.perf_counter()

    def _no_proposal(self, num_rows: int) -> Proposal:
        """The empty proposal of an autoregressive step (block size 1)."""
        empty = torch.zeros(num_rows, 0, dtype=torch.long, device=self.device)
        return Proposal(empty, empty[..., None], torch.zeros(num_rows, 0, 1, device=self.device))

    # ---- verify + commit ------------------------------------------------------------------------

    def _verify(self, rows: list[Request], proposal: Proposal, num_drafts: list[int], stats: StepStats) -> _Verified:
        """ONE target forward over every row's ``[anchor, drafts…]``, then rejection sampling."""
        start = time.perf_counter()
        width = max(num_drafts)  # rows near their limits verify shorter blocks
        draft_ids = proposal.draft_ids[:, :width]
        draft_lists = draft_ids.tolist()
        tokens = [[r.output_ids[-1], *draft_lists[i][: num_drafts[i]]] for i, r in enumerate(rows)]
        slots, starts = [self._slot(r) for r in rows], [r.num_cached for r in rows]
        logits, features = self.runner.verify(slots, tokens, starts)
        allowed = self._grammar_masks(rows, [t[1:] for t in tokens], width + 1, stats)
        drafts_per_row = torch.tensor(num_drafts, device=self.device)
        if all(r.params.is_greedy for r in rows):  # the same tokens, without the distributions
            processed = process_logits(logits, self._logits_context(rows), draft_ids, allowed)
            num_accepted, next_ids = greedy_accept(processed, draft_ids, drafts_per_row)
        else:
            probs = target_probs(logits, self._logits_context(rows), draft_ids, allowed)
            num_slots = self.block_size - 1
            uniforms = self._step_uniforms(rows, num_slots + 1)
            num_accepted, next_ids = rejection_accept(
                draft_ids,
                proposal.candidate_ids[:, :width],
                proposal.draft_probs[:, :width],
                probs,
                drafts_per_row,
                uniforms[:, :width],
                uniforms[:, num_slots],
            )
        stats.verify_time += time.perf_counter() - start
        return _Verified(
            slots, starts, logits, features, draft_lists, num_drafts, num_accepted.tolist(), next_ids.tolist()
        )

    def _commit(self, rows: list[Request], verified: _Verified, stats: StepStats) -> list[RequestOutput]:
        """Roll back each row to its accepted prefix, apply stops, count, and extend the drafter context."""
        stats.num_decode_rows += len(rows)
        if self.is_speculative and not stats.drafted_per_position:
            stats.accepted_per_position = [0] * (self.block_size - 1)
            stats.drafted_per_position = [0] * (self.block_size - 1)
        outputs = []
        for i, request in enumerate(rows):
            acc = verified.num_accepted[i]
            # Keep the anchor and the accepted drafts; the new anchor (bonus or correction) is not cached yet.
            request.num_cached += acc + 1
            self.runner.rollback(self._slot(request), request.num_cached)
            emitted = [*verified.draft_lists[i][:acc], verified.next_ids[i]]
            logprob_rows = verified.logits[i, : acc + 1] if request.params.logprobs is not None else None
            committed, text, logprobs = self._commit_tokens(request, emitted, logprob_rows, stats)
            self._count_acceptance(request, acc, len(committed), verified.num_drafts[i], stats)
            self._observe_acceptance(request, verified.num_drafts[i], acc, verified.lookup)
            outputs.append(self._output(request, committed, text, logprobs))  # cumulative counts include this step
        if self.cost_model is not None and (verified.lookup or not any(verified.num_drafts)):
            self.acceptance.idle_step()  # nothing observed: recover toward the long run (no lock-out)
        if self.prompt_lookup_max and not verified.lookup:
            self.lookup_acceptance.idle_step()
        if self.is_speculative and verified.features is not None:
            # The anchor's and accepted drafts' features become drafter context (spec §5.4), written
            # when the row drafts next (a step without drafts needs none) or when it ends.
            # One copy of the committed rows for the whole step (a CUDA graph overwrites its outputs at
            # the next replay); each request keeps a view of its part.
            counts = [acc + 1 for acc in verified.num_accepted]
            offsets = torch.arange(verified.features.shape[1], device=self.device)
            keep = offsets[None] < torch.tensor(counts, device=self.device)[:, None]
            kept = verified.features[keep].split(counts)
            for i, request in enumerate(rows):
                if request.finish_reason is not FinishReason.ABORT:
                    request.pending_context.add(verified.starts[i], kept[i])
            self._write_context([r for r in rows if r.pending_context.num_tokens >= MAX_PENDING_CONTEXT])
        return outputs

    def _observe_acceptance(self, request: Request, num_drafts: int, num_accepted: int, lookup: bool) -> None:
        """Fold a row's verify outcome into the adaptive policy's estimates for the source of its drafts
        (prompt lookup or the drafter); the other source's estimate relaxes toward its engine-wide one,
        so a row that stopped using a source tries it again later."""
        if request.acceptance is None:
            return
        if lookup:
            _fold(request.lookup_acceptance, self.lookup_acceptance, num_drafts, num_accepted)
            request.acceptance.relax(self.acceptance.values)
            return
        _fold(request.acceptance, self.acceptance, num_drafts, num_accepted)
        if request.lookup_acceptance is not None:
            request.lookup_acceptance.relax(self.lookup_acceptance.values)

    @staticmethod
    def _count_acceptance(request: Request, acc: int, num_committed: int, num_drafts: int, stats: StepStats) -> None:
        """Count only the accepted prefix that was committed (a stop may truncate the block)."""
        accepted = min(acc, num_committed)
        request.num_verify_steps += 1
        request.num_draft_tokens += num_drafts
        request.num_accepted_tokens += accepted
        stats.acceptance_lengths.append(num_committed)
        if num_drafts:
            stats.num_drafts += 1
            stats.num_draft_tokens += num_drafts
            stats.num_accepted_tokens += accepted
            for position in range(num_drafts):
                stats.drafted_per_position[position] += 1
            for position in range(accepted):
                stats.accepted_per_position[position] += 1

    def _commit_tokens(
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
            token_ids, grammar_reason = self._advance_grammar(request, token_ids)
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
        logprobs = self._logprobs(committed, logits, params.logprobs) if logits is not None else None
        stats.num_generated_tokens += len(committed)
        return committed, text, logprobs

    @staticmethod
    def _advance_grammar(
        request: Request, token_ids: list[int]
    ) -> tuple[list[int], tuple[FinishReason, str | int | None] | None]:
        """Advance the request's matcher token by token; returns the tokens it took and why it ended.

        A grammar that completes (``is_stopped``: nothing may follow) ends the request there with
        ``stop``, so where the block boundaries fall never changes the output; with ``length`` when a
        token was sampled under the budget rule (the budget, not the model, closed it). Every token was
        sampled under the masks, so a refusal is a bug: logged, and that request alone ends (``abort``).
        """
        matcher = request.matcher
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

    @staticmethod
    def _logprobs(token_ids: list[int], logits: torch.Tensor, num_top: int | None) -> list[TokenLogprob]:
        """Raw target log-probabilities of the committed tokens: ``logits [≥n, V]``."""
        n = len(token_ids)
        logprobs = torch.log_softmax(logits[:n].float(), dim=-1)
        chosen = logprobs.gather(-1, torch.tensor(token_ids, device=logits.device)[:, None])[:, 0].tolist()
        top_values, top_ids = logprobs.topk(num_top or 1, dim=-1)
        out = []
        for i, token in enumerate(token_ids):
            top = list(zip(top_ids[i].tolist(), top_values[i].tolist()))[: num_top or 0]
            out.append(TokenLogprob(token, chosen[i], top))
        return out

    def _output(
        self, request: Request, token_ids: list[int], text: str, logprobs: list[TokenLogprob] | None
    ) -> RequestOutput:
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
        )

    # ---- helpers ------------------------------------------------------------------------------

    def _grammar_masks(
        self, rows: list[Request], drafts: list[list[int]], num_positions: int, stats: StepStats
    ) -> torch.Tensor | None:
        """``[R, L, V]`` allowed-token masks along each row's drafts, or None when no row has a grammar."""
        if self.grammar is None or all(r.matcher is None for r in rows):
            return None
        start = time.perf_counter()
        closing: list[int | None] = []
        budgets = [r.remaining_tokens for r in rows]
        allowed = self.grammar.masks([r.matcher for r in rows], drafts, num_positions, budgets, closing)
        for request, first in zip(rows, closing):
            request.closing_from = first
        stats.grammar_time += time.perf_counter() - start
        return allowed

    def _logits_context(self, rows: list[Request]) -> LogitsContext:
        return LogitsContext(
            params=[r.params for r in rows],
            prompt_ids=[r.prompt_ids for r in rows],
            output_ids=[r.output_ids for r in rows],
            eos_token_ids=list(self.eos_token_ids),
        )

    def _step_uniforms(self, rows: list[Request], n: int) -> torch.Tensor:
        """``[R, n]`` uniforms, each row's from its own generator (zeros for greedy rows, which draw none)."""
        if all(r.params.is_greedy for r in rows):
            return torch.zeros(len(rows), n, device=self.device)
        return torch.stack([self._uniforms(r, n) for r in rows]).to(self.device)

    @staticmethod
    def _uniforms(request: Request, n: int) -> torch.Tensor:
        """``n`` uniforms from the request's own generator (none drawn for greedy requests)."""
        if request.params.is_greedy:
            return torch.zeros(n)
        return torch.rand(n, generator=request.generator)

    @staticmethod
    def _slot(request: Request) -> int:
        assert request.slot is not None
        return request.slot


def _fold(estimate: AcceptanceEstimate, tracker: AcceptanceTracker, num_drafts: int, num_accepted: int) -> None:
    """A row's verify outcome into its estimate and the engine-wide tracker; without drafts, the row's
    estimate relaxes toward the tracker's."""
    if num_drafts:
        estimate.observe(num_drafts, num_accepted)
        tracker.observe(num_drafts, num_accepted)
    else:
        estimate.relax(tracker.values)


def _seeded(rows: Iterable[Request]) -> bool:
    """True when a row has its own seed: its text must not depend on load or timings (a greedy one's too:
    in bfloat16 rounding can break a near-tie either way)."""
    return any(r.params.seed is not None for r in rows)


def _committed_tokens(request: Request) -> list[int]:
    """The tokens whose target KV and drafter context a request's slot holds: prompt + output, up to
    ``num_cached`` (the anchor, the last output token, is not in the cache yet)."""
    return [*request.prompt_ids, *request.output_ids][: request.num_cached]


def _error_output(request: Request, message: str) -> RequestOutput:
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


def default_drafter_path() -> Path | None:
    """The drafter shipped for the embedded default model, if this installation has one."""
    path = Path(__file__).parent / "assets" / "smollm2-135m-dflash2"
    return path if (path / "config.json").is_file() else None


def resolve_drafter_path(config: EngineConfig) -> str | Path | None:
    """The drafter folder a config asks for: ``config.drafter``, else the shipped one for the
    embedded default model, else None."""
    return config.drafter or (default_drafter_path() if config.model is None else None)


def untrained_default_drafter(target: Target, dtype: torch.dtype, device: torch.device) -> DFlashDrafter:
    """A randomly initialised DFlash 2 drafter shaped for the target (used until one is trained)."""
    from dflash2.models.drafter_factory import drafter_config_for_target

    logger.warning("no trained drafter found for the embedded model; using an untrained drafter (low acceptance)")
    drafter = DFlashDrafter(drafter_config_for_target(target.config))
    drafter.init_weights(seed=0)
    drafter.bind_target(*target.embedding_weights())
    return drafter.to(device=device, dtype=dtype).eval()


class LLM:
    """Offline convenience API: ``LLM().generate(prompts, params)`` and ``LLM().stream(...)``.

    Keyword arguments are ``EngineConfig`` fields (model, drafter, block_size, …).
    """

    def __init__(self, model: str | None = None, drafter: str | None = None, **kwargs: Any) -> None:
        self.engine = Engine.from_config(EngineConfig(model=model, drafter=drafter, **kwargs))

    @classmethod
    def from_engine(cls, engine: Engine) -> LLM:
        """Wrap an existing engine (tests build tiny ones directly)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    def stream(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[StepResult]:
        """Submit the prompts and yield every step's ``StepResult`` (deltas + ``StepStats``) until done."""
        yield from self._steps(self._submit(prompts, params))

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_step: Callable[[StepResult], None] | None = None,
    ) -> list[Completion]:
        """Generate to completion; returns one ``Completion`` per prompt, in order."""
        ids = self._submit(prompts, params)
        completions = {rid: Completion(request_id=rid) for rid in ids}
        for result in self._steps(ids):
            if on_step is not None:
                on_step(result)
            for output in result.outputs:
                completions[output.request_id].add(output)
        return [completions[rid] for rid in ids]

    def _steps(self, ids: list[str]) -> Iterator[StepResult]:
        """Step the engine until every request of ``ids`` has finished; outputs of others are dropped."""
        wanted, remaining = set(ids), set(ids)
        while remaining:
            result = self.engine.step()
            result.outputs = [o for o in result.outputs if o.request_id in wanted]
            remaining -= {o.request_id for o in result.outputs if o.finished}
            yield result

    def _submit(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[str]:
        batch: list[Any]
        if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int)):
            batch = [prompts]
        else:
            batch = list(prompts)
        params = params or SamplingParams()
        param_list = [params] * len(batch) if isinstance(params, SamplingParams) else list(params)
        if len(param_list) != len(batch):
            raise ValueError("pass one SamplingParams or one per prompt")
        return [self.engine.add_request(p, sp) for p, sp in zip(batch, param_list)]


@dataclass
class Completion:
    """The accumulated result of one request from ``LLM.generate``."""

    request_id: str
    text: str = ""
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    error: str | None = None

    def add(self, output: RequestOutput) -> None:
        """Fold one step's ``RequestOutput`` into the completion."""
        self.text += output.new_text
        self.token_ids = [*(self.token_ids or []), *output.new_token_ids]
        if output.new_logprobs is not None:
            self.logprobs = [*(self.logprobs or []), *output.new_logprobs]
        self.finish_reason, self.stop_reason, self.error = (
            output.finish_reason,
            output.stop_reason,
            output.error,
        )
        self.num_prompt_tokens = output.num_prompt_tokens
        self.num_cached_prompt_tokens = output.num_cached_tokens
        self.num_verify_steps = output.num_verify_steps
        self.num_draft_tokens = output.num_draft_tokens
        self.num_accepted_tokens = output.num_accepted_tokens

    @property
    def mean_acceptance_length(self) -> float:
        """Committed tokens per verify step (bonus included)."""
        return mean_acceptance_length(self.num_accepted_tokens, self.num_verify_steps)
