"""Shared fixtures: tiny random-weight targets and drafters built in code (fp32, CPU), and the embedded
SmolLM2 behind a real uvicorn server (loaded once per session, for ``tests/server`` and ``tests/deploy``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from tests.live_server import ServerThread, SmolLM2

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _threads() -> Iterator[None]:
    """An engine's thread governor changes torch's process-wide thread count (on busy cores, to 1);
    later tests get the count back."""
    yield
    if torch.get_num_threads() != 2:
        torch.set_num_threads(2)


@pytest.fixture(scope="session")
def smollm2() -> SmolLM2:
    """The embedded model (imported lazily: most tests never start a server)."""
    from tests.live_server import load_smollm2

    return load_smollm2()


@pytest.fixture(scope="session")
def real_server(smollm2: SmolLM2) -> Iterator[ServerThread]:
    """The embedded model (untrained default drafter, block size 8) behind uvicorn."""
    from tests.live_server import ServerThread

    with ServerThread(smollm2.engine(), max_concurrency=64) as server:
        yield server
