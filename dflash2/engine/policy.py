"""The step's plan: where this step's drafts come from (the drafter, prompt lookup, none) and how many
each row verifies, from the adaptive policy's estimates (``dflash2/spec/adaptive.py``); and what the policy
learns from each verify outcome and step timing."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from dflash2.config import EngineSpec
from dflash2.engine.plan import DraftSource, Plan, Verified
from dflash2.engine.request import Request
from dflash2.grammar import forced_tokens
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
from dflash2.spec.suffix import SuffixIndex
from dflash2.spec.tree import TreeCalibration

logger = logging.getLogger(__name__)

# Tokens of context each row has when the adaptive policy's step costs are timed at start-up: a chat
# request's prompt and some answer, so attention's share of the cost is not that of an empty cache.
COST_CONTEXT = 256
# The n-grams (longest … shortest) that find a row's last tokens among earlier outputs (suffix decoding).
SUFFIX_MAX_N, SUFFIX_MIN_N = 6, 2


# The acceptance the policy expects of a grammar-forced draft: the target's masked distribution puts all
# of its mass on the forced bytes, though it may spell them with other tokens than the canonical ones.
FORCED_ACCEPTANCE = 0.98


@dataclass
class FreeDrafts:
    """Per row, the drafts that cost no drafter forward (:meth:`SpeculationPolicy.plan`).

    Attributes:
        drafts: per row, its grammar-forced tokens then its lookup or earlier-output continuation (``[]``:
            none).
        sources: per row, where the continuation comes from (GRAMMAR where there is only the forced part).
        num_forced: per row, how many of its drafts the grammar forced.
    """

    drafts: list[list[int]]
    sources: list[DraftSource]
    num_forced: list[int]


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
        # Token trees: the drafter's log-probabilities calibrated per depth from the trees verified so far.
        self.tree_calibration = TreeCalibration(max(spec.block_size - 1, 1))
        self.lookup_acceptance = AcceptanceTracker(spec.block_size - 1)
        self.suffix_acceptance = AcceptanceTracker(spec.block_size - 1)
        # Drafts from earlier outputs: finished requests' outputs, bounded (dflash2/spec/suffix.py).
        self.suffix_index = (
            SuffixIndex(SUFFIX_MIN_N, SUFFIX_MAX_N, spec.suffix_max_requests, spec.suffix_max_tokens)
            if spec.suffix_max_requests
            else None
        )

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
        if self.suffix_index is not None:
            request.suffix_acceptance = AcceptanceEstimate(list(self.suffix_acceptance.values))

    def finish(self, request: Request) -> None:
        """A request ended: its output joins the earlier-output index (suffix decoding on), after the last
        tokens of its prompt, so that a later request's context before the same output finds it."""
        if self.suffix_index is not None and request.output_ids:
            self.suffix_index.add(request.prompt_ids[-SUFFIX_MAX_N:], request.output_ids)

    # ---- before the step ---------------------------------------------------------------------

    def plan(self, rows: list[Request]) -> Plan:
        """This step's plan for ``rows`` (they decode together); a tree step's carries the calibration
        its beam scores nodes with (:attr:`tree_calibration`).

        See :meth:`_plan`."""
        plan = self._plan(rows)
        if plan.tree:
            return dataclasses.replace(plan, tree_offsets=self.tree_calibration.offsets())
        return plan

    def _plan(self, rows: list[Request]) -> Plan:
        """This step's plan for ``rows``, before the tree calibration is attached.

        With the adaptive policy the candidates are: no draft or a chain of the best width
        (``choose_width``), a token tree of the best width where trees are on, its prediction counting
        the rows' prompt-lookup drafts as the branch they would join (:func:`expected_tokens_with_branch`),
        and the lookup drafts alone, which skip the drafter's forward (``choose_lookup_width``). The step
        takes whichever predicts the most tokens per second."""
        limits = self.num_drafts(rows)
        trees = self.spec.tree and tree_rows(rows)
        forced = self._forced(rows, limits)
        choice = self._choose_width(rows, limits, forced)
        if choice is None:  # no adaptive policy: the full block from the drafter (none at block size 1)
            source = DraftSource.DRAFTER if self.spec.speculative else DraftSource.NONE
            width = self.spec.block_size
            return Plan(source, width, self._drafter_limits(rows, limits, width), tree=trees)
        free = self._free_drafts(rows, limits, forced)
        tree = self._choose_tree(rows, limits, choice, free) if trees else None
        if tree is not None:
            choice = tree
        lookup = self._lookup_plan(rows, limits, choice, free) if free is not None else None
        if lookup is not None:
            return lookup
        source = DraftSource.DRAFTER if choice.width > 1 else DraftSource.NONE
        if tree is None:
            num_drafts = self._drafter_limits(rows, limits, choice.width)
            if source is DraftSource.NONE and any(forced):  # the forced tokens alone, with no drafter forward
                runs = FreeDrafts(forced, [DraftSource.GRAMMAR] * len(rows), [len(f) for f in forced])
                plan = self._lookup_plan(rows, [len(f) for f in forced], choice, runs)
                if plan is not None:
                    return plan
            return Plan(source, choice.width, num_drafts, choice.predicted_tokens)
        num_drafts = [min(n, choice.width - 1) for n in limits]
        # The lookup drafts ride along as a branch of each row's tree: no drafter forward for them, a few
        # more nodes in the same verify.
        assert free is None or not any(forced)  # a grammar row verifies chains
        branches = None if free is None else [d[:n] for d, n in zip(free.drafts, num_drafts)]
        sources = None if free is None else free.sources
        return Plan(
            source, choice.width, num_drafts, choice.predicted_tokens, tree=True, branches=branches, row_sources=sources
        )

    def _forced(self, rows: list[Request], limits: list[int]) -> list[list[int]]:
        """Per row, the tokens its grammar forces next (at most its limit; ``[]`` without a grammar or with
        grammar-forced drafts off)."""
        if not self.spec.grammar_forced_drafts:
            return [[] for _ in rows]
        return [forced_tokens(r.matcher, n) if r.matcher is not None else [] for r, n in zip(rows, limits)]

    def _drafter_limits(self, rows: list[Request], limits: list[int], width: int) -> list[int]:
        """Drafts per row of a drafter step of ``width``: its W − 1, and up to the row's limit for a row with
        a grammar (grammar-forced drafts on), whose walk may go on past the drafter's block with forced
        tokens (``dflash2.grammar.walk_drafts``; the verify is as wide as the walks turn out)."""
        if width == 1:
            return [0] * len(rows)
        grammar = self.spec.grammar_forced_drafts
        return [n if grammar and r.matcher is not None else min(n, width - 1) for r, n in zip(rows, limits)]

    def num_drafts(self, rows: list[Request]) -> list[int]:
        """Drafts each row may verify: never past ``max_tokens`` or the end of its KV slot."""
        limit, length = self.spec.block_size - 1, self.spec.max_model_len
        return [max(0, min(limit, r.remaining_tokens - 1, length - r.num_cached - 1)) for r in rows]

    def _choose_width(self, rows: list[Request], limits: list[int], forced: list[list[int]]) -> WidthChoice | None:
        """The adaptive policy's choice of the verify width with the drafter; None without the policy. A
        row's grammar-forced tokens count as drafts accepted with ``FORCED_ACCEPTANCE`` at their positions."""
        if self.cost_model is None:
            return None
        return choose_width(
            [with_forced(r.acceptance.values, len(f)) for r, f in zip(rows, forced) if r.acceptance is not None],
            limits,
            self.cost_model.widths,
            self.cost_model.seconds,
            min_width=self.spec.block_size if seeded(rows) else 1,
        )

    def _choose_tree(
        self,
        rows: list[Request],
        limits: list[int],
        chain: WidthChoice,
        free: FreeDrafts | None,
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
        if free is not None:
            branches = [(self._free_acceptance(r, s, 0), len(d)) for r, d, s in zip(rows, free.drafts, free.sources)]
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

    def _free_drafts(self, rows: list[Request], limits: list[int], forced: list[list[int]]) -> FreeDrafts | None:
        """Each row's drafts that cost no drafter forward, at most its limit, and their source: the tokens
        its grammar forces, continued by its prompt-lookup draft (``dflash2/spec/prompt_lookup.py``) or,
        where its own tokens have none, by a continuation from earlier outputs (``dflash2/spec/suffix.py``)
        of the tokens so far and the forced ones; empty where there is none. None without the adaptive
        policy, for a seeded row (whether such drafts win would be a timing question), and when no source
        is on."""
        if self.cost_model is None or seeded(rows):
            return None
        if not (self.spec.prompt_lookup_max or self.suffix_index is not None or any(forced)):
            return None
        free = FreeDrafts([], [], [len(run) for run in forced])
        for request, limit, run in zip(rows, limits, forced):
            draft: list[int] = []
            source = DraftSource.GRAMMAR  # the forced run alone, or nothing
            if request.lookup is not None:
                request.lookup.sync(request.output_ids)
                draft = request.lookup.propose(limit - len(run), run)
                source = DraftSource.LOOKUP if draft else source
            if not draft and self.suffix_index is not None:
                tail = [*request.prompt_ids[-SUFFIX_MAX_N:], *request.output_ids[-SUFFIX_MAX_N:], *run]
                draft = self.suffix_index.propose(tail, limit - len(run))
                source = DraftSource.SUFFIX if draft else source
            free.drafts.append([*run, *draft])
            free.sources.append(source)
        return free

    def _free_acceptance(self, request: Request, source: DraftSource, num_forced: int) -> list[float]:
        """The conditional acceptance per position the policy expects of a row's free drafts from
        ``source``, after ``num_forced`` grammar-forced ones."""
        estimate = {DraftSource.LOOKUP: request.lookup_acceptance, DraftSource.SUFFIX: request.suffix_acceptance}.get(
            source
        )
        values = estimate.values if estimate is not None else [0.0] * (self.spec.block_size - 1)
        return [FORCED_ACCEPTANCE] * num_forced + list(values)

    def _lookup_plan(
        self,
        rows: list[Request],
        limits: list[int],
        choice: WidthChoice,
        free: FreeDrafts,
    ) -> Plan | None:
        """A plan without a drafter forward when every row that may draft has free drafts (``free``: prompt
        lookup, earlier outputs, grammar-forced tokens) and verifying them is predicted to commit more tokens
        per second than ``choice``; the limits are cut to each row's free drafts. None otherwise."""
        assert self.cost_model is not None
        drafts = free.drafts
        if not all(d for d, limit in zip(drafts, limits) if limit):
            return None
        lookup_limits = [len(d) for d in drafts]
        lookup = choose_lookup_width(
            [self._free_acceptance(r, s, f) for r, s, f in zip(rows, free.sources, free.num_forced)],
            lookup_limits,
            self.cost_model.widths,
            self.cost_model.verify_seconds,
        )
        if not lookup.rates or lookup.rates[lookup.width] <= choice.rates.get(choice.width, 0.0):
            return None
        span = lookup.width - 1
        num_drafts = [min(n, span) for n in lookup_limits]
        if self.spec.grammar_forced_drafts:  # a grammar row's walk may go on with the forced tokens after them
            full = self.num_drafts(rows)
            num_drafts = [f if r.matcher is not None and n else n for r, n, f in zip(rows, num_drafts, full)]
        proposal = one_hot_proposal([d[:span] for d in drafts], self.spec.device)
        return Plan(
            DraftSource.LOOKUP, lookup.width, num_drafts, lookup.predicted_tokens, proposal, row_sources=free.sources
        )

    # ---- after the step ----------------------------------------------------------------------

    def learn(self, rows: list[Request], verified: Verified, probing: bool = False) -> None:
        """Everything the policy learns from one decode step, in one call: its timings (the cost table,
        :meth:`observe_costs`; not at a probed thread count), each row's acceptance for the source of its
        drafts (:meth:`observe`), the token-tree calibration from every verified tree, and the relaxation
        of the estimates the step did not use (:meth:`end_step`)."""
        plan, num_drafts = verified.plan, verified.drafts_per_row
        drafting = verified.draft_seconds + verified.select_seconds
        self.observe_costs(plan, len(rows), max(num_drafts) + 1, verified.verify_seconds, drafting, probing)
        spine, by_drafter, branches = verified.spine_accepted, verified.tree_accepted, verified.branch_accepted
        for i, request in enumerate(rows):
            # The accepted drafts the drafter proposed (a tree's free-draft branch is taught apart).
            drafted = verified.num_accepted[i] if by_drafter is None else by_drafter[i]
            branch = None
            if branches is not None and (held := branches[i]) is not None:
                assert plan.row_sources is not None
                branch = (plan.row_sources[i], *held)
            source = plan.source_of(i) if plan.source is DraftSource.LOOKUP else DraftSource.DRAFTER
            forced = verified.forced[i] if verified.forced is not None else None
            self.observe(request, num_drafts[i], drafted, source, forced, None if spine is None else spine[i], branch)
            if plan.tree:
                self.tree_calibration.observe(verified.trees[i], verified.accepted_nodes[i])
        self.end_step(plan)

    def observe_costs(
        self, plan: Plan, num_rows: int, width: int, verify_seconds: float, draft_seconds: float, probing: bool
    ) -> None:
        """Fold a decode step's timings into the cost table (not a step at a probed thread count, which is
        not what the table describes; a lookup step's drafting cost is not the drafter's)."""
        if self.cost_model is None or probing:
            return
        if plan.tree:
            self.cost_model.observe_tree(num_rows, plan.width, verify_seconds, draft_seconds)
            return
        draft = None if plan.source is DraftSource.LOOKUP else draft_seconds
        self.cost_model.observe(num_rows, width, verify_seconds, draft)

    def observe(
        self,
        request: Request,
        num_drafts: int,
        num_accepted: int,
        source: DraftSource,
        forced: list[bool] | None = None,
        spine_accepted: int | None = None,
        branch: tuple[DraftSource, int, int] | None = None,
    ) -> None:
        """Fold a row's verify outcome into the estimates for the source of its drafts (the drafter, prompt
        lookup, earlier outputs); a source the step did not use relaxes toward its engine-wide estimate, so
        a row that stopped using a source tries it again later. Grammar-forced drafts (``forced`` marks
        them per draft) teach no estimate: their acceptance is the grammar's, not the source's.

        A token tree's outcome (``spine_accepted`` given: how many of the accepted nodes were first-ranked
        children; ``num_accepted``: the accepted nodes the drafter proposed) teaches both drafter
        estimates: the tree's per depth from the accepted path, the chain's from its first-ranked spine,
        which is the path a chain step would have verified (for greedy rows; a sampled chain walks the
        lattice with its own draws, close to the spine). A free-draft branch verified in the tree
        (``branch``: its source, drafts and how many were accepted) teaches that source's estimate as a step
        of it would. A chain step teaches only the chain's; the tree's then relaxes toward its engine-wide one."""
        if request.acceptance is None:
            return
        tree_estimate = request.tree_acceptance
        taught: DraftSource | None = None
        if source is not DraftSource.DRAFTER:  # a step without a drafter forward
            taught = source
            if source is not DraftSource.GRAMMAR:
                _fold(*self._free_estimates(request, source), num_drafts, num_accepted, forced)
            request.acceptance.relax(self.acceptance.values)
            if tree_estimate is not None:
                tree_estimate.relax(self.tree_acceptance.values)
        elif spine_accepted is None:
            _fold(request.acceptance, self.acceptance, num_drafts, num_accepted, forced)
            if tree_estimate is not None:
                tree_estimate.relax(self.tree_acceptance.values)
        else:
            _fold(request.acceptance, self.acceptance, num_drafts, spine_accepted)
            if tree_estimate is not None:
                _fold(tree_estimate, self.tree_acceptance, num_drafts, num_accepted)
        if branch is not None:
            taught = branch[0]
            _fold(*self._free_estimates(request, branch[0]), branch[1], branch[2])
        for other in (DraftSource.LOOKUP, DraftSource.SUFFIX):
            if other is not taught:
                estimate, tracker = self._free_estimates(request, other)
                if estimate is not None:
                    estimate.relax(tracker.values)

    def _free_estimates(
        self, request: Request, source: DraftSource
    ) -> tuple[AcceptanceEstimate | None, AcceptanceTracker]:
        """The row's and the engine-wide acceptance of prompt lookup's or earlier outputs' drafts."""
        if source is DraftSource.SUFFIX:
            return request.suffix_acceptance, self.suffix_acceptance
        return request.lookup_acceptance, self.lookup_acceptance

    def end_step(self, plan: Plan) -> None:
        """After every row was observed: a step where the drafter's acceptance was not observed lets its
        engine-wide estimate recover toward the long run (no lock-out); likewise the token trees' and
        each free source's."""
        free = plan.source is DraftSource.LOOKUP
        if self.cost_model is not None and (free or not any(plan.num_drafts)):
            self.acceptance.idle_step()
        if self.cost_model is not None and self.spec.tree and not plan.tree:
            self.tree_acceptance.idle_step()
        used = set()
        if plan.row_sources is not None and (free or any(plan.branches or ())):
            used = set(plan.row_sources)
        if self.spec.prompt_lookup_max and DraftSource.LOOKUP not in used:
            self.lookup_acceptance.idle_step()
        if self.suffix_index is not None and DraftSource.SUFFIX not in used:
            self.suffix_acceptance.idle_step()


def _fold(
    estimate: AcceptanceEstimate | None,
    tracker: AcceptanceTracker,
    num_drafts: int,
    num_accepted: int,
    skip: list[bool] | None = None,
) -> None:
    """A row's verify outcome into its estimate and the engine-wide tracker, less the positions ``skip``
    marks; without drafts (or only skipped ones), the row's estimate relaxes toward the tracker's."""
    if estimate is None:
        return
    if num_drafts and not (skip is not None and all(skip[:num_drafts])):
        estimate.observe(num_drafts, num_accepted, skip)
        tracker.observe(num_drafts, num_accepted, skip)
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


def with_forced(acceptance: list[float], num_forced: int) -> list[float]:
    """A row's per-position drafter acceptance with its first ``num_forced`` positions grammar-forced
    (``FORCED_ACCEPTANCE`` there: the drafter's own slot estimates hold for the positions after them)."""
    if not num_forced:
        return acceptance
    return [FORCED_ACCEPTANCE] * num_forced + acceptance[num_forced:]


def one_hot_proposal(drafts: list[list[int]], device: torch.device) -> Proposal:
    """The proposal of drafts chosen without a distribution (copied or forced): one-hot on each draft,
    rows padded to the longest (the padding is never verified)."""
    span = max(map(len, drafts), default=0)
    padded = [(d + [d[-1] if d else 0] * span)[:span] for d in drafts]
    draft_ids = torch.tensor(padded, dtype=torch.long, device=device).view(len(drafts), span)
    return Proposal(draft_ids, draft_ids[..., None], torch.ones(len(drafts), span, 1, device=device))
