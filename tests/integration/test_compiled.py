"""The compiled model runner gives the eager path's tokens and distributions (float32, tiny models).

Compilation takes seconds per graph, so each engine here is built once per module.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from dflash2 import LLM, SamplingParams
from dflash2.precompiled import PrecompiledForward
from dflash2.runner import ModelRunner, key_length
from tests.integration.test_engine_sampling import PROMPT, SAMPLING_CASES, VOCAB, _chi_square_pvalue, _exact_joint
from tests.tiny import oracle_drafter, tiny_drafter, tiny_engine, tiny_target

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10] * 20, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
# 37 tokens: rows near max_tokens verify shorter blocks, so padded rows are exercised.
GREEDY = SamplingParams(max_tokens=37, temperature=0.0)


def compiled(engine):
    """The engine, whose constructor compiled its forwards (or logged why not)."""
    return engine


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


@pytest.fixture(scope="module")
def reference(target):
    return [c.token_ids for c in LLM.from_engine(tiny_engine(target, None)).generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def compiled_spec(target):
    # Compiled as for adaptive threads (kernels read the thread count when they run); the governor
    # itself is off, so the tests here choose the count.
    drafter = tiny_drafter(target, 2, 8)
    threads = torch.get_num_threads()
    engine = compiled(tiny_engine(target, drafter, 8, max_num_seqs=4, enforce_eager=False, adaptive_threads=True))
    assert engine.runner.compiled and engine.runner._draft_forward is not None
    engine.threads = None
    torch.set_num_threads(threads)  # start-up may have settled on fewer (busy cores)
    return engine


def test_compiled_speculative_greedy_equals_eager_autoregressive(compiled_spec, reference):
    llm = LLM.from_engine(compiled_spec)
    assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY)] == reference  # batch 4 (the rows ≥ 2 graph)
    assert llm.generate(PROMPTS[2], GREEDY)[0].token_ids == reference[2]  # batch 1 (its own graph)


def built_graphs(engine) -> tuple[int, tuple, tuple]:
    """Dynamo's graph count and the shape classes of the runner's compiled forwards."""
    runner = engine.runner
    return (
        torch._dynamo.utils.counters["stats"]["unique_graphs"],
        runner._target_forward.shape_classes,
        runner._draft_forward.shape_classes,
    )


def test_serving_never_recompiles(compiled_spec, reference):
    """Every graph is built at start-up: batches of 4, 2 and 1 at every verify width, decoded on
    another thread (as the server's engine thread does), add none."""
    llm = LLM.from_engine(compiled_spec)
    graphs = built_graphs(compiled_spec)
    assert len(graphs[1]) == 4 and len(graphs[2]) == 2
    outputs: list[list[list[int]]] = []

    def decode() -> None:
        outputs.append([c.token_ids for c in llm.generate(PROMPTS, GREEDY)])
        outputs.append([c.token_ids for c in llm.generate(PROMPTS[:2], GREEDY)])
        outputs.append([llm.generate(PROMPTS[3], GREEDY)[0].token_ids])

    thread = threading.Thread(target=decode)
    thread.start()
    thread.join()
    assert outputs == [reference, reference[:2], [reference[3]]]
    assert built_graphs(compiled_spec) == graphs


def test_thread_count_changes_recompile_nothing(compiled_spec, reference):
    """The engine moves between thread counts under load (dflash2/threads.py): the drafter's and the
    target's graphs then run at the new count as they are (a recompile costs 20 s on a real model)."""
    llm = LLM.from_engine(compiled_spec)
    graphs = built_graphs(compiled_spec)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            assert [c.token_ids for c in llm.generate(PROMPTS[:2], GREEDY)] == reference[:2]
    finally:
        torch.set_num_threads(before)
    assert built_graphs(compiled_spec) == graphs


def test_a_restart_loads_the_saved_graphs(target, compiled_spec, reference):
    """A second engine of the same shapes (as after a restart) loads every graph the first one saved,
    without tracing, and gives the same tokens."""
    assert set(compiled_spec.runner.graph_sources.values()) <= {"compiled", "loaded"}
    engine = tiny_engine(
        target, tiny_drafter(target, 2, 8), 8, max_num_seqs=4, enforce_eager=False, adaptive_threads=True
    )
    engine.threads = None
    assert engine.runner.compiled and len(engine.runner.graph_sources) == 6
    assert set(engine.runner.graph_sources.values()) == {"loaded"}
    llm = LLM.from_engine(engine)
    assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY)] == reference
    assert llm.generate(PROMPTS[2], GREEDY)[0].token_ids == reference[2]


def test_compiled_autoregressive_equals_eager(reference):
    target = tiny_target("qwen3")
    engine = compiled(tiny_engine(target, None, max_num_seqs=4, enforce_eager=False))
    assert engine.runner.compiled
    outputs = LLM.from_engine(engine).generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in outputs] == reference


