"""The frequency-ranked draft vocabulary: logits over the subset, index mapping, save/load, training loss."""

from __future__ import annotations

import logging

import pytest
import torch

from dflash2.models.loader import DRAFT_VOCAB_FILE, ModelLoadError, load_drafter, read_drafter, save_drafter
from dflash2.train.blocks import block_losses, make_blocks
from dflash2.train.data import TokenDataset
from dflash2.train.trainer import draft_vocabulary, response_token_counts
from tests.tiny import tiny_drafter, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def test_logits_cover_the_draft_vocabulary_only(target):
    drafter = tiny_drafter(target)
    hidden = torch.randn(2, 3, 64)
    full = drafter.logits(hidden)
    ids = torch.tensor([40, 3, 17, 90, 5, 66, 12, 8, 70])
    drafter.set_draft_vocab(ids)
    sub = drafter.logits(hidden)
    assert sub.shape == (2, 3, len(ids))
    assert torch.allclose(sub, full[..., ids.sort().values], atol=1e-6)
    top = drafter.token_ids(sub.argmax(-1))
    assert torch.equal(top, drafter.draft_vocab[full[..., drafter.draft_vocab].argmax(-1)])
    assert drafter.vocab_indices(torch.tensor([3, 4, 90])).tolist() == [0, -1, len(ids) - 1]
    drafter.set_draft_vocab(None)
    assert torch.equal(drafter.logits(hidden), full)


@pytest.mark.parametrize("ids", [[0, 0, 1, 2, 3, 4, 5, 6, 7], [-1, 1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3], [1, 96]])
def test_invalid_draft_vocabularies_are_rejected(target, ids):
    with pytest.raises(ValueError, match="draft vocabulary"):
        tiny_drafter(target).set_draft_vocab(torch.tensor(ids))


def test_draft_vocabulary_survives_save_and_load(target, tmp_path):
    drafter = tiny_drafter(target)
    drafter.set_draft_vocab(torch.arange(10, 50))
    save_drafter(drafter, tmp_path)
    assert (tmp_path / DRAFT_VOCAB_FILE).is_file()
    loaded = read_drafter(tmp_path, torch.float32, "cpu")
    loaded.bind_target(target.embed_tokens.weight, target.lm_head.weight)
    assert torch.equal(loaded.draft_vocab, torch.arange(10, 50))
    hidden = torch.randn(1, 4, 64)
    assert torch.allclose(loaded.logits(hidden), drafter.logits(hidden), atol=1e-6)
    drafter.set_draft_vocab(None)
    save_drafter(drafter, tmp_path)  # saving without one removes a stale file
    assert not (tmp_path / DRAFT_VOCAB_FILE).exists()


def test_limiting_keeps_the_most_frequent_tokens(target):
    drafter = tiny_drafter(target)  # top-k 8
    ids = torch.tensor([40, 3, 17, 90, 5, 66, 12, 8, 70, 21, 33, 50])
    counts = torch.tensor([5, 50, 7, 7, 1, 90, 0, 3, 30, 2, 60, 3])
    drafter.set_draft_vocab(ids, counts)
    # Sorted ids 3 5 8 12 17 21 33 40 50 66 70 90, their counts aligned.
    assert drafter.draft_vocab_counts.tolist() == [50, 1, 3, 0, 7, 2, 60, 5, 3, 90, 30, 7]
    hidden = torch.randn(2, 3, 64)
    full = drafter.logits(hidden)
    drafter.limit_draft_vocab(8)
    # 66 33 3 70 17 90 40, then the tie at 3 between 8 and 50 goes to the lower id.
    assert drafter.draft_vocab.tolist() == [3, 8, 17, 33, 40, 66, 70, 90]
    assert drafter.draft_vocab_counts.tolist() == [50, 3, 7, 60, 5, 90, 30, 7]
    kept = torch.tensor([0, 2, 4, 6, 7, 9, 10, 11])  # their positions among the sorted twelve
    assert torch.allclose(drafter.logits(hidden), full[..., kept], atol=1e-6)
    drafter.limit_draft_vocab(50)  # at or above the current size: unchanged
    assert len(drafter.draft_vocab) == 8
    with pytest.raises(ValueError, match="top-k"):
        drafter.limit_draft_vocab(7)


def test_limiting_without_counts_keeps_the_lowest_ids(target):
    drafter = tiny_drafter(target)
    drafter.limit_draft_vocab(12)  # no draft vocabulary: the whole vocabulary, ranked by id
    assert drafter.draft_vocab.tolist() == list(range(12)) and drafter.draft_vocab_counts is None
    drafter.set_draft_vocab(torch.tensor([90, 80, 70, 60, 50, 40, 30, 20, 10, 5]))
    drafter.limit_draft_vocab(8)
    assert drafter.draft_vocab.tolist() == [5, 10, 20, 30, 40, 50, 60, 70]


