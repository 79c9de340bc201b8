"""Stored responses over HTTP: what a request stores as its input items, what ``previous_response_id`` continues,
and ``GET`` / ``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items`` (OpenAI's shapes: the
Response object, ``{"id", "object": "response", "deleted": true}``, and a cursor list of items).

Errors: an unknown (never stored, expired, evicted or deleted) id is a 404 ``response_not_found`` naming it and
saying why when the store still knows; as ``previous_response_id`` it is OpenAI's 400
``previous_response_not_found``, which clients answer by sending the whole conversation.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Iterable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.datastructures import QueryParams

from server.errors import InvalidRequestError, PreviousResponseNotFoundError, ResponseNotFoundError
from server.responses.protocol import InputItem, InputMessage, ResponsesRequest, check_include
from server.responses.store import JSONObject, ResponseStore, StoredResponse

# Prefixes of the ids given to input items sent without one (as OpenAI's).
_ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
_INPUT_ITEM = TypeAdapter(InputItem)

# Retrieval parameters of OpenAI's that only apply to streaming a background response back.
_STREAM_RETRIEVAL_PARAMS = ("starting_after", "include_obfuscation")
# ``include`` comes as ``include=a&include=b``, or ``include[]=a&include[]=b`` from the openai client.
_INCLUDE_PARAMS = ("include", "include[]")
RETRIEVE_PARAMS = (*_INCLUDE_PARAMS, "stream", *_STREAM_RETRIEVAL_PARAMS)
INPUT_ITEMS_PARAMS = (*_INCLUDE_PARAMS, "after", "limit", "order")
MAX_INPUT_ITEMS_LIMIT = 100


class ResponseItemList(BaseModel):
    """``GET /v1/responses/{id}/input_items``: one page of a response's input items."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedResponse(BaseModel):
    """``DELETE /v1/responses/{id}``."""

    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


def input_items_json(request: ResponsesRequest) -> list[JSONObject]:
    """The request's own input as the items stored with its response (and listed by ``input_items``): a string
    is one user message; messages get their content as parts; every item gets an ``id`` (``msg_…``, ``fc_…``,
    ``fco_…``, ``rs_…``) unless it has one. What these items render to is what the request's input rendered to.
    """
    items: Sequence[BaseModel] = (
        [InputMessage(role="user", content=request.input)] if isinstance(request.input, str) else request.input
    )
    return [_item_json(item) for item in items]


def _item_json(item: BaseModel) -> JSONObject:
    data = item.model_dump(mode="json", by_alias=True, exclude_none=True)
    if data.get("type") == "message" and isinstance(data.get("content"), str):
        part = {"type": "input_text", "text": data["content"]}
        if data["role"] == "assistant":
            part = {"type": "output_text", "text": data["content"], "annotations": []}
        data["content"] = [part]
    item_id = data.pop("id", None) or f"{_ITEM_ID_PREFIXES.get(data.get('type', ''), 'item')}_{uuid.uuid4().hex}"
    return {"id": item_id, **data}


def previous_context(store: ResponseStore, previous_response_id: str) -> tuple[JSONObject, ...]:
    """The items a response continuing ``previous_response_id`` is generated from before its own input: that
    response's input items, then its output items.

    Raises:
        PreviousResponseNotFoundError: no such stored response (400 ``previous_response_not_found``, naming the
            id and, when the store knows, why: expired, evicted, deleted).
    """
    entry = store.get(previous_response_id)
    if entry is None:
        raise PreviousResponseNotFoundError(
            f"Previous response with id '{previous_response_id}' not found: {store.why_missing(previous_response_id)}",
            "previous_response_id",
        )
    return entry.context


