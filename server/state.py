"""``ServerState``: what the routes share (settings, engine client, admission, metrics registry) and,
once the engine is loaded, the serving layer."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector

from server.admission import Admission
from server.engine_client import EngineClient
from server.metrics import Metrics
from server.model_info import ModelInfo
from server.responses.store import ResponseStore
from server.serving import OpenAIServing
from server.settings import ServerSettings

if TYPE_CHECKING:
    from dflash2.engine import Engine

logger = logging.getLogger(__name__)


class ServerState:
    """Shared by every route of one app; ``serving``, ``metrics`` and the Responses API's response store
    (``responses``) exist once the engine is loaded."""

    def __init__(self, settings: ServerSettings, client: EngineClient) -> None:
        self.settings = settings
        self.client = client
        self.admission = Admission(settings.max_concurrency)
        self.registry = CollectorRegistry()
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=self.registry)
        self.serving: OpenAIServing | None = None
        self.metrics: Metrics | None = None
        self.responses: ResponseStore | None = None

    @property
    def readiness(self) -> str:
        """``ready``, ``loading``, ``draining`` or ``failed``."""
        if self.client.load_error is not None or (self.serving is not None and not self.client.is_alive):
            return "failed"
        if self.admission.is_draining:
            return "draining"
        return "loading" if self.serving is None else "ready"

    def on_engine_loaded(self, engine: Engine) -> None:
        """Build metrics, the response store and the serving layer for the loaded model; from here on the server is
        ready."""
        model = ModelInfo.from_engine(engine, self.settings.served_model_name)
        self.metrics = Metrics(
            self.registry,
            model.name,
            engine.block_size,
            self.settings.metrics_compat,
            model.max_model_len,
            model.quantization,
        )
        compile_status = getattr(engine, "compile_status", None)
        if compile_status is not None:  # read at every scrape
            self.metrics.watch_compile(lambda: engine.compile_status)
        self.client.observer = self.metrics
        self.responses = ResponseStore(
            self.settings.responses_store_max_entries,
            self.settings.responses_store_max_bytes,
            self.settings.responses_store_ttl,
            on_evict=self.metrics.on_stored_response_evicted,
        )
        self.metrics.watch_response_store(self.responses)
        self.serving = OpenAIServing(
            self.client,
            model,
            self.admission,
            self.settings.tool_call_parser,
            self.settings.stream_send_timeout,
            self.settings.default_parallel_tool_calls,
            self.settings.reasoning_parser,
        )
        logger.info(
            "serving %s (block size %d, max_model_len %d, weights %s%s)",
            model.name,
            engine.block_size,
            model.max_model_len,
            model.quantization,
            ", eager forwards until the background compilation is done"
            if compile_status is not None and compile_status.state == "compiling"
            else "",
        )
