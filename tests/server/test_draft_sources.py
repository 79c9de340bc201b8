"""Where accepted drafts came from, as a client and an operator see it: the response's
``dflash2.accepted_tokens_by_source`` and the ``…_by_source`` counters, on a real (tiny) engine whose
tool calls are mostly forced by their grammar."""

from __future__ import annotations

from typing import Any

import pytest

from dflash2.config import EngineConfig
from dflash2.engine import Engine
from dflash2.models import loader, source
from dflash2.outputs import DRAFT_SOURCE_NAMES
from tests.server.conftest import asgi_client
from tests.server.test_metrics import families, value
from tests.tiny import tiny_drafter, tiny_target

pytestmark = pytest.mark.anyio

SMOLLM2_VOCAB = 49152
FLIGHTS = {
    "type": "function",
    "function": {
        "name": "search_flights",
        "parameters": {
            "type": "object",
            "properties": {
                "origin": {"type": "string", "maxLength": 4},
                "cabin": {"enum": ["economy", "business"]},
            },
            "required": ["origin", "cabin"],
        },
    },
}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return loader.load_tokenizer(source.resolve_model(None))


def engine(tokenizer: Any, forced: bool) -> Engine:
    target = tiny_target(vocab_size=SMOLLM2_VOCAB, seed=5, scale=0.3)
    config = EngineConfig(
        block_size=8,
        max_num_seqs=2,
        max_model_len=512,
        device="cpu",
        dtype="float32",
        enforce_eager=True,
        speculative_adaptive=False,
        adaptive_threads=False,
        grammar_forced_drafts=forced,
    )
    return Engine(config, target, tokenizer, tiny_drafter(target, 2, 8), model_name="tiny")


async def call(forced: bool, tokenizer: Any) -> tuple[dict[str, Any], dict[str, list]]:
    body = {
        "messages": [{"role": "user", "content": "Flights from LHR?"}],
        "tools": [FLIGHTS],
        "tool_choice": "required",
        "max_tokens": 80,
        "temperature": 0,
    }
    async with asgi_client(engine(tokenizer, forced), served_model_name="tiny") as (client, _):
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        metrics = families((await client.get("/metrics")).text)
    return response.json(), metrics


async def test_grammar_forced_drafts_are_counted_per_request_and_in_the_metrics(tokenizer):
    """The same call with and without forced drafts: the same text; with them the forced tokens are
    accepted under ``grammar``, in the response and in the counters, and the counts add up."""
    with_forced, metrics = await call(True, tokenizer)
    without, _ = await call(False, tokenizer)
    calls = [[c["function"] for c in r["choices"][0]["message"]["tool_calls"]] for r in (with_forced, without)]
    assert calls[0] == calls[1] and calls[0]  # the same call (ids are random)
    info = with_forced["dflash2"]
    assert info["accepted_tokens_by_source"].get("grammar", 0) > 0
    assert sum(info["accepted_tokens_by_source"].values()) == info["accepted_tokens"]
    assert "grammar" not in without["dflash2"]["accepted_tokens_by_source"]
    assert info["verify_steps"] < without["dflash2"]["verify_steps"]

    def counter(name: str, **labels: str) -> float:
        return value(metrics[f"dflash2_{name}"], f"dflash2_{name}_total", model_name="tiny", **labels)

    by_source = {s: counter("spec_decode_num_accepted_tokens_by_source", source=s) for s in DRAFT_SOURCE_NAMES}
    assert by_source["grammar"] == info["accepted_tokens_by_source"]["grammar"]
    assert sum(by_source.values()) == counter("spec_decode_num_accepted_tokens")
    drafted = {s: counter("spec_decode_num_draft_tokens_by_source", source=s) for s in DRAFT_SOURCE_NAMES}
    assert sum(drafted.values()) == counter("spec_decode_num_draft_tokens")
    assert drafted["grammar"] >= by_source["grammar"]
