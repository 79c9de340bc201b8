"""Tensor parallelism across processes: rank 0 schedules, every rank runs the target's forwards on its shard.

``--tensor-parallel-size N`` (:attr:`EngineConfig.tensor_parallel_size`) starts N − 1 worker processes
(``torch.multiprocessing``, spawn) beside the engine's own, which is rank 0. All N join one
``torch.distributed`` process group (NCCL on CUDA, gloo on CPU) for the collectives inside the forwards
(:mod:`dflash2.models.tensor_parallel`); each loads the target and keeps its shard.

Rank 0 alone runs the scheduler, the drafter (which it keeps whole: it is small), the selector, the
adaptive policy and every sampling decision. Its :class:`~dflash2.runner.ModelRunner` sends each target
forward — prefill, verify (chains and token trees) — to the workers before running it itself, so every rank
runs the same forwards in the same order; the K/V bookkeeping that touches no collective (a tree's
commit, a prefix copy, a freed slot) rides along with the next forward's message. Messages go
over one ``multiprocessing`` pipe per worker: a worker waits on it without a timeout however long the
server idles, and sees end-of-file when rank 0 exits.

Failures: a thread on rank 0 watches the workers; when one exits, :attr:`TensorParallelGroup.failure`
names its rank and exit code, listeners are told (the server stops with that error), and the next
forward raises :class:`TensorParallelError` instead of waiting. A collective that waits on a dead peer
fails when gloo or NCCL sees the peer's connection close, or at the group's timeout
(:data:`COLLECTIVE_TIMEOUT_SECONDS`).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import logging
import multiprocessing.connection
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dflash2.models.tensor_parallel import ShardInfo
from dflash2.runner.settings import RunnerSpec

if TYPE_CHECKING:
    from dflash2.config import EngineConfig
    from dflash2.runner import ModelRunner

logger = logging.getLogger(__name__)

# A collective waits this long for its peers before it fails (torch.distributed's process-group timeout).
COLLECTIVE_TIMEOUT_SECONDS = 300
# Rank 0 waits this long for a worker to load its shard and build its runner.
START_TIMEOUT_SECONDS = 1800
# ModelRunner methods a worker runs when rank 0 asks (the forwards, and the cache bookkeeping).
WORKER_METHODS = frozenset({"prefill", "verify", "commit", "copy_prefix", "free"})


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed (its message names the rank); the engine cannot go on."""


def backend_for(device: torch.device) -> str:
    """The ``torch.distributed`` backend for a device: NCCL on CUDA, gloo elsewhere."""
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device rank ``rank`` runs on: ``cuda:rank`` on CUDA (one GPU per rank), else ``device``."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def threads_per_rank(config: EngineConfig) -> int:
    """CPU threads each rank uses: ``--threads`` (or the CPUs this process may use) split over the ranks."""
    from dflash2.platform import available_cpus

    total = config.num_threads or available_cpus()
    return max(1, total // config.tensor_parallel_size)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_process_group(device: torch.device, rank: int, world_size: int, store: Any) -> Any:
    """Join the ranks' process group over ``store`` (blocks until all have joined); returns it."""
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device),
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_SECONDS),
    )
    return dist.group.WORLD


def _store(port: int, world_size: int, is_master: bool) -> Any:
    """The ranks' rendezvous: a ``torch.distributed.TCPStore`` on 127.0.0.1 that rank 0 serves."""
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1",
        port,
        world_size,
        is_master=is_master,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_SECONDS),
    )


