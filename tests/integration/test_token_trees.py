"""Token-tree speculation (``--speculative-topk`` > 1): exact greedy output, the target's distribution,
the KV cache after a tree's accepted path is moved into place, and the settings' errors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dflash2 import LLM, SamplingParams
from dflash2.config import EngineConfig, EngineSpec
from dflash2.models.batch import ForwardBatch
from dflash2.models.kv_cache import KVCache
from dflash2.runner import ModelRunner, RunnerSpec
from dflash2.runner.compile import CompiledTarget, cuda_graph_count
from dflash2.runner.graph_inputs import bucket_nodes, node_buckets
from dflash2.spec import verify
from dflash2.spec.adaptive import CostModel
from dflash2.spec.selector import draft_path_of, lattice_scores, topk_candidates
from dflash2.spec.tree import TokenTree, build_trees, path_log_probs
from tests.integration.test_engine_greedy import GREEDY, PROMPTS
from tests.integration.test_engine_sampling import SAMPLING_CASES, VOCAB, _chi_square_pvalue, _exact_after_first
from tests.tiny import oracle_drafter, tiny_drafter, tiny_engine, tiny_target


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target(request):
    return tiny_target(request.param)


@pytest.fixture(scope="module")
def reference(target):
    return [c.token_ids for c in LLM.from_engine(tiny_engine(target, None)).generate(PROMPTS, GREEDY)]


def tree_steps(llm, prompts, params):
    steps = []
    outputs = llm.generate(prompts, params, on_step=lambda r: steps.append(r.stats))
    return outputs, [s for s in steps if s.num_decode_rows]


@pytest.mark.parametrize("topk, nodes", [(2, 8), (4, 16), (8, 24)])
@pytest.mark.parametrize("batch", [1, 4])
def test_random_drafter_tree_matches_autoregressive(target, reference, topk, nodes, batch):
    """A random drafter's trees (mostly rejected, some second-ranked children accepted): the text is the
    target's own, alone and in a batch (float32, eager)."""
    engine = tiny_engine(
        target,
        tiny_drafter(target, 2, 8),
        8,
        max_num_seqs=batch,
        speculative_topk=topk,
        speculative_num_draft_tokens=nodes,
    )
    prompts = PROMPTS[:batch]
    outputs, steps = tree_steps(LLM.from_engine(engine), prompts, GREEDY)
    assert [c.token_ids for c in outputs] == reference[:batch]
    assert all(s.num_tree_nodes > 0 for s in steps if s.verify_width > 1)
    assert max(s.num_tree_nodes for s in steps) > 7 * batch // 2  # trees, not chains of 7


@pytest.mark.parametrize("error_rate", [0.0, 0.3, 0.7])
def test_high_acceptance_tree_matches_autoregressive(target, reference, error_rate):
    """An oracle drafter (the reference continuation ranked first; where corrupted at a rate, ranked
    second): deep accepted paths, their K/V moved into place, and the text still the target's own."""
    refs = {i: PROMPTS[i] + reference[i] for i in range(len(PROMPTS))}
    drafter = oracle_drafter(target, refs, 8, error_rate, runner_up=True)
    engine = tiny_engine(target, drafter, 8, speculative_topk=4, speculative_num_draft_tokens=16)
    outputs = LLM.from_engine(engine).generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in outputs] == reference
    tau = sum(c.mean_acceptance_length for c in outputs) / len(outputs)
    assert tau > (4.0 if error_rate == 0.0 else 2.0)


def test_a_tree_accepts_more_than_the_chain_of_the_same_drafter(target, reference):
    """What a tree is for: where the first-ranked draft is corrupted the right token is ranked second,
    and the tree verifies that branch in the same forward, so τ rises over the chain of the same
    drafter (same text)."""
    refs = {i: PROMPTS[i] + reference[i] for i in range(len(PROMPTS))}
    taus = {}
    for topk in (1, 4):
        drafter = oracle_drafter(target, refs, 8, 0.5, seed=3, runner_up=True)
        kwargs = {"speculative_topk": topk, "speculative_num_draft_tokens": 24} if topk > 1 else {}
        outputs = LLM.from_engine(tiny_engine(target, drafter, 8, **kwargs)).generate(PROMPTS, GREEDY)
        assert [c.token_ids for c in outputs] == reference
        taus[topk] = sum(c.num_accepted_tokens for c in outputs) / sum(c.num_verify_steps for c in outputs)
    assert taus[4] > taus[1], taus


