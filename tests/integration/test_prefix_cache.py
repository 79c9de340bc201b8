"""Prefix caching in the engine: outputs, acceptance and safety.

- greedy output with the cache equals output without it, token for token in float32, for multi-turn
  conversations (block size 8 and autoregressive, batch of three conversations and alone), and the
  drafter accepts the same tokens (its context for a cached prefix is what a prefill writes);
- a chat history with tool calls, rendered by SmolLM2's template, reuses its previous turn;
- an evicted or aborted prefix is never read back (its KV is poisoned with NaN to prove it).
"""

from __future__ import annotations

import pytest
import torch

from dflash2 import LLM, SamplingParams
from dflash2.models import loader, source
from tests.tiny import tiny_drafter, tiny_engine, tiny_target

SYSTEM = [5, 17, 33, 2, 9, 41, 60, 7, 7, 12, 80, 3, 44, 21]  # a shared "system prompt"
QUESTIONS = [[70, 71, 72], [50, 51], [90, 91, 92, 93]]


def converse(llm: LLM, turns: int, max_tokens: int = 12) -> tuple[list[list[list[int]]], list[int], int]:
    """Three conversations in lockstep: each turn appends the previous output and a new question.
    Returns the outputs per turn, the cached prompt tokens per turn and the accepted drafts in all."""
    vocab = llm.engine.vocab_size
    histories = [[t % vocab for t in (*SYSTEM, *q)] for q in QUESTIONS]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs, cached, accepted = [], [], 0
    for turn in range(turns):
        results = llm.generate(histories, params)
        outputs.append([r.token_ids for r in results])
        cached.append(sum(r.num_cached_prompt_tokens for r in results))
        accepted += sum(r.num_accepted_tokens for r in results)
        histories = [[*h, *r.token_ids, (30 + turn) % vocab, 31 % vocab] for h, r in zip(histories, results)]
    return outputs, cached, accepted


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab_size=96, seed=11)


@pytest.mark.parametrize("block_size", [8, 1])
def test_greedy_output_and_acceptance_are_the_same_with_and_without_the_cache(block_size):
    """A 12-token vocabulary, so that even an untrained drafter gets some drafts accepted."""
    target = tiny_target(vocab_size=12, seed=11)
    drafter = tiny_drafter(target, 2, block_size=8) if block_size > 1 else None

    def engine(caching: bool):
        return LLM.from_engine(tiny_engine(target, drafter, block_size, max_num_seqs=4, enable_prefix_caching=caching))

    cold_outputs, cold_cached, cold_accepted = converse(engine(False), turns=3)
    warm_outputs, warm_cached, warm_accepted = converse(engine(True), turns=3)
    assert warm_outputs == cold_outputs
    assert cold_cached == [0, 0, 0]
    # turn 1: conversations admitted in one step share nothing yet; later turns reuse their history
    assert warm_cached[0] == 0 and all(c > 3 * len(SYSTEM) for c in warm_cached[1:])
    assert warm_accepted == cold_accepted
    if block_size > 1:
        assert warm_accepted > 0


