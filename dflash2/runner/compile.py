"""Compiling the runner's decode-time forwards: compiler settings, the thin modules the graphs
are built from, and building, saving and warming up every graph at start-up.

The modules here hold no model code of their own: each binds the runner's cache tensors and
the weights a graph reads to one static-shape method of the models —
:meth:`TargetModel.forward_slots`, :meth:`DFlashDrafter.draft_block`,
:meth:`DFlashDrafter.write_context` — and, on CPU, the selector's walk
(:func:`dflash2.spec.selector.draft_path`). Why they look the way they do:

* **Weights as graph inputs.** Inductor's weights are not frozen (``freezing = False``): a graph
  reads them, and the caches, from its module at every call, so inductor's caches store the whole
  compilation and a saved graph (:class:`~dflash2.runner.precompiled.PrecompiledForward`) loads at the
  next start. Every weight a graph reads is a parameter or buffer of its module.
* **Packed bfloat16 CPU kernels as custom ops.** With the project's kernels the modules' linears are
  packed (:func:`~dflash2.models.layers.prepack_linears`) and the graphs call the ops with the
  packed weight as an input; oneDNN's packed weights cannot be graph inputs, so there the graphs
  keep dense weights.
* **Cache tensors registered once.** The cache views are buffers, one pair per layer, and the
  drafter's context append and block share the same buffer objects: with two views of one cache
  as inputs, AOT autograd merged them into one overlapping base and inductor copied each layer's
  whole cache slice to write a few positions into it.
* **One drafting graph on CPU** (:class:`CompiledProposer`): the context the rows committed since
  they last drafted, the drafter's block and the selector's walk, one call instead of three.

Dimension letters: R rows, L tokens per row, W block width, J = W − 1 drafted slots, T keys,
H hidden, V vocab, F·H captured features, k candidates.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from dflash2.models.base import Drafter
from dflash2.models.drafter import DFlashDrafter, inference_copy
from dflash2.models.kv_cache import KVCache
from dflash2.models.layers import PROJECT_KERNELS, can_prepack, linear_backend, prepack_linears
from dflash2.models.llama import TargetModel
from dflash2.runner.draft_runner import DraftRunner
from dflash2.runner.graph_inputs import CUDA_MIN_KEYS, CUDA_ROW_BUCKETS, PendingWrites, bucket_rows, node_buckets
from dflash2.runner.precompiled import PrecompiledForward
from dflash2.runner.settings import RunnerSpec
from dflash2.spec.selector import SelectorWeights, draft_path
from dflash2.spec.tree import TokenTree


class GraphRunner(Protocol):
    """What building and warming up the graphs reads of the runner they are built for
    (:class:`~dflash2.runner.ModelRunner` is one; naming this instead keeps the runner's module, which
    calls this one, out of its imports)."""

    spec: RunnerSpec
    target: Any
    target_cache: Any
    drafter: Drafter | None
    drafting: DraftRunner | None
    capture_layer_ids: tuple[int, ...]
    device: torch.device
    dtype: torch.dtype

    @property
    def cuda(self) -> bool: ...

    @property
    def num_slots(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def scratch_slot(self) -> int: ...

    @property
    def tree_nodes(self) -> int: ...

    @property
    def max_tree_nodes(self) -> int: ...

    @property
    def draft_cache(self) -> KVCache | None: ...

    def chain_call(
        self,
        slots: list[int],
        chains: Sequence[TokenTree],
        starts: list[int],
        forward: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def tree_call(
        self,
        slots: list[int],
        trees: Sequence[TokenTree],
        starts: list[int],
        forward: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


logger = logging.getLogger(__name__)

# Inductor's size / stride / alignment / scalar checks in the CPU graphs' wrapper code (see below).
RUNTIME_ASSERTS = False


def inductor_cache_dir() -> str:
    """Where compiled graphs are cached: ``<dflash2 cache>/inductor`` (unless
    ``$TORCHINDUCTOR_CACHE_DIR`` is set)."""
    from dflash2.models.source import cache_dir

    return str(cache_dir() / "inductor")


def configure_compiler(device: torch.device, dynamic_threads: bool) -> None:
    """Dynamo's and inductor's settings for the runner's graphs (process-wide)."""
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
    """The CPU graph a target or context-append call needs: batch 1 or more, one token or more
    (``inputs[0]`` is ``[R, L, …]``)."""
    num_rows, width = inputs[0].shape[:2]
    return ("rows=1" if num_rows == 1 else "rows=2+", "width=1" if width == 1 else "width=2+")


