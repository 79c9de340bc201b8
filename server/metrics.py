"""Prometheus metrics: every name, type, unit, label and bucket in one table, fed from ``StepStats`` and
per-request timings.

Our names carry the ``dflash2_`` prefix and a ``model_name`` label. With ``--metrics-compat vllm`` the
same observations are also exported under vLLM's names (``vllm:…``) with its ``model_name`` and
``engine`` labels, so vLLM's Grafana dashboards and routers read them unchanged.

Counting conventions (the traps other engines fell into, decided here):

* speculative counters count *committed* tokens only: a stop inside an accepted block truncates
  the accepted counts too, and ``…_per_pos`` counts position i only when drafts 0..i were all
  accepted (the accepted prefix, never a plain sum of an accept mask);
* acceptance length includes the bonus token (τ = accepted drafts + 1 per verify step);
* inter-token latency is observed once per delivery: a speculative step that commits several
  tokens of a request counts as one interval;
* the per-request size and phase histograms (prompt, generation and ``max_tokens`` tokens; decode
  and inference time; time per output token) are observed once per finished request, whatever its
  finish reason, so their counts match ``request_success``; queue and prefill time are observed at
  the first token, like time to first token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from dflash2.outputs import DRAFT_SOURCE_NAMES, StepStats
from server.responses.store import EVICTION_REASONS

if TYPE_CHECKING:
    from dflash2.runner.background import CompileStatus
    from server.responses.store import ResponseStore
    from server.timings import RequestTimings

PREFIX = "dflash2_"
VLLM_PREFIX = "vllm:"
VLLM_ENGINE_LABEL = "0"
FINISH_REASONS = ("stop", "length", "abort", "error")

# Latency buckets follow vLLM's (wide, so one dashboard fits a CPU box and a GPU cluster).
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
# Time per output token: vLLM's inter-token buckets, plus finer ones below 10 ms for speculative decoding.
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, *ITL_BUCKETS)
TOKENS_PER_SECOND_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0)
# Tokens per request (prompt, generation, max_tokens): vLLM's 1-2-5 ladder, cut at the model's maximum length
# by token_count_buckets.
TOKEN_COUNT_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5,
                       5e5, 1e6, 2e6, 5e6, 1e7)
# Tokens per engine step: vLLM's powers of two (1, 8 … 16384), extended to a 128k-token prefill.
ITERATION_TOKENS_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
                            32768.0, 65536.0, 131072.0)
# Committed minus predicted tokens per row of an adaptive step (the policy's estimate error).
PREDICTION_ERROR_BUCKETS = (-4.0, -2.0, -1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0, 2.0, 4.0)
# fmt: on

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class MetricSpec:
    """One metric: our name (without prefix; counters without ``_total``), what it means, its labels.

    Attributes:
        labels: labels beyond ``model_name``.
        vllm_names: the vLLM names exported with ``--metrics-compat vllm`` (without ``vllm:``).
    """

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    vllm_names: tuple[str, ...] = ()


def token_count_buckets(max_model_len: int | None) -> tuple[float, ...]:
    """``TOKEN_COUNT_BUCKETS`` below ``max_model_len``, then ``max_model_len`` itself (so every request lands in
    a finite bucket); the whole ladder when the length is unknown."""
    if max_model_len is None:
        return TOKEN_COUNT_BUCKETS
    return (*(b for b in TOKEN_COUNT_BUCKETS if b < max_model_len), float(max_model_len))


def metric_specs(block_size: int, max_model_len: int | None = None) -> tuple[MetricSpec, ...]:
    """The table of every metric this server exports (acceptance-length buckets are 1..B; per-request token
    buckets end at ``max_model_len``)."""
    tokens = token_count_buckets(max_model_len)
    # fmt: off
    return (
        MetricSpec("spec_decode_num_drafts", "counter",
                   "Verify steps that checked at least one drafted token.", vllm_names=("spec_decode_num_drafts",)),
        MetricSpec("spec_decode_num_lookup_drafts", "counter",
                   "Verify steps (per row) whose drafts came from prompt lookup instead of the drafter; part of "
                   "spec_decode_num_drafts."),
        MetricSpec("spec_decode_num_tree_nodes", "counter",
                   "Drafted nodes verified as token trees (--speculative-topk > 1); the draft and acceptance "
                   "counters count each tree row as the chain of its depth."),
        MetricSpec("spec_decode_num_draft_tokens", "counter",
                   "Drafted tokens sent to verification.", vllm_names=("spec_decode_num_draft_tokens",)),
        MetricSpec("spec_decode_num_accepted_tokens", "counter",
                   "Accepted drafted tokens that were committed (bonus tokens not counted; a stop inside a block "
                   "truncates the count).", vllm_names=("spec_decode_num_accepted_tokens",)),
        MetricSpec("spec_decode_num_draft_tokens_by_source", "counter",
                   "Drafted tokens sent to verification, by where they came from: drafter, lookup (the request's "
                   "own tokens), suffix (earlier requests' outputs), grammar (forced by the request's grammar); "
                   "sums to spec_decode_num_draft_tokens.", labels=("source",)),
        MetricSpec("spec_decode_num_accepted_tokens_by_source", "counter",
                   "Accepted drafted tokens that were committed, by where they came from (the sources of "
                   "spec_decode_num_draft_tokens_by_source); sums to spec_decode_num_accepted_tokens.",
                   labels=("source",)),
        MetricSpec("spec_decode_num_accepted_tokens_per_pos", "counter",
                   "Committed acceptances per draft position: position i counts only when drafts 0..i were all "
                   "accepted.", labels=("position",), vllm_names=("spec_decode_num_accepted_tokens_per_pos",)),
        MetricSpec("prompt_tokens", "counter", "Prompt tokens of admitted requests (prefix-cache hits included).",
                   vllm_names=("prompt_tokens",)),
        MetricSpec("prefix_cache_queries", "counter",
                   "Prompt tokens looked up in the prefix cache (every admitted request's prompt).",
                   vllm_names=("prefix_cache_queries",)),
        MetricSpec("prefix_cache_hits", "counter",
                   "Prompt tokens served from the prefix cache (their KV reused, not recomputed).",
                   vllm_names=("prefix_cache_hits",)),
        MetricSpec("generation_tokens", "counter", "Output tokens committed.", vllm_names=("generation_tokens",)),
        MetricSpec("request_success", "counter",
                   "Finished requests by finish reason (stop, length, abort = client went away, error = engine "
                   "failure).", labels=("finished_reason",), vllm_names=("request_success",)),
        MetricSpec("model_info", "gauge",
                   "1, labelled with how the served model's linear weights are held (quantization: none, int8, "
                   "int4, or a GGUF file's types such as gguf:Q4_1+Q8_0).", labels=("quantization",)),
        MetricSpec("num_requests_running", "gauge", "Requests holding a KV slot after the last engine step.",
                   vllm_names=("num_requests_running",)),
        MetricSpec("num_requests_waiting", "gauge", "Requests queued for a KV slot after the last engine step.",
                   vllm_names=("num_requests_waiting",)),
        MetricSpec("kv_cache_usage_perc", "gauge",
                   "Fraction (0-1) of target KV-cache positions holding committed tokens.",
                   vllm_names=("kv_cache_usage_perc", "gpu_cache_usage_perc")),
        MetricSpec("num_stored_responses", "gauge",
                   "Responses API responses held by this replica's response store (retrievable by id and "
                   "continuable with previous_response_id)."),
        MetricSpec("stored_responses_bytes", "gauge",
                   "JSON bytes held by this replica's response store: each response counts its Response object and "
                   "every input item it was generated from (a continued conversation counts its whole history)."),
        MetricSpec("stored_responses_evicted", "counter",
                   "Stored responses dropped before anyone deleted them, by reason: expired (--responses-store-ttl), "
                   "max_entries or max_bytes (the store's bounds; max_bytes also counts a response larger than the "
                   "whole store, never kept).", labels=("reason",)),
        MetricSpec("cpu_threads", "gauge",
                   "torch CPU threads the last engine step ran with: fewer than --threads while other processes "
                   "keep the cores busy (adaptive threads); 0 on CUDA."),
        MetricSpec("compiled", "gauge",
                   "1 once the compiled decode forwards are in use (full speed); 0 while the server serves with "
                   "its eager forwards: the graphs are still compiling in the background, compilation failed, or "
                   "--enforce-eager."),
        MetricSpec("compiled_graphs", "gauge", "Compiled graphs in use (0 until they are)."),
        MetricSpec("compile_seconds", "gauge",
                   "Seconds from the start of compilation to the compiled graphs in use (0 until then)."),
        MetricSpec("compile_failed", "gauge",
                   "1 when compiling (or loading) the graphs failed and some forwards stay eager (the log says "
                   "why); the server goes on serving."),
        MetricSpec("spec_decode_draft_length", "histogram",
                   "Drafts each decode row verified per step (adaptive speculation chooses 0 … block size - 1).",
                   buckets=tuple(float(b) for b in range(0, block_size))),
        MetricSpec("spec_decode_prediction_error", "histogram",
                   "Per decode step with adaptive speculation: (tokens committed - tokens the policy predicted) / "
                   "rows.", buckets=PREDICTION_ERROR_BUCKETS),
        MetricSpec("acceptance_length", "histogram",
                   "Tokens committed per verify step, bonus token included (1 = no draft accepted).",
                   buckets=tuple(float(b) for b in range(1, block_size + 1))),
        MetricSpec("time_to_first_token_seconds", "histogram",
                   "Seconds from arrival to the first output token of a request.", buckets=TTFT_BUCKETS,
                   vllm_names=("time_to_first_token_seconds",)),
        MetricSpec("inter_token_latency_seconds", "histogram",
                   "Seconds between successive output deliveries of a request; a speculative step that commits "
                   "several tokens counts once (see generation_tokens_per_second for the per-token rate).",
                   buckets=ITL_BUCKETS, vllm_names=("inter_token_latency_seconds", "time_per_output_token_seconds")),
        MetricSpec("e2e_request_latency_seconds", "histogram", "Seconds from arrival to the end of a request.",
                   buckets=E2E_BUCKETS, vllm_names=("e2e_request_latency_seconds",)),
        MetricSpec("request_queue_time_seconds", "histogram",
                   "Seconds a request waited before the engine step that prefilled it began.",
                   buckets=TTFT_BUCKETS, vllm_names=("request_queue_time_seconds",)),
        MetricSpec("generation_tokens_per_second", "histogram",
                   "Per request: output tokens after the first, divided by the seconds from the first to the last "
                   "token (requests with at least two tokens).", buckets=TOKENS_PER_SECOND_BUCKETS),
        MetricSpec("request_prefill_time_seconds", "histogram",
                   "Seconds from the start of the engine step that prefilled a request to the delivery of its first "
                   "output token.", buckets=TTFT_BUCKETS, vllm_names=("request_prefill_time_seconds",)),
        MetricSpec("request_decode_time_seconds", "histogram",
                   "Per finished request: seconds from the delivery of its first output token to the delivery of "
                   "its last.", buckets=E2E_BUCKETS, vllm_names=("request_decode_time_seconds",)),
        MetricSpec("request_inference_time_seconds", "histogram",
                   "Per finished request: seconds from the start of the engine step that prefilled it to the "
                   "delivery of its last output token (prefill + decode).", buckets=E2E_BUCKETS,
                   vllm_names=("request_inference_time_seconds",)),
        MetricSpec("request_time_per_output_token_seconds", "histogram",
                   "Per finished request with at least two output tokens: decode seconds divided by (output "
                   "tokens - 1).", buckets=TPOT_BUCKETS, vllm_names=("request_time_per_output_token_seconds",)),
        MetricSpec("request_prompt_tokens", "histogram", "Per finished request: prompt tokens (count).",
                   buckets=tokens, vllm_names=("request_prompt_tokens",)),
        MetricSpec("request_generation_tokens", "histogram",
                   "Per finished request: output tokens committed (count; per choice when n > 1).", buckets=tokens,
                   vllm_names=("request_generation_tokens",)),
        MetricSpec("request_params_max_tokens", "histogram",
                   "Per finished request: the max_tokens limit the engine applied (count; the server's default "
                   "when the client sent none).", buckets=tokens, vllm_names=("request_params_max_tokens",)),
        MetricSpec("iteration_tokens_total", "histogram",
                   "Per engine step that processed tokens: prompt tokens computed (prefix-cache hits not "
                   "included) plus output tokens committed (count; rejected drafts not included).",
                   buckets=ITERATION_TOKENS_BUCKETS, vllm_names=("iteration_tokens_total",)),
    )
    # fmt: on


class _Family:
    """One metric as exported under our name and, optionally, its vLLM name; children cached by labels."""

    def __init__(self, spec: MetricSpec, registry: CollectorRegistry, model_name: str, compat: str | None) -> None:
        self._targets: list[tuple[MetricWrapperBase, dict[str, str]]] = [
            (_build(spec, PREFIX + spec.name, ("model_name", *spec.labels), registry), {"model_name": model_name})
        ]
        for vllm_name in spec.vllm_names if compat == "vllm" else ():
            metric = _build(spec, VLLM_PREFIX + vllm_name, ("model_name", "engine", *spec.labels), registry)
            self._targets.append((metric, {"model_name": model_name, "engine": VLLM_ENGINE_LABEL}))
        self._children: dict[tuple[tuple[str, str], ...], list[MetricWrapperBase]] = {}

    def children(self, **labels: str) -> list[MetricWrapperBase]:
        """The labelled children (one per exported name), created on first use."""
        key = tuple(sorted(labels.items()))
        if key not in self._children:
            self._children[key] = [metric.labels(**base, **labels) for metric, base in self._targets]
        return self._children[key]

    def inc(self, amount: float, **labels: str) -> None:
        """Add to a counter (nothing for 0)."""
        if amount:
            for child in self.children(**labels):
                child.inc(amount)  # type: ignore[attr-defined]

    def set(self, value: float, **labels: str) -> None:
        """Set a gauge."""
        for child in self.children(**labels):
            child.set(value)  # type: ignore[attr-defined]

    def set_function(self, read: Callable[[], float]) -> None:
        """Make a gauge read its value when scraped."""
        for child in self.children():
            child.set_function(read)  # type: ignore[attr-defined]

    def observe(self, value: float, **labels: str) -> None:
        """Observe a histogram value."""
        for child in self.children(**labels):
            child.observe(value)  # type: ignore[attr-defined]


def _build(spec: MetricSpec, name: str, labels: tuple[str, ...], registry: CollectorRegistry) -> MetricWrapperBase:
    if spec.kind == "counter":
        return Counter(name, spec.help, labels, registry=registry)
    if spec.kind == "gauge":
        return Gauge(name, spec.help, labels, registry=registry)
    return Histogram(name, spec.help, labels, registry=registry, buckets=spec.buckets)


class Metrics:
    """All server metrics for one model; implements the engine client's observer interface.

    ``on_step`` runs on the engine thread, the per-request hooks on the event loop; the
    prometheus client is thread-safe.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        block_size: int,
        compat: str | None = None,
        max_model_len: int | None = None,
        quantization: str = "none",
    ) -> None:
        specs = metric_specs(block_size, max_model_len)
        self.families = {spec.name: _Family(spec, registry, model_name, compat) for spec in specs}
        # Create the labelled children up front so every series is visible (at 0) from the start.
        for spec in specs:
            if not spec.labels:
                self.families[spec.name].children()
        for position in range(block_size - 1):
            self.families["spec_decode_num_accepted_tokens_per_pos"].children(position=str(position))
        for source in DRAFT_SOURCE_NAMES:
            self.families["spec_decode_num_draft_tokens_by_source"].children(source=source)
            self.families["spec_decode_num_accepted_tokens_by_source"].children(source=source)
        for reason in FINISH_REASONS:
            self.families["request_success"].children(finished_reason=reason)
        for reason in EVICTION_REASONS:
            self.families["stored_responses_evicted"].children(reason=reason)
        self.families["model_info"].set(1, quantization=quantization)

    def watch_compile(self, status: Callable[[], CompileStatus]) -> None:
        """Read the compile gauges from ``status()`` at every scrape (the engine's
        ``compile_status``: the switch to compiled graphs can happen while no step runs)."""
        f = self.families
        readers: dict[str, Callable[[], float]] = {
            "compiled": lambda: float(status().is_compiled),
            "compiled_graphs": lambda: float(status().num_graphs),
            "compile_seconds": lambda: status().seconds or 0.0,
            "compile_failed": lambda: float(status().state == "failed"),
        }
        for name, read in readers.items():
            for child in f[name].children():
                child.set_function(read)  # type: ignore[attr-defined]

    def on_step(self, stats: StepStats) -> None:
        """Counters, acceptance lengths, tokens per step and queue gauges from one engine step."""
        f = self.families
        f["spec_decode_num_drafts"].inc(stats.num_drafts)
        f["spec_decode_num_lookup_drafts"].inc(stats.num_lookup_drafts)
        f["spec_decode_num_tree_nodes"].inc(stats.num_tree_nodes)
        f["spec_decode_num_draft_tokens"].inc(stats.num_draft_tokens)
        f["spec_decode_num_accepted_tokens"].inc(stats.num_accepted_tokens)
        for position, count in enumerate(stats.accepted_per_position):
            f["spec_decode_num_accepted_tokens_per_pos"].inc(count, position=str(position))
        for source, count in stats.drafted_by_source.items():
            f["spec_decode_num_draft_tokens_by_source"].inc(count, source=source)
        for source, count in stats.accepted_by_source.items():
            f["spec_decode_num_accepted_tokens_by_source"].inc(count, source=source)
        for length in stats.acceptance_lengths:
            f["acceptance_length"].observe(length)
        for drafts in stats.draft_lengths if stats.block_size > 1 else ():
            f["spec_decode_draft_length"].observe(drafts)
        if stats.predicted_tokens and stats.draft_lengths:
            error = (sum(stats.acceptance_lengths) - stats.predicted_tokens) / len(stats.draft_lengths)
            f["spec_decode_prediction_error"].observe(error)
        f["prompt_tokens"].inc(stats.num_prefill_tokens)
        f["prefix_cache_queries"].inc(stats.num_prefix_cache_queries)
        f["prefix_cache_hits"].inc(stats.num_prefix_cache_hits)
        f["generation_tokens"].inc(stats.num_generated_tokens)
        computed = stats.num_prefill_tokens - stats.num_prefix_cache_hits + stats.num_generated_tokens
        if computed:
            f["iteration_tokens_total"].observe(computed)
        f["num_requests_running"].set(stats.num_running)
        f["num_requests_waiting"].set(stats.num_waiting)
        f["kv_cache_usage_perc"].set(stats.kv_cache_usage)
        f["cpu_threads"].set(stats.num_threads)

    def watch_response_store(self, store: ResponseStore) -> None:
        """Read the response store's size when scraped (expired responses dropped first)."""
        self.families["num_stored_responses"].set_function(lambda: store.num_responses)
        self.families["stored_responses_bytes"].set_function(lambda: store.num_bytes)

    def on_stored_response_evicted(self, reason: str) -> None:
        """A stored response left the store by expiry or to keep it within its bounds."""
        self.families["stored_responses_evicted"].inc(1, reason=reason)

    def on_first_token(self, timings: RequestTimings) -> None:
        """Time to first token, queue time and prefill time of one request."""
        if timings.time_to_first_token is not None:
            self.families["time_to_first_token_seconds"].observe(timings.time_to_first_token)
        if timings.queue_time is not None:
            self.families["request_queue_time_seconds"].observe(timings.queue_time)
        if timings.prefill_time is not None:
            self.families["request_prefill_time_seconds"].observe(timings.prefill_time)

    def on_delivery(self, interval: float) -> None:
        """One inter-token interval (a delivery after the first)."""
        self.families["inter_token_latency_seconds"].observe(interval)

    def on_request_finished(self, timings: RequestTimings) -> None:
        """Outcome, end-to-end latency, token counts, decode / inference time and per-request token rates."""
        f = self.families
        f["request_success"].inc(1, finished_reason=timings.finish_reason or "error")
        f["request_prompt_tokens"].observe(timings.num_prompt_tokens)
        f["request_generation_tokens"].observe(timings.num_output_tokens)
        f["request_params_max_tokens"].observe(timings.max_tokens)
        for name, observed in (
            ("e2e_request_latency_seconds", timings.e2e_latency),
            ("request_decode_time_seconds", timings.decode_time),
            ("request_inference_time_seconds", timings.inference_time),
            ("request_time_per_output_token_seconds", timings.time_per_output_token),
            ("generation_tokens_per_second", timings.tokens_per_second),
        ):
            if observed is not None:
                f[name].observe(observed)
