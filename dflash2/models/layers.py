"""Building blocks shared by the target decoders and the drafter.

Dimension letters: R rows, L positions per row, T key positions, H hidden size,
nh / nkv query / key-value heads, d head dim.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)
ModuleT = TypeVar("ModuleT", bound=nn.Module)
_local = threading.local()


@contextlib.contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Within this block (on this thread), forwards compute every token's result independently of
    the other tokens and rows in the same call: linear layers never run oneDNN's one-row kernel
    (:class:`PackedLinear` pads a single row to two) and :func:`attention` runs
    :func:`invariant_attention` instead of the fused SDPA kernel.

    Measured on CPU in bfloat16 (``tests/unit/test_batch_invariance.py``): oneDNN's GEMM gives
    each row the same bits for any row count ≥ 2 and at any row offset, while its one-row
    (GEMV) kernel sums in another order; the fused SDPA kernel's result depends on how many
    queries share a call and on the key length. This is the engine's deterministic mode
    (``EngineConfig.deterministic``); peers: vLLM's batch-invariant mode and SGLang's
    deterministic inference, which replace the same kernels on GPUs.
    """
    previous = getattr(_local, "enabled", False)
    _local.enabled = enabled
    try:
        yield
    finally:
        _local.enabled = previous


def batch_invariant_enabled() -> bool:
    """True inside :func:`batch_invariant` on this thread; always False while ``torch.compile``
    traces (compiled graphs never run batch-invariant, and reading the thread-local state there
    would guard every graph on it)."""
    if torch.compiler.is_compiling():
        return False
    return bool(getattr(_local, "enabled", False))


class RMSNorm(nn.Module):
    """Root-mean-square layer norm computed in float32 (Llama/Qwen convention)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def onednn_bf16(device: torch.device, dtype: torch.dtype) -> bool:
    """True on a CPU in bfloat16 when PyTorch was built with oneDNN (mkldnn) and the CPU has its
    bfloat16 support (AVX512-BF16 or AMX): the :class:`PackedLinear` backend ``"onednn"``."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


CPU_KERNELS = ("amx", "avx512bf16", "avx2", "onednn")  # DFLASH2_CPU_KERNEL's values, in the order tried
# The project's own kernels: custom ops that compiled graphs call with the packed weight as an input
# (oneDNN's packed weights cannot be graph inputs).
PROJECT_KERNELS = ("amx", "avx512bf16", "avx2")
BACKEND_NAMES = {  # for log lines
    "amx": "the project's AMX kernel",
    "avx512bf16": "the project's AVX512-BF16 kernel",
    "avx2": "the project's AVX2 kernel",
    "onednn": "oneDNN",
}


def choose_cpu_kernel(
    flags: frozenset[str], onednn: bool, builds: Callable[[str], bool], forced: str | None = None
) -> str | None:
    """Which bfloat16 linear path a CPU gets (pure; :func:`cpu_bf16_backend` calls it for this machine).

    The first that can run, in this order: the project's AMX kernel (the AVX512-BF16 flags and
    ``amx_tile``, ``amx_bf16``), its AVX512-BF16 kernel (flags ``avx512f``,
    ``avx512bw``, ``avx512vl``, ``avx512_bf16``), its AVX2 kernel (``avx2``, ``fma``), oneDNN (when
    ``onednn``: PyTorch reports its bfloat16 support); None when none can.

    Args:
        flags: the CPU's ``/proc/cpuinfo`` flags.
        onednn: whether oneDNN runs bfloat16 matrices here (:func:`onednn_bf16`).
        builds: whether a project kernel (by name) builds and loads; asked only where the flags allow.
        forced: a name from :data:`CPU_KERNELS` to use instead (``DFLASH2_CPU_KERNEL``).

    Raises:
        ValueError: ``forced`` is not one of :data:`CPU_KERNELS`, or cannot run on this CPU.
    """
    from dflash2.models.cpu_kernels import KERNELS

    def can_run(name: str) -> bool:
        if name == "onednn":
            return onednn
        return KERNELS[name].cpu_flags <= flags and builds(name)

    if forced:
        if forced not in CPU_KERNELS:
            raise ValueError(f"DFLASH2_CPU_KERNEL={forced!r}: expected one of {', '.join(CPU_KERNELS)}")
        if not can_run(forced):
            need = "oneDNN bfloat16 support" if forced == "onednn" else " ".join(sorted(KERNELS[forced].cpu_flags))
            raise ValueError(f"DFLASH2_CPU_KERNEL={forced}: cannot run on this CPU (needs {need}, and a C++ compiler)")
        return forced
    return next((name for name in CPU_KERNELS if can_run(name)), None)


