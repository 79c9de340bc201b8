"""Target decoder for the Llama / Mistral / Qwen2 / Qwen3 families, written for speculative serving.

Differences from the Hugging Face reference implementations (same math, same weights):
a batched forward over rows of different lengths and start positions, a preallocated
per-slot KV cache (``KVCache``) with O(1) rollback, and capture of the residual stream at
the drafter's ``target_layer_ids`` only (spec §2.1: the output of decoder layer ``id``).

Dimension letters: R rows, L positions per row, T key positions, H hidden size, V vocab,
F number of captured layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dflash2.kv_cache import KVCache
from dflash2.models.batch import ForwardBatch
from dflash2.models.layers import MLP, PackedLinear, RMSNorm, RotaryEmbedding, apply_rope, attention, prepack_linears

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class Attention(nn.Module):
    """Grouped-query self-attention with optional QKV bias (Qwen2) and per-head q/k norm (Qwen3)."""

    def __init__(self, config: Any, head_dim: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        self.q_proj = nn.Linear(hidden, self.num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * head_dim, hidden, bias=bool(getattr(config, "attention_bias", False)))
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.model_type == "qwen3":
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        mask: torch.Tensor,
        cache: KVCache,
        layer: int,
    ) -> torch.Tensor:
        num_rows, num_positions, _ = x.shape
        q = self.q_proj(x).view(num_rows, num_positions, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_rows, num_positions, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_rows, num_positions, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), *rope)  # [R, nh, L, d]
        k = apply_rope(k.transpose(1, 2), *rope)  # [R, nkv, L, d]
        # Write the new tokens' K/V into their slots, then attend over each slot's cache.
        new_k, new_v = batch.real_tokens(k.transpose(1, 2)), batch.real_tokens(v)  # [N, nkv, d]
        cache.write(layer, batch.flat_slots, batch.flat_positions, new_k, new_v)
        keys, values = cache.read(layer, batch.slots, batch.key_len)
        return self.o_proj(attention(q, keys.to(q.dtype), values.to(q.dtype), mask))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: attention and SwiGLU MLP with residuals."""

    def __init__(self, config: Any, head_dim: int, sliding_window: int | None) -> None:
        super().__init__()
        self.self_attn = Attention(config, head_dim)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, bias=bool(getattr(config, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.sliding_window = sliding_window


def layer_sliding_windows(config: Any) -> list[int | None]:
    """Per-layer sliding window (None = full attention), following each family's config keys."""
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    if config.model_type == "mistral":
        return [window] * num_layers
    if config.model_type in ("qwen2", "qwen3") and getattr(config, "use_sliding_window", False):
        first = getattr(config, "max_window_layers", num_layers)
        return [window if i >= first else None for i in range(num_layers)]
    return [None] * num_layers


class TargetModel(nn.Module):
    """Causal LM of the Llama family with slot-cache forward and feature capture.

    Parameter names match the Hugging Face checkpoints with the ``model.`` prefix removed
    (``embed_tokens``, ``layers.i.*``, ``norm``, ``lm_head``).
    """

    config: Any

    def __init__(self, config: Any) -> None:
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"TargetModel supports {SUPPORTED_MODEL_TYPES}, not {config.model_type!r}")
        self.config = config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        windows = layer_sliding_windows(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, self.head_dim, w) for w in windows)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Linear | PackedLinear = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config, self.head_dim)

    def decoder_layers(self) -> list[DecoderLayer]:
        """The decoder layers, typed."""
        return [layer for layer in self.layers if isinstance(layer, DecoderLayer)]

    @property
    def num_layers(self) -> int:
        """Number of decoder layers."""
        return len(self.layers)

    def embedding_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(embed_tokens.weight, lm_head.weight)``, each ``[V, H]``."""
        head = self.lm_head.weight
        assert head is not None  # a packed LM head keeps its dense weight
        return self.embed_tokens.weight, head

    def prepack(self) -> int:
        """Pre-pack every linear layer for CPU bfloat16 inference (:class:`PackedLinear`).

        Only when :func:`dflash2.models.layers.can_prepack` holds; outputs are unchanged.
        The LM head keeps its dense weight, which the drafter shares. Idempotent.

        Returns:
            The number of layers packed.
        """
        count = prepack_linears(self.layers)
        if isinstance(self.lm_head, nn.Linear):
            self.lm_head = PackedLinear(self.lm_head.weight, self.lm_head.bias, keep_weight=True)
            count += 1
        return count

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        """A preallocated KV cache for ``num_slots`` sequences of ``max_len`` tokens."""
        weight = self.embed_tokens.weight
        attn = self.decoder_layers()[0].self_attn
        return KVCache(
            self.num_layers, num_slots, attn.num_kv_heads, max_len, self.head_dim, weight.dtype, weight.device
        )

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, cache: KVCache, capture_layer_ids: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run new tokens through the decoder, appending their K/V to the cache.

        Args:
            batch: the rows to run (``ForwardBatch``).
            cache: the target KV cache; slot lengths are not changed here (the engine commits).
            capture_layer_ids: decoder layers whose output (residual stream) to return.

        Returns:
            ``(hidden [R, L, H] after the final norm, features [R, L, F·H] or None)``.
        """
        h = self.embed_tokens(batch.input_ids)
        rope = self.rotary(batch.positions, h.dtype)
        masks: dict[int | None, torch.Tensor] = {}
        wanted = set(capture_layer_ids)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.decoder_layers()):
            if layer.sliding_window not in masks:
                masks[layer.sliding_window] = batch.causal_mask(layer.sliding_window)
            h = h + layer.self_attn(layer.input_layernorm(h), rope, batch, masks[layer.sliding_window], cache, i)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if i in wanted:
                captured[i] = h
        features = torch.cat([captured[i] for i in capture_layer_ids], dim=-1) if capture_layer_ids else None
        return self.norm(h), features

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [..., H]`` → logits ``[..., V]`` (float32)."""
        return self.lm_head(hidden).float()

    def run(
        self,
        batch: ForwardBatch,
        cache: KVCache,
        capture_layer_ids: Sequence[int] = (),
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward plus LM head: logits ``[R, L, V]`` (``[R, 1, V]`` at each row's last token
        when ``last_only``) in float32, and the captured features ``[R, L, F·H]`` or None."""
        hidden, features = self.forward(batch, cache, capture_layer_ids)
        if last_only:
            last = torch.tensor([n - 1 for n in batch.lengths], device=hidden.device)
            hidden = hidden[torch.arange(len(last), device=hidden.device), last][:, None]
        with torch.inference_mode():
            return self.compute_logits(hidden), features
