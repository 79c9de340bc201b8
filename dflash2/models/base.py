"""The contracts between the runner and its models: a target (own decoder or transformers fallback) and a
drafter (the DFlash 2 drafter; any other drafter family implements :class:`Drafter`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from dflash2.models.batch import ForwardBatch
from dflash2.models.drafter import SelectorWeights
from dflash2.models.drafter_config import DrafterConfig
from dflash2.models.kv_cache import KVCache


class SlotCache(Protocol):
    """Per-slot target cache. It keeps no lengths: each forward says where its rows start (the engine's
    committed lengths), entries past a start are never read, so a rollback is nothing to do."""

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        ...

    def free(self, slot: int) -> None:
        """Forget a slot (release what it holds, if anything)."""
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


class Drafter(Protocol):
    """What the runner needs of a drafter bound to its target (:class:`~dflash2.models.drafter.DFlashDrafter`
    implements it): a context cache written from the target's features, one parallel forward over a block
    ``[anchor, MASK × (B−1)]`` per row, and the unary logits (with the DFlash 2 selector's weights, when
    it has them) the candidates and the walk are taken from. ``docs/dflash2-spec.md`` §2–§4.

    Dimension letters: R rows, B block width, H hidden, F·H captured target features, V vocabulary (or the
    draft vocabulary Vd).
    """

    config: DrafterConfig
    draft_vocab: torch.Tensor | None  # [Vd] target ids of the draft vocabulary, or None (the full one)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype."""
        ...

    @property
    def num_candidates(self) -> int:
        """Candidates per slot the walk chooses from (top-k)."""
        ...

    @property
    def feature_dim(self) -> int:
        """F·H: the width of the captured target features the context is written from."""
        ...

    @property
    def supports_compile(self) -> bool:
        """True when the runner may compile its block forward (:class:`~dflash2.runner.compile.CompiledDrafter`)."""
        ...

    def new_cache(
        self, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device, zeroed: bool = True
    ) -> KVCache:
        """A context K/V cache for ``num_slots`` sequences of ``max_len`` positions."""
        ...

    def prepack(self) -> int:
        """Pre-pack linear weights for CPU inference, if it can; layers packed."""
        ...

    def append_context(
        self, cache: KVCache, slots: torch.Tensor, positions: torch.Tensor, features: torch.Tensor
    ) -> None:
        """Write context K/V of tokens at ``slots [N]``, ``positions [N]`` from ``features [N, F·H]``."""
        ...

    def draft_hidden(
        self, cache: KVCache, slots: list[int], anchor_ids: torch.Tensor, starts: torch.Tensor, block_size: int
    ) -> torch.Tensor:
        """Hidden states ``[R, B, H]`` of one forward over each row's block at ``starts [R]``."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Unary logits ``[..., V or Vd]`` float32 of ``hidden [..., H]``."""
        ...

    def selector_weights(self) -> SelectorWeights | None:
        """The DFlash 2 selector's tensors, or None (a walk over the unary scores alone)."""
        ...