def test_one_conversation_alone_reuses_its_slot_and_a_new_one_copies_the_shared_prefix(target):
    drafter = tiny_drafter(target, 2, block_size=8)
    llm = LLM.from_engine(tiny_engine(target, drafter, 8, max_num_seqs=2, enable_prefix_caching=True))
    cold = LLM.from_engine(tiny_engine(target, drafter, 8, max_num_seqs=2, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    first = llm.generate([*SYSTEM, *QUESTIONS[0]], params)[0]
    follow_up = [*SYSTEM, *QUESTIONS[0], *first.token_ids, 30, 31]
    second = llm.generate(follow_up, params)[0]
    assert second.num_cached_prompt_tokens == len(SYSTEM) + len(QUESTIONS[0]) + len(first.token_ids) - 1
    assert second.token_ids == cold.generate(follow_up, params)[0].token_ids
    # another conversation with the same system prompt copies it into the other slot
    other = llm.generate([*SYSTEM, *QUESTIONS[1]], params)[0]
    assert other.num_cached_prompt_tokens == len(SYSTEM)
    assert other.token_ids == cold.generate([*SYSTEM, *QUESTIONS[1]], params)[0].token_ids


def _poison(engine, slot: int) -> None:
    """NaN in every KV position of ``slot``: any read of it would turn the output into garbage."""
    for cache in (engine.runner.target_cache, engine.runner.draft_cache):
        if cache is not None:
            cache.k[:, slot] = float("nan")
            cache.v[:, slot] = float("nan")


def test_an_evicted_prefix_is_never_read_back(target):
    drafter = tiny_drafter(target, 2, block_size=8)
    engine = tiny_engine(target, drafter, 8, max_num_seqs=1, enable_prefix_caching=True)
    llm = LLM.from_engine(engine)
    cold = LLM.from_engine(tiny_engine(target, drafter, 8, max_num_seqs=1, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    conversation = [*SYSTEM, *QUESTIONS[0]]
    llm.generate(conversation, params)
    llm.generate([1, 2, 3, 4], params)  # the one slot now holds another prompt: the conversation is evicted
    assert engine.prefix_cache.entries[0][:4] == [1, 2, 3, 4]
    again = llm.generate(conversation, params)[0]
    assert again.num_cached_prompt_tokens == 0
    assert again.token_ids == cold.generate(conversation, params)[0].token_ids


def test_an_aborted_request_leaves_nothing_to_reuse(target):
    drafter = tiny_drafter(target, 2, block_size=8)
    engine = tiny_engine(target, drafter, 8, max_num_seqs=1, enable_prefix_caching=True)
    prompt = [*SYSTEM, *QUESTIONS[2]]
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    engine.step()  # prefilled, first token out
    engine.step()
    engine.abort(request_id)
    engine.step()
    assert engine.prefix_cache.entries[0] == []
    _poison(engine, 0)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    again = LLM.from_engine(engine).generate(prompt, params)[0]
    assert again.num_cached_prompt_tokens == 0
    cold = LLM.from_engine(tiny_engine(target, drafter, 8, max_num_seqs=1, enable_prefix_caching=False))
    assert again.token_ids == cold.generate(prompt, params)[0].token_ids


def test_a_reused_prefix_is_read_from_the_cache(target):
    """The counterpart of the two tests above: poisoning a slot whose prefix *is* reused changes the
    output, so those tests would notice a stale read."""
    engine = tiny_engine(target, None, max_num_seqs=1, enable_prefix_caching=True)
    llm = LLM.from_engine(engine)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = [*SYSTEM, *QUESTIONS[0]]
    clean = llm.generate(prompt, params)[0].token_ids
    _poison(engine, 0)
    with torch.no_grad():
        poisoned = llm.generate(prompt, params)[0]
    assert poisoned.num_cached_prompt_tokens == len(prompt) - 1
    assert poisoned.token_ids != clean


def test_chat_history_with_tool_calls_reuses_the_previous_turn():
    """SmolLM2's template over a tool-call history: the next turn's prompt extends the previous one
    token for token, so all of it but the new messages comes from the cache; outputs match."""
    tokenizer = loader.load_tokenizer(source.resolve_model(None))
    wide = tiny_target(vocab_size=49152, seed=5, scale=0.3)
    drafter = tiny_drafter(wide, 2, block_size=8)
    messages = [
        {"role": "system", "content": "You call tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        },
        {"role": "tool", "content": "<tool_response>\nSunny, 21 C\n</tool_response>"},
    ]
    follow_up = [*messages, {"role": "assistant", "content": "It is sunny."}, {"role": "user", "content": "And Rome?"}]
    prompts = [
        tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=False) for m in (messages, follow_up)
    ]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    results = {}
    for caching in (True, False):
        llm = LLM.from_engine(tiny_engine(wide, drafter, 8, max_num_seqs=2, enable_prefix_caching=caching))
        results[caching] = [llm.generate(p, params)[0] for p in prompts]
    assert [r.token_ids for r in results[True]] == [r.token_ids for r in results[False]]
    assert results[True][1].num_cached_prompt_tokens >= len(prompts[0]) - 1
