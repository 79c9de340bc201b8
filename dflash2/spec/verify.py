"""Verification of a drafted block: lossless rejection sampling with a bonus token.

docs/dflash2-spec.md §5.2; Leviathan et al. 2023 / Chen et al. 2023 speculative sampling.
Greedy rows arrive with one-hot target probabilities and one-hot proposals, for which the
same rule reduces exactly to "accept while the draft equals the target argmax".

Dimension letters: R rows, J drafted slots, k candidates per slot, V vocabulary.
"""

from __future__ import annotations

import torch

from dflash2.sampling import LogitsContext, process_logits, sample_from_probs, target_probs
from dflash2.spec.selector import Proposal


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
