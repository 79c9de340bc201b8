"""The speculative engine: continuous batching over the DFlash 2 draft–select–verify step.

One ``Engine.step`` reads like the algorithm (docs/engine.md; docs/dflash2-spec.md §9):

    schedule     admit waiting requests into KV slots (prefix cache)       engine/scheduler.py
    prefill      their prompts, and each one's first token                 engine/executor.py
    plan         where this step's drafts come from and how many           engine/policy.py
    run          each row's proposal as a token tree, ONE verify, accept   engine/executor.py
    postprocess  commit accepted tokens, learn, outputs                    engine/postprocess.py
    release      finished requests free their slots                        engine/scheduler.py

A request that fails ends alone (:meth:`Engine._isolated`); the others get exactly their tokens.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from dflash2.config import EngineConfig, EngineSpec, resolve_spec
from dflash2.engine.executor import StepExecutor
from dflash2.engine.intake import encode, new_request
from dflash2.engine.policy import SpeculationPolicy, seeded
from dflash2.engine.postprocess import Postprocessor, error_output, output
from dflash2.engine.prefix_cache import PrefixCache
from dflash2.engine.request import Request
from dflash2.engine.scheduler import Scheduler
from dflash2.errors import EngineClosedError
from dflash2.grammar import GrammarBackend
from dflash2.models.base import Target
from dflash2.models.drafter import DEFAULT_TOP_K, DFlashDrafter
from dflash2.models.layers import batch_invariant
from dflash2.outputs import FinishReason, RequestOutput, StepResult, StepStats
from dflash2.platform import CpuLoad
from dflash2.runner import ModelRunner, RunnerSpec
from dflash2.runner.background import BackgroundCompiler, CompileStatus, compile_job
from dflash2.runner.tensor_parallel import TensorParallelError, TensorParallelGroup
from dflash2.runner.tensor_parallel_worker import start_workers
from dflash2.sampling import SamplingParams
from dflash2.threads import ThreadGovernor

logger = logging.getLogger(__name__)
Result = TypeVar("Result")

# What Engine.close() lets go of: the models, their caches and compiled graphs, and the step's parts
# that hold them (the prefix cache among them).
_RELEASED = (
    "target",
    "drafter",
    "tokenizer",
    "grammar",
    "runner",
    "scheduler",
    "policy",
    "prefix_cache",
    "executor",
    "postprocess",
    "threads",
)


def _check_tensor_parallel(config: EngineConfig) -> None:
    """Raise ``ValueError`` when ``config.model`` cannot be split over ``config.tensor_parallel_size`` ranks
    (read from its ``config.json``: a family the project decodes itself, heads that split)."""
    from dflash2.models import loader, source
    from dflash2.models.llama import SUPPORTED_MODEL_TYPES
    from dflash2.models.tensor_parallel import check_shardable

    hf_config = loader.load_hf_config(source.resolve_model(config.model))
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"--tensor-parallel-size needs a target the project decodes itself ({', '.join(SUPPORTED_MODEL_TYPES)}), "
            f"not {hf_config.model_type!r} (which runs through the transformers fallback)"
        )
    check_shardable(hf_config, config.tensor_parallel_size)


class Engine:
    """Synchronous engine: ``add_request`` / ``abort`` from any thread, ``step`` on one thread.

    Args:
        config: the frozen engine configuration (resolved against the models into ``self.spec``).
        target: a loaded target (``TargetModel`` or the transformers fallback).
        tokenizer: Hugging Face tokenizer, or None (then no text and no stop strings).
        drafter: a drafter bound to the target, or None (autoregressive decoding only).
        eos_token_ids: ids that end a request unless ``ignore_eos``.
        model_name: the name reported to clients.
        tensor_parallel: rank 0's group when ``target`` is its shard of a tensor-parallel target
            (:meth:`from_config` starts it; ``dflash2/runner/tensor_parallel.py``); the engine closes it in
            :meth:`close`.

    Lifetime: :meth:`close` (or ``with Engine.from_config(...) as engine:``) stops the engine's processes
    and releases its models and caches; after it, every method but :meth:`close` raises
    :class:`~dflash2.errors.EngineClosedError`. An engine dropped without ``close`` stops its processes
    when it is garbage-collected.

    Raises:
        ValueError: settings the models cannot run (``dflash2.config.resolve_spec``; deterministic mode
            where it cannot hold).
    """

    def __init__(
        self,
        config: EngineConfig,
        target: Target,
        tokenizer: Any | None,
        drafter: DFlashDrafter | None,
        eos_token_ids: Sequence[int] = (),
        model_name: str = "model",
        tensor_parallel: TensorParallelGroup | None = None,
    ) -> None:
        self._closed = False
        self.config, self.target, self.tokenizer, self.drafter = config, target, tokenizer, drafter
        self.tensor_parallel = tensor_parallel
        self.eos_token_ids, self.model_name = tuple(eos_token_ids), model_name
        self.spec: EngineSpec = resolve_spec(config, target, drafter)
        spec = self.spec
        self.grammar = GrammarBackend(tokenizer, spec.vocab_size) if tokenizer is not None else None
        self._cpu_load: CpuLoad | None = None
        self.threads = self._thread_governor()
        max_threads = torch.get_num_threads()  # before settle() lowers it on busy cores
        if self.threads is not None:
            self.threads.settle()  # start-up (compiling, timing step costs) at a count that fits the free cores
        runner_spec = RunnerSpec(
            spec.max_num_seqs,
            spec.max_model_len,
            spec.block_size,
            enforce_eager=config.enforce_eager,
            deterministic=config.deterministic,
            dynamic_threads=self.threads is not None,
            use_selector=config.use_selector,
            tree_nodes=spec.tree_nodes,
            defer_compile=config.background_compile,
        )
        self.runner = ModelRunner(target, drafter if spec.speculative else None, runner_spec, tensor_parallel)
        self.compiler: BackgroundCompiler | None = None  # the compile worker while it runs
        self._compile_status = self._initial_compile_status()
        if self.runner.graphs_deferred:
            job = compile_job(config, spec.max_model_len, max_threads, self.threads is not None)
            self.compiler = BackgroundCompiler(job)
            self._compile_status = CompileStatus("compiling")
            if self._cpu_load is not None:  # it runs only on otherwise idle cores: not a neighbour to yield to
                self._cpu_load.exclude(self.compiler.pid)
        self._costs_stale = False  # the cost table was timed on forwards that are no longer in use
        self.policy = SpeculationPolicy(spec, self.runner, quick=self.compiler is not None)
        prefix = config.enable_prefix_caching and self.runner.supports_prefix_copy
        self.prefix_cache = PrefixCache(spec.max_num_seqs, enabled=prefix)
        self.scheduler = Scheduler(spec.max_num_seqs, self.runner, self.prefix_cache)
        self.executor = StepExecutor(spec, self.runner, self.grammar, self.eos_token_ids)
        probing = lambda: self.threads is not None and self.threads.probing  # noqa: E731
        self.postprocess = Postprocessor(spec, self.runner, self.policy, self.eos_token_ids, probing)
        self._seed_source = torch.Generator().manual_seed(config.seed)
        self._inbox: deque[tuple[str, Any]] = deque()
        self._lock = threading.Lock()
        logger.info(
            "KV caches for %d slots x %d tokens: target %.1f MiB, drafter context %.1f MiB; block size %d",
            spec.max_num_seqs,
            spec.max_model_len,
            self.runner.target_cache.nbytes / 2**20,
            (self.runner.draft_cache.nbytes if self.runner.draft_cache is not None else 0) / 2**20,
            spec.block_size,
        )

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        """Load target, tokenizer and drafter as ``config`` says (``dflash2.runner.model_setup.load_models``); with
        ``tensor_parallel_size`` N > 1, start the N − 1 worker ranks first (:class:`TensorParallelGroup`).

        Raises:
            dflash2.models.source.ModelSourceError / dflash2.models.loader.ModelLoadError: with
                a message that says what to do.
        """
        from dflash2.runner.model_setup import load_models

        if config.tensor_parallel_size == 1:
            m = load_models(config)
            return cls(config, m.target, m.tokenizer, m.drafter, m.eos_token_ids, m.model_name)
        _check_tensor_parallel(config)  # before any process starts
        group = start_workers(config)
        try:
            m = load_models(config, shard=group.shard)
            return cls(config, m.target, m.tokenizer, m.drafter, m.eos_token_ids, m.model_name, tensor_parallel=group)
        except BaseException as error:
            failure = group.failure
            group.close()
            if failure is not None and not isinstance(error, (TensorParallelError, ValueError)):
                raise TensorParallelError(failure) from error  # a collective failed because a rank had gone
            raise

    def close(self) -> None:
        """Release what the engine holds: stop the compile worker and the tensor-parallel workers (and
        destroy their process group, so another tensor-parallel engine can start in this process), and let
        go of the models, the KV caches, the compiled graphs and the prefix cache. Queued and running
        requests are dropped without outputs. Idempotent; afterwards every other method raises
        :class:`~dflash2.errors.EngineClosedError`."""
        if self._closed:
            return
        self._closed = True
        compiler, self.compiler = self.compiler, None
        if compiler is not None:
            compiler.stop()
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()
        with self._lock:
            self._inbox.clear()
        for name in _RELEASED:
            self.__dict__.pop(name, None)
        if self.spec.device.type == "cuda":
            import gc

            gc.collect()  # the step's parts refer to each other: free them before returning the memory
            torch.cuda.empty_cache()

    @property
    def is_closed(self) -> bool:
        """True once :meth:`close` has run."""
        return self._closed

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    if not TYPE_CHECKING:  # mypy keeps checking attribute names; at run time this is reached only on a miss

        def __getattr__(self, name: str) -> Any:
            if name in _RELEASED and self.__dict__.get("_closed", False):
                raise EngineClosedError(f"the engine is closed (its {name} was released); build a new one")
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine is closed; build a new one")

    @property
    def fatal_error(self) -> str | None:
        """Why the engine cannot go on (a tensor-parallel rank has exited), or None."""
        return self.tensor_parallel.failure if self.tensor_parallel is not None else None

    def add_failure_listener(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(message)`` from another thread when :attr:`fatal_error` becomes set."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.add_failure_listener(listener)

    def _thread_governor(self) -> ThreadGovernor | None:
        """The thread-count chooser (CPU, more than one thread, not deterministic), or None."""
        threads = torch.get_num_threads()
        config = self.config
        if not config.adaptive_threads or self.spec.device.type != "cpu" or threads < 2 or config.deterministic:
            return None
        if self.tensor_parallel is not None:  # the workers keep theirs: ranks must run at the same pace
            return None
        load = self._cpu_load = CpuLoad()
        return ThreadGovernor(threads, set_threads=torch.set_num_threads, load=load.others, num_cpus=load.num_cpus)

    # ---- compiled forwards built in the background -------------------------------------------

    def _initial_compile_status(self) -> CompileStatus:
        runner = self.runner
        if runner.graphs_deferred:
            return CompileStatus("compiling")
        if runner.compile_failures:
            return CompileStatus("failed", len(runner.compile_times), error="; ".join(runner.compile_failures.values()))
        if not runner.compile_times:
            return CompileStatus("eager")
        return CompileStatus("compiled", len(runner.compile_times), runner.compile_seconds)

    @property
    def compile_status(self) -> CompileStatus:
        """Where the compiled forwards stand (``dflash2.runner.background.CompileStatus``)."""
        return self._compile_status

    @property
    def compile_pending(self) -> bool:
        """True while :meth:`poll_compile` has work: the compile worker runs, or the adaptive policy's step
        costs are to be timed again on the compiled forwards."""
        return self.compiler is not None or self._costs_stale

    def poll_compile(self, idle: bool = True) -> None:
        """Between steps (never inside one): once the compile worker has exited, load the graphs it saved
        and route the forwards to them (seconds; a graph that is missing or does not load leaves its
        forward eager, and a failed worker is logged as an error: the engine goes on serving eagerly).
        When ``idle`` (no request queued or running), also time the adaptive policy's step costs again
        on the compiled forwards; a request that arrives meanwhile interrupts that, and it is retried at
        the next idle moment. Never raises."""
        compiler = self.compiler
        if compiler is not None:
            code = compiler.poll()
            if code is None:
                return
            self.compiler = None
            self._install_compiled(compiler, code)
        if idle and self._costs_stale:
            try:
                self._costs_stale = not self.policy.retime(self.runner, interrupt=self.has_unfinished_requests)
            except Exception as error:  # keep the old table
                self._costs_stale = False
                logger.error("timing the step costs of the compiled forwards failed: %r", error)

    def _install_compiled(self, compiler: BackgroundCompiler, code: int) -> None:
        failure = compiler.failure(code) if code != 0 else None
        if failure is not None:
            logger.error("background compilation failed; serving with the eager forwards: %s", failure)
        start = time.perf_counter()
        try:
            with torch.inference_mode(False):
                failures = self.runner.load_deferred_graphs()
        except Exception as error:
            failures = {"all": f"{type(error).__name__}: {error}"}
        loading = time.perf_counter() - start
        num_graphs = len(self.runner.compile_times)
        if failure is None and failures:
            failure = "; ".join(f"{name}: {why}" for name, why in failures.items())
            logger.error(
                "loading the background-compiled graphs failed; serving eagerly where they did not load: %s", failure
            )
        seconds = time.monotonic() - compiler.started
        if failure is not None:
            self._compile_status = CompileStatus("failed", num_graphs, None, failure)
        else:
            self._compile_status = CompileStatus("compiled", num_graphs, seconds)
            logger.warning(
                "full speed: %d compiled graphs in use, %.0f s after compilation started (loaded in %.1f s)",
                num_graphs,
                seconds,
                loading,
            )
        self._costs_stale = num_graphs > 0 and self.policy.cost_model is not None

    # ---- what callers read ------------------------------------------------------------------

    block_size = property(lambda self: self.spec.block_size, doc="B, tokens per verify block (1: autoregressive).")
    max_model_len = property(lambda self: self.spec.max_model_len, doc="Positions per KV slot.")
    vocab_size = property(lambda self: self.spec.vocab_size, doc="The target's vocabulary size.")
    device = property(lambda self: self.spec.device, doc="Where the weights and caches live.")
    is_speculative = property(lambda self: self.spec.speculative, doc="True when steps draft blocks (B > 1).")
    prompt_lookup_max = property(lambda self: self.spec.prompt_lookup_max, doc="Longest lookup n-gram (0: off).")
    cost_model = property(lambda self: self.policy.cost_model, doc="The adaptive policy's step costs, or None.")

    @property
    def kv_cache_usage(self) -> float:
        """Fraction (0–1) of target KV positions holding running requests' committed tokens."""
        used = sum(r.num_cached for r in self.scheduler.running)
        return used / (self.spec.max_num_seqs * self.spec.max_model_len)

    @property
    def quantization(self) -> str:
        """How the target's linear weights are held: ``none``, ``int8``, ``int4`` or the GGUF types
        (``gguf:Q4_1+Q8_0``; ``dflash2.models.quantize.QuantizationReport.label``)."""
        report = getattr(self.runner.target, "quantization", None)
        return str(report.label) if report is not None else "none"

    @property
    def num_candidates(self) -> int:
        """Candidates per slot the drafted path is chosen from (the drafter's; spec §4)."""
        return self.drafter.num_candidates if self.drafter is not None else DEFAULT_TOP_K

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Validate and queue a request; thread-safe. Returns its id.

        Raises:
            ValueError / GrammarError / ContextLengthExceededError: see ``dflash2.engine.intake.new_request``.
            EngineClosedError: after :meth:`close`.
        """
        self._check_open()
        request = new_request(self.spec, self.tokenizer, self.grammar, prompt, params, request_id, self._seed_source)
        self.policy.start(request)
        with self._lock:
            self._inbox.append(("add", request))
        return request.request_id

    def abort(self, request_id: str) -> None:
        """Abort a queued or running request; its slot is freed at the start of the next step.

        Raises:
            EngineClosedError: after :meth:`close`.
        """
        self._check_open()
        with self._lock:
            self._inbox.append(("abort", request_id))

    def encode(self, text: str) -> list[int]:
        """Tokenize a prompt. Raises ValueError when the engine has no tokenizer."""
        return encode(self.tokenizer, text)

    def running_request_ids(self) -> list[str]:
        """Ids of the requests holding a KV slot (the ones a failed step was running)."""
        return [r.request_id for r in self.scheduler.running]

    def has_unfinished_requests(self) -> bool:
        """True while anything is queued, running or waiting in the inbox (False once closed)."""
        if self._closed:
            return False
        with self._lock:
            pending = bool(self._inbox)
        return pending or bool(self.scheduler.running) or bool(self.scheduler.waiting)

    # ---- the step -----------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> StepResult:
        """One engine iteration: schedule → prefill → plan → propose → verify → commit → emit.

        Raises:
            EngineClosedError: after :meth:`close`.
            TensorParallelError: a tensor-parallel rank has failed (the engine cannot go on).
        """
        self._check_open()
        if self.compiler is not None:
            self.poll_compile(idle=False)  # a step boundary: the compiled graphs may come in here
        if self.threads is not None:
            # A seeded request's text must not follow the load: while one is queued or running, steps run
            # at the configured count (the count decides how reductions are split, so their rounding).
            threads = self.threads.before_step(hold=self._has_seeded_work())
        else:
            threads = torch.get_num_threads() if self.spec.device.type == "cpu" else 0
        with batch_invariant() if self.config.deterministic else contextlib.nullcontext():
            result = self._step(StepStats(block_size=self.spec.block_size, num_threads=threads))
        if self.threads is not None:
            stats = result.stats
            comparable = stats.num_prefills == 0 and stats.num_decode_rows > 0
            shape = (stats.num_decode_rows, stats.verify_width) if comparable else None
            self.threads.after_step(shape, stats.total_time)
        return result

    def _step(self, stats: StepStats) -> StepResult:
        start = time.perf_counter()
        outputs = self._drain_inbox()
        admitted = self.scheduler.admit()
        if admitted:
            outputs += self._isolated(admitted, self.executor.prefill, self.postprocess.prefill, stats)
        rows = self.scheduler.decode_rows()
        if rows:
            decode = lambda rows: self.executor.decode(rows, self.policy.plan(rows))  # noqa: E731
            outputs += self._isolated(rows, decode, self.postprocess.decode, stats)
        for request in self.scheduler.running:  # a finished output joins the earlier-output index
            if request.is_finished and request.finish_reason is not FinishReason.ABORT:
                self.policy.finish(request)
        self.scheduler.release_finished()
        stats.total_time = time.perf_counter() - start
        stats.num_running, stats.num_waiting = self.scheduler.num_running, self.scheduler.num_waiting
        stats.kv_cache_usage = self.kv_cache_usage
        return StepResult(outputs, stats)

    def _has_seeded_work(self) -> bool:
        """True when a request with a seed is queued (inbox or waiting) or running."""
        with self._lock:
            if any(kind == "add" and item.params.seed is not None for kind, item in self._inbox):
                return True
        return seeded(self.scheduler.running) or seeded(self.scheduler.waiting)

    def _drain_inbox(self) -> list[RequestOutput]:
        with self._lock:
            items, self._inbox = list(self._inbox), deque()
        outputs: list[RequestOutput] = []
        for kind, item in items:
            if kind == "add":
                if self.scheduler.find(item.request_id) is not None:
                    outputs.append(error_output(item, f"duplicate request id {item.request_id!r}"))
                else:
                    self.scheduler.add(item)
            elif (request := self.scheduler.find(item)) is not None:
                request.finish_reason = FinishReason.ABORT
                self.scheduler.release(request)
                outputs.append(output(request, [], "", None))
        return outputs

    def _isolated(
        self,
        requests: list[Request],
        forward: Callable[[list[Request]], Result],
        commit: Callable[[list[Request], Result, StepStats], list[RequestOutput]],
        stats: StepStats,
    ) -> list[RequestOutput]:
        """``commit(requests, forward(requests))``, where one request's failure ends only that request.

        ``forward`` changes nothing but cache entries past the committed lengths (rewritten alike on a
        rerun), drafter context (written once) and the requests' generators, whose states are restored;
        everything a step counts is counted by ``commit``. When it raises for the batch, each request runs
        alone: the ones that fail again end with the error, the others get exactly the tokens they would
        have got (the same uniforms, the same target logits in float32).
        """
        # Greedy requests draw no uniforms: only sampled ones have generator state to restore.
        states = [None if r.params.is_greedy else r.generator.get_state() for r in requests]
        try:
            result = forward(requests)
        except Exception as error:
            self._raise_if_fatal(error)
            if len(requests) == 1:
                return [self._fail(requests[0], error)]
            logger.warning("a step over %d requests failed (%s); running each alone", len(requests), error)
            outputs = []
            for request, state in zip(requests, states):
                if state is not None:
                    request.generator.set_state(state)
                try:
                    alone = forward([request])
                except Exception as request_error:
                    self._raise_if_fatal(request_error)
                    outputs.append(self._fail(request, request_error))
                    continue
                outputs += commit([request], alone, stats)
            return outputs
        return commit(requests, result, stats)

    def _raise_if_fatal(self, error: Exception) -> None:
        """Re-raise an error that ends the engine, not one request: a tensor-parallel rank has failed."""
        if isinstance(error, TensorParallelError):
            raise error
        if self.fatal_error is not None:  # a collective saw the dead rank before this step's message did
            raise TensorParallelError(self.fatal_error) from error

    def _fail(self, request: Request, error: Exception) -> RequestOutput:
        """End one request with an engine error (its slot is released at the end of the step)."""
        logger.error("request %s failed in the engine: %r", request.request_id, error, exc_info=error)
        request.finish_reason = FinishReason.ABORT
        return error_output(request, f"{type(error).__name__}: {str(error)[:200]}")
