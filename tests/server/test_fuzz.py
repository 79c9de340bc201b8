"""Property-based fuzzing of the HTTP API from its own OpenAPI schema (schemathesis + hypothesis).

Every operation gets generated requests, valid and invalid; none may get a 5xx, and no stream may
carry an error event. By default the server is a real uvicorn server over the fake engine (fast;
the engine's own checks are the same functions); to fuzz a running ``dflash2 serve`` with the real
model instead:

    DFLASH2_FUZZ_URL=http://127.0.0.1:8000 DFLASH2_FUZZ_EXAMPLES=200 \\
        .venv/bin/python -m pytest tests/server/test_fuzz.py
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from server.app import create_app
from server.engine_client import EngineClient
from server.settings import ServerSettings
from tests.live_server import ServerThread
from tests.server.fakes import FakeEngine

EXAMPLES = int(os.environ.get("DFLASH2_FUZZ_EXAMPLES", "60"))
# Generated requests ask for short outputs: the fuzz is about validation, not decoding.
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
MAX_LENGTH, MAX_CHOICES = 4, 2


@pytest.fixture(scope="module")
def api_url() -> Iterator[str]:
    url = os.environ.get("DFLASH2_FUZZ_URL")
    if url:
        yield url.rstrip("/")
        return
    with ServerThread(FakeEngine(max_model_len=256, max_num_seqs=4), stream_send_timeout=5) as server:
        yield server.url


# The schema the server publishes at /openapi.json (the same app, built without starting it).
SCHEMA = schemathesis.openapi.from_dict(create_app(EngineClient.from_engine(FakeEngine()), ServerSettings()).openapi())
OPERATIONS = [result.ok() for result in SCHEMA.get_all_operations()]
# Valid requests for every operation; invalid ones where there is something to get wrong.
CASES = [
    pytest.param(op, mode, id=f"{op.label} {mode.value}")
    for op in OPERATIONS
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if mode is GenerationMode.POSITIVE or len(op.body) + len(op.query) + len(op.path_parameters) > 0
]


# The length field each generation endpoint reads (a request without one decodes to the context's end).
LENGTH_FIELD = {
    "/v1/chat/completions": "max_tokens",
    "/v1/completions": "max_tokens",
    "/v1/responses": "max_output_tokens",
}


def _shorten(path: str, body: Any) -> None:
    """Bound what a generated request may decode (values that are not numbers stay, to be refused)."""
    if not isinstance(body, dict):
        return
    if path in LENGTH_FIELD and not any(name in body for name in LENGTH_FIELDS):
        body[LENGTH_FIELD[path]] = MAX_LENGTH
    for name in LENGTH_FIELDS:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_LENGTH:
            body[name] = MAX_LENGTH
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and body["n"] > MAX_CHOICES:
        body["n"] = MAX_CHOICES


@pytest.mark.parametrize(("operation", "mode"), CASES)
def test_no_request_gets_a_server_error(operation: Any, mode: GenerationMode, api_url: str) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    def check(case: Any) -> None:
        _shorten(case.path, case.body)
        response = case.call(base_url=api_url, timeout=60)
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
        if "text/event-stream" in response.headers.get("content-type", ""):
            text = response.text
            assert '"error"' not in text and "response.failed" not in text, (case.path, case.body, text[-500:])

    check()
