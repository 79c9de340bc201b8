"""The server with an engine whose compiled graphs are built in the background: ready and serving at
once, the switch made by the engine thread between steps (also while idle), the compile gauges, and
a failed compilation that leaves the server serving eagerly."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from dflash2.runner.background import CompileStatus
from tests.server.conftest import asgi_client, wait_for
from tests.server.fakes import FakeEngine
from tests.server.test_metrics import families, value

pytestmark = pytest.mark.anyio

NUM_GRAPHS = 10


class CompilingFakeEngine(FakeEngine):
    """A fake engine whose compiled forwards come in when ``finish`` is set (``Engine.poll_compile``'s
    contract: only between steps; ``fail`` makes the compilation fail)."""

    def __init__(self, fail: bool = False, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.finish = threading.Event()
        self.fail = fail
        self.compile_status = CompileStatus("compiling")
        self.switches: list[tuple[bool, int]] = []  # (idle, steps before the switch)
        self.in_step = False
        self.started = time.monotonic()

    @property
    def compile_pending(self) -> bool:
        return self.compile_status.state == "compiling"

    def poll_compile(self, idle: bool = True) -> None:
        assert not self.in_step, "the switch happens between steps"
        if self.compile_pending and self.finish.is_set():
            self.switches.append((idle, self.num_steps))
            if self.fail:
                self.compile_status = CompileStatus("failed", error="the compile worker ended with exit status 1")
            else:
                self.compile_status = CompileStatus("compiled", NUM_GRAPHS, time.monotonic() - self.started)

    def step(self):  # type: ignore[no-untyped-def]
        self.poll_compile(idle=False)  # as Engine.step: the switch comes at a step boundary
        self.in_step = True
        try:
            return super().step()
        finally:
            self.in_step = False


def compile_gauges(text: str) -> dict[str, float]:
    exported = families(text)
    names = ("compiled", "compiled_graphs", "compile_seconds", "compile_failed")
    return {name: value(exported[f"dflash2_{name}"], f"dflash2_{name}") for name in names}


async def test_ready_and_serving_while_compiling_then_full_speed_while_idle() -> None:
    engine = CompilingFakeEngine()
    async with asgi_client(engine) as (client, _):
        assert (await client.get("/health/ready")).status_code == 200  # before any graph is built
        gauges = compile_gauges((await client.get("/metrics")).text)
        assert gauges == {"compiled": 0, "compiled_graphs": 0, "compile_seconds": 0, "compile_failed": 0}
        response = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == "abc"

        engine.finish.set()  # no request in flight: the engine thread's idle poll makes the switch
        await wait_for(lambda: engine.compile_status.is_compiled, timeout=10)
        assert engine.switches == [(True, engine.num_steps)]
        gauges = compile_gauges((await client.get("/metrics")).text)
        assert gauges["compiled"] == 1 and gauges["compiled_graphs"] == NUM_GRAPHS and gauges["compile_failed"] == 0
        assert gauges["compile_seconds"] > 0
        response = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == "abc"


async def test_the_switch_comes_between_the_steps_of_a_request_in_flight() -> None:
    engine = CompilingFakeEngine(step_delay=0.02)
    async with asgi_client(engine) as (client, _):

        async def finish_soon() -> None:
            await wait_for(lambda: engine.num_steps >= 5)
            engine.finish.set()

        finishing = asyncio.create_task(finish_soon())
        response = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 40})
        await finishing
        assert response.status_code == 200
        assert response.json()["choices"][0]["text"] == "".join(chr(ord("a") + i % 26) for i in range(40))
        ((idle, steps_before),) = engine.switches
        assert not idle and 5 <= steps_before < engine.num_steps  # mid-request, at a step boundary
        assert compile_gauges((await client.get("/metrics")).text)["compiled"] == 1


async def test_a_failed_compilation_keeps_the_server_serving() -> None:
    engine = CompilingFakeEngine(fail=True)
    engine.finish.set()
    async with asgi_client(engine) as (client, _):
        await wait_for(lambda: engine.compile_status.state == "failed", timeout=10)
        assert (await client.get("/health/ready")).status_code == 200
        assert (await client.get("/health")).status_code == 200
        response = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == "abc"
        gauges = compile_gauges((await client.get("/metrics")).text)
        assert gauges == {"compiled": 0, "compiled_graphs": 0, "compile_seconds": 0, "compile_failed": 1}
        await wait_for(lambda: not engine.compile_pending)
        assert len(engine.switches) == 1  # polled until it ended, then no more


async def test_a_poll_that_raises_does_not_end_the_engine_thread() -> None:
    engine = CompilingFakeEngine()
    calls = []

    def broken_poll(idle: bool = True) -> None:
        calls.append(idle)
        if idle:
            raise RuntimeError("a graph file could not be read")

    engine.poll_compile = broken_poll  # type: ignore[method-assign]
    async with asgi_client(engine) as (client, state):
        await wait_for(lambda: len(calls) >= 1, timeout=10)
        assert state.client.is_alive
        response = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert response.status_code == 200
