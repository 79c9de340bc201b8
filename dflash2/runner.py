"""The model runner: the target, the drafter, their KV caches, and the forwards of one step.

``ModelRunner`` runs prefill, draft, verify and the drafter's context append on tensors, so
``Engine.step`` only schedules, accepts and commits. Decode-time forwards (verify, the
autoregressive step, the drafter's block) run through compiled static-shape modules
(:class:`StaticTarget`, :class:`StaticDrafter`; on CPU also the drafter's context append,
:class:`StaticContext`, and the choice of the drafted path, :class:`StaticSelector`) unless
``EngineConfig.enforce_eager``:

* **CPU**: ``torch.compile`` with inductor, the weights as graph inputs (not frozen: see
  ``_configure_compiler``). Positions, slots and the key range are tensors, so
  one graph serves every batch size ≥ 2, another batch size 1, and every KV length (dynamic
  shapes); the attention reads only ``[0, T)`` of each slot, T rounded up to
  :data:`KEY_ALIGN`. Inductor's caches live in ``<dflash2 cache>/inductor``, so a restart
  reuses the compiled graphs.
* **CUDA**: the same modules compiled with ``mode="reduce-overhead"`` (CUDA graphs), with
  rows and key lengths padded to buckets so the number of recorded graphs stays bounded.
* Anything else (the transformers fallback target, a drafter that overrides its forward, a
  failed compilation) runs eagerly, with pre-packed CPU bfloat16 linears where possible.

Prefill stays eager: prompts have any length, and a prompt's forward is compute-bound.

Static shapes: every row of a verify forward is padded to the same query length; padding
tokens write their K/V into a spare *scratch slot* (one more than ``max_num_seqs``), so they
never touch a live slot, and a real query at position p sees exactly the keys ``≤ p`` of
its own slot — committed tokens and the tokens of this forward. Rollback stays an integer
per slot (``KVCache.lengths``).

Dimension letters: R rows, L query tokens per row, T key positions, H hidden, V vocab,
F·H captured features, W the step's verify width (≤ the block size B), J = W − 1 drafted slots.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from dflash2.kv_cache import KVCache
from dflash2.models.batch import ForwardBatch
from dflash2.models.drafter import DFlashDrafter, DraftLayer
from dflash2.models.layers import (
    BACKEND_NAMES,
    MLP,
    PROJECT_KERNELS,
    FusedMLP,
    apply_rope,
    attention,
    can_prepack,
    fused_linear,
    linear_backend,
    onednn_bf16,
    prepack_linears,
    softcap,
)
from dflash2.models.llama import SUPPORTED_MODEL_TYPES, TargetModel
from dflash2.precompiled import PrecompiledForward
from dflash2.selector import Proposal, SelectorWeights, draft_path

logger = logging.getLogger(__name__)

# Key lengths are rounded up to a multiple of this (CPU), so attention reads little past the
# longest row while dynamic shapes keep one graph for all lengths.
KEY_ALIGN = 64
# CUDA graphs replay fixed shapes: rows are padded to one of these batch sizes (≤ max_num_seqs)
# and key lengths to a power of two of at least CUDA_MIN_KEYS.
CUDA_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CUDA_MIN_KEYS = 256


@dataclasses.dataclass(frozen=True)
class Drafted:
    """A drafted step's proposal and what it cost.

    Attributes:
        proposal: over W − 1 slots, candidates as token ids.
        draft_seconds: the drafter forward (+ the context write; + the selector where it runs in the
            same graph).
        select_seconds: the selector's own time; None when it ran inside the drafting graph.
    """

    proposal: Proposal
    draft_seconds: float
    select_seconds: float | None


@dataclasses.dataclass
class PendingWrites:
    """Drafter context to write for a batch of rows: the first ``lengths[r]`` of ``features [R, L, F·H]``
    at positions ``starts[r] ..`` (a row of length 0 writes nothing, whatever its start)."""

    features: torch.Tensor
    lengths: list[int]
    starts: list[int]


def _bucket_rows(num_rows: int, max_rows: int) -> int:
    return next((b for b in CUDA_ROW_BUCKETS if b >= num_rows), max_rows)


def key_length(max_end: int, capacity: int, cuda: bool) -> int:
    """Keys a forward attends over: ``max_end`` (the longest row's end) rounded up to
    :data:`KEY_ALIGN` on CPU or to a power of two ≥ :data:`CUDA_MIN_KEYS` on CUDA, never past
    ``capacity`` (the cache's positions)."""
    if cuda:
        length = CUDA_MIN_KEYS
        while length < max_end:
            length *= 2
    else:
        length = -(-max_end // KEY_ALIGN) * KEY_ALIGN
    return min(length, capacity)


class StaticTarget(nn.Module):
    """A static-shape forward of a :class:`TargetModel` over per-slot caches, for compilation.

    Shares the target's modules and weights; Q/K/V and gate/up projections are fused into one
    matrix each (the checkpoint keeps its published names). The cache tensors are registered
    as buffers (one per layer, views of the shared ``KVCache``), so a compiled forward writes
    into the same memory that eager prefill uses.
    """

    def __init__(self, target: TargetModel, cache: KVCache, capture_layer_ids: Sequence[int]) -> None:
        super().__init__()
        layers = target.decoder_layers()
        first = layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self.intermediate_size = layers[0].mlp.gate_proj.out_features
        self.embed_tokens, self.norm, self.lm_head, self.rotary = (
            target.embed_tokens,
            target.norm,
            target.lm_head,
            target.rotary,
        )
        self.capture_layer_ids = tuple(capture_layer_ids)
        self.windows = [layer.sliding_window for layer in layers]
        self.layers = nn.ModuleList(_StaticLayer(layer) for layer in layers)
        self.kv_heads: torch.Tensor
        self.register_buffer("kv_heads", torch.arange(self.num_kv_heads, device=cache.k.device), persistent=False)
        for i in range(len(layers)):
            self.register_buffer(f"k_cache_{i}", cache.k[i], persistent=False)
            self.register_buffer(f"v_cache_{i}", cache.v[i], persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        write_positions: torch.Tensor,
        read_slots: torch.Tensor,
        key_positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``input_ids [R, L]`` at ``positions [R, L]``; write their K/V at
        ``(write_slots, write_positions) [R, L]``; attend over ``key_positions [T]`` of
        ``read_slots [R]``.

        Returns:
            ``(logits [R, L, V] float32, features [R, L, F·H]`` — ``[R, L, 0]`` without capture).
        """
        num_rows, num_queries = input_ids.shape
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, h.dtype)
        visible = key_positions[None, None, :] <= positions[:, :, None]  # [R, L, T]
        masks: dict[int | None, torch.Tensor] = {}
        index = (write_slots[:, :, None], self.kv_heads[None, None, :], write_positions[:, :, None])
        captured = []
        for i, layer in enumerate(cast(list[_StaticLayer], list(self.layers))):
            window = self.windows[i]
            if window not in masks:
                mask = visible
                if window is not None:
                    mask = mask & (positions[:, :, None] - key_positions[None, None, :] < window)
                masks[window] = mask[:, None]
            x = layer.input_layernorm(h)
            q, k, v = layer.qkv(x).split(layer.qkv_sizes, dim=-1)
            q = q.view(num_rows, num_queries, self.num_heads, self.head_dim)
            k = k.view(num_rows, num_queries, self.num_kv_heads, self.head_dim)
            v = v.view(num_rows, num_queries, self.num_kv_heads, self.head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            q = apply_rope(q.transpose(1, 2), cos, sin)
            k = apply_rope(k.transpose(1, 2), cos, sin).transpose(1, 2)  # [R, L, nkv, d]
            k_cache, v_cache = getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")
            k_cache.index_put_(index, k.to(k_cache.dtype))
            v_cache.index_put_(index, v.to(v_cache.dtype))
            length = key_positions.shape[0]
            keys = k_cache[read_slots, :, :length].to(q.dtype)
            values = v_cache[read_slots, :, :length].to(q.dtype)
            h = h + layer.o_proj(attention(q, keys, values, masks[window]))
            gate, up = layer.gate_up(layer.post_attention_layernorm(h)).split(self.intermediate_size, dim=-1)
            h = h + layer.down_proj(F.silu(gate) * up)
            if i in self.capture_layer_ids:
                captured.append((i, h))
        by_id = dict(captured)
        features = (
            torch.cat([by_id[i] for i in self.capture_layer_ids], dim=-1) if self.capture_layer_ids else h[..., :0]
        )
        return self.lm_head(self.norm(h)).float(), features


class _StaticLayer(nn.Module):
    """One decoder layer's weights with fused Q/K/V and gate/up projections (shared norms)."""

    def __init__(self, layer: Any) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.input_layernorm: nn.Module = layer.input_layernorm
        self.post_attention_layernorm: nn.Module = layer.post_attention_layernorm
        self.q_norm: nn.Module | None = attn.q_norm
        self.k_norm: nn.Module | None = attn.k_norm
        self.qkv = fused_linear([attn.q_proj, attn.k_proj, attn.v_proj])
        self.qkv_sizes = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
        self.o_proj: nn.Module = attn.o_proj
        self.gate_up = fused_linear([mlp.gate_proj, mlp.up_proj])
        self.down_proj: nn.Module = mlp.down_proj


class StaticDrafter(nn.Module):
    """A static-shape drafting forward of a :class:`DFlashDrafter` (block + LM head), for compilation.

    Shares the drafter's layers, or copies them when ``own_layers`` (the eager drafter's are then
    pre-packed in place on CPU bfloat16), fusing each copy's Q/K/V (and K/V for the context) and
    gate/up projections as the target's are fused; the token embedding and the (draft-vocabulary) LM head
    are registered as parameters (graph inputs, like every weight); the context cache tensors are
    buffers, one per layer. The block's width W (the anchor and W − 1 mask tokens) is a dimension of
    its inputs, so on CPU one graph drafts every width from 2 to the block size.
    """

    def __init__(self, drafter: DFlashDrafter, cache: KVCache, own_layers: bool = False) -> None:
        super().__init__()
        assert drafter._target is not None, "bind_target() first"
        self.config = drafter.config
        self.layers = drafter.layers
        if own_layers:  # a copy, with Q/K/V and gate/up fused (fewer, larger matrix products)
            self.layers = copy.deepcopy(drafter.layers)
            for layer in cast(list[DraftLayer], list(self.layers)):
                layer.self_attn.fuse_projections()
                layer.mlp = FusedMLP(cast(MLP, layer.mlp))
        self.norm, self.rotary = drafter.norm, drafter.rotary
        self.embed = nn.Parameter(drafter._target[0].detach(), requires_grad=False)
        head = drafter._draft_head if drafter._draft_head is not None else drafter._target[1]
        # An nn.Linear, so that the runner packs it like every other layer (bfloat16 CPU kernel).
        self.head = nn.Linear(head.shape[1], head.shape[0], bias=False, device="meta")
        self.head.weight = nn.Parameter(head.detach().to(drafter.dtype), requires_grad=False)
        self.dtype = drafter.dtype
        for i in range(self.config.num_hidden_layers):
            self.register_buffer(f"k_cache_{i}", cache.k[i], persistent=False)
            self.register_buffer(f"v_cache_{i}", cache.v[i], persistent=False)

    def forward(
        self, anchor_ids: torch.Tensor, positions: torch.Tensor, read_slots: torch.Tensor, key_positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft blocks ``[anchor, MASK × (W−1)]`` at ``positions [R, W]`` (the anchor's position
        first, then consecutive) against context keys ``key_positions [T]`` of ``read_slots [R]``.

        Returns:
            ``(hidden [R, W−1, H], logits [R, W−1, V or Vd] float32)`` of the drafted slots.
        """
        c = self.config
        num_rows, width = positions.shape
        block_ids = torch.full_like(positions, c.mask_token_id)
        block_ids[:, 0] = anchor_ids
        h = (F.embedding(block_ids, self.embed) * c.input_embedding_scale).to(self.dtype)
        cos, sin = self.rotary(positions, h.dtype)
        context = key_positions[None, None, :] < positions[:, :1, None]  # [R, 1, T]
        block = torch.ones(width, width, dtype=torch.bool, device=h.device)
        length = key_positions.shape[0]
        for i, layer in enumerate(self.layers):
            ctx = context
            window = c.layer_window(i)
            if window is not None:
                ctx = ctx & (positions[:, :, None] - key_positions[None, None, :] < window)
            blk = block.tril() if c.layer_is_causal(i) else block
            mask = torch.cat([ctx.expand(-1, width, -1), blk[None].expand(num_rows, -1, -1)], dim=-1)
            ctx_k = getattr(self, f"k_cache_{i}")[read_slots, :, :length]
            ctx_v = getattr(self, f"v_cache_{i}")[read_slots, :, :length]
            h = layer(h, cos, sin, ctx_k, ctx_v, mask[:, None])
        hidden = self.norm(h)[:, 1:]
        # A 2-D product: with a dynamic row count, a 3-D input became a bmm over a per-row copy of
        # the whole head (51.6 against 5.6 ms eager for a 4-row block on 2 cores).
        flat = hidden.reshape(num_rows * (width - 1), hidden.shape[-1])
        logits = self.head(flat).float().view(num_rows, width - 1, -1)
        if c.output_multiplier != 1.0:
            logits = logits * c.output_multiplier
        return hidden, softcap(logits, c.final_logit_softcapping)


class StaticContext(nn.Module):
    """The drafter's context append ("KV injection", spec §2.2) as a static-shape forward, for
    compilation: target features → ``hidden_norm(fc(·))`` → each layer's K/V at the tokens'
    positions, written into the draft cache (buffers, one per layer, views of the shared cache).

    Shares the drafter's fusion layers and the :class:`StaticDrafter`'s decoder layers (the ones
    its graph reads, pre-packed on CPU bfloat16) and its cache buffers — the same tensor objects, so
    that a graph holding both modules sees each layer's cache once: two views of one cache would be
    overlapping inputs, and the compiler would copy every layer's cache to write into it.
    """

    def __init__(self, drafter: DFlashDrafter, static: StaticDrafter) -> None:
        super().__init__()
        self.fc, self.hidden_norm, self.rotary = drafter.fc, drafter.hidden_norm, drafter.rotary
        self.layers = static.layers
        self.dtype = drafter.dtype
        self.kv_heads: torch.Tensor
        k_cache = static.get_buffer("k_cache_0")
        self.register_buffer("kv_heads", torch.arange(k_cache.shape[1], device=k_cache.device), persistent=False)
        for i in range(len(self.layers)):
            for name in (f"k_cache_{i}", f"v_cache_{i}"):
                self.register_buffer(name, static.get_buffer(name), persistent=False)

    def forward(self, features: torch.Tensor, write_slots: torch.Tensor, write_positions: torch.Tensor) -> torch.Tensor:
        """Write the context K/V of ``features [R, L, F·H]`` at ``(write_slots, write_positions)
        [R, L]`` (padding goes to the scratch slot).

        Returns:
            the fused context ``[R, L, H]`` (what the K/V were projected from).
        """
        context = self.hidden_norm(self.fc(features.to(self.dtype)))
        cos, sin = self.rotary(write_positions, context.dtype)
        index = (write_slots[:, :, None], self.kv_heads[None, None, :], write_positions[:, :, None])
        for i, layer in enumerate(cast(list[DraftLayer], list(self.layers))):
            k, v = layer.self_attn.key_value(context, cos, sin)  # [R, nkv, L, d]
            k_cache, v_cache = getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")
            k_cache.index_put_(index, k.transpose(1, 2).to(k_cache.dtype))
            v_cache.index_put_(index, v.transpose(1, 2).to(v_cache.dtype))
        return context


class StaticProposer(nn.Module):
    """A drafted step's whole proposal as one forward, for compilation (CPU): the context append,
    the drafting forward and the choice of the drafted path. The features the rows committed since
    they last drafted become context K/V (:class:`StaticContext`), each row drafts its block
    (:class:`StaticDrafter`) reading that context, and the selector (:class:`StaticSelector`) walks
    its path through the block's top-k candidates. All three are small, so one graph instead of three
    calls saves each call's fixed cost (about 0.5 ms on 2 cores for the first two).

    The walk is unrolled over the B − 1 slots of a full block whatever the width: top-k runs on the
    W − 1 drafted slots only, and the slots after them get zero scores, which the walk reaches only
    after every real slot (callers cut the outputs back to W − 1).
    """

    def __init__(
        self, context: StaticContext, drafter: StaticDrafter, selector: StaticSelector, block_size: int
    ) -> None:
        super().__init__()
        self.context, self.drafter, self.selector = context, drafter, selector
        self.num_slots = block_size - 1

    def forward(
        self,
        features: torch.Tensor,
        write_slots: torch.Tensor,
        write_positions: torch.Tensor,
        anchor_ids: torch.Tensor,
        positions: torch.Tensor,
        read_slots: torch.Tensor,
        key_positions: torch.Tensor,
        temperatures: torch.Tensor,
        uniforms: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`StaticContext.forward` on ``features [R, L, F·H]``, ``write_slots`` and
        ``write_positions [R, L]``; :meth:`StaticDrafter.forward` on ``anchor_ids`` … ``key_positions``;
        then the path for ``temperatures [R]`` and ``uniforms [R, B − 1]``.

        Returns:
            ``(hidden [R, J, H], logits [R, J, V or Vd], draft_ids [R, B − 1], candidate_ids
            [R, B − 1, k], draft_probs [R, B − 1, k])``, J = W − 1; slots from J on are padding.
        """
        self.context(features, write_slots, write_positions)
        hidden, logits = self.drafter(anchor_ids, positions, read_slots, key_positions)
        draft_ids, candidate_ids, draft_probs = self.selector(
            hidden, logits, anchor_ids, temperatures, uniforms, num_slots=self.num_slots
        )
        return hidden, logits, draft_ids, candidate_ids, draft_probs


class StaticSelector(nn.Module):
    """The drafted path's choice — top-k candidates, the DFlash 2 lattice and the walk (spec §4,
    ``dflash2/selector.py``) — as one module, for compilation. Eagerly it is some 80 small
    operations per step, about 1.4 ms on 2 CPU cores for SmolLM2's drafter.

    Args:
        drafter: supplies the candidate count, the draft vocabulary and the selector tensors
            (registered here as buffers; the drafter keeps its own).
        use_selector: walk the lattice (False: per-slot unary scores, as ``EngineConfig.use_selector``).
    """

    def __init__(self, drafter: DFlashDrafter, use_selector: bool) -> None:
        super().__init__()
        self.num_candidates = drafter.num_candidates
        # Only tensors are registered (a None buffer breaks a graph's guards when rows are dynamic).
        self.draft_vocab: torch.Tensor
        self.has_draft_vocab = drafter.draft_vocab is not None
        if drafter.draft_vocab is not None:
            self.register_buffer("draft_vocab", drafter.draft_vocab.detach(), persistent=False)
        weights = drafter.selector_weights() if use_selector else None
        self.use_lattice = weights is not None
        self.predecessor_codebook: torch.Tensor
        self.successor_codebook: torch.Tensor
        self.hidden_projection: torch.Tensor
        if weights is not None:
            for name in ("predecessor_codebook", "successor_codebook", "hidden_projection"):
                self.register_buffer(name, getattr(weights, name).detach(), persistent=False)

    def forward(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        anchor_ids: torch.Tensor,
        temperatures: torch.Tensor,
        uniforms: torch.Tensor,
        num_slots: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`DFlashDrafter.propose` on ``hidden [R, J, H]``, ``logits [R, J, V or Vd]``,
        ``anchor_ids [R]``, ``temperatures [R]`` and ``uniforms [R, S]``, walking S = ``num_slots``
        slots (default J; :func:`~dflash2.selector.draft_path`).

        Returns:
            ``(draft_ids [R, S], candidate_ids [R, S, k], draft_probs [R, S, k])`` (a :class:`Proposal`).
        """
        weights = None
        if self.use_lattice:
            weights = SelectorWeights(self.predecessor_codebook, self.successor_codebook, self.hidden_projection)
        vocab = self.draft_vocab if self.has_draft_vocab else None
        proposal = draft_path(
            hidden, logits, anchor_ids, temperatures, uniforms, self.num_candidates, vocab, weights, num_slots
        )
        return proposal.draft_ids, proposal.candidate_ids, proposal.draft_probs


def inductor_cache_dir() -> str:
    """Where compiled graphs are cached: ``<dflash2 cache>/inductor`` (unless
    ``$TORCHINDUCTOR_CACHE_DIR`` is set)."""
    from dflash2.models.source import cache_dir

    return str(cache_dir() / "inductor")


# Inductor's size / stride / alignment / scalar checks in the CPU graphs' wrapper code (see below).
RUNTIME_ASSERTS = False


def _configure_compiler(device: torch.device, dynamic_threads: bool) -> None:
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config
    import torch.fx.experimental._config as fx_config
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # Ours unless the user chose one (torch writes its default into the environment when asked).
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir()
    # A few graphs per module (batch 1, batch ≥ 2, CUDA buckets): never fall back silently.
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 256)
    # Sizes that happen to be equal at trace time (rows = query length) must stay independent.
    fx_config.use_duck_shape = False
    # Python floats (norm eps, RoPE scaling) are constants of the model, not graph inputs.
    dynamo_config.specialize_float = True
    if device.type == "cpu":
        # Weights stay graph inputs (no freezing): inductor's caches then store the whole compilation,
        # and a warm start skips tracing through AOT autograd as well as lowering. Frozen weights that
        # oneDNN pre-packed could not be cached at all (mkldnn tensors do not pickle); frozen dense
        # weights could, but AOT autograd's cache refuses frozen graphs. Measured interleaved in one
        # process at 1–8 rows, widths 1 and 8, and the drafter: unfrozen 0.92–1.08× the frozen time.
        inductor_config.freezing = False
        # Kernels read the thread count when they run, so the engine can change it (dflash2/threads.py);
        # otherwise each kernel keeps the count it was compiled with. Measured: no cost at 2 threads.
        inductor_config.cpp.dynamic_threads = dynamic_threads
        # The Python wrapper checks the size, stride and alignment of every tensor an external kernel
        # returns (the bfloat16 linear, attention): some 250 calls per target forward, 0.6 ms of a
        # 15 ms decode step on 2 cores. They guard against bugs in the lowering, which the tests'
        # compiled-against-eager comparisons catch, not against anything a request can do.
        inductor_config.size_asserts = RUNTIME_ASSERTS
        inductor_config.alignment_asserts = RUNTIME_ASSERTS
        inductor_config.scalar_asserts = RUNTIME_ASSERTS


def _target_shape_class(inputs: Sequence[torch.Tensor]) -> tuple[str, str]:
    """The CPU graph a :class:`StaticTarget` or :class:`StaticContext` call needs: batch 1 or more, one
    token or more (``inputs[0]`` is ``[R, L, …]``)."""
    num_rows, width = inputs[0].shape[:2]
    return ("rows=1" if num_rows == 1 else "rows=2+", "width=1" if width == 1 else "width=2+")


def _rows_class(inputs: Sequence[torch.Tensor]) -> str:
    """The CPU graph a :class:`StaticDrafter` or :class:`StaticProposer` call needs: batch 1 or more."""
    return "rows=1" if inputs[0].shape[0] == 1 else "rows=2+"


_FORWARD_NAMES = {"target": "target", "drafter": "draft", "context": "context"}
_SHAPE_CLASSES: dict[str, Callable[[Sequence[torch.Tensor]], Any]] = {
    "target": _target_shape_class,
    "drafter": _rows_class,
    "context": _target_shape_class,
}


def _without_global_state_guard(guards: Sequence[Any]) -> list[bool]:
    """Keep every dynamo guard but the global-state one (grad mode, autocast, default dtype, thread
    count …). That guard would recompile a graph (20 s on CPU) whenever the engine changes torch's
    thread count (``dflash2/threads.py``), while the kernels read the count when they run
    (``cpp.dynamic_threads``). The rest of that state is fixed for these graphs: the runner is their only
    caller, always in inference mode, without autocast, at the dtype the weights were loaded in."""
    return [entry.guard_type != "GLOBAL_STATE" for entry in guards]


class ModelRunner:
    """Owns the target, the drafter and their caches; runs one step's forwards.

    The constructor compiles and warms up every graph (a log line each) unless ``enforce_eager``;
    a failed compilation logs a warning and leaves that forward eager. (Compiling on a thread while
    eager forwards serve was tried: the compiler's Python work and C++ builds starved the engine
    thread, 32 tokens took 33 s instead of 0.4 s, so an engine is ready when it is fast.)

    Args:
        target: the loaded target.
        drafter: the drafter bound to it, or None (autoregressive decoding).
        num_slots: KV slots (``max_num_seqs``); one scratch slot is added for padding.
        max_model_len: positions per slot.
        block_size: tokens per verify forward (1 = autoregressive).
        enforce_eager: never compile.
        dynamic_threads: the engine changes torch's CPU thread count while it runs
            (``dflash2/threads.py``): compiled kernels then read the count when they run.
        use_selector: the drafted path walks the DFlash 2 lattice (``EngineConfig.use_selector``).
        deterministic: the engine runs its steps batch-invariant
            (:func:`dflash2.models.layers.batch_invariant`); forwards then run eagerly, because the
            compiled graphs fuse and reorder the very reductions that mode fixes.

    Raises:
        ValueError: ``deterministic`` where it cannot hold (see :func:`check_deterministic`).
    """

    def __init__(
        self,
        target: Any,
        drafter: DFlashDrafter | None,
        num_slots: int,
        max_model_len: int,
        block_size: int,
        enforce_eager: bool = False,
        deterministic: bool = False,
        dynamic_threads: bool = False,
        use_selector: bool = True,
    ) -> None:
        self.target, self.drafter = target, drafter
        self.use_selector = use_selector
        self.dynamic_threads = dynamic_threads
        embed_weight = target.embedding_weights()[0]
        self.device: torch.device = embed_weight.device
        self.dtype = embed_weight.dtype
        if deterministic:
            check_deterministic(target, self.device, self.dtype)
            if not enforce_eager:
                logger.info("deterministic mode: every forward runs eagerly (batch-invariant kernels)")
            enforce_eager = True
        self.num_slots, self.max_model_len, self.block_size = num_slots, max_model_len, block_size
        self.scratch_slot = num_slots
        speculative = drafter is not None and block_size > 1
        self.capture_layer_ids = tuple(drafter.config.target_layer_ids) if speculative and drafter else ()
        # One position more than a request can use: a key range [0, T) is then never the whole
        # cache, so the compiled graphs do not specialise on that case.
        self.target_cache = target.new_cache(num_slots + 1, max_model_len + 1)
        self.draft_cache = (
            drafter.new_cache(num_slots + 1, max_model_len + 1, drafter.dtype, self.device)
            if speculative and drafter is not None
            else None
        )
        self._cuda = self.device.type == "cuda"
        self.sync_timing = False
        self._target_forward: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        self._draft_forward: Callable[..., tuple[torch.Tensor, ...]] | None = None
        self._context_forward: Callable[..., torch.Tensor] | None = None
        self.compile_times: dict[str, float] = {}  # seconds to build each graph at start-up
        self.graph_sources: dict[str, str] = {}  # and whether it was "compiled" or "loaded" (saved before)
        self.compile_seconds: float | None = None  # wall time of the whole compilation
        modules = []
        if not enforce_eager and self.device.type in ("cpu", "cuda"):
            try:
                modules = self._static_modules()
            except Exception as error:
                logger.warning("no static forwards, running eagerly: %s", _short(error))
        self._prepack_eager()  # prefill, and any forward that does not compile, runs these
        if modules:
            self._compile(modules)

    @property
    def verify_widths(self) -> tuple[int, ...]:
        """Verify widths (tokens per row) a forward runs at without padding: every width from 1 to the
        block eagerly and compiled on CPU (one dynamic graph for widths ≥ 2); 1 and the block with
        CUDA graphs (other widths are padded to the block)."""
        if self._target_forward is not None and self._cuda:
            return tuple(dict.fromkeys((1, self.block_size)))
        return tuple(range(1, self.block_size + 1))

    @property
    def compiled(self) -> bool:
        """True when the verify / decode forward runs compiled."""
        return self._target_forward is not None

    @property
    def drafter_compiled(self) -> bool:
        """True when the drafter's block forward runs compiled (not through ``DFlashDrafter.draft_hidden``)."""
        return self._draft_forward is not None

    # ---- set-up -----------------------------------------------------------------------------

    def _static_modules(self) -> list[tuple[str, nn.Module]]:
        """The static modules to compile (built now, before the eager modules are pre-packed)."""
        modules: list[tuple[str, nn.Module]] = []
        if isinstance(self.target, TargetModel):
            modules.append(("target", StaticTarget(self.target, self.target_cache, self.capture_layer_ids).eval()))
        else:
            logger.info("the %s target runs eagerly (no static forward)", type(self.target).__name__)
        if self.draft_cache is not None and self.drafter is not None and self.drafter.supports_compile:
            own_layers = can_prepack(self.device, self.dtype)  # the eager drafter is packed in place
            drafter = StaticDrafter(self.drafter, self.draft_cache, own_layers)
            if self._cuda:
                modules.append(("drafter", drafter.eval()))
            else:
                # Small and shaped by the step (context widths up to a prompt, any row count): CUDA
                # graphs would record one per shape, so on CUDA the context append and the selector stay
                # eager. On CPU one graph writes the context the rows committed since they last drafted,
                # drafts and chooses the path (one call per step instead of three).
                context = StaticContext(self.drafter, drafter)
                if own_layers:  # the eager drafter's fusion layer is packed in place too
                    context.fc = copy.deepcopy(context.fc)
                selector = StaticSelector(self.drafter, self.use_selector)
                modules.append(("drafter", StaticProposer(context, drafter, selector, self.block_size).eval()))
                modules.append(("context", context.eval()))
        if linear_backend(self.device, self.dtype) in PROJECT_KERNELS:
            # The project's bfloat16 kernels are custom ops that graphs call with the packed weight as
            # an input (oneDNN's packed weights cannot be graph inputs, so there the graphs keep dense ones).
            packed = sum(prepack_linears(module) for _, module in modules)
            logger.info("packed %d linear layers of the compiled forwards for the bfloat16 CPU kernel", packed)
        return modules

    def _compile(self, modules: list[tuple[str, nn.Module]]) -> None:
        """Compile and warm up each static module; on failure keep that forward eager with a warning."""
        start = time.perf_counter()
        logger.info(
            "compiling the %s forward%s for %s (minutes on a small CPU; --enforce-eager skips this)",
            " and ".join(name for name, _ in modules),
            "s" * (len(modules) > 1),
            "CUDA graphs" if self._cuda else "inductor",
        )
        _configure_compiler(self.device, self.dynamic_threads)
        for name, module in modules:
            forward: Callable[..., Any]
            try:
                if self._cuda:  # graphs recorded and replayed, static shapes
                    forward = torch.compile(module, dynamic=False, fullgraph=True, mode="reduce-overhead")
                else:
                    # Inductor graphs saved for the next start, dispatched without dynamo (see
                    # dflash2/precompiled.py); only the dims marked in the calls are dynamic (rows, keys).
                    forward = PrecompiledForward(
                        module,
                        name,
                        _SHAPE_CLASSES[name],
                        _without_global_state_guard,
                        settings=f"slots={self.num_slots} block={self.block_size}",
                    )
                self._warm_up(name, forward)
            except Exception as error:
                logger.warning("compiling the %s failed, running it eagerly: %s", name, _short(error))
                continue
            setattr(self, f"_{_FORWARD_NAMES[name]}_forward", forward)
        self.compile_seconds = time.perf_counter() - start
        if self.compile_times:
            loaded = sum(source == "loaded" for source in self.graph_sources.values())
            logger.info(
                "%d graphs ready in %.1f s (%d compiled, %d loaded; cache: %s)",
                len(self.compile_times),
                self.compile_seconds,
                len(self.compile_times) - loaded,
                loaded,
                os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
            )

    def _row_buckets(self) -> list[int]:
        """Row counts to build graphs for: 1 and ≥ 2 on CPU; every bucket up to the slots on CUDA."""
        if self._cuda:
            return [*(b for b in CUDA_ROW_BUCKETS if b < self.num_slots), _bucket_rows(self.num_slots, self.num_slots)]
        return [1, 2] if self.num_slots >= 2 else [1]

    def _warm_up(self, name: str, forward: Callable[..., Any]) -> None:
        """Build every graph now (rows on the scratch slot only), not in the middle of a request:
        per row bucket, the drafter's block and the selector, and the target and the context append
        at width 1 and at the block width (on CPU one graph covers every width from 2 up)."""
        widths = dict.fromkeys((1, self.block_size)) if name in ("target", "context") else {self.block_size: None}
        for num_rows in dict.fromkeys(self._row_buckets()):
            for width in widths:
                start = time.perf_counter()
                slots = [self.scratch_slot] * num_rows
                for _ in range(2 if self._cuda else 1):  # CUDA graphs are recorded on a later call
                    if name == "target":
                        self._target_call(slots, [[0] * width] * num_rows, [0] * num_rows, forward)
                    elif name == "context":
                        assert self.drafter is not None
                        features = torch.zeros(
                            num_rows, width, self.drafter.fc.in_features, dtype=self.dtype, device=self.device
                        )
                        self._context_call(slots, PendingWrites(features, [width] * num_rows, [0] * num_rows), forward)
                    else:  # the drafter's block (on CPU with the context write and the walk)
                        anchors = torch.zeros(num_rows, dtype=torch.long, device=self.device)
                        ones = torch.ones_like(anchors)
                        self._draft_call(slots, anchors, ones, self.block_size, None, None, None, forward)
                elapsed = time.perf_counter() - start
                rows_label = f"{num_rows}{'+' if num_rows > 1 and not self._cuda else ''}"
                width_label = f" width={'2+' if width > 1 and not self._cuda else width}" if len(widths) > 1 else ""
                graph = f"{name} rows={rows_label}{width_label}"
                source = getattr(forward, "last_source", None) or "compiled"
                self.compile_times[graph], self.graph_sources[graph] = elapsed, source
                logger.info("%s %s graph for %s row(s)%s in %.1f s", source, name, rows_label, width_label, elapsed)

    def _prepack_eager(self) -> None:
        """Pre-pack the eager modules' linear weights (CPU bfloat16 only). The static modules were
        built from the dense weights before; with oneDNN they keep them, with the bfloat16 CPU kernel
        :meth:`_static_modules` packed their own."""
        backend = linear_backend(self.device, self.dtype)
        if backend is None:
            return
        packed = self.target.prepack()
        if self.drafter is not None and self.draft_cache is not None:
            packed += self.drafter.prepack()
        if packed:
            kernel = BACKEND_NAMES[backend]
            logger.info("pre-packed %d linear layers for %s", packed, kernel)

    # ---- forwards -------------------------------------------------------------------------------

    def prefill(
        self, slots: list[int], token_rows: list[list[int]], starts: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Eager forward over prompts: logits ``[R, 1, V]`` at each row's last token and the
        captured features ``[R, L, F·H]`` (None without a drafter)."""
        batch = ForwardBatch.build(slots, token_rows, starts, self.device)
        return self.target.run(batch, self.target_cache, self.capture_layer_ids, last_only=True)

    def verify(
        self, slots: list[int], token_rows: list[list[int]], starts: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ONE target forward over each row's ``[anchor, drafts…]`` (rows may differ in length).

        Returns:
            logits ``[R, L, V]`` float32 (L = the longest row; padding positions hold garbage)
            and features ``[R, L, F·H]`` or None.
        """
        if self._target_forward is None:
            batch = ForwardBatch.build(slots, token_rows, starts, self.device)
            return self.target.run(batch, self.target_cache, self.capture_layer_ids)
        width = max(len(row) for row in token_rows)
        logits, features = self._target_call(slots, token_rows, starts)
        return logits[:, :width], (features[:, :width] if self.capture_layer_ids else None)

    def _target_call(
        self,
        slots: list[int],
        token_rows: list[list[int]],
        starts: list[int],
        forward: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The compiled forward with rows padded to the narrowest verify width that holds the longest
        row (and to a row bucket on CUDA)."""
        forward = self._target_forward if forward is None else forward
        assert forward is not None
        with _compiled_mode():  # inputs are built here too: a graph is guarded on its inputs' flags
            longest = max(len(row) for row in token_rows)
            num_rows, width = len(slots), min(w for w in self.verify_widths if w >= longest)
            extra = (_bucket_rows(num_rows, self.num_slots) if self._cuda else num_rows) - num_rows
            input_ids = torch.tensor([row + [0] * (width - len(row)) for row in token_rows] + [[0] * width] * extra)
            lengths = torch.tensor([len(row) for row in token_rows] + [0] * extra)
            read_slots = torch.tensor(slots + [self.scratch_slot] * extra)
            positions = torch.tensor(starts + [0] * extra)[:, None] + torch.arange(width)[None]
            write_slots, write_positions = self._padded_writes(read_slots, positions, lengths)
            max_end = max(s + len(row) for s, row in zip(starts, token_rows))
            keys = torch.arange(key_length(max_end, self.max_model_len, self._cuda))
            inputs = [t.to(self.device) for t in (input_ids, positions, write_slots, write_positions, read_slots)]
            keys = keys.to(self.device)
            self._mark_dynamic(inputs, keys, width_inputs=inputs[:4])
            logits, features = forward(*inputs, keys)
        return logits[:num_rows], features[:num_rows]

    def _padded_writes(
        self, slots: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a padded forward writes K/V: ``positions [R, L]`` of ``slots [R]`` for each row's first
        ``lengths [R]`` tokens; padding goes into the scratch slot at its offset, never past the cache.

        Returns:
            ``(write_slots, write_positions)``, each ``[R, L]``.
        """
        offsets = torch.arange(positions.shape[1])[None]
        real = offsets < lengths[:, None]
        return torch.where(real, slots[:, None], self.scratch_slot), torch.where(real, positions, offsets)

    def _mark_dynamic(
        self,
        row_inputs: Sequence[torch.Tensor],
        keys: torch.Tensor | None = None,
        width_inputs: Sequence[torch.Tensor] = (),
    ) -> None:
        """CPU: one graph for every key length, one for every row count ≥ 2 (batch 1 has its own) and,
        for the target, the context append and the drafter's block, one for every width ≥ 2 (width 1,
        a plain decode step, has its own)."""
        if self._cuda:
            return
        if keys is not None:
            torch._dynamo.maybe_mark_dynamic(keys, 0)
        if row_inputs[0].shape[0] >= 2:
            for t in row_inputs:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        for t in width_inputs:
            if t.dim() >= 2 and t.shape[1] >= 2:
                torch._dynamo.maybe_mark_dynamic(t, 1)

    def draft(
        self,
        slots: list[int],
        anchor_ids: torch.Tensor,
        starts: torch.Tensor,
        width: int | None = None,
        context: PendingWrites | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ONE drafter forward over every row's block ``[anchor, MASK × (W−1)]``, after writing the
        drafter context ``context`` holds for these rows (on CPU, compiled, in the same graph).

        The drafter runs only the block the step verifies: W tokens, not the block size B it was
        trained at, so a narrow verify step (adaptive speculation) pays for a narrow draft. Its
        block attention is bidirectional, so the drafts of a W-token block are not the first W − 1
        of a B-token one; measured on SmolLM2's drafter, their acceptance per position is the same
        within noise (``docs/engine.md``). Verification is lossless whatever is drafted. With CUDA
        graphs the drafter runs the full block (its graphs have fixed shapes) and the first W − 1
        slots are returned. A step that goes on to choose the drafted path calls
        :meth:`draft_proposal`, which on CPU does both in one graph.

        Args:
            slots: the rows' cache slots (R); anchor_ids: ``[R]``; starts: ``[R]`` int64, each
                anchor's position (= its context length, counting ``context``'s tokens).
            width: W, 2 … B (default B).
            context: target features still to be written as these rows' drafter context
                (:meth:`append_context`'s arguments, one entry per row, length 0 for none).

        Returns:
            ``(hidden [R, W−1, H], unary logits [R, W−1, V or Vd] float32)``.

        Raises:
            ValueError: when ``width`` is outside 2 … B.
        """
        width = self._check_width(width)
        if self._draft_forward is None:
            return self._eager_draft(slots, anchor_ids, starts, width, context)
        hidden, logits, *_ = self._draft_call(slots, anchor_ids, starts, width, context)
        return hidden[:, : width - 1], logits[:, : width - 1]

    def draft_proposal(
        self,
        slots: list[int],
        anchor_ids: torch.Tensor,
        starts: torch.Tensor,
        temperatures: torch.Tensor,
        uniforms: torch.Tensor,
        width: int | None = None,
        context: PendingWrites | None = None,
    ) -> Proposal:
        """A drafted step's proposal: :meth:`draft`, then :meth:`propose` on its block — on CPU,
        compiled, one graph for the context write, the drafter's block and the walk
        (:class:`StaticProposer`).

        Args:
            slots, anchor_ids, starts, width, context: as for :meth:`draft`.
            temperatures: ``[R]`` float32 (≤ 1e-5 walks greedily); uniforms: ``[R, B − 1]`` in
                [0, 1) (the first W − 1 are used).

        Returns:
            The :class:`~dflash2.selector.Proposal` over W − 1 slots, candidates as token ids.

        Raises:
            ValueError: when ``width`` is outside 2 … B.
        """
        width = self._check_width(width)
        if not self.draft_selects:
            hidden, logits = self.draft(slots, anchor_ids, starts, width, context)
            return self._select(hidden, logits, anchor_ids, temperatures, uniforms[:, : width - 1])
        _, _, *proposal = self._draft_call(slots, anchor_ids, starts, width, context, temperatures, uniforms)
        return Proposal(*(t[:, : width - 1] for t in proposal))

    def _check_width(self, width: int | None) -> int:
        assert self.drafter is not None and self.draft_cache is not None
        width = self.block_size if width is None else width
        if not 2 <= width <= self.block_size:
            raise ValueError(f"draft width {width} outside 2 … {self.block_size}")
        return width

    def _eager_draft(
        self,
        slots: list[int],
        anchor_ids: torch.Tensor,
        starts: torch.Tensor,
        width: int,
        context: PendingWrites | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.drafter is not None and self.draft_cache is not None
        if context is not None:
            self.append_context(slots, context.starts, context.features, context.lengths)
        hidden = self.drafter.draft_hidden(self.draft_cache, slots, anchor_ids, starts, width)[:, 1:]
        return hidden, self.drafter.logits(hidden)

    @property
    def draft_selects(self) -> bool:
        """True when the compiled drafting forward also writes the pending context and chooses the
        drafted path (CPU: :class:`StaticProposer`)."""
        return self._draft_forward is not None and not self._cuda

    def _draft_call(
        self,
        slots: list[int],
        anchor_ids: torch.Tensor,
        starts: torch.Tensor,
        width: int,
        context: PendingWrites | None = None,
        temperatures: torch.Tensor | None = None,
        uniforms: torch.Tensor | None = None,
        forward: Callable[..., tuple[torch.Tensor, ...]] | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """The compiled drafting forward: ``(hidden, logits)`` with CUDA graphs (over the full block,
        after an eager context write), ``(hidden, logits, draft_ids, candidate_ids, draft_probs)`` on
        CPU (:class:`StaticProposer`; greedy walks without ``temperatures``), rows cut back to R."""
        forward = self._draft_forward if forward is None else forward
        assert forward is not None and self.draft_cache is not None and self.drafter is not None
        if self._cuda:
            if context is not None:
                self.append_context(slots, context.starts, context.features, context.lengths)
                context = None
            width = self.block_size
        num_rows, device = len(slots), self.device
        padded_rows = _bucket_rows(num_rows, self.num_slots) if self._cuda else num_rows
        max_start = int(starts.max())
        with _compiled_mode():  # fresh tensors: the engine's may be inference tensors
            read_slots = torch.full((padded_rows,), self.scratch_slot, dtype=torch.long, device=device)
            read_slots[:num_rows] = torch.tensor(slots, dtype=torch.long, device=device)
            anchors = torch.zeros(padded_rows, dtype=torch.long, device=device)
            anchors[:num_rows] = anchor_ids.clone()
            start_tensor = torch.ones(padded_rows, dtype=torch.long, device=device)
            start_tensor[:num_rows] = starts.clone()
            positions = start_tensor[:, None] + torch.arange(width, device=device)[None]
            keys = torch.arange(key_length(max(max_start, 1), self.max_model_len, self._cuda), device=device)
            inputs = [anchors, positions, read_slots]
            self._mark_dynamic(inputs, keys, width_inputs=[positions])
            if self._cuda:
                outputs = forward(*inputs, keys)
            else:
                # At least two context tokens per row (padding writes the scratch slot), so that one graph
                # per row class serves every step (a width of 1 would be a graph of its own).
                if context is None:
                    features = torch.zeros(num_rows, 2, self.drafter.fc.in_features, dtype=self.dtype)
                    context = PendingWrites(features, [0] * num_rows, [0] * num_rows)
                writes = self._context_inputs(slots, context, min_width=2)
                self._mark_dynamic(writes, width_inputs=writes)
                if temperatures is None or uniforms is None:
                    temperatures, uniforms = torch.zeros(num_rows), torch.zeros(num_rows, self.block_size - 1)
                sampling = [_graph_input(temperatures.float()), _graph_input(uniforms.float())]
                self._mark_dynamic(sampling)
                outputs = forward(*writes, *inputs, keys, *sampling)
        if context is not None:
            self._roll_context(slots, context.starts, context.lengths)
        return tuple(t[:num_rows] for t in outputs)

    def _select(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        anchor_ids: torch.Tensor,
        temperatures: torch.Tensor,
        uniforms: torch.Tensor,
    ) -> Proposal:
        """The drafted path of each row from the drafter's block (:meth:`draft`): top-k candidates,
        the DFlash 2 lattice (unless ``use_selector`` is off) and the walk, eagerly
        (:meth:`DFlashDrafter.propose`); :meth:`draft_proposal` runs it compiled with the drafter.

        Args:
            hidden: ``[R, J, H]``; logits: ``[R, J, V or Vd]`` float32; anchor_ids: ``[R]``;
            temperatures: ``[R]`` float32 (≤ 1e-5 walks greedily); uniforms: ``[R, J]`` in [0, 1).
        """
        assert self.drafter is not None
        return self.drafter.propose(hidden, logits, anchor_ids, temperatures, uniforms, self.use_selector)

    def propose(
        self,
        slots: list[int],
        anchor_ids: torch.Tensor,
        starts: torch.Tensor,
        temperatures: torch.Tensor,
        uniforms: torch.Tensor,
        width: int,
        context: PendingWrites | None,
    ) -> Drafted:
        """Each row's drafted path over a ``width``-token block, timed (interim: old methods)."""
        start = time.perf_counter()
        if self.draft_selects:
            proposal = self.draft_proposal(slots, anchor_ids, starts, temperatures, uniforms, width, context)
            return Drafted(proposal, self._phase_end() - start, None)
        hidden, logits = self.draft(slots, anchor_ids, starts, width, context)
        selecting = self._phase_end()
        proposal = self._select(hidden, logits, anchor_ids, temperatures, uniforms[:, : width - 1])
        return Drafted(proposal, selecting - start, self._phase_end() - selecting)

    def _phase_end(self) -> float:
        if self.sync_timing and self._cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def append_context(
        self, slots: list[int], starts: list[int], features: torch.Tensor, lengths: Sequence[int]
    ) -> None:
        """Write drafter context K/V for the first ``lengths[r]`` rows of ``features [R, L, F·H]``.

        Row r's tokens sit at positions ``starts[r] ..``; afterwards the slot's draft context
        covers every position whose target feature is known (spec §10 cache discipline).
        """
        assert self.drafter is not None and self.draft_cache is not None
        if self._context_forward is not None:
            self._context_call(slots, PendingWrites(features, list(lengths), list(starts)))
        else:
            self._eager_context(slots, starts, features, lengths)
        self._roll_context(slots, starts, lengths)

    def _roll_context(self, slots: list[int], starts: Sequence[int], lengths: Sequence[int]) -> None:
        """Each slot's drafter context now ends after its written tokens (rows with none unchanged)."""
        assert self.draft_cache is not None
        for slot, start, n in zip(slots, starts, lengths):
            if n:
                self.draft_cache.rollback(slot, start + n)

    def _eager_context(
        self, slots: list[int], starts: Sequence[int], features: torch.Tensor, lengths: Sequence[int]
    ) -> None:
        """The drafter context write through the eager drafter (its linears pre-packed on CPU)."""
        assert self.drafter is not None and self.draft_cache is not None
        width = features.shape[1]
        offsets = torch.arange(width, device=self.device)[None]
        keep = offsets < torch.tensor(lengths, device=self.device)[:, None]  # [R, L]
        positions = torch.tensor(starts, device=self.device)[:, None] + offsets
        flat_slots = torch.tensor(slots, device=self.device)[:, None].expand(-1, width)[keep]
        self.drafter.append_context(self.draft_cache, flat_slots, positions[keep], features[keep])

    def _context_inputs(self, slots: list[int], context: PendingWrites, min_width: int = 1) -> list[torch.Tensor]:
        """``(features, write_slots, write_positions)`` for a compiled context write: rows padded to
        ``min_width`` tokens or more, each row's positions past its length written into the scratch
        slot, as a verify forward's padding is."""
        features = context.features.to(self.dtype)  # the dtype the graphs were built for
        if features.shape[1] < min_width:
            features = F.pad(features, (0, 0, 0, min_width - features.shape[1]))
        positions = torch.tensor(context.starts)[:, None] + torch.arange(features.shape[1])[None]
        writes = self._padded_writes(torch.tensor(slots), positions, torch.tensor(context.lengths))
        return [_graph_input(features), *(t.to(self.device) for t in writes)]

    def _context_call(
        self, slots: list[int], context: PendingWrites, forward: Callable[..., torch.Tensor] | None = None
    ) -> None:
        """The drafter context write through the compiled :class:`StaticContext` (the caller rolls the
        slots forward)."""
        forward = self._context_forward if forward is None else forward
        assert forward is not None
        with _compiled_mode():
            inputs = self._context_inputs(slots, context)
            self._mark_dynamic(inputs, width_inputs=inputs)
            forward(*inputs)

    def measure_costs(
        self,
        row_counts: Sequence[int],
        widths: Sequence[int],
        repeats: int = 3,
        context: int = 0,
    ) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], float]]:
        """Time the decode forwards on the scratch slot: the target at each (rows, width) and, with a
        drafter, a greedy step's proposal at each (rows, width ≥ 2) — its block and the choice of the
        drafted path, :meth:`draft_proposal` — (median of ``repeats`` after one warm-up call). Every
        row sits after ``context`` tokens (clamped to the slot), so attention reads as many keys as a
        request that far in would.

        The calls are interleaved: each round times every (rows, width) once, so a stretch of load
        from another process slows one sample of many shapes rather than every sample of one (a
        table whose widths were timed one after another under such load verified 5–8 tokens per step
        where 4 paid most, for good: live steps rescale every drafted width by one factor).

        Returns:
            ``({(rows, width): verify seconds}, {(rows, width): draft seconds})`` (the second empty
            without a drafter).
        """
        calls: dict[tuple[str, int, int], Callable[[], object]] = {}
        context = max(0, min(context, self.max_model_len - max(widths, default=1)))
        for rows in row_counts:
            slots, starts = [self.scratch_slot] * rows, [context] * rows
            for width in widths:
                calls[("verify", rows, width)] = functools.partial(self.verify, slots, [[0] * width] * rows, starts)
            if self.draft_cache is None:
                continue
            anchors = torch.zeros(rows, dtype=torch.long, device=self.device)
            lengths = torch.full_like(anchors, max(context, 1))
            temperatures = torch.zeros(rows, device=self.device)
            uniforms = torch.zeros(rows, self.block_size - 1, device=self.device)
            for width in (w for w in widths if w > 1):
                calls[("draft", rows, width)] = functools.partial(
                    self.draft_proposal, slots, anchors, lengths, temperatures, uniforms, width
                )
        samples: dict[tuple[str, int, int], list[float]] = {key: [] for key in calls}
        with torch.inference_mode():
            for call in calls.values():  # warm-up
                call()
            for _ in range(repeats):
                for key, call in calls.items():
                    start = time.perf_counter()
                    call()
                    samples[key].append(time.perf_counter() - start)
        medians = {key: sorted(times)[len(times) // 2] for key, times in samples.items()}
        verify = {(rows, width): t for (kind, rows, width), t in medians.items() if kind == "verify"}
        draft = {(rows, width): t for (kind, rows, width), t in medians.items() if kind == "draft"}
        return verify, draft

    def rollback(self, slot: int, length: int) -> None:
        """Set a slot's committed target length (O(1))."""
        self.target_cache.rollback(slot, length)

    @property
    def supports_prefix_copy(self) -> bool:
        """True when the caches are contiguous per slot (``KVCache``), so a prefix can be copied."""
        return isinstance(self.target_cache, KVCache)

    def copy_prefix(self, source: int, dest: int, length: int) -> None:
        """Copy positions ``[0, length)`` of slot ``source`` into slot ``dest``: target K/V and drafter
        context (prefix caching). ``dest`` then holds ``length`` committed tokens."""
        for cache in (self.target_cache, self.draft_cache):
            if cache is not None:
                cache.k[:, dest, :, :length] = cache.k[:, source, :, :length]
                cache.v[:, dest, :, :length] = cache.v[:, source, :, :length]
        self.target_cache.rollback(dest, length)

    def free(self, slot: int) -> None:
        """Forget a slot in both caches."""
        self.target_cache.free(slot)
        if self.draft_cache is not None:
            self.draft_cache.free(slot)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction (0–1) of target KV positions holding committed tokens (scratch slot excluded)."""
        return sum(self.target_cache.lengths[: self.num_slots]) / (self.num_slots * self.max_model_len)


def check_deterministic(target: Any, device: torch.device, dtype: torch.dtype) -> None:
    """Raise ``ValueError`` unless batch-invariant forwards are available for this target, device
    and dtype: the project's own decoder (not the transformers fallback), on a CPU where oneDNN
    runs bfloat16 (its GEMM is the row-invariant kernel the mode relies on; float32 matrix
    products go through MKL, whose summation order depends on the row count)."""
    if device.type != "cpu":
        raise ValueError(f"--deterministic runs on CPU only for now, not on {device.type}")
    if not onednn_bf16(device, dtype):
        reason = (
            "this CPU has neither, so bfloat16 runs on the project's AVX2 kernel (or PyTorch's generic code), "
            "which this mode does not support"
            if dtype == torch.bfloat16
            else f"this engine runs {str(dtype).removeprefix('torch.')}"
        )
        raise ValueError(
            f"--deterministic needs --dtype bfloat16 on a CPU where oneDNN runs bfloat16 (AVX512-BF16 or AMX); {reason}"
        )
    if not isinstance(target, TargetModel):
        raise ValueError(
            f"--deterministic needs a target the project decodes itself ({', '.join(SUPPORTED_MODEL_TYPES)}), "
            f"not the {type(target).__name__} fallback"
        )


def _graph_input(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a compiled graph may take it on every call: contiguous, not an inference tensor (the
    engine's may be) — copied only then — and not a view (a view's guards read its base; ``detach``
    drops the base without a copy)."""
    if t.is_inference():
        return t.clone(memory_format=torch.contiguous_format)
    t = t.contiguous()
    return t.detach() if t._base is not None else t


@contextlib.contextmanager
def _compiled_mode() -> Iterator[None]:
    """Compiled forwards run under ``no_grad`` outside inference mode: a graph traced once must see
    the same tensor flags on every call, and the weights, graph inputs, need no autograd."""
    with torch.inference_mode(False), torch.no_grad():
        yield


def _short(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) < 500 else text[:500] + " …"
