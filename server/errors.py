"""One table from exceptions to HTTP status and OpenAI error envelope, and the FastAPI handlers that use it.

Every error leaves the server as ``{"error": {"message", "type", "param", "code"}}``: handlers raise
the exceptions below (or let validation / engine errors propagate) and never build error bodies.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from server.protocol import ErrorDetail, ErrorResponse

logger = logging.getLogger(__name__)


class APIError(Exception):
    """Base of the errors the HTTP layer raises on purpose; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(APIError):
    """The request is malformed or asks for something out of range."""


class ContextLengthError(InvalidRequestError):
    """Prompt tokens + max_tokens exceed the model's context (never silently truncated)."""


class AuthenticationError(APIError):
    """Missing or wrong API key."""


class ModelNotFoundError(APIError):
    """The request names a model this server does not serve."""


class ResponseNotFoundError(APIError):
    """``GET`` / ``DELETE /v1/responses/{id}``: no stored response with that id (never stored, expired, evicted or
    deleted)."""


class PreviousResponseNotFoundError(InvalidRequestError):
    """``previous_response_id`` names no stored response (OpenAI answers it with 400
    ``previous_response_not_found``, which clients recover from by sending the whole conversation)."""


class TooManyRequestsError(APIError):
    """Over the concurrency limit."""


class ServiceUnavailableError(APIError):
    """The model is still loading, or the server is draining after SIGTERM."""


class EngineError(APIError):
    """The engine failed on this request (the server keeps serving others)."""


class PayloadTooLargeError(HTTPException):
    """The request body is over the size limit.

    NOTE: an ``HTTPException`` on purpose: FastAPI re-raises those unchanged when they come out of
    reading the body, and turns any other exception there into a generic 400.
    """

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than {limit} bytes")


@dataclass(frozen=True)
class ErrorKind:
    """How one exception class leaves the server."""

    status: int
    type: str
    code: str | None = None


# The table. Lookup walks the exception's MRO, so the most specific class wins.
ERROR_TABLE: dict[type[BaseException], ErrorKind] = {
    InvalidRequestError: ErrorKind(400, "invalid_request_error"),
    ContextLengthError: ErrorKind(400, "invalid_request_error", "context_length_exceeded"),
    RequestValidationError: ErrorKind(400, "invalid_request_error"),
    AuthenticationError: ErrorKind(401, "authentication_error", "invalid_api_key"),
    ModelNotFoundError: ErrorKind(404, "not_found_error", "model_not_found"),
    ResponseNotFoundError: ErrorKind(404, "not_found_error", "response_not_found"),
    PreviousResponseNotFoundError: ErrorKind(400, "invalid_request_error", "previous_response_not_found"),
    PayloadTooLargeError: ErrorKind(413, "invalid_request_error", "request_too_large"),
    TooManyRequestsError: ErrorKind(429, "rate_limit_error", "rate_limit_exceeded"),
    EngineError: ErrorKind(500, "server_error", "engine_error"),
    ServiceUnavailableError: ErrorKind(503, "service_unavailable_error", "service_unavailable"),
    Exception: ErrorKind(500, "server_error", "internal_error"),
}

# Starlette's own HTTP errors (unknown route, wrong method, …) by status.
_HTTP_STATUS_KINDS = {
    404: ErrorKind(404, "not_found_error", "not_found"),
    405: ErrorKind(405, "invalid_request_error", "method_not_allowed"),
    413: ERROR_TABLE[PayloadTooLargeError],
}

_RETRY_AFTER_SECONDS = {429: "1", 503: "5"}


def error_kind(exc: BaseException) -> ErrorKind:
    """The table entry for ``exc`` (HTTP exceptions by status, everything else by class)."""
    if isinstance(exc, HTTPException) and not isinstance(exc, PayloadTooLargeError):
        return _HTTP_STATUS_KINDS.get(exc.status_code, ErrorKind(exc.status_code, "invalid_request_error"))
    for cls in type(exc).__mro__:
        if cls in ERROR_TABLE:
            return ERROR_TABLE[cls]
    return ERROR_TABLE[Exception]


