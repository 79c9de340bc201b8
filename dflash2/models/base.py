"""The contracts between the engine and a target model (own decoder or transformers fallback)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from dflash2.models.batch import ForwardBatch


class SlotCache(Protocol):
    """Per-slot target cache: committed ``lengths`` with O(1) ``rollback`` and ``free``."""

    lengths: list[int]

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        ...

    def rollback(self, slot: int, length: int) -> None:
        """Set a slot's committed length; later entries are ignored."""
        ...

    def free(self, slot: int) -> None:
        """Forget a slot."""
        ...


class Target(Protocol):
    """What the engine needs of a target model."""

    config: Any

    @property
    def num_layers(self) -> int:
        """Decoder layers (``target_layer_ids`` index them)."""
        ...

    def embedding_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(embed_tokens.weight [V, H], lm_head.weight [V, H])``, shared with the drafter."""
        ...

    def prepack(self) -> int:
        """Pre-pack linear weights for CPU bfloat16 inference, if the model can; layers packed."""
        ...

    def new_cache(self, num_slots: int, max_len: int) -> Any:
        """A cache for ``num_slots`` sequences of ``max_len`` tokens (a ``SlotCache``)."""
        ...

    def run(
        self, batch: ForwardBatch, cache: Any, capture_layer_ids: Sequence[int] = (), last_only: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``[R, L or 1, V]`` float32 and captured features ``[R, L, F·H]`` or None."""
        ...
