"""The multi-turn agent workload of ``dflash2 bench`` on the tiny folders: two servers (prefix cache on
and off) started as processes, conversations over a shared system prompt. Nothing here asserts a speed."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash2.bench.agents import history_text, questions, run_agents
from dflash2.bench.config import BenchConfig
from dflash2.config import EngineConfig
from dflash2.models.loader import load_tokenizer
from tests.bench.conftest import TinyFolders


@pytest.fixture(scope="module")
def agents_result(tiny_folders: TinyFolders, tmp_path_factory: pytest.TempPathFactory) -> dict:
    engine = EngineConfig(
        model=str(tiny_folders.model),
        drafter=str(tiny_folders.drafter),
        block_size=4,
        device="cpu",
        dtype="float32",
        enforce_eager=True,
        num_threads=1,
    )
    config = BenchConfig(
        engine=engine,
        methods=("ar", "dflash2"),
        block_sizes=(4,),
        agent_history_tokens=300,
        agent_conversations=2,
        agent_turns=3,
        agent_max_tokens=4,
    )
    return run_agents(config, tiny_folders.model, tmp_path_factory.mktemp("agents-logs"), lambda message: None)


def test_both_servers_ran_every_turn(agents_result: dict) -> None:
    assert agents_result["notes"] == []
    servers = {s["prefix_caching"]: s for s in agents_result["servers"]}
    assert set(servers) == {True, False}
    for server in servers.values():
        assert server["num_turns"] == 6 and server["num_errors"] == 0
        assert server["ttft_first_p50_ms"] > 0 and server["ttft_followup_p50_ms"] > 0
        assert server["prompt_tokens"] > 6 * 300


def test_the_cache_serves_the_shared_history_and_only_when_on(agents_result: dict) -> None:
    servers = {s["prefix_caching"]: s for s in agents_result["servers"]}
    assert servers[False]["cached_tokens"] == 0
    on = servers[True]
    # every follow-up turn reuses its history; the second conversation's first turn copies the system prompt
    records = on["turn_records"]
    assert all(r["cached_tokens"] >= 300 for r in records if r["turn"] > 0)
    assert any(r["cached_tokens"] >= 300 for r in records if r["turn"] == 0 and r["conversation"] == 1)
    assert on["hit_rate"] > 0.5
    assert agents_result["followup_ttft_ratio"] is not None


def test_history_and_questions_are_deterministic(tiny_folders: TinyFolders) -> None:
    tokenizer = load_tokenizer(Path(tiny_folders.model))
    text = history_text(tokenizer, 500)
    assert len(tokenizer.encode(text)) >= 500 and text == history_text(tokenizer, 500)
    asked = questions(3, 4)
    assert len({q for conversation in asked for q in conversation}) == 12
