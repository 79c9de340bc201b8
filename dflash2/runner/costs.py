"""Timing the runner's decode forwards at start-up, for the adaptive policy's cost table."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from dflash2.runner.compile import GraphRunner
from dflash2.spec.tree import TokenTree, build_trees


class TimedRunner(GraphRunner, Protocol):
    """What the timings call on the runner: what the graphs' warm-up reads, and ``verify``
    (:class:`~dflash2.runner.ModelRunner` is one; naming this instead keeps the runner's module, which
    calls the timings, out of this one's imports)."""

    def verify(
        self, slots: list[int], trees: Sequence[TokenTree], starts: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


class TimingInterrupted(Exception):
    """The ``interrupt`` callback of a timing said to stop (work arrived)."""


def measure_costs(
    runner: TimedRunner,
    row_counts: Sequence[int],
    widths: Sequence[int],
    repeats: int = 3,
    context: int = 0,
    interrupt: Callable[[], bool] | None = None,
) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], float]]:
    """Time the decode forwards on the scratch slot: the target at each (rows, width) and, with a
    drafter, a greedy step's proposal at each (rows, width ≥ 2) — its block and the choice of the
    drafted path, :meth:`DraftRunner.propose` — (median of ``repeats`` after one warm-up call). Every
    row sits after ``context`` tokens (clamped to the slot), so attention reads as many keys as a
    request that far in would.

    The calls are interleaved: each round times every (rows, width) once, so a stretch of load
    from another process slows one sample of many shapes rather than every sample of one (a
    table whose widths were timed one after another under such load verified 5–8 tokens per step
    where 4 paid most, for good: live steps rescale every drafted width by one factor).

    Returns:
        ``({(rows, width): verify seconds}, {(rows, width): draft seconds})`` (the second empty
        without a drafter).

    Raises:
        TimingInterrupted: when ``interrupt()``, asked before each call, returns True.
    """
    calls: dict[tuple[str, int, int], Callable[[], object]] = {}
    context = max(0, min(context, runner.max_model_len - max(widths, default=1)))
    device = runner.device
    for rows in row_counts:
        slots, starts = [runner.scratch_slot] * rows, [context] * rows
        for width in widths:
            calls[("verify", rows, width)] = functools.partial(
                runner.verify, slots, [TokenTree.chain([0] * width)] * rows, starts
            )
        if runner.drafting is None:
            continue
        anchors = torch.zeros(rows, dtype=torch.long, device=device)
        lengths = torch.full_like(anchors, max(context, 1))
        temperatures = torch.zeros(rows, device=device)
        uniforms = torch.zeros(rows, runner.block_size - 1, device=device)
        for width in (w for w in widths if w > 1):
            calls[("draft", rows, width)] = functools.partial(
                runner.drafting.propose, slots, anchors, lengths, temperatures, uniforms, width, None
            )
    return _timed(calls, repeats, interrupt)


def measure_tree_costs(
    runner: TimedRunner,
    row_counts: Sequence[int],
    nodes: dict[int, int],
    topk: int,
    context: int = 0,
    repeats: int = 3,
    interrupt: Callable[[], bool] | None = None,
) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], float]]:
    """Time a token-tree step's parts as :func:`measure_costs` times a chain's: at each (rows, width W)
    the drafting (:meth:`DraftRunner.draft_lattice`: the block, top-k and the lattice's log-probabilities)
    and the verify (the beam's tree of ``nodes[W]`` drafted nodes, :func:`dflash2.spec.tree.build_trees`,
    and ONE tree-masked forward, :meth:`ModelRunner.verify`).

    Args:
        nodes: drafted nodes per row by width (``EngineSpec.tree_budget``); topk: the beam's branching.

    Returns:
        ``({(rows, width): verify seconds}, {(rows, width): draft seconds})``; empty without a drafter.
    """
    drafting = runner.drafting
    if drafting is None:
        return {}, {}
    calls: dict[tuple[str, int, int], Callable[[], object]] = {}
    context = max(0, min(context, runner.max_model_len - max(nodes.values(), default=1) - 1))
    for rows in row_counts:
        slots, starts = [runner.scratch_slot] * rows, [context] * rows
        anchors = torch.zeros(rows, dtype=torch.long, device=runner.device)
        lengths = torch.full_like(anchors, max(context, 1))
        for width, count in nodes.items():
            draft = functools.partial(drafting.draft_lattice, slots, anchors, lengths, width, None)
            with torch.inference_mode():
                candidate_ids, log_probs, _ = draft()

            calls[("draft", rows, width)] = draft
            calls[("verify", rows, width)] = functools.partial(
                _verify_trees, runner, slots, starts, candidate_ids, log_probs, topk, count, width - 1
            )
    return _timed(calls, repeats, interrupt)


def _verify_trees(
    runner: TimedRunner,
    slots: list[int],
    starts: list[int],
    candidate_ids: torch.Tensor,
    log_probs: torch.Tensor,
    topk: int,
    num_nodes: int,
    depth: int,
) -> None:
    """A tree step's verify part: the beam's trees from a drafted lattice, then the tree-masked forward."""
    trees = build_trees(
        candidate_ids, log_probs, [0] * len(slots), topk, [num_nodes] * len(slots), [depth] * len(slots)
    )
    runner.verify(slots, trees, starts)


def _timed(
    calls: dict[tuple[str, int, int], Callable[[], object]],
    repeats: int,
    interrupt: Callable[[], bool] | None = None,
) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], float]]:
    """Median seconds of each call after one warm-up round, the calls interleaved round by round;
    split into the ``verify`` and ``draft`` tables by (rows, width). Raises ``TimingInterrupted`` when
    ``interrupt()`` turns True before a call."""
    samples: dict[tuple[str, int, int], list[float]] = {key: [] for key in calls}
    with torch.inference_mode():
        for call in calls.values():  # warm-up
            if interrupt is not None and interrupt():
                raise TimingInterrupted
            call()
        for _ in range(repeats):
            for key, call in calls.items():
                if interrupt is not None and interrupt():
                    raise TimingInterrupted
                start = time.perf_counter()
                call()
                samples[key].append(time.perf_counter() - start)
    medians = {key: sorted(times)[len(times) // 2] for key, times in samples.items()}
    verify = {(rows, width): t for (kind, rows, width), t in medians.items() if kind == "verify"}
    draft = {(rows, width): t for (kind, rows, width), t in medians.items() if kind == "draft"}
    return verify, draft
