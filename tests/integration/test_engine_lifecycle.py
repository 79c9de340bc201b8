"""An engine's lifetime: ``close()`` and ``with`` release what it holds and later calls raise; engines one
after another in one process (tensor-parallel or not, closed or dropped); a script that builds a
tensor-parallel engine without ``if __name__ == "__main__":`` is told so."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest

from dflash2 import LLM, SamplingParams
from dflash2.errors import EngineClosedError
from dflash2.runner import background
from dflash2.runner.background import BackgroundCompiler
from dflash2.runner.tensor_parallel import TensorParallelError
from tests.bench.tiny_folder import write_tiny_model
from tests.tiny import tiny_drafter, tiny_engine, tiny_target

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
COMMON = {"dtype": "float32", "max_model_len": 64, "enforce_eager": True, "adaptive_threads": False}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("lifecycle") / "model")


def test_close_releases_the_models_and_later_calls_raise():
    target = tiny_target(vocab_size=32, seed=3)
    engine = tiny_engine(target, tiny_drafter(target, 2, 4, seed=1), block_size=4)
    weights = weakref.ref(next(target.parameters()))
    cache = weakref.ref(engine.runner.target_cache)
    del target
    with LLM.from_engine(engine) as llm:
        first = llm.generate([[1, 2, 3]], GREEDY)[0].token_ids
        engine.add_request([4, 5, 6], GREEDY)  # queued, never run: dropped by close
    assert first is not None and len(first) == 8
    assert llm.is_closed and engine.is_closed and not engine.has_unfinished_requests()
    llm.close()  # idempotent
    gc.collect()
    assert weights() is None and cache() is None
    with pytest.raises(EngineClosedError, match="closed"):
        llm.generate([[1, 2, 3]], GREEDY)
    with pytest.raises(EngineClosedError):
        next(llm.stream([[1, 2, 3]], GREEDY))
    for call in (engine.step, lambda: engine.abort("x"), lambda: engine.kv_cache_usage):
        with pytest.raises(EngineClosedError):
            call()
    with pytest.raises(AttributeError):  # a name that never existed is still an AttributeError
        engine.no_such_attribute  # noqa: B018


def test_a_dropped_compile_worker_is_stopped(monkeypatch):
    """The background compiler's process ends when the compiler is collected (its log thread does not
    keep it alive)."""
    monkeypatch.setattr(background, "worker_command", lambda: [sys.executable, "-c", "import time; time.sleep(60)"])
    compiler = BackgroundCompiler({})
    process = compiler.process
    assert process.poll() is None
    del compiler
    gc.collect()
    assert process.wait(timeout=15) != 0  # terminated, not finished


def _workers(llm: LLM) -> list:
    group = llm.engine.tensor_parallel
    return [] if group is None else list(group.processes)


def test_one_then_two_then_two_ranks_in_with_blocks(model):
    outputs, workers = [], []
    for world_size in (1, 2, 2):
        with LLM(str(model), tensor_parallel_size=world_size, **COMMON) as llm:
            outputs.append(llm.generate("hello", GREEDY)[0].token_ids)
            workers.append(_workers(llm))
            if world_size == 2 and len(workers) == 2:  # one tensor-parallel engine at a time, said clearly
                with pytest.raises(TensorParallelError, match="another tensor-parallel engine is open"):
                    LLM(str(model), tensor_parallel_size=2, **COMMON)
        assert all(not p.is_alive() for p in workers[-1])
    assert outputs[0] == outputs[1] == outputs[2]
    assert [len(w) for w in workers] == [0, 1, 1] and workers[1][0].pid != workers[2][0].pid


def test_one_then_two_then_two_ranks_dropped_without_close(model):
    """As a script would: ``del llm`` between engines, no ``close`` and no explicit garbage collection."""
    outputs, workers = [], []
    for world_size in (1, 2, 2):
        llm = LLM(str(model), tensor_parallel_size=world_size, **COMMON)
        outputs.append(llm.generate("hello", GREEDY)[0].token_ids)
        workers.append(_workers(llm))
        del llm
    assert outputs[0] == outputs[1] == outputs[2]
    assert not workers[1][0].is_alive()  # stopped when the third engine started
    gc.collect()
    workers[2][0].join(15)
    assert not workers[2][0].is_alive()  # stopped when its engine was collected


def test_a_script_without_a_main_guard_is_told_to_add_one(model, tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(f"""\
            from dflash2 import LLM

            llm = LLM({str(model)!r}, tensor_parallel_size=2, dtype="float32", max_model_len=64, enforce_eager=True)
            print("built")
            """)
    )
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0 and "built" not in result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("dflash2.runner.tensor_parallel.TensorParallelError"), result.stderr[-3000:]
    assert str(script) in last and 'if __name__ == "__main__":' in last
    assert "before it joined the process group" not in result.stderr


def test_the_same_script_with_a_main_guard_runs(model, tmp_path):
    """The control: the fix the error names works."""
    script = tmp_path / "guarded.py"
    script.write_text(
        textwrap.dedent(f"""\
            from dflash2 import LLM, SamplingParams

            if __name__ == "__main__":
                with LLM({str(model)!r}, tensor_parallel_size=2, dtype="float32", max_model_len=64,
                         enforce_eager=True) as llm:
                    print(len(llm.generate("hi", SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids))
            """)
    )
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "4"
