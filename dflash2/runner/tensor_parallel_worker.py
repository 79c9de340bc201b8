"""Tensor parallelism's processes, the worker ranks: starting them from rank 0, and what each one runs.

:func:`start_workers` (rank 0) starts ranks 1 … N−1 with ``torch.multiprocessing``'s spawn, serves the
group's rendezvous (a ``torch.distributed.TCPStore`` on 127.0.0.1, on a port the system picks) and joins
the process group; it returns the :class:`~dflash2.runner.tensor_parallel.TensorParallelGroup` that the
runner sends forwards to. :func:`worker_main` is a worker's process: join the group, load the target's
shard, build a :class:`~dflash2.runner.ModelRunner` when rank 0 says how, then run rank 0's messages.

NOTE: spawn starts each worker as a fresh interpreter that imports the main module (the script) before
it runs :func:`worker_main`. A script that builds a tensor-parallel engine at module level, outside
``if __name__ == "__main__":``, would build one again in every worker; :func:`start_workers` sees that
case in the worker (:data:`MAIN_MODULE_EXIT_CODE`) and rank 0 raises an error that names the fix.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing
import os
import sys
import time
from typing import TYPE_CHECKING, Any

import torch

from dflash2.models.tensor_parallel import ShardInfo
from dflash2.runner.model_runner import ModelRunner
from dflash2.runner.settings import RunnerSpec
from dflash2.runner.tensor_parallel import (
    COLLECTIVE_TIMEOUT_SECONDS,
    START_TIMEOUT_SECONDS,
    TensorParallelError,
    TensorParallelGroup,
    check_no_open_group,
    exit_message,
    threads_per_rank,
)

if TYPE_CHECKING:
    from dflash2.config import EngineConfig

logger = logging.getLogger(__name__)

# ModelRunner methods a worker runs when rank 0 asks (the forwards, and the cache bookkeeping).
WORKER_METHODS = frozenset({"prefill", "verify", "commit", "copy_prefix", "free"})
# A spawned process that reached start_workers while importing the main module exits with this code.
MAIN_MODULE_EXIT_CODE = 87


def backend_for(device: torch.device) -> str:
    """The ``torch.distributed`` backend for a device: NCCL on CUDA, gloo elsewhere."""
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device rank ``rank`` runs on: ``cuda:rank`` on CUDA (one GPU per rank), else ``device``."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


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
    """The ranks' rendezvous: a ``torch.distributed.TCPStore`` on 127.0.0.1 that rank 0 serves (port 0:
    one the system picks, read back from ``store.port``)."""
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1",
        port,
        world_size,
        is_master=is_master,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_SECONDS),
    )


def is_importing_main_in_spawned_process() -> bool:
    """True while this process is one that multiprocessing's spawn started and it is still importing the
    main module (the bootstrap phase in which CPython itself refuses to start processes)."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def main_module_error() -> TensorParallelError:
    """The error rank 0 raises when its workers ran the script's engine construction again."""
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None) or "the main module"
    return TensorParallelError(
        f"the tensor-parallel worker processes build an engine again while they import {script}: a worker "
        "process starts a fresh Python interpreter (multiprocessing's spawn) that imports the main module, "
        "and this one builds the engine at module level. Put the code that builds the engine under "
        '`if __name__ == "__main__":` in that script'
    )


def start_workers(config: EngineConfig) -> TensorParallelGroup:
    """Start ranks 1 … N−1 for ``config`` and join the process group as rank 0.

    The workers load the target and shard it meanwhile; they build their runners when rank 0's
    runner sends its settings (:meth:`~TensorParallelGroup.start_runners`).

    Raises:
        ValueError: ``config.tensor_parallel_size`` is more than the GPUs on a CUDA machine.
        TensorParallelError: another group is open in this process (close its engine first); a worker
            exited before it joined — :func:`main_module_error` when the script builds the engine
            outside ``if __name__ == "__main__":``.
    """
    import torch.multiprocessing as mp

    if is_importing_main_in_spawned_process():
        # This process is a worker (or any spawned child) re-running the script's module-level code:
        # exit at once with a code rank 0 recognises, instead of starting workers of its own.
        print(
            "dflash2: a spawned process is building a tensor-parallel engine while it imports the main "
            'module; build the engine under `if __name__ == "__main__":`',
            file=sys.stderr,
        )
        raise SystemExit(MAIN_MODULE_EXIT_CODE)
    world = config.tensor_parallel_size
    device = config.torch_device
    if device.type == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(
            f"--tensor-parallel-size {world} needs {world} GPUs (one per rank); this machine has "
            f"{torch.cuda.device_count()}"
        )
    check_no_open_group()
    store = _store(0, world, is_master=True)
    context = mp.get_context("spawn")
    processes, pipes = [], []
    for rank in range(1, world):
        ours, theirs = context.Pipe()
        process = context.Process(
            target=worker_main,
            args=(config, rank, store.port, theirs),
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
            process.join(5)
        for pipe in pipes:
            pipe.close()
        raise
    return TensorParallelGroup(ShardInfo(0, world, group), processes, pipes)


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
                if process.exitcode == MAIN_MODULE_EXIT_CODE:
                    raise main_module_error()
                raise TensorParallelError(exit_message(rank, process) + " before it joined the process group")
        if time.monotonic() > deadline:
            raise TensorParallelError(f"the tensor-parallel workers did not start within {START_TIMEOUT_SECONDS} s")
        time.sleep(0.05)


def load_shard(config: EngineConfig, shard: ShardInfo, device: torch.device) -> Any:
    """Load ``config``'s target on the CPU, keep ``shard``'s part and move it to ``device``.

    Raises:
        dflash2.models.source.ModelSourceError / ModelLoadError.
    """
    from dflash2.models import loader, source
    from dflash2.models.llama import TargetModel
    from dflash2.models.tensor_parallel import shard_target
    from dflash2.runner.model_setup import resolve_dtype

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
            os._exit(0)  # rank 0 closed the group before its runner started
        runner = _build_runner(target, message[1])
    except EOFError:
        os._exit(0)  # rank 0 went away while this one started
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


def _build_runner(target: Any, spec: RunnerSpec) -> ModelRunner:
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