def _rows_class(inputs: Sequence[torch.Tensor]) -> str:
    """The CPU graph a drafting call needs: batch 1 or more."""
    return "rows=1" if inputs[0].shape[0] == 1 else "rows=2+"


def _tree_class(inputs: Sequence[torch.Tensor]) -> tuple[str, str]:
    """The CPU graph a token-tree call of the target module needs (its own, beside the chains' graphs
    of the same module): batch 1 or more."""
    return ("tree", _rows_class(inputs))


_SHAPE_CLASSES: dict[str, Callable[[Sequence[torch.Tensor]], Any]] = {
    "target": _target_shape_class,
    "drafter": _rows_class,
    "context": _target_shape_class,
    "tree": _tree_class,
}


def without_global_state_guard(guards: Sequence[Any]) -> list[bool]:
    """Keep every dynamo guard but the global-state one (grad mode, autocast, default dtype, thread
    count …). That guard would recompile a graph (20 s on CPU) whenever the engine changes torch's
    thread count (``dflash2/threads.py``), while the kernels read the count when they run
    (``cpp.dynamic_threads``). The rest of that state is fixed for these graphs: the runner is their only
    caller, always in inference mode, without autocast, at the dtype the weights were loaded in."""
    return [entry.guard_type != "GLOBAL_STATE" for entry in guards]


# ---- the modules the graphs are built from -------------------------------------------------------


def _register_caches(module: nn.Module, k: Sequence[torch.Tensor], v: Sequence[torch.Tensor]) -> None:
    for i, (k_cache, v_cache) in enumerate(zip(k, v)):
        module.register_buffer(f"k_cache_{i}", k_cache, persistent=False)
        module.register_buffer(f"v_cache_{i}", v_cache, persistent=False)


def _caches(module: nn.Module, num_layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(getattr(module, f"k_cache_{i}"), getattr(module, f"v_cache_{i}")) for i in range(num_layers)]


