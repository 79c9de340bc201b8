"""DFlash (v1) and DFlash 2 block drafters in the published checkpoint layout.

docs/dflash2-spec.md §2 (drafter forward), §3 (DFlash 2 dynamic convolution), §4 (candidate selector
weights) and §1.3 (tensor names). The drafter shares the target's embedding and LM head,
which are bound at run time and never saved with it.

The drafting forward has two entry points over the same layers: :meth:`DFlashDrafter.draft_hidden`
(eager, reading a ``KVCache``) and :meth:`DFlashDrafter.draft_block` (static shapes, the block and
its unary logits; the model runner compiles it), and the context append likewise
(:meth:`DFlashDrafter.append_context`, :meth:`DFlashDrafter.write_context`). Choosing the drafted
path from the block's outputs is the selector's job (``dflash2/spec/selector.py``), not the model's.

Dimension letters: R rows, B block size (W: the drafted block's width), N flattened context tokens,
T context positions, H hidden size, F fused target layers, V vocab, K conv taps, G conv groups,
r selector rank.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from dflash2.models.drafter_config import DrafterConfig
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
    softcap,
)

logger = logging.getLogger(__name__)

# Candidates per slot for drafters without a selector (top-k of the unary logits).
DEFAULT_TOP_K = 16


def draft_vocab_indices(draft_vocab: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Positions of ``token_ids [...]`` in the sorted ``draft_vocab [Vd]``; ``-1`` where absent."""
    index = torch.searchsorted(draft_vocab, token_ids.contiguous()).clamp(max=len(draft_vocab) - 1)
    return torch.where(draft_vocab[index] == token_ids, index, -1)


def block_mask_at(
    config: DrafterConfig, positions: torch.Tensor, key_positions: torch.Tensor, layer: int
) -> torch.Tensor:
    """``[R, 1, W, T+W]`` bool mask of one layer for blocks at ``positions [R, W]`` against context keys
    ``key_positions [T]``: context key j is visible when ``j < positions[r, 0]`` (and inside the
    sliding window, if any); block keys are all visible (bidirectional) unless the layer is causal
    (spec §2.4)."""
    num_rows, width = positions.shape
    ctx = key_positions[None, None, :] < positions[:, :1, None]  # [R, 1, T]
    window = config.layer_window(layer)
    if window is not None:
        ctx = ctx & (positions[:, :, None] - key_positions[None, None, :] < window)  # [R, W, T]
    blk = torch.ones(width, width, dtype=torch.bool, device=positions.device)
    if config.layer_is_causal(layer):
        blk = blk.tril()
    return torch.cat([ctx.expand(-1, width, -1), blk[None].expand(num_rows, -1, -1)], dim=-1)[:, None]


def transform_logits(config: DrafterConfig, logits: torch.Tensor) -> torch.Tensor:
    """The LM head's float32 output → unary logits (spec §2.5): ``output_multiplier``, then the softcap."""
    if config.output_multiplier != 1.0:
        logits = logits * config.output_multiplier
    return softcap(logits, config.final_logit_softcapping)


def inference_copy(drafter: DFlashDrafter, own_layers: bool) -> DFlashDrafter:
    """A copy of ``drafter`` for static-shape inference sharing its modules; with ``own_layers`` its
    decoder layers are copies with fused projections (:meth:`DraftLayer.fuse_projections`), so the
    drafter's own may be pre-packed in place. No selector (its tensors are read directly)."""
    clone = shallow_copy(drafter)
    if own_layers:
        layers = copy.deepcopy(drafter.layers)
        for layer in layers:
            assert isinstance(layer, DraftLayer)
            layer.fuse_projections()
        clone.layers = layers
    clone.candidate_selector = None
    return clone