def test_compiled_target_with_an_oracle_drafter(target, reference):
    """High acceptance: full blocks and the bonus token on the compiled verify; the drafter
    overrides its forward, so it runs eagerly beside the compiled target."""
    refs = {i: PROMPTS[i] + reference[i] for i in range(len(PROMPTS))}
    engine = compiled(tiny_engine(target, oracle_drafter(target, refs, 8, 0.2), 8, max_num_seqs=4, enforce_eager=False))
    assert engine.runner.compiled and engine.runner._draft_forward is None
    outputs = LLM.from_engine(engine).generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in outputs] == reference
    assert sum(c.mean_acceptance_length for c in outputs) / len(outputs) > 2.0


def test_padding_never_writes_a_live_slot(compiled_spec):
    """Rows of different lengths share one padded forward; the padding goes to the scratch slot."""
    runner: ModelRunner = compiled_spec.runner
    cache = runner.target_cache
    before = cache.k.clone(), cache.v.clone()
    logits, _ = runner.verify([0, 1], [[1, 2, 3, 4, 5, 6, 7, 8], [5, 6, 7]], [10, 20])
    assert logits.shape[:2] == (2, 8)
    changed = (cache.k != before[0]).any(-1).any(0).any(1)  # [slots, positions]
    assert changed[0, 10:18].all() and not changed[0, 18:].any() and not changed[0, :10].any()
    assert changed[1, 20:23].all() and not changed[1, 23:].any() and not changed[1, :20].any()
    assert not changed[2 : runner.scratch_slot].any()


def test_compiled_verify_matches_eager_logits(target, compiled_spec):
    eager = tiny_engine(target, tiny_drafter(target, 2, 8), 8, max_num_seqs=4).runner
    fast = compiled_spec.runner
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1]]
    for runner in (eager, fast):
        runner.prefill([0, 1], prompts, [0, 0])
    rows = [[5, 3, 5, 8], [8, 2, 8, 1, 8, 2, 8, 4]]
    expected, expected_features = eager.verify([0, 1], rows, [8, 3])
    got, got_features = fast.verify([0, 1], rows, [8, 3])
    assert expected_features is not None and got_features is not None
    for r, row in enumerate(rows):
        torch.testing.assert_close(got[r, : len(row)], expected[r, : len(row)], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got_features[r, : len(row)], expected_features[r, : len(row)], atol=1e-4, rtol=1e-4)


def test_compiled_speculative_sampling_matches_target_distribution():
    """The chi-square test of ``test_engine_sampling`` on the compiled path (temperature 1)."""
    target = tiny_target(vocab_size=VOCAB, seed=7)
    drafter = tiny_drafter(target, 2, block_size=4)
    drafter.config.__dict__["selector_top_k"] = 2
    engine = compiled(tiny_engine(target, drafter, 4, max_num_seqs=64, enforce_eager=False))
    assert engine.runner.compiled
    base = SAMPLING_CASES["temperature"]
    params = [SamplingParams(**{**base.__dict__, "seed": i}) for i in range(3000)]
    outputs = LLM.from_engine(engine).generate([PROMPT] * len(params), params)
    assert sum(o.num_accepted_tokens for o in outputs) > 0
    exact4 = _exact_joint(target, base, 4)
    exact: dict[tuple[int, ...], float] = {}
    for k, p in exact4.items():
        exact[k[1:]] = exact.get(k[1:], 0.0) + p
    assert _chi_square_pvalue([tuple(o.token_ids[1:]) for o in outputs], exact) > 1e-3


def test_compile_failure_falls_back_to_eager(target, reference, monkeypatch, caplog):
    def broken_build(*args, **kwargs):
        raise RuntimeError("no compiler here")

    # Neither compiling nor loading a saved graph works.
    monkeypatch.setattr(PrecompiledForward, "_build", broken_build)
    with caplog.at_level(logging.WARNING, logger="dflash2.runner"):
        engine = compiled(tiny_engine(target, tiny_drafter(target, 2, 8), 8, max_num_seqs=4, enforce_eager=False))
    assert not engine.runner.compiled
    assert "compiling the target failed" in caplog.text and "no compiler here" in caplog.text
    assert [c.token_ids for c in LLM.from_engine(engine).generate(PROMPTS, GREEDY)] == reference


def test_key_length_buckets():
    assert key_length(1, 2048, cuda=False) == 64
    assert key_length(65, 2048, cuda=False) == 128
    assert key_length(2040, 2048, cuda=False) == 2048
    assert key_length(300, 2048, cuda=True) == 512
    assert key_length(3000, 2048, cuda=True) == 2048
