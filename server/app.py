"""The app factory ``create_app(engine_client, settings)``, its lifespan, and ``serve`` (uvicorn with a
graceful drain on SIGTERM).

Start-up: the server listens at once; the engine thread loads target and drafter meanwhile, so
``/health`` answers 200 and ``/health/ready`` 503 until the model is loaded. Shutdown (SIGTERM or
Ctrl-C): readiness turns 503 and new generation requests get 503, requests in flight finish (up to
``drain_timeout`` seconds), then uvicorn stops and the lifespan stops the engine thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import dflash2
from dflash2.engine import Engine
from server.engine_client import EngineClient
from server.errors import PayloadTooLargeError, error_response, install_error_handlers
from server.routes import api, public
from server.settings import ServerSettings
from server.state import ServerState

logger = logging.getLogger(__name__)

# After the drain, uvicorn gets this long to close connections before it cancels what is left.
_SHUTDOWN_GRACE_SECONDS = 3


class BodySizeLimit:
    """ASGI middleware: 413 for bodies over ``max_bytes`` (by Content-Length, or while reading)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", ())).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(PayloadTooLargeError(self.max_bytes))(scope, receive, send)
            return
        num_bytes = 0

        async def limited_receive() -> Message:
            nonlocal num_bytes
            message = await receive()
            num_bytes += len(message.get("body", b""))
            if num_bytes > self.max_bytes:
                raise PayloadTooLargeError(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)


def create_app(engine_client: EngineClient, settings: ServerSettings) -> FastAPI:
    """The FastAPI app over ``engine_client`` (started by the lifespan, stopped at shutdown)."""
    state = ServerState(settings, engine_client)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine_client.start()
        loading = asyncio.create_task(_become_ready(state))
        try:
            yield
        finally:
            loading.cancel()
            await engine_client.shutdown()
            if state.serving is not None:
                state.serving.close()

    app = FastAPI(
        title="dflash2",
        version=dflash2.__version__,
        summary="OpenAI-compatible speculative-decoding server (DFlash 2)",
        lifespan=lifespan,
    )
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.include_router(api)
    app.include_router(public)
    app.openapi = lambda: _openapi_schema(app)  # type: ignore[method-assign]
    return app


# Paths behind --api-key (the `api` router); /openapi.json declares the bearer scheme for them.
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


def _openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the bearer security scheme on the API paths."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
        schemes["bearer"] = {"type": "http", "scheme": "bearer", "description": "the server's --api-key, if any"}
        for path, operations in schema.get("paths", {}).items():
            if path.startswith(_PROTECTED_PREFIXES):
                for operation in operations.values():
                    operation["security"] = [{"bearer": []}]
        app.openapi_schema = schema
    return app.openapi_schema


async def _become_ready(state: ServerState) -> None:
    try:
        engine = await state.client.wait_loaded()
    except Exception:
        return  # logged by the engine thread; /health and /health/ready report it
    try:
        state.on_engine_loaded(engine)
    except ValueError as exc:  # a setting the loaded model cannot honour (--reasoning-parser): stop with it
        logger.error("%s", exc)
        state.client.load_error = exc


class DrainingServer(uvicorn.Server):
    """uvicorn that drains on the first SIGTERM / SIGINT instead of stopping at once.

    A second signal stops at once (uvicorn's own handling). The server also stops when the engine
    failed to load or stopped for good (a tensor-parallel rank exited), so ``serve`` can report it.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First signal: start draining (flags only: this runs in a signal handler)."""
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + self.state.settings.drain_timeout
            self.state.admission.begin_drain()
        else:
            super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        """Stop once the drain is done or timed out, or the engine failed to load or stopped for good."""
        if self.drain_deadline is not None and not self.should_exit:
            is_drained = self.state.admission.num_in_flight == 0
            if is_drained or time.monotonic() >= self.drain_deadline:
                if not is_drained:
                    logger.warning("drain timeout: %d requests still running", self.state.admission.num_in_flight)
                self.should_exit = True
        if self.state.client.load_error is not None or self.state.client.fatal_error is not None:
            self.should_exit = True
        return await super().on_tick(counter)


def serve(settings: ServerSettings) -> int:
    """Run the server until SIGTERM / Ctrl-C; returns the process exit status."""
    from sse_starlette.sse import AppStatus

    # Streams in flight finish during the drain instead of being cut off by sse-starlette.
    AppStatus.disable_automatic_graceful_drain()
    client = EngineClient(lambda: Engine.from_config(settings.engine))
    app = create_app(client, settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        timeout_graceful_shutdown=_SHUTDOWN_GRACE_SECONDS,
        timeout_keep_alive=int(settings.timeout_keep_alive),
        log_level="info",
    )
    DrainingServer(config, app.state.server).run()
    if client.load_error is not None:
        print(f"dflash2: error: could not load the model: {client.load_error}", file=sys.stderr)
        return 1
    if client.fatal_error is not None:
        print(f"dflash2: error: the engine stopped: {client.fatal_error}", file=sys.stderr)
        return 1
    return 0
