"""Training blocks, masks and loss weights (docs/dflash2-spec.md §7, §10)."""

from __future__ import annotations

import dataclasses
import json
import math

import torch

from dflash2.train.blocks import Blocks, block_losses, make_blocks, sample_anchors, slot_weights
from dflash2.train.features import SoftLabels
from dflash2.train.trainer import read_training_log
from tests.tiny import tiny_drafter, tiny_drafter_config, tiny_target


def test_slot_weights_decay_and_skip_the_anchor():
    w = slot_weights(8)
    assert w[0] == 0
    for k in range(1, 8):
        assert math.isclose(float(w[k]), math.exp(-(k - 1) / 4.0), rel_tol=1e-6)
    assert math.isclose(float(slot_weights(16)[3]), math.exp(-2 / 7.0), rel_tol=1e-6)


def test_anchors_are_response_tokens_with_room_for_a_block():
    mask = torch.zeros(40, dtype=torch.bool)
    mask[10:40] = True
    g = torch.Generator().manual_seed(0)
    anchors = sample_anchors(mask, 8, 12, g)
    assert len(anchors) == 12 and len(set(anchors.tolist())) == 12
    assert torch.equal(anchors, anchors.sort().values)
    assert all(10 <= a <= 32 for a in anchors.tolist())
    assert len(sample_anchors(mask, 8, 100, g)) == 23  # every eligible position once


def test_labels_are_same_position_and_weights_mask_prompt_and_overflow():
    ids = torch.arange(100, 120)
    mask = torch.ones(20, dtype=torch.bool)
    mask[15] = False
    blocks = make_blocks(ids, mask, torch.tensor([3, 14]), 8, mask_token_id=7)
    assert blocks.block_ids[0].tolist() == [103] + [7] * 7
    assert blocks.labels[0].tolist() == list(range(103, 111))  # slot k predicts x_{a+k}
    w = slot_weights(8)
    assert torch.allclose(blocks.weights[0], w)
    assert blocks.weights[1, 1] == 0  # position 15 is a prompt token
    assert blocks.weights[1, 6] == 0 and blocks.weights[1, 7] == 0  # 20, 21 are past the end
    assert blocks.weights[1, 5] > 0


def _drafter_and_features(seq_len=30, layer_types=None, window=None):
    target = tiny_target()
    config = tiny_drafter_config(2, 8, 96)
    if layer_types is not None:
        config = dataclasses.replace(config, layer_types=layer_types, sliding_window=window, is_causal=False)
    drafter = tiny_drafter(target, 2, 8)
    drafter.config = config  # same tensors, new attention layout
    g = torch.Generator().manual_seed(5)
    return drafter, torch.randn(seq_len, 2 * 64, generator=g), torch.randint(0, 90, (seq_len,), generator=g)


def test_block_never_sees_context_at_or_after_its_anchor_nor_other_blocks():
    drafter, features, ids = _drafter_and_features()
    blocks = make_blocks(ids, torch.ones(30, dtype=torch.bool), torch.tensor([6, 12, 20]), 8, 95)
    base = drafter.forward_blocks(features, blocks.block_ids, blocks.anchors)
    later = features.clone()
    later[12:] += 5.0  # context at/after the second anchor
    out = drafter.forward_blocks(later, blocks.block_ids, blocks.anchors)
    assert torch.equal(out[0], base[0]) and torch.equal(out[1], base[1])
    assert not torch.allclose(out[2], base[2])
    other = blocks.block_ids.clone()
    other[1, 0] = (other[1, 0] + 1) % 90  # change only block 1's anchor token
    out = drafter.forward_blocks(features, other, blocks.anchors)
    assert torch.equal(out[0], base[0]) and torch.equal(out[2], base[2])
    assert not torch.allclose(out[1], base[1])


def test_sliding_window_limits_context_in_training():
    drafter, features, ids = _drafter_and_features(layer_types=("sliding_attention", "sliding_attention"), window=4)
    anchors = torch.tensor([15])
    blocks = make_blocks(ids, torch.ones(30, dtype=torch.bool), anchors, 8, 95)
    base = drafter.forward_blocks(features, blocks.block_ids, anchors)
    far = features.clone()
    far[:5] += 5.0  # more than W−1 + B−1 positions before the anchor: never visible
    assert torch.equal(drafter.forward_blocks(far, blocks.block_ids, anchors), base)
    near = features.clone()
    near[14] += 5.0
    assert not torch.allclose(drafter.forward_blocks(near, blocks.block_ids, anchors), base)


def test_training_forward_equals_inference_draft():
    drafter, features, ids = _drafter_and_features()
    anchor = 17
    blocks = make_blocks(ids, torch.ones(30, dtype=torch.bool), torch.tensor([anchor]), 8, 95)
    train_hidden = drafter.forward_blocks(features, blocks.block_ids, blocks.anchors)
    cache = drafter.new_cache(1, 64, torch.float32, torch.device("cpu"))
    drafter.append_context(cache, torch.zeros(anchor, dtype=torch.long), torch.arange(anchor), features[:anchor])
    infer_hidden = drafter.draft_hidden(cache, [0], ids[anchor : anchor + 1], torch.tensor([anchor]), 8)
    assert torch.allclose(train_hidden, infer_hidden, atol=1e-5)


