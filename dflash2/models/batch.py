"""The description of one batched ragged forward over per-slot caches.

Dimension letters: R rows, L padded positions per row, T key positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """Rows of different lengths and start positions, padded to ``[R, L]``.

    Row r holds ``lengths[r]`` new tokens for cache slot ``slots[r]`` at absolute positions
    ``starts[r] .. starts[r] + lengths[r] - 1``; everything before ``starts[r]`` is already
    cached. Padding positions compute garbage that is never written to a cache or read.

    Attributes:
        slots: cache slot of each row.
        input_ids: ``[R, L]`` int64 (padding = 0).
        starts: cached length of each row before this forward.
        lengths: number of real tokens in each row.
        positions: ``[R, L]`` int64 absolute positions.
        valid: ``[R, L]`` bool, True on real tokens.
        flat_slots, flat_positions: ``[N]`` int64 slot and position of every real token.
        key_len: T, the longest ``starts[r] + lengths[r]``.
        real_index: ``[N]`` int64 indices of the real tokens in the flattened ``[R·L]``
            positions, or None when there is no padding (see :meth:`real_tokens`).
    """

    slots: list[int]
    input_ids: torch.Tensor
    starts: list[int]
    lengths: list[int]
    positions: torch.Tensor
    valid: torch.Tensor
    flat_slots: torch.Tensor
    flat_positions: torch.Tensor
    key_len: int
    real_index: torch.Tensor | None

    @classmethod
    def build(
        cls, slots: list[int], token_rows: list[list[int]], starts: list[int], device: torch.device | str
    ) -> ForwardBatch:
        """Pad ``token_rows`` (one list of ids per row) into a batch on ``device``."""
        lengths = [len(row) for row in token_rows]
        width = max(lengths)
        input_ids = torch.zeros(len(token_rows), width, dtype=torch.long)
        for r, row in enumerate(token_rows):
            input_ids[r, : len(row)] = torch.tensor(row, dtype=torch.long)
        offsets = torch.arange(width)
        positions = torch.tensor(starts)[:, None] + offsets[None]
        valid = offsets[None] < torch.tensor(lengths)[:, None]
        flat_slots = torch.tensor(slots)[:, None].expand(-1, width)[valid]
        return cls(
            slots=list(slots),
            input_ids=input_ids.to(device),
            starts=list(starts),
            lengths=lengths,
            positions=positions.to(device),
            valid=valid.to(device),
            flat_slots=flat_slots.to(device),
            flat_positions=positions[valid].to(device),
            key_len=max(s + n for s, n in zip(starts, lengths)),
            real_index=None if min(lengths) == width else valid.flatten().nonzero()[:, 0].to(device),
        )

    def real_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """``x [R, L, ...]`` → ``[N, ...]``, the entries of real tokens in row-major order.

        Equal to ``x[valid]``, but one index (none without padding) computed once per batch
        instead of a boolean-mask lookup per call.
        """
        flat = x.reshape(-1, *x.shape[2:])
        return flat if self.real_index is None else flat.index_select(0, self.real_index)

    def causal_mask(self, sliding_window: int | None = None) -> torch.Tensor:
        """``[R, 1, L, T]`` bool: key j is visible to query i when ``j ≤ pos_i`` and j is cached.

        With a sliding window W, keys also need ``pos_i − j < W``.
        """
        keys = torch.arange(self.key_len, device=self.positions.device)
        query_pos = self.positions[:, :, None]  # [R, L, 1]
        ends = (self.positions[:, :1] + self.valid.sum(-1, keepdim=True))[:, :, None]  # [R, 1, 1]
        mask = (keys[None, None] <= query_pos) & (keys[None, None] < ends)
        if sliding_window is not None:
            mask &= query_pos - keys[None, None] < sliding_window
        return mask[:, None]
