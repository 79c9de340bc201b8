"""A decode step's plan and its verdict: what the policy decided before any forward (:class:`Plan`) and
what the target decided (:class:`Verified`), the one record the commit phase and the policy's learning
read. Every proposal is verified as a token tree per row (``dflash2/spec/tree.py``): a chain of drafts is
a one-branch tree.

Dimension letters: R rows, N nodes per tree (the anchor first), L = accepted drafts + 1, V vocab,
F·H captured target features.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from dflash2.engine.prefix_cache import common_prefix_length
from dflash2.spec.selector import Proposal
from dflash2.spec.tree import TokenTree


class DraftSource(enum.Enum):
    """Where a step's drafts come from."""

    DRAFTER = "drafter"  # one drafter forward over the rows' blocks, then the selector's walk
    LOOKUP = "lookup"  # copied from each row's own earlier tokens (no drafter forward)
    SUFFIX = "suffix"  # copied from earlier requests' outputs (no drafter forward; dflash2/spec/suffix.py)
    GRAMMAR = "grammar"  # forced by the row's grammar (dflash2.grammar.walk_drafts)
    NONE = "none"  # an autoregressive step (block size 1, or the policy chose width 1)


@dataclass(frozen=True)
class Plan:
    """One decode step's speculation, decided before any forward.

    Attributes:
        source: where the drafts come from: the drafter, none, or LOOKUP for a step without a drafter
            forward whose rows verify free drafts (prompt lookup, earlier outputs, grammar-forced tokens;
            ``row_sources`` says which per row).
        width: W, tokens per row of the drafted block (anchor included; the drafter's block width).
        num_drafts: per row, the drafts it verifies (≤ W − 1; fewer near ``max_tokens`` or the slot's end).
        predicted_tokens: tokens the adaptive policy expects the rows to commit (0 without the policy).
        lookup: the prompt-lookup proposal (one-hot on the copied tokens) when ``source`` is LOOKUP.
        tree: the drafter's step verifies token trees (``dflash2/spec/tree.py``) of
            ``EngineSpec.tree_budget(width)`` nodes per row, ``num_drafts`` deep, rather than chains.
        tree_offsets: for a tree step, the calibration of the drafter's log-probabilities per depth and
            sibling rank (:meth:`dflash2.spec.tree.TreeCalibration.offsets`) the beam scores nodes with.
        branches: for a tree step with prompt lookup on, each row's lookup draft (≤ its ``num_drafts``;
            empty: none), verified as one more branch of the row's tree; None otherwise.
        row_sources: per row, where its free drafts come from (a LOOKUP step's drafts, a tree step's
            branch): LOOKUP, SUFFIX, or GRAMMAR for a row whose drafts are only forced tokens; None otherwise.
            The grammar's forced tokens inside any row's drafts are marked by the executor's walk.
    """

    source: DraftSource
    width: int
    num_drafts: list[int]
    predicted_tokens: float = 0.0
    lookup: Proposal | None = None
    tree: bool = False
    tree_offsets: torch.Tensor | None = None
    branches: list[list[int]] | None = None
    row_sources: list[DraftSource] | None = None

    def source_of(self, row: int) -> DraftSource:
        """Where ``row``'s drafts come from on this step (a free-draft step's row source; grammar-forced
        positions inside them are marked by the executor's walk)."""
        if self.source is DraftSource.LOOKUP and self.row_sources is not None:
            return self.row_sources[row]
        return self.source

    @property
    def verify_width(self) -> int:
        """Tokens per row of the verify forward: the anchor and the most drafts any row verifies."""
        return max(self.num_drafts) + 1


