"""Compiling the runner's graphs in another process while the engine serves with its eager forwards.

On a fresh machine compiling the decode graphs takes minutes (about 6 on 2 cores for the server's
defaults). The server does not wait for them: its runner is built with ``defer_compile`` (eager
forwards, the modules to compile built but not compiled), and :class:`BackgroundCompiler` starts a
worker process — ``python -m dflash2.compile_worker`` — that loads the same models with the
same settings, compiles and warms up every graph exactly as an up-front start would, and saves
them (``dflash2/runner/precompiled.py``) before it exits. The engine then loads the saved graphs between
two steps (:meth:`dflash2.engine.Engine.poll_compile`), seconds instead of minutes.

Why a process and not a thread: warm-up and compilation run forwards that write the runner's KV
caches, and the compiler's Python work and C++ builds on a thread starved the engine thread
(``docs/engine.md``). The worker has its own model copy and caches, runs at the lowest CPU priority
(``SCHED_IDLE`` where Linux offers it, and nice 19) with one compiler thread, and dies with the
server (``PR_SET_PDEATHSIG``). Its cost is memory: a second copy of the weights and the compiler's
own, for the minutes it runs.

The worker reads its job, one JSON object (:func:`compile_job`), from stdin and logs to stderr
(``LEVEL logger: message`` lines, which the server logs again under ``dflash2.runner.background``).
Exit status 0: every graph was compiled and saved.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import IO, Any

logger = logging.getLogger(__name__)

WORKER_MODULE = "dflash2.compile_worker"
_TAIL_LINES = 20  # worker log lines kept to explain a failure


@dataclass(frozen=True)
class CompileStatus:
    """Where an engine's compiled forwards stand.

    Attributes:
        state: ``eager`` (nothing is compiled: ``--enforce-eager``, deterministic mode, a target that
            runs eagerly), ``compiling`` (a worker builds the graphs; eager forwards serve meanwhile),
            ``compiled`` (every graph in use) or ``failed`` (some or all forwards stay eager; ``error``
            says why).
        num_graphs: graphs in use (0 until they are).
        seconds: from the start of compilation to the graphs in use (None until then).
        error: why compilation failed, or None.
    """

    state: str
    num_graphs: int = 0
    seconds: float | None = None
    error: str | None = None

    @property
    def is_compiled(self) -> bool:
        """True once every compiled forward is in use."""
        return self.state == "compiled"


def worker_command() -> list[str]:
    """The command that runs the compile worker (this module, with this interpreter)."""
    return [sys.executable, "-m", WORKER_MODULE]


class BackgroundCompiler:
    """The compile worker process, started now and watched from the engine thread.

    Args:
        job: what the worker builds (:func:`compile_job`).

    Attributes:
        pid: the worker's process id.
        started: ``time.monotonic()`` when it was started.
    """

    def __init__(self, job: dict[str, Any]) -> None:
        self.started = time.monotonic()
        self._tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self.process = subprocess.Popen(
            worker_command(),
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
        )
        self.pid = self.process.pid
        # At once, from here: the worker itself could do it only after its imports.
        _lower_priority(self.pid)
        assert self.process.stdin is not None and self.process.stderr is not None
        with self.process.stdin as stdin:
            stdin.write(json.dumps(job))
        # The thread holds the tail, not this object: dropping the compiler lets it be collected (below).
        self._reader = threading.Thread(
            target=_relay, args=(self.process.stderr, self._tail), name="dflash2-compile-log", daemon=True
        )
        self._reader.start()
        # Stops the worker at stop(), when this object is collected, or at exit, whichever comes first.
        self._finalizer = weakref.finalize(self, _stop_process, self.process)
        # At the default log level too: decoding is slower until the graphs are in use (Engine.poll_compile says when).
        logger.warning(
            "serving with the eager forwards while a background process (pid %d) compiles the decode graphs", self.pid
        )

    def poll(self) -> int | None:
        """The worker's exit status once it has exited (its log relayed), else None."""
        code = self.process.poll()
        if code is not None:
            self._reader.join(timeout=5)
        return code

    def failure(self, code: int) -> str:
        """Why a worker that exited with ``code`` failed: the status and its last log line."""
        last = next((line for line in reversed(self._tail) if line.startswith(("ERROR", "WARNING"))), None)
        last = last or (self._tail[-1] if self._tail else "no output")
        how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        return f"the compile worker ended with {how}: {last}"

    def stop(self) -> None:
        """End the worker if it still runs (idempotent)."""
        self._finalizer()


def _relay(stream: IO[str], tail: collections.deque[str]) -> None:
    """Log the worker's lines at their own level; keep the last ones in ``tail``."""
    for line in stream:
        line = line.rstrip()
        if not line:
            continue
        tail.append(line)
        level_name, _, rest = line.partition(" ")
        level = logging.getLevelName(level_name)
        if isinstance(level, int):
            logger.log(level, "compile worker: %s", rest)
        else:
            logger.info("compile worker: %s", line)


def _stop_process(process: subprocess.Popen[str]) -> None:
    """Terminate ``process`` if it still runs; kill it when it has not ended 10 s later."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def compile_job(config: Any, max_model_len: int, num_threads: int, dynamic_threads: bool) -> dict[str, Any]:
    """The worker's job for an engine of ``config`` (an ``EngineConfig``): the same settings, with the
    engine's resolved ``max_model_len`` (the graphs are keyed by the cache shapes) and thread settings
    (without ``cpp.dynamic_threads`` a kernel keeps the count it was compiled with)."""
    settings = dataclasses.asdict(config)
    settings.update(max_model_len=max_model_len, background_compile=False, enforce_eager=False)
    settings.update(num_threads=num_threads, adaptive_threads=False, tensor_parallel_size=1)
    return {"config": settings, "dynamic_threads": dynamic_threads, "parent_pid": os.getpid()}


def _lower_priority(pid: int) -> None:
    """Let process ``pid`` run only when the cores are otherwise idle (``SCHED_IDLE``), at nice 19 where
    that is refused; the threads and processes it starts inherit both."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, pid, 19)
    if hasattr(os, "SCHED_IDLE"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
