"""Tensor parallelism's processes, rank 0's side: the group the runner sends each target forward to.

``--tensor-parallel-size N`` (:attr:`EngineConfig.tensor_parallel_size`) starts N − 1 worker processes
(:mod:`dflash2.runner.tensor_parallel_worker`) beside the engine's own, which is rank 0. All N join one
``torch.distributed`` process group (NCCL on CUDA, gloo on CPU) for the collectives inside the forwards
(:mod:`dflash2.models.tensor_parallel`); each loads the target and keeps its shard.

Rank 0 alone runs the scheduler, the drafter (which it keeps whole: it is small), the selector, the
adaptive policy and every sampling decision. Its :class:`~dflash2.runner.ModelRunner` sends each target
forward — prefill, verify (chains and token trees) — to the workers before running it itself, so every
rank runs the same forwards in the same order; the K/V bookkeeping that touches no collective (a tree's
commit, a prefix copy, a freed slot) rides along with the next forward's message. Messages go
over one ``multiprocessing`` pipe per worker: a worker waits on it without a timeout however long the
server idles, and sees end-of-file when rank 0 exits.

Failures: a thread on rank 0 watches the workers; when one exits, :attr:`TensorParallelGroup.failure`
names its rank and exit code, listeners are told (the server stops with that error), and the next
forward raises :class:`TensorParallelError` instead of waiting. A collective that waits on a dead peer
fails when gloo or NCCL sees the peer's connection close, or at the group's timeout
(:data:`COLLECTIVE_TIMEOUT_SECONDS`).

Lifetime: :meth:`TensorParallelGroup.close` — or the group's garbage collection, or the interpreter's
exit, whichever comes first — stops the workers and destroys the process group, so a later engine in the
same process can start its own. One group is open per process at a time (``torch.distributed`` has one
default process group); :func:`check_no_open_group` says so before a second one starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import multiprocessing.connection
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dflash2.models.tensor_parallel import ShardInfo
from dflash2.runner.settings import RunnerSpec

if TYPE_CHECKING:
    from dflash2.config import EngineConfig

logger = logging.getLogger(__name__)

# A collective waits this long for its peers before it fails (torch.distributed's process-group timeout).
COLLECTIVE_TIMEOUT_SECONDS = 300
# Rank 0 waits this long for a worker to load its shard and build its runner.
START_TIMEOUT_SECONDS = 1800
# Rank 0 waits this long for a worker to stop when asked, before it kills it.
STOP_TIMEOUT_SECONDS = 10

# The group open in this process, if any (weakly: the engine that owns it decides when it goes).
_open_group: weakref.ref[TensorParallelGroup] | None = None


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed (its message names the rank), or the group is closed; the engine
    cannot go on."""