class TensorParallelGroup:
    """Rank 0's side of tensor parallelism: the worker processes, their pipes, and watching them.

    Build it with :meth:`launch`. The runner calls :meth:`run` before each target forward and
    :meth:`defer` for bookkeeping; :meth:`query` asks every worker for a value (tests, health).

    Attributes:
        shard: rank 0's place in the group (for :func:`~dflash2.models.tensor_parallel.shard_target`).
        failure: None while every worker runs; else what happened, naming the rank.
    """

    def __init__(self, shard: ShardInfo, processes: list[Any], pipes: list[Any]) -> None:
        self.shard = shard
        self.processes, self.pipes = processes, pipes
        self.failure: str | None = None
        self._pending: list[tuple[str, tuple[Any, ...]]] = []
        self._listeners: list[Callable[[str], None]] = []
        self._closing = False
        self._lock = threading.Lock()
        self._watcher = threading.Thread(target=self._watch, name="dflash2-tp-watch", daemon=True)
        self._watcher.start()
        atexit.register(self.close)

    @property
    def world_size(self) -> int:
        """N, the ranks (this process included)."""
        return self.shard.world_size

    @classmethod
    def launch(cls, config: EngineConfig) -> TensorParallelGroup:
        """Start ranks 1 … N−1 for ``config`` and join the process group as rank 0.

        The workers load the target and shard it meanwhile; they build their runners when rank 0's
        runner sends its settings (:meth:`start_runners`).

        Raises:
            ValueError: ``config.tensor_parallel_size`` is more than the GPUs on a CUDA machine.
        """
        import torch.multiprocessing as mp

        world = config.tensor_parallel_size
        device = config.torch_device
        if device.type == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(
                f"--tensor-parallel-size {world} needs {world} GPUs (one per rank); this machine has "
                f"{torch.cuda.device_count()}"
            )
        port = _free_port()
        store = _store(port, world, is_master=True)
        context = mp.get_context("spawn")
        processes, pipes = [], []
        for rank in range(1, world):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=worker_main,
                args=(config, rank, port, theirs),
                name=f"dflash2-tp{rank}",
                daemon=False,  # a worker compiles graphs, which may start processes of its own
            )
            process.start()
            theirs.close()
            processes.append(process)
            pipes.append(ours)
        logger.info("tensor parallelism: %d ranks (%s), joining the process group", world, backend_for(device))
        try:
            _wait_joined(store, processes)
            group = init_process_group(rank_device(device, 0), 0, world, store)
        except BaseException:
            for process in processes:
                process.kill()
            raise
        return cls(ShardInfo(0, world, group), processes, pipes)

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
            TensorParallelError: a worker has failed.
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
            TensorParallelError: a worker has failed.
        """
        with self._lock:
            ops, self._pending = [*self._pending, (name, args)], []
        self._send(("query", ops))
        return [self._receive(rank, pipe, COLLECTIVE_TIMEOUT_SECONDS)[1] for rank, pipe in enumerate(self.pipes, 1)]

    def _send(self, message: Any) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)
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
        raise TensorParallelError(self.failure or _exit_message(rank, process))

    # ---- failures --------------------------------------------------------------------------------

    def add_failure_listener(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(message)`` (from the watching thread) when a worker exits; at once if one has."""
        self._listeners.append(listener)
        if self.failure is not None:
            listener(self.failure)

    def _watch(self) -> None:
        sentinels = {process.sentinel: rank for rank, process in enumerate(self.processes, start=1)}
        if not sentinels:
            return
        ended = multiprocessing.connection.wait(list(sentinels))
        if self._closing:
            return
        rank = sentinels[ended[0]]
        process = self.processes[rank - 1]
        process.join(1)
        self.failure = _exit_message(rank, process)
        logger.error("%s: the engine cannot go on", self.failure)
        for listener in list(self._listeners):
            with contextlib.suppress(Exception):
                listener(self.failure)

    def close(self) -> None:
        """Stop the workers (asked first, then terminated) and leave the process group. Idempotent."""
        if self._closing:
            return
        self._closing = True
        for pipe in self.pipes:
            with contextlib.suppress(Exception):
                pipe.send(("stop", None))
        for process in self.processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(5)
        import torch.distributed as dist

        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()


