"""The bridge between the async HTTP layer and the synchronous engine.

One dedicated thread loads the engine, then loops ``Engine.step()`` while work exists and sleeps on
a condition otherwise. Each HTTP request submits its choices as one ``RequestGroup``: engine outputs
travel to it through an ``asyncio.Queue`` fed with ``loop.call_soon_threadsafe``, so the event loop
never waits on a tensor. Closing a group before it finished (client gone, error elsewhere) aborts
its engine requests; the engine frees their slots at the start of the next step.

If ``step()`` raises, the requests holding a slot in that step fail with an ``EngineError`` (500 for
them), are aborted in the engine, and the thread keeps serving everything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from dflash2.outputs import RequestOutput, StepStats
from dflash2.sampling import SamplingParams
from server.errors import APIError, EngineError, ServiceUnavailableError
from server.timings import RequestTimings

if TYPE_CHECKING:
    from dflash2.engine import Engine

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT_SECONDS = 30.0
_IDLE_POLL_SECONDS = 1.0  # how often an idle engine thread checks on background compilation


class EngineObserver(Protocol):
    """What the engine client reports (implemented by ``server.metrics.Metrics``)."""

    def on_step(self, stats: StepStats) -> None:
        """After every successful engine step (engine thread)."""

    def on_first_token(self, timings: RequestTimings) -> None:
        """When a request delivers its first token (event loop)."""

    def on_delivery(self, interval: float) -> None:
        """When a request delivers tokens again, ``interval`` seconds after the previous delivery."""

    def on_request_finished(self, timings: RequestTimings) -> None:
        """When a request finishes, is aborted or fails (event loop)."""


class RequestGroup:
    """The engine requests (one per choice) behind one HTTP request, read as one async stream.

    Iterating yields ``(choice index, RequestOutput)`` until every choice has finished, and raises
    an ``APIError`` when the engine failed on one of them. ``close()`` is idempotent and aborts
    the choices that have not finished.
    """

    def __init__(self, client: EngineClient, num_prompt_tokens: int, max_tokens: Sequence[int]) -> None:
        """One choice per entry of ``max_tokens`` (each choice's limit as submitted to the engine)."""
        num_choices = len(max_tokens)
        arrival = time.monotonic()
        self.request_ids: list[str] = []
        self.timings = [RequestTimings(arrival, num_prompt_tokens, limit) for limit in max_tokens]
        self._client = client
        self._queue: asyncio.Queue[tuple[int, RequestOutput] | APIError] = asyncio.Queue()
        self._is_finished = [False] * num_choices
        self._num_unread = num_choices
        self._is_closed = False

    def __aiter__(self) -> RequestGroup:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if self._num_unread == 0:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, APIError):
            raise item
        if item[1].finished:
            self._num_unread -= 1
        return item

    def deliver(self, index: int, output: RequestOutput) -> None:
        """Queue one engine output (event loop)."""
        if output.error is not None:
            self.fail(index, EngineError(f"the engine could not run this request: {output.error}"))
            return
        if output.finished:
            self._is_finished[index] = True
        self._queue.put_nowait((index, output))

    def fail(self, index: int, error: APIError) -> None:
        """End choice ``index`` with an error that the reader receives (event loop)."""
        self._is_finished[index] = True
        self._queue.put_nowait(error)

    def close(self) -> None:
        """Abort unfinished choices in the engine; the group reads nothing more."""
        if self._is_closed:
            return
        self._is_closed = True
        unfinished = [i for i, done in enumerate(self._is_finished) if not done]
        self._client.abort([self.request_ids[i] for i in unfinished if i < len(self.request_ids)])
        for i in unfinished:
            self._is_finished[i] = True


