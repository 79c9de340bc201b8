"""Serving load: concurrent streaming chat requests against a server on loopback.

For each server (``--url``, or ``dflash2 serve`` started here on a free loopback port per server
configuration: autoregressive and DFlash 2) and each concurrency level c, c client tasks send
streaming ``/v1/chat/completions`` requests from the prompt sets back to back until the level has
sent ``serving_requests`` requests or ``serving_seconds`` have passed (requests in flight then
finish, bounded by ``max_tokens``). Per level:

- output tokens/s = completion tokens of the successful requests / the level's wall time;
- TTFT = request start → first content chunk; inter-token latency = gaps between a request's
  content chunks (a verify step that commits several tokens arrives as one chunk, as the server's
  own ``inter_token_latency_seconds`` counts it); TPOT = (end − TTFT) / (tokens − 1) per request;
- τ from the ``dflash2`` object of each stream's usage chunk, and from ``/metrics`` counter deltas
  (``1 + Δaccepted / Δdrafts``), with per-position acceptance from
  ``dflash2_spec_decode_num_accepted_tokens_per_pos_total``;
- errors: non-200 answers, error events, broken streams and timeouts.

All servers run at once and the levels are interleaved (c = 1 on every server, then c = 2, …), so
a host that slows down or speeds up during the run shifts every server's figures at a level
alike and the ratios between servers stay comparable (run one after the other, the autoregressive
server measured 160 and 225 tok/s at c = 8 in two runs 15 minutes apart on a shared 2-core host).
An idle server only waits for requests. With ``serving_rounds`` > 1 each level runs that many rounds,
the servers' order reversed every other round (A B, B A, A B …), so drift within a level also falls
on both alike; a level then reports the median of its rounds' tokens/s, latencies over every
round's requests, and ``× AR`` as the median of the rounds' paired ratios (single rounds on a shared
2-core host often land more than 10 % from their level's median, up to 40 %).

Only loopback addresses are accepted: this is a load generator.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import json
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from dflash2.bench.config import AR, DFLASH, DFLASH2, BenchConfig
from dflash2.bench.stats import percentile, ratio

Progress = Callable[[str], None]
Messages = list[dict[str, str]]
_READY_TIMEOUT = 1800.0  # seconds for a server to load (a first run may convert the model)
_METRIC_PREFIX = "dflash2_spec_decode_"


def is_loopback_url(url: str) -> bool:
    """True when ``url``'s host is localhost or a loopback address (127.0.0.0/8, ::1)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def free_loopback_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class ServerSpec:
    """One server configuration to load: an engine method, or a server given by URL."""

    id: str
    block_size: int = 1
    use_selector: bool = True
    url: str | None = None


def server_specs(config: BenchConfig) -> list[ServerSpec]:
    """The servers of a run: ``--url`` alone, else AR and the speculative family chosen (B from the config)."""
    if config.url is not None:
        return [ServerSpec("url", url=config.url.rstrip("/"))]
    block = config.serving_block_size
    specs = []
    if AR in config.methods:
        specs.append(ServerSpec(AR, 1))
    if DFLASH2 in config.methods:
        specs.append(ServerSpec(f"{DFLASH2}-b{block}", block, config.engine.use_selector))
    elif DFLASH in config.methods:
        specs.append(ServerSpec(f"{DFLASH}-b{block}", block, False))
    return specs