@pytest.mark.parametrize("counts", [[1, 2, 3], [1, 2, 3, 4, 5, 6, 7, 8, -1]])
def test_counts_must_match_the_ids(target, counts):
    with pytest.raises(ValueError, match="counts"):
        tiny_drafter(target).set_draft_vocab(torch.arange(9), torch.tensor(counts))


def test_counts_survive_save_and_load_and_the_loader_limits(target, tmp_path, caplog):
    drafter = tiny_drafter(target)
    ids, counts = torch.arange(10, 50), torch.arange(40).flip(0)  # lower ids are more frequent
    drafter.set_draft_vocab(ids, counts)
    save_drafter(drafter, tmp_path)
    loaded = read_drafter(tmp_path, torch.float32, "cpu")
    assert torch.equal(loaded.draft_vocab, ids) and torch.equal(loaded.draft_vocab_counts, counts)
    with caplog.at_level(logging.INFO, logger="dflash2.models.loader"):
        limited = load_drafter(tmp_path, target, torch.float32, torch.device("cpu"), draft_vocab_size=16)
    assert "drafting over the 16 most frequent of the drafter's 40 draft-vocabulary tokens" in caplog.text
    assert limited.draft_vocab.tolist() == list(range(10, 26))
    hidden = torch.randn(1, 4, 64)
    assert torch.allclose(limited.logits(hidden), drafter.logits(hidden)[..., :16], atol=1e-6)
    with pytest.raises(ModelLoadError, match="top-k"):
        load_drafter(tmp_path, target, torch.float32, torch.device("cpu"), draft_vocab_size=2)


def test_draft_vocabulary_ranks_response_tokens_then_fills_lowest_ids():
    tokens = torch.tensor([50, 7, 7, 9, 9, 9, 60, 61], dtype=torch.int32)
    mask = torch.tensor([0, 1, 1, 1, 1, 1, 0, 1], dtype=torch.uint8)  # 50 and 60 are prompt tokens
    dataset = TokenDataset(tokens, mask, torch.tensor([0, 8]), torch.tensor([False]))
    counts = response_token_counts(dataset, [0], 96)
    assert (counts[7], counts[9], counts[61], counts[50], int(counts.sum())) == (2, 3, 1, 0, 6)
    assert draft_vocabulary(counts, 2).tolist() == [7, 9]  # the two most frequent
    assert draft_vocabulary(counts, 5).tolist() == [0, 1, 7, 9, 61]  # seen tokens, then lowest ids
    assert len(draft_vocabulary(counts, 500)) == 96


def test_loss_over_a_full_draft_vocabulary_equals_the_plain_loss(target):
    drafter = tiny_drafter(target)
    ids = torch.randint(0, 90, (40,))
    mask = torch.ones(40, dtype=torch.bool)
    blocks = make_blocks(ids, mask, torch.tensor([3, 10, 20]), 8, drafter.config.mask_token_id)
    hidden = torch.randn(3, 7, 64)
    logits = drafter.logits(hidden)
    plain = block_losses(logits, hidden, blocks, drafter.selector_weights(), 4)
    same = block_losses(logits, hidden, blocks, drafter.selector_weights(), 4, torch.arange(96))
    for name in ("base_loss", "base_weight", "selector_loss", "top1", "topk"):
        assert torch.allclose(getattr(plain, name), getattr(same, name)), name


def test_labels_outside_the_draft_vocabulary_get_no_loss_but_count_as_misses(target):
    drafter = tiny_drafter(target)
    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    blocks = make_blocks(ids, torch.ones(10, dtype=torch.bool), torch.tensor([0]), 8, drafter.config.mask_token_id)
    vocab = torch.tensor([2, 4, 6, 8, 11, 12, 13, 14])  # labels 2..8: only even ones are draftable
    drafter.set_draft_vocab(vocab)
    hidden = torch.randn(1, 7, 64)
    terms = block_losses(drafter.logits(hidden), hidden, blocks, drafter.selector_weights(), 4, vocab)
    weights = blocks.weights[0, 1:]
    learnable = torch.tensor([label in vocab.tolist() for label in blocks.labels[0, 1:].tolist()])
    assert torch.isclose(terms.base_weight, weights[learnable].sum())
    assert terms.count.sum() == 7  # every valid slot is counted ...
    assert terms.topk[~learnable].sum() == 0  # ... and odd labels can never be hits