def test_selector_loss_counts_only_slots_with_label_in_top_k():
    drafter, features, ids = _drafter_and_features()
    blocks = make_blocks(ids, torch.ones(30, dtype=torch.bool), torch.tensor([2, 9]), 8, 95)
    hidden = drafter.forward_blocks(features, blocks.block_ids, blocks.anchors)[:, 1:]
    logits = drafter.logits(hidden)
    terms = block_losses(logits, hidden, blocks, drafter.selector_weights(), top_k=4)
    in_top = (logits.topk(4, dim=-1).indices == blocks.labels[:, 1:, None]).any(-1)
    expected_weight = (blocks.weights[:, 1:] * in_top).sum()
    assert torch.allclose(terms.selector_weight, expected_weight)
    assert torch.equal(terms.topk, in_top.sum(0).float())
    assert terms.base_weight == blocks.weights[:, 1:].sum()


def test_soft_labels_align_with_slots_and_one_hot_soft_labels_give_the_hard_loss():
    drafter, features, ids = _drafter_and_features()
    seq_len, k = len(ids), 3
    # Row t carries token t+1 as its most likely entry, so slot j's soft label must lead with x_{a+j}.
    soft_ids = torch.stack([torch.roll(ids, -1), ids, ids], dim=1).int()
    one_hot = torch.tensor([0.0, -30.0, -30.0]).expand(seq_len, k).half()
    anchors = torch.tensor([2, 9])
    blocks = make_blocks(
        ids, torch.ones(seq_len, dtype=torch.bool), anchors, 8, 95, None, SoftLabels(one_hot, soft_ids)
    )
    assert torch.equal(blocks.soft_ids[:, 1:, 0], blocks.labels[:, 1:])
    hidden = drafter.forward_blocks(features, blocks.block_ids, blocks.anchors)[:, 1:]
    logits = drafter.logits(hidden)
    terms = block_losses(logits, hidden, blocks, None, top_k=4)
    torch.testing.assert_close(terms.distill_loss, terms.base_loss, atol=1e-4, rtol=1e-4)
    # A spread soft label: Σ w · (−Σ_i p_i log q_i) over the slots.
    spread = torch.log(torch.tensor([0.5, 0.25, 0.25])).expand(seq_len, k).half()
    blocks_spread = make_blocks(
        ids, torch.ones(seq_len, dtype=torch.bool), anchors, 8, 95, None, SoftLabels(spread, soft_ids)
    )
    p = torch.tensor([0.5, 0.25, 0.25])
    log_q = torch.log_softmax(logits.float(), -1).gather(-1, blocks_spread.soft_ids[:, 1:])
    expected = (blocks.weights[:, 1:] * -(p * log_q).sum(-1)).sum()
    torch.testing.assert_close(block_losses(logits, hidden, blocks_spread, None, 4).distill_loss, expected)
    # Entries outside a draft vocabulary are dropped and the rest renormalised.
    vocab = torch.tensor([10, 20, 30, 40])
    small_logits = torch.tensor([[[0.0, 1.0, 2.0, 3.0]]])  # [n=1, J=1, Vd=4]
    small = Blocks(
        anchors=torch.tensor([0]),
        block_ids=torch.tensor([[5, 95]]),
        labels=torch.tensor([[0, 20]]),
        weights=torch.tensor([[0.0, 1.0]]),
        soft_logprobs=torch.log(torch.tensor([0.5, 0.3, 0.2])).expand(1, 2, 3),
        soft_ids=torch.tensor([20, 99, 40]).expand(1, 2, 3),
    )
    log_q = torch.log_softmax(small_logits[0, 0], -1)
    expected = -(5 / 7 * log_q[1] + 2 / 7 * log_q[3])
    got = block_losses(small_logits, torch.zeros(1, 1, 4), small, None, 2, vocab).distill_loss
    torch.testing.assert_close(got, expected)
    plain = make_blocks(ids, torch.ones(seq_len, dtype=torch.bool), anchors, 8, 95)
    assert block_losses(logits, hidden, plain, None, 4).distill_loss.item() == 0


def test_training_log_keeps_the_newest_line_of_each_step(tmp_path):
    log = tmp_path / "log.jsonl"
    lines = [{"step": 1, "loss": 9.0}, {"step": 2, "loss": 8.0}, {"step": 2, "loss": 7.5}, {"step": 3, "loss": 7.0}]
    log.write_text("".join(json.dumps(m) + "\n" for m in lines))  # step 2 ran again after a resume
    assert [(m["step"], m["loss"]) for m in read_training_log(log)] == [(1, 9.0), (2, 7.5), (3, 7.0)]
