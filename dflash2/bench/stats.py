"""Pure aggregation of measured samples: medians over repetitions, percentiles, speedups, cost split.

Nothing here times anything: it takes ``GenerationSample`` lists and returns numbers, so the
arithmetic is tested on synthetic inputs.

Definitions (per method, temperature and scope, a scope being one prompt set or ``all``):

- one repetition's speed = its output tokens / its wall seconds, summed over the scope's prompts;
  ``tokens_per_second`` is the median over repetitions, ``ms_per_token`` = 1000 / that median;
- ``tpot_ms`` (time per output token after the first) = median over repetitions of
  Σ(seconds − ttft) / Σ(tokens − 1); ``ttft_ms`` = median over repetitions of the mean TTFT;
- τ = (accepted + verify steps) / verify steps over every repetition; per-position acceptance =
  accepted / drafted at each draft slot (the accepted prefix only, so Σ_j = τ − 1 per step);
- the cost split is per decode step (steps without a prefill; at batch 1 one step is one
  draft–select–verify cycle): draft, select and verify as the engine timed them, other = the
  step's total − the three (commit, stop checks, detokenization, bookkeeping);
- a speedup is a ratio of median tokens/s at the same temperature and scope.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from dflash2.bench.config import BASELINES
from dflash2.bench.runners import GenerationSample

ALL = "all"


@dataclass
class RunRecord:
    """One method over one prompt set at one temperature, in one repetition."""

    method: str
    temperature: float
    prompt_set: str
    repeat: int
    samples: list[GenerationSample]


@dataclass
class SpeedRow:
    """The summary of one (method, temperature, scope)."""

    method: str
    temperature: float
    scope: str
    num_repeats: int
    num_prompts: int
    num_output_tokens: float  # per repetition (mean)
    tokens_per_second: float
    tokens_per_second_min: float
    tokens_per_second_max: float
    ms_per_token: float
    tpot_ms: float
    ttft_ms: float
    tau: float | None = None
    acceptance_per_position: list[float] = field(default_factory=list)
    draft_ms: float | None = None
    select_ms: float | None = None
    select_in_draft: bool = False  # the selector ran inside the drafting graph: its time is in draft_ms
    verify_ms: float | None = None
    other_ms: float | None = None
    speedups: dict[str, float | None] = field(default_factory=dict)

    @property
    def cycle_ms(self) -> float | None:
        """One decode step (draft + select + verify + other), ms."""
        parts = (self.draft_ms, self.select_ms, self.verify_ms, self.other_ms)
        return None if any(p is None for p in parts) else sum(p for p in parts if p is not None)

    def share(self, part_ms: float | None) -> float | None:
        """``part_ms`` as a fraction of the cycle."""
        cycle = self.cycle_ms
        return part_ms / cycle if part_ms is not None and cycle else None

    def to_dict(self) -> dict[str, Any]:
        """JSON view with the cycle."""
        return {**asdict(self), "cycle_ms": self.cycle_ms}


def median(values: Iterable[float]) -> float:
    """Median (0 for no values)."""
    data = list(values)
    return float(statistics.median(data)) if data else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0–100) with linear interpolation between order statistics (0 for no values)."""
    data = sorted(values)
    if not data:
        return 0.0
    rank = (len(data) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return data[low] + (data[high] - data[low]) * (rank - low)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, None when either is missing or the denominator is 0."""
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def _rep_speed(samples: list[GenerationSample]) -> tuple[float, float, float]:
    """(tokens/s, decode ms per token after the first, mean TTFT ms) of one repetition."""
    tokens = sum(s.num_output_tokens for s in samples)
    seconds = sum(s.seconds for s in samples)
    decode_tokens = sum(max(s.num_output_tokens - 1, 0) for s in samples)
    decode_seconds = sum(s.seconds - s.ttft for s in samples)
    tpot = decode_seconds / decode_tokens * 1e3 if decode_tokens else 0.0
    ttft = sum(s.ttft for s in samples) / len(samples) * 1e3 if samples else 0.0
    return (tokens / seconds if seconds else 0.0), tpot, ttft


def _speculative(row: SpeedRow, samples: list[GenerationSample]) -> None:
    """τ, per-position acceptance and the cost split from the engine's counters (no-op for peers)."""
    steps = sum(s.num_verify_steps for s in samples)
    if not steps:
        return
    accepted = sum(s.num_accepted_tokens for s in samples)
    row.tau = (accepted + steps) / steps
    width = max((len(s.accepted_per_position) for s in samples), default=0)
    acc, drafted = [0] * width, [0] * width
    for s in samples:
        for j, (a, d) in enumerate(zip(s.accepted_per_position, s.drafted_per_position)):
            acc[j] += a
            drafted[j] += d
    row.acceptance_per_position = [a / d if d else 0.0 for a, d in zip(acc, drafted)]
    decode_steps = sum(s.num_decode_steps for s in samples)
    if decode_steps:
        draft, select, verify = (
            sum(getattr(s, k) for s in samples) for k in ("draft_time", "select_time", "verify_time")
        )
        total = sum(s.decode_time for s in samples)
        row.draft_ms, row.select_ms, row.verify_ms = (x / decode_steps * 1e3 for x in (draft, select, verify))
        row.select_in_draft = any(s.select_in_draft for s in samples)
        row.other_ms = max(total - draft - select - verify, 0.0) / decode_steps * 1e3


def summarize_group(method: str, temperature: float, scope: str, records: list[RunRecord]) -> SpeedRow:
    """One row from the records of one (method, temperature, scope), any number of repetitions."""
    by_repeat: dict[int, list[GenerationSample]] = {}
    for record in records:
        by_repeat.setdefault(record.repeat, []).extend(record.samples)
    speeds = [_rep_speed(samples) for samples in by_repeat.values()]
    tps = [s[0] for s in speeds]
    tps_median = median(tps)
    all_samples = [s for samples in by_repeat.values() for s in samples]
    row = SpeedRow(
        method=method,
        temperature=temperature,
        scope=scope,
        num_repeats=len(by_repeat),
        num_prompts=len(all_samples) // max(len(by_repeat), 1),
        num_output_tokens=sum(s.num_output_tokens for s in all_samples) / max(len(by_repeat), 1),
        tokens_per_second=tps_median,
        tokens_per_second_min=min(tps, default=0.0),
        tokens_per_second_max=max(tps, default=0.0),
        ms_per_token=1e3 / tps_median if tps_median else 0.0,
        tpot_ms=median(s[1] for s in speeds),
        ttft_ms=median(s[2] for s in speeds),
    )
    _speculative(row, all_samples)
    return row


def summarize(records: list[RunRecord], method_order: Sequence[str]) -> list[SpeedRow]:
    """Rows for every (method, temperature) over all sets (scope ``all``) and per set, with speedups."""
    temperatures = sorted({r.temperature for r in records})
    sets = list(dict.fromkeys(r.prompt_set for r in records))
    rows = []
    for scope in [ALL, *sets]:
        for temperature in temperatures:
            for method in method_order:
                group = [
                    r
                    for r in records
                    if r.method == method and r.temperature == temperature and scope in (ALL, r.prompt_set)
                ]
                if group:
                    rows.append(summarize_group(method, temperature, scope, group))
    add_speedups(rows)
    return rows


def add_speedups(rows: list[SpeedRow], baselines: Sequence[str] = BASELINES) -> None:
    """Set ``row.speedups[b]`` = row tokens/s ÷ baseline b's tokens/s (same temperature and scope)."""
    index = {(r.method, r.temperature, r.scope): r for r in rows}
    for row in rows:
        for baseline in baselines:
            base = index.get((baseline, row.temperature, row.scope))
            row.speedups[baseline] = ratio(row.tokens_per_second, base.tokens_per_second if base else None)


def overhead_share(row: SpeedRow, conv_overhead_ms: float | None) -> float | None:
    """(select + convolution) ms as a fraction of the decode cycle: the DFlash 2 overhead headline (None
    when the selector ran inside the drafting graph, where it is not timed apart)."""
    if row.select_ms is None or row.select_in_draft:
        return None
    return row.share(row.select_ms + (conv_overhead_ms or 0.0))
