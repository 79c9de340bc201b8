"""Server-sent event streams, framed one way for every endpoint: an error after the stream started is one error
event (the endpoint's own kind), chat and completions end with ``data: [DONE]`` even after it, and the generation
is closed however the stream ends (a client that went away aborts it)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask

from server.errors import error_kind
from server.generation import Generation

logger = logging.getLogger(__name__)

E = TypeVar("E")  # one event: an encoded JSON string, or a ServerSentEvent with its own ``event:`` name
SSE_PING_SECONDS = 15
DONE = "[DONE]"  # the last event of chat and completion streams


def event_stream(
    events: AsyncIterator[E],
    generation: Generation,
    on_error: Callable[[Exception], E],
    done: E | None,
    send_timeout: float,
) -> EventSourceResponse:
    """The SSE response for a generation's events, framed by ``framed``.

    Args:
        events: the endpoint's events, in order.
        generation: closed when the stream ends; the background task also closes a stream whose generator
            never started.
        on_error: the error event for an exception raised by ``events``.
        done: the event that always ends the stream (``DONE``), or None.
        send_timeout: seconds one event may wait for the client before the stream ends (0: forever).

    Returns:
        The streaming response.
    """
    return EventSourceResponse(
        framed(events, generation, on_error, done),
        sep="\n",
        ping=SSE_PING_SECONDS,
        send_timeout=send_timeout or None,
        background=BackgroundTask(generation.close),
    )


async def framed(
    events: AsyncIterator[E], generation: Generation, on_error: Callable[[Exception], E], done: E | None = None
) -> AsyncIterator[E]:
    """``events``, then ``done`` when given; an exception becomes one ``on_error`` event (logged when it is a 500)
    and the generation is closed however the stream ends."""
    try:
        async for event in events:
            yield event
    except Exception as exc:
        if error_kind(exc).status == 500:
            logger.error("stream %s failed", generation.id, exc_info=exc)
        yield on_error(exc)
    finally:
        generation.close()
    if done is not None:
        yield done
