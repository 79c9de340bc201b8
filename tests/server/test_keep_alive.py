"""Idle keep-alive connections outlive the clients' own idle limit (httpx and the openai client keep one
for 5 s): a server that closed them at 5 s too would race a client sending its next request on one."""

from __future__ import annotations

import http.client
import select
import socket
import time
from urllib.parse import urlsplit

import pytest

from server.settings import ServerSettings
from tests.live_server import ServerThread

pytestmark = pytest.mark.slow


def test_an_idle_connection_stays_open_past_five_seconds(real_server: ServerThread):
    url = urlsplit(real_server.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    for _ in range(2):  # the second request reuses the connection the first one opened
        connection.request("GET", "/health")
        response = connection.getresponse()
        assert response.status == 200 and response.read()
        time.sleep(6)  # past uvicorn's default keep-alive of 5 s
    sock = connection.sock
    assert sock is not None
    readable, _, _ = select.select([sock], [], [], 0)
    assert not readable or sock.recv(1, socket.MSG_PEEK) != b"", "the server closed the idle connection"
    connection.close()


def test_keep_alive_must_be_positive():
    assert ServerSettings().timeout_keep_alive == 65
    with pytest.raises(ValueError, match="timeout_keep_alive"):
        ServerSettings(timeout_keep_alive=0)