class CompiledTarget(nn.Module):
    """:meth:`TargetModel.forward_slots` of a fused copy of the target (:meth:`TargetModel.fused_copy`:
    its embedding, norms, LM head and output projections shared) over the target cache, whose
    per-layer views are buffers, so a compiled forward writes into the memory eager prefill uses.

    One module serves chains and token trees: a batch of chains runs the causal forward (no mask), a
    batch with a tree passes its ancestor mask; each is a graph of its own (``target`` and ``tree``)."""

    def __init__(self, target: TargetModel, cache: KVCache, capture_layer_ids: Sequence[int]) -> None:
        super().__init__()
        self.model = target.fused_copy()
        self.capture_layer_ids = tuple(capture_layer_ids)
        self.num_layers = target.num_layers
        _register_caches(self, list(cache.k), list(cache.v))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        write_positions: torch.Tensor,
        read_slots: torch.Tensor,
        key_positions: torch.Tensor,
        tree_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits [R, L, V] float32, features [R, L, F·H])``: see :meth:`TargetModel.forward_slots`;
        ``tree_mask [R, L, L]`` (True: node j is node i or its ancestor) for token trees, None for chains."""
        caches = _caches(self, self.num_layers)
        return self.model.forward_slots(
            input_ids,
            positions,
            write_slots,
            write_positions,
            read_slots,
            key_positions,
            caches,
            self.capture_layer_ids,
            tree_mask,
        )


class CompiledDrafter(nn.Module):
    """:meth:`DFlashDrafter.draft_block` of an inference copy of the drafter
    (:func:`~dflash2.models.drafter.inference_copy`: its own fused layers when ``own_layers``, since the eager
    drafter's are then pre-packed in place) over the context cache, whose per-layer views are
    buffers. The target's embedding and the (draft-vocabulary) LM head are registered here as
    parameters (graph inputs, like every weight); the head is an ``nn.Linear`` so that the runner
    packs it like every other layer. The block's width W is a dimension of the inputs, so on CPU one
    graph drafts every width from 2 to the block size."""

    def __init__(self, drafter: DFlashDrafter, cache: KVCache, own_layers: bool = False) -> None:
        super().__init__()
        self.model = inference_copy(drafter, own_layers)
        self.num_layers = drafter.config.num_hidden_layers
        self.embed = nn.Parameter(drafter.embed_weight.detach(), requires_grad=False)
        head = drafter.head_weight
        self.head = nn.Linear(head.shape[1], head.shape[0], bias=False, device="meta")
        self.head.weight = nn.Parameter(head.detach().to(drafter.dtype), requires_grad=False)
        _register_caches(self, list(cache.k), list(cache.v))

    def forward(
        self, anchor_ids: torch.Tensor, positions: torch.Tensor, read_slots: torch.Tensor, key_positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks at ``positions [R, W]`` against context keys ``key_positions [T]`` of ``read_slots [R]``:
        ``(hidden [R, W−1, H], logits [R, W−1, V or Vd] float32)``."""
        num_keys = key_positions.shape[0]
        context = [
            (k[read_slots, :, :num_keys], v[read_slots, :, :num_keys]) for k, v in _caches(self, self.num_layers)
        ]
        return self.model.draft_block(anchor_ids, positions, key_positions, context, self.embed, self.head)


class CompiledContext(nn.Module):
    """:meth:`DFlashDrafter.write_context` of the :class:`CompiledDrafter`'s model (its layers and
    fusion layer) into the same cache buffer objects, so that a graph holding both modules sees
    each layer's cache once."""

    def __init__(self, drafter: CompiledDrafter) -> None:
        super().__init__()
        self.model = drafter.model
        self.num_layers = drafter.num_layers
        caches = _caches(drafter, drafter.num_layers)
        _register_caches(self, [k for k, _ in caches], [v for _, v in caches])

    def forward(self, features: torch.Tensor, write_slots: torch.Tensor, write_positions: torch.Tensor) -> torch.Tensor:
        """Write the context K/V of ``features [R, L, F·H]`` at ``(write_slots, write_positions) [R, L]``
        (padding goes to the scratch slot); returns the fused context ``[R, L, H]``."""
        return self.model.write_context(features, write_slots, write_positions, _caches(self, self.num_layers))


class CompiledSelector(nn.Module):
    """The drafted path's choice (:func:`dflash2.spec.selector.draft_path`) with the drafter's candidate
    count, draft vocabulary and selector tensors registered as buffers (the drafter keeps its own).
    Eagerly it is some 80 small operations per step, about 1.4 ms on 2 CPU cores for SmolLM2's
    drafter.

    Args:
        use_selector: walk the lattice (False: per-slot unary scores, as ``EngineConfig.use_selector``).
    """

    def __init__(self, drafter: DFlashDrafter, use_selector: bool) -> None:
        super().__init__()
        self.num_candidates = drafter.num_candidates
        self.draft_vocab: torch.Tensor
        self.predecessor_codebook: torch.Tensor
        self.successor_codebook: torch.Tensor
        self.hidden_projection: torch.Tensor
        # Only tensors are registered (a None buffer breaks a graph's guards when rows are dynamic).
        self.has_draft_vocab = drafter.draft_vocab is not None
        if drafter.draft_vocab is not None:
            self.register_buffer("draft_vocab", drafter.draft_vocab.detach(), persistent=False)
        weights = drafter.selector_weights() if use_selector else None
        self.use_lattice = weights is not None
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
        """:func:`~dflash2.spec.selector.draft_path` over S = ``num_slots`` slots (default J):
        ``(draft_ids [R, S], candidate_ids [R, S, k], draft_probs [R, S, k])``."""
        weights = None
        if self.use_lattice:
            weights = SelectorWeights(self.predecessor_codebook, self.successor_codebook, self.hidden_projection)
        vocab = self.draft_vocab if self.has_draft_vocab else None
        proposal = draft_path(
            hidden, logits, anchor_ids, temperatures, uniforms, self.num_candidates, vocab, weights, num_slots
        )
        return proposal.draft_ids, proposal.candidate_ids, proposal.draft_probs


class CompiledProposer(nn.Module):
    """A drafted step's whole proposal as one forward (CPU): the context append, the drafter's block
    and the selector's walk. All three are small, so one graph instead of three calls saves each
    call's fixed cost (about 0.5 ms on 2 cores for the first two).

    The walk is unrolled over the B − 1 slots of a full block whatever the width: top-k runs on the
    W − 1 drafted slots only, and the slots after them get zero scores, which the walk reaches only
    after every real slot (callers cut the outputs back to W − 1).
    """

    def __init__(
        self, context: CompiledContext, drafter: CompiledDrafter, selector: CompiledSelector, block_size: int
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
        """:class:`CompiledContext` on ``features … write_positions``, :class:`CompiledDrafter` on
        ``anchor_ids … key_positions``, then the path for ``temperatures [R]`` and ``uniforms [R, B − 1]``.

        Returns:
            ``(hidden [R, J, H], logits [R, J, V or Vd], draft_ids [R, B − 1], candidate_ids
            [R, B − 1, k], draft_probs [R, B − 1, k])``; slots from J on are padding.
        """
        self.context(features, write_slots, write_positions)
        hidden, logits = self.drafter(anchor_ids, positions, read_slots, key_positions)
        draft_ids, candidate_ids, draft_probs = self.selector(
            hidden, logits, anchor_ids, temperatures, uniforms, num_slots=self.num_slots
        )
        return hidden, logits, draft_ids, candidate_ids, draft_probs


# ---- building and warming up the graphs ----------------------------------------------------------


def build_modules(runner: GraphRunner) -> list[tuple[str, nn.Module]]:
    """The modules to compile for ``runner`` (built before its eager modules are pre-packed)."""
    modules: list[tuple[str, nn.Module]] = []
    if isinstance(runner.target, TargetModel):
        target = CompiledTarget(runner.target, runner.target_cache, runner.capture_layer_ids).eval()
        modules.append(("target", target))
        if runner.tree_nodes:  # the same module with a mask; CPU: one dynamic graph; CUDA: one per bucket
            modules.append(("tree", target))
    else:
        logger.info("the %s target runs eagerly (no static forward)", type(runner.target).__name__)
    drafter, cache = runner.drafter, runner.draft_cache
    if cache is not None and isinstance(drafter, DFlashDrafter) and drafter.supports_compile:
        own_layers = can_prepack(runner.device, runner.dtype)  # the eager drafter is packed in place
        compiled = CompiledDrafter(drafter, cache, own_layers)
        if runner.cuda:
            modules.append(("drafter", compiled.eval()))
        else:
            # Small and shaped by the step (context widths up to a prompt, any row count): CUDA graphs
            # would record one per shape, so on CUDA the context append and the selector stay eager.
            # On CPU one graph writes the context the rows committed since they last drafted, drafts
            # and chooses the path (one call per step instead of three).
            context = CompiledContext(compiled)
            selector = CompiledSelector(drafter, runner.spec.use_selector)
            modules.append(("drafter", CompiledProposer(context, compiled, selector, runner.block_size).eval()))
            modules.append(("context", context.eval()))
    if linear_backend(runner.device, runner.dtype) in PROJECT_KERNELS:
        # The project's bfloat16 kernels are custom ops that graphs call with the packed weight as an
        # input (oneDNN's packed weights cannot be graph inputs, so there the graphs keep dense ones).
        packed = sum(prepack_linears(module) for _, module in modules)
        logger.info("packed %d linear layers of the compiled forwards for the bfloat16 CPU kernel", packed)
    return modules


@dataclasses.dataclass
class CompiledForwards:
    """What one compilation built, for the runner to be built with (:meth:`ModelRunner.install`).

    Attributes:
        forwards: the compiled forwards by module name (``target``, ``tree``, ``drafter``, ``context``).
        times: seconds to build (or load) each graph, by graph label; sources: each graph's
            ``"compiled"`` or ``"loaded"`` (saved by an earlier start or another process).
        failures: the modules left eager, and why.
        seconds: wall time of the whole compilation.
    """

    forwards: dict[str, Callable[..., Any]]
    times: dict[str, float]
    sources: dict[str, str]
    failures: dict[str, str]
    seconds: float


def compile_modules(
    runner: GraphRunner, modules: list[tuple[str, nn.Module]], load_only: bool = False
) -> CompiledForwards:
    """Compile and warm up each module; on failure keep that forward eager with a warning.

    Args:
        load_only: (CPU) load the graphs another process saved and never compile one
            (:class:`~dflash2.runner.precompiled.PrecompiledForward`'s ``load_only``): a module without a
            saved graph that fits stays eager, with a warning.

    The runner's forwards run each graph once on its scratch slot (the warm-up); nothing of the runner
    changes here.

    Returns:
        The :class:`CompiledForwards`: forwards, each graph's build time and source, failures.
    """
    start = time.perf_counter()
    cuda = runner.cuda
    logger.info(
        "%s the %s forward%s for %s%s",
        "loading" if load_only else "compiling",
        " and ".join(name for name, _ in modules),
        "s" * (len(modules) > 1),
        "CUDA graphs" if cuda else "inductor",
        "" if load_only else " (minutes on a small CPU; --enforce-eager skips this)",
    )
    configure_compiler(runner.device, runner.spec.dynamic_threads)
    if cuda:  # one recorded graph per static shape: dynamo must not give up on them and run eagerly
        import torch._dynamo.config as dynamo_config

        graphs = cuda_graph_count(runner)
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, graphs)
        dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 4 * graphs)
    result = CompiledForwards({}, {}, {}, {}, 0.0)
    for name, module in modules:
        forward: Callable[..., Any]
        try:
            if cuda:  # graphs recorded and replayed, static shapes
                forward = torch.compile(module, dynamic=False, fullgraph=True, mode="reduce-overhead")
            else:
                # Inductor graphs saved for the next start, dispatched without dynamo (see
                # dflash2/runner/precompiled.py); only the dims marked in the calls are dynamic (rows, keys).
                forward = PrecompiledForward(
                    module,
                    name,
                    _SHAPE_CLASSES[name],
                    without_global_state_guard,
                    settings=f"slots={runner.num_slots} block={runner.block_size}",
                    load_only=load_only,
                )
            _warm_up(runner, name, forward, result)
        except Exception as error:
            verb = "loading" if load_only else "compiling"
            logger.warning("%s the %s failed, running it eagerly: %s", verb, name, short_error(error))
            result.failures[name] = short_error(error)
            continue
        result.forwards[name] = forward
    result.seconds = time.perf_counter() - start
    if result.times:
        loaded = sum(source == "loaded" for source in result.sources.values())
        logger.info(
            "%d graphs ready in %.1f s (%d compiled, %d loaded; cache: %s)",
            len(result.times),
            result.seconds,
            len(result.times) - loaded,
            loaded,
            os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        )
    return result


