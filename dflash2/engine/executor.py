"""The forwards of one step, as the plan says: prefill and each prompt's first token; the proposal
(drafter chain or tree, prompt lookup, earlier outputs, grammar-forced tokens, or none) as a token tree per
row, ONE verify forward and ONE acceptance. Nothing here commits tokens (the accepted path's K/V is moved
into place; the committed lengths change in :mod:`dflash2.engine.postprocess`).

Dimension letters: R rows, B block size, J ≤ B − 1 drafted slots, V vocab, F·H captured target features.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dflash2.config import EngineSpec
from dflash2.engine.drafter_context import pending_writes, write_context
from dflash2.engine.plan import DraftSource, Plan, Verified
from dflash2.engine.request import Request, slot_of
from dflash2.grammar import GrammarBackend, walk_drafts
from dflash2.runner import Drafted, ModelRunner
from dflash2.sampling import LogitsContext, sample_from_probs, target_probs
from dflash2.spec.selector import Proposal
from dflash2.spec.tree import TokenTree, build_trees
from dflash2.spec.verify import accept


@dataclass
class Prefilled:
    """What a prefill forward decided: raw logits ``[R, 1, V]`` at each prompt's last token, each
    request's first token, and the seconds its grammar masks took."""

    logits: torch.Tensor
    first_ids: list[int]
    grammar_seconds: float


