"""Fixtures for server tests: an ASGI client over a fake engine; the real uvicorn server on loopback running
the embedded SmolLM2 (loaded once per test session) comes from ``tests/conftest.py``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
import torch

from server.app import create_app
from server.engine_client import EngineClient
from server.settings import ServerSettings
from server.state import ServerState
from tests.live_server import (  # noqa: F401  (re-exported for the tests in this folder)
    REAL_MAX_NUM_SEQS,
    ServerThread,
    SmolLM2,
    scrape,
    wait_until,
)
from tests.server.fakes import FakeEngine


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """The server runs the event loop and the engine thread side by side (and the tests run clients):
    one intra-op thread avoids oversubscribing the cores, which slows a busy CPU box down several times."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


async def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.01) -> None:
    """Poll ``predicate`` on the event loop until it holds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(interval)


@contextlib.asynccontextmanager
async def asgi_client(engine: Any = None, **settings: Any) -> AsyncIterator[tuple[httpx.AsyncClient, ServerState]]:
    """An httpx client talking ASGI to a fresh app (lifespan run, engine loaded)."""
    app = create_app(EngineClient.from_engine(engine or FakeEngine()), ServerSettings(**settings))
    state: ServerState = app.state.server
    async with app.router.lifespan_context(app):
        await wait_for(lambda: state.serving is not None)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=30) as client:
            yield client, state
