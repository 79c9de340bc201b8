"""Single-stream (batch 1) speed: every method in its own process, warmed up, then interleaved.

Order of work:

1. start one worker process per method; they load in parallel;
2. warm-up: each method generates the first prompt once per temperature (not measured);
3. for each repetition, for each temperature, for each prompt set, every method in turn runs the
   whole set (A B C A B C …), so a slow drift of the machine touches every method alike;
4. the conv probe (``conv_probe.py``) runs once per DFlash / DFlash 2 method whose drafter has
   convolutions, after the measured work;
5. each worker reports its peak RSS and exits.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash2.bench.config import ENGINE, LLAMA, TRANSFORMERS, BenchConfig, MethodSpec
from dflash2.bench.gguf_export import choose_gguf, typed_gguf
from dflash2.bench.runners import GenerationSample
from dflash2.bench.stats import RunRecord, SpeedRow, summarize
from dflash2.bench.worker import WorkerError, WorkerHandle
from dflash2.bench.workload import Workload
from dflash2.config import DTYPES
from dflash2.runner.model_setup import resolve_dtype

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]
_LOAD_TIMEOUT = 1800.0  # seconds; a first run may convert the model or write a GGUF


@dataclass
class MethodResult:
    """What happened to one method: ``ok``, ``skipped`` (with why), ``failed`` (with the error) or ``crashed``
    (its worker killed by a signal, named in the message)."""

    spec: MethodSpec
    status: str = "pending"
    message: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    load_seconds: float | None = None
    peak_rss_bytes: int | None = None
    conv_probe: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON view."""
        return {
            "id": self.spec.id,
            "label": self.spec.label,
            "family": self.spec.family,
            "block_size": self.spec.block_size or None,
            "adaptive": self.spec.adaptive,
            "prompt_lookup": self.spec.prompt_lookup,
            "tree_topk": self.spec.tree_topk,
            "tree_nodes": self.spec.tree_nodes or None,
            "status": self.status,
            "message": self.message,
            "info": self.info,
            "load_seconds": self.load_seconds,
            "peak_rss_bytes": self.peak_rss_bytes,
            "conv_probe": self.conv_probe,
        }


@dataclass
class SingleStreamResult:
    """Methods, raw records and summary rows of the single-stream benchmark."""

    methods: list[MethodResult]
    records: list[RunRecord]
    rows: list[SpeedRow]


def _dtype_name(config: BenchConfig) -> str:
    return {v: k for k, v in DTYPES.items()}[resolve_dtype(config.engine)]


def worker_spec(
    config: BenchConfig, method: MethodSpec, workload: Workload, eos: list[int], gguf: Path | None
) -> dict[str, Any]:
    """What the worker of ``method`` loads (JSON)."""
    e = config.engine
    if method.runner == ENGINE:
        return {
            "runner": ENGINE,
            "engine": config.engine_config(
                method.block_size,
                method.use_selector,
                enforce_eager=method.enforce_eager,
                speculative_adaptive=method.adaptive,
                prompt_lookup=method.prompt_lookup,
                tree_topk=method.tree_topk,
                tree_nodes=method.tree_nodes,
                tensor_parallel_size=method.tensor_parallel_size,
                quantization=method.quantization,
            ).to_dict(),
        }
    if method.runner == TRANSFORMERS:
        return {
            "runner": TRANSFORMERS,
            "folder": str(workload.folder),
            "dtype": _dtype_name(config),
            "device": str(e.torch_device),
            "eos_token_ids": eos,
            "threads": e.num_threads,
            "prompt_lookup_tokens": method.prompt_lookup_tokens,
        }
    import torch

    return {
        "runner": LLAMA,
        "gguf": str(gguf),
        "n_ctx": workload.max_model_len,
        "threads": e.num_threads or torch.get_num_threads(),
        "eos_token_ids": eos,
        "gpu": e.torch_device.type == "cuda",
        "seed": e.seed,
    }


def _skip_reason(config: BenchConfig, method: MethodSpec, gguf_note: str, gguf: Path | None) -> str | None:
    """Why a method cannot run here (None: it can)."""
    if method.is_speculative_engine and config.engine.model is not None and config.engine.drafter is None:
        return "needs a drafter for this model: pass --drafter"
    if method.runner == LLAMA:
        if importlib.util.find_spec("llama_cpp") is None:
            return "llama-cpp-python is not installed (pip install 'dflash2[bench]'; it compiles llama.cpp)"
        if gguf is None:
            return gguf_note
    return None


