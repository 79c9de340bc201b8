"""Start-up to ready of the speculative engine, with an empty and with a warm compile cache.

Each measurement is a fresh process (``python -m dflash2.bench.startup CONFIG_JSON``) that
builds the engine — model load, drafter load, KV caches, compilation and warm-up of every
graph — and reports the seconds until it could serve. Both runs share one temporary
``TORCHINDUCTOR_CACHE_DIR``, so the first is cold and the second finds its graphs cached.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from dflash2.bench.config import BenchConfig

_TIMEOUT = 1800.0  # seconds per start-up (a cold compile on 2 cores takes minutes)


def measure_startup(config: BenchConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    """``{"block_size", "max_num_seqs", "cold": {...}, "warm": {...}}``; each run gives ``seconds``
    to ready, ``compile_seconds`` per graph, ``graph_sources`` (each graph "compiled" or "loaded"
    from the saved graphs) and whether the forwards were ``compiled``, or an ``error``.

    The engine is the speculative server's: the run's ``max_num_seqs`` slots, so the batch-1 and
    the batch-≥2 graphs are both built, and the server's adaptive policy (unless the run says
    ``--no-speculative-adaptive``), so ready includes timing its step costs."""
    engine = config.engine_config(
        config.serving_block_size,
        True,
        max_num_seqs=config.engine.max_num_seqs,
        speculative_adaptive=config.engine.speculative_adaptive,
    )
    result: dict[str, Any] = {"block_size": config.serving_block_size, "max_num_seqs": engine.max_num_seqs}
    with tempfile.TemporaryDirectory(prefix="dflash2-startup-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        for label in ("cold", "warm"):
            progress(f"start-up, {label} compile cache")
            command = [sys.executable, "-m", "dflash2.bench.startup", json.dumps(engine.to_dict())]
            try:
                done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=_TIMEOUT, check=False)
            except subprocess.TimeoutExpired:
                result[label] = {"error": f"not ready within {_TIMEOUT:.0f} s"}
                continue
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode != 0 or not lines:
                result[label] = {"error": (done.stderr.strip().splitlines() or ["exited without a report"])[-1]}
                continue
            result[label] = json.loads(lines[-1])
            run = result[label]
            progress(f"start-up, {label}: ready in {run['seconds']:.1f} s")
    return result


def _main(argv: list[str]) -> int:
    start = time.perf_counter()
    from dflash2.config import EngineConfig
    from dflash2.engine import Engine

    engine = Engine.from_config(EngineConfig(**json.loads(argv[0])))
    report = {
        "seconds": time.perf_counter() - start,
        "compiled": engine.runner.compiled,
        "compile_seconds": engine.runner.compile_times,
        "graph_sources": engine.runner.graph_sources,
    }
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
