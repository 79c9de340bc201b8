"""The thread governor's choices on synthetic step costs, and the CPU-load reading it uses."""

from __future__ import annotations

import os

import pytest

from dflash2.platform import CpuLoad
from dflash2.threads import MAX_INTERVAL, ThreadGovernor, thread_ladder

SHAPE = (1, 1)  # one decode row, width 1


class Machine:
    """A fake clock and CPU: a step's seconds at each thread count, and what other processes use.

    ``cost[threads]`` is the step time at that count; the clock advances by each step's time.
    """

    def __init__(self, cost: dict[int, float], others: float | None = 0.0) -> None:
        self.now = 0.0
        self.cost = dict(cost)
        self.others = others
        self.applied: list[int] = []

    def governor(self, max_threads: int = 2, watch_load: bool = True) -> ThreadGovernor:
        return ThreadGovernor(
            max_threads,
            set_threads=self.applied.append,
            load=(lambda: self.others) if watch_load else None,
            num_cpus=max_threads,
            clock=lambda: self.now,
        )

    def run(self, governor: ThreadGovernor, steps: int, shape=SHAPE) -> list[int]:
        """Run ``steps`` steps; returns the thread count of each."""
        counts = []
        for _ in range(steps):
            threads = governor.before_step()
            seconds = self.cost[threads]
            self.now += seconds
            governor.after_step(shape, seconds)
            counts.append(threads)
        return counts


def test_ladder():
    assert thread_ladder(2) == (1, 2)
    assert thread_ladder(8) == (1, 2, 4, 8)
    assert thread_ladder(6) == (1, 3, 6)
    with pytest.raises(ValueError, match="at least 2"):
        ThreadGovernor(1, set_threads=lambda n: None)


def test_idle_cores_keep_every_thread_and_probes_grow_rare():
    """One thread is 1.3× slower: probes try it, keep two, and back off to one probe a minute."""
    machine = Machine({2: 0.010, 1: 0.013})
    governor = machine.governor()
    counts = machine.run(governor, 30_000)  # 5 minutes
    assert governor.current == 2 and governor.switches == 0
    assert governor.interval == MAX_INTERVAL
    probe_steps = counts.count(1)
    assert 0 < probe_steps < 0.005 * len(counts)


def test_shared_cores_move_to_one_thread_and_back_when_they_free_up():
    """Two threads collapse when others take the cores (no load reading here: timings only)."""
    machine = Machine({2: 0.010, 1: 0.013}, others=None)
    governor = machine.governor(watch_load=False)
    machine.run(governor, 500)
    assert governor.current == 2
    machine.cost = {2: 0.200, 1: 0.025}  # neighbours start
    counts = machine.run(governor, 200)
    assert governor.current == 1
    assert counts.index(1) < 10  # the slow steps call a probe at once, not at the next interval
    slow_steps = sum(1 for c in counts if c == 2)
    assert slow_steps <= 4 + 2  # the steps that noticed, the probe's first step back
    machine.cost = {2: 0.010, 1: 0.013}  # neighbours gone
    machine.run(governor, 3000)
    assert governor.current == 2


def test_a_load_reading_moves_down_before_any_slow_step_and_blocks_probes_up():
    machine = Machine({2: 0.010, 1: 0.013})
    governor = machine.governor()
    machine.run(governor, 150)  # no probe due yet
    assert governor.current == 2
    machine.others = 1.8  # neighbours take the cores; a step at 2 threads would take 5 s now
    machine.cost = {2: 5.0, 1: 0.025}
    counts = machine.run(governor, 2000)  # 50 s
    assert governor.current == 1
    assert counts.count(2) <= 1  # at most the step before the next load reading
    machine.others = 0.05
    machine.cost = {2: 0.010, 1: 0.013}
    counts = machine.run(governor, 200)
    assert governor.current == 2 and counts.index(2) < 100  # the freed cores call a probe at once


def test_held_steps_run_at_every_thread_whatever_the_load_and_teach_nothing():
    """A seeded request's steps (hold) run at the configured count on busy cores, and the governor's own
    choice is back for the steps after them."""
    machine = Machine({2: 0.010, 1: 0.013})
    governor = machine.governor()
    machine.run(governor, 150)
    machine.others = 1.8
    machine.cost = {2: 0.200, 1: 0.025}
    machine.run(governor, 400)
    assert governor.current == 1
    held = []
    for _ in range(50):
        threads = governor.before_step(hold=True)
        machine.now += machine.cost[threads]
        governor.after_step(SHAPE, machine.cost[threads])
        held.append(threads)
    assert held == [2] * 50 and machine.applied[-1] == 2
    assert governor.current == 1  # 50 slow steps at 2 threads were no reason to move
    assert machine.run(governor, 5) == [1] * 5 and machine.applied[-1] == 1