def serve_command(config: BenchConfig, spec: ServerSpec, port: int) -> list[str]:
    """``dflash2 serve`` on 127.0.0.1:port with the run's model and engine flags."""
    e = config.engine
    command = [sys.executable, "-m", "dflash2.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--drain-timeout", "5", "--block-size", str(spec.block_size)]
    command += ["--max-num-seqs", str(max(e.max_num_seqs, *config.concurrency))]
    command += ["--device", e.device, "--dtype", e.dtype, "--seed", str(e.seed)]
    for flag, value in (("--model", e.model), ("--drafter", e.drafter), ("--max-model-len", e.max_model_len)):
        if value is not None:
            command += [flag, str(value)]
    if e.num_threads:
        command += ["--threads", str(e.num_threads)]
    if not spec.use_selector:
        command.append("--no-selector")
    # Compiled rows are measured compiled: the server turns ready only once its graphs are in use.
    command.append("--enforce-eager" if e.enforce_eager else "--wait-for-compile")
    if not e.speculative_adaptive:
        command.append("--no-speculative-adaptive")
    elif spec.block_size > 1:  # prompt lookup runs beside a drafter (the autoregressive server has none)
        for flag, value in (("--prompt-lookup-max", e.prompt_lookup_max), ("--prompt-lookup-min", e.prompt_lookup_min)):
            if value is not None:
                command += [flag, str(value)]
    if e.deterministic:
        command.append("--deterministic")
    if spec.block_size > 1 and e.speculative_topk > 1:  # the run's token trees, on the speculative server
        command += ["--speculative-topk", str(e.speculative_topk)]
        if e.speculative_num_draft_tokens is not None:
            command += ["--speculative-num-draft-tokens", str(e.speculative_num_draft_tokens)]
    if e.tensor_parallel_size > 1:
        command += ["--tensor-parallel-size", str(e.tensor_parallel_size)]
    command += ["--quantization", e.quantization]
    if spec.block_size > 1:
        command += ["--speculative-draft-quantization", e.speculative_draft_quantization]
    command.append("--adaptive-threads" if e.adaptive_threads else "--no-adaptive-threads")
    return command


@dataclass
class RunningServer:
    """A ``dflash2 serve`` process started here."""

    url: str
    process: subprocess.Popen[bytes]
    command: list[str]


