"""Adaptive speculation: each step's verify width from live acceptance and the measured step cost.

A verify forward over R rows of width W (the anchor and W − 1 drafts) costs about the same whatever
each row does with its W positions (rows are padded to one width), so the choice is the batch's
width W ∈ 1 … B, each row then verifying ``min(W − 1, its limit)`` drafts. W = 1 is a plain
autoregressive step: no drafter forward at all.

For each candidate W the policy predicts

    rate(W) = Σ_r E_r[committed tokens | W − 1 drafts] / T(R, W)

and takes the best, where

- ``E_r[k] = 1 + Σ_{j=1..k} Π_{i≤j} a_r,i`` with ``a_r,i`` row r's estimated probability that draft
  i is accepted when drafts 1 … i−1 were (an exponentially weighted average of its own verify
  outcomes, started from the engine-wide recent average, and drawn back toward it on steps without
  drafts so a row is re-tried; docs/dflash2-spec.md §5.2's τ is E[W − 1] for a full block). The engine-wide recent
  average is in turn drawn back toward the drafter's long-run acceptance (all outcomes so far) on
  steps where no row drafts: otherwise a hard stretch of text that stops every row from drafting
  would freeze the estimates where that stretch left them, and the engine would never draft again
  (:class:`AcceptanceTracker`);
- ``T(R, W)`` is the step's seconds: the verify forward (+ sampling) at R rows and width W, plus the
  drafter forward over a W-token block and the selector walk at R rows when W > 1 (the drafter runs
  only the block the step verifies, ``DraftRunner.propose``). It is measured at start-up on the actual
  machine and shapes (``ModelRunner.measure_costs``) and scaled, per row count, by what live steps
  measure (:class:`CostModel`).

With token trees on (``--speculative-topk`` > 1) a drafted width W may also verify a tree W − 1 deep:
its E_r comes from the row's per-depth *tree* acceptance and its T from the tree tables
(:meth:`CostModel.tree_seconds`), and the policy takes the best of no draft, chains and trees
(``dflash2/engine/policy.py``, docs/engine.md "Token trees").

Only the block length changes, so outputs stay exactly as lossless as with a fixed block (a shorter
block is a valid block; the choice depends on past steps only). One exception keeps a guarantee: a
*seeded* request always verifies the full block, so its text does not depend on the load.
Peers: vLLM V0's ``speculative_disable_by_batch_size`` (all or nothing above a batch size), llama.cpp's
``--draft-p-min`` (stop drafting below a probability).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# Starting acceptance per draft position before anything is observed: optimistic enough that the
# first steps speculate (and so measure acceptance).
PRIOR_ACCEPTANCE = 0.6
# The same for token trees, per depth: a tree keeps the first-ranked path and adds the runners-up, so it
# starts more optimistic than a chain (otherwise a tree, dearer to verify, is never tried and never learnt).
TREE_PRIOR_ACCEPTANCE = 0.7
ROW_ALPHA = 0.15  # weight of a row's newest verify outcome in its estimate
# Per step without drafts, how far a row's estimate moves back toward the engine-wide one: a row that
# stopped drafting after a bad patch is re-tried instead of staying autoregressive for good.
RELAX_RATE = 0.1
GLOBAL_ALPHA = 0.05  # weight of any row's outcome in the engine-wide estimate
# The long-run acceptance starts as this many observations at PRIOR_ACCEPTANCE per position.
PRIOR_OBSERVATIONS = 20
COST_ALPHA = 0.1  # weight of a new step timing in the cost table
# A step timing counts as at most this many times (at least 1 / this) the current factor: a host hiccup
# (a step 3–5× slower than its neighbours) then moves a factor by 10 %, not 20–40 %.
COST_CLIP = 2.0
# Per step without drafts at a row count, how far its learned drafting factors move back toward its
# autoregressive factor: a few slow drafted steps cannot stop drafting for good (nothing would correct
# them), and a row count where drafting really loses re-tries it now and then (docs/engine.md).
COST_RELAX = 0.002


def expected_tokens(acceptance: Sequence[float], num_drafts: int) -> float:
    """Expected tokens one verify step commits with ``num_drafts`` drafts: the bonus or correction
    token plus each draft whose whole prefix is accepted (``acceptance[i]``: P(draft i+1 accepted |
    drafts 1..i accepted))."""
    return expected_tokens_with_branch(acceptance, num_drafts, (), 0)


def expected_tokens_with_branch(
    acceptance: Sequence[float], num_drafts: int, branch_acceptance: Sequence[float], branch_drafts: int
) -> float:
    """Expected tokens of a tree step that also verifies a prompt-lookup branch: the tree's drafts
    (``acceptance``, ``num_drafts`` deep) and the branch's (``branch_acceptance``, ``branch_drafts``
    long) both hang from the anchor, and the step commits the longer accepted path, so

        E = 1 + Σ_j P(either path accepted to depth j) ≥ 1 + Σ_j max(S_tree(j), S_branch(j))

    with ``S(j)`` a path's survival to depth j (the product of its conditional acceptances). The
    policy takes the lower bound: the two are strongly correlated (a branch that agrees with the
    drafter's first tokens merges into the tree), so adding them as independent chances would
    overrate the step. Without a branch (``branch_drafts`` 0) this is :func:`expected_tokens`."""
    total, tree, branch = 1.0, 1.0, 1.0
    for i in range(max(num_drafts, branch_drafts)):
        tree *= acceptance[i] if i < min(num_drafts, len(acceptance)) else 0.0
        branch *= branch_acceptance[i] if i < min(branch_drafts, len(branch_acceptance)) else 0.0
        total += max(tree, branch)
    return total


def observed_positions(
    num_drafts: int, num_accepted: int, skip: Sequence[bool] | None = None
) -> list[tuple[int, float]]:
    """What a verify step with ``num_drafts`` drafts and ``num_accepted`` accepted tells about each
    draft position: ``(i, 1.0)`` for the accepted ones, ``(i, 0.0)`` for the first rejected one (if
    drafted); later positions were not reached, so they are not observed. Positions where ``skip`` is
    True (grammar-forced drafts, which another source proposed) say nothing about this source."""
    reached = range(min(num_accepted + 1, num_drafts))
    return [(i, 1.0 if i < num_accepted else 0.0) for i in reached if skip is None or i >= len(skip) or not skip[i]]


@dataclass
class AcceptanceEstimate:
    """Per-position conditional acceptance, updated from verify outcomes by exponential averaging.

    Attributes:
        values: ``[B − 1]`` estimates in [0, 1].
        alpha: the weight of a new observation.
    """

    values: list[float]
    alpha: float = ROW_ALPHA

    def observe(self, num_drafts: int, num_accepted: int, skip: Sequence[bool] | None = None) -> None:
        """A verify step with ``num_drafts`` drafts accepted ``num_accepted``: positions before it were
        accepted, the one after it (if drafted) rejected; later positions, and those ``skip`` marks, are not
        observed."""
        for i, seen in observed_positions(num_drafts, num_accepted, skip):
            self.values[i] += self.alpha * (seen - self.values[i])

    def relax(self, toward: Sequence[float], rate: float = RELAX_RATE) -> None:
        """Move every position ``rate`` of the way to ``toward`` (a step that observed nothing)."""
        for i, target in enumerate(toward):
            self.values[i] += rate * (target - self.values[i])


class AcceptanceTracker:
    """The engine-wide acceptance: a recent estimate (new rows start from it, idle rows relax toward
    it) and the long-run per-position rate of every outcome so far, toward which the recent estimate
    relaxes on steps where no row drafts.

    Without that second pull the policy can lock itself out: a stretch of poorly drafted text lowers
    the recent estimate until no row drafts, after which nothing is observed and the estimate never
    recovers, so the engine decodes autoregressively for good (seen at batch 1 on chat prompts: the
    recent estimate for draft 1 stuck at 0.27 while the drafter's rate there was 0.48).

    Args:
        num_positions: draft positions (B − 1).
        prior: the acceptance assumed before anything is observed.
        prior_observations: how many observations the prior counts as in the long-run rate.
    """

    def __init__(
        self, num_positions: int, prior: float = PRIOR_ACCEPTANCE, prior_observations: int = PRIOR_OBSERVATIONS
    ) -> None:
        self.recent = AcceptanceEstimate([prior] * num_positions, alpha=GLOBAL_ALPHA)
        self._accepted = [prior * prior_observations] * num_positions
        self._observed = [float(prior_observations)] * num_positions

    @property
    def values(self) -> list[float]:
        """The recent estimate per position (what a new row starts from)."""
        return self.recent.values

    @property
    def long_run(self) -> list[float]:
        """Accepted ÷ observed per position over the engine's life (prior included)."""
        return [a / n for a, n in zip(self._accepted, self._observed)]

    def observe(self, num_drafts: int, num_accepted: int, skip: Sequence[bool] | None = None) -> None:
        """One row's verify outcome (see :meth:`AcceptanceEstimate.observe`)."""
        self.recent.observe(num_drafts, num_accepted, skip)
        for i, seen in observed_positions(num_drafts, num_accepted, skip):
            self._observed[i] += 1.0
            self._accepted[i] += seen

    def idle_step(self, rate: float = RELAX_RATE) -> None:
        """A decode step where no row drafted: move the recent estimate ``rate`` of the way to the long run."""
        self.recent.relax(self.long_run, rate)


@dataclass
class CostModel:
    """Seconds of one decode step by rows R and verify width W (``seconds(R, W)``).

    ``verify[(R, W)]`` and ``draft[(R, W)]`` (drafter forward over a W-token block + selector, W ≥ 2)
    are the start-up measurements at a few row counts, interpolated in between (linearly in R): they
    give the shape of the cost over widths. Live steps then learn, per row count, how far the machine
    is from that shape: one factor for autoregressive steps (W = 1), one for the verify forward of
    drafted steps (any W > 1) and one for the drafter (any W), each an exponential average of
    measured ÷ start-up seconds. So one step at W = 5 corrects the prediction for every W ≥ 2 at
    that row count (longer contexts than at start-up, a slower host, another thread count), instead
    of the policy trusting the optimistic start-up figure of each width it has not tried yet — which
    made it draft under load, where drafting loses. A row count that has not drafted yet borrows
    drafting's factors (:meth:`seconds`). Token-tree steps have tables and factors of their own
    (``tree_verify``, ``tree_draft``, :meth:`seed_tree`, :meth:`tree_seconds`, :meth:`observe_tree`).
    """

    max_rows: int
    widths: tuple[int, ...]
    verify: dict[tuple[int, int], float] = field(default_factory=dict)
    draft: dict[tuple[int, int], float] = field(default_factory=dict)
    verify_scale: dict[tuple[int, bool], float] = field(default_factory=dict)
    draft_scale: dict[int, float] = field(default_factory=dict)
    tree_verify: dict[tuple[int, int], float] = field(default_factory=dict)
    tree_draft: dict[tuple[int, int], float] = field(default_factory=dict)
    tree_verify_scale: dict[int, float] = field(default_factory=dict)
    tree_draft_scale: dict[int, float] = field(default_factory=dict)

    def seed(self, verify: dict[tuple[int, int], float], draft: dict[tuple[int, int], float]) -> None:
        """Fill every (R, W) from measurements at some row counts (linear interpolation in R; beyond the
        last, proportional to R).

        At each measured row count the drafted widths' verify and drafting times (W ≥ 2) are first
        made non-decreasing in W (a wider forward does more work; :func:`monotone`): a width timed
        fast by chance at start-up (seen: 20.7 ms at width 4 between 22.3 at 3 and 21.5 at 5) would
        otherwise be preferred for the engine's whole life, since live steps rescale every drafted
        width by one factor. Width 1 keeps its own time: it has its own live factor.
        """
        self._fill(self.verify, self.draft, verify, draft, self.widths)

    def seed_tree(self, verify: dict[tuple[int, int], float], draft: dict[tuple[int, int], float]) -> None:
        """Fill the token-tree step's tables as :meth:`seed` fills the chain's: ``verify[(R, W)]`` the tree
        verify forward over the node budget of a width-W step (``EngineSpec.tree_budget``) with the tree's
        build and acceptance, ``draft[(R, W)]`` the drafter's block with the lattice's log-probabilities."""
        self._fill(self.tree_verify, self.tree_draft, verify, draft, tuple(w for w in self.widths if w > 1))

    def _fill(
        self,
        verify_table: dict[tuple[int, int], float],
        draft_table: dict[tuple[int, int], float],
        verify: dict[tuple[int, int], float],
        draft: dict[tuple[int, int], float],
        widths: Sequence[int],
    ) -> None:
        verify, draft = _monotone_in_width(verify), _monotone_in_width(draft)
        for width in widths:
            known = {r: t for (r, w), t in verify.items() if w == width}
            drafting = {r: t for (r, w), t in draft.items() if w == width}
            for rows in range(1, self.max_rows + 1):
                verify_table[(rows, width)] = _interpolate(known, rows)
                if width > 1:
                    draft_table[(rows, width)] = _interpolate(drafting, rows)

    def seconds(self, rows: int, width: int) -> float:
        """Predicted seconds of a step (inf when never measured).

        A drafted step's factors, until learned, are borrowed: the verify factor from the
        autoregressive steps at the same row count (the machine is that much slower or faster at that
        batch), the drafter's from the mean of the row counts that have drafted (its live cost is about
        the same multiple of the start-up timing at every row count). So a row count the policy has
        not drafted at is not predicted from the optimistic start-up figures alone. Borrowing only
        ever goes toward drafting's costs: an autoregressive step keeps its own factor, or it would
        rise with drafting's and drafting would never look worse.
        """
        verify = self.verify_seconds(rows, width)
        if width == 1:
            return verify
        return verify + self.draft.get((rows, width), math.inf) * self._draft_factor(rows)

    def verify_seconds(self, rows: int, width: int) -> float:
        """Predicted seconds of the verify forward alone (inf when never measured): a step's whole
        cost at width 1, or when its ``width − 1`` drafts need no drafter forward (prompt lookup,
        ``dflash2/spec/prompt_lookup.py``)."""
        return self.verify.get((rows, width), math.inf) * self._verify_factor(rows, width > 1)

    def tree_seconds(self, rows: int, width: int) -> float:
        """Predicted seconds of a token-tree step whose deepest drafts sit ``width − 1`` after the anchor
        (:meth:`seconds` at width 1; inf when never measured). Its factors, until learned, are borrowed
        from the chain's drafted steps at the same row count (:meth:`seconds`)."""
        if width == 1:
            return self.seconds(rows, 1)
        verify = self.tree_verify.get((rows, width), math.inf) * self._tree_factor(rows)
        return verify + self.tree_draft.get((rows, width), math.inf) * self.tree_draft_scale.get(
            rows, self._draft_factor(rows)
        )

    def observe_tree(self, rows: int, width: int, verify_seconds: float, draft_seconds: float) -> None:
        """Fold one token-tree step's timings into its row count's tree factors (as :meth:`observe`)."""
        self.tree_verify_scale[rows] = _learned(
            self._tree_factor(rows), verify_seconds, self.tree_verify.get((rows, width), 0.0)
        )
        self.tree_draft_scale[rows] = _learned(
            self.tree_draft_scale.get(rows, self._draft_factor(rows)),
            draft_seconds,
            self.tree_draft.get((rows, width), 0.0),
        )

    def _tree_factor(self, rows: int) -> float:
        return self.tree_verify_scale.get(rows, self._verify_factor(rows, True))

    def observe(self, rows: int, width: int, verify_seconds: float, draft_seconds: float | None) -> None:
        """Fold one step's measured timings into the factors of its row count (a factor learned for
        the first time starts from the value it borrowed; each timing is clipped to ``COST_CLIP``× the
        factor, so one slow step moves it little).

        A step without drafts also draws that row count's learned drafting factors ``COST_RELAX`` of
        the way toward its autoregressive factor, as :meth:`AcceptanceTracker.idle_step` does for
        acceptance: otherwise factors inflated by a few slow drafted steps would stop drafting, and no
        drafted step would ever come to correct them (seen at batch 1: drafter factor 1.74 and
        drafted-verify factor 1.39 against 0.89 for autoregressive steps, and no drafting in 712 steps).
        ``draft_seconds`` None: a step whose drafts came from prompt lookup (no drafter forward), which
        teaches only the drafted verify factor.
        """
        drafted = width > 1
        self.verify_scale[(rows, drafted)] = _learned(
            self._verify_factor(rows, drafted), verify_seconds, self.verify.get((rows, width), 0.0)
        )
        if drafted:
            if draft_seconds is None:  # prompt lookup: a verify forward with drafts, no drafter
                return
            base = self.draft.get((rows, width), 0.0)
            self.draft_scale[rows] = _learned(self._draft_factor(rows), draft_seconds, base)
            return
        plain = self.verify_scale[(rows, False)]
        if (rows, True) in self.verify_scale:
            self.verify_scale[(rows, True)] += COST_RELAX * (plain - self.verify_scale[(rows, True)])
        for scales in (self.draft_scale, self.tree_verify_scale, self.tree_draft_scale):
            if rows in scales:
                scales[rows] += COST_RELAX * (plain - scales[rows])

    def _verify_factor(self, rows: int, drafted: bool) -> float:
        if drafted and (rows, True) not in self.verify_scale:
            return self.verify_scale.get((rows, False), 1.0)
        return self.verify_scale.get((rows, drafted), 1.0)

    def _draft_factor(self, rows: int) -> float:
        if rows in self.draft_scale:
            return self.draft_scale[rows]
        if self.draft_scale:
            return sum(self.draft_scale.values()) / len(self.draft_scale)
        return 1.0


def _learned(scale: float, measured: float, base: float) -> float:
    """``scale`` moved a ``COST_ALPHA`` step toward ``measured ÷ base``, that ratio clipped to
    ``[scale / COST_CLIP, scale · COST_CLIP]`` (unchanged without a base)."""
    if base > 0 and math.isfinite(base):
        ratio = min(max(measured / base, scale / COST_CLIP), scale * COST_CLIP)
        return scale + COST_ALPHA * (ratio - scale)
    return scale


def _monotone_in_width(times: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """``times[(R, W)]`` with each row count's widths ≥ 2 made non-decreasing in W (:func:`monotone`)."""
    times = dict(times)
    for rows in {r for r, _ in times}:
        widths = sorted(w for r, w in times if r == rows and w > 1)
        for width, seconds in zip(widths, monotone([times[(rows, w)] for w in widths])):
            times[(rows, width)] = seconds
    return times


def monotone(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in least squares (pool adjacent violators:
    each run that decreases is replaced by its mean)."""
    blocks: list[list[float]] = []  # [sum, count] per pooled run
    for value in values:
        blocks.append([value, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def _interpolate(known: dict[int, float], rows: int) -> float:
    if not known:
        return math.inf
    if rows in known:
        return known[rows]
    below = [r for r in known if r < rows]
    above = [r for r in known if r > rows]
    if not below:
        return known[min(above)]
    if not above:
        low = max(below)
        return known[low] * rows / low  # beyond the last measurement: proportional to rows
    low, high = max(below), min(above)
    return known[low] + (known[high] - known[low]) * (rows - low) / (high - low)


@dataclass(frozen=True)
class WidthChoice:
    """What the policy chose for one step.

    Attributes:
        width: W, tokens per row in the verify forward (1: no drafting).
        predicted_tokens: Σ_r E_r at that width (what the step is expected to commit).
        rates: predicted committed tokens per second for every candidate width (for inspection).
    """

    width: int
    predicted_tokens: float
    rates: dict[int, float]


def choose_width(
    acceptance: Sequence[Sequence[float]],
    limits: Sequence[int],
    widths: Sequence[int],
    seconds: Callable[[int, int], float],
    min_width: int = 1,
    branches: Sequence[tuple[Sequence[float], int]] | None = None,
) -> WidthChoice:
    """The verify width that maximises predicted committed tokens per second.

    Args:
        acceptance: per row, conditional acceptance per draft position.
        limits: per row, the most drafts it may verify (``max_tokens``, context end).
        widths: candidate widths (each 1 … B).
        seconds: ``seconds(R, W)``, the predicted step time.
        min_width: the narrowest allowed (B when a seeded row needs its full block).
        branches: for a token-tree step that verifies prompt-lookup drafts as one more branch, per row
            the lookup's conditional acceptance and its draft's length (0: none); a row's expected
            tokens are then :func:`expected_tokens_with_branch`'s, the branch cut to the width too.

    Returns:
        The choice; ties go to the narrower width (less compute for the same rate).
    """
    rows = len(acceptance)
    candidates = sorted(w for w in widths if w >= min_width)
    lookup = branches if branches is not None else [((), 0)] * rows

    def predicted(width: int) -> float:
        return sum(
            expected_tokens_with_branch(a, min(width - 1, limit), b, min(width - 1, n))
            for a, limit, (b, n) in zip(acceptance, limits, lookup)
        )

    if all(math.isinf(seconds(rows, w)) for w in candidates):  # nothing measured: the full block
        best = candidates[-1]
        return WidthChoice(best, predicted(best), {})
    rates: dict[int, float] = {}
    tokens: dict[int, float] = {}
    for width in candidates:
        tokens[width] = predicted(width)
        cost = seconds(rows, width)
        rates[width] = tokens[width] / cost if cost > 0 else math.inf
    best = max(rates, key=lambda w: (rates[w], -w))
    return WidthChoice(best, tokens[best], rates)


def choose_lookup_width(
    acceptance: Sequence[Sequence[float]],
    limits: Sequence[int],
    widths: Sequence[int],
    verify_seconds: Callable[[int, int], float],
) -> WidthChoice:
    """The best width for a step whose drafts come from prompt lookup (``dflash2/spec/prompt_lookup.py``):
    :func:`choose_width` over widths ≥ 2 with the verify forward's cost alone (no drafter forward).

    Args:
        acceptance: per row, the conditional acceptance per position of its lookup drafts.
        limits: per row, the most drafts it may verify: its limit and the length of its lookup draft.
        widths: candidate widths; verify_seconds: ``verify_seconds(R, W)``
            (:meth:`CostModel.verify_seconds`).

    Returns:
        The choice; its ``rates[width]`` compares with :func:`choose_width`'s for the drafter.
    """
    return choose_width(acceptance, limits, widths, verify_seconds, min_width=2)
