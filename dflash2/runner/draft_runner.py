"""``DraftRunner``: the drafter, its context cache, and the drafting forwards of one step.

A drafted step writes the target features its rows committed since they last drafted as the
drafter's context, runs ONE drafter forward over each row's block ``[anchor, MASK × (W−1)]``, and
hands the block to the selector (``dflash2/spec/selector.py``) or, for a token tree, to the
lattice's log-probabilities (``dflash2/spec/tree.py``). On CPU, compiled, context write, block and
walk are one graph; with CUDA graphs the block runs at the full width; eagerly each is its own call.
:class:`~dflash2.runner.model_runner.ModelRunner` owns one of these when it has a drafter.

Dimension letters as in ``model_runner.py``: R rows, W the step's width, J = W − 1 drafted slots,
H hidden, V vocab (Vd a drafter's own vocabulary), F·H captured features, k candidates per slot.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dflash2.models.base import Drafter
from dflash2.models.kv_cache import KVCache
from dflash2.models.layers import batch_invariant_enabled
from dflash2.runner.graph_inputs import (
    PendingWrites,
    bucket_rows,
    compiled_mode,
    context_writes,
    draft_inputs,
    flat_context,
    graph_input,
    key_length,
    mark_dynamic,
)
from dflash2.runner.settings import RunnerSpec
from dflash2.spec.selector import Proposal, draft_path_of, lattice_scores, topk_candidates
from dflash2.spec.tree import path_log_probs


@dataclass(frozen=True)
class Drafted:
    """A drafted step's proposal and what it cost.

    Attributes:
        proposal: the drafted path over W − 1 slots, candidates as token ids.
        draft_seconds: the drafter's forward, with the context write, and with the selector where
            it runs in the same graph.
        select_seconds: the selector's own time (0 when it ran inside the drafting graph).
        select_in_draft: the selector ran inside the drafting graph (its time is in ``draft_seconds``).
    """

    proposal: Proposal
    draft_seconds: float
    select_seconds: float
    select_in_draft: bool = False


class DraftRunner:
    """The drafter with its context cache; runs a step's drafting.

    Args:
        drafter: the drafter bound to the target.
        cache: its context K/V (``num_slots + 1`` slots, one position more than a request uses).
        spec: the runner's settings (slots, block size, ``use_selector``).
        device, dtype: where the runner's rows live and the dtype its graphs were built for.

    Attributes:
        forward: the compiled drafting forward (set by the runner after compiling), or None.
        context_forward: the compiled context append, or None.
        sync_timing: wait for the device's queued kernels before each drafting phase ends (CUDA;
            nothing to wait for on CPU). Kernels run asynchronously, so without it a GPU's drafting
            time is counted by whatever synchronizes next (the verify). Off by default: it costs a
            synchronization per phase; the benchmark sets it.
    """

    def __init__(
        self, drafter: Drafter, cache: KVCache, spec: RunnerSpec, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.drafter, self.cache, self.spec, self.device, self.dtype = drafter, cache, spec, device, dtype
        self.forward: Callable[..., tuple[torch.Tensor, ...]] | None = None
        self.context_forward: Callable[..., torch.Tensor] | None = None
        self.sync_timing = False

    def install(
        self,
        forward: Callable[..., tuple[torch.Tensor, ...]] | None,
        context_forward: Callable[..., torch.Tensor] | None,
    ) -> None:
        """Run the drafting and context-append calls through these compiled forwards (None: eagerly)."""
        self.forward, self.context_forward = forward, context_forward

    @property
    def cuda(self) -> bool:
        """True on a CUDA device (graphs with static shapes)."""
        return self.device.type == "cuda"

    @property
    def selects_in_draft(self) -> bool:
        """The compiled drafting graph also writes the pending context and walks the path (CPU)."""
        return self.forward is not None and not self.cuda

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
        self.check_width(width)
        start = time.perf_counter()
        if self.selects_in_draft:
            _, _, *path = self.draft_call(slots, anchor_ids, starts, width, context, temperatures, uniforms)
            proposal = Proposal(*(t[:, : width - 1] for t in path))
            return Drafted(proposal, self.phase_end() - start, 0.0, select_in_draft=True)
        hidden, logits = self.draft_block(slots, anchor_ids, starts, width, context)
        drafted = self.phase_end()
        proposal = draft_path_of(
            self.drafter, hidden, logits, anchor_ids, temperatures, uniforms[:, : width - 1], self.spec.use_selector
        )
        return Drafted(proposal, drafted - start, self.phase_end() - drafted)

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
        start = time.perf_counter()
        hidden, logits = self.draft_block(slots, anchor_ids, starts, width, context)
        with torch.inference_mode():
            candidate_ids, unary = topk_candidates(logits, self.drafter.num_candidates)
            if self.drafter.draft_vocab is not None:
                candidate_ids = self.drafter.draft_vocab[candidate_ids]
            weights = self.drafter.selector_weights() if self.spec.use_selector else None
            lattice = lattice_scores(hidden, anchor_ids, candidate_ids, unary, weights) if weights is not None else None
            log_probs = path_log_probs(unary, lattice)
        return candidate_ids, log_probs, self.phase_end() - start

    def check_width(self, width: int) -> None:
        """Raise ``ValueError`` unless 2 ≤ ``width`` ≤ B."""
        if not 2 <= width <= self.spec.block_size:
            raise ValueError(f"draft width {width} outside 2 … {self.spec.block_size}")

    def phase_end(self) -> float:
        """``time.perf_counter()`` at the end of a phase, after the device's queued kernels when
        :attr:`sync_timing`."""
        if self.sync_timing and self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def draft_block(
        self,
        slots: list[int],
        anchor_ids: torch.Tensor,
        starts: torch.Tensor,
        width: int,
        context: PendingWrites | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's block for :meth:`propose`'s arguments, before the selector: ``(hidden
        [R, W−1, H], unary logits [R, W−1, V or Vd] float32)``."""
        self.check_width(width)
        if self.forward is not None:
            hidden, logits, *_ = self.draft_call(slots, anchor_ids, starts, width, context)
            return hidden[:, : width - 1], logits[:, : width - 1]
        if context is not None:
            self.append_context(slots, context.starts, context.features, context.lengths)
        if batch_invariant_enabled() and len(slots) > 1:
            # Deterministic mode: one row at a time, as the target's verify does. Batched, a row's block
            # keys follow the batch's longest context, so a shorter row attends over a gap of masked keys
            # and the product with V sums in another grouping than alone (seen with oneDNN on AMX).
            rows = [(slot, anchor_ids[r : r + 1], starts[r : r + 1]) for r, slot in enumerate(slots)]
            hidden = torch.cat([self.drafter.draft_hidden(self.cache, [s], a, t, width) for s, a, t in rows])
        else:
            hidden = self.drafter.draft_hidden(self.cache, slots, anchor_ids, starts, width)
        hidden = hidden[:, 1:]
        return hidden, self.drafter.logits(hidden)

    def draft_call(
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
        forward = self.forward if forward is None else forward
        assert forward is not None
        if self.cuda:
            if context is not None:
                self.append_context(slots, context.starts, context.features, context.lengths)
                context = None
            width = self.spec.block_size
        num_rows, device = len(slots), self.device
        padded_rows = bucket_rows(num_rows, self.spec.num_slots) if self.cuda else num_rows
        max_start = int(starts.max())
        with compiled_mode():  # fresh tensors: the engine's may be inference tensors
            inputs = draft_inputs(slots, anchor_ids, starts, width, padded_rows, self.spec.scratch_slot, device)
            keys = torch.arange(key_length(max(max_start, 1), self.spec.max_model_len, self.cuda), device=device)
            mark_dynamic(inputs, keys, [inputs[1]], static=self.cuda)
            if self.cuda:
                outputs = forward(*inputs, keys)
            else:
                # At least two context tokens per row (padding writes the scratch slot), so that one graph
                # per row class serves every step (a width of 1 would be a graph of its own).
                if context is None:
                    features = torch.zeros(num_rows, 2, self.drafter.feature_dim, dtype=self.dtype)
                    context = PendingWrites(features, [0] * num_rows, [0] * num_rows)
                writes = self.context_inputs(slots, context, min_width=2)
                mark_dynamic(writes, width_inputs=writes)
                if temperatures is None or uniforms is None:
                    temperatures, uniforms = torch.zeros(num_rows), torch.zeros(num_rows, self.spec.block_size - 1)
                sampling = [graph_input(temperatures.float()), graph_input(uniforms.float())]
                mark_dynamic(sampling)
                outputs = forward(*writes, *inputs, keys, *sampling)
        return tuple(t[:num_rows] for t in outputs)

    def append_context(
        self, slots: list[int], starts: Sequence[int], features: torch.Tensor, lengths: Sequence[int]
    ) -> None:
        """Write drafter context K/V for the first ``lengths[r]`` rows of ``features [R, L, F·H]``.

        Row r's tokens sit at positions ``starts[r] ..``; afterwards the slot's draft context
        covers every position whose target feature is known (docs/dflash2-spec.md §10, cache discipline).
        """
        if self.context_forward is not None:
            self.context_call(slots, PendingWrites(features, list(lengths), list(starts)))
        else:  # through the eager drafter (its linears pre-packed on CPU)
            flat = flat_context(slots, list(starts), features, list(lengths), self.device)
            self.drafter.append_context(self.cache, *flat)

    def context_inputs(self, slots: list[int], context: PendingWrites, min_width: int = 1) -> list[torch.Tensor]:
        """:func:`~dflash2.runner.graph_inputs.context_writes` as graph inputs, in the graphs' dtype."""
        features, *writes = context_writes(slots, context, self.dtype, self.spec.scratch_slot, min_width)
        return [graph_input(features), *(t.to(self.device) for t in writes)]

    def context_call(
        self, slots: list[int], context: PendingWrites, forward: Callable[..., torch.Tensor] | None = None
    ) -> None:
        """The drafter context write through the compiled context append (the caller rolls the slots
        forward)."""
        forward = self.context_forward if forward is None else forward
        assert forward is not None
        with compiled_mode():
            inputs = self.context_inputs(slots, context)
            mark_dynamic(inputs, width_inputs=inputs)  # compiled on CPU only
            forward(*inputs)
