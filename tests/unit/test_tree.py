"""Token trees' pieces: the tree's structure, the beam's budget, and the acceptance rule's output
distribution (the engine-level tests are in ``tests/integration/test_token_trees.py``)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from dflash2.spec.tree import TokenTree, accept_tree, build_trees


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
