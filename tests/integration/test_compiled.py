"""The compiled model runner gives the eager path's tokens and distributions (float32, tiny models).

Compilation takes seconds per graph, so each engine here is built once per module.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading

import pytest
import torch

from dflash2 import LLM, SamplingParams
from dflash2.runner import ModelRunner, PendingWrites, key_length
from dflash2.runner.precompiled import PrecompiledForward
from dflash2.spec.adaptive import WidthChoice
from dflash2.spec.selector import draft_path_of
from dflash2.spec.tree import TokenTree
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
    runner = engine.runner
    assert runner.compiled and runner.drafting.forward is not None
    assert runner.drafting.context_forward is not None and runner.drafting.selects_in_draft
    engine.threads = None
    torch.set_num_threads(threads)  # start-up may have settled on fewer (busy cores)
    return engine


def test_compiled_speculative_greedy_equals_eager_autoregressive(compiled_spec, reference):
    llm = LLM.from_engine(compiled_spec)
    assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY)] == reference  # batch 4 (the rows ≥ 2 graph)
    assert llm.generate(PROMPTS[2], GREEDY)[0].token_ids == reference[2]  # batch 1 (its own graph)


def test_compiled_greedy_at_every_verify_width_equals_autoregressive(compiled_spec, reference, monkeypatch):
    """Steps at every width 1 … B in turn (as adaptive speculation chooses them): the drafter's block
    and the selector follow the width, and the text stays the target's own."""
    widths = itertools.cycle([2, 5, 1, 8, 3, 4, 7, 6])
    monkeypatch.setattr(
        compiled_spec.policy, "_choose_width", lambda rows, limits, forced: WidthChoice(next(widths), 0.0, {})
    )
    steps = []
    llm = LLM.from_engine(compiled_spec)
    assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY, on_step=lambda r: steps.append(r.stats))] == reference
    assert llm.generate(PROMPTS[2], GREEDY)[0].token_ids == reference[2]
    assert {s.verify_width for s in steps if s.num_decode_rows} == set(range(1, 9))


def test_compiled_greedy_with_prompt_lookup_equals_autoregressive(compiled_spec, reference, monkeypatch):
    """Prompt-lookup steps (the verify graph without a drafter forward) mixed with drafted and plain
    steps, as the adaptive policy chooses them: the text stays the target's own."""
    from tests.integration.test_prompt_lookup_engine import FixedCosts

    policy = compiled_spec.policy
    monkeypatch.setattr(policy, "cost_model", FixedCosts(4, tuple(range(1, 9)), draft=0.002))
    monkeypatch.setattr(policy, "spec", dataclasses.replace(policy.spec, prompt_lookup_max=4))
    steps = []
    llm = LLM.from_engine(compiled_spec)
    assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY, on_step=lambda r: steps.append(r.stats))] == reference
    assert llm.generate(PROMPTS[2], GREEDY, on_step=lambda r: steps.append(r.stats))[0].token_ids == reference[2]
    assert any(s.num_lookup_drafts for s in steps)
    assert any(s.verify_width > 1 and not s.num_lookup_drafts for s in steps if s.num_decode_rows)


def built_graphs(engine) -> tuple[int, tuple, tuple, tuple]:
    """Dynamo's graph count and the shape classes of the runner's compiled forwards (target, drafter
    with the selector, context append)."""
    runner = engine.runner
    return (
        torch._dynamo.utils.counters["stats"]["unique_graphs"],
        runner._target_forward.shape_classes,
        runner.drafting.forward.shape_classes,
        runner.drafting.context_forward.shape_classes,
    )


def test_serving_never_recompiles(compiled_spec, reference):
    """Every graph is built at start-up: batches of 4, 2 and 1 at every verify width, decoded on
    another thread (as the server's engine thread does), add none."""
    llm = LLM.from_engine(compiled_spec)
    graphs = built_graphs(compiled_spec)
    assert [len(classes) for classes in graphs[1:]] == [4, 2, 4]
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
    assert engine.runner.compiled and len(engine.runner.graph_sources) == 10
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
    assert engine.runner.compiled and engine.runner.drafter_compiled is False
    outputs = LLM.from_engine(engine).generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in outputs] == reference
    assert sum(c.mean_acceptance_length for c in outputs) / len(outputs) > 2.0


