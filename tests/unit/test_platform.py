"""CPUs the process may use, and the thread count the engine sets from them."""

from __future__ import annotations

import os

import pytest
import torch

from dflash2 import platform


@pytest.mark.parametrize(("cpu_max", "expected"), [("max 100000\n", None), ("150000 100000\n", 2), ("50000 100000", 1)])
def test_available_cpus_follows_the_cgroup_quota(tmp_path, cpu_max, expected):
    (tmp_path / "cpu.max").write_text(cpu_max)
    affinity = len(os.sched_getaffinity(0))
    assert platform.available_cpus(str(tmp_path)) == (affinity if expected is None else min(affinity, expected))
    assert platform.available_cpus(str(tmp_path / "missing")) == affinity


def test_configure_threads_caps_torch_default_and_keeps_an_explicit_count(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(platform, "available_cpus", lambda: 1)
        torch.set_num_threads(2)
        assert platform.configure_threads(None) == 1  # a default above the quota comes down
        assert platform.configure_threads(2) == 2  # --threads wins
    finally:
        torch.set_num_threads(before)
