"""DFlash 2 candidate selector: top-k candidates, lattice scores and the path walk.

docs/dflash2-spec.md §4. Pure tensor functions with no state and no host syncs.

Dimension letters:
    R  rows (requests)            J  drafted slots per block (block size − 1)
    k  candidates per slot         V  vocabulary size
    H  hidden size                 r  selector rank
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash2.models.base import Drafter
from dflash2.models.drafter import SelectorWeights
from dflash2.models.layers import batch_invariant_enabled

__all__ = ["Proposal", "SelectorWeights", "draft_path", "draft_path_of", "lattice_scores", "topk_candidates", "walk"]


@dataclass
class Proposal:
    """A drafted path and the proposal distribution that produced it.

    Attributes:
        draft_ids: ``[R, J]`` drafted tokens d_1..d_J.
        candidate_ids: ``[R, J, k]`` top-k candidate ids per slot (sorted by unary score).
        draft_probs: ``[R, J, k]`` float32 proposal q_j over ``candidate_ids[:, j]``,
            conditioned on the realised predecessor; one-hot for greedy rows.
    """

    draft_ids: torch.Tensor
    candidate_ids: torch.Tensor
    draft_probs: torch.Tensor


def topk_candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k candidates per slot (spec §4.1), sorted by descending unary score.

    Args:
        logits: ``[R, J, V]`` transformed unary draft logits.
        k: candidates per slot (clamped to V).

    Returns:
        ``(candidate_ids [R, J, k] int64, unary_scores [R, J, k] float32)``.
    """
    values, ids = logits.topk(min(k, logits.shape[-1]), dim=-1, sorted=True)
    return ids, values.float()


def lattice_scores(
    hidden: torch.Tensor,
    anchor_ids: torch.Tensor,
    candidate_ids: torch.Tensor,
    unary_scores: torch.Tensor,
    weights: SelectorWeights,
) -> torch.Tensor:
    """Edge scores S_j(a, b) = U_j(b) + Σ_r A[a, r]·(Wh h_j)[r]·B[b, r] (spec §4.2).

    Args:
        hidden: ``[R, J, H]`` final-normed draft hidden states of the drafted slots.
        anchor_ids: ``[R]`` the anchor token (the predecessor of slot 1).
        candidate_ids: ``[R, J, k]``.
        unary_scores: ``[R, J, k]``.
        weights: selector tensors.

    Returns:
        ``[R, J, k_prev, k]`` float32 lattice; for slot 1 every predecessor row is the anchor.
    """
    if batch_invariant_enabled() and hidden.shape[0] > 1:
        # Float32 matrix products sum in an order that depends on the row count: one row at a time.
        return torch.cat(
            [
                lattice_scores(
                    hidden[r : r + 1], anchor_ids[r : r + 1], candidate_ids[r : r + 1], unary_scores[r : r + 1], weights
                )
                for r in range(hidden.shape[0])
            ]
        )
    prev_ids = torch.empty_like(candidate_ids)  # [R, J, k]
    prev_ids[:, 0] = anchor_ids[:, None]
    prev_ids[:, 1:] = candidate_ids[:, :-1]
    projected = hidden.float() @ weights.hidden_projection.float().t()  # [R, J, r]
    pred = weights.predecessor_codebook[prev_ids].float()  # [R, J, k_prev, r]
    succ = weights.successor_codebook[candidate_ids].float()  # [R, J, k, r]
    transition = (pred * projected[:, :, None, :]) @ succ.transpose(-1, -2)  # [R, J, k_prev, k]
    return unary_scores[:, :, None, :] + transition


def draft_path(
    hidden: torch.Tensor,
    logits: torch.Tensor,
    anchor_ids: torch.Tensor,
    temperatures: torch.Tensor,
    uniforms: torch.Tensor,
    num_candidates: int,
    draft_vocab: torch.Tensor | None,
    weights: SelectorWeights | None,
    num_slots: int | None = None,
) -> Proposal:
    """The drafted path of each row (spec §4): top-k candidates per slot, mapped to token ids,
    the lattice when there are selector weights, then the walk.

    Args:
        hidden: ``[R, J, H]`` final-normed draft hidden states; logits: ``[R, J, V or Vd]`` their
            unary logits; anchor_ids: ``[R]``; temperatures: ``[R]``; uniforms: ``[R, S]``.
        num_candidates: k.
        draft_vocab: ``[Vd]`` sorted token ids of a draft vocabulary (the logits index it), or None.
        weights: the selector tensors, or None to walk the unary scores alone.
        num_slots: S ≥ J, the slots to walk (default J). Slots from J on are padding with zero
            scores and candidate id 0: the walk reaches them only after every real slot, so the
            first J slots of the result do not depend on S (a compiled walk is unrolled over a
            fixed S while J varies).
    """
    candidate_ids, unary = topk_candidates(logits, num_candidates)
    if draft_vocab is not None:
        candidate_ids = draft_vocab[candidate_ids]
    if num_slots is not None:  # unconditionally: a compiled caller's J is symbolic
        pad = num_slots - logits.shape[1]
        candidate_ids = torch.nn.functional.pad(candidate_ids, (0, 0, 0, pad))
        unary = torch.nn.functional.pad(unary, (0, 0, 0, pad))
        hidden = torch.nn.functional.pad(hidden, (0, 0, 0, pad))
    lattice = lattice_scores(hidden, anchor_ids, candidate_ids, unary, weights) if weights is not None else None
    return walk(candidate_ids, unary, lattice, temperatures, uniforms)


