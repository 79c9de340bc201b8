"""Training-data helpers: chat-template prefixes, loss masks, user JSONL, dataset storage."""

from __future__ import annotations

import json

import pytest
import torch

from dflash2.models import loader, source
from dflash2.train.data import (
    TokenDataset,
    _clean,
    _dedup_key,
    read_prompts_jsonl,
    tokenize_conversation,
    user_turn_prefix,
)


@pytest.fixture(scope="module")
def tokenizer():
    return loader.load_tokenizer(source.resolve_model(None))


def test_user_turn_prefix_stops_where_the_user_message_starts(tokenizer):
    prefix = tokenizer.decode(user_turn_prefix(tokenizer, "You are a math tutor."))
    assert prefix.endswith("<|im_start|>user\n")
    assert "You are a math tutor." in prefix


def test_loss_mask_covers_exactly_the_assistant_answers(tokenizer):
    messages = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke"},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
    ]
    ids, mask = tokenize_conversation(tokenizer, messages)
    full = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
    assert ids == full  # the conversation is tokenized as the chat template renders it
    answer_text = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert "Hello! How can I help?" in answer_text and "Why did the chicken" in answer_text
    assert "Hi there" not in answer_text and "Tell me a joke" not in answer_text
    assert answer_text.count("<|im_end|>") == 2  # each answer's end-of-turn is learned
    prompt_text = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    assert "<|im_start|>assistant" in prompt_text


def test_user_jsonl_accepts_prompts_and_conversations(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"prompt": "What is 2+2?"})
        + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
        + "\n"
    )
    conversations = read_prompts_jsonl(path)
    assert conversations[0].messages == [{"role": "user", "content": "What is 2+2?"}]
    assert conversations[1].messages[-1]["role"] == "assistant"
    path.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match=":1:"):
        read_prompts_jsonl(path)


def test_synthesized_messages_are_filtered_and_deduplicated():
    assert _clean("  too short ") is None
    assert _clean("<|im_start|>leaked template text here") is None
    assert _clean("How do I bake bread at home?") == "How do I bake bread at home?"
    assert _dedup_key("How do I bake BREAD at home?!") == _dedup_key("how do i bake bread at home")


def test_dataset_round_trip_and_subset(tmp_path):
    dataset = TokenDataset(
        torch.tensor([1, 2, 3, 4, 5, 6], dtype=torch.int32),
        torch.tensor([0, 1, 1, 0, 0, 1], dtype=torch.uint8),
        torch.tensor([0, 3, 6]),
        torch.tensor([False, True]),
    )
    dataset.save(tmp_path / "d.safetensors")
    loaded = TokenDataset.load(tmp_path / "d.safetensors")
    ids, mask = loaded.sequence(1)
    assert ids.tolist() == [4, 5, 6] and mask.tolist() == [False, False, True]
    assert loaded.indices(heldout=True) == [1] and loaded.indices(heldout=False) == [0]
    sub = loaded.subset([1])
    assert len(sub) == 1 and sub.sequence(0)[0].tolist() == [4, 5, 6] and bool(sub.is_heldout[0])
