"""The inputs of the runner's static-shape (graph) forwards over per-slot caches: slots, padding, key
lengths and the CUDA graphs' row and node buckets.

A padded forward writes its padding tokens' K/V into a spare *scratch slot* (one more than
``max_num_seqs``), so it never touches a live slot, and attends over keys ``[0, T)`` with T
rounded up (:func:`key_length`) so that one graph serves many key lengths.

Dimension letters: R rows, L tokens per row, T key positions, F·H captured features.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence

import torch

from dflash2.models.kv_cache import KVCache
from dflash2.spec.tree import TokenTree

# Key lengths are rounded up to a multiple of this (CPU), so attention reads little past the
# longest row while dynamic shapes keep one graph for all lengths.
KEY_ALIGN = 64
# CUDA graphs replay fixed shapes: rows are padded to one of these batch sizes (≤ max_num_seqs)
# and key lengths to a power of two of at least CUDA_MIN_KEYS.
CUDA_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CUDA_MIN_KEYS = 256
# A token-tree verify's nodes per row (the root included) are padded to one of these on CUDA, the
# largest tree the engine builds being the last bucket.
CUDA_NODE_BUCKETS = (8, 16, 32, 64, 128, 256)


@dataclasses.dataclass
class PendingWrites:
    """Drafter context to write for a batch of rows: the first ``lengths[r]`` of ``features [R, L, F·H]``
    at positions ``starts[r] ..`` (a row of length 0 writes nothing, whatever its start)."""

    features: torch.Tensor
    lengths: list[int]
    starts: list[int]


def bucket_rows(num_rows: int, max_rows: int) -> int:
    """The CUDA row bucket that holds ``num_rows`` rows (``max_rows`` past the last bucket)."""
    return next((b for b in CUDA_ROW_BUCKETS if b >= num_rows), max_rows)


def node_buckets(max_nodes: int) -> list[int]:
    """The CUDA node buckets of a runner whose largest token tree has ``max_nodes`` nodes (root included):
    each of :data:`CUDA_NODE_BUCKETS` below it, then ``max_nodes`` itself."""
    return [*(b for b in CUDA_NODE_BUCKETS if b < max_nodes), max_nodes]


def bucket_nodes(num_nodes: int, max_nodes: int) -> int:
    """The CUDA node bucket that holds a tree of ``num_nodes`` nodes (:func:`node_buckets`).

    Raises:
        ValueError: when ``num_nodes`` exceeds ``max_nodes``.
    """
    if num_nodes > max_nodes:
        raise ValueError(f"a token tree of {num_nodes} nodes is larger than the runner's {max_nodes}")
    return next(b for b in node_buckets(max_nodes) if b >= num_nodes)


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


def padded_writes(
    slots: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor, scratch_slot: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a padded forward writes K/V: ``positions [R, L]`` of ``slots [R]`` for each row's first
    ``lengths [R]`` tokens; padding goes into the scratch slot at its offset, never past the cache.

    Returns:
        ``(write_slots, write_positions)``, each ``[R, L]``.
    """
    offsets = torch.arange(positions.shape[1])[None]
    real = offsets < lengths[:, None]
    return torch.where(real, slots[:, None], scratch_slot), torch.where(real, positions, offsets)


def target_inputs(
    slots: list[int], token_rows: list[list[int]], starts: list[int], width: int, num_rows: int, scratch_slot: int
) -> list[torch.Tensor]:
    """``(input_ids, positions, write_slots, write_positions, read_slots)`` of a static-shape target
    forward (CPU tensors): each row padded to ``width`` tokens, and padding rows up to ``num_rows``,
    which read and write only the scratch slot."""
    extra = num_rows - len(slots)
    input_ids = torch.tensor([row + [0] * (width - len(row)) for row in token_rows] + [[0] * width] * extra)
    lengths = torch.tensor([len(row) for row in token_rows] + [0] * extra)
    read_slots = torch.tensor(slots + [scratch_slot] * extra)
    positions = torch.tensor(starts + [0] * extra)[:, None] + torch.arange(width)[None]
    write_slots, write_positions = padded_writes(read_slots, positions, lengths, scratch_slot)
    return [input_ids, positions, write_slots, write_positions, read_slots]


def tree_inputs(
    slots: list[int], trees: Sequence[TokenTree], starts: list[int], width: int, num_rows: int, scratch_slot: int
) -> list[torch.Tensor]:
    """``(input_ids, positions, write_slots, write_positions, read_slots, tree_mask)`` of a token-tree
    forward (CPU tensors, ``[R, N]`` and the mask ``[R, N, N]``): node i at start + its depth, written at
    start + i; nodes past a row's tree, and padding rows, write the scratch slot."""
    extra = num_rows - len(slots)
    input_ids = torch.tensor([t.token_ids + [0] * (width - len(t)) for t in trees] + [[0] * width] * extra)
    depths = torch.tensor([t.depths + list(range(len(t), width)) for t in trees] + [list(range(width))] * extra)
    lengths = torch.tensor([len(t) for t in trees] + [0] * extra)
    read_slots = torch.tensor(slots + [scratch_slot] * extra)
    first = torch.tensor(starts + [0] * extra)[:, None]
    write_slots, write_positions = padded_writes(read_slots, first + torch.arange(width)[None], lengths, scratch_slot)
    masks = [t.ancestor_mask(width) for t in trees] + [torch.eye(width, dtype=torch.bool)] * extra
    return [input_ids, first + depths, write_slots, write_positions, read_slots, torch.stack(masks)]


