"""Selector lattice and walk (docs/dflash2-spec.md §4, §10)."""

from __future__ import annotations

import torch

from dflash2.spec.selector import SelectorWeights, lattice_scores, topk_candidates, walk


def _weights(vocab=20, rank=4, hidden=8, zero_successor=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    succ = torch.zeros(vocab, rank) if zero_successor else torch.randn(vocab, rank, generator=g)
    return SelectorWeights(torch.randn(vocab, rank, generator=g), succ, torch.randn(rank, hidden, generator=g))


def test_lattice_entries_match_direct_formula():
    g = torch.Generator().manual_seed(1)
    w = _weights()
    hidden = torch.randn(2, 3, 8, generator=g)
    logits = torch.randn(2, 3, 20, generator=g)
    cand, unary = topk_candidates(logits, 5)
    anchors = torch.tensor([4, 11])
    lattice = lattice_scores(hidden, anchors, cand, unary, w)
    assert lattice.shape == (2, 3, 5, 5)
    for r in range(2):
        for j in range(3):
            for p in range(5):
                prev = int(anchors[r]) if j == 0 else int(cand[r, j - 1, p])
                for b in range(5):
                    token = int(cand[r, j, b])
                    direct = (
                        unary[r, j, b]
                        + (
                            w.predecessor_codebook[prev]
                            * (w.hidden_projection @ hidden[r, j])
                            * w.successor_codebook[token]
                        ).sum()
                    )
                    assert torch.allclose(lattice[r, j, p, b], direct, atol=1e-5)


def test_greedy_walk_with_zero_successor_is_unary_argmax():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 6, 20, generator=g)
    cand, unary = topk_candidates(logits, 4)
    lattice = lattice_scores(
        torch.randn(3, 6, 8, generator=g), torch.tensor([1, 2, 3]), cand, unary, _weights(zero_successor=True)
    )
    proposal = walk(cand, unary, lattice, torch.zeros(3), torch.rand(3, 6))
    assert torch.equal(proposal.draft_ids, logits.argmax(-1))
    assert torch.equal(proposal.draft_probs.sum(-1), torch.ones(3, 6))


def test_greedy_walk_follows_the_lattice_path():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 4, 20, generator=g)
    cand, unary = topk_candidates(logits, 4)
    w = _weights(seed=5)
    anchors = torch.tensor([9])
    lattice = lattice_scores(torch.randn(1, 4, 8, generator=g) * 3, anchors, cand, unary, w)
    proposal = walk(cand, unary, lattice, torch.zeros(1), torch.zeros(1, 4))
    prev = 0
    for j in range(4):
        best = int(lattice[0, j, prev].argmax())
        assert int(proposal.draft_ids[0, j]) == int(cand[0, j, best])
        prev = best


def test_sampled_walk_draws_from_softmax_of_the_realised_row():
    n, temperature = 40_000, 0.7
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(1, 1, 20, generator=g).expand(n, 1, 20)
    cand, unary = topk_candidates(logits, 5)
    proposal = walk(cand, unary, None, torch.full((n,), temperature), torch.rand(n, 1, generator=g))
    expected = torch.softmax(unary[0, 0] / temperature, dim=-1)
    assert torch.allclose(proposal.draft_probs[0, 0], expected, atol=1e-6)
    counts = torch.stack([(proposal.draft_ids[:, 0] == c).sum() for c in cand[0, 0]]).double() / n
    assert (counts - expected).abs().max() < 0.01
