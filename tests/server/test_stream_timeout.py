"""A client that stops reading a stream does not hold its request forever (``--stream-send-timeout``)."""

from __future__ import annotations

import json
import socket

import pytest

from server.settings import ServerSettings
from tests.live_server import ServerThread, wait_until
from tests.server.fakes import FakeEngine


def _open_stream(url: str, path: str, body: dict) -> socket.socket:
    """POST ``body`` on a raw socket with a small receive buffer, read the status line, then stop."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    sock.connect((host, int(port)))
    payload = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(payload)}\r\n\r\n"
    sock.sendall(head.encode() + payload)
    assert sock.recv(64).startswith(b"HTTP/1.1 200")
    return sock


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "hi", "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
        ("/v1/responses", {"input": "hi", "stream": True}),
    ],
)
def test_a_client_that_stops_reading_is_cut_off_and_its_request_aborted(path, body):
    # Without the timeout the handler would wait for this client forever.
    engine = FakeEngine(max_model_len=250_000, max_num_seqs=2, step_delay=0.0)
    with ServerThread(engine, stream_send_timeout=0.5) as server:
        tokens = {"max_output_tokens" if path == "/v1/responses" else "max_tokens": 200_000}
        sock = _open_stream(server.url, path, {"model": "fake-model", **body, **tokens})
        try:
            wait_until(lambda: engine.num_steps > 0, timeout=10)
            # The stream's handler ends (its concurrency slot is free) while the client still holds
            # the connection, and the request is no longer decoding.
            wait_until(lambda: server.state.admission.num_in_flight == 0, timeout=20)
            wait_until(lambda: not engine.running_request_ids() and not engine.scheduler.waiting, timeout=5)
        finally:
            sock.close()


def test_stream_send_timeout_is_validated():
    assert ServerSettings(stream_send_timeout=0).stream_send_timeout == 0
    with pytest.raises(ValueError, match="stream_send_timeout"):
        ServerSettings(stream_send_timeout=-1)
