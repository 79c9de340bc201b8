"""Rejection sampling is lossless; greedy rows reduce to prefix matching."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from dflash2.engine.policy import one_hot_proposal
from dflash2.sampling import LogitsContext, SamplingParams, probs_from_logits
from dflash2.spec.tree import TokenTree
from dflash2.spec.verify import accept, greedy_accept, rejection_accept


def _first_emitted(num_accepted, next_ids, draft_ids):
    return torch.where(num_accepted > 0, draft_ids[:, 0], next_ids)


def test_first_token_follows_target_including_tokens_outside_top_k():
    g = torch.Generator().manual_seed(0)
    vocab, k, n = 10, 3, 200_000
    target = torch.softmax(torch.randn(vocab, generator=g) * 1.5, dim=0)
    candidates = torch.tensor([7, 2, 4])  # deliberately not the target's favourites
    proposal = torch.tensor([0.6, 0.3, 0.1])
    index = torch.multinomial(proposal, n, replacement=True, generator=g)
    draft_ids = candidates[index][:, None]  # [n, 1]
    num_accepted, next_ids = rejection_accept(
        draft_ids,
        candidates.expand(n, 1, k),
        proposal.expand(n, 1, k),
        target.expand(n, 2, vocab),
        torch.ones(n, dtype=torch.long),
        torch.rand(n, 1, generator=g),
        torch.rand(n, generator=g),
    )
    counts = torch.bincount(_first_emitted(num_accepted, next_ids, draft_ids), minlength=vocab).double()
    expected = target.double() / target.double().sum() * counts.sum()
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3
    assert 0.5 * (counts / n - target.double()).abs().sum() < 0.01
    outside = [t for t in range(vocab) if t not in candidates.tolist()]
    assert counts[outside].sum() > 0.3 * n * 0.5  # reachable only through the residual


def test_bonus_after_full_acceptance_follows_last_row():
    vocab, n = 6, 50_000
    g = torch.Generator().manual_seed(1)
    rows = torch.softmax(torch.randn(3, vocab, generator=g), dim=-1)
    # Proposal equal to the target on slots 0,1 restricted to all tokens: always accepted.
    draft_ids = torch.tensor([[2, 3]]).expand(n, 2)
    candidates = torch.arange(vocab).expand(n, 2, vocab)
    one_hot = torch.nn.functional.one_hot(torch.tensor([2, 3]), vocab).float().expand(n, 2, vocab)
    target = rows.clone()
    target[0], target[1] = one_hot[0, 0], one_hot[0, 1]
    num_accepted, next_ids = rejection_accept(
        draft_ids,
        candidates,
        one_hot,
        target.expand(n, 3, vocab),
        torch.full((n,), 2),
        torch.rand(n, 2, generator=g),
        torch.rand(n, generator=g),
    )
    assert bool((num_accepted == 2).all())
    counts = torch.bincount(next_ids, minlength=vocab).double()
    expected = rows[2].double() / rows[2].double().sum() * counts.sum()
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3


def test_greedy_rows_accept_the_matching_prefix():
    vocab = 8
    target_ids = torch.tensor([[3, 5, 1, 6], [2, 2, 2, 2]])  # argmax per position
    target = torch.nn.functional.one_hot(target_ids, vocab).float()
    draft_ids = torch.tensor([[3, 5, 0], [2, 2, 2]])
    candidates = draft_ids[..., None]
    one_hot = torch.ones(2, 3, 1)
    num_accepted, next_ids = rejection_accept(
        draft_ids, candidates, one_hot, target, torch.tensor([3, 2]), torch.rand(2, 3), torch.rand(2)
    )
    assert num_accepted.tolist() == [2, 2]  # row 1 is limited to 2 drafts
    assert next_ids.tolist() == [1, 2]  # correction token, then the bonus at position 2


def test_greedy_accept_gives_the_general_rules_tokens():
    """The greedy shortcut against rejection sampling over the one-hot distributions the general path
    builds (``probs_from_logits`` at T = 0, one-hot proposals), on random logits with many ties (a
    small integer range), drafts that mostly match, and every draft limit including none."""
    generator = torch.Generator().manual_seed(0)
    num_rows, num_slots, vocab, k = 64, 5, 16, 4
    logits = torch.randint(0, 4, (num_rows, num_slots + 1, vocab), generator=generator).float()
    logits[5, :, 7] = float("-inf")  # a masked token (grammar) never wins
    argmax = logits.argmax(dim=-1)
    noise = torch.randint(0, vocab, (num_rows, num_slots), generator=generator)
    keep = torch.rand(num_rows, num_slots, generator=generator) < 0.7
    draft_ids = torch.where(keep, argmax[:, :num_slots], noise)
    num_drafts = torch.randint(0, num_slots + 1, (num_rows,), generator=generator)
    candidates = torch.cat([draft_ids[..., None], torch.randint(0, vocab, (num_rows, num_slots, k - 1))], dim=-1)
    proposal = torch.zeros(num_rows, num_slots, k)
    proposal[..., 0] = 1.0
    probs = probs_from_logits(logits, [SamplingParams(temperature=0.0)] * num_rows)
    zeros = torch.zeros(num_rows, num_slots)
    expected = rejection_accept(draft_ids, candidates, proposal, probs, num_drafts, zeros, torch.zeros(num_rows))
    accepted, next_ids = greedy_accept(logits, draft_ids, num_drafts)
    assert accepted.tolist() == expected[0].tolist()
    assert next_ids.tolist() == expected[1].tolist()
    assert 0 < int((accepted > 0).sum()) < num_rows and int((accepted == num_drafts).sum()) > 0  # both cases occur
    none = greedy_accept(logits[:, :1], draft_ids[:, :0], torch.zeros(num_rows, dtype=torch.long))
    assert none[0].tolist() == [0] * num_rows and none[1].tolist() == argmax[:, 0].tolist()


def test_one_acceptance_rule_for_chains_and_trees():
    """``accept`` decides a batch of chains with their proposal distributions at once and a tree's point-mass
    children one by one; on chains whose drafts are point masses (copied or forced drafts) both ways are the
    same rule and, from the same uniforms, accept the same nodes and emit the same next tokens, greedy and
    sampled, including rows where a draft is rejected and the next token comes from the residual."""
    generator = torch.Generator().manual_seed(11)
    vocab, rows, mismatches = 12, 64, 0
    for trial in range(20):
        lengths = torch.randint(1, 6, (rows,), generator=generator).tolist()  # nodes: the anchor and 0-4 drafts
        width = max(lengths)
        logits = torch.randn(rows, width, vocab, generator=generator) * 2.0
        # Drafts the target often agrees with: the argmax half of the time, else a random token.
        drafts = [
            [
                int(logits[r, j].argmax())
                if torch.rand(1, generator=generator) < 0.5
                else int(torch.randint(vocab, (1,), generator=generator))
                for j in range(n - 1)
            ]
            for r, n in enumerate(lengths)
        ]
        trees = [TokenTree.chain([0, *d]) for d in drafts]
        greedy = trial % 2 == 0
        params = [SamplingParams(temperature=0.0 if greedy else 1.0) for _ in range(rows)]
        ctx = LogitsContext(params=params, prompt_ids=[[1]] * rows, output_ids=[[0]] * rows, eos_token_ids=[])
        uniforms = None if greedy else torch.rand(rows, width + 1, generator=generator)
        batched = accept(trees, logits, ctx, one_hot_proposal(drafts, torch.device("cpu")), None, uniforms)
        walked = accept(trees, logits, ctx, None, None, uniforms)
        assert batched[0] == walked[0]
        mismatches += sum(a != b for a, b in zip(batched[1], walked[1]))
        assert any(len(nodes) < n - 1 for nodes, n in zip(batched[0], lengths))  # rejections happened
    assert mismatches == 0
