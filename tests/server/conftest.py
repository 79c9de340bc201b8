"""Fixtures for server tests: an ASGI client over a fake engine, and a real uvicorn server on loopback
running the embedded SmolLM2 (loaded once per test session)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import torch
import uvicorn

from dflash2.config import EngineConfig
from dflash2.engine import Engine, untrained_default_drafter
from dflash2.models import loader, source
from server.app import create_app
from server.engine_client import EngineClient
from server.settings import ServerSettings
from server.state import ServerState
from tests.server.fakes import FakeEngine

REAL_MAX_NUM_SEQS = 8
REAL_MAX_MODEL_LEN = 512


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


# ---- the real model --------------------------------------------------------------------------------


@dataclass
class SmolLM2:
    """The embedded model, loaded once: tokenizer, target and EOS ids."""

    tokenizer: Any
    target: Any
    eos_token_ids: list[int]

    def engine(self, drafter: Any = "untrained", block_size: int | None = None, **config: Any) -> Engine:
        """An engine over the shared target (each engine has its own KV caches)."""
        if drafter == "untrained":
            drafter = untrained_default_drafter(self.target, torch.float32, torch.device("cpu"))
        defaults = {"max_num_seqs": REAL_MAX_NUM_SEQS, "max_model_len": REAL_MAX_MODEL_LEN}
        engine_config = EngineConfig(block_size=block_size, device="cpu", dtype="float32", **{**defaults, **config})
        return Engine(
            engine_config, self.target, self.tokenizer, drafter, self.eos_token_ids, source.EMBEDDED_MODEL_NAME
        )


@pytest.fixture(scope="session")
def smollm2() -> SmolLM2:
    folder = source.resolve_model(None)
    tokenizer = loader.load_tokenizer(folder)
    target = loader.load_target(folder, torch.float32, torch.device("cpu"))
    return SmolLM2(tokenizer, target, list(loader.eos_token_ids(folder, tokenizer)))


class ServerThread:
    """uvicorn on 127.0.0.1 (a free port) in a background thread."""

    def __init__(self, engine: Engine, **settings: Any) -> None:
        self.app = create_app(EngineClient.from_engine(engine), ServerSettings(**settings))
        self.state: ServerState = self.app.state.server
        self.engine = engine
        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)
        self.url = ""

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not (self.server.started and self.state.serving is not None):
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="session")
def real_server(smollm2: SmolLM2) -> Iterator[ServerThread]:
    """The embedded model (untrained default drafter, block size 8) behind uvicorn."""
    with ServerThread(smollm2.engine(), max_concurrency=64) as server:
        yield server


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``/metrics`` as {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0, interval: float = 0.05) -> None:
    """Poll ``predicate`` (blocking) until it holds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(interval)
