"""CPU threads when other processes share the cores: the engine's thread count, chosen from timed steps.

torch runs a CPU op on a team of OpenMP threads that meet at a barrier when the op ends. When other
processes keep the cores busy, one member of the team is descheduled and the whole op waits for its
next time slice; a forward runs hundreds of ops. On 2 cores with two busy neighbours, a 24-token
decode of SmolLM2 (compiled, bfloat16) took 1.0–15 s with 2 threads and 0.4–0.6 s with 1; on idle
cores 2 threads are faster (0.26 s against 0.35 s). No fixed count is right for both, and OpenMP's
own remedies (a passive wait policy, a short spin count) cost 2× on idle cores (docs/engine.md,
"Threads").

So the engine measures. :class:`ThreadGovernor` runs now and then a few decode steps with a
neighbouring thread count, each followed by a step with the current count (the pair has the same
shape: rows and verify width, no prefill), and moves to the neighbour when it was faster by a clear
margin. Probes are rare once a count has held (the interval doubles up to a minute); a step with
the current count that runs much slower than before (a neighbour started) calls a probe at once.
The thread count changes no token: the kernels' results do not depend on it beyond float rounding,
and sampling does not depend on it at all.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

FIRST_INTERVAL = 2.0  # seconds between probes after a change; doubles while the count holds
MAX_INTERVAL = 60.0
BLOCK_STEPS = 5  # steps a probe runs at the other count, then at the current one
# Move when the other count's steps took at most this fraction of the current count's (in total, so a
# rare very slow step weighs what it costs). More threads must win by more: too many threads on shared
# cores cost up to 30× (the 15 s above), too few on idle cores 1.1–1.35×.
FEWER_RATIO = 0.9
MORE_RATIO = 0.85
ABORT_RATIO = 4.0  # a probe step this much slower than the last current-count step of its shape ends the probe
SLOWDOWN_RATIO = 1.5  # current-count steps this much slower than before call a probe …
SLOWDOWN_STEPS = 3  # … after this many in a row
REFERENCE_ALPHA = 0.1  # how fast the per-shape reference follows ordinary drift (longer contexts)
LOAD_PERIOD = 0.5  # seconds between reads of what other processes use (``CpuLoad``)
FIT_MARGIN = 0.5  # a thread count fits when the cores others leave free are at least count − this


def thread_ladder(max_threads: int) -> tuple[int, ...]:
    """The counts the governor chooses from: ``max_threads`` halved down to 1 (8 → 1, 2, 4, 8; 6 → 1, 3, 6)."""
    counts = {1}
    threads = max_threads
    while threads > 1:
        counts.add(threads)
        threads //= 2
    return tuple(sorted(counts))


@dataclass
class _Probe:
    """One probe in progress: a block of steps at ``other``, then a block at the current count."""

    other: int
    at_other: bool = True  # the block being run
    other_steps: list[tuple[Hashable, float]] = field(default_factory=list)  # (shape, seconds)
    current_steps: list[tuple[Hashable, float]] = field(default_factory=list)
    steps: int = 0
    outcome: float | None = None  # the ratio, when one step already decided it (0 or inf)

    def ratio(self) -> float:
        """Time at ``other`` ÷ time at the current count over the shapes both blocks ran (each block's
        first step left out: it pays for the switch, e.g. waking a sleeping thread); inf when the
        blocks have no shape in common."""
        if self.outcome is not None:
            return self.outcome
        other, current = _by_shape(self.other_steps[1:]), _by_shape(self.current_steps[1:])
        other_total = current_total = 0.0
        for shape in other.keys() & current.keys():
            count = min(len(other[shape]), len(current[shape]))
            other_total += count * statistics.fmean(other[shape])
            current_total += count * statistics.fmean(current[shape])
        return other_total / current_total if current_total > 0 else math.inf


def _by_shape(steps: list[tuple[Hashable, float]]) -> dict[Hashable, list[float]]:
    grouped: dict[Hashable, list[float]] = {}
    for shape, seconds in steps:
        grouped.setdefault(shape, []).append(seconds)
    return grouped


@dataclass
class ThreadGovernor:
    """Chooses torch's intra-op thread count among :func:`thread_ladder` from paired step timings.

    Call :meth:`before_step` before each engine step (it sets the count that step runs with) and
    :meth:`after_step` after it with the step's shape and seconds.

    Where it can see what other processes use on this process's CPUs (``load``, e.g.
    :meth:`dflash2.platform.CpuLoad.others`), the governor probes when that changes (fewer threads
    as soon as others take cores, more as soon as they leave them) and never tries a count that
    does not fit in the free cores: with the cores taken, one step at too many threads can take
    seconds.

    Attributes:
        max_threads: the most threads (the configured count).
        set_threads: applies a count (``torch.set_num_threads``; a stand-in in tests).
        load: cores other processes used since the previous call, or None when unknown; None: not watched.
        num_cpus: the CPUs this process may run on (what ``load`` is measured against).
        clock: monotonic seconds.
        current: the count steps run with outside probes.
        switches: how often ``current`` changed.
    """

    max_threads: int
    set_threads: Callable[[int], None]
    load: Callable[[], float | None] | None = None
    num_cpus: int = 0
    clock: Callable[[], float] = time.monotonic
    first_interval: float = FIRST_INTERVAL
    max_interval: float = MAX_INTERVAL
    block_steps: int = BLOCK_STEPS
    current: int = 0
    switches: int = 0
    interval: float = 0.0
    next_probe: float = 0.0
    _ladder: tuple[int, ...] = ()
    _applied: int = 0
    _probe: _Probe | None = None
    _direction: int = -1  # the next probe goes down (-1) or up (+1) the ladder, where both ways exist
    _reference: dict[Hashable, float] = field(default_factory=dict)  # seconds per shape at ``current`` (smoothed)
    _last: dict[Hashable, float] = field(default_factory=dict)  # the last step's seconds per shape at ``current``
    _slow_steps: int = 0
    _free: float | None = None  # cores others left free at the last read (None: unknown)
    _next_load_read: float = 0.0
    _held: bool = False  # the last step ran at max_threads for a seeded request (before_step's hold)

    def __post_init__(self) -> None:
        if self.max_threads < 2:
            raise ValueError("a thread governor needs at least 2 threads to choose from")
        self._ladder = thread_ladder(self.max_threads)
        self.current = self._applied = self.max_threads
        self.interval = self.first_interval
        self.next_probe = self.clock() + self.interval

    def settle(self, window: float = 0.25, sleep: Callable[[float], None] = time.sleep) -> int:
        """Before start-up work (compiling, timing the step costs): read what other processes use over
        ``window`` seconds, move to the most threads that fit in the free cores, and apply it. Without
        this, start-up on busy cores ran at every thread and took minutes. Returns the count."""
        if self.load is not None:
            self.load()  # the window starts now
            sleep(window)
            self._read_load()
            self._next_load_read = self.clock() + LOAD_PERIOD
        if self._applied != self.current:
            self.set_threads(self.current)
            self._applied = self.current
        return self.current

    @property
    def probing(self) -> bool:
        """True while the step about to run (or just run) uses another count than :attr:`current` (or was
        held at ``max_threads``)."""
        return self._applied != self.current

    def before_step(self, hold: bool = False) -> int:
        """Set the thread count of the next step (a probe starts here when one is due); returns it.

        ``hold``: the step runs at ``max_threads`` whatever the load (a seeded request runs: its
        rounding, and so its text, must not follow the load); it starts no probe and teaches nothing."""
        self._held = hold
        if hold:
            if self._applied != self.max_threads:
                self.set_threads(self.max_threads)
                self._applied = self.max_threads
            return self.max_threads
        now = self.clock()
        if self.load is not None and now >= self._next_load_read:
            self._next_load_read = now + LOAD_PERIOD
            self._read_load()
        if self._probe is None and now >= self.next_probe:
            other = self._neighbour()
            if self._fits(other) or other < self.current:
                self._probe = _Probe(other=other)
            else:  # the cores are taken: trying more threads could cost seconds
                self.next_probe = now + self.interval
        threads = self.current
        if self._probe is not None and self._probe.at_other:
            threads = self._probe.other
        if threads != self._applied:
            self.set_threads(threads)
            self._applied = threads
        return threads

    def after_step(self, shape: Hashable | None, seconds: float) -> None:
        """Record the step just run.

        Args:
            shape: what makes two steps' times comparable (decode rows and verify width), or None
                for a step that is not (a prefill in it, nothing decoded).
            seconds: the step's wall time.
        """
        if self._held:
            return
        probe = self._probe
        if probe is None:
            if shape is not None:
                self._observe_current(shape, seconds)
            return
        probe.steps += 1
        if shape is not None:
            if probe.at_other:
                # More threads far slower: stop here (on shared cores one such step can take seconds).
                # Fewer threads are never that slow, but their first step may wait for the released
                # thread to be scheduled, so it decides nothing.
                last = self._last.get(shape)
                if probe.other > self.current and last is not None and seconds > ABORT_RATIO * last:
                    probe.outcome = math.inf
                probe.other_steps.append((shape, seconds))
                probe.at_other = len(probe.other_steps) < self.block_steps
            else:
                probe.current_steps.append((shape, seconds))
                self._observe_current(shape, seconds)
                other_best = min((t for s, t in probe.other_steps if s == shape), default=math.inf)
                if seconds > ABORT_RATIO * other_best:  # far slower than at the other count: no need to wait
                    probe.outcome = 0.0
        done = len(probe.current_steps) >= self.block_steps or probe.steps >= 4 * self.block_steps
        if probe.outcome is not None or done:
            self._decide(probe)

    # ---- internals ------------------------------------------------------------------------------

    def _fits(self, threads: int) -> bool:
        return self._free is None or self._free >= threads - FIT_MARGIN

    def _read_load(self) -> None:
        assert self.load is not None
        others = self.load()
        if others is None:
            self._free = None
            return
        up_fitted = self._fits(self._up())
        self._free = max(0.0, self.num_cpus - others)
        if self._probe is not None:
            if self._fits(self._probe.other) or self._probe.other < self.current:
                return
            self._probe = None  # a probe of more threads than now fit
            self.next_probe = self.clock() + self.interval
        if not self._fits(self.current) and self.current > self._ladder[0]:
            # Others took cores: move down at once. Checking first would mean steps at the current count,
            # and those are what can take seconds now; if this was wrong, the next probe up finds out.
            fitting = [t for t in self._ladder if t < self.current and self._fits(t)] or [self._ladder[0]]
            self._switch(fitting[-1], f"other processes use {others:.1f} of {self.num_cpus} cores")
        elif not up_fitted and self._fits(self._up()) and self.current < self._ladder[-1]:  # cores came free
            self._direction, self.next_probe, self.interval = 1, self.clock(), self.first_interval

    def _switch(self, threads: int, reason: str) -> None:
        logger.info("CPU threads %d → %d: %s", self.current, threads, reason)
        self.current = threads
        self.switches += 1
        self.interval = self.first_interval
        self.next_probe = self.clock() + self.interval
        self._last.clear()
        self._reference.clear()
        self._slow_steps = 0

    def _up(self) -> int:
        index = self._ladder.index(self.current)
        return self._ladder[min(index + 1, len(self._ladder) - 1)]

    def _neighbour(self) -> int:
        index = self._ladder.index(self.current)
        if index == 0:
            return self._ladder[1]
        if index == len(self._ladder) - 1:
            return self._ladder[index - 1]
        direction, self._direction = self._direction, -self._direction  # the probe after this one goes the other way
        return self._ladder[index + direction]

    def _observe_current(self, shape: Hashable, seconds: float) -> None:
        self._last[shape] = seconds
        reference = self._reference.get(shape)
        if reference is None:
            self._reference[shape] = seconds
            return
        # Slower steps with threads to spare: a neighbour may have started; probe fewer threads now.
        # (At the fewest there is nothing to try: more threads only help when cores come free.)
        if seconds > SLOWDOWN_RATIO * reference and self.current > self._ladder[0]:
            self._slow_steps += 1
            if self._slow_steps >= SLOWDOWN_STEPS or seconds > ABORT_RATIO * reference:  # something changed: look now
                logger.debug("steps of shape %s slowed from %.4f s to %.4f s: probing", shape, reference, seconds)
                self._slow_steps = 0
                self.next_probe = self.clock()
                self.interval = self.first_interval
                self._direction = -1  # the probe goes down
            return
        self._slow_steps = 0
        self._reference[shape] = reference + REFERENCE_ALPHA * (seconds - reference)

    def _decide(self, probe: _Probe) -> None:
        self._probe = None
        ratio = probe.ratio()
        if ratio <= (FEWER_RATIO if probe.other < self.current else MORE_RATIO):
            self._switch(probe.other, f"steps took {ratio:.2f}× as long with {probe.other}")
            return
        self.interval = min(2 * self.interval, self.max_interval)
        self.next_probe = self.clock() + self.interval
        # Steps from now on are the new baseline (the load may have changed what a step costs).
        self._reference.clear()
        self._slow_steps = 0
