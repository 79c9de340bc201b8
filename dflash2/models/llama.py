"""Target decoder for the Llama / Mistral / Qwen2 / Qwen3 families, written for speculative serving.

Differences from the Hugging Face reference implementations (same math, same weights):
a batched forward over rows of different lengths and start positions, a preallocated
per-slot KV cache (``KVCache``) with O(1) rollback, and capture of the residual stream at
the drafter's ``target_layer_ids`` only (docs/dflash2-spec.md §2.1: the output of decoder layer ``id``).

Two entry points share the layers: :meth:`TargetModel.forward` runs a ragged
:class:`ForwardBatch` (prefill), and :meth:`TargetModel.forward_slots` runs a static-shape block
whose slots, positions and key range are tensors (verify and the autoregressive step, eager and
compiled: the model runner compiles this same method).

Dimension letters: R rows, L positions per row, T key positions, H hidden size, V vocab,
F number of captured layers, nh / nkv query / key-value heads, d head dim.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from dflash2.models.batch import ForwardBatch
from dflash2.models.kv_cache import KVCache
from dflash2.models.layers import (
    MLP,
    FusedMLP,
    PackedLinear,
    RMSNorm,
    RotaryEmbedding,
    apply_rope,
    attention,
    fuse_linears,
    prepack_linears,
    shallow_copy,
)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# Writes one layer's new ``k, v [R, L, nkv, d]`` into its cache and returns the keys and values the
# layer attends over, each ``[R, nkv, T, d]``.
CacheUpdate = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


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
        self.qkv: nn.Module | None = None  # Q/K/V in one matrix (fuse_projections)
        self.qkv_sizes = [self.num_heads * head_dim, self.num_kv_heads * head_dim, self.num_kv_heads * head_dim]

    def fuse_projections(self) -> None:
        """Replace Q/K/V by one fused matrix ``qkv``, in place (new weight tensors), so an inference
        copy runs one matrix product where it ran three. The separate projections, which the
        checkpoint names, are dropped from this module. Quantized projections of different formats
        stay separate."""
        qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        if qkv is None:  # quantized in different formats (a GGUF mix): they stay three products
            return
        self.qkv = qkv
        del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor, update_cache: CacheUpdate
    ) -> torch.Tensor:
        """``x [R, L, H]`` → ``[R, L, H]``: the new tokens' K/V go through ``update_cache``, which
        returns the keys and values to attend over under ``mask [R, 1, L, T]``."""
        num_rows, num_positions, _ = x.shape
        if self.qkv is not None:
            q, k, v = self.qkv(x).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(num_rows, num_positions, self.num_heads, self.head_dim)
        k = k.view(num_rows, num_positions, self.num_kv_heads, self.head_dim)
        v = v.view(num_rows, num_positions, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), *rope)  # [R, nh, L, d]
        k = apply_rope(k.transpose(1, 2), *rope).transpose(1, 2)  # [R, L, nkv, d]
        keys, values = update_cache(k, v)  # [R, nkv, T, d]
        return self.o_proj(attention(q, keys.to(q.dtype), values.to(q.dtype), mask))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: attention and SwiGLU MLP with residuals."""

    def __init__(self, config: Any, head_dim: int, sliding_window: int | None) -> None:
        super().__init__()
        self.self_attn = Attention(config, head_dim)
        self.mlp: nn.Module = MLP(
            config.hidden_size, config.intermediate_size, bias=bool(getattr(config, "mlp_bias", False))
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.sliding_window = sliding_window

    def fuse_projections(self) -> None:
        """Fuse Q/K/V and gate/up into one matrix each, in place (see :meth:`Attention.fuse_projections`)."""
        self.self_attn.fuse_projections()
        if isinstance(self.mlp, MLP) and FusedMLP.can_fuse(self.mlp):
            self.mlp = FusedMLP(self.mlp)

    def forward(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor, update_cache: CacheUpdate
    ) -> torch.Tensor:
        """The residual stream ``h [R, L, H]`` through attention and the MLP."""
        h = h + self.self_attn(self.input_layernorm(h), rope, mask, update_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


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
    # Set by dflash2.models.tensor_parallel.shard_target on a tensor-parallel rank's share of the model.
    shard: Any = None
    # How the linears are held (a dflash2.models.quantize.QuantizationReport), set where they are quantized.
    quantization: Any = None

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

    @property
    def vocab_size(self) -> int:
        """V, the rows of the embedding (of the whole model, on a tensor-parallel rank too)."""
        return int(self.embed_tokens.num_embeddings)

    def embedding_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(embed_tokens.weight, lm_head.weight)``, each ``[V, H]`` (a tensor-parallel rank's rows of
        them on a sharded model, :mod:`dflash2.models.tensor_parallel`)."""
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
        if self.shard is not None:  # a rank's vocabulary rows, which no drafter shares
            count += prepack_linears(self.lm_head)
        elif isinstance(self.lm_head, nn.Linear):
            self.lm_head = PackedLinear(self.lm_head.weight, self.lm_head.bias, keep_weight=True)
            count += 1
        return count

    def new_cache(self, num_slots: int, max_len: int, zeroed: bool = True) -> KVCache:
        """A preallocated KV cache for ``num_slots`` sequences of ``max_len`` tokens (``zeroed``: see
        :class:`KVCache`)."""
        weight = self.embed_tokens.weight
        attn = self.decoder_layers()[0].self_attn
        return KVCache(
            self.num_layers, num_slots, attn.num_kv_heads, max_len, self.head_dim, weight.dtype, weight.device, zeroed
        )

    def fused_copy(self) -> TargetModel:
        """A copy for static-shape inference: the embedding, norms, LM head and output projections
        are this model's own modules, and each layer's Q/K/V and gate/up are fused into one new
        matrix (:meth:`DecoderLayer.fuse_projections`). This model keeps the checkpoint's layout."""
        clone = shallow_copy(self)
        layers = []
        for layer in self.decoder_layers():
            copied = shallow_copy(layer)
            copied.self_attn = shallow_copy(layer.self_attn)
            copied.fuse_projections()
            layers.append(copied)
        clone.layers = nn.ModuleList(layers)
        return clone

    def _decode(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask_for: Callable[[int | None], torch.Tensor],
        update_for: Callable[[int], CacheUpdate],
        capture_layer_ids: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder layers over ``h [R, L, H]``: one mask per sliding window (``mask_for``), each
        layer's cache access from ``update_for(layer)``. Returns the last residual ``[R, L, H]`` and
        the captured features ``[R, L, F·H]`` (None without capture)."""
        masks: dict[int | None, torch.Tensor] = {}
        wanted = set(capture_layer_ids)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.decoder_layers()):
            if layer.sliding_window not in masks:
                masks[layer.sliding_window] = mask_for(layer.sliding_window)
            h = layer(h, rope, masks[layer.sliding_window], update_for(i))
            if i in wanted:
                captured[i] = h
        features = torch.cat([captured[i] for i in capture_layer_ids], dim=-1) if capture_layer_ids else None
        return h, features

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, cache: KVCache, capture_layer_ids: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run new tokens through the decoder, appending their K/V to the cache (prefill).

        Args:
            batch: the rows to run (``ForwardBatch``).
            cache: the target KV cache; slot lengths are not changed here (the engine commits).
            capture_layer_ids: decoder layers whose output (residual stream) to return.

        Returns:
            ``(hidden [R, L, H] after the final norm, features [R, L, F·H] or None)``.
        """

        def update_for(layer: int) -> CacheUpdate:
            def update(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                # Write the real tokens' K/V into their slots, then read each slot's cache.
                cache.write(layer, batch.flat_slots, batch.flat_positions, batch.real_tokens(k), batch.real_tokens(v))
                return cache.read(layer, batch.slots, batch.key_len)

            return update

        h = self.embed_tokens(batch.input_ids)
        rope = self.rotary(batch.positions, h.dtype)
        h, features = self._decode(h, rope, batch.causal_mask, update_for, capture_layer_ids)
        return self.norm(h), features

    def forward_slots(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        write_positions: torch.Tensor,
        read_slots: torch.Tensor | slice,
        key_positions: torch.Tensor,
        caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        capture_layer_ids: Sequence[int] = (),
        tree_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A static-shape forward over per-slot caches (verify, the autoregressive step, a token tree):
        the model runner calls it eagerly and compiles it. Shapes come from the tensors alone, so one
        graph serves every slot, position and key length.

        Args:
            input_ids: ``[R, L]``, run at ``positions [R, L]``.
            write_slots, write_positions: ``[R, L]``, where each token's K/V is written (the
                runner sends padding to a scratch slot).
            read_slots: ``[R]`` (or a slice of consecutive slots) whose keys each row attends over.
            key_positions: ``[T]`` = ``0 … T−1``; key j is visible to a query at p when j ≤ p (and
                inside the layer's sliding window).
            caches: per layer ``(k, v)``, each ``[slots, nkv, max_len, d]``, written in place.
            capture_layer_ids: decoder layers whose output to return as features.
            tree_mask: ``[R, L, L]`` bool for a token tree (:mod:`dflash2.spec.tree`), or None for
                chains. With a tree, row r's node i runs at ``positions[r, i]`` = start + its depth but
                is written at start + i (``write_positions``), where start = ``positions[r, 0]``;
                it sees every key before start and the block's keys j with ``tree_mask[r, i, j]``
                (itself and its ancestors).

        Returns:
            ``(logits [R, L, V] float32, features [R, L, F·H]`` — ``[R, L, 0]`` without capture).
        """
        h = self.embed_tokens(input_ids)
        rope = self.rotary(positions, h.dtype)
        if tree_mask is None:
            visible = key_positions[None, None, :] <= positions[:, :, None]  # [R, L, T]
        else:
            visible = tree_visibility(positions[:, 0], key_positions, tree_mask)

        def mask_for(window: int | None) -> torch.Tensor:
            mask = visible
            if window is not None:
                mask = mask & (positions[:, :, None] - key_positions[None, None, :] < window)
            return mask[:, None]  # [R, 1, L, T]

        kv_heads = torch.arange(caches[0][0].shape[1], device=input_ids.device)
        index = (write_slots[:, :, None], kv_heads[None, None, :], write_positions[:, :, None])
        num_keys = key_positions.shape[0]

        def update_for(layer: int) -> CacheUpdate:
            k_cache, v_cache = caches[layer]

            def update(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                k_cache.index_put_(index, k.to(k_cache.dtype))
                v_cache.index_put_(index, v.to(v_cache.dtype))
                return k_cache[read_slots, :, :num_keys], v_cache[read_slots, :, :num_keys]

            return update

        h, features = self._decode(h, rope, mask_for, update_for, capture_layer_ids)
        logits = self.lm_head(self.norm(h)).float()
        return logits, (features if features is not None else h[..., :0])

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


def tree_visibility(starts: torch.Tensor, key_positions: torch.Tensor, tree_mask: torch.Tensor) -> torch.Tensor:
    """Which keys each node of a token tree sees: ``[R, L, T]`` bool.

    Args:
        starts: ``[R]`` each row's first block position (its context length).
        key_positions: ``[T]`` = ``0 … T−1``.
        tree_mask: ``[R, L, L]`` bool, node i sees block node j (written at start + j).
    """
    num_nodes = tree_mask.shape[-1]
    offsets = key_positions[None, :] - starts[:, None]  # [R, T]: a key's node index inside the block
    in_block = (offsets >= 0) & (offsets < num_nodes)
    index = offsets.clamp(0, num_nodes - 1)[:, None, :].expand(-1, tree_mask.shape[1], -1)  # [R, L, T]
    ancestors = tree_mask.gather(2, index) & in_block[:, None, :]
    return (offsets < 0)[:, None, :] | ancestors