def continued(request: ResponsesRequest, context: Sequence[JSONObject]) -> ResponsesRequest:
    """``request`` with ``context`` (stored items) before its own input; the request itself when there is none.

    Raises:
        InvalidRequestError: a stored item this server cannot take back as input (naming
            ``previous_response_id``).
    """
    if not context:
        return request
    try:
        items = [_INPUT_ITEM.validate_python(item) for item in context]
    except ValidationError as exc:
        raise InvalidRequestError(
            "the previous response holds an item this server cannot take back as input", "previous_response_id"
        ) from exc
    own = [InputMessage(role="user", content=request.input)] if isinstance(request.input, str) else request.input
    return request.model_copy(update={"input": [*items, *own]})


def include(query: QueryParams) -> list[str]:
    """The ``include`` entries of a query string (``include`` and ``include[]`` both count)."""
    return [entry for name in _INCLUDE_PARAMS for entry in query.getlist(name)]


def check_query(names: Iterable[str], known: Collection[str]) -> None:
    """Query parameters must be known ones, as body fields must.

    Raises:
        InvalidRequestError: naming the first unknown parameter.
    """
    for name in names:
        if name not in known:
            raise InvalidRequestError(f"Unrecognized query parameter supplied: {name}", name)


def retrieve(
    store: ResponseStore, response_id: str, include: Sequence[str] | None, stream: bool, given: Collection[str]
) -> JSONObject:
    """``GET /v1/responses/{id}``: the stored Response object as it was sent.

    ``stream: true`` is a 400: OpenAI streams a *background* response back while it runs, and this server runs
    none (a stored response is complete); ``starting_after`` and ``include_obfuscation`` only apply to that.

    Raises:
        InvalidRequestError: ``stream: true``, a streaming-only parameter (``given`` are the query's names), or an
            ``include`` entry that is not served.
        ResponseNotFoundError: no such stored response.
    """
    if stream:
        raise InvalidRequestError(
            "stream: true is not supported: it streams a background response back while it runs, and this server "
            "runs no background responses (a stored response is complete: retrieve it without stream)",
            "stream",
        )
    for name in _STREAM_RETRIEVAL_PARAMS:
        if name in given:
            raise InvalidRequestError(f"{name} only applies with stream: true, which this server does not serve", name)
    check_include(include)
    return _stored(store, response_id).response


def delete(store: ResponseStore, response_id: str) -> DeletedResponse:
    """``DELETE /v1/responses/{id}``: forget the response (later ``previous_response_id`` uses of it are 400s).

    Raises:
        ResponseNotFoundError: no such stored response.
    """
    if not store.delete(response_id):
        raise _not_found(store, response_id)
    return DeletedResponse(id=response_id)


def list_input_items(
    store: ResponseStore,
    response_id: str,
    limit: int,
    order: Literal["asc", "desc"],
    after: str | None,
    include: Sequence[str] | None,
) -> ResponseItemList:
    """``GET /v1/responses/{id}/input_items``: a page of the items the response was generated from (with
    ``previous_response_id``, the whole conversation before its output), ``order`` ``asc`` oldest first.

    Args:
        limit: items per page, 1-100.
        after: an item id: the page starts after it (in ``order``).

    Raises:
        InvalidRequestError: ``after`` names no item of this response, or an ``include`` entry is not served.
        ResponseNotFoundError: no such stored response.
    """
    check_include(include)
    items = list(_stored(store, response_id).input_items)
    if order == "desc":
        items.reverse()
    start = 0
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise InvalidRequestError(f"after: no input item with id '{after}' in response '{response_id}'", "after")
        start = ids.index(after) + 1
    page = items[start : start + limit]
    return ResponseItemList(
        data=page,
        first_id=page[0]["id"] if page else None,
        last_id=page[-1]["id"] if page else None,
        has_more=start + limit < len(items),
    )


def _stored(store: ResponseStore, response_id: str) -> StoredResponse:
    entry = store.get(response_id)
    if entry is None:
        raise _not_found(store, response_id)
    return entry


def _not_found(store: ResponseStore, response_id: str) -> ResponseNotFoundError:
    return ResponseNotFoundError(
        f"Response with id '{response_id}' not found: {store.why_missing(response_id)}", "response_id"
    )