def test_kv_after_tree_steps_equals_a_fresh_prefill():
    """After tree steps whose accepted paths left the first-ranked branch, the row's cached K/V equals a
    prefill of its committed tokens."""
    target = tiny_target(seed=2)
    reference = LLM.from_engine(tiny_engine(target, None)).generate(PROMPTS[:1], GREEDY)[0].token_ids
    drafter = oracle_drafter(target, {0: PROMPTS[0] + reference}, 8, 0.5, seed=4, runner_up=True)
    engine = tiny_engine(target, drafter, 8, max_num_seqs=1, speculative_topk=4, speculative_num_draft_tokens=16)
    engine.add_request(PROMPTS[0], GREEDY)
    moved = 0
    for _ in range(6):
        result = engine.step()
        moved += result.stats.num_tree_nodes
    request = engine.scheduler.running[0]
    assert moved and request.num_cached > len(PROMPTS[0]) + 6
    committed = [*request.prompt_ids, *request.output_ids[:-1]]  # the last token is the next anchor
    assert len(committed) == request.num_cached
    fresh = KVCache(target.num_layers, 1, 2, 256, 16, torch.float32, "cpu")
    batch = ForwardBatch.build([0], [committed], [0], "cpu")
    target.run(batch, fresh, last_only=True)
    cache, slot, n = engine.runner.target_cache, request.slot, request.num_cached
    torch.testing.assert_close(cache.k[:, slot, :, :n], fresh.k[:, 0, :, :n], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.v[:, slot, :, :n], fresh.v[:, 0, :, :n], rtol=1e-5, atol=1e-5)


def test_tree_sampling_matches_target_distribution():
    """Chi-square over the 3 tokens one tree step decides (3000 requests, p > 1e-3), topk 2 over the
    drafter's 2 candidates of 8 tokens: both siblings are tried and rejected often, and most of the
    target's mass is reached through the residual after every sibling was rejected."""
    target = tiny_target(vocab_size=VOCAB, seed=7)
    drafter = tiny_drafter(target, 2, block_size=4)
    drafter.config.__dict__["selector_top_k"] = 2
    engine = tiny_engine(target, drafter, 4, max_num_seqs=64, speculative_topk=2, speculative_num_draft_tokens=7)
    base = SAMPLING_CASES["temperature"]
    params = [SamplingParams(**{**base.__dict__, "seed": i}) for i in range(3000)]
    outputs, steps = tree_steps(LLM.from_engine(engine), [[1, 5, 2]] * len(params), params)
    assert all(len(o.token_ids) == 4 for o in outputs)
    assert steps[0].num_tree_nodes == 64 * 6  # every row's first decode step verifies a 6-node tree
    assert sum(o.num_accepted_tokens for o in outputs) > 0
    exact = _exact_after_first(target, base)
    assert _chi_square_pvalue([tuple(o.token_ids[1:]) for o in outputs], exact) > 1e-3


def test_a_seeded_tree_request_does_not_follow_the_calibration_other_traffic_taught(target):
    """Unseeded tree steps teach the per-depth calibration (TreeCalibration) that shapes later trees; a
    seeded request's trees use the drafter's own numbers, so its sampled text is the same before and
    after that traffic."""
    engine = tiny_engine(
        target, tiny_drafter(target, 2, 8), 8, max_num_seqs=4, speculative_topk=4, speculative_num_draft_tokens=16
    )
    llm = LLM.from_engine(engine)
    seeded = SamplingParams(max_tokens=24, temperature=1.0, seed=5)
    before = llm.generate(PROMPTS[:2], seeded)
    assert engine.policy.tree_calibration.offsets()[0, 0] != 0.0  # the seeded steps were counted too
    llm.generate(PROMPTS * 3, SamplingParams(max_tokens=24, temperature=1.0))  # unseeded traffic
    trained = engine.policy.tree_calibration.offsets()
    assert any(abs(offset) > 0.1 for by_rank in trained.tolist() for offset in by_rank)
    after = llm.generate(PROMPTS[:2], seeded)
    assert [c.token_ids for c in after] == [c.token_ids for c in before]


