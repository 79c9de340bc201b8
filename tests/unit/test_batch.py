"""ForwardBatch: padding bookkeeping of a ragged batch."""

from __future__ import annotations

import torch

from dflash2.models.batch import ForwardBatch


def test_real_tokens_equal_the_boolean_mask_lookup_with_and_without_padding():
    ragged = ForwardBatch.build([2, 0, 5], [[4, 5, 6], [7], [8, 9]], [10, 0, 3], "cpu")
    full = ForwardBatch.build([1, 3], [[1, 2], [3, 4]], [0, 7], "cpu")
    assert full.real_index is None and ragged.real_index is not None
    for batch in (ragged, full):
        x = torch.randn(*batch.input_ids.shape, 2, 3).transpose(2, 3)  # strided, like k.transpose(1, 2)
        assert torch.equal(batch.real_tokens(x), x[batch.valid])
        assert torch.equal(batch.real_tokens(batch.positions), batch.flat_positions)
