"""``ModelRunner``: the target, the drafter, their KV caches, and the forwards of one step.

``ModelRunner`` runs prefill, verify (chains and token trees) and the K/V bookkeeping on tensors;
its :class:`~dflash2.runner.draft_runner.DraftRunner` runs the drafted proposal and the drafter's
context append, so ``Engine.step`` only schedules, accepts and commits. Decode-time forwards (verify,
the autoregressive step, the drafter's block; on CPU also the context append and the selector)
run compiled (``dflash2/runner/compile.py``) unless ``EngineConfig.enforce_eager``:

* **CPU**: ``torch.compile`` with inductor, the weights as graph inputs. Positions, slots and the
  key range are tensors, so one graph serves every batch size ≥ 2, another batch size 1, and
  every KV length (dynamic shapes); the attention reads only ``[0, T)`` of each slot, T rounded
  up (``dflash2/runner/graph_inputs.py``).
* **CUDA**: the same modules compiled with ``mode="reduce-overhead"`` (CUDA graphs), with rows and
  key lengths padded to buckets so the number of recorded graphs stays bounded.
* Anything else (the transformers fallback target, a drafter that overrides its forward, a
  failed compilation) runs eagerly, with pre-packed CPU bfloat16 linears where possible. The
  eager verify runs the compiled graphs' own model method (:meth:`TargetModel.forward_slots`).

Prefill stays eager: prompts have any length, and a prompt's forward is compute-bound.

Dimension letters: R rows, L query tokens per row, T key positions, H hidden, V vocab,
F·H captured features, W the step's verify width (≤ the block size B), J = W − 1 drafted slots.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from dflash2.models.base import Drafter
from dflash2.models.batch import ForwardBatch
from dflash2.models.cpu_kernels import AVX512_BF16
from dflash2.models.kv_cache import KVCache
from dflash2.models.layers import BACKEND_NAMES, invariant_kernel_available, linear_backend
from dflash2.models.llama import SUPPORTED_MODEL_TYPES, TargetModel
from dflash2.runner import compile as graphs
from dflash2.runner.costs import measure_costs
from dflash2.runner.draft_runner import DraftRunner
from dflash2.runner.graph_inputs import (
    bucket_nodes,
    bucket_rows,
    compiled_mode,
    key_length,
    layer_caches,
    mark_dynamic,
    read_slots_index,
    target_inputs,
    tree_inputs,
)
from dflash2.runner.settings import RunnerSpec
from dflash2.spec.tree import TokenTree

if TYPE_CHECKING:
    from dflash2.runner.tensor_parallel import TensorParallelGroup

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the target, the drafter and their caches; runs one step's forwards.

    The constructor compiles and warms up every graph (a log line each) unless ``enforce_eager`` or
    ``defer_compile``; a failed compilation logs a warning and leaves that forward eager (compiling on
    a thread while eager forwards serve starved the engine thread: ``docs/engine.md``; the server
    compiles in another process instead and loads the saved graphs between steps).

    Args:
        target: the loaded target.
        drafter: the drafter bound to it, or None (autoregressive decoding).
        spec: the runner's settings (:class:`~dflash2.runner.settings.RunnerSpec`).
        tensor_parallel: rank 0's :class:`~dflash2.runner.tensor_parallel.TensorParallelGroup` when ``target`` is its
            shard of a tensor-parallel target: the workers build their runners from the same ``spec``,
            every target forward is sent to them first, the K/V bookkeeping with the next forward
            (``dflash2/runner/tensor_parallel.py``). None: one process.

    Attributes:
        drafting: the drafter's side (:class:`~dflash2.runner.draft_runner.DraftRunner`: its context
            cache and the drafting forwards), or None without speculation.

    Raises:
        ValueError: ``deterministic`` where it cannot hold (see :func:`check_deterministic`).
    """

    def __init__(
        self,
        target: Any,
        drafter: Drafter | None,
        spec: RunnerSpec,
        tensor_parallel: TensorParallelGroup | None = None,
    ) -> None:
        self.target, self.drafter, self.spec = target, drafter, spec
        self.tensor_parallel = tensor_parallel
        embed_weight = target.embedding_weights()[0]
        self.device: torch.device = embed_weight.device
        self.dtype = embed_weight.dtype
        if spec.deterministic:
            check_deterministic(target, self.device, self.dtype)
            if not spec.enforce_eager:
                logger.info("deterministic mode: every forward runs eagerly (batch-invariant kernels)")
        speculative = drafter is not None and spec.block_size > 1
        self.capture_layer_ids = tuple(drafter.config.target_layer_ids) if speculative and drafter else ()
        # One position more than a request can use: a key range [0, T) is then never the whole
        # cache, so the compiled graphs do not specialise on that case.
        lazy = {} if spec.zeroed_caches else {"zeroed": False}
        slots, positions = spec.num_slots + 1, spec.max_model_len + 1
        self.target_cache = target.new_cache(slots, positions, **lazy)
        self.drafting: DraftRunner | None = None
        if speculative and drafter is not None:
            cache = drafter.new_cache(slots, positions, drafter.dtype, self.device, spec.zeroed_caches)
            self.drafting = DraftRunner(drafter, cache, spec, self.device, self.dtype)
        if tensor_parallel is not None:  # the workers build theirs alongside, compiling the same graphs
            tensor_parallel.start_runners(spec)
        self.compile_times: dict[str, float] = {}  # seconds to build each graph at start-up
        self.graph_sources: dict[str, str] = {}  # and whether it was "compiled" or "loaded" (saved before)
        self.compile_seconds: float | None = None  # wall time of the whole compilation
        self.compile_failures: dict[str, str] = {}  # modules left eager, and why
        modules = []
        if not spec.eager and self.device.type in ("cpu", "cuda"):
            try:
                modules = graphs.build_modules(self)
            except Exception as error:
                logger.warning("no static forwards, running eagerly: %s", graphs.short_error(error))
                self.compile_failures["all"] = graphs.short_error(error)
        self._prepack_eager()  # prefill, and any forward that does not compile, runs these
        self._target_forward: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        self._tree_forward: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        # Modules whose graphs another process compiles (defer_compile): loaded by load_deferred_graphs.
        self._deferred: list[tuple[str, torch.nn.Module]] = []
        if modules and spec.defer_compile and self.device.type == "cpu" and tensor_parallel is None:
            self._deferred = modules
        else:
            if modules:  # the warm-up runs the eager forwards' Nones above
                self.install(graphs.compile_modules(self, modules))
        if tensor_parallel is not None:
            tensor_parallel.wait_ready()

    def install(self, compiled: graphs.CompiledForwards) -> None:
        """Route the verify, token-tree, drafting and context-append calls to these compiled forwards
        (by module name; a missing one stays eager) and keep the compilation's record (graph times and
        sources, failures)."""
        forwards = compiled.forwards
        self._target_forward, self._tree_forward = forwards.get("target"), forwards.get("tree")
        if self.drafting is not None:
            self.drafting.install(forwards.get("drafter"), forwards.get("context"))
        self.compile_times.update(compiled.times)
        self.graph_sources.update(compiled.sources)
        self.compile_failures.update(compiled.failures)
        self.compile_seconds = compiled.seconds

    num_slots = property(lambda self: self.spec.num_slots, doc="KV slots for requests (the scratch slot not counted).")
    max_model_len = property(lambda self: self.spec.max_model_len, doc="Positions per slot.")
    block_size = property(lambda self: self.spec.block_size, doc="B, tokens per verify forward.")
    scratch_slot = property(lambda self: self.spec.scratch_slot, doc="The slot padding rows read and write.")
    tree_nodes = property(lambda self: self.spec.tree_nodes, doc="Drafted nodes of a full-block tree (0: chains).")

    @property
    def cuda(self) -> bool:
        """True on a CUDA device: compiled forwards are CUDA graphs with static shapes (bucketed rows, keys)."""
        return self.device.type == "cuda"

    @property
    def graphs_deferred(self) -> bool:
        """True while the compiled forwards wait for :meth:`load_deferred_graphs` (``defer_compile``)."""
        return bool(self._deferred)

    @property
    def deferred_settings(self) -> str:
        """What the deferred graphs are keyed by beyond the models: ``slots=… block=…``."""
        return f"slots={self.num_slots} block={self.block_size}"

    def load_deferred_graphs(self) -> dict[str, str]:
        """Load and warm up (on the scratch slot) the graphs another process compiled and saved for the
        deferred modules, and route the forwards to them; never compiles. Call between engine steps,
        never inside one: a forward's graph changes here. Live slots are not touched, so a request
        in flight goes on through the compiled forwards with its caches as they were.

        Returns:
            The modules left eager and why (``{}`` when every graph loaded); each also logs a warning.
        """
        modules, self._deferred = self._deferred, []
        if not modules:
            return dict(self.compile_failures)
        self.install(graphs.compile_modules(self, modules, load_only=True))
        return dict(self.compile_failures)

    @property
    def verify_widths(self) -> tuple[int, ...]:
        """Verify widths (tokens per row) a forward runs at without padding: every width from 1 to the
        block eagerly and compiled on CPU (one dynamic graph for widths ≥ 2); 1 and the block with
        CUDA graphs (other widths are padded to the block)."""
        if self._target_forward is not None and self.cuda:
            return tuple(dict.fromkeys((1, self.block_size)))
        return tuple(range(1, self.block_size + 1))

    @property
    def compiled(self) -> bool:
        """True when the verify / decode forward runs compiled."""
        return self._target_forward is not None

    @property
    def drafter_compiled(self) -> bool:
        """True when the drafter's block forward runs compiled (not through ``DFlashDrafter.draft_hidden``)."""
        return self.drafting is not None and self.drafting.forward is not None

    def _prepack_eager(self) -> None:
        """Pre-pack the eager modules' linear weights (CPU bfloat16 only). The compiled modules were
        built from the dense weights before; with oneDNN they keep them, with the bfloat16 CPU kernel
        they packed their own."""
        backend = linear_backend(self.device, self.dtype)
        if backend is None:
            return
        packed = self.target.prepack()
        if self.drafter is not None and self.draft_cache is not None:
            packed += self.drafter.prepack()
        if packed:
            logger.info("pre-packed %d linear layers for %s", packed, BACKEND_NAMES[backend])

    # ---- the target -------------------------------------------------------------------------------

    def prefill(
        self, slots: list[int], token_rows: list[list[int]], starts: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Eager forward over prompts: logits ``[R, 1, V]`` at each row's last token and the
        captured features ``[R, L, F·H]`` (None without a drafter)."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.run("prefill", slots, token_rows, starts)
        batch = ForwardBatch.build(slots, token_rows, starts, self.device)
        return self.target.run(batch, self.target_cache, self.capture_layer_ids, last_only=True)

    def verify(
        self, slots: list[int], trees: Sequence[TokenTree], starts: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ONE target forward over each row's proposal as a token tree (``dflash2/spec/tree.py``; a chain
        ``[anchor, drafts…]`` is a one-branch tree): node i at position ``start + depth(i)``, its K/V
        written at ``start + i`` (:meth:`commit` moves an accepted tree path into place), seeing the
        context and its ancestors. A batch of chains (rows may differ in length) takes the causal path:
        no mask, the narrowest compiled width; a batch with a branching tree passes the trees' ancestor
        masks (the project's own decoder only).

        Returns:
            logits ``[R, N, V]`` float32 (N = the largest tree; padding positions hold garbage) and
            features ``[R, N, F·H]`` or None.

        Raises:
            ValueError: a branching tree for a target the project does not decode itself (the
                transformers fallback).
        """
        chains = all(tree.is_chain for tree in trees)
        if not chains and not isinstance(self.target, TargetModel):
            raise ValueError(f"token trees need a target the project decodes itself, not {type(self.target).__name__}")
        if self.tensor_parallel is not None:
            self.tensor_parallel.run("verify", slots, list(trees), starts)
        width = max(len(tree) for tree in trees)
        if chains and self._target_forward is not None:
            logits, features = self.chain_call(slots, trees, starts)
        elif not chains and self._tree_forward is not None:
            logits, features = self.tree_call(slots, trees, starts)
        elif isinstance(self.target, TargetModel):
            # The compiled graphs' method, run eagerly (deterministic mode too: its attention skips the
            # masked keys past a row's own end, so the batch's longest key range changes no bits).
            if chains:
                rows = [tree.token_ids for tree in trees]
                inputs = target_inputs(slots, rows, starts, width, len(slots), self.scratch_slot)
                mask = None
            else:
                inputs = tree_inputs(slots, trees, starts, width, len(slots), self.scratch_slot)
                mask = inputs[5].to(self.device)
            input_ids, positions, write_slots, write_positions = (t.to(self.device) for t in inputs[:4])
            # The exact key range: the eager attention then reads what the ragged prefill reads.
            keys = torch.arange(max(s + len(tree) for s, tree in zip(starts, trees)), device=self.device)
            with torch.inference_mode():
                reads = (read_slots_index(slots, self.device), keys, layer_caches(self.target_cache))
                logits, features = self.target.forward_slots(
                    input_ids, positions, write_slots, write_positions, *reads, self.capture_layer_ids, mask
                )
        else:  # the transformers fallback
            rows = [tree.token_ids for tree in trees]
            batch = ForwardBatch.build(slots, rows, starts, self.device)
            return self.target.run(batch, self.target_cache, self.capture_layer_ids)
        return logits[:, :width], (features[:, :width] if self.capture_layer_ids else None)

    def chain_call(
        self,
        slots: list[int],
        chains: Sequence[TokenTree],
        starts: list[int],
        forward: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The compiled causal forward over chains, rows padded to the narrowest verify width that holds
        the longest row (and to a row bucket on CUDA); ``forward`` replaces the installed one (warm-up)."""
        forward = self._target_forward if forward is None else forward
        assert forward is not None
        with compiled_mode():  # inputs are built here too: a graph is guarded on its inputs' flags
            longest = max(len(chain) for chain in chains)
            num_rows, width = len(slots), min(w for w in self.verify_widths if w >= longest)
            padded_rows = bucket_rows(num_rows, self.num_slots) if self.cuda else num_rows
            token_rows = [chain.token_ids for chain in chains]
            inputs = [
                t.to(self.device)
                for t in target_inputs(slots, token_rows, starts, width, padded_rows, self.scratch_slot)
            ]
            max_end = max(s + len(chain) for s, chain in zip(starts, chains))
            keys = torch.arange(key_length(max_end, self.max_model_len, self.cuda), device=self.device)
            mark_dynamic(inputs, keys, inputs[:4], static=self.cuda)
            logits, features = forward(*inputs, keys)
        return logits[:num_rows], features[:num_rows]

    @property
    def max_tree_nodes(self) -> int:
        """The most nodes, the root included, of a token tree this runner verifies: the full block's node
        budget (``EngineSpec.tree_budget`` at the full block: never fewer than B − 1 drafts) and a
        prompt-lookup branch of up to B − 1 drafts beside it."""
        return max(self.tree_nodes, self.block_size - 1) + self.block_size

    def tree_call(
        self,
        slots: list[int],
        trees: Sequence[TokenTree],
        starts: list[int],
        forward: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The compiled tree-masked forward: on CPU one graph (rows, nodes and keys dynamic, at least two nodes
        per row); with CUDA graphs nodes are padded to a node bucket (:func:`bucket_nodes`), rows to a
        row bucket and keys to a power of two, one recorded graph per (rows, nodes, keys) bucket.
        Padding nodes and rows write the scratch slot and their outputs are cut away, as a narrower
        tree's padding is on CPU. ``forward`` replaces the installed one (warm-up)."""
        forward = self._tree_forward if forward is None else forward
        assert forward is not None
        with compiled_mode():
            num_rows, width = len(slots), max(2, *(len(tree) for tree in trees))
            padded_rows = num_rows
            if self.cuda:
                width, padded_rows = bucket_nodes(width, self.max_tree_nodes), bucket_rows(num_rows, self.num_slots)
            inputs = [
                t.to(self.device) for t in tree_inputs(slots, trees, starts, width, padded_rows, self.scratch_slot)
            ]
            max_end = max(s + len(tree) for s, tree in zip(starts, trees))
            keys = torch.arange(key_length(max_end, self.max_model_len, self.cuda), device=self.device)
            mark_dynamic(inputs, keys, [*inputs[:4], inputs[5]], static=self.cuda)
            if not self.cuda:
                torch._dynamo.maybe_mark_dynamic(inputs[5], 2)
            logits, features = forward(*inputs[:5], keys, inputs[5])
        return logits[:num_rows], features[:num_rows]

    def commit(self, slot: int, start: int, accepted_nodes: Sequence[int]) -> None:
        """Move the accepted path's target K/V (written at ``start + node``) to ``start + 1 …`` in order
        (nothing moves for a chain, whose node i is at depth i). Nodes ascend along a path, so no copy
        reads a position an earlier copy wrote. The slot's committed length is the engine's
        (``Request.num_cached``): the caches keep none."""
        if all(node == depth for depth, node in enumerate(accepted_nodes, start=1)):
            return
        if self.tensor_parallel is not None:
            self.tensor_parallel.defer("commit", slot, start, list(accepted_nodes))
        cache = self.target_cache
        for depth, node in enumerate(accepted_nodes, start=1):
            if node != depth:
                cache.k[:, slot, :, start + depth] = cache.k[:, slot, :, start + node]
                cache.v[:, slot, :, start + depth] = cache.v[:, slot, :, start + node]

    # ---- the drafter (dflash2/runner/draft_runner.py) ----------------------------------------------

    @property
    def draft_cache(self) -> KVCache | None:
        """The drafter's context cache, or None without speculation."""
        return self.drafting.cache if self.drafting is not None else None

    @property
    def sync_timing(self) -> bool:
        """Whether drafting phases wait for the device's queued kernels (:attr:`DraftRunner.sync_timing`)."""
        return self.drafting is not None and self.drafting.sync_timing

    @sync_timing.setter
    def sync_timing(self, value: bool) -> None:
        if self.drafting is not None:
            self.drafting.sync_timing = value

    # ---- slots ------------------------------------------------------------------------------------

    def measure_costs(
        self,
        row_counts: Sequence[int],
        widths: Sequence[int],
        repeats: int = 3,
        context: int = 0,
        interrupt: Callable[[], bool] | None = None,
    ) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], float]]:
        """The decode forwards' costs on the scratch slot (:func:`dflash2.runner.costs.measure_costs`)."""
        return measure_costs(self, row_counts, widths, repeats, context, interrupt)

    @property
    def supports_prefix_copy(self) -> bool:
        """True when the caches are contiguous per slot (``KVCache``), so a prefix can be copied."""
        return isinstance(self.target_cache, KVCache)

    def copy_prefix(self, source: int, dest: int, length: int) -> None:
        """Copy positions ``[0, length)`` of slot ``source`` into slot ``dest``: target K/V and drafter
        context (prefix caching). ``dest`` then holds ``length`` committed tokens."""
        if self.tensor_parallel is not None:  # the workers copy their target K/V (they hold no drafter)
            self.tensor_parallel.defer("copy_prefix", source, dest, length)
        for cache in (self.target_cache, self.draft_cache):
            if cache is not None:
                cache.k[:, dest, :, :length] = cache.k[:, source, :, :length]
                cache.v[:, dest, :, :length] = cache.v[:, source, :, :length]

    def free(self, slot: int) -> None:
        """Forget a slot in both caches."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.defer("free", slot)
        self.target_cache.free(slot)
        if self.draft_cache is not None:
            self.draft_cache.free(slot)


def check_deterministic(target: Any, device: torch.device, dtype: torch.dtype) -> None:
    """Raise ``ValueError`` unless batch-invariant forwards are available for this target, device
    and dtype: the project's own decoder (not the transformers fallback), in bfloat16 on a CPU where
    the project's AVX512-BF16 library builds (its ``invariant_attention`` op is the mode's attention;
    the linears run on the project's row-invariant kernels). Float32 matrix products go through MKL,
    whose summation order depends on the row count, so float32 is refused."""
    if device.type != "cpu":
        raise ValueError(f"--deterministic runs on CPU only for now, not on {device.type}")
    if dtype != torch.bfloat16:
        raise ValueError(
            "--deterministic needs --dtype bfloat16 on a CPU with AVX512-BF16 (or AMX); "
            f"this engine runs {str(dtype).removeprefix('torch.')}"
        )
    if not invariant_kernel_available():
        raise ValueError(
            "--deterministic needs --dtype bfloat16 on a CPU with AVX512-BF16 (or AMX) and a C++ compiler to build "
            "the project's kernels there; this CPU has neither, so bfloat16 runs on the project's AVX2 kernel "
            "(or PyTorch's generic code), which this mode does not support"
            if not AVX512_BF16.supported_cpu()
            else "--deterministic needs the project's AVX512-BF16 kernel library, which could not be built here "
            "(see the warning above; a C++ compiler is needed)"
        )
    if not isinstance(target, TargetModel):
        raise ValueError(
            f"--deterministic needs a target the project decodes itself ({', '.join(SUPPORTED_MODEL_TYPES)}), "
            f"not the {type(target).__name__} fallback"
        )
    if target.head_dim % 16 or target.head_dim > 256:
        raise ValueError(
            f"--deterministic's attention kernel takes head dims that are multiples of 16 up to 256, "
            f"not this target's {target.head_dim}"
        )