def test_tree_sampling_with_lookup_branches_matches_target_distribution(monkeypatch):
    """As above, with prompt lookup on: a prompt that repeats itself gives most rows a lookup continuation,
    which joins the drafted tree as one more branch (a deterministic path beside the drafter's siblings).
    The 3 tokens one step decides still follow the target (chi-square over 3000 requests, p > 1e-3)."""
    branched: list[int] = []
    with_branch = TokenTree.with_branch

    def counting(tree, token_ids, max_nodes):
        branched.append(len(token_ids))
        return with_branch(tree, token_ids, max_nodes)

    monkeypatch.setattr(TokenTree, "with_branch", counting)
    target = tiny_target(vocab_size=VOCAB, seed=7)
    drafter = tiny_drafter(target, 2, block_size=4)
    drafter.config.__dict__["selector_top_k"] = 2
    kwargs = {"speculative_topk": 2, "speculative_num_draft_tokens": 7, "speculative_adaptive": True}
    engine = tiny_engine(target, drafter, 4, max_num_seqs=64, prompt_lookup_max=2, prompt_lookup_min=1, **kwargs)
    costs = TreeCosts(engine.spec)
    for key in costs.verify:  # every forward costs the same: the tree, with its lookup branch, wins
        costs.verify[key] = costs.tree_verify[key] = 0.010
    engine.policy.cost_model = costs
    prompt = [1, 5, 2, 1, 5, 2, 1, 5]
    base = SAMPLING_CASES["temperature"]
    # No seeds of their own (a seeded request verifies full blocks without lookup); the engine's seed
    # source still makes the run repeatable.
    params = [SamplingParams(**base.__dict__) for _ in range(3000)]
    outputs, steps = tree_steps(LLM.from_engine(engine), [prompt] * len(params), params)
    assert all(len(o.token_ids) == 4 for o in outputs)
    assert sum(s.num_tree_nodes > 0 for s in steps) > len(steps) / 2
    assert len(branched) > 1000  # most rows verified a lookup branch beside the drafted siblings
    exact = _exact_after_first(target, base, prompt=prompt)
    assert _chi_square_pvalue([tuple(o.token_ids[1:]) for o in outputs], exact) > 1e-3


def test_topk_one_tree_is_the_greedy_walk():
    """The beam at topk 1 is the selector's greedy walk over the lattice: the chain a chain step verifies."""
    target = tiny_target(seed=3)
    drafter = tiny_drafter(target, 2, 8)
    hidden = torch.randn(3, 7, drafter.config.hidden_size)
    anchors = torch.tensor([4, 9, 11])
    logits = drafter.logits(hidden)
    walk = draft_path_of(drafter, hidden, logits, anchors, torch.zeros(3), torch.zeros(3, 7), True)
    candidate_ids, unary = topk_candidates(logits, drafter.num_candidates)
    lattice = lattice_scores(hidden, anchors, candidate_ids, unary, drafter.selector_weights())
    trees = build_trees(candidate_ids, path_log_probs(unary, lattice), anchors.tolist(), 1, [7] * 3, [7] * 3)
    for tree, path, anchor in zip(trees, walk.draft_ids.tolist(), anchors.tolist()):
        assert tree == TokenTree.chain([anchor, *path])