def test_a_catastrophic_probe_step_ends_the_probe():
    """Timings only: a probe of two threads on shared cores stops after its first slow step."""
    machine = Machine({2: 0.010, 1: 0.013}, others=None)
    governor = machine.governor(watch_load=False)
    governor.current = 1
    machine.cost = {2: 3.0, 1: 0.025}
    counts = machine.run(governor, 5000)
    assert governor.current == 1
    probes = [i for i in range(1, len(counts)) if counts[i] == 2 and counts[i - 1] == 1]
    assert all(counts[i + 1] == 1 for i in probes)  # one step each
    assert len(probes) <= 8  # 2, 4, 8 … 60 s apart over about two minutes


def test_steps_of_other_shapes_and_prefills_do_not_compare():
    """Narrow steps cost less at two threads, wide ones the same at both. The load comes in runs
    of five, so a probe's block at one thread often holds narrow steps while the block at two
    that follows holds wide ones: compared as they are, one thread would look 4× faster."""
    cost = {(1, 1): {2: 0.010, 1: 0.013}, (4, 8): {2: 0.050, 1: 0.050}, None: {2: 0.100, 1: 0.100}}
    machine = Machine({})
    governor = machine.governor()
    for index in range(30_000):
        shape = [(1, 1), (4, 8)][index // 5 % 2] if index % 11 else None  # None: a step with a prefill
        threads = governor.before_step()
        machine.now += cost[shape][threads]
        governor.after_step(shape, cost[shape][threads])
    assert governor.current == 2 and governor.switches == 0


def test_more_threads_stop_at_the_ladder_top():
    machine = Machine({8: 0.010, 4: 0.011, 2: 0.016, 1: 0.030})
    governor = machine.governor(max_threads=8)
    counts = machine.run(governor, 20_000)
    assert governor.current == 8
    assert set(counts) <= {8, 4}


def test_cpu_load_reads_others_from_proc_stat(tmp_path, monkeypatch):
    cpus = sorted(os.sched_getaffinity(0))
    stat = tmp_path / "stat"

    def write(busy: int) -> None:
        lines = ["cpu  1 1 1 1 1 1 1 1 0 0"] + [f"cpu{i} {busy} 0 0 100 0 0 0 0 0 0" for i in cpus]
        stat.write_text("\n".join(lines) + "\n")

    clock = iter([10.0, 11.0, 12.0])
    monkeypatch.setattr("dflash2.platform.time.monotonic", lambda: next(clock))
    monkeypatch.setattr("dflash2.platform.os.times", lambda: os.times_result((5.0, 0.0, 0.0, 0.0, 0.0)))
    write(0)
    load = CpuLoad(str(stat))
    assert load.num_cpus == len(cpus)
    ticks = os.sysconf("SC_CLK_TCK")
    write(ticks)  # every CPU busy for one second, none of it ours
    assert load.others() == pytest.approx(len(cpus))
    assert load.others() == 0.0  # nothing since
    assert CpuLoad(str(tmp_path / "missing")).others() is None


def test_cpu_load_counts_an_excluded_process_as_its_own(tmp_path, monkeypatch):
    """The background compile worker runs only on idle cores: its CPU time is not a neighbour's, also
    after it has exited (its last reading stays counted, so the load does not jump)."""
    cpus = sorted(os.sched_getaffinity(0))
    stat = tmp_path / "stat"
    ticks = os.sysconf("SC_CLK_TCK")

    def write(busy: int) -> None:
        lines = [f"cpu{i} {busy} 0 0 100 0 0 0 0 0 0" for i in cpus]
        stat.write_text("\n".join(lines) + "\n")

    worker = {"seconds": 0.0}  # the worker's CPU-seconds; None once it has exited
    clock = iter([10.0, 11.0, 12.0, 13.0])
    monkeypatch.setattr("dflash2.platform.time.monotonic", lambda: next(clock))
    monkeypatch.setattr("dflash2.platform.os.times", lambda: os.times_result((5.0, 0.0, 0.0, 0.0, 0.0)))
    monkeypatch.setattr(CpuLoad, "_process_seconds", lambda self, pid: worker["seconds"] if pid == 4242 else None)
    write(0)
    load = CpuLoad(str(stat))
    load.exclude(4242)
    worker["seconds"] = 1.0  # the worker used one core for the second, another process the rest
    write(ticks)
    assert load.others() == pytest.approx(len(cpus) - 1)
    worker["seconds"] = None  # it exited
    write(2 * ticks)
    assert load.others() == pytest.approx(len(cpus))  # its last reading stays: no negative jump


def test_start_up_settles_on_the_threads_that_fit_the_free_cores():
    """Compiling and timing the step costs on busy cores at every thread took minutes."""
    busy = Machine({2: 5.0, 1: 0.025}, others=1.7)
    governor = busy.governor()
    assert governor.settle(sleep=lambda seconds: None) == 1
    assert busy.applied == [1] and governor.current == 1
    idle = Machine({2: 0.010, 1: 0.013}, others=0.1)
    governor = idle.governor()
    assert governor.settle(sleep=lambda seconds: None) == 2 and idle.applied == []


@pytest.mark.parametrize("threads", [0, -1])
def test_a_thread_count_below_one_is_refused(threads):
    from dflash2.config import EngineConfig

    with pytest.raises(ValueError, match="--threads"):
        EngineConfig(num_threads=threads)
