"""``ModelRunner``: the target, the drafter, their KV caches, and the forwards of one step.

``ModelRunner`` runs prefill, verify, the drafted proposal and the drafter's context append on
tensors, so ``Engine.step`` only schedules, accepts and commits. Decode-time forwards (verify,
the autoregressive step, the drafter's block; on CPU also the context append and the selector)
run compiled (``dflash2/runner/compile.py``) unless ``EngineConfig.enforce_eager``:

* **CPU**: ``torch.compile`` with inductor, the weights as graph inputs. Positions, slots and the
  key range are tensors, so one graph serves every batch size ≥ 2, another batch size 1, and
  every KV length (dynamic shapes); the attention reads only ``[0, T)`` of each slot, T rounded
  up (``dflash2/runner/cache.py``).
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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash2.models.batch import ForwardBatch
from dflash2.models.drafter import DFlashDrafter
from dflash2.models.kv_cache import KVCache
from dflash2.models.layers import BACKEND_NAMES, batch_invariant_enabled, linear_backend, onednn_bf16
from dflash2.models.llama import SUPPORTED_MODEL_TYPES, TargetModel
from dflash2.runner import compile as graphs
from dflash2.runner.cache import (
    PendingWrites,
    bucket_rows,
    context_writes,
    draft_inputs,
    flat_context,
    key_length,
    layer_caches,
    read_slots_index,
    target_inputs,
    tree_inputs,
)
from dflash2.runner.compile import compiled_mode, graph_input, mark_dynamic
from dflash2.runner.costs import measure_costs
from dflash2.spec.selector import Proposal, drafter_path, lattice_scores, topk_candidates
from dflash2.spec.tree import TokenTree, path_log_probs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Drafted:
    """A drafted step's proposal and what it cost.

    Attributes:
        proposal: the drafted path over W − 1 slots, candidates as token ids.
        draft_seconds: the drafter's forward, with the context write, and with the selector where
            it runs in the same graph.
        select_seconds: the selector's own time; None when it ran inside the drafting graph.
    """

    proposal: Proposal
    draft_seconds: float
    select_seconds: float | None


class ModelRunner:
    """Owns the target, the drafter and their caches; runs one step's forwards.

    The constructor compiles and warms up every graph (a log line each) unless ``enforce_eager``;
    a failed compilation logs a warning and leaves that forward eager (compiling on a thread while
    eager forwards serve starved the engine thread: ``docs/engine.md``).

    Args:
        target: the loaded target.
        drafter: the drafter bound to it, or None (autoregressive decoding).
        num_slots: KV slots (``max_num_seqs``); one scratch slot is added for padding.
        max_model_len: positions per slot.
        block_size: tokens per verify forward (1 = autoregressive).
        enforce_eager: never compile.
        deterministic: the engine runs its steps batch-invariant
            (:func:`dflash2.models.layers.batch_invariant`); forwards then run eagerly, because the
            compiled graphs fuse and reorder the very reductions that mode fixes.
        dynamic_threads: the engine changes torch's CPU thread count while it runs
            (``dflash2/threads.py``): compiled kernels then read the count when they run.
        use_selector: the drafted path walks the DFlash 2 lattice (``EngineConfig.use_selector``).
        tree_nodes: drafted nodes of a token tree (``EngineConfig.speculative_num_draft_tokens``) when
            steps verify trees (``speculative_topk`` > 1), else 0; builds the tree verify graph.

    Attributes:
        sync_timing: wait for the device's queued kernels before each phase of :meth:`propose`
            ends (CUDA; nothing to wait for on CPU). Kernels run asynchronously, so without it a
            GPU's drafting and selection time is counted by whatever synchronizes next (the
            verify). Off by default: it costs a synchronization per phase; the benchmark sets it.

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
        tree_nodes: int = 0,
    ) -> None:
        self.target, self.drafter = target, drafter
        self.tree_nodes = tree_nodes
        self.use_selector = use_selector
        self.dynamic_threads = dynamic_threads
        self.sync_timing = False
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
        self.compile_times: dict[str, float] = {}  # seconds to build each graph at start-up
        self.graph_sources: dict[str, str] = {}  # and whether it was "compiled" or "loaded" (saved before)
        self.compile_seconds: float | None = None  # wall time of the whole compilation
        modules = []
        if not enforce_eager and self.device.type in ("cpu", "cuda"):
            try:
                modules = graphs.build_modules(self)
            except Exception as error:
                logger.warning("no static forwards, running eagerly: %s", graphs.short_error(error))
        self._prepack_eager()  # prefill, and any forward that does not compile, runs these
        self._target_forward: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        self._draft_forward: Callable[..., tuple[torch.Tensor, ...]] | None = None
        self._context_forward: Callable[..., torch.Tensor] | None = None
        self._tree_forward: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        forwards = graphs.compile_modules(self, modules) if modules else {}
        self._target_forward, self._draft_forward = forwards.get("target"), forwards.get("drafter")
        self._context_forward, self._tree_forward = forwards.get("context"), forwards.get("tree")

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

    @property
    def _selects_in_draft(self) -> bool:
        """The compiled drafting graph also writes the pending context and walks the path (CPU)."""
        return self._draft_forward is not None and not self._cuda

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
        width = max(len(row) for row in token_rows)
        if batch_invariant_enabled() and len(slots) > 1:
            # Deterministic mode: one row at a time. Batched, a row's logits were seen to differ from
            # the same row's alone (oneDNN on AMX; the kernels and the attention each pass their own
            # invariance tests, the cause in between was not found): slower, but exact.
            alone = [self.verify([slot], [row], [start]) for slot, row, start in zip(slots, token_rows, starts)]
            logits = torch.cat([_pad_positions(lg, width) for lg, _ in alone])
            features = None
            if self.capture_layer_ids:
                features = torch.cat([_pad_positions(f, width) for _, f in alone if f is not None])
            return logits, features
        if self._target_forward is not None:
            logits, features = self._target_call(slots, token_rows, starts)
        elif isinstance(self.target, TargetModel) and not batch_invariant_enabled():
            # The compiled graphs' method, run eagerly. Not in deterministic mode: its key range is the
            # batch's longest, and a product over padded keys sums in another order than the same row's
            # alone (seen with oneDNN on AMX); the ragged forward below reads each row's own keys.
            rows = target_inputs(slots, token_rows, starts, width, len(slots), self.scratch_slot)
            input_ids, positions, write_slots, write_positions = (t.to(self.device) for t in rows[:4])
            # The exact key range: the eager attention then reads what the ragged prefill reads.
            keys = torch.arange(max(s + len(row) for s, row in zip(starts, token_rows)), device=self.device)
            with torch.inference_mode():
                reads = (read_slots_index(slots, self.device), keys, layer_caches(self.target_cache))
                logits, features = self.target.forward_slots(
                    input_ids, positions, write_slots, write_positions, *reads, self.capture_layer_ids
                )
        else:  # the transformers fallback, and batch-invariant steps
            batch = ForwardBatch.build(slots, token_rows, starts, self.device)
            return self.target.run(batch, self.target_cache, self.capture_layer_ids)
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
        with compiled_mode():  # inputs are built here too: a graph is guarded on its inputs' flags
            longest = max(len(row) for row in token_rows)
            num_rows, width = len(slots), min(w for w in self.verify_widths if w >= longest)
            padded_rows = bucket_rows(num_rows, self.num_slots) if self._cuda else num_rows
            inputs = [
                t.to(self.device)
                for t in target_inputs(slots, token_rows, starts, width, padded_rows, self.scratch_slot)
            ]
            max_end = max(s + len(row) for s, row in zip(starts, token_rows))
            keys = torch.arange(key_length(max_end, self.max_model_len, self._cuda), device=self.device)
            self._mark_dynamic(inputs, keys, width_inputs=inputs[:4])
            logits, features = forward(*inputs, keys)
        return logits[:num_rows], features[:num_rows]

    def verify_tree(
        self, slots: list[int], trees: Sequence[TokenTree], starts: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ONE target forward over each row's token tree (``dflash2/spec/tree.py``): node i at position
        ``start + depth(i)``, its K/V written at ``start + i`` (:meth:`commit_tree` moves the accepted
        path into place), seeing the context and its ancestors.

        Returns:
            logits ``[R, N, V]`` float32 (N = the largest tree; padding nodes hold garbage) and features
            ``[R, N, F·H]`` or None.

        Raises:
            ValueError: for a target the project does not decode itself (the transformers fallback).
        """
        if not isinstance(self.target, TargetModel):
            raise ValueError(f"token trees need a target the project decodes itself, not {type(self.target).__name__}")
        width = max(len(tree) for tree in trees)
        if self._tree_forward is not None:
            logits, features = self._tree_call(slots, trees, starts)
        else:
            inputs = [
                t.to(self.device) for t in tree_inputs(slots, trees, starts, width, len(slots), self.scratch_slot)
            ]
            keys = torch.arange(max(s + len(tree) for s, tree in zip(starts, trees)), device=self.device)
            input_ids, positions, write_slots, write_positions = inputs[:4]
            with torch.inference_mode():
                logits, features = self.target.forward_slots(
                    input_ids,
                    positions,
                    write_slots,
                    write_positions,
                    read_slots_index(slots, self.device),
                    keys,
                    layer_caches(self.target_cache),
                    self.capture_layer_ids,
                    inputs[5],
                )
        return logits[:, :width], (features[:, :width] if self.capture_layer_ids else None)

    def _tree_call(
        self,
        slots: list[int],
        trees: Sequence[TokenTree],
        starts: list[int],
        forward: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The compiled tree forward (CPU; rows and width dynamic, at least two nodes per row)."""
        forward = self._tree_forward if forward is None else forward
        assert forward is not None
        with compiled_mode():
            width = max(2, *(len(tree) for tree in trees))
            inputs = [
                t.to(self.device) for t in tree_inputs(slots, trees, starts, width, len(slots), self.scratch_slot)
            ]
            max_end = max(s + len(tree) for s, tree in zip(starts, trees))
            keys = torch.arange(key_length(max_end, self.max_model_len, False), device=self.device)
            self._mark_dynamic(inputs, keys, width_inputs=[*inputs[:4], inputs[5]])
            torch._dynamo.maybe_mark_dynamic(inputs[5], 2)
            return forward(*inputs, keys)

    def commit_tree(self, slot: int, start: int, accepted_nodes: Sequence[int]) -> None:
        """Move the accepted path's target K/V (written at ``start + node``) to ``start + 1 …`` in order;
        the caller rolls the slot back to its committed length. Nodes ascend along a path, so no copy
        reads a position an earlier copy wrote."""
        cache = self.target_cache
        for depth, node in enumerate(accepted_nodes, start=1):
            if node != depth:
                cache.k[:, slot, :, start + depth] = cache.k[:, slot, :, start + node]
                cache.v[:, slot, :, start + depth] = cache.v[:, slot, :, start + node]

    def _mark_dynamic(
        self,
        row_inputs: Sequence[torch.Tensor],
        keys: torch.Tensor | None = None,
        width_inputs: Sequence[torch.Tensor] = (),
    ) -> None:
        if not self._cuda:  # CUDA graphs have static shapes
            mark_dynamic(row_inputs, keys, width_inputs)

    # ---- the drafter ------------------------------------------------------------------------------

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
        """A drafted step's proposal: the drafter context ``context`` holds for these rows is written,
        ONE drafter forward runs over every row's block ``[anchor, MASK × (W−1)]``, then the selector
        chooses each row's path (top-k candidates, the DFlash 2 lattice unless ``use_selector`` is
        off, the walk). On CPU, compiled, all three are one graph; with CUDA graphs the drafter runs
        the full block (fixed shapes) and its first W − 1 slots are used; eagerly each is its own call.

        The drafter runs only the W tokens the step verifies, so a narrow step (adaptive speculation)
        pays for a narrow draft; its block attention is bidirectional, so these are not the first
        W − 1 drafts of a B-token block (``docs/engine.md``). Verification is lossless either way.

        Args:
            slots: the rows' cache slots (R); anchor_ids: ``[R]``; starts: ``[R]`` int64, each
                anchor's position (= its context length, counting ``context``'s tokens).
            temperatures: ``[R]`` float32 (≤ 1e-5 walks greedily); uniforms: ``[R, B − 1]`` in
                [0, 1) (the first W − 1 are used).
            width: W, 2 … B.
            context: target features still to be written as these rows' drafter context
                (:meth:`append_context`'s arguments, one entry per row, length 0 for none), or None.

        Returns:
            The :class:`Drafted` proposal over W − 1 slots and its phase times (:attr:`sync_timing`).

        Raises:
            ValueError: when ``width`` is outside 2 … B.
        """
        assert self.drafter is not None
        self._check_width(width)
        start = time.perf_counter()
        if self._selects_in_draft:
            _, _, *path = self._draft_call(slots, anchor_ids, starts, width, context, temperatures, uniforms)
            proposal = Proposal(*(t[:, : width - 1] for t in path))
            return Drafted(proposal, self._phase_end() - start, None)
        hidden, logits = self._draft_block(slots, anchor_ids, starts, width, context)
        drafted = self._phase_end()
        proposal = drafter_path(
            self.drafter, hidden, logits, anchor_ids, temperatures, uniforms[:, : width - 1], self.use_selector
        )
        return Drafted(proposal, drafted - start, self._phase_end() - drafted)

    def draft_lattice(
        self,
        slots: list[int],
        anchor_ids: torch.Tensor,
        starts: torch.Tensor,
        width: int,
        context: PendingWrites | None,
    ) -> tuple[torch.Tensor, torch.Tensor, float]:
        """A tree step's drafting: the drafter's block as :meth:`propose` runs it, then each slot's top-k
        candidates and their draft log-probabilities given the candidate before (the DFlash 2 lattice
        unless ``use_selector`` is off; :func:`dflash2.spec.tree.path_log_probs`).

        Returns:
            ``(candidate_ids [R, W−1, k] token ids, log_probs [R, W−1, k, k] float32, seconds)``.
        """
        assert self.drafter is not None
        start = time.perf_counter()
        hidden, logits = self._draft_block(slots, anchor_ids, starts, width, context)
        with torch.inference_mode():
            candidate_ids, unary = topk_candidates(logits, self.drafter.num_candidates)
            if self.drafter.draft_vocab is not None:
                candidate_ids = self.drafter.draft_vocab[candidate_ids]
            weights = self.drafter.selector_weights() if self.use_selector else None
            lattice = lattice_scores(hidden, anchor_ids, candidate_ids, unary, weights) if weights is not None else None
            log_probs = path_log_probs(unary, lattice)
        return candidate_ids, log_probs, self._phase_end() - start

    def _check_width(self, width: int) -> None:
        if not 2 <= width <= self.block_size:
            raise ValueError(f"draft width {width} outside 2 … {self.block_size}")

    def _phase_end(self) -> float:
        """``time.perf_counter()`` at the end of a phase, after the device's queued kernels when
        :attr:`sync_timing`."""
        if self.sync_timing and self._cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _draft_block(
        self,
        slots: list[int],
        anchor_ids: torch.Tensor,
        starts: torch.Tensor,
        width: int,
        context: PendingWrites | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's block for :meth:`propose`'s arguments, before the selector: ``(hidden
        [R, W−1, H], unary logits [R, W−1, V or Vd] float32)``."""
        assert self.drafter is not None and self.draft_cache is not None
        self._check_width(width)
        if self._draft_forward is not None:
            hidden, logits, *_ = self._draft_call(slots, anchor_ids, starts, width, context)
            return hidden[:, : width - 1], logits[:, : width - 1]
        if context is not None:
            self.append_context(slots, context.starts, context.features, context.lengths)
        if batch_invariant_enabled() and len(slots) > 1:
            # Deterministic mode: one row at a time, as :meth:`verify` does. Batched, a row's block keys
            # follow the batch's longest context, so a shorter row attends over a gap of masked keys and
            # the product with V sums in another grouping than alone (seen with oneDNN on AMX).
            rows = [(slot, anchor_ids[r : r + 1], starts[r : r + 1]) for r, slot in enumerate(slots)]
            hidden = torch.cat([self.drafter.draft_hidden(self.draft_cache, [s], a, t, width) for s, a, t in rows])
        else:
            hidden = self.drafter.draft_hidden(self.draft_cache, slots, anchor_ids, starts, width)
        hidden = hidden[:, 1:]
        return hidden, self.drafter.logits(hidden)

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
        CPU (:class:`~dflash2.runner.compile.CompiledProposer`; greedy walks without
        ``temperatures``), rows cut back to R."""
        forward = self._draft_forward if forward is None else forward
        assert forward is not None and self.draft_cache is not None and self.drafter is not None
        if self._cuda:
            if context is not None:
                self.append_context(slots, context.starts, context.features, context.lengths)
                context = None
            width = self.block_size
        num_rows, device = len(slots), self.device
        padded_rows = bucket_rows(num_rows, self.num_slots) if self._cuda else num_rows
        max_start = int(starts.max())
        with compiled_mode():  # fresh tensors: the engine's may be inference tensors
            inputs = draft_inputs(slots, anchor_ids, starts, width, padded_rows, self.scratch_slot, device)
            keys = torch.arange(key_length(max(max_start, 1), self.max_model_len, self._cuda), device=device)
            self._mark_dynamic(inputs, keys, width_inputs=[inputs[1]])
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
                sampling = [graph_input(temperatures.float()), graph_input(uniforms.float())]
                self._mark_dynamic(sampling)
                outputs = forward(*writes, *inputs, keys, *sampling)
        if context is not None:
            self._roll_context(slots, context.starts, context.lengths)
        return tuple(t[:num_rows] for t in outputs)

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
        else:  # through the eager drafter (its linears pre-packed on CPU)
            flat = flat_context(slots, list(starts), features, list(lengths), self.device)
            self.drafter.append_context(self.draft_cache, *flat)
        self._roll_context(slots, starts, lengths)

    def _roll_context(self, slots: list[int], starts: Sequence[int], lengths: Sequence[int]) -> None:
        """Each slot's drafter context now ends after its written tokens (rows with none unchanged)."""
        assert self.draft_cache is not None
        for slot, start, n in zip(slots, starts, lengths):
            if n:
                self.draft_cache.rollback(slot, start + n)

    def _context_inputs(self, slots: list[int], context: PendingWrites, min_width: int = 1) -> list[torch.Tensor]:
        """:func:`~dflash2.runner.cache.context_writes` as graph inputs, in the dtype the graphs were built for."""
        features, *writes = context_writes(slots, context, self.dtype, self.scratch_slot, min_width)
        return [graph_input(features), *(t.to(self.device) for t in writes)]

    def _context_call(
        self, slots: list[int], context: PendingWrites, forward: Callable[..., torch.Tensor] | None = None
    ) -> None:
        """The drafter context write through the compiled context append (the caller rolls the slots
        forward)."""
        forward = self._context_forward if forward is None else forward
        assert forward is not None
        with compiled_mode():
            inputs = self._context_inputs(slots, context)
            self._mark_dynamic(inputs, width_inputs=inputs)
            forward(*inputs)

    # ---- slots ------------------------------------------------------------------------------------

    def measure_costs(
        self, row_counts: Sequence[int], widths: Sequence[int], repeats: int = 3, context: int = 0
    ) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], float]]:
        """The decode forwards' costs on the scratch slot (:func:`dflash2.runner.costs.measure_costs`)."""
        return measure_costs(self, row_counts, widths, repeats, context)

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


def _pad_positions(values: torch.Tensor, width: int) -> torch.Tensor:
    """``values [1, L, D]`` padded with zeros to ``[1, width, D]``."""
    return torch.nn.functional.pad(values, (0, 0, 0, width - values.shape[1]))


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