def draft_path_of(
    drafter: Drafter,
    hidden: torch.Tensor,
    logits: torch.Tensor,
    anchor_ids: torch.Tensor,
    temperatures: torch.Tensor,
    uniforms: torch.Tensor,
    use_selector: bool = True,
) -> Proposal:
    """:func:`draft_path` on a drafter's block outputs: its candidate count, its draft vocabulary,
    and its selector tensors when it has a selector and ``use_selector``.

    Args:
        hidden: ``[R, J, H]`` final-normed hidden states of the drafted slots; logits: ``[R, J, V
            or Vd]`` their unary logits (``DFlashDrafter.logits``); anchor_ids: ``[R]``;
            temperatures: ``[R]`` float32 (≤ 1e-5 walks greedily); uniforms: ``[R, J]`` in [0, 1).

    Returns:
        The :class:`Proposal`, candidates as token ids.
    """
    weights = drafter.selector_weights() if use_selector else None
    return draft_path(
        hidden, logits, anchor_ids, temperatures, uniforms, drafter.num_candidates, drafter.draft_vocab, weights
    )


def walk(
    candidate_ids: torch.Tensor,
    unary_scores: torch.Tensor,
    lattice: torch.Tensor | None,
    temperatures: torch.Tensor,
    uniforms: torch.Tensor,
) -> Proposal:
    """Walk one path through the candidates (spec §4.3), greedy or sampled per row.

    Without a lattice (DFlash v1, or the selector switched off) each slot is scored by its
    unary logits alone, so the greedy walk is the per-slot argmax and the sampled walk draws
    from ``softmax(U_j / T)`` restricted to the top-k.

    Args:
        candidate_ids: ``[R, J, k]``.
        unary_scores: ``[R, J, k]`` float32.
        lattice: ``[R, J, k, k]`` from :func:`lattice_scores`, or None.
        temperatures: ``[R]`` float32; rows with T ≤ 1e-5 walk greedily (ties → lowest index).
        uniforms: ``[R, J]`` uniforms in [0, 1) for the sampled rows (inverse-CDF sampling).

    Returns:
        The :class:`Proposal` with one-hot ``draft_probs`` for greedy rows.
    """
    num_rows, num_slots, k = candidate_ids.shape
    greedy = temperatures <= 1e-5
    inv_t = 1.0 / temperatures.clamp(min=1e-5)
    rows = torch.arange(num_rows, device=candidate_ids.device)
    prev_index = torch.zeros(num_rows, dtype=torch.long, device=candidate_ids.device)
    places = torch.arange(k, device=candidate_ids.device)
    # prefix[i, c] = c ≤ i: the cumulative sums as one reduction, and the inverse-CDF draw as a count
    # (searchsorted(cdf, u, right=True) = #{i : cdf_i ≤ u} for a non-decreasing cdf), which a
    # compiler fuses with the rest of the step instead of calling cumsum and searchsorted per slot.
    prefix = (places[None, :] <= places[:, None]).float()  # [k, k]
    chosen, probs = [], []
    for j in range(num_slots):
        scores = unary_scores[:, j] if lattice is None else lattice[rows, j, prev_index]  # [R, k]
        q = torch.softmax(scores * inv_t[:, None], dim=-1)
        cdf = (q[:, None, :] * prefix[None]).sum(dim=-1)  # [R, k]
        sampled = (cdf <= uniforms[:, j : j + 1] * cdf[:, -1:]).sum(dim=-1)
        index = torch.where(greedy, scores.argmax(dim=-1), sampled.clamp(max=k - 1))
        one_hot = (index[:, None] == places).float()  # F.one_hot, in a form that compiles
        probs.append(torch.where(greedy[:, None], one_hot, q))
        chosen.append(index)
        prev_index = index
    index = torch.stack(chosen, dim=1) if chosen else candidate_ids.new_zeros(num_rows, 0)
    draft_probs = torch.stack(probs, dim=1) if probs else unary_scores.new_zeros(num_rows, 0, k)
    draft_ids = candidate_ids.gather(-1, index[..., None]).squeeze(-1)
    return Proposal(draft_ids=draft_ids, candidate_ids=candidate_ids, draft_probs=draft_probs)