def error_body(exc: BaseException) -> ErrorResponse:
    """The OpenAI error envelope for ``exc``."""
    kind = error_kind(exc)
    if isinstance(exc, RequestValidationError):
        message, param = describe_validation_error(exc.errors())
    elif isinstance(exc, APIError):
        message, param = exc.message, exc.param
    elif isinstance(exc, HTTPException):
        message, param = str(exc.detail), None
    else:
        message, param = "internal server error", None  # never leak internals of unexpected failures
    return ErrorResponse(error=ErrorDetail(message=message, type=kind.type, param=param, code=kind.code))


def error_response(exc: BaseException) -> JSONResponse:
    """A JSON response with the envelope and the status from the table."""
    kind = error_kind(exc)
    headers = {"Retry-After": _RETRY_AFTER_SECONDS[kind.status]} if kind.status in _RETRY_AFTER_SECONDS else None
    if kind.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    if isinstance(exc, HTTPException) and exc.headers:  # e.g. Starlette's Allow on a 405
        headers = {**(headers or {}), **exc.headers}
    return JSONResponse(error_body(exc).model_dump(), status_code=kind.status, headers=headers)


def error_event(exc: BaseException) -> str:
    """The envelope as one SSE data payload, for errors after a stream has started."""
    body = error_body(exc).model_dump()
    body["error"]["status"] = error_kind(exc).status
    return json.dumps(body, separators=(",", ":"))


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception through the table."""

    async def handle(request: Request, exc: Exception) -> JSONResponse:
        if error_kind(exc).status == 500:
            logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(exc)

    for cls in (APIError, RequestValidationError, HTTPException, Exception):
        app.add_exception_handler(cls, handle)


# ---- validation errors ---------------------------------------------------------------------------

# Pydantic puts the name of the union member that failed into ``loc``; those are not field names.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
# Where FastAPI found a parameter: the first part of its ``loc``, not part of the parameter's name.
_REQUEST_PARTS = ("body", "query", "path")


def _is_field(part: Any) -> bool:
    return isinstance(part, int) or (isinstance(part, str) and part not in _TYPE_TAGS and "[" not in part)


def error_param(loc: tuple[Any, ...]) -> str | None:
    """``("body", "messages", 0, "content", "str")`` → ``"messages[0].content"``; ``("query", "limit")`` →
    ``"limit"``."""
    if loc and loc[0] in _REQUEST_PARTS:
        loc = loc[1:]
    parts = [p for p in loc if _is_field(p)]
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text or None


def describe_validation_error(errors: Any) -> tuple[str, str | None]:
    """One readable message and the field path for pydantic / FastAPI validation errors.

    Unknown fields are reported first (by name, as OpenAI does); a union field that failed every
    alternative is reported once, with every alternative's complaint.
    """
    errors = list(errors)
    extra = [e for e in errors if e.get("type") == "extra_forbidden"]
    if extra:
        param = error_param(tuple(extra[0]["loc"]))
        return f"Unrecognized request argument supplied: {param}", param
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "invalid JSON")
        return f"malformed JSON body: {detail} (at character {loc[-1] if loc else '?'})", None
    # A union reports one error per alternative, below the field: name the field, list every complaint.
    root = loc[: next((i for i, part in enumerate(loc) if not _is_field(part)), len(loc))]
    param = error_param(root)
    if param is None:
        if first.get("type") == "missing":
            return "the request body is required", None
        return f"the request body must be a JSON object ({first.get('msg', 'invalid')})", None
    complaints = [
        f"{error_param(tuple(e['loc']))}: {_clean(e.get('msg', 'invalid value'))}"
        for e in errors
        if tuple(e.get("loc", ()))[: len(root)] == root
    ]
    return " or ".join(dict.fromkeys(complaints)), param


def _clean(message: str) -> str:
    return message.removeprefix("Value error, ")


def param_from_message(message: str) -> str | None:
    """The field an engine message names first (``"top_p must be in (0, 1]"`` → ``"top_p"``), if any."""
    word = message.split(" ", 1)[0]
    return word if word.isidentifier() and "_" in word else None
