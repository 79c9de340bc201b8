"""The step's plan: where this step's drafts come from (the drafter, prompt lookup, none) and how many
each row verifies, from the adaptive policy's estimates (``dflash2/spec/adaptive.py``); and what the policy
learns from each verify outcome and step timing."""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from dflash2.config import EngineSpec
from dflash2.engine.request import Request
from dflash2.runner import ModelRunner
from dflash2.runner.costs import TimingInterrupted, measure_tree_costs
from dflash2.spec.adaptive import (
    TREE_PRIOR_ACCEPTANCE,
    AcceptanceEstimate,
    AcceptanceTracker,
    CostModel,
    WidthChoice,
    choose_lookup_width,
    choose_width,
)
from dflash2.spec.prompt_lookup import PromptLookup
from dflash2.spec.selector import Proposal

logger = logging.getLogger(__name__)

# Tokens of context each row has when the adaptive policy's step costs are timed at start-up: a chat
# request's prompt and some answer, so attention's share of the cost is not that of an empty cache.
COST_CONTEXT = 256


class DraftSource(enum.Enum):
    """Where a step's drafts come from."""

    DRAFTER = "drafter"  # one drafter forward over the rows' blocks, then the selector's walk
    LOOKUP = "lookup"  # copied from each row's own earlier tokens (no drafter forward)
    NONE = "none"  # an autoregressive step (block size 1, or the policy chose width 1)


@dataclass(frozen=True)
class Plan:
    """One decode step's speculation, decided before any forward.

    Attributes:
        source: where the drafts come from.
        width: W, tokens per row of the drafted block (anchor included; the drafter's block width).
        num_drafts: per row, the drafts it verifies (≤ W − 1; fewer near ``max_tokens`` or the slot's end).
        predicted_tokens: tokens the adaptive policy expects the rows to commit (0 without the policy).
        lookup: the prompt-lookup proposal (one-hot on the copied tokens) when ``source`` is LOOKUP.
        tree: the drafter's step verifies token trees (``dflash2/spec/tree.py``) of
            ``EngineSpec.tree_budget(width)`` nodes per row, ``num_drafts`` deep, rather than chains.
        branches: for a tree step with prompt lookup on, each row's lookup draft (≤ its ``num_drafts``;
            empty: none), verified as one more branch of the row's tree; None otherwise.
    """

    source: DraftSource
    width: int
    num_drafts: list[int]
    predicted_tokens: float = 0.0
    lookup: Proposal | None = None
    tree: bool = False
    branches: list[list[int]] | None = None

    @property
    def verify_width(self) -> int:
        """Tokens per row of the verify forward: the anchor and the most drafts any row verifies."""
        return max(self.num_drafts) + 1


