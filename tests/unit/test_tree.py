"""Token trees' pieces: the tree's structure, the beam's budget, and the acceptance rule's output
distribution (the engine-level tests are in ``tests/integration/test_token_trees.py``)."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from dflash2.spec import tree as tree_module
from dflash2.spec.tree import TokenTree, TreeCalibration, accept_tree, build_trees


def test_structure_depths_children_paths_and_mask():
    tree = TokenTree([9, 1, 2, 3, 4], [-1, 0, 0, 1, 1])
    assert tree.depths == [0, 1, 1, 2, 2]
    assert tree.children == [[1, 2], [3, 4], [], [], []]
    assert tree.path(4) == [1, 4] and tree.path(0) == []
    mask = tree.ancestor_mask(6)
    assert mask[4].tolist() == [True, True, False, False, True, False]
    assert mask[5].tolist() == [False] * 5 + [True]  # padding sees only itself
    with pytest.raises(ValueError, match="topological"):
        TokenTree([9, 1, 2], [-1, 2, 0])
    with pytest.raises(ValueError, match="root"):
        TokenTree([9, 1], [0, 0])


def test_beam_respects_the_node_budget_and_depth_and_keeps_parents():
    generator = torch.Generator().manual_seed(0)
    candidates = torch.randint(100, (2, 7, 8), generator=generator)
    log_probs = torch.log_softmax(torch.randn(2, 7, 8, 8, generator=generator), dim=-1)
    trees = build_trees(candidates, log_probs, [5, 6], 3, [10, 4], [7, 2])
    assert [len(t) for t in trees] == [11, 5]
    assert max(trees[1].depths) <= 2
    for tree in trees:
        assert all(0 <= p < i for i, p in enumerate(tree.parents) if i)  # every kept node's parent is kept
    with pytest.raises(ValueError, match="topk"):
        build_trees(candidates, log_probs, [5, 6], 9, [10, 4], [7, 2])


@pytest.mark.parametrize("children", [[0, 1], [3, 4, 5], [2]])
def test_sampled_acceptance_emits_the_target_distribution(children):
    """20 000 draws of the first emitted token from a root with deterministic children (the most and
    least likely tokens among them): the emitted token follows p exactly, and many draws reject every
    child and come from the residual."""
    p = torch.tensor([0.30, 0.25, 0.02, 0.18, 0.15, 0.10])
    tree = TokenTree([7, *children], [-1] + [0] * len(children))
    probs = p.expand(len(tree), -1)  # after an accepted child the bonus comes from p as well
    generator = torch.Generator().manual_seed(3)
    counts, residual = torch.zeros(6), 0
    for _ in range(20_000):
        verdict = accept_tree(tree, probs, None, torch.rand(len(tree) + 1, generator=generator))
        first = tree.token_ids[verdict.accepted_nodes[0]] if verdict.accepted_nodes else verdict.next_id
        counts[first] += 1
        residual += not verdict.accepted_nodes
    assert chisquare(counts.tolist(), (p * 20_000).tolist()).pvalue > 1e-3
    assert residual > 2000


def test_greedy_acceptance_follows_the_argmax_branch():
    tree = TokenTree([7, 1, 2, 3, 4], [-1, 0, 0, 2, 2])
    logits = torch.full((5, 6), -1.0)
    logits[0, 2] = logits[2, 4] = logits[4, 5] = 1.0  # root → 2 (node 2) → 4 (node 4) → bonus 5
    verdict = accept_tree(tree, None, logits, None)
    assert verdict.accepted_nodes == [2, 4] and verdict.next_id == 5


def test_a_lookup_branch_merges_its_shared_prefix_and_appends_the_rest():
    tree = TokenTree([9, 1, 2, 3, 4], [-1, 0, 0, 1, 1])  # 9 ─┬─ 1 ─┬─ 3 ; └─ 2 (1 also has child 4)
    merged = tree.with_branch([1, 4, 7, 8], max_nodes=10)  # shares 1 → 4, then 7, 8 are new
    assert merged.token_ids == [9, 1, 2, 3, 4, 7, 8] and merged.parents == [-1, 0, 0, 1, 1, 4, 5]
    assert [merged.token_ids[n] for n in merged.path(6)] == [1, 4, 7, 8]
    assert tree.with_branch([5, 6], max_nodes=10).parents == [-1, 0, 0, 1, 1, 0, 5]  # a new first-level branch
    assert tree.with_branch([1, 3], max_nodes=10).token_ids == tree.token_ids  # already in the tree
    assert len(tree.with_branch([5, 6, 7], max_nodes=6)) == 6  # cut at the node limit
    assert tree.with_branch([], max_nodes=10).token_ids == tree.token_ids
    # A greedy row accepts along the branch where the target agrees with it.
    logits = torch.full((7, 10), -1.0)
    for node, target in {0: 1, 1: 4, 4: 7, 5: 8, 6: 0}.items():
        logits[node, target] = 1.0
    verdict = accept_tree(merged, None, logits, None)
    assert verdict.accepted_nodes == [1, 4, 5, 6] and verdict.next_id == 0


def test_calibration_learns_the_accepted_share_of_the_draft_probability_per_depth_and_rank():
    """Root children q = 0.6 / 0.3, accepted 30 % / 10 % of the time; the first child's children
    q = 0.5, accepted half the time when it is. A lookup node (NaN) and unreached depths stay at 0."""
    calibration = TreeCalibration(max_depth=3, prior_weight=1.0, decay=1.0)
    assert calibration.offsets().tolist() == [[0.0] * 16] * 3
    lp = math.log
    tree = TokenTree([0, 1, 2, 3, 4], [-1, 0, 0, 1, 0], [0.0, lp(0.6), lp(0.3), lp(0.5), math.nan])
    for i in range(1000):
        if i % 10 < 3:  # the first child, and half of those times its child too
            calibration.observe(tree, [1, 3] if i % 20 < 3 else [1])
        elif i % 10 == 3:
            calibration.observe(tree, [2])
        else:
            calibration.observe(tree, [])
    offsets = calibration.offsets().tolist()
    assert offsets[0][0] == pytest.approx(math.log(0.3 / 0.6), abs=0.01)
    assert offsets[0][1] == pytest.approx(math.log(0.1 / 0.3), abs=0.02)
    assert offsets[1][0] == pytest.approx(math.log(0.5 / 0.5), abs=0.02)
    assert offsets[0][2:] == [0.0] * 14 and offsets[2] == [0.0] * 16
    calibration.observe(TokenTree.chain([0, 1, 2]), [1, 2])  # a tree without draft probabilities: not counted
    assert calibration.offsets().tolist() == offsets


def test_calibration_forgets_at_its_decay_rate():
    calibration = TreeCalibration(max_depth=1, prior_weight=1.0, decay=0.9)
    tree = TokenTree([0, 1], [-1, 0], [0.0, math.log(0.5)])
    for _ in range(200):
        calibration.observe(tree, [])  # never accepted
    for _ in range(200):
        calibration.observe(tree, [1])  # then always: the early trees have decayed away
    assert calibration.offsets()[0][0].item() == pytest.approx(
        math.log((10 + 1) / (5 + 1)), abs=1e-6
    )  # sums 1/(1 − 0.9)


def test_offsets_reshape_the_tree_and_zero_offsets_change_nothing():
    generator = torch.Generator().manual_seed(3)
    candidates = torch.randint(100, (2, 7, 8), generator=generator)
    log_probs = torch.log_softmax(2 * torch.randn(2, 7, 8, 8, generator=generator), dim=-1)
    plain = build_trees(candidates, log_probs, [5, 6], 4, [15, 15], [7, 7])
    zeros = build_trees(candidates, log_probs, [5, 6], 4, [15, 15], [7, 7], torch.zeros(2, 7, 16))
    assert [(t.token_ids, t.parents) for t in zeros] == [(t.token_ids, t.parents) for t in plain]
    # Deep nodes distrusted: row 0's tree is shallower and wider; row 1 (no offsets) unchanged.
    shallow = build_trees(
        candidates, log_probs, [5, 6], 4, [15, 15], [7, 7], torch.tensor([-3.0, 0.0])[:, None, None].expand(2, 7, 16)
    )
    assert max(shallow[0].depths) < max(plain[0].depths)
    assert sum(d == 1 for d in shallow[0].depths) >= sum(d == 1 for d in plain[0].depths)
    assert (shallow[1].token_ids, shallow[1].parents) == (plain[1].token_ids, plain[1].parents)
    # Each node carries its draft log-probability given its parent, uncalibrated.
    tree = shallow[0]
    assert tree.draft_log_probs is not None and tree.draft_log_probs[0] == 0.0
    for node in range(1, len(tree)):
        assert tree.draft_log_probs[node] <= 0.0
    assert all(math.isnan(x) for x in tree.with_branch([999, 998], 40).draft_log_probs[len(tree) :])


def test_the_depth_penalty_moves_the_budget_toward_shallow_nodes(monkeypatch):
    """Two nodes to give: the first-ranked child's own child (q 0.7 under a parent of q 0.6: joint 0.42)
    or the second-ranked child (q 0.4). Raw probabilities keep the chain; λ per level (the deep node
    pays twice) keeps the sibling."""
    candidate_ids = torch.tensor([[[10, 11], [20, 21]]])
    log_probs = torch.tensor([[[0.6, 0.4], [0.6, 0.4]], [[0.7, 0.3], [0.7, 0.3]]]).log()[None]
    monkeypatch.setattr(tree_module, "DEPTH_PENALTY", 0.0)
    assert build_trees(candidate_ids, log_probs, [1], 2, [2], [2])[0].token_ids == [1, 10, 20]
    monkeypatch.setattr(tree_module, "DEPTH_PENALTY", 0.5)
    assert build_trees(candidate_ids, log_probs, [1], 2, [2], [2])[0].token_ids == [1, 10, 11]
