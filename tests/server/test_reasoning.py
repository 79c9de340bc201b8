"""Reasoning models (``--reasoning-parser``): the thinking block split out of replies, grammars that start after
it, and speculation that stays lossless through it.

A tiny random-weight Qwen3-shaped target over SmolLM2's vocabulary plus ``<think>`` / ``</think>`` (added tokens,
as in Qwen3's tokenizer), with a Qwen3-style chat template written here (``enable_thinking``, earlier thinking
rendered from ``reasoning_content``) and a DeepSeek-R1-style one (the prompt opens the block). A random model
never ends its thinking by itself: the grammar's budget rule closes the block and then the answer within
``max_tokens``, which is what the structured-output tests rely on.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from transformers import PreTrainedTokenizerFast

from dflash2 import LLM, SamplingParams
from dflash2.grammar import GrammarBackend, json_schema_grammar
from dflash2.models import loader, source
from server.reasoning import REASONING_PARSERS, Reasoning, ReasoningSplitter, StartState
from tests.server.conftest import asgi_client
from tests.tiny import tiny_drafter, tiny_engine, tiny_target

QWEN3_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}<|im_start|>assistant\n"
    "{%- if message.reasoning_content %}<think>\n{{ message.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ message.content or '' }}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- else %}<think>\n{%- endif %}{%- endif %}"
)
# DeepSeek-R1 style: the block opens in the prompt; no enable_thinking switch.
R1_TEMPLATE = (
    "{%- for message in messages %}<|{{ message.role }}|>{{ message.content or '' }}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|><think>\n{%- endif %}"
)
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"],
            },
        },
    }
]


def thinking_tokenizer(template: str) -> PreTrainedTokenizerFast:
    tokenizer = loader.load_tokenizer(source.resolve_model(None))
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="module")
def qwen3_tokenizer() -> PreTrainedTokenizerFast:
    return thinking_tokenizer(QWEN3_TEMPLATE)


@pytest.fixture(scope="module")
def target(qwen3_tokenizer):
    return tiny_target("qwen3", vocab_size=len(qwen3_tokenizer), seed=3, scale=0.3)


def engine_for(target, tokenizer, block_size: int = 8):
    drafter = tiny_drafter(target, 2, block_size=block_size) if block_size > 1 else None
    return tiny_engine(target, drafter, block_size, max_num_seqs=4, tokenizer=tokenizer)


# ---- the split, on text ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "state", "text", "expected"),
    [
        ("qwen3", StartState.INSIDE, "plan a </thin k> b</think>\n\nanswer", ("plan a </thin k> b", "answer")),
        ("qwen3", StartState.OPTIONAL, "<think>\nplan</think>\n\nanswer", ("plan", "answer")),
        ("qwen3", StartState.OPTIONAL, "answer <think> not a block", (None, "answer <think> not a block")),
        ("qwen3", StartState.AFTER, "answer</think>", (None, "answer</think>")),
        ("qwen3", StartState.INSIDE, "cut short by max_tokens", ("cut short by max_tokens", "")),
        ("deepseek_r1", StartState.INSIDE, "plan</think>answer", ("plan", "answer")),
    ],
)
def test_split_whole_and_streamed_at_every_cut(name, state, text, expected):
    """The whole reply's split, and the same split streamed in two pieces cut at every character (a tag cut in
    half is held back, never sent as text)."""
    parser = REASONING_PARSERS[name]
    assert parser.split(text, state) == expected
    for cut in range(len(text) + 1):
        splitter = ReasoningSplitter(parser, state)
        pieces = [splitter.feed(text[:cut]), splitter.feed(text[cut:]), splitter.finish()]
        reasoning = "".join(p[0] for p in pieces)
        content = "".join(p[1] for p in pieces)
        assert (reasoning if splitter.had_block else None, content) == expected, cut
        assert "</think" not in reasoning


def test_start_state_is_read_from_the_prompt(qwen3_tokenizer):
    reasoning = Reasoning.for_tokenizer("qwen3", qwen3_tokenizer)
    r1 = Reasoning.for_tokenizer("deepseek_r1", qwen3_tokenizer)
    messages = [{"role": "user", "content": "hi"}]

    def prompt(**kwargs: Any) -> list[int]:
        return qwen3_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
        )

    assert reasoning.start_state(prompt()) is StartState.INSIDE
    assert reasoning.start_state(prompt(enable_thinking=False)) is StartState.AFTER
    plain = qwen3_tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert reasoning.start_state(plain) is StartState.OPTIONAL
    assert r1.start_state(plain) is StartState.INSIDE  # DeepSeek-R1 thinks first even without the tag
    assert r1.start_state(prompt(enable_thinking=False)) is StartState.AFTER


def test_a_tokenizer_without_the_tags_is_refused_at_start_up():
    tokenizer = loader.load_tokenizer(source.resolve_model(None))
    with pytest.raises(ValueError, match="not one token"):
        Reasoning.for_tokenizer("qwen3", tokenizer)


# ---- the grammar after the block -------------------------------------------------------------------


def test_budget_closes_the_block_then_the_answer(qwen3_tokenizer):
    """From inside the block the closing path is the end token, then the answer's closing bytes."""
    reasoning = Reasoning.for_tokenizer("qwen3", qwen3_tokenizer)
    backend = GrammarBackend(qwen3_tokenizer, len(qwen3_tokenizer))
    wrapped = reasoning.wrap_grammar(json_schema_grammar(SCHEMA), StartState.INSIDE)
    matcher = backend.matcher(wrapped)
    for token in qwen3_tokenizer.encode("let me see", add_special_tokens=False):
        assert matcher.consume_token(token)
    lead, path = backend.closing_path(matcher)
    assert lead == [reasoning.end_id]
    jsonschema.validate(json.loads(path), SCHEMA)