def cuda_graph_count(runner: GraphRunner) -> int:
    """The most CUDA graphs one compiled module of ``runner`` can record: row buckets × key-length buckets
    (powers of two from ``CUDA_MIN_KEYS`` up to the slot's positions) × widths (1 and the block for the
    target, every node bucket for the token-tree forward)."""
    keys, length = 1, CUDA_MIN_KEYS
    while length < runner.max_model_len:
        keys, length = keys + 1, length * 2
    widths = max(2, len(node_buckets(runner.max_tree_nodes)) if runner.tree_nodes else 0)
    return len(_row_buckets_cuda(runner)) * keys * widths


def _row_buckets_cuda(runner: GraphRunner) -> list[int]:
    last = bucket_rows(runner.num_slots, runner.num_slots)
    return [*(b for b in CUDA_ROW_BUCKETS if b < runner.num_slots), last]


def _row_buckets(runner: GraphRunner) -> list[int]:
    """Row counts to build graphs for: 1 and ≥ 2 on CPU; every bucket up to the slots on CUDA."""
    if runner.cuda:
        return _row_buckets_cuda(runner)
    return [1, 2] if runner.num_slots >= 2 else [1]


def _warm_up(runner: GraphRunner, name: str, forward: Callable[..., Any], result: CompiledForwards) -> None:
    """Build every graph now (rows on the scratch slot only), not in the middle of a request:
    per row bucket, the drafter's block and the selector, the target and the context append at
    width 1 and at the block width (on CPU one graph covers every width from 2 up), and the token-tree
    forward (on CUDA at every node bucket, :func:`~dflash2.runner.graph_inputs.node_buckets`)."""
    cuda, block_size, device, drafting = runner.cuda, runner.block_size, runner.device, runner.drafting
    widths = dict.fromkeys((1, block_size)) if name in ("target", "context") else {block_size: None}
    if name == "tree":  # nodes per row, the root included: every bucket with CUDA graphs
        widths = dict.fromkeys(node_buckets(runner.max_tree_nodes) if cuda else [runner.tree_nodes + 1])
    for num_rows in dict.fromkeys(_row_buckets(runner)):
        for width in widths:
            start = time.perf_counter()
            slots = [runner.scratch_slot] * num_rows
            for _ in range(2 if cuda else 1):  # CUDA graphs are recorded on a later call
                if name == "target":
                    runner.chain_call(slots, [TokenTree.chain([0] * width)] * num_rows, [0] * num_rows, forward)
                elif name == "tree":
                    tree = TokenTree([0] * width, [-1, *[0] * (width - 1)])  # the root and its children
                    runner.tree_call(slots, [tree] * num_rows, [0] * num_rows, forward)
                elif name == "context":
                    assert drafting is not None
                    dim = drafting.drafter.feature_dim
                    features = torch.zeros(num_rows, width, dim, dtype=runner.dtype, device=device)
                    drafting.context_call(slots, PendingWrites(features, [width] * num_rows, [0] * num_rows), forward)
                else:  # the drafter's block (on CPU with the context write and the walk)
                    assert drafting is not None
                    anchors = torch.zeros(num_rows, dtype=torch.long, device=device)
                    drafting.draft_call(slots, anchors, torch.ones_like(anchors), block_size, forward=forward)
            elapsed = time.perf_counter() - start
            rows_label = f"{num_rows}{'+' if num_rows > 1 and not cuda else ''}"
            width_label = f" width={'2+' if width > 1 and not cuda else width}" if len(widths) > 1 else ""
            if name == "tree" and cuda:
                width_label = f" nodes={width}"
            graph = f"{name} rows={rows_label}{width_label}"
            source = getattr(forward, "last_source", None) or "compiled"
            result.times[graph], result.sources[graph] = elapsed, source
            logger.info("%s %s graph for %s row(s)%s in %.1f s", source, name, rows_label, width_label, elapsed)


def short_error(error: BaseException) -> str:
    """``error`` as one log line of at most about 500 characters."""
    text = f"{type(error).__name__}: {error}"
    return text if len(text) < 500 else text[:500] + " …"