class StepExecutor:
    """Runs a step's forwards on the runner; changes only cache entries past the committed lengths (a
    rerun rewrites them alike), drafter context (written once, idempotently) and the requests'
    generators (the engine restores them when it reruns rows one by one).

    Args:
        spec: the engine's resolved settings; runner: the forwards and caches;
        grammar: masks for requests with a grammar (None without a tokenizer);
        eos_token_ids: for the logits processors (``min_tokens``).
    """

    def __init__(
        self, spec: EngineSpec, runner: ModelRunner, grammar: GrammarBackend | None, eos_token_ids: tuple[int, ...]
    ) -> None:
        self.spec, self.runner, self.grammar, self.eos_token_ids = spec, runner, grammar, eos_token_ids

    def prefill(self, requests: list[Request]) -> Prefilled:
        """Run the prompts through the target (a cached prefix is not recomputed), write their drafter
        context and sample each first token."""
        slots = [slot_of(r) for r in requests]
        starts = [r.num_cached_prompt_tokens for r in requests]
        rest = [r.prompt_ids[start:] for r, start in zip(requests, starts)]
        logits, features = self.runner.prefill(slots, rest, starts)
        if features is not None and self.runner.drafting is not None:
            self.runner.drafting.append_context(slots, starts, features, [len(tokens) for tokens in rest])
        no_drafts = logits.new_zeros(len(requests), 0).long()
        allowed, grammar_seconds = self._grammar_masks(requests, [[] for _ in requests], 1)
        probs = target_probs(logits, self._logits_context(requests), no_drafts, allowed)
        uniforms = torch.stack([_uniforms(r, 1) for r in requests])[:, 0].to(self.spec.device)
        return Prefilled(logits, sample_from_probs(probs[:, 0], uniforms).tolist(), grammar_seconds)

    def decode(self, rows: list[Request], plan: Plan) -> Verified:
        """The plan's proposal as a token tree per row (a drafted, looked-up or empty chain is a one-branch
        tree; a tree step's is the beam's), then ONE target forward over the trees, ONE acceptance
        (lossless rejection sampling; greedy rows take the argmax path) and the accepted path's K/V moved
        into place. Phases: propose, grammar walk (chains), verify, accept."""
        slots, starts = [slot_of(r) for r in rows], [r.num_cached for r in rows]
        if plan.source is DraftSource.DRAFTER:
            # A backlog of context (rows that decoded without drafts) is not part of the drafted step's
            # cost: it is due whenever the rows draft next, and charging it here would make each draft
            # after a pause look dearer, so the policy would pause longer. One step's worth is written
            # by the drafting forward itself.
            write_context(self.runner, [r for r in rows if r.pending_context.num_tokens > self.spec.block_size])
        proposal: Proposal | None = None
        drafter_nodes = forced = None
        draft_seconds = select_seconds = grammar_seconds = 0.0
        select_in_draft = False
        if plan.tree:
            trees, drafter_nodes, draft_seconds = self._draft_trees(rows, plan, slots, starts)
        elif plan.source is DraftSource.DRAFTER:
            drafted = self._draft(rows, plan.width)
            proposal, draft_seconds = drafted.proposal, drafted.draft_seconds
            select_seconds, select_in_draft = drafted.select_seconds, drafted.select_in_draft
        elif plan.source is DraftSource.LOOKUP:
            assert plan.lookup is not None
            proposal = plan.lookup
        else:
            proposal = self._no_proposal(len(rows))
        start = time.perf_counter()
        num_drafts = list(plan.num_drafts)
        if proposal is not None:  # chains: the grammar walk, then each row's [anchor, drafts…]
            if self.spec.grammar_forced_drafts and any(r.matcher is not None for r in rows):
                proposal, num_drafts, forced = self._walk_grammar(rows, proposal, num_drafts)
                grammar_seconds = time.perf_counter() - start
            width = max(num_drafts)  # rows near their limits verify shorter blocks
            draft_lists = proposal.draft_ids[:, :width].tolist()
            trees = [TokenTree.chain([r.output_ids[-1], *draft_lists[i][: num_drafts[i]]]) for i, r in enumerate(rows)]
        logits, features = self.runner.verify(slots, trees, starts)
        num_positions = max(len(tree) for tree in trees)
        allowed, mask_seconds = self._grammar_masks(rows, [t.token_ids[1:] for t in trees], num_positions)
        uniforms = None
        if not all(r.params.is_greedy for r in rows):
            # The same count per row on every step of a kind, whatever its shape: a chain step's block, a
            # tree step's most nodes (one per child tried) and one for the next token.
            draws = self.runner.max_tree_nodes + 1 if plan.tree else self.spec.block_size
            uniforms = self._step_uniforms(rows, draws)
        accepted, next_ids = accept(trees, logits, self._logits_context(rows), proposal, allowed, uniforms)
        for slot, first, nodes in zip(slots, starts, accepted):
            self.runner.commit(slot, first, nodes)
        if plan.tree:  # logits, features and drafts along each row's accepted path, as a chain's
            paths = [[0, *nodes] for nodes in accepted]
            index = torch.tensor([p + [p[-1]] * (max(map(len, paths)) - len(p)) for p in paths], device=logits.device)
            logits = _along(logits, index)
            features = None if features is None else _along(features, index)
            draft_lists = [[tree.token_ids[n] for n in nodes] for tree, nodes in zip(trees, accepted)]
        return Verified(
            plan,
            starts,
            trees,
            accepted,
            drafter_nodes,
            logits,
            features,
            draft_lists,
            next_ids,
            num_drafts,
            forced,
            draft_seconds,
            select_seconds,
            select_in_draft,
            time.perf_counter() - start,
            grammar_seconds + mask_seconds,
        )

    def _walk_grammar(
        self, rows: list[Request], proposal: Proposal, num_drafts: list[int]
    ) -> tuple[Proposal, list[int], list[list[bool]]]:
        """Grammar-forced drafts (``dflash2.grammar.walk_drafts``): each row with a grammar walks its
        proposal from its committed state, the tokens its grammar forces filled in, up to its planned
        drafts; returns the proposal as walked (forced and replaced drafts one-hot), the drafts each row
        verifies and, per row and draft, whether the grammar forced it."""
        drafts, candidates = proposal.draft_ids.tolist(), proposal.candidate_ids.tolist()
        walks = [
            walk_drafts(r.matcher, drafts[i][: num_drafts[i]], candidates[i], num_drafts[i], r.params.is_greedy)
            if r.matcher is not None
            else None
            for i, r in enumerate(rows)
        ]
        counts = [n if walk is None else len(walk.token_ids) for walk, n in zip(walks, num_drafts)]
        width = max(counts)
        draft_ids = _padded(proposal.draft_ids, width)
        candidate_ids = _padded(proposal.candidate_ids, width)
        draft_probs = _padded(proposal.draft_probs, width)
        for i, walk in enumerate(walks):
            if walk is None:
                continue
            for j, (token, replaced) in enumerate(zip(walk.token_ids, walk.replaced)):
                draft_ids[i, j] = token
                if replaced:  # a draft chosen without a distribution: one-hot
                    candidate_ids[i, j] = token
                    draft_probs[i, j] = 0.0
                    draft_probs[i, j, 0] = 1.0
        forced = [[False] * n if walk is None else walk.forced for walk, n in zip(walks, counts)]
        return Proposal(draft_ids, candidate_ids, draft_probs), counts, forced

    def _draft_trees(
        self, rows: list[Request], plan: Plan, slots: list[int], starts: list[int]
    ) -> tuple[list[TokenTree], list[int], float]:
        """A tree step's proposal (``dflash2/spec/tree.py``): the drafter's block and the lattice, then each
        row's tree (the beam's best nodes, at most ``EngineSpec.tree_budget`` of them and its
        ``plan.num_drafts`` deep) with its prompt-lookup branch, if any, merged in after the drafter's nodes.

        Returns:
            ``(trees, drafter_nodes, draft_seconds)``: per row its tree and how many of its nodes (the root
            included) the drafter proposed, and the drafting forward's seconds.
        """
        device = self.spec.device
        anchors = [r.output_ids[-1] for r in rows]
        assert self.runner.drafting is not None
        candidate_ids, log_probs, draft_seconds = self.runner.drafting.draft_lattice(
            slots,
            torch.tensor(anchors, device=device),
            torch.tensor(starts, device=device),
            plan.width,
            pending_writes(rows),
        )
        for request in rows:  # written by the drafting forward
            request.pending_context.clear()
        budget = self.spec.tree_budget(plan.width)
        limits = [min(budget, self.spec.max_model_len - s - 1) if n else 0 for s, n in zip(starts, plan.num_drafts)]
        offsets = None
        if plan.tree_offsets is not None:
            # A seeded row's tree must not follow the traffic before it: the drafter's own numbers.
            unseeded = torch.tensor([r.params.seed is None for r in rows], dtype=torch.float32)
            offsets = (plan.tree_offsets[None] * unseeded[:, None, None]).to(device)
        trees = build_trees(candidate_ids, log_probs, anchors, self.spec.tree_topk, limits, plan.num_drafts, offsets)
        drafter_nodes = [len(tree) for tree in trees]  # the drafter's nodes come first in each tree
        if plan.branches is not None:  # prompt-lookup drafts as one more branch (nodes beyond the budget)
            room = [self.spec.max_model_len - s for s in starts]
            trees = [t.with_branch(b, n) if b else t for t, b, n in zip(trees, plan.branches, room)]
        return trees, drafter_nodes, draft_seconds

    def _draft(self, rows: list[Request], width: int) -> Drafted:
        """Each row's drafted path over the ``width``-token block: ONE drafter forward from the rows'
        last tokens (the anchors), after writing the context they committed since they last drafted,
        then top-k candidates per slot, lattice scores (DFlash 2 selector) and the walk."""
        device = self.spec.device
        anchors = torch.tensor([r.output_ids[-1] for r in rows], device=device)
        starts = torch.tensor([r.num_cached for r in rows], device=device)
        temperatures = torch.tensor([r.params.temperature for r in rows], device=device)
        # B − 1 per row whatever the width: a row's random stream advances the same on every step.
        uniforms = self._step_uniforms(rows, self.spec.block_size - 1)
        slots = [slot_of(r) for r in rows]
        assert self.runner.drafting is not None
        drafted = self.runner.drafting.propose(
            slots, anchors, starts, temperatures, uniforms, width, pending_writes(rows)
        )
        for request in rows:  # written by the drafting forward
            request.pending_context.clear()
        return drafted

    def _no_proposal(self, num_rows: int) -> Proposal:
        """The empty proposal of an autoregressive step."""
        empty = torch.zeros(num_rows, 0, dtype=torch.long, device=self.spec.device)
        return Proposal(empty, empty[..., None], torch.zeros(num_rows, 0, 1, device=self.spec.device))

    def _grammar_masks(
        self, rows: list[Request], drafts: list[list[int]], num_positions: int
    ) -> tuple[torch.Tensor | None, float]:
        """``[R, L, V]`` allowed-token masks along each row's drafts (None when no row has a grammar),
        and the seconds they took; each row's ``closing_from`` is set (the budget rule)."""
        if self.grammar is None or all(r.matcher is None for r in rows):
            return None, 0.0
        start = time.perf_counter()
        closing: list[int | None] = []
        budgets = [r.remaining_tokens for r in rows]
        allowed = self.grammar.masks([r.matcher for r in rows], drafts, num_positions, budgets, closing)
        for request, first in zip(rows, closing):
            request.closing_from = first
        return allowed, time.perf_counter() - start

    def _logits_context(self, rows: list[Request]) -> LogitsContext:
        return LogitsContext(
            params=[r.params for r in rows],
            prompt_ids=[r.prompt_ids for r in rows],
            output_ids=[r.output_ids for r in rows],
            eos_token_ids=list(self.eos_token_ids),
        )

    def _step_uniforms(self, rows: list[Request], n: int) -> torch.Tensor:
        """``[R, n]`` uniforms, each row's from its own generator (zeros for greedy rows, which draw none)."""
        if all(r.params.is_greedy for r in rows):
            return torch.zeros(len(rows), n, device=self.spec.device)
        return torch.stack([_uniforms(r, n) for r in rows]).to(self.spec.device)


def _padded(values: torch.Tensor, width: int) -> torch.Tensor:
    """A copy of ``values [R, J, …]`` with exactly ``width`` slots: cut, or padded with zeros."""
    if values.shape[1] >= width:
        return values[:, :width].clone()
    pad = values.new_zeros(values.shape[0], width - values.shape[1], *values.shape[2:])
    return torch.cat([values, pad], dim=1)


def _uniforms(request: Request, n: int) -> torch.Tensor:
    """``n`` uniforms from the request's own generator (none drawn for greedy requests)."""
    if request.params.is_greedy:
        return torch.zeros(n)
    return torch.rand(n, generator=request.generator)


def _along(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values [R, N, D]`` at each row's nodes ``index [R, L]``: ``[R, L, D]``."""
    return values.gather(1, index[..., None].expand(-1, -1, values.shape[-1]))
