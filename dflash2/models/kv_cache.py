"""Preallocated per-slot key/value cache; rollback costs nothing.

One tensor pair holds every layer's K/V for ``num_slots`` sequences of up to ``max_len``
tokens. The cache keeps no lengths: a slot's committed length is the engine's (``Request.num_cached``),
every forward is told where each row starts, and attention reads only the keys before a row's own
positions, so entries past a committed length are never read and a later write simply overwrites
them: rolling back is nothing at all.

Dimension letters: N flattened tokens, R rows, nkv key-value heads, T key positions, d head dim.
"""

from __future__ import annotations

import torch


class KVCache:
    """K/V storage ``[num_layers, num_slots, nkv, max_len, d]``; zero-filled unless ``zeroed`` is False.

    Raises:
        ValueError: from :meth:`write` when a position is outside ``[0, max_len)``.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        zeroed: bool = True,
    ) -> None:
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        # zeroed=False: uninitialised, so a large CPU allocation stays unbacked until written (the
        # background compile worker writes only its scratch slot; masks never read past a length).
        allocate = torch.zeros if zeroed else torch.empty
        self.k = allocate(shape, dtype=dtype, device=device)
        self.v = allocate(shape, dtype=dtype, device=device)
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        """Bytes held by the K and V tensors."""
        return self.k.numel() * self.k.element_size() * 2

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v [N, nkv, d]`` for tokens at ``(slots [N], positions [N])``."""
        self.k[layer, slots, :, positions] = k.to(self.k.dtype)
        self.v[layer, slots, :, positions] = v.to(self.v.dtype)

    def read(self, layer: int, slots: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of ``slots`` (R of them) for positions ``[0, length)``: each ``[R, nkv, length, d]``.

        Contiguous ascending slots are returned as views (no copy).
        """
        first = slots[0]
        if slots == list(range(first, first + len(slots))):
            return (
                self.k[layer, first : first + len(slots), :, :length],
                self.v[layer, first : first + len(slots), :, :length],
            )
        index = torch.tensor(slots, device=self.k.device)
        return self.k[layer, index, :, :length], self.v[layer, index, :, :length]

    def free(self, slot: int) -> None:
        """Nothing to release: the tensors are preallocated, and a slot's stale entries are never read."""