def test_padding_never_writes_a_live_slot(compiled_spec):
    """Rows of different lengths share one padded forward; the padding goes to the scratch slot."""
    runner: ModelRunner = compiled_spec.runner
    cache = runner.target_cache
    before = cache.k.clone(), cache.v.clone()
    logits, _ = runner.verify([0, 1], [TokenTree.chain([1, 2, 3, 4, 5, 6, 7, 8]), TokenTree.chain([5, 6, 7])], [10, 20])
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
    expected, expected_features = eager.verify([0, 1], [TokenTree.chain(row) for row in rows], [8, 3])
    got, got_features = fast.verify([0, 1], [TokenTree.chain(row) for row in rows], [8, 3])
    assert expected_features is not None and got_features is not None
    for r, row in enumerate(rows):
        torch.testing.assert_close(got[r, : len(row)], expected[r, : len(row)], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got_features[r, : len(row)], expected_features[r, : len(row)], atol=1e-4, rtol=1e-4)


def test_compiled_context_append_matches_eager(target, compiled_spec):
    """The compiled context append writes the eager one's drafter K/V at each row's positions (also from
    features of another dtype), and its padding (rows shorter than the widest) writes only the
    scratch slot."""
    eager = tiny_engine(target, tiny_drafter(target, 2, 8), 8, max_num_seqs=4).runner
    fast: ModelRunner = compiled_spec.runner
    assert eager.draft_cache is not None and fast.draft_cache is not None
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(2, 5, fast.drafter.fc.in_features, generator=generator)
    before = fast.draft_cache.k.clone()
    eager.drafting.append_context([0, 2], [4, 9], features, [5, 2])
    fast.drafting.append_context([0, 2], [4, 9], features.double(), [5, 2])  # cast to the graph's dtype, not misread
    for cache in ("k", "v"):
        expected, got = getattr(eager.draft_cache, cache), getattr(fast.draft_cache, cache)
        torch.testing.assert_close(got[:, 0, :, 4:9], expected[:, 0, :, 4:9], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[:, 2, :, 9:11], expected[:, 2, :, 9:11], atol=1e-5, rtol=1e-5)
    changed = (fast.draft_cache.k != before).any(-1).any(0).any(1)  # [slots, positions]
    assert changed[0, 4:9].all() and changed[2, 9:11].all()
    changed[0, 4:9] = changed[2, 9:11] = False
    assert not changed[: fast.scratch_slot].any()


def test_compiled_draft_matches_eager_at_every_width(target, compiled_spec):
    """The drafter runs only the verified block: one compiled graph per row class drafts every width
    2 … B with the eager drafter's hidden states and logits (batch 1 and batch 3), and a narrow block
    is its own forward, not a cut of the full one (the block attention is bidirectional)."""
    eager = tiny_engine(target, tiny_drafter(target, 2, 8), 8, max_num_seqs=4).runner
    fast: ModelRunner = compiled_spec.runner
    generator = torch.Generator().manual_seed(3)
    features = torch.randn(3, 6, fast.drafter.fc.in_features, generator=generator)
    for runner in (eager, fast):
        runner.drafting.append_context([0, 1, 2], [0, 0, 0], features, [6, 4, 5])
    with torch.inference_mode():  # as the engine drafts
        for slots, starts in (([1], [4]), ([0, 1, 2], [6, 4, 5])):
            anchors = torch.randint(0, 50, (len(slots),), generator=generator)
            starts_tensor = torch.tensor(starts)
            full = eager.drafting.draft_block(slots, anchors, starts_tensor, 8)[1]
            for width in range(2, 9):
                expected_hidden, expected_logits = eager.drafting.draft_block(slots, anchors, starts_tensor, width)
                hidden, logits = fast.drafting.draft_block(slots, anchors, starts_tensor, width)
                assert hidden.shape[1] == logits.shape[1] == width - 1
                torch.testing.assert_close(hidden, expected_hidden, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)
                if width < 8:
                    assert not torch.allclose(logits, full[:, : width - 1], atol=1e-3)
    with pytest.raises(ValueError, match="draft width"):
        fast.drafting.draft_block([0], torch.tensor([1]), torch.tensor([6]), 9)
    assert built_graphs(compiled_spec)[2] == ("rows=1", "rows=2+")  # no graph per width


