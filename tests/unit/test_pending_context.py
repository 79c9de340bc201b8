"""PendingContext: committed features kept for the drafter until the row drafts again."""

import torch

from dflash2.engine.request import PendingContext


def test_chunks_from_successive_steps_concatenate_from_the_first_position():
    pending = PendingContext()
    assert not pending and pending.num_tokens == 0
    step_features = torch.arange(24.0).view(3, 2, 4)  # one step: 3 rows × 2 positions × F·H 4
    pending.add(10, step_features[1, :2])  # views into the step's tensor
    pending.add(12, step_features[2, :1])
    assert pending and pending.start == 10 and pending.num_tokens == 3
    assert torch.equal(pending.features(), torch.cat([step_features[1], step_features[2, :1]]))
    pending.clear()
    assert not pending and pending.num_tokens == 0
    pending.add(40, step_features[0, :1])  # a new backlog starts where the next step commits
    assert pending.start == 40 and torch.equal(pending.features(), step_features[0, :1])
