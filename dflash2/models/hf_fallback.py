"""Generic transformers fallback for causal LMs without a decoder written here.

Runs one row at a time with a ``DynamicCache`` per slot, cropped to the committed length
before each forward (the rollback). Layers that keep less than the whole past — sliding windows,
the recurrent state and convolution window of linear attention (Gated DeltaNet hybrids) — record
what a rollback needs (transformers' ``activate_past_recording``: the window's evicted keys and
the state after every verified position) until that crop. Results are identical to the batched
decoders; it is only slower. Features come from ``output_hidden_states[id + 1]`` (docs/dflash2-spec.md §2.1).

Dimension letters: R rows, L positions per row, V vocab, F·H captured features.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dflash2.models.batch import ForwardBatch


class SlotCaches:
    """Per-slot ``DynamicCache`` objects; a slot's cache is cropped to the row's start before its next
    forward (the engine's committed length, as ``KVCache`` readers use it)."""

    def __init__(self, num_slots: int, max_len: int) -> None:
        self.caches: list[Any] = [None] * num_slots
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        """Bytes currently held (grows with use; nothing is preallocated)."""
        total = 0
        for cache in self.caches:
            if cache is not None:
                for layer in getattr(cache, "layers", []):
                    for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                        if isinstance(t, torch.Tensor):
                            total += t.numel() * t.element_size()
        return total

    def free(self, slot: int) -> None:
        """Drop a slot's cache."""
        self.caches[slot] = None


class HFCausalLMTarget(nn.Module):
    """Any ``AutoModelForCausalLM`` — or the text side of an image-text-to-text model, fed text only —
    behind the target interface (batch 1 per forward)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model: Any = model
        # A multimodal model's text decoder is what this target serves: its config (layers, heads, vocab).
        self.config: Any = model.config.get_text_config()
        # transformers ≥ 5.x names the cache argument ``cache``; earlier releases ``past_key_values``.
        parameters = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in parameters else "past_key_values"

    @property
    def num_layers(self) -> int:
        """Number of decoder layers."""
        return int(self.config.num_hidden_layers)

    def embedding_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input embedding weight, output head weight)``, each ``[V, H]``."""
        embed, head = self.model.get_input_embeddings(), self.model.get_output_embeddings()
        assert isinstance(embed.weight, torch.Tensor) and head is not None and isinstance(head.weight, torch.Tensor)
        return embed.weight, head.weight

    def prepack(self) -> int:
        """No-op: a transformers model keeps its own linear layers (nothing packed)."""
        return 0

    def new_cache(self, num_slots: int, max_len: int) -> SlotCaches:
        """Per-slot dynamic caches (allocated on first use)."""
        return SlotCaches(num_slots, max_len)

    @torch.inference_mode()
    def run(
        self,
        batch: ForwardBatch,
        cache: SlotCaches,
        capture_layer_ids: Sequence[int] = (),
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Same contract as ``TargetModel.run``: logits ``[R, L or 1, V]`` and features ``[R, L, F·H]``."""
        from transformers import DynamicCache

        logits_rows, feature_rows = [], []
        for r, slot in enumerate(batch.slots):
            start, length = batch.starts[r], batch.lengths[r]
            past = cache.caches[slot]
            if past is None or start == 0:
                past = DynamicCache(config=self.config)
                # Sliding-window and linear-attention layers keep what a rollback needs until the next
                # crop (a no-op for full-attention layers, which keep everything anyway).
                past.activate_past_recording()
            elif past.get_seq_length() >= start:
                # Negative: drop that many trailing tokens; crop(0) still trims windows and states
                # recorded by the last forward back to what the next one needs. (A shorter cache is the
                # scratch slot's, which the start-up timings run at any position.)
                past.crop(start - past.get_seq_length())
            # A verify may be rolled back to any of its positions: record the recurrent state after each
            # (a prefill is never rolled back into: its last token is committed).
            _record_states(past, 0 if last_only else length)
            out = self.model(
                input_ids=batch.input_ids[r : r + 1, :length],
                position_ids=batch.positions[r : r + 1, :length],
                use_cache=True,
                output_hidden_states=bool(capture_layer_ids),
                **{self._cache_kwarg: past},
            )
            cache.caches[slot] = past  # updated in place by the forward
            logits = out.logits[0].float()  # [len, V]
            logits_rows.append(logits[length - 1 :] if last_only else logits)
            if capture_layer_ids:
                feature_rows.append(torch.cat([out.hidden_states[i + 1][0] for i in capture_layer_ids], dim=-1))
        return _pad(logits_rows), (_pad(feature_rows) if feature_rows else None)


def _record_states(past: Any, count: int) -> None:
    """Have every linear-attention layer of ``past`` keep its recurrent state after each of the next
    forward's last ``count`` tokens, so a rollback into that forward restores the state exactly
    (transformers' ``activate_past_recording``; full- and sliding-attention layers keep their K/V)."""
    for layer in getattr(past, "layers", ()):
        if getattr(layer, "record_past", False) and hasattr(layer, "recurrent_states_to_keep"):
            layer.recurrent_states_to_keep = count


def _pad(rows: list[torch.Tensor]) -> torch.Tensor:
    """Stack ``[len_r, X]`` tensors into ``[R, max len, X]`` with zero padding."""
    width = max(t.shape[0] for t in rows)
    out = rows[0].new_zeros(len(rows), width, rows[0].shape[-1])
    for r, t in enumerate(rows):
        out[r, : t.shape[0]] = t
    return out