@pytest.mark.parametrize("state", [StartState.INSIDE, StartState.OPTIONAL])
def test_greedy_speculative_equals_autoregressive_with_the_block_before_the_grammar(target, qwen3_tokenizer, state):
    """float32: DFlash 2 (block 8) with the wrapped grammar emits exactly the autoregressive tokens, alone and in
    a batch of mixed prompt lengths; every reply ends its block and answers with valid JSON."""
    reasoning = Reasoning.for_tokenizer("qwen3", qwen3_tokenizer)
    grammar = reasoning.wrap_grammar(json_schema_grammar(SCHEMA), state)
    opening = "<think>\n" if state is StartState.INSIDE else ""
    prompts = [
        qwen3_tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n{opening}")
        for text in ("Is the sky blue?", "Name a colour, any colour at all, and say if you like it.")
    ]
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, grammar=grammar) for max_tokens in (28, 40)]
    outputs = {}
    for block_size in (1, 8):
        llm = LLM.from_engine(engine_for(target, qwen3_tokenizer, block_size))
        outputs[block_size] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs[8] == outputs[1]
    for ids in outputs[8]:
        reasoning_text, content = reasoning.parser.split(qwen3_tokenizer.decode(ids), state)
        if state is StartState.INSIDE:
            assert reasoning_text is not None
        jsonschema.validate(json.loads(content), SCHEMA)


# ---- through the server ----------------------------------------------------------------------------