def layer_caches(cache: KVCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's ``(k, v)`` of ``cache``, views ``[slots, nkv, max_len, d]``."""
    return [(cache.k[i], cache.v[i]) for i in range(cache.k.shape[0])]


def read_slots_index(slots: list[int], device: torch.device) -> slice | torch.Tensor:
    """An index of ``slots`` into a cache's slot dimension for an eager forward: a slice (the read is
    a view, no copy) when they are consecutive and ascending, else a ``[R]`` tensor."""
    first = slots[0]
    if slots == list(range(first, first + len(slots))):
        return slice(first, first + len(slots))
    return torch.tensor(slots, device=device)


def context_writes(
    slots: list[int], context: PendingWrites, dtype: torch.dtype, scratch_slot: int, min_width: int = 1
) -> list[torch.Tensor]:
    """``(features [R, L, F·H] in dtype, write_slots [R, L], write_positions [R, L])`` of a static-shape
    context write (positions CPU tensors): rows padded to ``min_width`` tokens or more, each row's
    positions past its length written into the scratch slot, as a verify forward's padding is."""
    features = context.features.to(dtype)
    if features.shape[1] < min_width:
        features = torch.nn.functional.pad(features, (0, 0, 0, min_width - features.shape[1]))
    positions = torch.tensor(context.starts)[:, None] + torch.arange(features.shape[1])[None]
    writes = padded_writes(torch.tensor(slots), positions, torch.tensor(context.lengths), scratch_slot)
    return [features, *writes]


def draft_inputs(
    slots: list[int],
    anchor_ids: torch.Tensor,
    starts: torch.Tensor,
    width: int,
    num_rows: int,
    scratch_slot: int,
    device: torch.device,
) -> list[torch.Tensor]:
    """``(anchor_ids [R'], positions [R', W], read_slots [R'])`` of a static-shape drafting forward,
    fresh tensors on ``device``: rows padded to ``num_rows`` R' with rows that read the scratch
    slot at position 1."""
    real = len(slots)
    read_slots = torch.full((num_rows,), scratch_slot, dtype=torch.long, device=device)
    read_slots[:real] = torch.tensor(slots, dtype=torch.long, device=device)
    anchors = torch.zeros(num_rows, dtype=torch.long, device=device)
    anchors[:real] = anchor_ids.clone()
    start_tensor = torch.ones(num_rows, dtype=torch.long, device=device)
    start_tensor[:real] = starts.clone()
    positions = start_tensor[:, None] + torch.arange(width, device=device)[None]
    return [anchors, positions, read_slots]


def flat_context(
    slots: list[int], starts: list[int], features: torch.Tensor, lengths: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The real tokens of a context write, flattened: ``(slots [N], positions [N], features [N, F·H])``
    for the first ``lengths[r]`` of each row of ``features [R, L, F·H]`` at ``starts[r] ..``."""
    width = features.shape[1]
    offsets = torch.arange(width, device=device)[None]
    keep = offsets < torch.tensor(lengths, device=device)[:, None]  # [R, L]
    positions = torch.tensor(starts, device=device)[:, None] + offsets
    flat_slots = torch.tensor(slots, device=device)[:, None].expand(-1, width)[keep]
    return flat_slots, positions[keep], features[keep]


# ---- calling the compiled graphs ------------------------------------------------------------


def graph_input(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a compiled graph may take it on every call: contiguous, not an inference tensor (the
    engine's may be) — copied only then — and not a view (a view's guards read its base; ``detach``
    drops the base without a copy)."""
    if t.is_inference():
        return t.clone(memory_format=torch.contiguous_format)
    t = t.contiguous()
    return t.detach() if t._base is not None else t


@contextlib.contextmanager
def compiled_mode() -> Iterator[None]:
    """Compiled forwards run under ``no_grad`` outside inference mode: a graph traced once must see
    the same tensor flags on every call, and the weights, graph inputs, need no autograd."""
    with torch.inference_mode(False), torch.no_grad():
        yield


def mark_dynamic(
    row_inputs: Sequence[torch.Tensor],
    keys: torch.Tensor | None = None,
    width_inputs: Sequence[torch.Tensor] = (),
    static: bool = False,
) -> None:
    """CPU: one graph for every key length, one for every row count ≥ 2 (batch 1 has its own) and,
    for the target, the context append and the drafter's block, one for every width ≥ 2 (width 1,
    a plain decode step, has its own). Nothing when ``static`` (CUDA graphs have static shapes)."""
    if static:
        return
    if keys is not None:
        torch._dynamo.maybe_mark_dynamic(keys, 0)
    if row_inputs[0].shape[0] >= 2:
        for t in row_inputs:
            torch._dynamo.maybe_mark_dynamic(t, 0)
    for t in width_inputs:
        if t.dim() >= 2 and t.shape[1] >= 2:
            torch._dynamo.maybe_mark_dynamic(t, 1)