def _wait_joined(store: Any, processes: list[Any]) -> None:
    """Wait until every worker has reached the store (each sets ``joined/<rank>``), failing at once when
    one exits first (an import error in a spawned process, say) instead of at the store's timeout.

    Raises:
        TensorParallelError: a worker exited, or did not join within :data:`START_TIMEOUT_SECONDS`.
    """
    keys = [f"joined/{rank}" for rank in range(1, len(processes) + 1)]
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while not store.check(keys):
        for rank, process in enumerate(processes, start=1):
            if not process.is_alive():
                process.join(1)
                raise TensorParallelError(_exit_message(rank, process) + " before it joined the process group")
        if time.monotonic() > deadline:
            raise TensorParallelError(f"the tensor-parallel workers did not start within {START_TIMEOUT_SECONDS} s")
        time.sleep(0.05)


def _exit_message(rank: int, process: Any) -> str:
    code = process.exitcode
    how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
    return f"tensor-parallel worker rank {rank} (pid {process.pid}) {how}"


# ---- the workers ------------------------------------------------------------------------------------


def load_shard(config: EngineConfig, shard: ShardInfo, device: torch.device) -> Any:
    """Load ``config``'s target on the CPU, keep ``shard``'s part and move it to ``device``.

    Raises:
        dflash2.models.source.ModelSourceError / ModelLoadError.
    """
    from dflash2.loading import resolve_dtype
    from dflash2.models import loader, source
    from dflash2.models.llama import TargetModel
    from dflash2.models.tensor_parallel import shard_target

    folder = source.resolve_model(config.model)
    target = loader.load_target(folder, resolve_dtype(config), torch.device("cpu"))
    assert isinstance(target, TargetModel)  # Engine.from_config checked the family before starting workers
    return shard_target(target, shard).to(device)


def worker_main(config: EngineConfig, rank: int, port: int, pipe: Any) -> None:
    """A worker rank's process: join the group, load the shard, build the runner when rank 0 says how,
    then run what rank 0 sends until it says stop or its pipe closes. Exits non-zero on an error."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
    torch.set_num_threads(threads_per_rank(config))
    device = rank_device(config.torch_device, rank)
    try:
        store = _store(port, config.tensor_parallel_size, is_master=False)
        store.set(f"joined/{rank}", "1")
        group = init_process_group(device, rank, config.tensor_parallel_size, store)
        target = load_shard(config, ShardInfo(rank, config.tensor_parallel_size, group), device)
        message = pipe.recv()
        if message[0] != "build":
            return
        runner = _build_runner(config, target, message[1])
    except EOFError:
        return  # rank 0 went away while this one started
    except BaseException as error:
        logger.exception("starting tensor-parallel rank %d failed", rank)
        with contextlib.suppress(Exception):
            pipe.send(("error", f"{type(error).__name__}: {error}"))
        os._exit(1)
    pipe.send(("ready", None))
    try:
        _serve(runner, pipe)
    except BaseException:
        logger.exception("tensor-parallel rank %d failed", rank)
        os._exit(1)
    os._exit(0)  # skip the interpreter's teardown of the process group and the compiled graphs


def _build_runner(config: EngineConfig, target: Any, spec: RunnerSpec) -> ModelRunner:
    from dflash2.runner import ModelRunner

    return ModelRunner(target, None, spec)


def _serve(runner: ModelRunner, pipe: Any) -> None:
    """Run rank 0's messages: ``("run", ops)``, ``("query", ops)`` (the last op's result goes back) and
    ``("stop", None)``; return at stop or when the pipe closes."""
    while True:
        try:
            kind, ops = pipe.recv()
        except EOFError:
            return
        if kind == "stop":
            return
        result = None
        with torch.inference_mode():
            for name, args in ops:
                if name not in WORKER_METHODS:
                    raise ValueError(f"rank 0 asked for an unknown runner method {name!r}")
                result = getattr(runner, name)(*args)
        if kind == "query":
            pipe.send(("result", result))