def test_compiled_draft_writes_the_pending_context(target, compiled_spec):
    """On CPU the drafting graph first writes the context its rows committed since they last drafted:
    the same K/V, hidden states and logits as the eager append followed by the eager draft, rows with
    one token or none padded into the scratch slot, each slot's context length moved past its tokens."""
    eager = tiny_engine(target, tiny_drafter(target, 2, 8), 8, max_num_seqs=4).runner
    fast: ModelRunner = compiled_spec.runner
    assert fast.drafting.selects_in_draft and not eager.drafting.selects_in_draft
    assert fast.drafter_compiled and not eager.drafter_compiled
    generator = torch.Generator().manual_seed(4)
    dim = fast.drafter.fc.in_features
    earlier = torch.randn(3, 6, dim, generator=generator)
    for runner in (eager, fast):
        runner.drafting.append_context([0, 1, 2], [0, 0, 0], earlier, [6, 5, 4])
    before = fast.draft_cache.k.clone()
    for slots, pending, lengths, starts in (([0, 1, 2], 3, [3, 1, 0], [6, 5, 4]), ([2], 1, [1], [4])):
        features = torch.randn(len(slots), pending, dim, generator=generator)
        anchors = torch.randint(0, 50, (len(slots),), generator=generator)
        ends = torch.tensor([s + n for s, n in zip(starts, lengths)])
        results = []
        with torch.inference_mode():
            for runner in (eager, fast):
                context = PendingWrites(features, lengths, starts)
                results.append(runner.drafting.draft_block(slots, anchors, ends, 4, context))
        for expected, got in zip(*results):
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    for cache in ("k", "v"):
        expected, got = getattr(eager.draft_cache, cache), getattr(fast.draft_cache, cache)
        for slot, length in enumerate([9, 6, 5]):
            torch.testing.assert_close(got[:, slot, :, :length], expected[:, slot, :, :length], atol=1e-5, rtol=1e-5)
    changed = (fast.draft_cache.k != before).any(-1).any(0).any(1)  # [slots, positions]
    assert changed[0, 6:9].all() and changed[1, 5] and changed[2, 4]
    changed[0, 6:9] = changed[1, 5] = changed[2, 4] = False
    assert not changed[: fast.scratch_slot].any()  # padding only into the scratch slot


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_compiled_selector_matches_eager(compiled_spec, temperature):
    """The drafting graph's top-k, lattice and walk choose the eager selector's drafts for its own
    block, with its proposal probabilities, for batch 1 and batch 3 (their two graphs), on full blocks
    and on narrower ones (the walk is unrolled over B − 1 slots, then cut back)."""
    runner: ModelRunner = compiled_spec.runner
    drafter = runner.drafter
    assert drafter is not None and drafter.selector_weights() is not None and runner.drafting.selects_in_draft
    generator = torch.Generator().manual_seed(1)
    for rows, width in ((1, 8), (3, 8), (1, 2), (3, 5)):
        slots = [runner.scratch_slot] * rows
        anchors = torch.randint(0, 50, (rows,), generator=generator)
        starts = torch.full((rows,), 5)
        temperatures = torch.full((rows,), temperature)
        uniforms = torch.rand(rows, runner.block_size - 1, generator=generator)
        hidden, logits = runner.drafting.draft_block(slots, anchors, starts, width)
        expected = draft_path_of(
            drafter, hidden, logits, anchors, temperatures, uniforms[:, : width - 1], use_selector=True
        )
        got = runner.drafting.propose(slots, anchors, starts, temperatures, uniforms, width, None).proposal
        assert got.draft_ids.shape == (rows, width - 1)
        assert torch.equal(got.draft_ids, expected.draft_ids)
        assert torch.equal(got.candidate_ids, expected.candidate_ids)
        torch.testing.assert_close(got.draft_probs, expected.draft_probs, atol=1e-5, rtol=1e-5)


def test_compiled_speculative_sampling_matches_target_distribution(monkeypatch):
    """The chi-square test of ``test_engine_sampling`` on the compiled path (temperature 1), with steps
    at widths 3, 4 and 2 in turn: narrower blocks draft from their own drafter forward."""
    target = tiny_target(vocab_size=VOCAB, seed=7)
    drafter = tiny_drafter(target, 2, block_size=4)
    drafter.config.__dict__["selector_top_k"] = 2
    engine = compiled(tiny_engine(target, drafter, 4, max_num_seqs=64, enforce_eager=False))
    assert engine.runner.compiled
    widths = itertools.cycle([3, 4, 2])
    monkeypatch.setattr(engine.policy, "_choose_width", lambda rows, limits, forced: WidthChoice(next(widths), 0.0, {}))
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