def test_settings_and_errors(target):
    drafter = tiny_drafter(target, 2, 8)
    engine = tiny_engine(target, drafter, 8, speculative_topk=4)
    assert engine.spec.tree_topk == 4 and engine.spec.tree_nodes == 14  # 2 · B − 1 nodes, the anchor not counted
    engine = tiny_engine(target, drafter, 8, speculative_topk=2, speculative_num_draft_tokens=6)
    assert engine.spec.tree_nodes == 5
    assert not tiny_engine(target, drafter, 8).spec.tree
    with pytest.raises(ValueError, match="--speculative-topk"):
        EngineConfig(speculative_topk=0)
    with pytest.raises(ValueError, match="--speculative-num-draft-tokens ≥ 2"):
        EngineConfig(speculative_topk=2, speculative_num_draft_tokens=1)
    with pytest.raises(ValueError, match="needs a drafter"):
        tiny_engine(target, None, speculative_topk=2)
    with pytest.raises(ValueError, match="--block-size 1 drafts none"):
        tiny_engine(target, drafter, 1, speculative_topk=2)
    with pytest.raises(ValueError, match="candidates per position"):
        tiny_engine(target, drafter, 8, speculative_topk=drafter.num_candidates + 1)


def test_compiled_tree_matches_autoregressive_and_the_eager_tree():
    """The compiled tree verify (CPU: one graph, rows and node count dynamic): greedy text equals the
    autoregressive text, batch 4 and alone, and the same steps verify the same trees as eagerly."""
    target = tiny_target("qwen3")
    reference = [c.token_ids for c in LLM.from_engine(tiny_engine(target, None)).generate(PROMPTS, GREEDY)]
    drafter = tiny_drafter(target, 2, 8)
    kwargs = {"max_num_seqs": 4, "speculative_topk": 4, "speculative_num_draft_tokens": 12}
    engine = tiny_engine(target, drafter, 8, enforce_eager=False, **kwargs)
    assert engine.runner._tree_forward is not None
    outputs, steps = tree_steps(LLM.from_engine(engine), PROMPTS, GREEDY)
    assert [c.token_ids for c in outputs] == reference
    alone, _ = tree_steps(LLM.from_engine(engine), PROMPTS[3:], GREEDY)
    assert alone[0].token_ids == reference[3]
    _, eager_steps = tree_steps(LLM.from_engine(tiny_engine(target, drafter, 8, **kwargs)), PROMPTS, GREEDY)
    assert [s.num_tree_nodes for s in steps] == [s.num_tree_nodes for s in eager_steps]


class TreeCosts(CostModel):
    """A synthetic machine for the adaptive policy with trees: one row launch-bound (a tree of any size
    costs what a chain costs), compute-bound beyond (verify time grows with rows × tokens verified, a
    tree's nodes counted); timings from steps are ignored."""

    def __init__(self, spec: EngineSpec) -> None:
        widths = tuple(range(1, spec.block_size + 1))
        super().__init__(spec.max_num_seqs, widths)
        for rows in range(1, spec.max_num_seqs + 1):
            load = 0.0 if rows == 1 else 0.010 * rows
            for width in widths:
                self.verify[(rows, width)] = 0.010 + load * width
                self.draft[(rows, width)] = self.tree_draft[(rows, width)] = 0.001
                self.tree_verify[(rows, width)] = 0.010 + load * (spec.tree_budget(width) + 1)

    def observe(self, *args, **kwargs) -> None:
        pass

    def observe_tree(self, *args, **kwargs) -> None:
        pass


def test_node_buckets_cover_every_tree_up_to_the_largest():
    assert node_buckets(24) == [8, 16, 24] and node_buckets(8) == [8] and node_buckets(5) == [5]
    assert [bucket_nodes(n, 24) for n in (2, 8, 9, 16, 17, 24)] == [8, 8, 16, 16, 24, 24]
    with pytest.raises(ValueError, match="25 nodes is larger than the runner's 24"):
        bucket_nodes(25, 24)


