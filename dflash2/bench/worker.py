"""One method per child process: the child's command loop and the parent's ``WorkerHandle``.

Each measured method lives in its own process for the whole run, so its peak RSS
(``getrusage(RUSAGE_SELF).ru_maxrss`` in the child, read at the end) is that method's alone, and
the parent can still interleave repetitions across methods. Only one child works at a time; the
others wait on a pipe, so they take no CPU.

Protocol: the parent writes one JSON command per line to the child's stdin; the child answers one
JSON line on a dedicated pipe (its stdout and stderr go to a log file, since libraries print).

NOTE: this file is run as a script and imports only the standard library at module level: a
llama.cpp child loads ``llamacpp.py`` by path and never imports torch or the dflash2 package.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import resource
import select
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, TextIO

_HERE = Path(__file__).resolve().parent
_PACKAGE_ROOT = _HERE.parent.parent  # the folder holding the dflash2 package


class WorkerError(RuntimeError):
    """A worker could not load its method, failed a command, or died."""


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


# ---- parent side --------------------------------------------------------------------------------


class WorkerHandle:
    """The parent's end of one worker process.

    Args:
        name: the method id (for messages).
        spec: what the child loads (see ``_build_runner``).
        log_path: the child's stdout and stderr.
    """

    def __init__(self, name: str, spec: dict[str, Any], log_path: Path) -> None:
        self.name = name
        self.spec = spec
        self.log_path = log_path
        self.process: subprocess.Popen[str] | None = None
        self._replies: TextIO | None = None

    def start(self) -> None:
        """Start the child (it loads its method right away)."""
        read_fd, write_fd = os.pipe()
        env = dict(os.environ)
        env["PYTHONSAFEPATH"] = "1"  # do not put this folder first on sys.path (Python ≥ 3.11)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), json.dumps(self.spec), str(write_fd)],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd,),
                env=env,
                text=True,
            )
        os.close(write_fd)
        self._replies = os.fdopen(read_fd, "r")

    def wait_ready(self, timeout: float | None = None) -> dict[str, Any]:
        """The child's load report ``{"info", "load_seconds"}``; raises ``WorkerError`` on failure."""
        return self._reply(timeout)

    def call(self, op: str, timeout: float | None = None, **payload: Any) -> dict[str, Any]:
        """Send one command and wait for its answer."""
        assert self.process is not None and self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps({"op": op, **payload}) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError as exc:
            raise WorkerError(f"{self.name}: the worker is gone\n{self.log_tail()}") from exc
        return self._reply(timeout)

    def stop(self) -> int | None:
        """Ask the child for its peak RSS, let it exit, and return the peak (None when it failed)."""
        peak = None
        if self.process is not None and self.process.poll() is None:
            try:
                peak = int(self.call("stop", timeout=60)["peak_rss_bytes"])
            except WorkerError:
                peak = None
        self.close()
        return peak

    def close(self) -> None:
        """End the child if it still runs and release the pipes."""
        if self.process is not None:
            if self.process.stdin is not None:
                self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._replies is not None:
            self._replies.close()
            self._replies = None

    @property
    def crashed(self) -> bool:
        """True when the child was killed by a signal (a segmentation fault in a peer's native code)."""
        return self.process is not None and (self.process.returncode or 0) < 0

    def exit_description(self) -> str:
        """How the child ended: ``crashed: killed by signal SIGSEGV``, ``the worker exited with 1``, …"""
        code = None if self.process is None else self.process.returncode
        if code is None:
            return "the worker exited"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = str(-code)
            return f"crashed: killed by signal {name}"
        return f"the worker exited with {code}"

    def log_tail(self, num_lines: int = 15) -> str:
        """The last lines of the child's log (for error messages)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])

    def _reply(self, timeout: float | None) -> dict[str, Any]:
        assert self._replies is not None and self.process is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            ready, _, _ = select.select([self._replies], [], [], 1.0)
            if ready:
                line = self._replies.readline()
                if not line:
                    with contextlib.suppress(subprocess.TimeoutExpired):  # still tearing down: no exit status yet
                        self.process.wait(timeout=5)
                    raise WorkerError(f"{self.name}: {self.exit_description()}\n{self.log_tail()}")
                reply = json.loads(line)
                if not reply.get("ok"):
                    raise WorkerError(f"{self.name}: {reply.get('error', 'failed')}")
                return dict(reply)
            if self.process.poll() is not None:
                raise WorkerError(f"{self.name}: {self.exit_description()}\n{self.log_tail()}")
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerError(f"{self.name}: no answer within {timeout:.0f} s")


# ---- child side -----------------------------------------------------------------------------------


def _load_sibling(name: str) -> Any:
    """Import ``<name>.py`` from this folder by path (no package import, so no torch)."""
    spec = importlib.util.spec_from_file_location(f"dflash2_bench_{name}", _HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build_runner(spec: dict[str, Any]) -> Any:
    """Load the method named by ``spec["runner"]``: ``engine``, ``transformers`` or ``llama.cpp``."""
    kind = spec["runner"]
    if kind == "llama.cpp":
        module = _load_sibling("llamacpp")
        return module.LlamaCppRunner(
            spec["gguf"], spec["n_ctx"], spec["threads"], spec["eos_token_ids"], spec["gpu"], spec["seed"]
        )
    import torch

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    if kind == "engine":
        from dflash2.bench.runners import EngineRunner
        from dflash2.config import EngineConfig

        return EngineRunner(EngineConfig(**spec["engine"]))
    if kind == "transformers":
        from dflash2.bench.runners import TransformersRunner
        from dflash2.config import DTYPES

        return TransformersRunner(
            Path(spec["folder"]),
            DTYPES[spec["dtype"]],
            torch.device(spec["device"]),
            spec["eos_token_ids"],
            int(spec.get("prompt_lookup_tokens", 0)),
        )
    raise ValueError(f"unknown runner {kind!r}")


def _describe(runner: Any) -> dict[str, Any]:
    info = dict(runner.describe())
    if "torch" in sys.modules:
        info["torch_threads"] = sys.modules["torch"].get_num_threads()
    return info


def _handle(runner: Any, command: dict[str, Any]) -> dict[str, Any]:
    op = command["op"]
    if op == "generate":
        samples = []
        for ids, seed in zip(command["prompt_ids"], command["seeds"]):
            sample = runner.generate(ids, int(command["max_tokens"]), float(command["temperature"]), int(seed))
            samples.append(sample if isinstance(sample, dict) else sample.to_dict())
        return {"samples": samples}
    if op == "conv_probe":
        from dflash2.bench.conv_probe import measure_conv_overhead

        return {"probe": measure_conv_overhead(runner, command["prompt_ids"], int(command["max_tokens"]))}
    raise ValueError(f"unknown command {op!r}")


def main(argv: list[str]) -> int:
    """Child entry: ``worker.py SPEC_JSON REPLY_FD``; load, report, then serve commands until ``stop``."""
    spec, replies = json.loads(argv[0]), os.fdopen(int(argv[1]), "w")

    def send(message: dict[str, Any]) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    start = time.perf_counter()
    try:
        runner = _build_runner(spec)
        send({"ok": True, "info": _describe(runner), "load_seconds": time.perf_counter() - start})
    except Exception as exc:
        traceback.print_exc()
        send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return 1
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "stop":
            send({"ok": True, "peak_rss_bytes": peak_rss_bytes()})
            return 0
        try:
            send({"ok": True, **_handle(runner, command)})
        except Exception as exc:
            traceback.print_exc()
            send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
