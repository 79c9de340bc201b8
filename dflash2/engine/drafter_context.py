"""The drafter context rows committed and have not written yet (docs/dflash2-spec.md §5.4): batched for one write.

A verify step keeps the committed tokens' target features on each request (``Request.pending_context``);
they become drafter context K/V when the row drafts next (inside the drafting forward), when it holds
``MAX_PENDING_CONTEXT`` positions of them, when its slot is copied for the prefix cache, or when it ends.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflash2.engine.request import Request
from dflash2.runner import ModelRunner, PendingWrites

# Pending drafter context is written once a request holds this many positions of it, so a request that
# decodes without drafts for long keeps little memory and a later draft step little work.
MAX_PENDING_CONTEXT = 64


def pending_writes(rows: Sequence[Request]) -> PendingWrites | None:
    """The drafter context ``rows`` committed since they last drafted, as one batch padded to the
    longest (a row with nothing pending has length 0), or None when no row has any."""
    segments = [r.pending_context.features() if r.pending_context else None for r in rows]
    some = next((s for s in segments if s is not None), None)
    if some is None:
        return None
    return PendingWrites(
        torch.nn.utils.rnn.pad_sequence([some[:0] if s is None else s for s in segments], batch_first=True),
        [r.pending_context.num_tokens for r in rows],
        [r.pending_context.start for r in rows],
    )


def write_context(runner: ModelRunner, requests: Sequence[Request]) -> None:
    """Write the drafter context still pending for ``requests`` (one batched call) and clear it; nothing
    without a drafter."""
    pending = [r for r in requests if r.pending_context and r.slot is not None]
    writes = pending_writes(pending)
    if writes is None or runner.drafting is None:
        return
    slots = [r.slot for r in pending if r.slot is not None]
    runner.drafting.append_context(slots, writes.starts, writes.features, writes.lengths)
    for request in pending:
        request.pending_context.clear()
