"""The background compile worker: ``python -m dflash2.compile_worker``, started by the server's engine
(:class:`dflash2.runner.background.BackgroundCompiler`).

It reads its job, one JSON object (:func:`dflash2.runner.background.compile_job`), from stdin, loads the
models with the engine's settings, builds a runner exactly as an up-front start would — compiling,
warming up on its own caches and saving every graph (``dflash2/runner/precompiled.py``) — and exits 0 when
every graph compiled. It logs to stderr as ``LEVEL logger: message`` lines, which the server logs again.
The server lowers its priority right after starting it; Linux ends it when the server's engine thread
exits (``PR_SET_PDEATHSIG``). A module of its own, imported by nothing, so that ``-m`` runs it once.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

logger = logging.getLogger("dflash2.compile_worker")


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to end this process when the thread that started it exits, and exit now if the server
    has already gone."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        sys.exit(1)


def _run(job: dict[str, Any]) -> int:
    """Load the models, compile and save every graph; 0 when all compiled."""
    import resource

    import torch
    import torch._inductor.config as inductor_config

    from dflash2.config import EngineConfig, resolve_spec
    from dflash2.runner.model_runner import ModelRunner
    from dflash2.runner.model_setup import load_models
    from dflash2.runner.settings import RunnerSpec

    inductor_config.compile_threads = 1  # one C++ build at a time: the server keeps the other cores
    config = EngineConfig(**job["config"])
    start = time.monotonic()
    models = load_models(config)
    spec = resolve_spec(config, models.target, models.drafter)
    runner_spec = RunnerSpec(
        spec.max_num_seqs,
        spec.max_model_len,
        spec.block_size,
        dynamic_threads=bool(job["dynamic_threads"]),
        use_selector=config.use_selector,
        tree_nodes=spec.tree_nodes,
        zeroed_caches=False,  # its caches' pages stay unbacked: warm-up writes only the scratch slot
    )
    runner = ModelRunner(models.target, models.drafter if spec.speculative else None, runner_spec)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if runner.compile_failures:
        for name, error in runner.compile_failures.items():
            logger.error("the %s forward did not compile: %s", name, error)
        return 1
    logger.info(
        "%d graphs compiled and saved in %.1f s (%d threads, peak memory %.0f MiB)",
        len(runner.compile_times),
        time.monotonic() - start,
        torch.get_num_threads(),
        peak_mib,
    )
    return 0


def main() -> int:
    """The job from stdin, logs to stderr; exit status 0 when every graph compiled."""
    job = json.loads(sys.stdin.read())
    _die_with_parent(int(job["parent_pid"]))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return _run(job)
    except Exception as error:
        logger.error("compilation failed: %s: %s", type(error).__name__, str(error)[:500], exc_info=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