class DynamicConv(nn.Module):
    """Two-tap (K-tap) dynamic short convolution around one sublayer (spec §3.2).

    ``base_kernel [2, K, H]``: side 0 convolves the sublayer input, side 1 its output.
    ``kernel_projection: H → 2·K·G`` gives a per-position correction shared by each group
    of ``group_size`` contiguous channels; both sides' coefficients come from the pre-sublayer
    input. Taps never cross a block boundary (position 0 reads zero padding).
    """

    def __init__(self, hidden_size: int, group_size: int, kernel_size: int) -> None:
        super().__init__()
        self.group_size = group_size
        self.kernel_size = kernel_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False)
        self.reset_to_identity()

    def reset_to_identity(self) -> None:
        """Identity initialisation (spec §3.4): tap 0 = 1, other taps 0, zero projection."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def coefficients(self, x: torch.Tensor) -> torch.Tensor:
        """``x [R, B, H]`` (the sublayer input) → coefficients ``[R, B, 2, K, H]``."""
        num_rows, block, _ = x.shape
        dynamic = self.kernel_projection(x).view(num_rows, block, 2, self.kernel_size, self.num_groups)
        return self.base_kernel + dynamic.repeat_interleave(self.group_size, dim=-1)

    @staticmethod
    def convolve(y: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
        """``out_t = Σ_j coefficients[:, t, j] ⊙ y_{t−j}`` with zeros before the block start.

        Args:
            y: ``[R, B, H]``; coefficients: ``[R, B, K, H]`` (one side).
        """
        out = coefficients[:, :, 0] * y
        for tap in range(1, coefficients.shape[2]):
            shifted = torch.zeros_like(y)
            shifted[:, tap:] = y[:, :-tap]
            out = out + coefficients[:, :, tap] * shifted
        return out


class DraftAttention(nn.Module):
    """Qwen3-style attention whose queries are block tokens and keys/values are [context; block]."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        hidden, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            d,
        )
        self.q_proj = nn.Linear(hidden, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.qkv: nn.Module | None = None  # fused copies (fuse_projections)
        self.kv: nn.Module | None = None

    def fuse_projections(self) -> None:
        """Replace Q/K/V by two fused matrices, in place — ``qkv`` for the block, ``kv`` for the
        context — so an inference copy runs one matrix product where it ran three (or two). The
        separate projections, which checkpoints and training use, are dropped."""
        qkv, kv = fuse_linears([self.q_proj, self.k_proj, self.v_proj]), fuse_linears([self.k_proj, self.v_proj])
        if qkv is None or kv is None:  # quantized in different formats: they stay separate products
            return
        self.qkv, self.kv = qkv, kv
        del self.q_proj, self.k_proj, self.v_proj

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [R, L, H]`` → ``(k, v)`` each ``[R, nkv, L, d]`` (k normed and rotated)."""
        if self.kv is not None:
            k, v = self.kv(x).split(self.num_kv_heads * self.head_dim, dim=-1)
        else:
            k, v = self.k_proj(x), self.v_proj(x)
        return self._rotated_key_value(k, v, cos, sin)

    def _rotated_key_value(
        self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_rows, length, _ = k.shape
        k = self.k_norm(k.view(num_rows, length, self.num_kv_heads, self.head_dim))
        v = v.view(num_rows, length, self.num_kv_heads, self.head_dim)
        return apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_k: torch.Tensor,
        context_v: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Block ``x [R, B, H]`` attends to ``context_k/v [R, nkv, T, d]`` and itself; mask ``[R, 1, B, T+B]``."""
        num_rows, block, _ = x.shape
        if self.qkv is not None:
            kv_size = self.num_kv_heads * self.head_dim
            q, k, v = self.qkv(x).split([self.num_heads * self.head_dim, kv_size, kv_size], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = self.q_norm(q.view(num_rows, block, self.num_heads, self.head_dim))
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k, v = self._rotated_key_value(k, v, cos, sin)
        keys = torch.cat([context_k.to(k.dtype), k], dim=2)
        values = torch.cat([context_v.to(v.dtype), v], dim=2)
        return self.o_proj(attention(q, keys, values, mask))


class DraftLayer(nn.Module):
    """One drafter decoder layer; with convolutions it is the DFlash 2 layer of spec §3.1."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.self_attn = DraftAttention(config)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.mlp: nn.Module = MLP(hidden, config.intermediate_size)
        self.attention_conv: DynamicConv | None = None
        self.mlp_conv: DynamicConv | None = None
        if config.has_conv:
            self.attention_conv = DynamicConv(hidden, config.conv_group_size, config.conv_kernel_size)
            self.mlp_conv = DynamicConv(hidden, config.conv_group_size, config.conv_kernel_size)

    def fuse_projections(self) -> None:
        """Fuse Q/K/V (and the context's K/V) and gate/up into one matrix each, in place, for an
        inference copy (see :meth:`DraftAttention.fuse_projections`)."""
        self.self_attn.fuse_projections()
        if isinstance(self.mlp, MLP) and FusedMLP.can_fuse(self.mlp):
            self.mlp = FusedMLP(self.mlp)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_k: torch.Tensor,
        context_v: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """``h [R, B, H]`` → ``[R, B, H]``; the context K/V are never convolved."""
        u = self.input_layernorm(h)
        attn_coeff = None
        if self.attention_conv is not None:
            attn_coeff = self.attention_conv.coefficients(u)
            u = DynamicConv.convolve(u, attn_coeff[:, :, 0])
        a = self.self_attn(u, cos, sin, context_k, context_v, mask)
        if attn_coeff is not None:
            a = DynamicConv.convolve(a, attn_coeff[:, :, 1])
        h = h + a
        m = self.post_attention_layernorm(h)
        mlp_coeff = None
        if self.mlp_conv is not None:
            mlp_coeff = self.mlp_conv.coefficients(m)
            m = DynamicConv.convolve(m, mlp_coeff[:, :, 0])
        y = self.mlp(m)
        if mlp_coeff is not None:
            y = DynamicConv.convolve(y, mlp_coeff[:, :, 1])
        return h + y


@dataclass
class SelectorWeights:
    """The three selector tensors of a DFlash 2 checkpoint (spec §1.3), as the selector's pure
    functions (``dflash2/spec/selector.py``) take them.

    Attributes:
        predecessor_codebook: ``[V, r]`` A(·).
        successor_codebook: ``[V, r]`` B(·).
        hidden_projection: ``[r, H]`` H(·) (a Linear weight, no bias).
    """

    predecessor_codebook: torch.Tensor
    successor_codebook: torch.Tensor
    hidden_projection: torch.Tensor


class CandidateSelector(nn.Module):
    """Low-rank transition scorer of DFlash 2 (spec §4.2); tensor names as published."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        rank = config.selector_rank
        self.predecessor_codebook = nn.Parameter(torch.zeros(config.vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(config.vocab_size, rank))
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)

    def weights(self) -> SelectorWeights:
        """The tensors the pure selector functions take."""
        return SelectorWeights(self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight)


class DFlashDrafter(nn.Module):
    """A DFlash / DFlash 2 drafter: one parallel forward drafts a whole block.

    Use :meth:`bind_target` before drafting to share the target's embedding and LM head.
    """

    # The model runner may compile :meth:`draft_block` (the same layers as :meth:`draft_hidden` +
    # :meth:`logits`); a subclass that overrides those two sets this to False.
    supports_compile = True

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(config.num_features * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.candidate_selector = CandidateSelector(config) if config.has_selector else None
        self.rotary = RotaryEmbedding(config.as_hf_rope_config(), config.head_dim)
        self._target: tuple[torch.Tensor, torch.Tensor] | None = None
        # Draft vocabulary (FR-Spec): sorted token ids the LM head is restricted to; None = all.
        self.draft_vocab: torch.Tensor | None
        self.register_buffer("draft_vocab", None, persistent=False)
        # How often each draft-vocabulary token occurred in the training responses (aligned with
        # draft_vocab), when known: what limit_draft_vocab ranks by.
        self.draft_vocab_counts: torch.Tensor | None = None
        self._draft_head: torch.Tensor | None = None
        self._prepacked = False
        self._packed_draft_head: PackedLinear | None = None

    # ---- construction -------------------------------------------------------------------

    def draft_layers(self) -> list[DraftLayer]:
        """The decoder layers, typed."""
        return [layer for layer in self.layers if isinstance(layer, DraftLayer)]

    def bind_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Share the target's ``embed_tokens.weight [V, H]`` and ``lm_head.weight [V, H]``.

        Raises:
            ValueError: when the target's vocabulary or hidden size differs from the drafter's.
        """
        if embed_weight.shape != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(
                f"drafter expects a target embedding of shape {(self.config.vocab_size, self.config.hidden_size)}, "
                f"got {tuple(embed_weight.shape)}: the drafter was trained for a different target"
            )
        self._target = (embed_weight, lm_head_weight)
        self._refresh_draft_head()

    def set_draft_vocab(self, token_ids: torch.Tensor | None, counts: torch.Tensor | None = None) -> None:
        """Restrict the drafter's LM head to ``token_ids`` (a draft vocabulary), or lift it (None).

        The unary logits then cover only these tokens, which cuts the LM-head cost of drafting
        and training by ``V / len(token_ids)`` (FR-Spec, Zhao et al. 2025). Tokens outside it
        are never drafted; verification is unchanged, so decoding stays lossless.

        Args:
            token_ids: ``[Vd]`` distinct int64 token ids (stored sorted), or None.
            counts: ``[Vd]`` non-negative occurrence counts aligned with ``token_ids`` (how often
                each token appeared in the training responses), or None when unknown; kept for
                :meth:`limit_draft_vocab`.

        Raises:
            ValueError: on ids outside ``[0, vocab_size)``, duplicates, fewer ids than top-k, or
                counts of another length or with negative values.
        """
        if token_ids is None:
            self.draft_vocab = None
            self.draft_vocab_counts = None
            self._draft_head = None
            return
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        order = ids.argsort()
        ids = ids[order]
        if len(ids) == 0 or int(ids[0]) < 0 or int(ids[-1]) >= self.config.vocab_size:
            raise ValueError(f"draft vocabulary ids must lie in [0, {self.config.vocab_size})")
        if bool((ids[1:] == ids[:-1]).any()):
            raise ValueError("draft vocabulary ids must be distinct")
        if len(ids) < max(self.config.selector_top_k, 1):
            raise ValueError("the draft vocabulary is smaller than the selector's top-k")
        if counts is not None:
            counts = torch.as_tensor(counts, dtype=torch.long).flatten()
            if counts.shape != ids.shape or bool((counts < 0).any()):
                raise ValueError("draft vocabulary counts must be one non-negative count per token id")
            counts = counts[order]
        self.draft_vocab = ids.to(self.device)
        self.draft_vocab_counts = counts
        self._refresh_draft_head()

    @property
    def draft_vocab_size(self) -> int:
        """Tokens the drafter's LM head covers: the draft vocabulary's, else the whole vocabulary's."""
        return self.config.vocab_size if self.draft_vocab is None else len(self.draft_vocab)

    def limit_draft_vocab(self, size: int) -> None:
        """Keep only the ``size`` most frequent tokens of the draft vocabulary (FR-Spec's knob,
        applied when serving: no retraining, since the draft LM head is rows of the target's).

        Tokens are ranked by :attr:`draft_vocab_counts` when known (ties and unknown counts: lower
        ids first, a BPE vocabulary's merge order being a proxy for frequency); a drafter without a
        draft vocabulary ranks the whole vocabulary by id. On a CPU the draft LM head is read from
        memory once per drafted step, so a smaller one drafts faster; tokens left out can no
        longer be drafted, and the acceptance length falls once the frequent ones are cut.

        Args:
            size: tokens to keep; at least the selector's top-k. A size at or above the current
                draft vocabulary's keeps it unchanged.

        Raises:
            ValueError: when ``size`` is below the selector's top-k (or 1).
        """
        current = self.draft_vocab_size
        if size < max(self.config.selector_top_k, 1):
            raise ValueError(
                f"a draft vocabulary of {size} tokens is smaller than the drafter's top-k "
                f"({self.config.selector_top_k})"
            )
        if size >= current:
            return
        ids = torch.arange(current) if self.draft_vocab is None else self.draft_vocab.cpu()
        counts = self.draft_vocab_counts
        # Stable sort on -count: equal (or unknown) counts keep ascending id order.
        ranked = torch.arange(current) if counts is None else (-counts).argsort(stable=True)
        keep = ranked[:size]
        self.set_draft_vocab(ids[keep], None if counts is None else counts[keep])

    def _refresh_draft_head(self) -> None:
        self._packed_draft_head = None
        if self._target is None or self.draft_vocab is None:
            self._draft_head = None
            return
        lm_head = self._target[1]
        self._draft_head = lm_head.detach()[self.draft_vocab.to(lm_head.device)].contiguous()
        if self._prepacked:
            self._packed_draft_head = PackedLinear(self._draft_head.to(self.dtype))

    @property
    def is_prepacked(self) -> bool:
        """True after :meth:`prepack` (the dense linear weights are gone: no training, no saving)."""
        return self._prepacked

    @property
    def dtype(self) -> torch.dtype:
        """The drafter's compute dtype."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        """The drafter's device."""
        return self.norm.weight.device

    def prepack(self) -> int:
        """Pre-pack the linear layers, and the draft-vocabulary LM head if there is one, for
        CPU bfloat16 inference (:class:`~dflash2.models.layers.PackedLinear`).

        Only when :func:`~dflash2.models.layers.can_prepack` holds; outputs are unchanged, but
        the drafter can no longer be trained. The selector, whose weights the walk reads
        directly, stays as it is. Idempotent.

        Returns:
            The number of layers packed.
        """
        if self._prepacked:
            return 0
        count = prepack_linears(self, skip=("candidate_selector",))
        self._prepacked = True
        self._refresh_draft_head()
        return count + (self._packed_draft_head is not None)

    def token_ids(self, indices: torch.Tensor) -> torch.Tensor:
        """Map indices into the unary logits' last dimension to token ids (identity without a draft vocabulary)."""
        return indices if self.draft_vocab is None else self.draft_vocab[indices]

    def vocab_indices(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Map token ids to indices into the unary logits; ``-1`` for ids outside the draft vocabulary."""
        return token_ids if self.draft_vocab is None else draft_vocab_indices(self.draft_vocab, token_ids)

    def init_weights(self, std: float = 0.02, seed: int | None = None) -> None:
        """Training initialisation: normal(std) linears, unit norms, identity convs (spec §3.4)
        and a zero successor codebook (spec §4.4), so a fresh DFlash 2 equals DFlash."""
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.copy_(torch.randn(param.shape, generator=generator) * std)
            for layer in self.draft_layers():
                for conv in (layer.attention_conv, layer.mlp_conv):
                    if conv is not None:
                        conv.reset_to_identity()
            if self.candidate_selector is not None:
                self.candidate_selector.successor_codebook.zero_()

    def new_cache(
        self, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device, zeroed: bool = True
    ) -> KVCache:
        """A context K/V cache (spec §2.6): one entry per committed token with a known target feature
        (``zeroed``: see :class:`KVCache`)."""
        c = self.config
        return KVCache(
            c.num_hidden_layers, num_slots, c.num_key_value_heads, max_len, c.head_dim, dtype, device, zeroed
        )

    # ---- inference ----------------------------------------------------------------------

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Fuse target features: ``[..., F·H]`` → ``hidden_norm(fc(·))`` ``[..., H]`` (spec §2.1)."""
        return self.hidden_norm(self.fc(features.to(self.dtype)))

    def write_context(
        self,
        features: torch.Tensor,
        write_slots: torch.Tensor,
        write_positions: torch.Tensor,
        caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Write context K/V ("KV injection", spec §2.3) of ``features [R, L, F·H]`` at
        ``(write_slots, write_positions) [R, L]`` into each layer's ``caches[i] = (k, v)``, each
        ``[slots, nkv, max_len, d]``, in place (static shapes: the model runner compiles this).

        Returns:
            The fused context ``[R, L, H]`` the K/V were projected from.
        """
        context = self.context(features)
        cos, sin = self.rotary(write_positions, context.dtype)
        kv_heads = torch.arange(self.config.num_key_value_heads, device=write_slots.device)
        index = (write_slots[:, :, None], kv_heads[None, None, :], write_positions[:, :, None])
        for i, layer in enumerate(self.draft_layers()):
            k, v = layer.self_attn.key_value(context, cos, sin)  # [R, nkv, L, d]
            k_cache, v_cache = caches[i]
            k_cache.index_put_(index, k.transpose(1, 2).to(k_cache.dtype))
            v_cache.index_put_(index, v.transpose(1, 2).to(v_cache.dtype))
        return context

    @torch.inference_mode()
    def append_context(
        self, cache: KVCache, slots: torch.Tensor, positions: torch.Tensor, features: torch.Tensor
    ) -> None:
        """Write context K/V ("KV injection") for newly verified tokens of every layer.

        Args:
            cache: the draft KV cache.
            slots: ``[N]`` int64 slot of each token; positions: ``[N]`` int64 absolute positions.
            features: ``[N, F·H]`` target features of those tokens.
        """
        caches = [(cache.k[i], cache.v[i]) for i in range(self.config.num_hidden_layers)]
        self.write_context(features[None], slots[None], positions[None], caches)

    def block_mask(self, starts: torch.Tensor, block_size: int, context_len: int, layer: int) -> torch.Tensor:
        """``[R, 1, B, T+B]`` bool mask of one layer for blocks starting at ``starts [R]``.

        Context key j is visible when ``j < start`` (and inside the sliding window, if any);
        block keys are all visible (bidirectional) unless the layer is causal (spec §2.4).
        """
        positions = starts[:, None] + torch.arange(block_size, device=starts.device)[None]  # [R, B]
        return block_mask_at(self.config, positions, torch.arange(context_len, device=starts.device), layer)

    def _run_block(
        self,
        anchor_ids: torch.Tensor,
        positions: torch.Tensor,
        key_positions: torch.Tensor,
        context: Sequence[tuple[torch.Tensor, torch.Tensor]],
        embed_weight: torch.Tensor,
    ) -> torch.Tensor:
        """The drafter's layers over blocks ``[anchor, MASK × (W−1)]`` at ``positions [R, W]``
        against each layer's context ``(k, v)``, each ``[R, nkv, T, d]`` at ``key_positions [T]``.

        Returns:
            ``[R, W, H]`` final-normed hidden states.
        """
        c = self.config
        block_ids = torch.full_like(positions, c.mask_token_id)
        block_ids[:, 0] = anchor_ids
        h = (nn.functional.embedding(block_ids, embed_weight) * c.input_embedding_scale).to(self.dtype)
        cos, sin = self.rotary(positions, h.dtype)
        for i, layer in enumerate(self.layers):
            ctx_k, ctx_v = context[i]
            h = layer(h, cos, sin, ctx_k, ctx_v, block_mask_at(c, positions, key_positions, i))
        return self.norm(h)

    @torch.inference_mode()
    def draft_hidden(
        self,
        cache: KVCache,
        slots: list[int],
        anchor_ids: torch.Tensor,
        starts: torch.Tensor,
        block_size: int,
    ) -> torch.Tensor:
        """One parallel forward over the blocks ``[anchor, MASK × (B−1)]`` of all rows (eager).

        Args:
            cache: the draft KV cache holding context K/V for positions ``< starts[r]``.
            slots: cache slot of each row (R).
            anchor_ids: ``[R]`` the last verified token of each row.
            starts: ``[R]`` int64 absolute position of each anchor (= context length).
            block_size: B.

        Returns:
            ``[R, B, H]`` final-normed hidden states (position 0, the anchor, is unused).
        """
        assert self._target is not None, "bind_target() first"
        positions = starts[:, None] + torch.arange(block_size, device=starts.device)[None]
        context_len = int(starts.max())
        context = [cache.read(i, slots, context_len) for i in range(self.config.num_hidden_layers)]
        keys = torch.arange(context_len, device=starts.device)
        return self._run_block(anchor_ids, positions, keys, context, self._target[0])

    def draft_block(
        self,
        anchor_ids: torch.Tensor,
        positions: torch.Tensor,
        key_positions: torch.Tensor,
        context: Sequence[tuple[torch.Tensor, torch.Tensor]],
        embed_weight: torch.Tensor,
        head: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafting forward with static shapes (the model runner compiles it): blocks
        ``[anchor, MASK × (W−1)]`` at ``positions [R, W]`` (the anchor's first, then consecutive),
        against each layer's ``context (k, v)``, each ``[R, nkv, T, d]`` at ``key_positions [T]``.
        ``embed_weight [V, H]`` and ``head`` (``[N, H]`` → ``[N, V or Vd]``) are the target's
        embedding and the (draft-vocabulary) LM head, which the caller holds.

        Returns:
            ``(hidden [R, W−1, H], logits [R, W−1, V or Vd] float32)`` of the drafted slots.
        """
        num_rows, width = positions.shape
        hidden = self._run_block(anchor_ids, positions, key_positions, context, embed_weight)[:, 1:]
        # A 2-D product: with a dynamic row count, a 3-D input became a bmm over a per-row copy of
        # the whole head (51.6 against 5.6 ms eager for a 4-row block on 2 cores).
        flat = hidden.reshape(num_rows * (width - 1), hidden.shape[-1])
        return hidden, transform_logits(self.config, head(flat).float().view(num_rows, width - 1, -1))

    def forward_blocks(self, features: torch.Tensor, block_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Training forward: many blocks of one sequence against its full context (spec §7).

        The same modules as inference, with the context K/V computed for every position and
        each block's queries masked to context strictly before its anchor, bidirectional
        inside the block, and never another block.

        Args:
            features: ``[S, F·H]`` target features of the sequence.
            block_ids: ``[n, B]`` block inputs ``[x_a, MASK, …]``.
            anchors: ``[n]`` int64 anchor positions a (the block sits at a .. a+B−1).

        Returns:
            ``[n, B, H]`` final-normed hidden states.
        """
        assert self._target is not None, "bind_target() first"
        num_blocks, block_size = block_ids.shape
        context = self.context(features)[None]  # [1, S, H]
        context_len = context.shape[1]
        cos_c, sin_c = self.rotary(torch.arange(context_len, device=features.device)[None], context.dtype)
        h = nn.functional.embedding(block_ids, self._target[0]).to(context.dtype) * self.config.input_embedding_scale
        positions = anchors[:, None] + torch.arange(block_size, device=anchors.device)[None]
        cos, sin = self.rotary(positions, h.dtype)
        for i, layer in enumerate(self.draft_layers()):
            ctx_k, ctx_v = layer.self_attn.key_value(context, cos_c, sin_c)  # [1, nkv, S, d]
            expand = (num_blocks, -1, -1, -1)
            mask = self.block_mask(anchors, block_size, context_len, i)
            h = layer(h, cos, sin, ctx_k.expand(*expand), ctx_v.expand(*expand), mask)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Transformed unary logits ``softcap(lm_head(hidden) · output_multiplier)`` (spec §2.5), float32.

        ``[..., H]`` → ``[..., V]``, or ``[..., Vd]`` over the draft vocabulary when one is set
        (map indices with :meth:`token_ids`).
        """
        assert self._target is not None, "bind_target() first"
        head = self._draft_head if self._draft_head is not None else self._target[1]
        # A 2-D matmul: a strided 3-D input (e.g. hidden[:, 1:]) would go through bmm, which
        # copies the whole head every call (≈ 3× slower for bfloat16 on CPU).
        flat_hidden = hidden.reshape(-1, hidden.shape[-1])
        if self._packed_draft_head is not None and hidden.dtype == self.dtype:
            flat = self._packed_draft_head(flat_hidden)
        else:
            flat = nn.functional.linear(flat_hidden, head.to(hidden.dtype))
        return transform_logits(self.config, flat.view(*hidden.shape[:-1], -1).float())  # [..., V or Vd]

    @property
    def feature_dim(self) -> int:
        """F·H: the width of the captured target features the context is written from."""
        return self.fc.in_features

    @property
    def embed_weight(self) -> torch.Tensor:
        """The bound target's embedding ``[V, H]`` (the MASK and anchor tokens' rows)."""
        assert self._target is not None, "bind_target() first"
        return self._target[0]

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head ``[V or Vd, H]`` the unary logits come from: the draft vocabulary's rows of the
        target's head when one is set."""
        assert self._target is not None, "bind_target() first"
        return self._draft_head if self._draft_head is not None else self._target[1]

    @property
    def num_candidates(self) -> int:
        """Candidates per slot the walk chooses from: the selector's top-k, else ``DEFAULT_TOP_K``."""
        return (self.config.selector_top_k if self.config.has_selector else 0) or DEFAULT_TOP_K

    def selector_weights(self) -> SelectorWeights | None:
        """Selector tensors, or None for a drafter without a selector."""
        return self.candidate_selector.weights() if self.candidate_selector is not None else None
