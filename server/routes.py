"""HTTP routes: thin handlers that parse, call ``serving`` and return.

Dependencies are ``async`` on purpose: FastAPI would run plain functions on its thread pool.

Generation handlers run until the client disconnects (``until_disconnected``): a client that
goes away cancels the handler, which aborts its engine requests. Streams are watched by
sse-starlette, which cancels the stream generator the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import Awaitable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

import dflash2
from server.errors import AuthenticationError, ServiceUnavailableError
from server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from server.responses import retrieval
from server.responses.protocol import ResponseObject, ResponsesRequest
from server.responses.retrieval import DeletedResponse, ResponseItemList
from server.responses.serving import ResponsesServing
from server.responses.store import ResponseStore
from server.serving import OpenAIServing
from server.state import ServerState

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first" (only ever logged)

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "Invalid request (the error names the field), or context_length_exceeded"),
        (401, "Missing or wrong API key"),
        (404, "Unknown model, or unknown stored response"),
        (413, "Request body too large"),
        (429, "Too many requests in flight"),
        (500, "The engine failed on this request"),
        (503, "The model is loading or the server is draining"),
    )
}


async def server_state(request: Request) -> ServerState:
    """The shared state of the app serving this request."""
    state: ServerState = request.app.state.server
    return state


State = Annotated[ServerState, Depends(server_state)]


async def ready_serving(state: State) -> OpenAIServing:
    """The serving layer; 503 while the model loads or the server drains."""
    if state.admission.is_draining:
        raise ServiceUnavailableError("the server is shutting down")
    if state.serving is None:
        raise ServiceUnavailableError("the model is still loading")
    return state.serving


async def check_api_key(request: Request, state: State) -> None:
    """With ``--api-key``: ``Authorization: Bearer <key>`` or 401."""
    expected = state.settings.api_key
    if expected is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise AuthenticationError("missing or invalid API key (send 'Authorization: Bearer <key>')")


async def until_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """Run ``work``; if the client disconnects first, cancel it (aborting its engine requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()  # a finished handler wins, so a returned stream is always run (and closed)
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return Response(status_code=CLIENT_CLOSED_REQUEST)


Serving = Annotated[OpenAIServing, Depends(ready_serving)]


async def response_store(state: State) -> ResponseStore:
    """The Responses API's response store; 503 while the model loads (it is built with the serving layer)."""
    if state.responses is None:
        raise ServiceUnavailableError("the model is still loading")
    return state.responses


Store = Annotated[ResponseStore, Depends(response_store)]


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# With stream: true the same 200 is a server-sent event stream of chunks, ending with `data: [DONE]`.
_SSE_ALTERNATIVE: dict[str, Any] = {
    "description": "JSON, or with stream: true server-sent events (chunk objects, then data: [DONE])",
    "content": {"text/event-stream": {"schema": {"type": "string"}}},
}
# The same for the Responses API, whose stream has named events and no [DONE].
_RESPONSES_SSE_ALTERNATIVE: dict[str, Any] = {
    "description": "JSON, or with stream: true server-sent events (event: <type>, data: <event object>)",
    "content": {"text/event-stream": {"schema": {"type": "string"}}},
}

api = APIRouter(dependencies=[Depends(check_api_key)], responses=ERROR_RESPONSES)
public = APIRouter()


@api.post(
    "/v1/chat/completions",
    response_model=None,
    responses={200: {"model": ChatCompletionResponse, **_SSE_ALTERNATIVE}},
)
async def create_chat_completion(body: ChatCompletionRequest, request: Request, serving: Serving) -> Response:
    """OpenAI chat completions (``stream: true`` for server-sent events)."""
    return await until_disconnected(request, serving.create_chat_completion(body))


@api.post(
    "/v1/completions",
    response_model=None,
    responses={200: {"model": CompletionResponse, **_SSE_ALTERNATIVE}},
)
async def create_completion(body: CompletionRequest, request: Request, serving: Serving) -> Response:
    """OpenAI text completions; ``prompt`` is text or a list of token ids."""
    return await until_disconnected(request, serving.create_completion(body))


@api.post(
    "/v1/responses",
    response_model=None,
    responses={200: {"model": ResponseObject, **_RESPONSES_SSE_ALTERNATIVE}},
)
async def create_response(body: ResponsesRequest, request: Request, serving: Serving, store: Store) -> Response:
    """OpenAI Responses API (``stream: true`` for server-sent events); stored unless ``store: false``, and
    continued with ``previous_response_id``."""
    return await until_disconnected(request, ResponsesServing(serving, store).create_response(body))


@api.get("/v1/responses/{response_id}", response_model=ResponseObject)
async def retrieve_response(
    response_id: str,
    request: Request,
    store: Store,
    stream: bool = False,
) -> JSONResponse:
    """A stored response, as it was sent (404 when unknown, expired, evicted or deleted); ``include`` (or
    ``include[]``, as the openai client sends it) as in ``POST``."""
    query = request.query_params
    retrieval.check_query(query, retrieval.RETRIEVE_PARAMS)
    return JSONResponse(retrieval.retrieve(store, response_id, retrieval.include(query), stream, query.keys()))


@api.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request, store: Store) -> DeletedResponse:
    """Forget a stored response."""
    retrieval.check_query(request.query_params, ())
    return retrieval.delete(store, response_id)


@api.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    request: Request,
    store: Store,
    limit: Annotated[int, Query(ge=1, le=retrieval.MAX_INPUT_ITEMS_LIMIT)] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> ResponseItemList:
    """The items a stored response was generated from (with ``previous_response_id``: the whole conversation
    before its output), a page at a time; ``include`` as in ``POST``."""
    query = request.query_params
    retrieval.check_query(query, retrieval.INPUT_ITEMS_PARAMS)
    return retrieval.list_input_items(store, response_id, limit, order, after, retrieval.include(query))


@api.get("/v1/models")
async def list_models(serving: Serving) -> ModelList:
    """The served model, with ``max_model_len``."""
    return serving.list_models()


@api.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, serving: Serving) -> ModelCard:
    """One model by name (404 unless it is the served one)."""
    return serving.retrieve_model(model_id)


@api.post("/tokenize")
async def tokenize(body: TokenizeRequest, serving: Serving) -> TokenizeResponse:
    """Token ids of a prompt, or of messages after the chat template."""
    return await serving.tokenize(body)


@api.post("/detokenize")
async def detokenize(body: DetokenizeRequest, serving: Serving) -> DetokenizeResponse:
    """Text of a list of token ids."""
    return await serving.detokenize(body)


@public.get("/health", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
async def health(state: State) -> JSONResponse:
    """Liveness: the engine thread is running (also while the model loads)."""
    client = state.client
    is_alive = client.is_alive and client.load_error is None and client.fatal_error is None
    return JSONResponse({"status": "ok" if is_alive else "dead"}, status_code=200 if is_alive else 503)


@public.get("/health/ready", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
async def ready(state: State) -> JSONResponse:
    """Readiness: target and drafter loaded and not draining (the compiled graphs may still be building in the
    background: the eager forwards serve meanwhile; ``--wait-for-compile`` waits for them)."""
    status = state.readiness
    return JSONResponse({"status": status}, status_code=200 if status == "ready" else 503)


@public.get("/metrics", response_class=Response)
async def metrics(state: State) -> Response:
    """Prometheus metrics (docs/server.md lists every one)."""
    return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)


@public.get("/version")
async def version() -> VersionResponse:
    """The dflash2 version."""
    return VersionResponse(version=dflash2.__version__)
