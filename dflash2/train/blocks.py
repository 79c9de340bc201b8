"""Block sampling, labels and loss weights for DFlash training (docs/dflash2-spec.md §7, §10). Pure functions.

Dimension letters: S sequence length, n blocks, B block size, J = B−1 drafted slots,
k candidates, V vocabulary, r selector rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash2.models.drafter import draft_vocab_indices
from dflash2.spec.selector import SelectorWeights
from dflash2.train.features import SoftLabels

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def decay_gamma(block_size: int) -> float:
    """γ of the exponential slot weights: 7 for B=16, 5 for B=10, 4 for B=8 (spec §7), else B/2."""
    return DEFAULT_GAMMA.get(block_size, block_size / 2)


def slot_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """``[B]`` weights: 0 for slot 0 (the anchor), ``exp(−(k−1)/γ)`` for slot k ≥ 1."""
    gamma = gamma or decay_gamma(block_size)
    weights = torch.tensor([math.exp(-(k - 1) / gamma) for k in range(block_size)])
    weights[0] = 0.0
    return weights


def sample_anchors(
    loss_mask: torch.Tensor, block_size: int, num_anchors: int, generator: torch.Generator
) -> torch.Tensor:
    """Up to ``num_anchors`` distinct sorted anchor positions a with ``loss_mask[a]`` and a ≤ S − B.

    Args:
        loss_mask: ``[S]`` bool, True on response tokens.

    Returns:
        ``[n]`` int64 (n may be 0 for a sequence without room for a block).
    """
    seq_len = loss_mask.shape[0]
    eligible = torch.nonzero(loss_mask[: max(0, seq_len - block_size + 1)]).flatten()
    if len(eligible) > num_anchors:
        eligible = eligible[torch.randperm(len(eligible), generator=generator)[:num_anchors]]
    return eligible.sort().values


@dataclass
class Blocks:
    """Inputs and targets of the blocks of one sequence.

    Attributes:
        anchors: ``[n]`` anchor positions.
        block_ids: ``[n, B]`` ``[x_a, MASK × (B−1)]``.
        labels: ``[n, B]`` ``x_{a+k}`` (0 where out of range).
        weights: ``[n, B]`` loss weight per slot (0 on slot 0, outside the sequence and on prompt tokens).
        soft_logprobs, soft_ids: ``[n, B, k]`` the target's top-k distribution of each slot's
            label (its prediction after ``x_{a+k−1}``), or None without soft labels.
    """

    anchors: torch.Tensor
    block_ids: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor
    soft_logprobs: torch.Tensor | None = None
    soft_ids: torch.Tensor | None = None


def make_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    gamma: float | None = None,
    soft_labels: SoftLabels | None = None,
) -> Blocks:
    """Block inputs, same-position labels and weights (spec §7: slot k predicts ``x_{a+k}``).

    ``soft_labels`` (``[S, k]`` of this sequence, row t = the target's distribution of token
    t + 1) add each slot's soft label for distillation.
    """
    seq_len = input_ids.shape[0]
    positions = anchors[:, None] + torch.arange(block_size)[None]  # [n, B]
    in_bounds = positions < seq_len
    clamped = positions.clamp(max=seq_len - 1)
    labels = torch.where(in_bounds, input_ids[clamped], 0)
    weights = slot_weights(block_size, gamma)[None] * in_bounds * loss_mask[clamped]
    block_ids = torch.full_like(positions, mask_token_id)
    block_ids[:, 0] = input_ids[anchors]
    blocks = Blocks(anchors, block_ids, labels, weights.float())
    if soft_labels is not None:
        rows = (positions - 1).clamp(min=0, max=seq_len - 1)  # slot k's label x_{a+k} is predicted at a+k−1
        blocks.soft_logprobs, blocks.soft_ids = soft_labels.logprobs[rows], soft_labels.ids[rows].long()
    return blocks


@dataclass
class LossTerms:
    """Sums over the slots of a batch (divide by the weight sums for means)."""

    base_loss: torch.Tensor  # Σ w·CE over the vocabulary
    base_weight: torch.Tensor  # Σ w
    selector_loss: torch.Tensor  # Σ w·CE over the top-k (slots whose label is in the top-k)
    selector_weight: torch.Tensor
    top1: torch.Tensor  # [J] count of slots whose argmax is the label
    topk: torch.Tensor  # [J] count of slots whose label is in the top-k
    selector_top1: torch.Tensor  # [J] teacher-forced selector argmax hits
    count: torch.Tensor  # [J] valid slots
    distill_loss: torch.Tensor  # Σ w·CE against the target's soft labels (0 without them)


def block_losses(
    logits: torch.Tensor,
    hidden: torch.Tensor,
    blocks: Blocks,
    selector: SelectorWeights | None,
    top_k: int,
    draft_vocab: torch.Tensor | None = None,
) -> LossTerms:
    """Decay-weighted CE on the unary logits plus the DFlash 2 selector CE (spec §7).

    Args:
        logits: ``[n, J, V]`` transformed unary logits of slots 1..B−1.
        hidden: ``[n, J, H]`` the hidden states those logits come from.
        blocks: the blocks (labels and weights of slots 1..B−1 are used).
        selector: selector tensors, or None (no selector term).
        top_k: candidates per slot.
        draft_vocab: ``[Vd]`` sorted token ids when the logits cover a draft vocabulary
            (``logits [n, J, Vd]``); labels outside it get no CE (they can never be drafted)
            but still count as misses in the recall counters.

    With soft labels in ``blocks`` the distillation term is the cross-entropy between the
    target's top-k distribution (renormalised over the entries the logits cover) and the
    drafter's softmax, with the same slot weights: the forward KL of knowledge distillation
    (Hinton et al., 2015; DistillSpec, Zhou et al., 2024) up to the target's entropy.

    The selector term is teacher-forced: the predecessor is the true previous token (the
    anchor for slot 1); slots whose true token is outside the top-k are excluded ("strict").
    """
    labels, weights = blocks.labels[:, 1:], blocks.weights[:, 1:]  # [n, J]
    logits = logits.float()
    valid = weights > 0
    targets, learnable = labels, torch.ones_like(valid)  # targets index the logits' last dim
    if draft_vocab is not None:
        index = draft_vocab_indices(draft_vocab, labels)
        learnable = index >= 0
        targets = index.clamp(min=0)
    ce_weights = weights * learnable
    log_q = torch.log_softmax(logits, dim=-1)  # shared by the hard and the soft CE
    ce = -log_q.gather(-1, targets[..., None])[..., 0]
    candidates = logits.detach().topk(top_k, dim=-1).indices  # [n, J, k]
    hit = (candidates == targets[..., None]) & learnable[..., None]  # [n, J, k]
    in_topk = hit.any(-1) & valid
    zero = logits.new_zeros(())
    selector_loss, selector_weight = zero, zero
    selector_top1 = torch.zeros(labels.shape[1], device=logits.device)
    if selector is not None:
        predecessors = torch.cat([blocks.block_ids[:, :1], labels[:, :-1]], dim=1)  # [n, J]
        unary = logits.gather(-1, candidates)  # [n, J, k]
        projected = hidden.float() @ selector.hidden_projection.float().t()  # [n, J, r]
        pred = selector.predecessor_codebook[predecessors].float()  # [n, J, r]
        candidate_ids = candidates if draft_vocab is None else draft_vocab[candidates]
        succ = selector.successor_codebook[candidate_ids].float()  # [n, J, k, r]
        scores = unary + ((pred * projected)[:, :, None, :] * succ).sum(-1)  # [n, J, k]
        target_index = hit.float().argmax(-1)  # [n, J]
        sel_ce = F.cross_entropy(scores.flatten(0, 1), target_index.flatten(), reduction="none").view_as(labels)
        sel_w = weights * in_topk
        selector_loss, selector_weight = (sel_w * sel_ce).sum(), sel_w.sum()
        selector_top1 = ((scores.argmax(-1) == target_index) & in_topk).sum(0).float()
    return LossTerms(
        base_loss=(ce_weights * ce).sum(),
        base_weight=ce_weights.sum(),
        selector_loss=selector_loss,
        selector_weight=selector_weight,
        top1=((logits.detach().argmax(-1) == targets) & learnable & valid).sum(0).float(),
        topk=in_topk.sum(0).float(),
        selector_top1=selector_top1,
        count=valid.sum(0).float(),
        distill_loss=(ce_weights * _soft_cross_entropy(log_q, blocks, draft_vocab)).sum()
        if blocks.soft_ids is not None
        else zero,
    )


def _soft_cross_entropy(log_q: torch.Tensor, blocks: Blocks, draft_vocab: torch.Tensor | None) -> torch.Tensor:
    """``[n, J]`` CE of the drafter's log-probabilities ``log_q [n, J, V or Vd]`` against the blocks' soft labels."""
    assert blocks.soft_ids is not None and blocks.soft_logprobs is not None
    ids, logprobs = blocks.soft_ids[:, 1:], blocks.soft_logprobs[:, 1:].float()  # [n, J, k]
    covered = torch.ones_like(ids, dtype=torch.bool)
    if draft_vocab is not None:
        ids = draft_vocab_indices(draft_vocab, ids)
        covered = ids >= 0
        ids = ids.clamp(min=0)
    target = torch.softmax(logprobs.masked_fill(~covered, -math.inf), dim=-1).nan_to_num(0.0)
    return -(target * log_q.gather(-1, ids)).sum(-1)
