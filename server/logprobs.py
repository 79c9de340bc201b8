"""Engine logprobs as OpenAI's logprobs objects: chat's ``content`` list and completions' legacy arrays."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from dflash2.outputs import TokenLogprob
from server.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprobInfo, TopLogprob

_MIN_LOGPROB = -9999.0  # JSON has no -inf


class TokenText:
    """Token id → display string for logprobs (cached; partial UTF-8 shows as U+FFFD)."""

    def __init__(self, tokenizer: Any | None) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id]) if self._tokenizer is not None else f"token_id:{token_id}"
            self._cache[token_id] = text
        return text


def chat_logprobs(logprobs: Sequence[TokenLogprob], token_text: TokenText) -> ChatLogprobs:
    """``choices[i].logprobs`` of a chat response or chunk: each token with its alternatives and UTF-8 bytes."""

    def entry(token_id: int, logprob: float) -> TopLogprob:
        text = token_text(token_id)
        return TopLogprob(token=text, logprob=_finite(logprob), bytes=list(text.encode("utf-8")))

    content = []
    for lp in logprobs:
        chosen = entry(lp.token_id, lp.logprob)
        top = [entry(t, v) for t, v in lp.top]
        content.append(TokenLogprobInfo(**chosen.model_dump(), top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(logprobs: Sequence[TokenLogprob], offset: int, token_text: TokenText) -> CompletionLogprobs:
    """``choices[i].logprobs`` of a text completion; ``offset`` is the text offset of the first token (the
    chosen token is always among ``top_logprobs``)."""
    result = CompletionLogprobs()
    for lp in logprobs:
        text = token_text(lp.token_id)
        result.tokens.append(text)
        result.token_logprobs.append(_finite(lp.logprob))
        top = {token_text(t): _finite(v) for t, v in lp.top}
        top.setdefault(text, _finite(lp.logprob))
        result.top_logprobs.append(top)
        result.text_offset.append(offset)
        offset += len(text)
    return result


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB
