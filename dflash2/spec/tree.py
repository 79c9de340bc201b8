"""Token trees: the drafter's best paths through the selector lattice, verified in one forward.

A chain verifies one path per row; a token tree verifies several that share prefixes, so a row
whose first-ranked draft is wrong can still accept the second-ranked one (the shipped SmolLM2
drafter ranks the right first token first 61 % of the time but has it among its top 16 91 % of the
time). Built like EAGLE-2's dynamic trees (Li et al. 2024): a beam over the lattice keeps the
``topk`` best partial paths per depth by joint draft log-probability, every node the beam makes is
a candidate, and the ``num_nodes`` best candidates overall form the tree (a node never scores above
its parent, so the kept set is closed under parents). Verification is SpecInfer's tree attention
(Miao et al. 2023): node i sits at position ``start + depth(i)`` and sees the context and its own
ancestors. docs/dflash2-spec.md §6 specifies the tree, its mask and its acceptance rule.

Acceptance (:func:`accept_tree`) is recursive rejection sampling over deterministic children with
point-mass proposals. At a node whose target distribution is p, its children c₁, c₂, … (best first)
are tried in turn: c_i is accepted with probability p_i(c_i), where p₁ = p and, after c_i is
rejected, p_{i+1} = p_i with c_i's mass removed and renormalised. When every child is rejected the
next token is drawn from the last p_i. For any token x,

    P(emit x) = Σ_i [Π_{l<i} (1 − p_l(c_l))] p_i(x)·[x = c_i] + [Π_l (1 − p_l(c_l))] p_m+1(x)

and p_i(x) = p(x) / Π_{l<i}(1 − p_l(c_l)) for every x not among c_1 … c_{i−1}, so each term equals
p(x) restricted to "x is c_i" or "x is none of the children": P(emit x) = p(x). The emitted token is
distributed exactly as the target's, whatever the drafter proposed; the drafter only decides how
often a child is accepted. (SpecInfer's multi-draft rule assumes children drawn i.i.d. from q, which
top-k children are not; the rule here needs no q at all.) Greedy rows follow the child equal to the
target's argmax, which is the same rule on one-hot distributions.

Dimension letters: R rows, J drafted slots, k candidates per slot, N nodes (the root, node 0, is the
anchor), V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["TokenTree", "TreeAcceptance", "TreeCalibration", "accept_tree", "build_trees", "path_log_probs"]


@dataclass
class TokenTree:
    """One row's token tree in topological order.

    Attributes:
        token_ids: the nodes' tokens; node 0 is the anchor (already committed, its K/V not yet cached).
        parents: each node's parent index (−1 for the root); ``parents[i] < i``, and siblings are
            listed best first.
        draft_log_probs: each node's draft log-probability given its parent (uncalibrated; the root's
            0, a prompt-lookup node's NaN), or None where the tree was not drafted
            (:class:`TreeCalibration` learns from these).
    """

    token_ids: list[int]
    parents: list[int]
    draft_log_probs: list[float] | None = field(default=None, compare=False)
    _children: list[list[int]] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.parents) or not self.parents or self.parents[0] != -1:
            raise ValueError("a token tree needs one parent per node and the root (parent −1) first")
        if any(not 0 <= p < i for i, p in enumerate(self.parents) if i):
            raise ValueError(f"parents {self.parents} are not in topological order")
        if self.draft_log_probs is not None and len(self.draft_log_probs) != len(self.parents):
            raise ValueError("a token tree needs one draft log-probability per node")

    @classmethod
    def chain(cls, token_ids: list[int]) -> TokenTree:
        """The tree of one path: ``[anchor, d₁, …]``, each node the child of the one before."""
        return cls(list(token_ids), list(range(-1, len(token_ids) - 1)))

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_chain(self) -> bool:
        """True when the tree is one path: node i is the child of node i − 1."""
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    @property
    def depths(self) -> list[int]:
        """Each node's depth (the root's is 0): its position after the anchor's."""
        depths = [0] * len(self)
        for i in range(1, len(self)):
            depths[i] = depths[self.parents[i]] + 1
        return depths

    @property
    def children(self) -> list[list[int]]:
        """Each node's children, best first."""
        if self._children is None:
            children: list[list[int]] = [[] for _ in self.parents]
            for i in range(1, len(self)):
                children[self.parents[i]].append(i)
            self._children = children
        return self._children

    def follow(self, token_ids: Sequence[int]) -> list[int]:
        """The nodes of the longest path below the root whose tokens are ``token_ids``' first ones (the
        nodes a greedy row accepts when the target's text continues with ``token_ids``)."""
        nodes, node = [], 0
        for token in token_ids:
            match = next((c for c in self.children[node] if self.token_ids[c] == token), None)
            if match is None:
                break
            nodes.append(node := match)
        return nodes

    def with_branch(self, token_ids: list[int], max_nodes: int) -> TokenTree:
        """This tree with the path ``token_ids`` below the root merged in (a prompt-lookup continuation):
        the path follows existing children while their tokens match, and the rest becomes new nodes
        after the existing ones (topological order kept; a new child is its parent's last sibling).
        At most ``max_nodes`` nodes in all: the path is cut there."""
        tokens, parents = list(self.token_ids), list(self.parents)
        first_new = len(tokens)
        shared = self.follow(token_ids)
        node = shared[-1] if shared else 0
        for new in token_ids[len(shared) :]:
            if len(tokens) >= max_nodes:
                break
            tokens.append(new)
            parents.append(node)
            node = len(tokens) - 1
        log_probs = None
        if self.draft_log_probs is not None:
            log_probs = self.draft_log_probs + [math.nan] * (len(tokens) - first_new)
        return TokenTree(tokens, parents, log_probs)

    def path(self, node: int) -> list[int]:
        """The nodes from the root's first child down to ``node`` (empty for the root)."""
        nodes = []
        while node > 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    def ancestor_mask(self, width: int) -> torch.Tensor:
        """``[width, width]`` bool: entry (i, j) is True when node j is node i or one of its ancestors.
        Rows and columns past the tree (padding) see only themselves."""
        mask = torch.eye(width, dtype=torch.bool)
        for i in range(1, len(self)):
            mask[i] |= mask[self.parents[i]]
        return mask


def path_log_probs(unary_scores: torch.Tensor, lattice: torch.Tensor | None) -> torch.Tensor:
    """Draft log-probabilities of each candidate given its predecessor candidate.

    Args:
        unary_scores: ``[R, J, k]`` float32 candidate scores (sorted best first).
        lattice: ``[R, J, k_prev, k]`` selector lattice (:func:`~dflash2.spec.selector.lattice_scores`),
            or None to use the unary scores alone.

    Returns:
        ``[R, J, k_prev, k]`` float32 ``log q_j(b | a)``, normalised over the k candidates.
    """
    if lattice is None:
        num_rows, num_slots, k = unary_scores.shape
        lattice = unary_scores[:, :, None, :].expand(num_rows, num_slots, k, k)
    return torch.log_softmax(lattice.float(), dim=-1)


# Nats taken off every level of a path's score in build_trees. The calibrated per-edge estimates still
# overrate deep nodes (their errors compound along a path); measured on the shipped SmolLM2 drafter at
# K = 4, N = 16: offline over recorded lattices of 32 prompts per set τ 2.459 against 2.440 without it
# (best for 0.5–0.7 on held-out, HumanEval, math and multi-turn alike), in the engine over 8 prompts per
# set 2.288 against 2.273 (docs/engine.md, "Token trees").
DEPTH_PENALTY = 0.5


def build_trees(
    candidate_ids: torch.Tensor,
    log_probs: torch.Tensor,
    anchor_ids: list[int],
    topk: int,
    num_nodes: list[int],
    max_depths: list[int],
    offsets: torch.Tensor | None = None,
) -> list[TokenTree]:
    """Each row's token tree (EAGLE-2-style dynamic tree over the DFlash 2 lattice).

    Depth by depth a beam keeps the ``topk`` partial paths with the highest joint score and expands
    each by its ``topk`` best candidates at the next slot; every node expanded this way is a
    candidate, and the ``num_nodes[r]`` best candidates (ties: the shallower) form row r's tree. With
    ``topk`` 1 the tree is the chain of the greedy walk over the lattice.

    A node's score is the sum along its path of ``min(log q(node | parent) + offset_{d,r} − λ, 0)``:
    the draft log-probabilities, calibrated per depth d and rank r among the parent's ``topk``
    expansions by ``offsets`` (:class:`TreeCalibration`; 0 = the drafter's own numbers), less
    :data:`DEPTH_PENALTY` λ per level. Capped at 0, a child never scores above its parent, so the kept
    set stays closed under parents; λ is the same for every sibling, so it changes which depths the
    budget goes to, never the order of a node's children (and not the chain at ``topk`` 1).

    Args:
        candidate_ids: ``[R, J, k]`` candidate token ids per slot.
        log_probs: ``[R, J, k_prev, k]`` from :func:`path_log_probs` (slot 0's predecessor is the
            anchor, so its first row is used).
        anchor_ids: per row, the anchor token (the root).
        topk: branching kept per depth, 1 … k.
        num_nodes: per row, the drafted nodes to keep (the root not counted), ≥ 0.
        max_depths: per row, the deepest node allowed (≤ J; fewer near ``max_tokens``).
        offsets: ``[R, D, ranks]`` float calibration offsets per row, depth (index 0 = the root's
            children) and rank (:meth:`TreeCalibration.offsets` per row; depths and ranks past its
            size count 0), or None: no calibration.

    Returns:
        One :class:`TokenTree` per row with at most ``num_nodes[r] + 1`` nodes, its
        ``draft_log_probs`` the uncalibrated ones.

    Raises:
        ValueError: when ``topk`` is outside 1 … k.
    """
    num_rows, num_slots, k = candidate_ids.shape
    if not 1 <= topk <= k:
        raise ValueError(f"speculative topk {topk} outside 1 … {k} candidates")
    depth_limit = min(num_slots, max(max_depths, default=0))
    device = log_probs.device
    rows = torch.arange(num_rows, device=device)
    calibration = torch.zeros(num_rows, max(depth_limit, 1), topk, device=device)
    if offsets is not None:
        depths, ranks = min(depth_limit, offsets.shape[1]), min(topk, offsets.shape[2])
        calibration[:, :depths, :ranks] = offsets[:, :depths, :ranks]
    beam_score = torch.zeros(num_rows, 1, device=device)
    beam_index = torch.zeros(num_rows, 1, dtype=torch.long, device=device)
    levels: list[_Level] = []
    for depth in range(depth_limit):
        scores = log_probs[:, depth][rows[:, None], beam_index]  # [R, beam, k]
        child_scores, child_index = scores.topk(topk, dim=-1)  # [R, beam, topk], best first
        calibrated = (child_scores + calibration[:, depth, None, :] - DEPTH_PENALTY).clamp(max=0.0)
        joint = (beam_score[..., None] + calibrated).flatten(1)  # [R, beam · topk]
        child_index = child_index.flatten(1)
        parent_entry = torch.arange(beam_index.shape[1], device=device).repeat_interleave(topk)
        keep = joint.topk(min(topk, joint.shape[1]), dim=-1).indices  # [R, topk], best first
        levels.append(_Level(child_index, joint, parent_entry.expand(num_rows, -1), keep, child_scores.flatten(1)))
        beam_score, beam_index = joint.gather(1, keep), child_index.gather(1, keep)
    host = [level.row_lists() for level in levels]
    return [
        _row_tree([level[r] for level in host], candidate_ids[r], anchor_ids[r], num_nodes[r], max_depths[r])
        for r in range(num_rows)
    ]


@dataclass
class _Level:
    """One depth of :func:`build_trees`' beam, per row: each candidate's index among its slot's k
    candidates and its joint score, the beam entry (of the depth before) it expanded, and the
    candidates the beam kept (best first), and each candidate's draft log-probability given its parent."""

    child_index: torch.Tensor  # [R, E]
    joint: torch.Tensor  # [R, E]
    parent_entry: torch.Tensor  # [R, E]
    keep: torch.Tensor  # [R, beam]
    log_prob: torch.Tensor  # [R, E]

    def row_lists(self) -> list[tuple[list[int], list[float], list[int], list[int], list[float]]]:
        columns = [t.tolist() for t in (self.child_index, self.joint, self.parent_entry, self.keep, self.log_prob)]
        return list(zip(*columns))


def _row_tree(
    levels: list[tuple[list[int], list[float], list[int], list[int], list[float]]],
    candidate_ids: torch.Tensor,
    anchor_id: int,
    num_nodes: int,
    max_depth: int,
) -> TokenTree:
    """One row's tree from its beam levels: the best ``num_nodes`` candidates up to ``max_depth``, in
    topological order (depth by depth) with siblings best first.

    The kept set is closed under parents: a child's joint score is at most its parent's
    (log-probabilities ≤ 0), and on a tie the shallower node sorts first."""
    levels = levels[:max_depth]
    ranked = sorted(
        (-score, depth, entry) for depth, level in enumerate(levels) for entry, score in enumerate(level[1])
    )
    chosen = {(depth, entry) for _, depth, entry in ranked[:num_nodes]}
    token_ids, parents, log_probs = [anchor_id], [-1], [0.0]
    node_of: dict[tuple[int, int], int] = {}
    for depth, (child_index, joint, parent_entry, _, log_prob) in enumerate(levels):
        entries = sorted(
            (e for e in range(len(joint)) if (depth, e) in chosen), key=lambda e: (parent_entry[e], -joint[e])
        )
        for entry in entries:
            parent = 0 if depth == 0 else node_of.get((depth - 1, levels[depth - 1][3][parent_entry[entry]]))
            if parent is None:  # its parent was not kept (only on exact ties): drop the branch
                continue
            node_of[(depth, entry)] = len(token_ids)
            token_ids.append(int(candidate_ids[depth, child_index[entry]]))
            parents.append(parent)
            log_probs.append(log_prob[entry])
    return TokenTree(token_ids, parents, log_probs)


MAX_RANKS = 16  # sibling ranks TreeCalibration tracks per depth (the drafter's candidates per slot)


class TreeCalibration:
    """Calibration of the drafter's log-probabilities for :func:`build_trees`, per depth and sibling
    rank, learnt from verified trees.

    A node's worth in a tree is the chance that it is accepted: the product along its path of
    P(node accepted | parent accepted), which the beam estimates by the draft probabilities q. The
    DFlash 2 drafter predicts a block's positions in parallel, normalised over the lattice's top
    candidates, and overrates its nodes: on the shipped SmolLM2 drafter (bench prompts, K = 4, N = 16)
    about 0.7 of its q was accepted at depths 1–3. The model here:
    P(accepted | parent accepted) ≈ q · exp(c_{d,r}) for a node at depth d that is its parent's r-th
    child, with ``c_{d,r} = log((A + w) / (Q + w))`` where, over the drafted nodes at (d, r) whose
    parent was accepted, A counts those accepted and Q sums their q; ``w`` pseudo-observations at
    c = 0 keep a cell not yet seen at the drafter's own numbers. The sums decay by ``decay`` per
    observed tree, so the offsets follow the workload. Measured (docs/engine.md, "Token trees";
    ``scripts/tree_tau.py``): τ 2.34 against 2.27 uncalibrated at K = 4, N = 16 (32 prompts, greedy).

    Args:
        max_depth: depths tracked (the block's drafted slots).
        prior_weight: ``w`` above.
        decay: per observed tree, 0 < decay ≤ 1.
        bounds: ``(lowest, highest)`` offset.
    """

    def __init__(
        self, max_depth: int, prior_weight: float = 4.0, decay: float = 0.998, bounds: tuple[float, float] = (-4.0, 1.0)
    ) -> None:
        self.accepted = torch.zeros(max_depth, MAX_RANKS, dtype=torch.float64)  # A per [depth, sibling rank]
        self.probability = torch.zeros(max_depth, MAX_RANKS, dtype=torch.float64)  # Q
        self.prior_weight, self.decay, self.bounds = prior_weight, decay, bounds

    def observe(self, tree: TokenTree, accepted_nodes: Sequence[int]) -> None:
        """Count one verified tree: every drafted node whose parent was accepted (the root always is)."""
        if tree.draft_log_probs is None:
            return
        accepted = set(accepted_nodes)
        depths, log_probs = tree.depths, tree.draft_log_probs
        cells: list[tuple[int, int]] = []
        probability, hits = [], []
        for parent in (0, *accepted_nodes):
            # Drafted children by draft probability, as the beam ranked them (lookup nodes, NaN, left out).
            drafted = sorted(
                (c for c in tree.children[parent] if not math.isnan(log_probs[c])), key=lambda c: -log_probs[c]
            )
            for rank, child in enumerate(drafted[:MAX_RANKS]):
                if depths[child] <= len(self.accepted):
                    cells.append((depths[child] - 1, rank))
                    probability.append(math.exp(log_probs[child]))
                    hits.append(float(child in accepted))
        self.accepted.mul_(self.decay)
        self.probability.mul_(self.decay)
        if cells:
            index = tuple(torch.tensor(cells).T)
            self.probability.index_put_(index, torch.tensor(probability, dtype=torch.float64), accumulate=True)
            self.accepted.index_put_(index, torch.tensor(hits, dtype=torch.float64), accumulate=True)

    def offsets(self) -> torch.Tensor:
        """``c_{d,r}``: ``[max_depth, MAX_RANKS]`` float32 per depth (index 0 = the root's children) and
        sibling rank (best first), for :func:`build_trees`."""
        w = self.prior_weight
        return ((self.accepted + w) / (self.probability + w)).log().clamp(*self.bounds).float()