def test_the_recompile_limit_covers_every_cuda_graph_a_module_can_record():
    """Rows 1 … 64 (7 buckets) × key lengths 256 … 8192 (6) × widths: 2 for the target (1 and B), 4 node
    buckets for trees of up to 46 nodes (8, 16, 32, 46): past dynamo's default limits, which would run
    the later shapes eagerly without a word."""
    runner = SimpleNamespace(num_slots=64, max_model_len=8192, tree_nodes=30, block_size=16, max_tree_nodes=46)
    assert cuda_graph_count(runner) == 7 * 6 * 4
    assert cuda_graph_count(SimpleNamespace(**{**vars(runner), "tree_nodes": 0})) == 7 * 6 * 2
    assert cuda_graph_count(SimpleNamespace(**{**vars(runner), "num_slots": 1, "max_model_len": 256})) == 4


def test_tree_forward_padded_to_static_buckets_gives_the_eager_logits(monkeypatch):
    """The tree forward with CUDA graphs' static shapes (nodes padded to a node bucket, rows to a row
    bucket, keys to a power of two), run here on CPU through the same module: each row's logits at its
    own nodes equal the eager tree forward's, and the padding is cut from what it returns."""
    target = tiny_target("llama")
    runner = ModelRunner(target, None, RunnerSpec(4, 128, 8, enforce_eager=True, tree_nodes=16))
    prompts = [[5, 9, 2, 7, 1, 3], [4, 4, 8, 2], [11, 3, 6, 9, 12, 1, 2]]
    runner.prefill([0, 1, 2], prompts, [0, 0, 0])
    trees = [
        TokenTree([1, 20, 21, 22, 23, 24], [-1, 0, 0, 1, 1, 3]),
        TokenTree.chain([2, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39]),  # 11 nodes: the bucket of 16
        TokenTree([2, 40, 41], [-1, 0, 0]),
    ]
    starts = [len(p) for p in prompts]
    eager, _ = runner.verify([0, 1, 2], trees, starts)
    module = CompiledTarget(runner.target, runner.target_cache, runner.capture_layer_ids).eval()
    monkeypatch.setattr(ModelRunner, "cuda", property(lambda self: True))  # static shapes, as CUDA graphs record them
    padded, _ = runner.tree_call([0, 1, 2], trees, starts, forward=module)
    assert padded.shape[:2] == (3, 16)  # 3 rows (4 ran: the row bucket), 11 nodes padded to 16
    for row, tree in enumerate(trees):
        torch.testing.assert_close(padded[row, : len(tree)], eager[row, : len(tree)], rtol=1e-5, atol=1e-5)


def test_one_verify_gives_chains_the_same_logits_on_the_causal_and_the_masked_path():
    """``ModelRunner.verify`` takes one list of trees: a batch of chains runs the causal forward, a batch with
    a branching tree the masked one; a chain's logits are the same either way (float32, eager)."""
    target = tiny_target("llama")
    runner = ModelRunner(target, None, RunnerSpec(4, 128, 8, enforce_eager=True, tree_nodes=16))
    prompts = [[5, 9, 2, 7, 1, 3], [4, 4, 8, 2]]
    runner.prefill([0, 1], prompts, [0, 0])
    chains = [TokenTree.chain([1, 20, 21, 22]), TokenTree.chain([2, 30])]
    starts = [len(p) for p in prompts]
    causal, _ = runner.verify([0, 1], chains, starts)
    branching = TokenTree([3, 40, 41], [-1, 0, 0])
    runner.prefill([2], [[6, 6, 1]], [0])
    masked, _ = runner.verify([0, 1, 2], [*chains, branching], [*starts, 3])
    for row, chain in enumerate(chains):
        torch.testing.assert_close(masked[row, : len(chain)], causal[row, : len(chain)], rtol=1e-5, atol=1e-5)


