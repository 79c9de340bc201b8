"""Shared fixtures: tiny random-weight targets and drafters built in code (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