@dataclass
class Verified:
    """What one decode step's forwards decided, for the commit phase and the policy's learning.

    Every row verified a token tree (a chain step's rows: one-branch trees); ``logits``, ``features`` and
    ``draft_lists`` follow each row's accepted path, so a tree step reads like a chain step.

    Attributes:
        plan: the step's plan.
        starts: each row's cached length before the verify forward.
        trees: per row, the tree it verified (node 0 the anchor).
        accepted_nodes: per row, the accepted nodes, root excluded, root to leaf.
        drafter_nodes: per row of a tree step, how many of its tree's nodes (the root included) the drafter
            proposed: they come first, a prompt-lookup branch's own nodes after them; None for a chain step.
        logits: ``[R, L, V]`` raw target logits along the accepted path (a chain step: over every verified
            position); features: ``[R, L, F·H]`` alike, or None.
        draft_lists: per row, the proposed drafts (≥ its verified drafts; a tree row: its accepted path).
        next_ids: per row, the bonus or correction token.
        num_drafts: per row, the drafts it verified (a chain row: its chain; a tree row: the plan's depth).
        forced: per row of a chain step with grammar-forced drafts, per draft: True where the grammar
            forced it; None when no row had any.
        draft_seconds, select_seconds, verify_seconds, grammar_seconds: the phases' times;
        select_in_draft: the selector ran inside the drafting forward (its time is in ``draft_seconds``).
    """

    plan: Plan
    starts: list[int]
    trees: list[TokenTree]
    accepted_nodes: list[list[int]]
    drafter_nodes: list[int] | None
    logits: torch.Tensor
    features: torch.Tensor | None
    draft_lists: list[list[int]]
    next_ids: list[int]
    num_drafts: list[int]
    forced: list[list[bool]] | None = None
    draft_seconds: float = 0.0
    select_seconds: float = 0.0
    select_in_draft: bool = False
    verify_seconds: float = 0.0
    grammar_seconds: float = 0.0

    @property
    def num_accepted(self) -> list[int]:
        """Per row, the accepted drafts."""
        return [len(nodes) for nodes in self.accepted_nodes]

    @property
    def drafts_per_row(self) -> list[int]:
        """Per row, the drafts it verified."""
        return self.num_drafts

    @property
    def tree_nodes(self) -> int:
        """Drafted nodes the step verified as token trees (0 for a chain step)."""
        return sum(len(tree) - 1 for tree in self.trees) if self.drafter_nodes is not None else 0

    @property
    def tree_accepted(self) -> list[int] | None:
        """Per row of a tree step, the accepted nodes that the drafter proposed (what its tree alone would
        have accepted; a prompt-lookup branch's own nodes not counted); None for a chain step."""
        if self.drafter_nodes is None:
            return None
        return [_prefix_below(nodes, limit) for nodes, limit in zip(self.accepted_nodes, self.drafter_nodes)]

    @property
    def spine_accepted(self) -> list[int] | None:
        """Per row of a tree step, the accepted nodes that were their parent's first child among the
        drafter's nodes (what the chain of first-ranked drafts would have accepted); None for a chain step."""
        if self.drafter_nodes is None:
            return None
        return [
            _spine_length(tree, nodes, limit)
            for tree, nodes, limit in zip(self.trees, self.accepted_nodes, self.drafter_nodes)
        ]

    @property
    def branch_accepted(self) -> list[tuple[int, int] | None] | None:
        """Per row of a tree step with a free-draft branch, ``(drafts, accepted)``: how many of the branch's
        drafts the tree held (a slot's end may cut a branch) and how many were accepted (None for a row
        without one); None without branches."""
        branches = self.plan.branches
        if branches is None:
            return None
        out: list[tuple[int, int] | None] = []
        for tree, nodes, branch in zip(self.trees, self.accepted_nodes, branches):
            held = tree.follow(branch)
            out.append((len(held), common_prefix_length(nodes, held)) if branch else None)
        return out


def _spine_length(tree: TokenTree, accepted_nodes: list[int], drafted: int) -> int:
    """How many of the accepted nodes, from the root down, are their parent's first (best-ranked) child
    among the drafter's nodes (the first ``drafted`` of the tree)."""
    count = 0
    for node in accepted_nodes:
        if node >= drafted or tree.children[tree.parents[node]][0] != node:
            break
        count += 1
    return count


def _prefix_below(nodes: list[int], limit: int) -> int:
    """How many of ``nodes``, from the first, are below ``limit``."""
    return next((i for i, node in enumerate(nodes) if node >= limit), len(nodes))