def test_adaptive_policy_prices_trees_against_chains_and_no_draft(target, reference):
    """With trees on, the adaptive policy measures tree steps at start-up and chooses per step between no
    draft, chains and trees of every width on their own acceptance and cost. A drafter whose first-ranked
    draft is mostly wrong and whose runner-up is right: one row (launch-bound) verifies trees, and learns
    that trees accept far more per depth than the chain of first-ranked drafts; four rows (compute-bound)
    stop drafting. The text is the target's own either way."""
    refs = dict.fromkeys(range(4), PROMPTS[1] + reference[1])  # whichever slot the single row gets
    drafter = oracle_drafter(target, refs, 8, 0.7, seed=5, runner_up=True)
    kwargs = {"speculative_topk": 4, "speculative_num_draft_tokens": 16, "speculative_adaptive": True}
    engine = tiny_engine(target, drafter, 8, max_num_seqs=4, prompt_lookup_max=0, **kwargs)
    measured = engine.cost_model
    assert all(measured.tree_verify[(rows, w)] > 0 for rows in range(1, 5) for w in range(2, 9))
    assert all(measured.tree_draft[(rows, w)] > 0 for rows in range(1, 5) for w in range(2, 9))
    engine.policy.cost_model = TreeCosts(engine.spec)
    llm = LLM.from_engine(engine)
    batch, batch_steps = tree_steps(llm, PROMPTS, GREEDY)
    assert [c.token_ids for c in batch] == reference
    assert all(s.verify_width == 1 and not s.num_tree_nodes for s in batch_steps if s.num_decode_rows == 4)
    alone, steps = tree_steps(llm, PROMPTS[1:2], GREEDY)
    assert alone[0].token_ids == reference[1]
    assert sum(s.num_tree_nodes > 0 for s in steps) >= len(steps) - 1
    policy = engine.policy
    # Runner-ups accepted in trees; the chain of first-ranked drafts (the trees' spines) mostly rejected.
    assert policy.tree_acceptance.long_run[0] > policy.acceptance.long_run[0] + 0.15
    assert alone[0].mean_acceptance_length > 2.0


def test_prompt_lookup_drafts_ride_along_as_a_branch_of_the_tree(target, reference, monkeypatch):
    """With prompt lookup on, a tree step that the lookup drafts did not win alone verifies them as one more
    branch of the row's tree (no drafter forward for them): the text stays the target's own, alone and in
    a batch, and the branches were there."""
    branches: list[list[int]] = []
    with_branch = TokenTree.with_branch

    def counting(tree, token_ids, max_nodes):
        branches.append(list(token_ids))
        return with_branch(tree, token_ids, max_nodes)

    monkeypatch.setattr(TokenTree, "with_branch", counting)
    kwargs = {"speculative_topk": 4, "speculative_num_draft_tokens": 12, "speculative_adaptive": True}
    engine = tiny_engine(target, tiny_drafter(target, 2, 8), 8, max_num_seqs=4, prompt_lookup_max=4, **kwargs)
    costs = TreeCosts(engine.spec)
    for key in costs.verify:  # launch-bound at every row count, trees as cheap as chains: trees keep winning
        costs.verify[key] = costs.tree_verify[key] = 0.010
    engine.policy.cost_model = costs
    repeats = [p * 3 for p in PROMPTS]  # prompts that repeat themselves: lookup finds continuations
    expected = [c.token_ids for c in LLM.from_engine(tiny_engine(target, None)).generate(repeats, GREEDY)]
    outputs, steps = tree_steps(LLM.from_engine(engine), repeats, GREEDY)
    assert [c.token_ids for c in outputs] == expected
    alone, _ = tree_steps(LLM.from_engine(engine), repeats[2:3], GREEDY)
    assert alone[0].token_ids == expected[2]
    assert any(s.num_tree_nodes for s in steps) and branches


