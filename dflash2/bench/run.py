"""``run_bench``: the whole benchmark in order: machine, workload, single stream, serving, agents, report."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

from dflash2.bench.config import BenchConfig
from dflash2.bench.machine import describe_machine
from dflash2.bench.report import write_report
from dflash2.bench.serving import run_serving
from dflash2.bench.single_stream import run_single_stream
from dflash2.bench.workload import build_workload
from dflash2.runner.model_setup import resolve_dtype

logger = logging.getLogger(__name__)


def config_summary(config: BenchConfig) -> dict[str, Any]:
    """The settings that shape the numbers, with device and dtype resolved."""
    e = config.engine
    return {
        "model": e.model,
        "drafter": e.drafter,
        "device": str(e.torch_device),
        "dtype": str(resolve_dtype(e)).removeprefix("torch."),
        "threads": e.num_threads,
        "seed": e.seed,
        "max_tokens": config.max_tokens,
        "num_prompts": config.num_prompts,
        "repeats": config.repeats,
        "sets": list(config.sets),
        "methods": list(config.methods),
        "block_sizes": list(config.block_sizes),
        "temperatures": list(config.temperatures),
        "prompt_lookup_tokens": config.prompt_lookup_tokens,
        "gguf": str(config.gguf) if config.gguf else None,
        "url": config.url,
        "concurrency": list(config.concurrency),
        "serving_requests": config.serving_requests,
        "serving_seconds": config.serving_seconds,
        "serving_temperature": config.serving_temperature,
        "serving_rounds": config.serving_rounds,
        "adaptive_threads": config.engine.adaptive_threads,
        "serving_block_size": config.serving_block_size,
        "agents": config.agents,
        "agent_history_tokens": config.agent_history_tokens,
        "agent_conversations": config.agent_conversations,
        "agent_turns": config.agent_turns,
        "agent_max_tokens": config.agent_max_tokens,
        "agent_loop": config.agent_loop,
        "agent_loop_servers": list(config.agent_loop_servers),
        "agent_loop_conversations": config.agent_loop_conversations,
        "agent_loop_max_tokens": config.agent_loop_max_tokens,
        "enforce_eager": e.enforce_eager,
        "eager_rows": config.eager_rows,
        "adaptive_rows": config.adaptive_rows,
    }


def run_bench(config: BenchConfig, progress: Callable[[str], None] = logger.info) -> dict[str, Any]:
    """Run what ``config`` selects, write results.json / results.md / plots into ``config.out``, return the results."""
    from dflash2.platform import configure_threads

    configure_threads(config.engine.num_threads)
    log_dir = config.out / "logs"
    results: dict[str, Any] = {
        "command": config.command,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": describe_machine(),
        "config": config_summary(config),
    }
    workload = build_workload(config)
    # Every method (engines, servers, llama.cpp) gets the workload's context, not the engine's default.
    config = replace(config, engine=replace(config.engine, max_model_len=workload.max_model_len))
    results["prompt_sets"] = {s.name: len(s.prompt_ids) for s in workload.sets}
    results["notes"] = list(workload.notes)
    if config.single_stream:
        single = run_single_stream(config, workload, workload.eos_token_ids, log_dir, progress)
        results["single_stream"] = {
            "methods": [m.to_dict() for m in single.methods],
            "rows": [r.to_dict() for r in single.rows],
            "records": [
                {
                    "method": r.method,
                    "temperature": r.temperature,
                    "prompt_set": r.prompt_set,
                    "repeat": r.repeat,
                    "samples": [s.to_dict() for s in r.samples],
                }
                for r in single.records
            ],
        }
    if config.startup:
        from dflash2.bench.startup import measure_startup

        results["startup"] = measure_startup(config, progress)
    if config.serving:
        results["serving"] = run_serving(config, workload.messages, log_dir, progress).to_dict()
    if config.agents:
        from dflash2.bench.agents import run_agents

        results["agents"] = run_agents(config, workload.folder, log_dir, progress)
    if config.agent_loop:
        from dflash2.bench.agent_loop import run_agent_loop

        results["agent_loop"] = run_agent_loop(config, log_dir, progress)
    for path in write_report(config.out, results):
        progress(f"wrote {path}")
    return results