class SpeculationPolicy:
    """Chooses each decode step's :class:`Plan` and learns from its outcome.

    Without adaptive speculation every step drafts the full block with the drafter (or none at block
    size 1), verified as token trees where the engine has them and the rows allow (:func:`tree_rows`).
    With it, the step's width maximises predicted tokens per second (``choose_width``); where trees
    are on, chains and trees of every width compete on their own acceptance and cost (a tree commits
    more per step and costs more to verify: at high concurrency chains or no drafts win); and prompt
    lookup replaces the drafter when every drafting row has a lookup draft and it predicts more (on a
    tree step it does not win, the lookup drafts join each row's tree as a branch). A
    seeded request keeps the full block from the drafter (a tree where trees are on), so its text does
    not depend on timings.

    Args:
        spec: the engine's resolved settings.
        runner: times the step costs at start-up (adaptive only).
        quick: a provisional table (eager forwards that serve only until the compiled graphs come into
            use, then :meth:`retime`): timed at 1 row and at ``max_num_seqs`` rows, once each after the
            warm-up, instead of at every power of two three times. Readiness waits for it: on 2 busy
            cores the full timing of the eager forwards took over 2 minutes.
    """

    def __init__(self, spec: EngineSpec, runner: ModelRunner, quick: bool = False) -> None:
        self.spec = spec
        self.cost_model = self._measure_costs(runner, quick=quick) if spec.adaptive else None
        self.acceptance = AcceptanceTracker(spec.block_size - 1)
        self.tree_acceptance = AcceptanceTracker(spec.block_size - 1, prior=TREE_PRIOR_ACCEPTANCE)
        self.lookup_acceptance = AcceptanceTracker(spec.block_size - 1)

    def retime(self, runner: ModelRunner, interrupt: Callable[[], bool] | None = None) -> bool:
        """Time the step costs again (the forwards changed: compiled graphs came into use) and start a
        fresh cost table from them. Returns False, keeping the current table, when ``interrupt()`` turned
        True before the timing ended."""
        try:
            self.cost_model = self._measure_costs(runner, interrupt)
        except TimingInterrupted:
            logger.info("adaptive speculation: timing the step costs again was interrupted by a request")
            return False
        return True

    def _measure_costs(
        self, runner: ModelRunner, interrupt: Callable[[], bool] | None = None, quick: bool = False
    ) -> CostModel:
        """The cost table: every verify width and the drafter's block, timed now at 1, 2, 4, … rows up to
        ``max_num_seqs`` (``quick``: at 1 and ``max_num_seqs`` rows, once), each row :data:`COST_CONTEXT`
        tokens in (a few seconds). Raises ``TimingInterrupted`` when ``interrupt()`` turns True first."""
        start = time.perf_counter()
        slots = self.spec.max_num_seqs
        row_counts = sorted({*(2**i for i in range(slots.bit_length()) if 2**i <= slots and not quick), 1, slots})
        repeats = 1 if quick else 3
        verify, draft = runner.measure_costs(
            row_counts, runner.verify_widths, repeats, context=COST_CONTEXT, interrupt=interrupt
        )
        model = CostModel(slots, runner.verify_widths)
        model.seed(verify, draft)
        logger.info(
            "adaptive speculation: step costs measured in %.1f s%s; ms per verify at 1 row by width: %s; "
            "drafter block + selector by width: %s",
            time.perf_counter() - start,
            " (provisional, eager forwards)" if quick else "",
            ", ".join(f"{w}: {1000 * model.verify[(1, w)]:.1f}" for w in model.widths),
            ", ".join(f"{w}: {1000 * model.draft[(1, w)]:.1f}" for w in model.widths if w > 1),
        )
        if self.spec.tree:
            start = time.perf_counter()
            widths = [w for w in model.widths if w > 1]
            nodes = {w: self.spec.tree_budget(w) for w in widths}
            costs = measure_tree_costs(
                runner, row_counts, nodes, self.spec.tree_topk, COST_CONTEXT, repeats, interrupt=interrupt
            )
            model.seed_tree(*costs)
            logger.info(
                "adaptive speculation: token-tree step costs measured in %.1f s; ms per tree verify at 1 row "
                "by width (nodes): %s",
                time.perf_counter() - start,
                ", ".join(f"{w} ({nodes[w] + 1}): {1000 * model.tree_verify[(1, w)]:.1f}" for w in widths),
            )
        return model

    # ---- a new request -----------------------------------------------------------------------

    def start(self, request: Request) -> None:
        """Give a new request its acceptance estimates (from the engine-wide ones) and, with prompt
        lookup on, its n-gram index over the prompt."""
        if self.cost_model is not None:
            request.acceptance = AcceptanceEstimate(list(self.acceptance.values))
            if self.spec.tree:
                request.tree_acceptance = AcceptanceEstimate(list(self.tree_acceptance.values))
        if self.spec.prompt_lookup_max:
            request.lookup = PromptLookup(self.spec.prompt_lookup_min, self.spec.prompt_lookup_max, request.prompt_ids)
            request.lookup_acceptance = AcceptanceEstimate(list(self.lookup_acceptance.values))

    # ---- before the step ---------------------------------------------------------------------

    def plan(self, rows: list[Request]) -> Plan:
        """This step's plan for ``rows`` (they decode together).

        With the adaptive policy the candidates are: no draft or a chain of the best width
        (``choose_width``), a token tree of the best width where trees are on, its prediction counting
        the rows' prompt-lookup drafts as the branch they would join (:func:`expected_tokens_with_branch`),
        and the lookup drafts alone, which skip the drafter's forward (``choose_lookup_width``). The step
        takes whichever predicts the most tokens per second."""
        limits = self.num_drafts(rows)
        trees = self.spec.tree and tree_rows(rows)
        choice = self._choose_width(rows, limits)
        if choice is None:  # no adaptive policy: the full block from the drafter (none at block size 1)
            source = DraftSource.DRAFTER if self.spec.speculative else DraftSource.NONE
            width = self.spec.block_size
            return Plan(source, width, [min(n, width - 1) for n in limits], tree=trees)
        drafts = self._lookup_drafts(rows, limits)
        tree = self._choose_tree(rows, limits, choice, drafts) if trees else None
        if tree is not None:
            choice = tree
        lookup = self._lookup_plan(rows, limits, choice, drafts) if drafts is not None else None
        if lookup is not None:
            return lookup
        source = DraftSource.DRAFTER if choice.width > 1 else DraftSource.NONE
        num_drafts = [min(n, choice.width - 1) for n in limits]
        if tree is None:
            return Plan(source, choice.width, num_drafts, choice.predicted_tokens)
        # The lookup drafts ride along as a branch of each row's tree: no drafter forward for them, a few
        # more nodes in the same verify.
        branches = None if drafts is None else [d[:n] for d, n in zip(drafts, num_drafts)]
        return Plan(source, choice.width, num_drafts, choice.predicted_tokens, tree=True, branches=branches)

    def num_drafts(self, rows: list[Request]) -> list[int]:
        """Drafts each row may verify: never past ``max_tokens`` or the end of its KV slot."""
        limit, length = self.spec.block_size - 1, self.spec.max_model_len
        return [max(0, min(limit, r.remaining_tokens - 1, length - r.num_cached - 1)) for r in rows]

    def _choose_width(self, rows: list[Request], limits: list[int]) -> WidthChoice | None:
        """The adaptive policy's choice of the verify width with the drafter; None without the policy."""
        if self.cost_model is None:
            return None
        return choose_width(
            [r.acceptance.values for r in rows if r.acceptance is not None],
            limits,
            self.cost_model.widths,
            self.cost_model.seconds,
            min_width=self.spec.block_size if seeded(rows) else 1,
        )

    def _choose_tree(
        self, rows: list[Request], limits: list[int], chain: WidthChoice, drafts: list[list[int]] | None
    ) -> WidthChoice | None:
        """The best token-tree width when it predicts more tokens per second than ``chain`` (the best chain
        or no draft), else None: E_r from each row's per-depth tree acceptance and, where the row has a
        prompt-lookup draft (``drafts``), its lookup acceptance for the branch the draft joins; the cost
        from the tree tables (:meth:`CostModel.tree_seconds`). A seeded row's full block is a tree
        whenever it can be."""
        assert self.cost_model is not None
        if not any(limits):
            return None
        branches = None
        if drafts is not None:
            branches = [
                (r.lookup_acceptance.values if r.lookup_acceptance is not None else (), len(d))
                for r, d in zip(rows, drafts)
            ]
        tree = choose_width(
            [r.tree_acceptance.values for r in rows if r.tree_acceptance is not None],
            limits,
            [w for w in self.cost_model.widths if w > 1],
            self.cost_model.tree_seconds,
            min_width=self.spec.block_size if seeded(rows) else 2,
            branches=branches,
        )
        if seeded(rows) or tree.rates.get(tree.width, 0.0) > chain.rates.get(chain.width, 0.0):
            return tree
        return None

    def _lookup_drafts(self, rows: list[Request], limits: list[int]) -> list[list[int]] | None:
        """Each row's prompt-lookup draft (``dflash2/spec/prompt_lookup.py``; at most its limit, empty where
        nothing matches); None when lookup is off, without the adaptive policy, and for a seeded row
        (whether its drafts win would be a timing question)."""
        if not self.spec.prompt_lookup_max or self.cost_model is None or seeded(rows):
            return None
        drafts = []
        for request, limit in zip(rows, limits):
            assert request.lookup is not None
            request.lookup.sync(request.output_ids)
            drafts.append(request.lookup.propose(limit))
        return drafts

    def _lookup_plan(
        self, rows: list[Request], limits: list[int], choice: WidthChoice, drafts: list[list[int]]
    ) -> Plan | None:
        """A prompt-lookup plan when every row that may draft has a lookup draft (``drafts``) and verifying
        them, with no drafter forward, is predicted to commit more tokens per second than ``choice``; the
        limits are cut to each row's lookup draft. None otherwise."""
        assert self.cost_model is not None
        if not all(d for d, limit in zip(drafts, limits) if limit):
            return None
        lookup_limits = [len(d) for d in drafts]
        lookup = choose_lookup_width(
            [r.lookup_acceptance.values for r in rows if r.lookup_acceptance is not None],
            lookup_limits,
            self.cost_model.widths,
            self.cost_model.verify_seconds,
        )
        if not lookup.rates or lookup.rates[lookup.width] <= choice.rates.get(choice.width, 0.0):
            return None
        span = lookup.width - 1
        draft_ids = torch.tensor([(d + [d[-1] if d else 0] * span)[:span] for d in drafts], device=self.spec.device)
        ones = torch.ones(len(rows), span, 1, device=self.spec.device)
        proposal = Proposal(draft_ids, draft_ids[..., None], ones)
        num_drafts = [min(n, span) for n in lookup_limits]
        return Plan(DraftSource.LOOKUP, lookup.width, num_drafts, lookup.predicted_tokens, proposal)

    # ---- after the step ----------------------------------------------------------------------

    def observe_costs(
        self, plan: Plan, num_rows: int, verify_seconds: float, draft_seconds: float, probing: bool
    ) -> None:
        """Fold a decode step's timings into the cost table (not a step at a probed thread count, which is
        not what the table describes; a lookup step's drafting cost is not the drafter's)."""
        if self.cost_model is None or probing:
            return
        if plan.tree:
            self.cost_model.observe_tree(num_rows, plan.width, verify_seconds, draft_seconds)
            return
        draft = None if plan.source is DraftSource.LOOKUP else draft_seconds
        self.cost_model.observe(num_rows, plan.verify_width, verify_seconds, draft)

    def observe(
        self,
        request: Request,
        num_drafts: int,
        num_accepted: int,
        lookup: bool,
        spine_accepted: int | None = None,
        branch: tuple[int, int] | None = None,
    ) -> None:
        """Fold a row's verify outcome into the estimates for the source of its drafts (prompt lookup or
        the drafter); a source the step did not use relaxes toward its engine-wide estimate, so a row
        that stopped using a source tries it again later.

        A token tree's outcome (``spine_accepted`` given: how many of the accepted nodes were first-ranked
        children; ``num_accepted``: the accepted nodes the drafter proposed) teaches both drafter
        estimates: the tree's per depth from the accepted path, the chain's from its first-ranked spine,
        which is the path a chain step would have verified (for greedy rows; a sampled chain walks the
        lattice with its own draws, close to the spine). A prompt-lookup branch verified in the tree
        (``branch``: its drafts and how many were accepted) teaches the lookup estimate as a lookup step
        would. A chain step teaches only the chain's; the tree's then relaxes toward its engine-wide one."""
        if request.acceptance is None:
            return
        tree_estimate = request.tree_acceptance
        if lookup:
            assert request.lookup_acceptance is not None
            _fold(request.lookup_acceptance, self.lookup_acceptance, num_drafts, num_accepted)
            request.acceptance.relax(self.acceptance.values)
            if tree_estimate is not None:
                tree_estimate.relax(self.tree_acceptance.values)
            return
        if spine_accepted is None:
            _fold(request.acceptance, self.acceptance, num_drafts, num_accepted)
            if tree_estimate is not None:
                tree_estimate.relax(self.tree_acceptance.values)
        else:
            _fold(request.acceptance, self.acceptance, num_drafts, spine_accepted)
            if tree_estimate is not None:
                _fold(tree_estimate, self.tree_acceptance, num_drafts, num_accepted)
        if request.lookup_acceptance is not None:
            if branch is not None:
                _fold(request.lookup_acceptance, self.lookup_acceptance, *branch)
            else:
                request.lookup_acceptance.relax(self.lookup_acceptance.values)

    def end_step(self, plan: Plan) -> None:
        """After every row was observed: a step where the drafter's acceptance was not observed lets its
        engine-wide estimate recover toward the long run (no lock-out); likewise the token trees' and
        prompt lookup's."""
        lookup = plan.source is DraftSource.LOOKUP
        if self.cost_model is not None and (lookup or not any(plan.num_drafts)):
            self.acceptance.idle_step()
        if self.cost_model is not None and self.spec.tree and not plan.tree:
            self.tree_acceptance.idle_step()
        if self.spec.prompt_lookup_max and not lookup and not any(plan.branches or ()):
            self.lookup_acceptance.idle_step()


def _fold(estimate: AcceptanceEstimate, tracker: AcceptanceTracker, num_drafts: int, num_accepted: int) -> None:
    """A row's verify outcome into its estimate and the engine-wide tracker; without drafts, the row's
    estimate relaxes toward the tracker's."""
    if num_drafts:
        estimate.observe(num_drafts, num_accepted)
        tracker.observe(num_drafts, num_accepted)
    else:
        estimate.relax(tracker.values)


def tree_rows(rows: Iterable[Request]) -> bool:
    """True when these rows can verify token trees: no row's logits processing depends on the tokens
    before a node (a grammar, repetition / frequency / presence penalties, ``min_tokens`` still to
    reach); such a step verifies chains, where each position's history is the drafted prefix."""
    return all(
        r.matcher is None and not r.params.has_penalties and len(r.output_ids) >= r.params.min_tokens for r in rows
    )


def seeded(rows: Iterable[Request]) -> bool:
    """True when a row has its own seed: its text must not depend on load or timings (a greedy one's too:
    in bfloat16 rounding can break a near-tie either way)."""
    return any(r.params.seed is not None for r in rows)