class EngineClient:
    """Owns the engine thread; ``submit`` / ``abort`` / ``shutdown`` are called from the event loop.

    Args:
        load_engine: builds the engine; runs on the engine thread, so the server can answer
            ``/health`` while a large model loads.
        owns_engine: :meth:`shutdown` closes the engine (it was built for this client); False for an
            engine the caller loaded and keeps (:meth:`from_engine`), which the caller closes.
    """

    def __init__(self, load_engine: Callable[[], Engine], owns_engine: bool = True) -> None:
        self.owns_engine = owns_engine
        self.engine: Engine | None = None
        self.load_error: BaseException | None = None
        self.fatal_error: str | None = None  # why a loaded engine stopped for good (a tensor-parallel rank exited)
        self.observer: EngineObserver | None = None
        self._load_engine = load_engine
        self._wakeup = threading.Condition()
        self._is_stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loaded: asyncio.Future[Engine] | None = None
        self._routes: dict[str, tuple[RequestGroup, int]] = {}  # event loop only

    @classmethod
    def from_engine(cls, engine: Engine) -> EngineClient:
        """A client for an engine that is already loaded; the caller keeps it (and closes it)."""
        return cls(lambda: engine, owns_engine=False)

    # ---- lifecycle (event loop) -------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (it loads the engine first); call from the event loop."""
        self._loop = asyncio.get_running_loop()
        self._loaded = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, name="dflash2-engine", daemon=True)
        self._thread.start()

    async def wait_loaded(self) -> Engine:
        """The engine once loaded; raises what loading raised."""
        assert self._loaded is not None, "start() first"
        return await asyncio.shield(self._loaded)

    @property
    def is_alive(self) -> bool:
        """True while the engine thread runs (loading or serving)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        """Engine requests submitted and not yet finished or aborted."""
        return len(self._routes)

    async def shutdown(self) -> None:
        """Stop the engine thread and fail whatever is still in flight."""
        with self._wakeup:
            self._is_stopping = True
            self._wakeup.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, _JOIN_TIMEOUT_SECONDS)
        if self.engine is not None and self.owns_engine:
            await asyncio.to_thread(self.engine.close)  # stops tensor-parallel workers, if any
        error = ServiceUnavailableError("the server is shutting down")
        for group, index in list(self._routes.values()):
            group.fail(index, error)
        self._routes.clear()

    # ---- requests (event loop) --------------------------------------------------------------------

    def submit(self, prompt_ids: Sequence[int], params: Sequence[SamplingParams], request_id: str) -> RequestGroup:
        """Queue one engine request per choice (ids ``{request_id}-{i}``).

        Raises:
            ValueError / dflash2.errors.ContextLengthExceededError: from ``Engine.add_request``;
                choices already queued are aborted.
        """
        engine = self.engine
        if engine is None:
            raise ServiceUnavailableError("the model is still loading")
        group = RequestGroup(self, len(prompt_ids), [p.max_tokens for p in params])
        try:
            for index, choice_params in enumerate(params):
                engine_id = engine.add_request(prompt_ids, choice_params, request_id=f"{request_id}-{index}")
                group.request_ids.append(engine_id)
                self._routes[engine_id] = (group, index)
        except BaseException:
            group.close()
            raise
        self._notify()
        return group

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort engine requests (their final outputs are dropped); records them as aborted."""
        if not request_ids:
            return
        now = time.monotonic()
        for request_id in request_ids:
            route = self._routes.pop(request_id, None)
            if route is not None:
                self._finish_timings(route[0].timings[route[1]], "abort", now)
            if self.engine is not None and not self.engine.is_closed:  # a closed engine holds no request
                self.engine.abort(request_id)
        self._notify()

    # ---- engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            engine = self._load_engine()
        except BaseException as exc:
            # ModelSourceError / ModelLoadError (ValueError) say what to do; anything else is a bug worth a trace.
            logger.error("loading the engine failed: %s", exc, exc_info=not isinstance(exc, ValueError))
            self.load_error = exc
            self._call_soon(_settle, self._loaded, None, exc)
            return
        self.engine = engine
        engine.add_failure_listener(self._on_fatal)
        self._call_soon(_settle, self._loaded, engine, None)
        while self._wait_for_work(engine):
            self._step(engine)
        if self.fatal_error is not None:
            logger.error("the engine stopped: %s", self.fatal_error)
            self._call_soon(self._fail, None, EngineError(f"the engine stopped: {self.fatal_error}"))

    def _on_fatal(self, message: str) -> None:
        """The engine cannot go on (called from another thread): the engine thread ends, the server stops."""
        with self._wakeup:
            self.fatal_error = message
            self._wakeup.notify_all()

    def _wait_for_work(self, engine: Engine) -> bool:
        """Sleep until a request is in the engine (True) or the thread is to stop (False). While the engine
        has background work between steps (``Engine.compile_pending``: the compiled graphs to load when
        the worker is done, the step costs to time again), wake up every ``_IDLE_POLL_SECONDS`` to do it
        here, outside the lock, so an idle server reaches full speed without waiting for a request."""
        while True:
            with self._wakeup:
                if self._is_stopping or self.fatal_error is not None:
                    return False
                if engine.has_unfinished_requests():
                    return True
                idle_work = bool(getattr(engine, "compile_pending", False))
                self._wakeup.wait(_IDLE_POLL_SECONDS if idle_work else None)
                if self._is_stopping or self.fatal_error is not None or engine.has_unfinished_requests():
                    continue
            if idle_work:
                try:
                    engine.poll_compile(idle=True)
                except Exception:  # never ends the engine thread: the engine serves eagerly
                    logger.exception("loading the compiled graphs failed")

    def _step(self, engine: Engine) -> None:
        started = time.monotonic()
        try:
            result = engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing the requests it was running")
            failed = engine.running_request_ids()
            for request_id in failed:
                engine.abort(request_id)
            error = EngineError(f"the engine failed while running this request ({type(exc).__name__})")
            self._call_soon(self._fail, failed or None, error)
            return
        if self.observer is not None:
            self.observer.on_step(result.stats)
        if result.outputs:
            self._call_soon(self._dispatch, result.outputs, started)

    def _call_soon(self, callback: Callable[..., object], *args: object) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting any more
            self._loop.call_soon_threadsafe(callback, *args)

    def _notify(self) -> None:
        with self._wakeup:
            self._wakeup.notify()

    # ---- delivery (event loop) --------------------------------------------------------------------

    def _dispatch(self, outputs: list[RequestOutput], step_started: float) -> None:
        now = time.monotonic()
        for output in outputs:
            route = self._routes.get(output.request_id)
            if route is None:  # aborted or failed already
                continue
            group, index = route
            self._record(group.timings[index], output, step_started, now)
            if output.finished:
                del self._routes[output.request_id]
            group.deliver(index, output)

    def _fail(self, request_ids: list[str] | None, error: APIError) -> None:
        """Fail the given requests; None = every request in flight (a failure with nobody running)."""
        now = time.monotonic()
        for request_id in list(self._routes) if request_ids is None else request_ids:
            route = self._routes.pop(request_id, None)
            if route is None:
                continue
            group, index = route
            self._finish_timings(group.timings[index], "error", now)
            group.fail(index, error)
            if request_ids is None and self.engine is not None:
                self.engine.abort(request_id)
        self._notify()

    def _record(self, timings: RequestTimings, output: RequestOutput, step_started: float, now: float) -> None:
        if output.new_token_ids:
            if timings.first_token is None:
                timings.scheduled, timings.first_token = step_started, now
                if self.observer is not None:
                    self.observer.on_first_token(timings)
            elif self.observer is not None and timings.last_token is not None and now > timings.last_token:
                # Outputs of one step arrive together (prefill + first verify): one delivery, no interval.
                self.observer.on_delivery(now - timings.last_token)
            timings.last_token = now
            timings.num_output_tokens += len(output.new_token_ids)
        if output.finished:
            self._finish_timings(timings, "error" if output.error else output.finish_reason, now)

    def _finish_timings(self, timings: RequestTimings, reason: str | None, now: float) -> None:
        if timings.finished is not None:
            return
        timings.finished, timings.finish_reason = now, reason
        if self.observer is not None:
            self.observer.on_request_finished(timings)


def _settle(future: asyncio.Future[Engine] | None, engine: Engine | None, error: BaseException | None) -> None:
    if future is None or future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        assert engine is not None
        future.set_result(engine)
