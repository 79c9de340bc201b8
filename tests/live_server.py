"""The embedded SmolLM2 behind a real uvicorn server on loopback, shared by ``tests/server`` and
``tests/deploy`` (the ``smollm2`` and ``real_server`` fixtures in ``tests/conftest.py`` build on it)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import torch
import uvicorn

from dflash2.config import EngineConfig
from dflash2.engine import Engine
from dflash2.models import loader, source
from dflash2.runner.model_setup import untrained_default_drafter
from server.app import create_app
from server.engine_client import EngineClient
from server.settings import ServerSettings
from server.state import ServerState

REAL_MAX_NUM_SEQS = 8
REAL_MAX_MODEL_LEN = 512


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
        # Full blocks: with the untrained drafter the adaptive policy would rightly stop drafting at all.
        defaults = {
            "max_num_seqs": REAL_MAX_NUM_SEQS,
            "max_model_len": REAL_MAX_MODEL_LEN,
            "speculative_adaptive": False,
        }
        engine_config = EngineConfig(
            block_size=block_size, device="cpu", dtype="float32", enforce_eager=True, **{**defaults, **config}
        )
        return Engine(
            engine_config, self.target, self.tokenizer, drafter, self.eos_token_ids, source.EMBEDDED_MODEL_NAME
        )


def load_smollm2() -> SmolLM2:
    """Load the embedded model (fp32, CPU)."""
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
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=0,
            log_level="warning",
            timeout_graceful_shutdown=2,
            timeout_keep_alive=int(self.state.settings.timeout_keep_alive),
        )
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