def chat(messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": messages, "temperature": 0, **fields}


def engine_name(engine) -> str:
    return engine.model_name


@pytest.mark.anyio
async def test_chat_reasoning_content_and_a_json_answer_after_it(target, qwen3_tokenizer):
    engine = engine_for(target, qwen3_tokenizer)
    schema_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    body = chat([{"role": "user", "content": "Is it ok?"}], max_tokens=48, response_format=schema_format)
    body["model"] = engine_name(engine)
    async with asgi_client(engine, reasoning_parser="qwen3") as (client, _):
        whole = (await client.post("/v1/chat/completions", json=body)).json()
        message = whole["choices"][0]["message"]
        assert message["reasoning_content"]
        assert "</think>" not in message["reasoning_content"] and "<think>" not in message["content"]
        jsonschema.validate(json.loads(message["content"]), SCHEMA)
        # Streamed: the same reasoning and content, in reasoning_content and content deltas.
        reasoning, content = "", ""
        async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as stream:
            async for line in stream.aiter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        reasoning += choice["delta"].get("reasoning_content") or ""
                        content += choice["delta"].get("content") or ""
        assert (reasoning, content) == (message["reasoning_content"], message["content"])
        # Thinking switched off by the template: no block, and the grammar applies from the first token.
        off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
        message = (await client.post("/v1/chat/completions", json=off)).json()["choices"][0]["message"]
        assert "reasoning_content" not in message
        jsonschema.validate(json.loads(message["content"]), SCHEMA)


@pytest.mark.anyio
async def test_a_required_tool_call_after_the_thinking_block(target, qwen3_tokenizer):
    engine = engine_for(target, qwen3_tokenizer)
    body = chat([{"role": "user", "content": "Weather in Paris?"}], max_tokens=44, tools=TOOLS, tool_choice="required")
    body["model"] = engine_name(engine)
    async with asgi_client(engine, reasoning_parser="qwen3") as (client, _):
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        # A random model thinks until the budget rule closes the block and the call ("length": the budget ended it).
        assert choice["finish_reason"] in ("tool_calls", "length")
        assert choice["message"]["reasoning_content"]
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert set(json.loads(call["function"]["arguments"])) == {"city"}


@pytest.mark.anyio
async def test_earlier_reasoning_reaches_the_template(target, qwen3_tokenizer):
    """An assistant turn's reasoning_content (or reasoning) is rendered by a template that reads it."""
    engine = engine_for(target, qwen3_tokenizer)
    async with asgi_client(engine, reasoning_parser="qwen3") as (client, _):
        for key in ("reasoning_content", "reasoning"):
            messages = [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello", key: "the user greets me"},
                {"role": "user", "content": "again"},
            ]
            tokens = (await client.post("/tokenize", json={"messages": messages})).json()["tokens"]
            assert "<think>\nthe user greets me\n</think>" in qwen3_tokenizer.decode(tokens)
        bad = [{"role": "user", "content": "hi", "reasoning_content": "no"}]
        response = await client.post("/v1/chat/completions", json=chat(bad, model=engine_name(engine)))
        assert response.status_code == 400 and "assistant" in response.json()["error"]["message"]


@pytest.mark.anyio
async def test_responses_reasoning_items_whole_and_streamed(target, qwen3_tokenizer):
    engine = engine_for(target, qwen3_tokenizer)
    body = {
        "model": engine_name(engine),
        "input": "Is it ok?",
        "temperature": 0,
        "max_output_tokens": 48,
        "store": False,
        "text": {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}},
    }
    async with asgi_client(engine, reasoning_parser="qwen3") as (client, _):
        response = (await client.post("/v1/responses", json=body)).json()
        kinds = [item["type"] for item in response["output"]]
        assert kinds == ["reasoning", "message"]
        thinking = response["output"][0]["content"][0]
        assert thinking["type"] == "reasoning_text" and thinking["text"]
        jsonschema.validate(json.loads(response["output"][1]["content"][0]["text"]), SCHEMA)
        events = []
        async with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as stream:
            async for line in stream.aiter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
        types = [e["type"] for e in events]
        assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
        streamed = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
        assert streamed == thinking["text"]
        assert events[-1]["response"]["output"][0]["content"][0]["text"] == thinking["text"]
        # A reasoning item sent back reaches the next assistant turn's reasoning_content.
        replay = {
            **body,
            "input": [
                {"role": "user", "content": "hi"},
                {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "greeting"}]},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "again"},
            ],
        }
        replayed = await client.post("/v1/responses", json=replay)
        assert replayed.status_code == 200, replayed.text
        without = {**replay, "input": [item for item in replay["input"] if item.get("type") != "reasoning"]}
        plain = (await client.post("/v1/responses", json=without)).json()
        # The template wrapped "greeting" in the tags (two tokens) into the prompt.
        rendered = len(qwen3_tokenizer.encode("greeting", add_special_tokens=False)) + 2
        assert replayed.json()["usage"]["input_tokens"] >= plain["usage"]["input_tokens"] + rendered


@pytest.mark.anyio
async def test_deepseek_r1_prompt_opens_the_block(target):
    tokenizer = thinking_tokenizer(R1_TEMPLATE)
    engine = engine_for(target, tokenizer)
    body = chat([{"role": "user", "content": "hi"}], max_tokens=12, model=engine_name(engine))
    async with asgi_client(engine, reasoning_parser="deepseek_r1") as (client, _):
        message = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
    # A random model does not end its thinking in 12 tokens: the whole reply is reasoning, cut by max_tokens.
    assert message["reasoning_content"] and message["content"] == ""