def threads_per_rank(config: EngineConfig) -> int:
    """CPU threads each rank uses: ``--threads`` (or the CPUs this process may use) split over the ranks."""
    from dflash2.platform import available_cpus

    total = config.num_threads or available_cpus()
    return max(1, total // config.tensor_parallel_size)


def exit_message(rank: int, process: Any) -> str:
    """``tensor-parallel worker rank R (pid P) exited with code C`` (or ``was killed by signal S``)."""
    code = process.exitcode
    how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
    return f"tensor-parallel worker rank {rank} (pid {process.pid}) {how}"


def check_no_open_group() -> None:
    """Make sure no tensor-parallel group is open in this process before another starts.

    A group whose engine was dropped without :meth:`~TensorParallelGroup.close` is released by a garbage
    collection first (an engine's objects refer to each other, so dropping the last name does not free
    them at once).

    Raises:
        TensorParallelError: a group is open (its engine is still referenced), or ``torch.distributed``'s
            default process group was initialised by something else in this process.
    """
    import torch.distributed as dist

    if _open_group is not None and _open_group() is not None:
        gc.collect()
    group = _open_group() if _open_group is not None else None
    if group is not None and not group.is_closed:
        raise TensorParallelError(
            "another tensor-parallel engine is open in this process: close it first (LLM.close(), "
            "Engine.close() or a `with LLM(...) as llm:` block); one runs at a time"
        )
    if dist.is_available() and dist.is_initialized():
        raise TensorParallelError(
            "torch.distributed's default process group is already initialised in this process; tensor "
            "parallelism starts its own (call torch.distributed.destroy_process_group() first)"
        )


@dataclass
class _Ranks:
    """What the watching thread and the finalizer share: never the group itself, so that dropping the
    group's last reference lets it be collected (and its workers stopped)."""

    processes: list[Any]
    pipes: list[Any]
    failure: str | None = None
    listeners: list[Callable[[str], None]] = field(default_factory=list)
    closing: bool = False


class TensorParallelGroup:
    """Rank 0's side of tensor parallelism: the worker processes, their pipes, and watching them.

    :func:`dflash2.runner.tensor_parallel_worker.start_workers` builds it. The runner calls :meth:`run`
    before each target forward and :meth:`defer` for bookkeeping; :meth:`query` asks every worker for a
    value (tests, health). :meth:`close` (idempotent; also run when the group is collected or the
    interpreter exits) stops the workers and destroys the process group.

    Attributes:
        shard: rank 0's place in the group (for :func:`~dflash2.models.tensor_parallel.shard_target`).
    """

    def __init__(self, shard: ShardInfo, processes: list[Any], pipes: list[Any]) -> None:
        global _open_group
        self.shard = shard
        self._ranks = _Ranks(processes, pipes)
        self._pending: list[tuple[str, tuple[Any, ...]]] = []
        self._lock = threading.Lock()
        self._watcher = threading.Thread(target=_watch, args=(self._ranks,), name="dflash2-tp-watch", daemon=True)
        self._watcher.start()
        # Runs at close(), at collection or at exit, whichever comes first, and only once.
        self._finalizer = weakref.finalize(self, _shut_down, self._ranks)
        _open_group = weakref.ref(self)

    @property
    def world_size(self) -> int:
        """N, the ranks (this process included)."""
        return self.shard.world_size

    @property
    def processes(self) -> list[Any]:
        """The worker processes, ranks 1 … N−1."""
        return self._ranks.processes

    @property
    def pipes(self) -> list[Any]:
        """Rank 0's end of each worker's pipe, ranks 1 … N−1."""
        return self._ranks.pipes

    @property
    def failure(self) -> str | None:
        """None while every worker runs; else what happened, naming the rank."""
        return self._ranks.failure

    @property
    def is_closed(self) -> bool:
        """True once :meth:`close` has run (or the group was finalised)."""
        return not self._finalizer.alive

    # ---- messages --------------------------------------------------------------------------------

    def start_runners(self, spec: RunnerSpec) -> None:
        """Send the workers rank 0's runner settings; they build their runners from them (compiling in step
        with rank 0; the server's background compilation is rank 0's alone, so ``defer_compile`` is off)."""
        self._send(("build", dataclasses.replace(spec, defer_compile=False)))

    def wait_ready(self) -> None:
        """Wait until every worker has built its runner.

        Raises:
            TensorParallelError: a worker failed to load or build (its error), or exited.
        """
        for rank, pipe in enumerate(self.pipes, start=1):
            reply = self._receive(rank, pipe, START_TIMEOUT_SECONDS)
            if reply[0] != "ready":
                raise TensorParallelError(f"tensor-parallel rank {rank} failed to start: {reply[1]}")

    def run(self, name: str, *args: Any) -> None:
        """Have every worker run ``runner.<name>(*args)`` (after the bookkeeping deferred so far), before
        rank 0 runs the same forward.

        Raises:
            TensorParallelError: a worker has failed, or the group is closed.
        """
        with self._lock:
            ops, self._pending = [*self._pending, (name, args)], []
        self._send(("run", ops))

    def defer(self, name: str, *args: Any) -> None:
        """Queue ``runner.<name>(*args)`` (no collective inside) for the workers' next message."""
        with self._lock:
            self._pending.append((name, args))

    def query(self, name: str, *args: Any) -> list[Any]:
        """Every worker's ``runner.<name>(*args)``, by rank 1 … N−1 (the deferred bookkeeping runs first).

        Raises:
            TensorParallelError: a worker has failed, or the group is closed.
        """
        with self._lock:
            ops, self._pending = [*self._pending, (name, args)], []
        self._send(("query", ops))
        return [self._receive(rank, pipe, COLLECTIVE_TIMEOUT_SECONDS)[1] for rank, pipe in enumerate(self.pipes, 1)]

    def _send(self, message: Any) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        if self.is_closed:
            raise TensorParallelError("the tensor-parallel group is closed (its workers have stopped)")
        for rank, pipe in enumerate(self.pipes, start=1):
            try:
                pipe.send(message)
            except (BrokenPipeError, ConnectionError, EOFError, OSError) as error:
                raise TensorParallelError(self.failure or f"tensor-parallel rank {rank} is gone ({error})") from error

    def _receive(self, rank: int, pipe: Any, timeout: float) -> Any:
        process = self.processes[rank - 1]
        ready = multiprocessing.connection.wait([pipe, process.sentinel], timeout)
        if pipe in ready:
            with contextlib.suppress(EOFError, OSError):
                return pipe.recv()
        if not ready:
            raise TensorParallelError(f"tensor-parallel rank {rank} did not answer within {timeout:.0f} s")
        process.join(1)
        raise TensorParallelError(self.failure or exit_message(rank, process))

    # ---- failures and the end ----------------------------------------------------------------------

    def add_failure_listener(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(message)`` (from the watching thread) when a worker exits; at once if one has."""
        self._ranks.listeners.append(listener)
        if self.failure is not None:
            listener(self.failure)

    def close(self) -> None:
        """Stop the workers (asked first, then killed after :data:`STOP_TIMEOUT_SECONDS`) and destroy the
        process group. Idempotent; later messages raise :class:`TensorParallelError`."""
        self._finalizer()


def _watch(ranks: _Ranks) -> None:
    """The watching thread: wait until a worker exits; unless the group is closing, record the failure
    and tell the listeners."""
    sentinels = {process.sentinel: rank for rank, process in enumerate(ranks.processes, start=1)}
    if not sentinels:
        return
    ended = multiprocessing.connection.wait(list(sentinels))
    if ranks.closing:
        return
    rank = sentinels[ended[0]]
    process = ranks.processes[rank - 1]
    process.join(1)
    ranks.failure = exit_message(rank, process)
    logger.error("%s: the engine cannot go on", ranks.failure)
    for listener in list(ranks.listeners):
        with contextlib.suppress(Exception):
            listener(ranks.failure)


def _shut_down(ranks: _Ranks) -> None:
    """Ask every worker to stop, kill the ones that do not, close the pipes and destroy the process group."""
    import torch.distributed as dist

    ranks.closing = True
    for pipe in ranks.pipes:
        with contextlib.suppress(Exception):
            pipe.send(("stop", None))
    for process in ranks.processes:
        process.join(STOP_TIMEOUT_SECONDS)
        if process.is_alive():
            process.kill()
            process.join(5)
    for pipe in ranks.pipes:
        with contextlib.suppress(Exception):
            pipe.close()
    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()
