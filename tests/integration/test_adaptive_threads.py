"""The engine under its thread governor: the count it chooses is the count steps run with, and
the tokens are the ones a fixed count gives (float32, tiny models)."""

from __future__ import annotations

import pytest
import torch

from dflash2 import LLM, SamplingParams
from dflash2.threads import ThreadGovernor
from tests.tiny import tiny_drafter, tiny_engine, tiny_target

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10] * 20]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


def test_engine_has_a_governor_where_it_can_choose(target):
    torch.set_num_threads(2)
    assert isinstance(tiny_engine(target, None, adaptive_threads=True).threads, ThreadGovernor)
    assert tiny_engine(target, None).threads is None  # --no-adaptive-threads
    torch.set_num_threads(1)
    assert tiny_engine(target, None, adaptive_threads=True).threads is None  # nothing to choose from


def test_busy_cores_run_steps_at_one_thread_with_the_same_tokens(target):
    torch.set_num_threads(2)
    drafter = tiny_drafter(target, 2, 4)
    reference = [c.token_ids for c in LLM.from_engine(tiny_engine(target, drafter, 4)).generate(PROMPTS, GREEDY)]
    engine = tiny_engine(target, drafter, 4, adaptive_threads=True)
    others, now = [0.0], [0.0]  # cores used by other processes; the governor's clock (seconds)
    engine.threads = ThreadGovernor(
        2, set_threads=torch.set_num_threads, load=lambda: others[0], num_cpus=2, clock=lambda: now[0]
    )
    # The engine's own governor read the real machine when it was built and may have moved torch to
    # 1 thread (busy cores); the stand-in starts from 2, so torch must too.
    torch.set_num_threads(2)
    counts: list[int] = []
    llm = LLM.from_engine(engine)

    def generate() -> list[list[int] | None]:
        ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            result = engine.step()
            counts.append(result.stats.num_threads)
            assert result.stats.num_threads == torch.get_num_threads()
            for output in result.outputs:
                done.setdefault(output.request_id, []).extend(output.new_token_ids)
        return [done.get(i) for i in ids]

    assert generate() == reference  # (a step that ran slow, the machine being busy, may have probed 1 thread)
    others[0], now[0] = 1.9, 1.0  # other processes take both cores: the next load reading moves the engine down
    counts.clear()
    assert generate() == reference
    assert counts[0] == 1 and set(counts) == {1}
    assert engine.threads.current == 1 and engine.threads.switches >= 1
    assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY)] == reference


def test_a_seeded_request_runs_at_the_configured_count_on_busy_cores(target):
    """Busy cores move the governor to 1 thread; a seeded request's steps (prefill included) still run at
    2, as on idle cores, so its rounding does not follow the load; the unseeded ones go on at 1."""
    engine = tiny_engine(target, tiny_drafter(target, 2, 4), 4, adaptive_threads=True)
    applied: list[int] = []
    now = [0.0]
    engine.threads = ThreadGovernor(2, set_threads=applied.append, load=lambda: 1.9, num_cpus=2, clock=lambda: now[0])
    llm = LLM.from_engine(engine)
    counts: list[int] = []
    llm.generate(PROMPTS[0], GREEDY, on_step=lambda r: counts.append(r.stats.num_threads))
    assert engine.threads.current == 1 and set(counts) == {1}
    counts.clear()
    seeded = SamplingParams(max_tokens=24, temperature=1.0, seed=5)
    llm.generate(PROMPTS[1], seeded, on_step=lambda r: counts.append(r.stats.num_threads))
    assert set(counts) == {2} and applied[-1] == 2
    counts.clear()
    llm.generate(PROMPTS[0], GREEDY, on_step=lambda r: counts.append(r.stats.num_threads))
    assert set(counts) == {1} and engine.threads.current == 1
