"""Incremental detokenization with stop-string handling for streaming responses.

A speculative decoder accepts a block of tokens per step, so output arrives in
irregular chunks of token ids. :class:`IncrementalDetokenizer` turns those chunks
into text deltas that are safe to stream (e.g. over SSE):

* Decoding is incremental (the prefix-offset/read-offset scheme used by vLLM and
  TGI): only a small window of recent token ids, with a few tokens of left
  context, is decoded for each new token, so the cost per call is proportional
  to the number of new tokens rather than to the length of the output.
* Text that ends in an incomplete UTF-8 sequence (decoded as U+FFFD, e.g. an
  emoji or CJK character spread over several byte-level tokens) is held back
  until a later token completes it.
* Stop strings are matched against the whole output, including matches that
  straddle earlier deltas. Text that ends with a proper prefix of a stop string
  is held back until it either completes the stop string or turns out not to.
* Repeated units (``repeat_marker``): when the output is a sequence of units that
  each end with a marker (tool calls ending with ``</tool_call>``), a unit that
  repeats an earlier one (surrounding whitespace aside) ends the output right
  before it. The unit being written is held back while it may still become a
  repeat, so no part of a repeat is ever emitted.

Invariant: the concatenation of every returned delta plus :meth:`flush` equals
``tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)``
(with the prompt tail as left context, so a leading space of the first output
token is kept), truncated at the first stop string when one matched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["DetokenizeResult", "IncrementalDetokenizer"]

_REPLACEMENT_CHAR = "\ufffd"

# Number of prompt tokens used as left context for the first output tokens.
_PROMPT_CONTEXT_TOKENS = 5

# Undecodable tail text is held back for at most this many tokens. A valid but
# incomplete UTF-8 sequence spans at most three bytes, so a longer run of
# tokens ending in U+FFFD is genuinely invalid and is emitted as is; the bound
# keeps the decode window (and so the per-token cost) small.
_MAX_PENDING_TOKENS = 16


@dataclass
class DetokenizeResult:
    """Outcome of one :meth:`IncrementalDetokenizer.add_tokens` call.

    Attributes:
        text: New text that is safe to emit now (may be empty).
        stop_index: If a stop string matched, the 0-based index into the token ids
            passed to this call of the token that completed the match; else None.
            Tokens after this index were ignored.
        stop_string: The stop string that matched, else None (also for a repeated unit).
        repeated: True when a unit repeated an earlier one (``stop_index`` is the token that completed it).
    """

    text: str
    stop_index: int | None = None
    stop_string: str | None = None
    repeated: bool = False


class IncrementalDetokenizer:
    """Streams the text of a generated sequence, token block by token block.

    Args:
        tokenizer: A Hugging Face tokenizer (anything with
            ``decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=...)``).
        prompt_ids: The prompt token ids; the last few serve as left context so
            the first output token is rendered as it would be after the prompt.
        stop: Stop strings (a single string is accepted too). Empty strings are ignored.
        skip_special_tokens: Leave special tokens (EOS and the like) out of the text.
        include_stop_str_in_output: Include the matched stop string at the end of
            the output instead of ending right before it.
        repeat_marker: The string that ends each unit of the output, or None: a unit
            (the text after the previous unit's marker, up to and including its own)
            equal to an earlier one, both whitespace-stripped, ends the output before it.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        repeat_marker: str | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._include_stop = include_stop_str_in_output
        stops = (stop,) if isinstance(stop, str) else stop
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))
        self._max_stop_len = max((len(s) for s in self._stops), default=0)

        # Decode window (recent ids only): window[:read_offset] is left context whose
        # text is already accounted for (prefix_text); window[read_offset:] is unread.
        context = [int(t) for t in prompt_ids[-_PROMPT_CONTEXT_TOKENS:]]
        self._window: list[int] = context
        self._read_offset = len(context)
        self._prefix_text = self._decode(context)

        # Decoded text not emitted yet because it may be the start of a stop string.
        self._held_text = ""
        self._chunks: list[str] = []
        # Last (max_stop_len - 1) emitted characters, the part a stop match may reach back into.
        self._emitted_tail = ""
        self._finished = False
        # Repeated units: the units completed so far, and where the current one starts in the
        # text after the emitted part (``_held_text``, which holds it while it may be a repeat).
        self._repeat_marker = repeat_marker or None
        self._units: set[str] = set()
        self._unit_text = ""  # the current unit so far (held text included)

    @property
    def output_text(self) -> str:
        """All text emitted so far: every returned ``text`` plus what :meth:`flush` returned."""
        return "".join(self._chunks)

    @property
    def finished(self) -> bool:
        """True once a stop string matched or :meth:`flush` was called."""
        return self._finished

    def add_tokens(self, token_ids: Sequence[int]) -> DetokenizeResult:
        """Feeds newly accepted tokens and returns the text that can be emitted now.

        Tokens are processed one at a time. When a stop string is completed by
        token ``i``, processing stops there: the returned text ends right before
        the stop string (or includes it when ``include_stop_str_in_output``),
        ``stop_index`` is ``i`` and the remaining tokens of the call are ignored.

        Args:
            token_ids: The new output token ids, in order.

        Returns:
            The emitted delta and, if a stop string matched, where and which.

        Raises:
            RuntimeError: If called after a stop string matched or after :meth:`flush`.
        """
        if self._finished:
            raise RuntimeError("IncrementalDetokenizer is finished: a stop string matched or flush() was called")
        parts: list[str] = []
        for index, token_id in enumerate(token_ids):
            self._window.append(int(token_id))
            delta = self._decode_step(final=False)
            if not delta:
                continue
            emitted, matched = self._process_text(delta)
            if emitted:
                parts.append(emitted)
            if self._finished:  # a stop string matched, or a unit repeated
                return DetokenizeResult("".join(parts), index, matched, repeated=matched is None)
        return DetokenizeResult("".join(parts))

    def flush(self) -> str:
        """Finishes the stream and returns all text still held back.

        Call this when the request ends for a reason other than a stop string
        (EOS, length limit, cancellation). Since no more tokens will come, the
        pending tokens are decoded as they are, including a trailing U+FFFD from
        an incomplete UTF-8 sequence, and a held-back partial stop string is
        released. If the final text completes a stop string, the output is
        truncated at it. Calling it again, or after a stop matched, returns "".

        Returns:
            The remaining text (may be empty).
        """
        if self._finished:
            return ""
        delta = self._decode_step(final=True)
        emitted, _ = self._process_text(delta, final=True)
        self._finished = True
        return emitted

    # ------------------------------------------------------------------ internals

    def _decode(self, ids: list[int]) -> str:
        text = self._tokenizer.decode(
            ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
        return str(text)

    def _decode_step(self, final: bool) -> str:
        """Returns the new text of the unread tokens in the window, or "" if held back."""
        if self._read_offset >= len(self._window):
            return ""
        full_text = self._decode(self._window)
        pending_tokens = len(self._window) - self._read_offset
        force = final or pending_tokens >= _MAX_PENDING_TOKENS
        if not force and (len(full_text) <= len(self._prefix_text) or full_text.endswith(_REPLACEMENT_CHAR)):
            # No visible text yet (e.g. a skipped special token) or an incomplete
            # UTF-8 sequence at the end: wait for more tokens.
            return ""
        delta = full_text[len(self._prefix_text) :]
        # Advance: the tokens just read become the left context for the next ones.
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        if not final:
            self._prefix_text = self._decode(self._window)
        return delta

    def _process_text(self, delta: str, final: bool = False) -> tuple[str, str | None]:
        """Appends decoded text, checks stop strings and repeated units and returns (text to emit,
        matched stop); ``_finished`` is set when either ended the output."""
        if not self._stops and self._repeat_marker is None:
            self._emit(delta)
            return delta, None
        self._held_text += delta
        # Everything before the held text was checked already, so a new match must
        # end in the new delta; it can only reach back into the emitted tail.
        tail = self._emitted_tail
        search_text = tail + self._held_text
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = search_text.find(stop)
            if start < 0:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate < best:
                best = candidate
        if best is not None:
            end, start, stop = best
            cut = end if self._include_stop else start
            # Hold-back guarantees the match does not start inside emitted text.
            out = search_text[len(tail) : max(cut, len(tail))]
            self._held_text = ""
            self._emit(out)
            self._finished = True
            return out, stop
        repeat = self._scan_units(delta) if self._repeat_marker is not None else None
        if repeat is not None:
            out = self._held_text[:repeat]
            self._held_text = ""
            self._emit(out)
            self._finished = True
            return out, None
        if final:
            out = self._held_text
            self._held_text = ""
            self._emit(out)
            return out, None
        hold = max(self._partial_stop_len(self._held_text), self._unit_hold())
        out = self._held_text[: len(self._held_text) - hold]
        self._held_text = self._held_text[len(self._held_text) - hold :]
        self._emit(out)
        return out, None

    def _scan_units(self, delta: str) -> int | None:
        """Folds ``delta`` into the current unit; where a completed unit that repeats an earlier one
        starts in ``_held_text`` (it is held whole: it was a prefix of that unit from its start), or None."""
        assert self._repeat_marker is not None
        self._unit_text += delta
        while (found := self._unit_text.find(self._repeat_marker)) >= 0:
            end = found + len(self._repeat_marker)
            unit = self._unit_text[:end].strip()
            if unit in self._units:
                return max(0, len(self._held_text) - len(self._unit_text))
            self._units.add(unit)
            self._unit_text = self._unit_text[end:]
        return None

    def _unit_hold(self) -> int:
        """Characters at the end of ``_held_text`` to hold because the current unit may still repeat one."""
        if not self._units:
            return 0
        partial = self._unit_text.lstrip()
        if any(unit.startswith(partial) for unit in self._units):
            return min(len(self._unit_text), len(self._held_text))
        return 0

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(text), len(stop) - 1), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest

    def _emit(self, text: str) -> None:
        if not text:
            return
        self._chunks.append(text)
        keep = self._max_stop_len - 1
        if keep > 0:
            self._emitted_tail = (self._emitted_tail + text)[-keep:]