def cpu_bf16_backend() -> str | None:
    """:func:`choose_cpu_kernel` for this machine, ``DFLASH2_CPU_KERNEL`` honoured (each call reads
    it; the kernels' builds and the CPU's flags are cached); each choice is logged once."""
    from dflash2.models.cpu_kernels import KERNELS
    from dflash2.platform import cpu_flags

    onednn = onednn_bf16(torch.device("cpu"), torch.bfloat16)
    forced = os.environ.get("DFLASH2_CPU_KERNEL", "").strip().lower() or None
    backend = choose_cpu_kernel(cpu_flags(), onednn, lambda name: KERNELS[name].available(), forced)
    if (backend, forced) not in _logged_choices:
        _logged_choices.add((backend, forced))
        how = "forced by DFLASH2_CPU_KERNEL" if forced else "chosen from the CPU's flags"
        logger.info("bfloat16 CPU linears: %s (%s)", BACKEND_NAMES.get(backend or "", "PyTorch's generic code"), how)
    return backend


_logged_choices: set[tuple[str | None, str | None]] = set()  # (backend, forced) pairs already logged


def linear_backend(device: torch.device, dtype: torch.dtype) -> str | None:
    """How :class:`PackedLinear` runs linears of this device and dtype, or None (plain ``nn.Linear``).

    On a CPU in bfloat16, :func:`cpu_bf16_backend`: ``"amx"``, ``"avx512bf16"`` or ``"avx2"`` (the project's
    kernels, :mod:`dflash2.models.cpu_kernels`, built the first time) or ``"onednn"`` (oneDNN's
    kernels on a pre-packed weight). None on CUDA, in float32 or float16, and where none can run.

    Raises:
        ValueError: ``DFLASH2_CPU_KERNEL`` names a path that cannot run here.
    """
    if device.type != "cpu" or dtype != torch.bfloat16:
        return None
    return cpu_bf16_backend()


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :class:`PackedLinear` can serve linears of this device and dtype (see
    :func:`linear_backend`): CPU bfloat16 with one of the project's kernels or oneDNN."""
    return linear_backend(device, dtype) is not None


# Rows per oneDNN call inside batch_invariant(): from 2 to 32 rows its matrix kernel gives each row the
# same bits; above that, on CPUs with AMX, it blocks the rows differently (seen at 35 and 64 rows).
ONEDNN_INVARIANT_ROWS = 32


