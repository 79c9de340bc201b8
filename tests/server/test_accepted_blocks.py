"""Stops inside accepted blocks, end to end over HTTP: the real SmolLM2 target and tokenizer with an oracle
drafter that proposes the greedy continuation, so whole blocks are accepted and a stop string, EOS or
``max_tokens`` lands in the middle of one."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dflash2 import LLM, SamplingParams
from dflash2.models.drafter_factory import drafter_config_for_target
from tests.server.conftest import SmolLM2, asgi_client
from tests.tiny import OracleDrafter

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

BLOCK_SIZE = 8
COLORS = [{"role": "user", "content": "Name three colors of the rainbow."}]
HELLO = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def oracle(smollm2: SmolLM2) -> tuple[Any, OracleDrafter, dict[str, Any]]:
    """An engine whose drafter proposes the greedy reference of the request in slot 0."""
    reference_engine = LLM.from_engine(smollm2.engine(drafter=None, block_size=1, max_num_seqs=1))
    references = {}
    for name, messages, max_tokens in (("colors", COLORS, 24), ("hello", HELLO, 40)):
        prompt_ids = smollm2.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        (completion,) = reference_engine.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, temperature=0))
        references[name] = (list(prompt_ids), completion)
    config = drafter_config_for_target(smollm2.target.config, num_layers=1, block_size=BLOCK_SIZE, selector_rank=8)
    drafter = OracleDrafter(config, {}, error_rate=0.0)
    drafter.bind_target(*smollm2.target.embedding_weights())
    return smollm2.engine(drafter=drafter, block_size=BLOCK_SIZE, max_num_seqs=1), drafter, references


def use_reference(drafter: OracleDrafter, references: dict[str, Any], name: str) -> Any:
    prompt_ids, completion = references[name]
    drafter.references[0] = prompt_ids + completion.token_ids
    return completion


async def test_stop_string_inside_an_accepted_block(oracle):
    engine, drafter, references = oracle
    reference = use_reference(drafter, references, "colors")
    words = reference.text.split()
    stop = words[len(words) // 2]
    body = {"messages": COLORS, "max_tokens": 24, "temperature": 0, "stop": stop}
    async with asgi_client(engine) as (client, _):
        response = (await client.post("/v1/chat/completions", json=body)).json()
        async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as stream:
            events = [json.loads(line[6:]) for line in [x async for x in stream.aiter_lines()] if line[6:7] == "{"]
    choice, stats = response["choices"][0], response["dflash2"]
    assert choice["message"]["content"] == reference.text[: reference.text.index(stop)]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert stats["accepted_tokens"] > 0 and stats["mean_acceptance_length"] > 2  # whole blocks were accepted
    deltas = [e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]]
    assert "".join(deltas) == choice["message"]["content"]
    assert all(stop not in d for d in deltas)


async def test_eos_inside_an_accepted_block(oracle):
    engine, drafter, references = oracle
    reference = use_reference(drafter, references, "hello")
    assert reference.finish_reason == "stop" and reference.token_ids[-1] in engine.eos_token_ids
    body = {"messages": HELLO, "max_tokens": 40, "temperature": 0}
    async with asgi_client(engine) as (client, _):
        response = (await client.post("/v1/chat/completions", json=body)).json()
    choice, stats, usage = response["choices"][0], response["dflash2"], response["usage"]
    assert choice["message"]["content"] == reference.text
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None
    assert usage["completion_tokens"] == len(reference.token_ids)  # through the EOS, nothing after it
    assert stats["verify_steps"] < usage["completion_tokens"] - 1 and stats["accepted_tokens"] > 0


async def test_max_tokens_inside_an_accepted_block(oracle):
    engine, drafter, references = oracle
    reference = use_reference(drafter, references, "colors")
    async with asgi_client(engine) as (client, _):
        for max_tokens in (1, 5, 11):
            body = {"messages": COLORS, "max_tokens": max_tokens, "temperature": 0, "logprobs": True}
            response = (await client.post("/v1/chat/completions", json=body)).json()
            choice, usage = response["choices"][0], response["usage"]
            assert choice["finish_reason"] == "length"
            assert usage["completion_tokens"] == max_tokens == len(choice["logprobs"]["content"])
            assert reference.text.startswith(choice["message"]["content"])
            stats = response["dflash2"]
            assert usage["completion_tokens"] == 1 + stats["verify_steps"] + stats["accepted_tokens"]