def test_a_lookup_branch_teaches_the_lookup_estimate_not_the_trees(target, monkeypatch):
    """Tree steps with prompt-lookup branches (a random drafter on text that repeats itself, so the
    lookup's drafts are often right and the drafter's seldom): the tree's acceptance learns from the
    drafter's own nodes only, the lookup's from its branch as from a lookup step, so the policy prices
    "tree + branch" against "lookup alone" on what each source accepts. Checked by counting, from every
    verified tree, the first-depth acceptances each estimate should have seen."""
    grown: dict[int, tuple[TokenTree, int, list[int]]] = {}  # id(tree with branch) -> (it, drafted, branch)
    verified: list[tuple[TokenTree, list[int]]] = []
    with_branch, accept = TokenTree.with_branch, verify.accept_tree

    def branching(tree, token_ids, max_nodes):
        grown_tree = with_branch(tree, token_ids, max_nodes)
        grown[id(grown_tree)] = (grown_tree, len(tree), list(token_ids))
        return grown_tree

    def accepting(tree, *args):
        verdict = accept(tree, *args)
        verified.append((tree, verdict.accepted_nodes))
        return verdict

    monkeypatch.setattr(TokenTree, "with_branch", branching)
    monkeypatch.setattr(verify, "accept_tree", accepting)
    kwargs = {"speculative_topk": 4, "speculative_num_draft_tokens": 12, "speculative_adaptive": True}
    engine = tiny_engine(target, tiny_drafter(target, 2, 8), 8, max_num_seqs=1, prompt_lookup_max=4, **kwargs)
    engine.policy.cost_model = TreeCosts(engine.spec)  # one row: a tree costs a chain's verify, + 1 ms drafting
    policy = engine.policy
    tree_before = (policy.tree_acceptance._accepted[0], policy.tree_acceptance._observed[0])
    lookup_before = (policy.lookup_acceptance._accepted[0], policy.lookup_acceptance._observed[0])
    repeats = [p * 3 for p in PROMPTS]
    expected = [c.token_ids for c in LLM.from_engine(tiny_engine(target, None)).generate(repeats, GREEDY)]
    outputs, steps = tree_steps(LLM.from_engine(engine), repeats, GREEDY)
    assert [c.token_ids for c in outputs] == expected

    by_drafter = by_branch = branch_trees = 0
    for tree, accepted in verified:
        _, drafted, branch = grown.get(id(tree), (tree, len(tree), []))
        by_drafter += bool(accepted) and accepted[0] < drafted
        if branch:
            branch_trees += 1
            by_branch += bool(accepted) and tree.token_ids[accepted[0]] == branch[0]
    lookup_steps = [s for s in steps if s.num_lookup_drafts]
    lookup_first = sum(s.num_accepted_tokens > 0 for s in lookup_steps)  # batch 1: the step's one row
    assert branch_trees and by_branch > by_drafter  # the branches were there, and right more often
    tree_after = (policy.tree_acceptance._accepted[0], policy.tree_acceptance._observed[0])
    lookup_after = (policy.lookup_acceptance._accepted[0], policy.lookup_acceptance._observed[0])
    assert tree_after == pytest.approx((tree_before[0] + by_drafter, tree_before[1] + len(verified)))
    assert lookup_after == pytest.approx(
        (lookup_before[0] + by_branch + lookup_first, lookup_before[1] + branch_trees + len(lookup_steps))
    )


def test_a_budget_below_the_block_still_bounds_every_tree(target):
    """``--speculative-num-draft-tokens`` below the block (N = 4, B = 8): a full block's tree still holds
    its B − 1 drafts, so the largest tree (the runner's node buckets, a sampled row's uniforms) is that
    and a lookup branch: 1 + 7 + 7 nodes. Sampled rows with lookup branches on text that repeats itself
    decode to the end."""
    kwargs = {"speculative_topk": 4, "speculative_num_draft_tokens": 4, "speculative_adaptive": True}
    engine = tiny_engine(target, tiny_drafter(target, 2, 8), 8, max_num_seqs=2, prompt_lookup_max=4, **kwargs)
    assert engine.runner.max_tree_nodes == engine.spec.tree_budget(8) + 8 == 15
    costs = TreeCosts(engine.spec)
    for key in costs.verify:  # trees as cheap as chains: trees (with branches) keep winning
        costs.verify[key] = costs.tree_verify[key] = 0.010
    engine.policy.cost_model = costs
    params = [SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True) for _ in range(4)]
    outputs, steps = tree_steps(LLM.from_engine(engine), [p * 3 for p in PROMPTS], params)
    assert all(len(o.token_ids) == 24 for o in outputs)
    assert max(s.num_tree_nodes for s in steps) > 0