class _Session:
    """The running workers and the results gathered from them."""

    def __init__(self, config: BenchConfig, workload: Workload, progress: Progress) -> None:
        self.config, self.workload, self.progress = config, workload, progress
        self.results: dict[str, MethodResult] = {}
        self.handles: dict[str, WorkerHandle] = {}
        self.records: list[RunRecord] = []

    def start(self, eos: list[int], log_dir: Path) -> None:
        config = self.config
        needs_gguf = any(m.runner == LLAMA for m in config.method_specs())
        gguf = None
        gguf_note = ""
        if needs_gguf and importlib.util.find_spec("llama_cpp") is not None:
            choice = choose_gguf(config.engine.model, self.workload.folder, _dtype_name(config), config.gguf)
            gguf, gguf_note = choice.path, choice.note
        for method in config.method_specs():
            result = self.results[method.id] = MethodResult(method)
            reason = _skip_reason(config, method, gguf_note, gguf)
            if reason is not None:
                result.status, result.message = "skipped", reason
                self.progress(f"skipping {method.id}: {reason}")
                continue
            method_gguf = gguf
            if method.runner == LLAMA:
                note = gguf_note
                if method.gguf_type:
                    choice = typed_gguf(config.engine.model, self.workload.folder, method.gguf_type)
                    method_gguf, note = choice.path, choice.note
                    if method_gguf is None:
                        result.status, result.message = "skipped", note
                        self.progress(f"skipping {method.id}: {note}")
                        continue
                result.info["gguf_note"] = note
            handle = WorkerHandle(
                method.id, worker_spec(config, method, self.workload, eos, method_gguf), log_dir / f"{method.id}.log"
            )
            # One worker loads at a time: a loading engine times its step costs for adaptive
            # speculation, and other workers compiling or loading beside it on the same cores skewed
            # that table (seen: a run whose adaptive engine verified 5–8 tokens where 4 pay most).
            handle.start()
            self.handles[method.id] = handle
            try:
                ready = handle.wait_ready(_LOAD_TIMEOUT)
            except WorkerError as exc:
                self._fail(method.id, exc)
                continue
            result.status, result.load_seconds = "ok", ready["load_seconds"]
            result.info.update(ready["info"])
            self.progress(f"loaded {method.id} in {ready['load_seconds']:.1f} s")

    def _fail(self, method_id: str, exc: Exception) -> None:
        result = self.results[method_id]
        handle = self.handles.get(method_id)
        crashed = handle is not None and handle.crashed  # a segmentation fault is not a failed measurement
        result.status, result.message = "crashed" if crashed else "failed", str(exc).splitlines()[0]
        self.progress(f"{method_id} {result.status}: {exc}")
        handle = self.handles.pop(method_id, None)
        if handle is not None:
            handle.close()

    def generate(
        self, method_id: str, prompt_ids: list[list[int]], seeds: list[int], temperature: float
    ) -> list[GenerationSample]:
        """Run prompts on one worker; [] when it failed (it is then dropped)."""
        handle = self.handles.get(method_id)
        if handle is None:
            return []
        try:
            reply = handle.call(
                "generate",
                prompt_ids=prompt_ids,
                seeds=seeds,
                max_tokens=self.config.max_tokens,
                temperature=temperature,
            )
        except WorkerError as exc:
            self._fail(method_id, exc)
            return []
        return [GenerationSample.from_dict(s) for s in reply["samples"]]

    def warm_up(self) -> None:
        first = self.workload.sets[0]
        for method_id in list(self.handles):
            for temperature in self.config.temperatures:
                self.generate(method_id, first.prompt_ids[:1], first.seeds[:1], temperature)
        self.progress("warm-up done")

    def measure(self) -> None:
        config = self.config
        for repeat in range(config.repeats):
            for temperature in config.temperatures:
                for prompt_set in self.workload.sets:
                    for method_id in list(self.handles):
                        samples = self.generate(method_id, prompt_set.prompt_ids, prompt_set.seeds, temperature)
                        if not samples:
                            continue
                        self.records.append(RunRecord(method_id, temperature, prompt_set.name, repeat, samples))
                        tokens = sum(s.num_output_tokens for s in samples)
                        seconds = sum(s.seconds for s in samples)
                        self.progress(
                            f"repeat {repeat + 1}/{config.repeats} T={temperature:g} {prompt_set.name}: "
                            f"{method_id} {tokens / seconds if seconds else 0:.1f} tok/s"
                        )

    def probe_convolutions(self) -> None:
        first = self.workload.sets[0]
        for method_id, handle in list(self.handles.items()):
            result = self.results[method_id]
            if not result.spec.is_speculative_engine or not result.info.get("has_conv"):
                continue
            try:
                reply = handle.call("conv_probe", prompt_ids=first.prompt_ids[0], max_tokens=self.config.max_tokens)
            except WorkerError as exc:
                result.conv_probe = {"skipped": str(exc).splitlines()[0]}
                continue
            result.conv_probe = reply["probe"]

    def stop(self) -> None:
        for method_id, handle in self.handles.items():
            self.results[method_id].peak_rss_bytes = handle.stop()
        self.handles.clear()


def run_single_stream(
    config: BenchConfig, workload: Workload, eos_token_ids: list[int], log_dir: Path, progress: Progress
) -> SingleStreamResult:
    """Load, warm up, measure interleaved, probe the convolutions, stop; then summarize."""
    session = _Session(config, workload, progress)
    try:
        session.start(eos_token_ids, log_dir)
        session.warm_up()
        session.measure()
        session.probe_convolutions()
    finally:
        session.stop()
    order = [m.id for m in config.method_specs()]
    return SingleStreamResult(
        methods=[session.results[m] for m in order],
        records=session.records,
        rows=summarize(session.records, order),
    )
