"""Verification of a step's proposals: lossless rejection sampling with a bonus token.

:func:`accept` is the one acceptance every step takes: each row proposed a token tree (a chain of drafts
is a one-branch tree). The rule is recursive rejection sampling: at a node whose target distribution is
p, each child c proposed from q is accepted with probability min(1, p(c)/q(c)), and a rejection leaves
``normalize(max(0, p − q))`` for the next child or the final draw. A drafted chain's q is the drafter's
distribution over its candidates (:func:`rejection_accept`, batched over the rows); a tree's children are
deterministic, q a point mass, and the same rule tries them in turn
(:func:`dflash2.spec.tree.accept_tree`).

docs/dflash2-spec.md §5.2; Leviathan et al. 2023 / Chen et al. 2023 speculative sampling.
Greedy rows arrive with one-hot target probabilities and one-hot proposals, for which the
same rule reduces exactly to "accept while the draft equals the target argmax".

Dimension letters: R rows, J drafted slots, k candidates per slot, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflash2.sampling import LogitsContext, probs_from_logits, process_logits, sample_from_probs, target_probs
from dflash2.spec.selector import Proposal
from dflash2.spec.tree import TokenTree, accept_tree


def accept(
    trees: Sequence[TokenTree],
    logits: torch.Tensor,
    ctx: LogitsContext,
    proposal: Proposal | None,
    allowed: torch.Tensor | None,
    uniforms: torch.Tensor | None,
) -> tuple[list[list[int]], list[int]]:
    """The target's decision on every row's proposal (one speculative step, spec §5.2 and §6).

    A batch of chains with their proposal distributions (``proposal``) is decided at once by
    :func:`accept_block` (an all-greedy batch by the argmax shortcut inside); trees, whose nodes are
    point-mass proposals, by :func:`~dflash2.spec.tree.accept_tree` row by row, on the same rule.

    Args:
        trees: per row, the proposed tree, node 0 the anchor (N nodes at most).
        logits: ``[R, N, V]`` raw target logits of the verify forward, node i's at index i.
        ctx: per-row sampling parameters and histories. A tree step's rows must not depend on the
            tokens before a node (no penalties or grammar: ``dflash2.engine.policy.tree_rows``).
        proposal: for chains, the drafted paths and their distribution q over at least N − 1 slots
            (the chains' tokens are its ``draft_ids``); None for point-mass nodes (trees).
        allowed: ``[R, N, V]`` grammar masks along the chains, or None.
        uniforms: ``[R, S+1]`` uniforms in [0, 1), S ≥ N − 1 (one per child tried, the last one for the next
            token); None for an all-greedy batch (which draws none).

    Returns:
        ``(accepted_nodes, next_ids)``: per row, the accepted nodes (root excluded, root to leaf; a chain's
        are 1 … k) and the bonus or correction token.

    Raises:
        ValueError: a tree (``proposal`` None) with grammar masks.
    """
    if proposal is not None:
        num_drafts = [len(tree) - 1 for tree in trees]
        num_accepted, next_tokens = accept_block(logits, ctx, proposal, num_drafts, allowed, uniforms)
        return [list(range(1, n + 1)) for n in num_accepted.tolist()], next_tokens.tolist()
    if allowed is not None:
        raise ValueError("token trees take no grammar masks: their positions' histories differ per branch")
    no_drafts = torch.zeros(len(trees), 0, dtype=torch.long, device=logits.device)
    processed = process_logits(logits, ctx, no_drafts)
    probs = None if uniforms is None else probs_from_logits(processed, ctx.params)
    accepted: list[list[int]] = []
    next_ids: list[int] = []
    for i, tree in enumerate(trees):
        greedy = probs is None or ctx.params[i].is_greedy
        n = len(tree)
        verdict = accept_tree(
            tree,
            None if greedy or probs is None else probs[i, :n],
            processed[i, :n],
            None if uniforms is None else uniforms[i],
        )
        accepted.append(verdict.accepted_nodes)
        next_ids.append(verdict.next_id)
    return accepted, next_ids


def accept_block(
    logits: torch.Tensor,
    ctx: LogitsContext,
    proposal: Proposal,
    num_drafts: list[int],
    allowed: torch.Tensor | None,
    uniforms: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's decision on every row's drafted block (one speculative step, spec §5.2): the
    logits processors, then :func:`greedy_accept` when every row is greedy (``uniforms`` None) or
    :func:`rejection_accept` on the target distributions.

    Args:
        logits: ``[R, J+1, V]`` raw target logits over ``[anchor, drafts…]`` (J = max ``num_drafts``).
        ctx: per-row sampling parameters and histories.
        proposal: the drafted path over at least J slots.
        num_drafts: per row, the drafts it verifies (≤ J).
        allowed: ``[R, J+1, V]`` grammar masks, or None.
        uniforms: ``[R, S+1]`` uniforms in [0, 1), S ≥ J: the first J decide acceptance, the last one
            samples the correction or bonus token; None for an all-greedy batch (which draws none).

    Returns:
        ``(num_accepted [R] int64, next_ids [R] int64)``: each row emits its first ``num_accepted``
        drafts, then ``next_ids``.
    """
    width = max(num_drafts)
    draft_ids = proposal.draft_ids[:, :width]
    drafts_per_row = torch.tensor(num_drafts, device=logits.device)
    if uniforms is None:  # the same tokens as the rule below, without the distributions
        return greedy_accept(process_logits(logits, ctx, draft_ids, allowed), draft_ids, drafts_per_row)
    return rejection_accept(
        draft_ids,
        proposal.candidate_ids[:, :width],
        proposal.draft_probs[:, :width],
        target_probs(logits, ctx, draft_ids, allowed),
        drafts_per_row,
        uniforms[:, :width],
        uniforms[:, -1],
    )


def rejection_accept(
    draft_ids: torch.Tensor,
    candidate_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    num_drafts: torch.Tensor,
    accept_uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of each row's draft and sample the next token.

    Draft j is accepted when ``u_j · q_j(d_j) < p_j(d_j)`` (probability min(1, p/q)); the
    first rejection samples from ``normalize(max(0, p_j − q_j))`` (falling back to p_j when
    that is empty) and a fully accepted row samples the bonus token from ``p_J``.

    Args:
        draft_ids: ``[R, J]`` drafted tokens.
        candidate_ids: ``[R, J, k]`` candidates the proposal is defined over.
        draft_probs: ``[R, J, k]`` proposal q_j (zero outside the candidates).
        target_probs: ``[R, J+1, V]`` float32; row j is the distribution of the token after
            the anchor and the first j drafts.
        num_drafts: ``[R]`` int64, drafts to consider per row (≤ J; the rest are ignored).
        accept_uniforms: ``[R, J]`` uniforms in [0, 1).
        sample_uniforms: ``[R]`` uniforms in [0, 1) for the residual or bonus sample.

    Returns:
        ``(num_accepted [R] int64, next_ids [R] int64)``; the row emits
        ``draft_ids[:num_accepted]`` followed by ``next_ids``.
    """
    num_rows, num_slots = draft_ids.shape
    vocab_size = target_probs.shape[-1]
    if num_slots == 0:
        return draft_ids.new_zeros(num_rows), sample_from_probs(target_probs[:, 0], sample_uniforms)
    is_chosen = candidate_ids == draft_ids[..., None]  # [R, J, k]
    q_draft = (draft_probs * is_chosen).sum(-1)  # [R, J]
    p_draft = target_probs[:, :num_slots].gather(-1, draft_ids[..., None]).squeeze(-1)  # [R, J]
    slots = torch.arange(num_slots, device=draft_ids.device)
    accepted = (accept_uniforms * q_draft < p_draft) & (slots[None] < num_drafts[:, None])
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [R]

    rows = torch.arange(num_rows, device=draft_ids.device)
    p_next = target_probs[rows, num_accepted]  # [R, V]
    slot = num_accepted.clamp(max=num_slots - 1)
    q_next = torch.zeros(num_rows, vocab_size, device=target_probs.device)
    q_next.scatter_add_(1, candidate_ids[rows, slot], draft_probs[rows, slot].float())
    was_rejected = (num_accepted < num_drafts)[:, None]
    residual = torch.where(was_rejected, (p_next - q_next).clamp(min=0.0), p_next)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)
    return num_accepted, sample_from_probs(residual, sample_uniforms)


def greedy_accept(
    target_logits: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rejection_accept` for a batch of greedy rows, without building distributions: accept
    while each draft is the target's argmax, then emit the argmax after the accepted prefix.

    For greedy rows the target distribution is one-hot at the argmax (lowest index on ties, as
    :func:`torch.argmax` picks) and the proposal one-hot at the draft, so rejection sampling accepts
    draft j exactly when it equals that argmax, the residual at the first rejection is the one-hot
    argmax, and so is the bonus: this gives the same tokens as the general rule, several full-vocabulary
    passes cheaper per position (softmax, one-hot, cumulative sums).

    Args:
        target_logits: ``[R, J+1, V]`` processed target logits (penalties, bias and grammar masks
            applied: :func:`dflash2.sampling.process_logits`).
        draft_ids: ``[R, J]`` drafted tokens.
        num_drafts: ``[R]`` int64, drafts to consider per row (≤ J).

    Returns:
        ``(num_accepted [R] int64, next_ids [R] int64)``, as :func:`rejection_accept`.
    """
    num_slots = draft_ids.shape[1]
    target_ids = target_logits[:, : num_slots + 1].argmax(dim=-1)  # [R, J+1]
    slots = torch.arange(num_slots, device=draft_ids.device)
    accepted = (draft_ids == target_ids[:, :num_slots]) & (slots[None] < num_drafts[:, None])
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    return num_accepted, target_ids.gather(1, num_accepted[:, None]).squeeze(1)