@dataclass
class TreeAcceptance:
    """A row's verdict on its tree: the accepted nodes (root excluded, root to leaf) and the next token
    (the bonus after a fully accepted branch, else the token drawn where the branch stopped)."""

    accepted_nodes: list[int]
    next_id: int


def accept_tree(
    tree: TokenTree, probs: torch.Tensor | None, logits: torch.Tensor | None, uniforms: torch.Tensor | None
) -> TreeAcceptance:
    """Lossless acceptance of one row's tree (the module docstring derives the rule).

    Args:
        tree: the row's tree (N nodes).
        probs: ``[N, V]`` float32 target distributions after each node (processed and filtered: the
            distribution of the token that follows node i), for a sampled row; None for a greedy row.
        logits: ``[N, V]`` processed target logits, for a greedy row (argmax, lowest index on ties).
        uniforms: ``[≥ N + 1]`` uniforms in [0, 1) for a sampled row: one per child tried, and the last
            one for the next token.

    Returns:
        The :class:`TreeAcceptance`.
    """
    node = 0
    accepted: list[int] = []
    if probs is None:
        assert logits is not None
        targets = logits.argmax(dim=-1).tolist()
        while True:
            match = next((c for c in tree.children[node] if tree.token_ids[c] == targets[node]), None)
            if match is None:
                return TreeAcceptance(accepted, targets[node])
            accepted.append(match)
            node = match
    assert uniforms is not None
    draws, used = uniforms.tolist(), 0
    while True:
        p, moved = probs[node], False
        for child in tree.children[node]:
            token = tree.token_ids[child]
            accept = draws[used] < float(p[token])  # probability p_i(c_i)
            used += 1
            if accept:
                accepted.append(child)
                node, moved = child, True
                break
            p = p.clone()
            p[token] = 0.0
            total = float(p.sum())
            # p(c_i) < 1 when c_i is rejected, so mass remains (up to rounding, then p stays as it was).
            p = p / total if total > 0.0 else probs[node]
        if not moved:  # a leaf was accepted (the bonus), or every child was rejected (the residual)
            return TreeAcceptance(accepted, _sample(p, draws[-1]))


def _sample(p: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from ``p [V]`` with uniform ``u``."""
    cdf = torch.cumsum(p, dim=0)
    index = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype), right=True))
    return min(index, p.shape[0] - 1)
