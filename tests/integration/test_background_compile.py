"""Background compilation (dflash2/runner/background.py): the engine serves with its eager forwards at
once, a worker process compiles and saves the graphs, and the engine switches to them between two
steps. Float32 greedy output of a request that spans the switch equals the target's own (tiny models
saved as folders, so that the worker loads the same models; its graphs compile in seconds each).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from dflash2.config import EngineConfig
from dflash2.engine import Engine
from dflash2.runner import background
from dflash2.sampling import SamplingParams
from tests.bench.tiny_folder import write_tiny_drafter, write_tiny_model

PROMPT = [5, 17, 33, 8, 90, 41, 12, 77, 3, 64]
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
WORKER_TIMEOUT = 900  # seconds: the worker runs only on otherwise idle cores


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return write_tiny_model(root / "model"), write_tiny_drafter(root / "drafter")


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dflash2 cache of this module's tests: empty at first, so the first worker compiles."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def cache(module_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This module's cache for the engine and its worker (which inherits the environment). The worker
    keeps the normal CPU priority here: at the idle priority a test on cores busy with other work would
    wait for them to free up."""
    monkeypatch.setenv("DFLASH2_CACHE", str(module_cache))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(background, "_lower_priority", lambda pid: None)
    return module_cache


@pytest.fixture
def empty_cache(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache of its own: no saved graph to load."""
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_worker_runs_at_the_idle_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the server does to the worker right after starting it (a stand-in process here)."""
    monkeypatch.setattr(background, "worker_command", lambda: [sys.executable, "-c", "import time; time.sleep(30)"])
    compiler = background.BackgroundCompiler({"config": {}})
    try:
        if hasattr(os, "SCHED_IDLE"):
            assert os.sched_getscheduler(compiler.pid) == os.SCHED_IDLE
        assert os.getpriority(os.PRIO_PROCESS, compiler.pid) == 19
    finally:
        compiler.stop()
    assert compiler.poll() is not None


def config(folders: tuple[Path, Path], **overrides: object) -> EngineConfig:
    model, drafter = folders
    settings: dict = dict(
        model=str(model),
        drafter=str(drafter),
        device="cpu",
        dtype="float32",
        max_num_seqs=1,  # five graphs: batch 1 only
        max_model_len=256,
        adaptive_threads=False,
        num_threads=1,
    )
    return EngineConfig(**{**settings, **overrides})


@pytest.fixture(scope="module")
def reference(folders: tuple[Path, Path]) -> list[int]:
    """Target-only greedy decoding (autoregressive, eager)."""
    engine = Engine.from_config(config(folders, block_size=1, enforce_eager=True))
    return run_to_end(engine, [])[0]


def run_to_end(engine: Engine, compiled_at_step: list[bool]) -> tuple[list[int], int]:
    """Add the request and step until it finishes; ``compiled_at_step`` gets, per step, whether the
    verify forward ran compiled. Returns the token ids and the number of steps."""
    request_id = engine.add_request(PROMPT, GREEDY)
    token_ids: list[int] = []
    steps = 0
    while engine.has_unfinished_requests():
        result = engine.step()
        steps += 1
        compiled_at_step.append(engine.runner.compiled)
        for output in result.outputs:
            assert output.request_id == request_id and output.error is None
            token_ids += output.new_token_ids
    return token_ids, steps


def new_tokens(engine: Engine) -> list[int]:
    """One step's new tokens (one request running)."""
    outputs = engine.step().outputs
    assert all(o.error is None for o in outputs)
    return [t for o in outputs for t in o.new_token_ids]


def test_serves_eagerly_then_switches_to_compiled_graphs_between_steps(folders, cache, reference) -> None:
    """The first start: nothing saved, the worker compiles every graph."""
    engine = Engine.from_config(config(folders, background_compile=True))
    try:
        assert engine.compile_status.state == "compiling" and engine.compiler is not None
        assert not engine.runner.compiled and engine.runner.graphs_deferred
        engine.add_request(PROMPT, GREEDY)
        token_ids: list[int] = []
        for _ in range(3):  # eager steps while the worker compiles
            token_ids += new_tokens(engine)
        assert not engine.runner.compiled and token_ids
        assert engine.compiler.process.wait(timeout=WORKER_TIMEOUT) == 0
        assert not engine.runner.compiled  # the switch waits for a step boundary
        compiled_at_step: list[bool] = []
        while engine.has_unfinished_requests():
            token_ids += new_tokens(engine)
            compiled_at_step.append(engine.runner.compiled)
        assert compiled_at_step and all(compiled_at_step)  # the next step ran on the loaded graphs
        assert token_ids == reference  # one request across the switch: the target's own tokens
        status = engine.compile_status
        assert status.is_compiled and status.num_graphs == len(engine.runner.compile_times) > 0
        assert status.seconds is not None and status.seconds > 0 and status.error is None
        assert set(engine.runner.graph_sources.values()) == {"loaded"}  # the worker compiled, this process loaded
        assert engine.runner.drafter_compiled and engine.runner.drafting.context_forward is not None

        # Idle: the adaptive policy's step costs are timed again on the compiled forwards.
        assert engine.compile_pending
        before = engine.policy.cost_model
        engine.poll_compile(idle=True)
        assert not engine.compile_pending and engine.policy.cost_model is not before
        assert run_to_end(engine, compiled_at_step)[0] == reference
    finally:
        engine.close()


def test_a_second_start_loads_the_saved_graphs(folders, cache, reference, caplog) -> None:
    """The worker of a start whose graphs were saved (by the test above) loads them in seconds; the engine
    then loads them too."""
    caplog.set_level("INFO", logger="dflash2.runner.background")  # the worker's lines, relayed
    engine = Engine.from_config(config(folders, background_compile=True))
    try:
        assert engine.compiler is not None and engine.compiler.process.wait(timeout=WORKER_TIMEOUT) == 0
        compiled_at_step: list[bool] = []
        assert run_to_end(engine, compiled_at_step)[0] == reference
        relayed = [r.getMessage() for r in caplog.records if r.name == "dflash2.runner.background"]
        assert any("compile worker: dflash2.runner.compile: loaded target graph" in m for m in relayed), relayed
        assert not any("compiled target graph" in m for m in relayed)
        assert all(compiled_at_step) and engine.compile_status.is_compiled
    finally:
        engine.close()


def test_a_failed_worker_keeps_the_engine_serving_eagerly(folders, empty_cache, reference, monkeypatch, caplog):
    fail = "import sys; sys.stdin.read(); print('ERROR dflash2: out of memory', file=sys.stderr); sys.exit(3)"
    monkeypatch.setattr(background, "worker_command", lambda: [sys.executable, "-c", fail])
    engine = Engine.from_config(config(folders, background_compile=True))
    try:
        assert engine.compiler is not None and engine.compiler.process.wait(timeout=60) == 3
        compiled_at_step: list[bool] = []
        with caplog.at_level("ERROR"):
            assert run_to_end(engine, compiled_at_step)[0] == reference
        assert not any(compiled_at_step) and not engine.runner.compiled
        status = engine.compile_status
        assert status.state == "failed" and status.num_graphs == 0
        assert "exit status 3" in status.error and "out of memory" in status.error
        assert any("background compilation failed" in r.message for r in caplog.records if r.levelname == "ERROR")
        assert not engine.compile_pending  # nothing left to poll: eager for good
    finally:
        engine.close()


def test_enforce_eager_starts_no_worker(folders, cache) -> None:
    eager = Engine.from_config(config(folders, background_compile=True, enforce_eager=True))
    assert eager.compiler is None and eager.compile_status.state == "eager" and not eager.compile_pending
