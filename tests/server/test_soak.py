"""A short soak: 8 concurrent clients against uvicorn + SmolLM2 for ``SOAK_SECONDS`` (45 s by default,
``DFLASH2_SOAK_SECONDS`` overrides), mixing valid streams, streams the client drops mid-way, full responses
the client stops waiting for, and bad requests.

Checks: no 5xx for a valid request, every completed stream ends with a finish reason and ``[DONE]``,
and afterwards no leaked slot (running gauge 0, all KV slots free, nothing in flight) and bounded
memory growth after warm-up (the server's own ``process_resident_memory_bytes``; the server runs in
this process).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import time
from collections import Counter

import httpx
import pytest

from tests.server.conftest import REAL_MAX_NUM_SEQS, ServerThread, scrape, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

SOAK_SECONDS = float(os.environ.get("DFLASH2_SOAK_SECONDS", "45"))
WARMUP_SECONDS = 10.0
NUM_CLIENTS = 8
MAX_RSS_GROWTH_BYTES = 200 * 2**20
CHAT = "/v1/chat/completions"
TOPICS = ["the sea", "a cat", "coffee", "mountains", "rain", "a robot", "the moon", "bread"]

BAD_REQUESTS: list[tuple[str, bytes]] = [
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"'),  # malformed JSON
    (CHAT, json.dumps({"messages": [{"role": "user", "content": "hi"}], "functions": []}).encode()),
    (CHAT, json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": 9}).encode()),
    (CHAT, json.dumps({"messages": []}).encode()),
    (CHAT, json.dumps({"messages": [{"role": "user", "content": "hi"}], "model": "nope"}).encode()),
    ("/v1/completions", json.dumps({"prompt": "x " * 300, "max_tokens": 400}).encode()),  # over the context
    ("/v1/completions", json.dumps({"prompt": [10**9]}).encode()),
]


def chat_body(rng: random.Random, stream: bool) -> dict:
    body = {
        "messages": [{"role": "user", "content": f"Write one sentence about {rng.choice(TOPICS)}."}],
        "max_tokens": rng.randint(4, 24),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "seed": rng.randint(0, 1000),
        "n": rng.choice([1, 1, 1, 2]),
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


class Soak:
    def __init__(self, url: str) -> None:
        self.url = url
        self.outcomes: Counter[str] = Counter()
        self.failures: list[str] = []

    async def client(self, seed: int, deadline: float) -> None:
        rng = random.Random(seed)
        async with httpx.AsyncClient(base_url=self.url, timeout=120) as http:
            while time.monotonic() < deadline:
                action = rng.random()
                if action < 0.55:
                    await self.stream(http, chat_body(rng, True), drop_after=None)
                elif action < 0.70:
                    await self.stream(http, chat_body(rng, True), drop_after=rng.randint(1, 4))
                elif action < 0.80:
                    await self.full(http, chat_body(rng, False), give_up_after=rng.choice([None, 0.3]))
                else:
                    await self.bad(http, *rng.choice(BAD_REQUESTS))

    async def stream(self, http: httpx.AsyncClient, body: dict, drop_after: int | None) -> None:
        events = []
        async with http.stream("POST", CHAT, json=body) as response:
            if response.status_code != 200:
                self.failures.append(f"stream {response.status_code}: {(await response.aread())[:200]!r}")
                return
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if drop_after is not None and len(events) >= drop_after:
                    self.outcomes["stream dropped"] += 1
                    return  # leaving the block closes the connection mid-stream
        chunks = [json.loads(e) for e in events[:-1]]
        finishes = [c for c in chunks if c.get("choices") and c["choices"][0].get("finish_reason")]
        if events[-1:] != ["[DONE]"] or any("error" in c for c in chunks) or len(finishes) != body["n"]:
            self.failures.append(f"bad stream: {events[-3:]}")
        self.outcomes["stream"] += 1

    async def full(self, http: httpx.AsyncClient, body: dict, give_up_after: float | None) -> None:
        try:
            response = await http.post(CHAT, json=body, timeout=httpx.Timeout(120, read=give_up_after))
        except httpx.ReadTimeout:
            self.outcomes["full dropped"] += 1
            return
        if response.status_code != 200:
            self.failures.append(f"full {response.status_code}: {response.text[:200]}")
        self.outcomes["full"] += 1

    async def bad(self, http: httpx.AsyncClient, path: str, body: bytes) -> None:
        response = await http.post(path, content=body, headers={"content-type": "application/json"})
        if not 400 <= response.status_code < 500 or "error" not in response.json():
            self.failures.append(f"bad request answered {response.status_code}: {response.text[:200]}")
        self.outcomes["bad"] += 1


def server_rss(url: str) -> float:
    """The server's resident memory as it reports it (``process_resident_memory_bytes``)."""
    gc.collect()
    return scrape(url)[("process_resident_memory_bytes", ())]


async def test_soak(real_server: ServerThread):
    soak = Soak(real_server.url)
    start = time.monotonic()
    clients = [asyncio.create_task(soak.client(seed, start + SOAK_SECONDS)) for seed in range(NUM_CLIENTS)]
    await asyncio.sleep(min(WARMUP_SECONDS, SOAK_SECONDS / 2))
    rss_after_warmup = await asyncio.to_thread(server_rss, real_server.url)
    await asyncio.gather(*clients)

    assert not soak.failures, soak.failures[:5]
    assert soak.outcomes["stream"] > 0 and soak.outcomes["stream dropped"] > 0 and soak.outcomes["bad"] > 0
    state, engine = real_server.state, real_server.engine
    running = ("dflash2_num_requests_running", (("model_name", "SmolLM2-135M-Instruct"),))
    await asyncio.to_thread(wait_until, lambda: scrape(real_server.url)[running] == 0)
    await asyncio.to_thread(wait_until, lambda: not engine.has_unfinished_requests())
    assert len(engine.scheduler.free_slots) == REAL_MAX_NUM_SEQS and engine.kv_cache_usage == 0
    assert state.admission.num_in_flight == 0 and state.client.num_in_flight == 0
    growth = await asyncio.to_thread(server_rss, real_server.url) - rss_after_warmup
    print(f"soak outcomes {dict(soak.outcomes)}; RSS growth after warm-up {growth / 2**20:.1f} MiB")
    assert growth < MAX_RSS_GROWTH_BYTES