@contextmanager
def started_server(
    config: BenchConfig, spec: ServerSpec, log_path: Path, extra_args: Sequence[str] = ()
) -> Iterator[RunningServer]:
    """Start ``dflash2 serve`` for ``spec`` (plus ``extra_args``), wait until ready, yield it, then
    SIGTERM it (it drains).

    Raises:
        RuntimeError: the server exited or was not ready in time (the message has its log's tail).
    """
    port = free_loopback_port()
    url = f"http://127.0.0.1:{port}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [*serve_command(config, spec, port), *extra_args]
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_ready(url, process, log_path)
        yield RunningServer(url, process, command)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_ready(url: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + _READY_TIMEOUT
    with httpx.Client(trust_env=False, timeout=5) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
                raise RuntimeError(f"the server exited with {process.returncode}:\n{tail}")
            try:
                if client.get(f"{url}/health/ready").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
    raise RuntimeError(f"the server at {url} was not ready within {_READY_TIMEOUT:.0f} s")


def process_peak_rss_bytes(pid: int) -> int | None:
    """``VmHWM`` (peak RSS) of a running process from /proc (None where unavailable)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# ---- one request -----------------------------------------------------------------------------


@dataclass
class RequestResult:
    """One streamed request as the client saw it."""

    ok: bool
    error: str = ""
    seconds: float = 0.0
    ttft: float = 0.0
    num_output_tokens: int = 0
    chunk_gaps: list[float] = field(default_factory=list)
    num_verify_steps: int = 0
    num_accepted_tokens: int = 0


def _chunk_events(chunk: dict[str, Any], result: RequestResult) -> bool:
    """Fold one SSE chunk into ``result``; True when it carried content or a finish."""
    if "error" in chunk:
        result.ok, result.error = False, str(chunk["error"].get("message", chunk["error"]))
        return False
    visible = False
    for choice in chunk.get("choices") or []:
        if (choice.get("delta") or {}).get("content") or choice.get("finish_reason"):
            visible = True
    if chunk.get("usage"):
        result.num_output_tokens = int(chunk["usage"]["completion_tokens"])
        info = chunk.get("dflash2") or {}
        result.num_verify_steps = int(info.get("verify_steps", 0))
        result.num_accepted_tokens = int(info.get("accepted_tokens", 0))
    return visible


async def stream_chat(client: httpx.AsyncClient, url: str, payload: dict[str, Any]) -> RequestResult:
    """Send one streaming chat request and time its chunks."""
    result = RequestResult(ok=True)
    start = time.perf_counter()
    times: list[float] = []
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                return RequestResult(ok=False, error=f"HTTP {response.status_code}: {body[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                if _chunk_events(json.loads(data), result):
                    times.append(time.perf_counter())
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return RequestResult(ok=False, error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    result.seconds = end - start
    result.ttft = (times[0] if times else end) - start
    result.chunk_gaps = [b - a for a, b in itertools.pairwise(times)]
    if result.ok and not result.num_output_tokens:
        result.ok, result.error = False, "the stream ended without a usage chunk"
    return result


# ---- one level ---------------------------------------------------------------------------------


@dataclass
class LevelResult:
    """One (server, concurrency) level."""

    server: str
    concurrency: int
    num_requests: int
    num_errors: int
    seconds: float
    output_tokens_per_second: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    tpot_mean_ms: float
    e2e_p50_ms: float
    tau: float | None
    tau_metrics: float | None = None
    acceptance_per_position: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    speedup_vs_ar: float | None = None
    round_tokens_per_second: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON view."""
        return asdict(self)


def output_tokens_per_second(results: Sequence[RequestResult], seconds: float) -> float:
    """Completion tokens of the successful requests ÷ ``seconds`` of wall time (0 for no time)."""
    return sum(r.num_output_tokens for r in results if r.ok) / seconds if seconds else 0.0


def summarize_level(
    server: str,
    concurrency: int,
    results: list[RequestResult],
    seconds: float,
    round_tokens_per_second: Sequence[float] = (),
) -> LevelResult:
    """Latency percentiles, throughput and τ of one level's requests (``seconds``: the level's wall
    time). With ``round_tokens_per_second`` (one figure per round, ``results`` pooled over the rounds)
    the level's output tokens/s is their median."""
    good = [r for r in results if r.ok]
    rate = output_tokens_per_second(results, seconds)
    if round_tokens_per_second:
        rate = statistics.median(round_tokens_per_second)
    gaps = [g for r in good for g in r.chunk_gaps]
    tpots = [(r.seconds - r.ttft) / (r.num_output_tokens - 1) for r in good if r.num_output_tokens > 1]
    steps = sum(r.num_verify_steps for r in good)
    accepted = sum(r.num_accepted_tokens for r in good)
    return LevelResult(
        server=server,
        concurrency=concurrency,
        num_requests=len(results),
        num_errors=len(results) - len(good),
        seconds=seconds,
        output_tokens_per_second=rate,
        ttft_p50_ms=percentile([r.ttft for r in good], 50) * 1e3,
        ttft_p99_ms=percentile([r.ttft for r in good], 99) * 1e3,
        itl_p50_ms=percentile(gaps, 50) * 1e3,
        itl_p99_ms=percentile(gaps, 99) * 1e3,
        tpot_mean_ms=sum(tpots) / len(tpots) * 1e3 if tpots else 0.0,
        e2e_p50_ms=percentile([r.seconds for r in good], 50) * 1e3,
        tau=(accepted + steps) / steps if steps else None,
        errors=sorted({r.error for r in results if not r.ok})[:5],
        round_tokens_per_second=list(round_tokens_per_second),
    )


def request_payload(model: str, messages: Messages, max_tokens: int, temperature: float) -> dict[str, Any]:
    """One streamed chat request of the serving load. No ``seed``: a request with a seed of its own
    verifies full blocks (trees where they are on) without prompt lookup whatever the load, so the
    adaptive policy under test would never run (each server seeds its requests from its ``--seed``)."""
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def run_level(
    url: str,
    model: str,
    prompts: list[Messages],
    concurrency: int,
    num_requests: int,
    max_seconds: float,
    max_tokens: int,
    temperature: float,
) -> tuple[list[RequestResult], float]:
    """``concurrency`` tasks send requests back to back; returns the results and the wall seconds."""
    counter = itertools.count()
    results: list[RequestResult] = []
    start = time.perf_counter()
    deadline = start + max_seconds
    timeout = httpx.Timeout(max_seconds + 60.0, connect=10.0)
    limits = httpx.Limits(max_connections=concurrency + 2)

    async with httpx.AsyncClient(trust_env=False, timeout=timeout, limits=limits) as client:

        async def client_task() -> None:
            while True:
                index = next(counter)
                if index >= num_requests or time.perf_counter() > deadline:
                    return
                payload = request_payload(model, prompts[index % len(prompts)], max_tokens, temperature)
                results.append(await stream_chat(client, url, payload))

        await asyncio.gather(*(client_task() for _ in range(concurrency)))
    return results, time.perf_counter() - start


# ---- /metrics ---------------------------------------------------------------------------------


def scrape_counters(url: str) -> dict[str, float]:
    """The speculative counters of ``/metrics``: ``{name or name{position}: value}`` (empty on failure)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    except httpx.HTTPError:
        return {}
    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(_METRIC_PREFIX) and sample.name.endswith("_total"):
                position = sample.labels.get("position")
                key = sample.name if position is None else f"{sample.name}{{{position}}}"
                counters[key] = counters.get(key, 0.0) + sample.value
    return counters


def acceptance_from_counters(before: dict[str, float], after: dict[str, float]) -> tuple[float | None, list[float]]:
    """τ = 1 + Δaccepted / Δdrafts and Δaccepted_per_pos[j] / Δdrafts, from two scrapes."""

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    drafts = delta(f"{_METRIC_PREFIX}num_drafts_total")
    if drafts <= 0:
        return None, []
    per_pos_name = f"{_METRIC_PREFIX}num_accepted_tokens_per_pos_total"
    positions = sorted(int(k[len(per_pos_name) + 1 : -1]) for k in after if k.startswith(per_pos_name + "{"))
    per_position = [delta(f"{per_pos_name}{{{p}}}") / drafts for p in positions]
    return 1.0 + delta(f"{_METRIC_PREFIX}num_accepted_tokens_total") / drafts, per_position


# ---- the serving benchmark ---------------------------------------------------------------------


@dataclass
class ServingResult:
    """Every level of every server, and the servers' notes (peak RSS, failures)."""

    levels: list[LevelResult] = field(default_factory=list)
    servers: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON view."""
        return {"levels": [lv.to_dict() for lv in self.levels], "servers": self.servers, "notes": self.notes}


def _model_name(url: str) -> str:
    response = httpx.get(f"{url}/v1/models", timeout=10, trust_env=False)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


def warm_up(url: str, model: str, prompts: list[Messages], config: BenchConfig) -> None:
    """One request before measuring (first-request costs: tokenizer, allocator, caches)."""
    asyncio.run(run_level(url, model, prompts, 1, 1, config.serving_seconds, config.max_tokens, 0.0))


def run_server_round(
    config: BenchConfig,
    server: str,
    url: str,
    model: str,
    prompts: list[Messages],
    concurrency: int,
    progress: Progress,
) -> tuple[list[RequestResult], float]:
    """One round of a concurrency level against ``url`` (serving ``model``): its requests' results
    and its wall seconds."""
    results, seconds = asyncio.run(
        run_level(
            url,
            model,
            prompts,
            concurrency,
            config.serving_requests,
            config.serving_seconds,
            config.max_tokens,
            config.serving_temperature,
        )
    )
    good = [r for r in results if r.ok]
    rate, ttft = output_tokens_per_second(results, seconds), percentile([r.ttft for r in good], 50) * 1e3
    progress(
        f"serving {server} c={concurrency}: {rate:.1f} tok/s, TTFT p50 {ttft:.0f} ms, {len(results) - len(good)} errors"
    )
    return results, seconds


@dataclass
class _LevelRun:
    """What one server's rounds of one level collected so far."""

    counters: dict[str, float]  # /metrics before its first round
    results: list[RequestResult] = field(default_factory=list)
    seconds: float = 0.0
    rates: list[float] = field(default_factory=list)

    def add(self, results: list[RequestResult], seconds: float) -> None:
        self.results += results
        self.seconds += seconds
        self.rates.append(output_tokens_per_second(results, seconds))

    def level(self, server: str, concurrency: int, url: str) -> LevelResult:
        """The level's summary, τ from the ``/metrics`` counters over its rounds."""
        level = summarize_level(server, concurrency, self.results, self.seconds, self.rates)
        level.tau_metrics, level.acceptance_per_position = acceptance_from_counters(self.counters, scrape_counters(url))
        return level


def add_serving_speedups(levels: list[LevelResult]) -> None:
    """``speedup_vs_ar`` = a level's tokens/s ÷ the AR server's at the same concurrency; with rounds
    on both, the median of the rounds' paired ratios (round i of one server ÷ round i of the other,
    run back to back)."""
    ar = {lv.concurrency: lv for lv in levels if lv.server == AR}
    for level in levels:
        base = ar.get(level.concurrency)
        if base is None:
            level.speedup_vs_ar = None
        elif len(level.round_tokens_per_second) > 1 and len(level.round_tokens_per_second) == len(
            base.round_tokens_per_second
        ):
            pairs = list(zip(level.round_tokens_per_second, base.round_tokens_per_second))
            paired = [a / b for a, b in pairs if b > 0]
            level.speedup_vs_ar = statistics.median(paired) if len(paired) == len(pairs) else None
        else:
            level.speedup_vs_ar = ratio(level.output_tokens_per_second, base.output_tokens_per_second)


def run_serving(config: BenchConfig, prompts: list[Messages], log_dir: Path, progress: Progress) -> ServingResult:
    """The serving benchmark over every server of ``server_specs(config)``: all servers started (or
    reached) first, then each concurrency level on every server in turn."""
    result = ServingResult()
    if config.url is not None and not is_loopback_url(config.url):
        result.notes.append(f"--url {config.url} is not a loopback address; the serving benchmark only loads loopback")
        progress(result.notes[-1])
        return result
    specs = server_specs(config)
    if not specs:
        result.notes.append("no engine method selected (ar, dflash, dflash2): no server to load")
    errors = (RuntimeError, httpx.HTTPError, OSError)

    def failed(server_id: str, exc: BaseException) -> None:
        result.notes.append(f"{server_id}: {str(exc).splitlines()[0]}")
        progress(f"serving {server_id} failed: {exc}")

    with ExitStack() as stack:
        reached: dict[str, tuple[str, str]] = {}  # server id → (url, model name)
        started: dict[str, RunningServer] = {}
        for spec in specs:
            if (
                spec.url is None
                and spec.block_size > 1
                and config.engine.model is not None
                and not config.engine.drafter
            ):
                result.notes.append(f"{spec.id}: needs --drafter for this model; not served")
                continue
            try:
                if spec.url is None:
                    server = stack.enter_context(started_server(config, spec, log_dir / f"serve-{spec.id}.log"))
                    progress(f"started dflash2 serve for {spec.id} at {server.url} (pid {server.process.pid})")
                    started[spec.id] = server
                url = spec.url or started[spec.id].url
                model = _model_name(url)
                warm_up(url, model, prompts, config)
                reached[spec.id] = (url, model)
            except errors as exc:
                failed(spec.id, exc)
        for concurrency in config.concurrency:
            runs = {server_id: _LevelRun(scrape_counters(url)) for server_id, (url, _) in reached.items()}
            for round_index in range(config.serving_rounds):
                in_turn = list(runs) if round_index % 2 == 0 else list(reversed(runs))
                for server_id in in_turn:
                    if server_id not in reached:
                        continue
                    url, model = reached[server_id]
                    try:
                        runs[server_id].add(
                            *run_server_round(config, server_id, url, model, prompts, concurrency, progress)
                        )
                    except errors as exc:
                        del reached[server_id]  # no further rounds or levels for a server that failed
                        failed(server_id, exc)
            for server_id, run in runs.items():
                if server_id in reached:
                    result.levels.append(run.level(server_id, concurrency, reached[server_id][0]))
        for spec in specs:
            if spec.id in started:
                server = started[spec.id]
                result.servers[spec.id] = {
                    "command": " ".join(["dflash2", *server.command[3:]]),
                    "peak_rss_bytes": process_peak_rss_bytes(server.process.pid),
                }
            elif spec.url is not None:
                result.servers[spec.id] = {"url": spec.url}
    order = {spec.id: i for i, spec in enumerate(specs)}
    result.levels.sort(key=lambda level: (order.get(level.server, len(order)), level.concurrency))
    add_serving_speedups(result.levels)
    return result