class PackedLinear(nn.Module):
    """An inference-only ``nn.Linear`` whose bfloat16 weight is pre-packed once for a CPU kernel.

    Backends ``"amx"`` (CPUs with AMX), ``"avx512bf16"`` (CPUs with AVX512-BF16) and ``"avx2"`` (other
    AVX2 CPUs): the weight
    in the layout of the project's kernel (:mod:`dflash2.models.cpu_kernels`), multiplied by its op
    (float32 accumulation in a fixed order: a row's result does not depend on the other rows). A
    custom op with a shape function, so compiled graphs call it too, with the packed weight as a
    graph input.

    Backend ``"onednn"``: the weight in oneDNN's blocked layout. ``F.linear`` re-lays out a
    bfloat16 weight on every CPU call; packing once at load time makes the small matrix–vector
    products of decoding about 1.8× faster (a SmolLM2-135M token: 20.5 → 11.6 ms of linears on 2
    cores) with bit-identical outputs. ``torch.compile`` cannot take mkldnn tensors as graph
    inputs, so the runner's compiled forwards keep dense weights there.

    The packed weight supports no autograd, indexing or ``.to()``: use it only after the model is
    on its device and in its final dtype (see :func:`prepack_linears`).

    Args:
        weight: ``[out, in]`` bfloat16 on a CPU; bias: ``[out]`` or None.
        keep_weight: keep the dense ``weight`` attribute, for code that reads it directly
            (e.g. an LM head the drafter shares); otherwise it is dropped to save memory.
        backend: ``"amx"``, ``"avx512bf16"``, ``"avx2"`` or ``"onednn"``; None = :func:`linear_backend`'s choice.

    Raises:
        ValueError: where neither backend can run (see :func:`linear_backend`).
    """

    packed_weight: torch.Tensor

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        keep_weight: bool = False,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        backend = backend or linear_backend(weight.device, weight.dtype)
        if backend not in CPU_KERNELS:
            raise ValueError(f"no packed linear kernel for {weight.dtype} on {weight.device}")
        self.backend = backend
        self.bias: torch.Tensor | None
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)
        self.weight = weight if keep_weight else None
        if backend == "onednn":
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        else:
            from dflash2.models.cpu_kernels import KERNELS

            pack = KERNELS[backend].pack
            assert pack is not None
            self.register_buffer("packed_weight", pack(weight), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` bfloat16 → ``[..., out]``."""
        if self.backend in ("amx", "avx512bf16"):
            from dflash2.models.cpu_kernels import dot_linear

            return dot_linear(self.backend, x, self.packed_weight, self.bias, self.in_features, self.out_features)
        if self.backend == "avx2":
            return torch.ops.dflash2.bf16_linear(x, self.packed_weight, self.bias, self.out_features)
        if batch_invariant_enabled():
            flat = x.reshape(-1, self.in_features)
            rows = [
                self._onednn(flat[i : i + ONEDNN_INVARIANT_ROWS]) for i in range(0, len(flat), ONEDNN_INVARIANT_ROWS)
            ]
            return torch.cat(rows).reshape(*x.shape[:-1], self.out_features)
        return self._onednn(x)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == self.in_features:
            # One row would take oneDNN's matrix-vector kernel, which sums in another order than
            # the matrix kernel every larger call uses; a copy of the row keeps the bits equal.
            flat = x.reshape(1, self.in_features).expand(2, -1)
            out = torch.ops.mkldnn._linear_pointwise(flat.contiguous(), self.packed_weight, self.bias, "none", [], "")
            return out[:1].reshape(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight, self.bias, "none", [], "")


def prepack_linears(module: nn.Module, skip: tuple[str, ...] = ()) -> int:
    """Replace every ``nn.Linear`` under ``module`` by a :class:`PackedLinear`, in place.

    Call only when :func:`can_prepack` holds for the module's device and dtype, and only on
    modules used for inference. Already packed layers are left alone, so it is idempotent.

    Args:
        skip: names of child modules (at any depth) to leave untouched, e.g. a layer whose
            ``weight`` other code reads.

    Returns:
        The number of layers packed.
    """
    count = 0
    for name, child in list(module.named_children()):
        if name in skip:
            continue
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child.weight, child.bias))
            count += 1
        else:
            count += prepack_linears(child, skip)
    return count


def shallow_copy(module: ModuleT) -> ModuleT:
    """A copy of ``module`` that shares its children, parameters and buffers but holds them in tables
    of its own: replacing a child of the copy (fusing or packing a layer) leaves the original as it
    was, and nothing is duplicated in memory."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    clone._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    return clone


def fused_linear(parts: Sequence[nn.Module]) -> nn.Linear:
    """One ``nn.Linear`` whose output is the concatenation of ``parts``' outputs (new weight tensors:
    an inference copy runs one larger matrix product instead of several).

    Raises:
        ValueError: when a part has no dense weight (a model already pre-packed for eager use).
    """
    linears = [p for p in parts if isinstance(p, nn.Linear)]
    if len(linears) != len(parts):
        raise ValueError("the model's linear layers are already pre-packed: build the runner from dense weights")
    weight = torch.cat([p.weight.detach() for p in linears])
    biases = [p.bias for p in linears]
    has_bias = any(b is not None for b in biases)
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        bias = [b.detach() if b is not None else weight.new_zeros(p.out_features) for p, b in zip(linears, biases)]
        fused.bias = nn.Parameter(torch.cat(bias), requires_grad=False)
    return fused


def fuse_linears(parts: list[nn.Module]) -> nn.Module | None:
    """:func:`fused_linear` for dense parts; for weight-only quantized parts
    (:class:`~dflash2.models.quant.QuantizedLinear`) their codes concatenated, or None where their formats
    differ (a GGUF mix may quantize Q/K and V differently: those stay separate)."""
    from dflash2.models.quant import QuantizedLinear, fuse_quantized, same_format

    if not same_format(parts):
        return None
    quantized = [p for p in parts if isinstance(p, QuantizedLinear)]
    return fuse_quantized(quantized) if quantized else fused_linear(parts)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class FusedMLP(nn.Module):
    """An inference copy of an :class:`MLP` with the gate and up projections in one matrix.

    Raises:
        ValueError: when the two cannot be fused (see :func:`fuse_linears`; check with :meth:`can_fuse`).
    """

    def __init__(self, mlp: MLP) -> None:
        super().__init__()
        self.intermediate_size = mlp.gate_proj.out_features
        gate_up = fuse_linears([mlp.gate_proj, mlp.up_proj])
        if gate_up is None:
            raise ValueError("the MLP's gate and up projections have different weight formats")
        self.gate_up = gate_up
        self.down_proj: nn.Module = mlp.down_proj

    @staticmethod
    def can_fuse(mlp: MLP) -> bool:
        """Whether ``mlp``'s gate and up projections share a weight format (always, for dense ones)."""
        from dflash2.models.quant import same_format

        return same_format([mlp.gate_proj, mlp.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (NeoX / rotate-half layout) for any position ids.

    The inverse frequencies come from transformers' RoPE initialisers for scaled variants
    (linear, llama3, yarn, longrope) so scaling matches the reference models exactly.

    Raises:
        ValueError: for the ``dynamic`` rope type, whose frequencies depend on sequence length.
    """

    def __init__(self, config: Any, head_dim: int) -> None:
        super().__init__()
        params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
        rope_type = str(params.get("rope_type", params.get("type", "default")))
        theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        scaling = 1.0
        with torch.device("cpu"):  # real values even when the model is built on the meta device
            inv_freq, scaling = self._inverse_frequencies(config, rope_type, theta, head_dim)
        # A plain attribute, not a buffer: Module.to(dtype) must not round the frequencies.
        self.inv_freq = inv_freq.float()
        self.scaling = float(scaling)

    @staticmethod
    def _inverse_frequencies(config: Any, rope_type: str, theta: float, head_dim: int) -> tuple[torch.Tensor, float]:
        scaling = 1.0
        if rope_type == "default":
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        elif rope_type == "dynamic":
            raise ValueError("rope_type 'dynamic' is not supported: its frequencies change with length")
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        return inv_freq, float(scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [...]`` int64 → ``(cos, sin)`` each ``[..., d]`` in ``dtype``."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[..., None].float() * self.inv_freq  # [..., d/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [R, heads, L, d]`` by ``cos/sin [R, L, d]``."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# Up to this many queries per row, grouped-query attention folds query groups (see attention).
FOLD_MAX_QUERIES = 64


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked grouped-query attention.

    Args:
        q: ``[R, nh, L, d]``; k, v: ``[R, nkv, T, d]``; mask: ``[R, 1, L, T]`` bool, True = visible.

    Returns:
        ``[R, L, nh·d]``.
    """
    if batch_invariant_enabled():
        return invariant_attention(q, k, v, mask)
    num_rows, num_heads, num_queries, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    if num_queries <= FOLD_MAX_QUERIES:
        # Few queries (decode, verify, drafting): fold each K/V head's query group into the query
        # axis, [R, nh, L, d] → [R, nkv, g·L, d] (query head h uses K/V head h // g), and run plain
        # attention. On CPU this is ~5x faster than enable_gqa for batched bfloat16 decode.
        folded = q.reshape(num_rows, num_kv_heads, group * num_queries, head_dim)
        # The mask repeated per group member (a view when L = 1).
        folded_mask = mask[:, :, None].expand(-1, -1, group, -1, -1).flatten(2, 3)
        out = F.scaled_dot_product_attention(folded, k, v, attn_mask=folded_mask)
        # A view on CPU; CUDA's kernels may return [R, g·L, nkv, d] memory transposed, then a copy.
        out = out.reshape(num_rows, num_heads, num_queries, head_dim)
    else:
        # enable_gqa shares each K/V head with its query group without materialising copies
        # (repeat_interleave made decode at batch 32 ~15x slower on CPU).
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=group > 1)
    return out.transpose(1, 2).reshape(num_rows, num_queries, num_heads * head_dim)


# Float32 scores per invariant_attention call, at most (bounds a long prefill's memory).
INVARIANT_SCORES_BUDGET = 1 << 24
# invariant_attention pads each softmax row to a multiple of this many keys.
INVARIANT_KEY_ALIGN = 64


def invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked grouped-query attention whose result for each query depends only on that query, its
    mask row and the keys it sees: not on the other queries, heads or rows in the call, nor on how
    many masked keys there are (batch-invariant; see :func:`batch_invariant`).

    In bfloat16 on a CPU with the AVX512-BF16 kernel's library (deterministic mode requires it), the
    op ``dflash2::invariant_attention`` (``csrc/invariant_attention.cpp``): one thread computes one
    query head's output from start to end, in float32 in a fixed order, skipping masked keys.
    Library GEMMs cannot be used for this: on CPUs with AMX, oneDNN's bfloat16 product gave one
    query other bits in a call of 3 rows than in one of 6. Elsewhere (other dtypes, tests),
    :func:`_written_out_attention`.

    Args:
        q: ``[R, nh, L, d]``; k, v: ``[R, nkv, T, d]``; mask: ``[R, 1, L, T]`` bool, True = visible.

    Returns:
        ``[R, L, nh·d]`` in ``q``'s dtype.
    """
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and invariant_kernel_available():
        scale = q.shape[-1] ** -0.5
        return torch.ops.dflash2.invariant_attention(q, k, v, mask[:, 0], scale)
    return _written_out_attention(q, k, v, mask)


def invariant_kernel_available() -> bool:
    """Whether ``dflash2::invariant_attention`` runs here: it is built into the AVX512-BF16 kernel's
    library (:data:`dflash2.models.cpu_kernels.AVX512_BF16`)."""
    from dflash2.models.cpu_kernels import AVX512_BF16

    return AVX512_BF16.available()


def _written_out_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """:func:`invariant_attention` without the kernel: two ``torch.matmul`` products and a float32
    masked softmax, each softmax row padded to a multiple of ``INVARIANT_KEY_ALIGN`` keys. Row
    invariance then rests on the library's GEMM, which holds on some CPUs and not on others (oneDNN on
    AMX), so deterministic mode never runs it."""
    num_rows, num_heads, num_queries, head_dim = q.shape
    num_kv_heads, num_keys = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    # [R, nkv, g·L, d]: query head h uses K/V head h // g; its mask row is the query's.
    folded = q.reshape(num_rows, num_kv_heads, group * num_queries, head_dim)
    folded_mask = mask[:, :, None].expand(-1, -1, group, -1, -1).flatten(2, 3)
    # Contiguous K and V: one row's cache read can be a strided view where a batch's is a gathered
    # copy, and the matrix kernels group their sums differently for the two layouts (oneDNN on AMX).
    k, v = k.contiguous(), v.contiguous()
    keys_t = k.transpose(-1, -2)
    scale = head_dim**-0.5
    # The softmax sums a row in vector lanes and a scalar tail, so how many keys follow changes the
    # order of the sum: rows are padded to a multiple of 64 (masked, exact zeros). The products
    # with V are unaffected by trailing zeros.
    padded_keys = -(-num_keys // INVARIANT_KEY_ALIGN) * INVARIANT_KEY_ALIGN
    chunk = max(1, INVARIANT_SCORES_BUDGET // max(1, num_rows * num_kv_heads * num_keys))
    # The lowest finite value, not -inf: a query with no visible key (padding) stays finite.
    lowest = torch.finfo(torch.float32).min
    outs = []
    for begin in range(0, group * num_queries, chunk):
        scores = torch.matmul(folded[:, :, begin : begin + chunk], keys_t).float() * scale
        scores = scores.masked_fill(~folded_mask[:, :, begin : begin + chunk], lowest)
        if padded_keys != num_keys:
            scores = F.pad(scores, (0, padded_keys - num_keys), value=lowest)
        probs = torch.softmax(scores, dim=-1)[..., :num_keys].to(v.dtype)
        outs.append(torch.matmul(probs, v))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.view(num_rows, num_heads, num_queries, head_dim).transpose(1, 2).reshape(num_rows, num_queries, -1)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap · tanh(logits / cap)`` when ``cap`` is a positive number, else the logits unchanged."""
    if cap is None or cap <= 0:
        return logits
    return cap * torch.tanh(logits / cap)
