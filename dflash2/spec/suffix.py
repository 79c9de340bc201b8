"""Suffix index: drafts copied from the outputs of earlier requests, beside the drafter.

Agent traffic repeats itself *across* requests: an agent loop sends the same tool calls, quotes the same
file contents and writes the same phrases turn after turn, each turn a new request. Prompt lookup
(``prompt_lookup.py``) only sees the request's own tokens; this index keeps the outputs of recent finished
requests, so that any running request whose last tokens occurred in one of them can copy what followed.

Sources: SuffixDecoding (Oliaro et al., 2024, arXiv 2411.04975) keeps a global suffix tree over earlier
requests' outputs beside a per-request one, weighs the continuations of the longest match by their
counts in the tree, and speculates further the longer the match; Arctic Inference ships it
(``arctic_inference.suffix_decoding``), and vLLM's ``suffix`` speculative method calls that
implementation. This module keeps the idea (match the running request's tail against earlier outputs,
copy the continuation) with a simpler structure:

- **An n-gram table over a bounded FIFO of sequences**, not a suffix tree. Each n-gram of ``min_n`` …
  ``max_n`` tokens maps to its newest occurrence, so a proposal costs ``max_n − min_n + 1`` dictionary
  reads plus the copy, whatever the history holds, and memory is a fixed number of entries per stored
  token (see :class:`SuffixIndex`), freed exactly when the sequence that owns them leaves the FIFO.
- **The newest occurrence, not the most frequent one.** The engine already prices each draft source by its
  live acceptance (``dflash2/spec/adaptive.py``), so a second, frequency-based confidence here would
  only duplicate it; recency also tracks an agent loop's latest version of a repeated text.

A copied draft is deterministic, like a prompt-lookup draft: its proposal distribution is one-hot on the
copied token, so rejection sampling (``dflash2/spec/verify.py``) keeps verification lossless.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import chain
from typing import NamedTuple


class _Sequence(NamedTuple):
    """One stored sequence: its tokens (context, then output) and where the output starts."""

    output_start: int
    tokens: tuple[int, ...]


class SuffixIndex:
    """The n-grams of recent finished requests' outputs, for drafts in any running request.

    ``add(context, output)`` stores one finished request: the last tokens of its prompt, then its output.
    ``propose(tail, k)`` finds the longest n-gram, ``max_n`` down to ``min_n`` tokens, that ends ``tail``
    and is indexed, and returns up to ``k`` tokens that followed its newest occurrence.

    Memory bound: at most ``max_requests`` sequences and ``max_tokens`` tokens are stored (context
    included), and the n-gram table holds at most ``max_n − min_n + 1`` entries per stored token (an
    entry per n per output token, and entries are shared between equal n-grams). In CPython an entry
    costs about 80 + 8·n bytes (its key tuple, and its share of the dictionary), plus about 70 bytes per
    stored token (the token, its position). Measured with ``tracemalloc`` (CPython 3.11, 200 outputs of
    1,000 tokens drawn from 32,000 ids, so nearly every n-gram is distinct): 2 … 8 (7 entries per token)
    about 0.95 KB per stored token, so ``max_tokens=262144`` holds about 250 MB at most; 2 … 4 about
    0.35–0.4 KB per token (about 100 MB).

    Time: an ``add`` of a 1,000-token output took about 2 ms into an empty index (2 … 8; 1.1 ms for
    2 … 4); in a full 262,144-token index, where each add also evicts about as many tokens, about 12 ms
    (2 … 8, 1.8 million entries) and 4 ms (2 … 4), on a busy 2-core machine; the rare add that resizes a
    table took up to about 150 ms (2 … 8). A ``propose`` took 4–7 µs.

    Thread safety: none (no lock). The engine thread alone adds finished requests and proposes for
    running ones, as it alone owns the other per-request lookup state.

    Args:
        min_n, max_n: the shortest and longest n-gram matched (1 ≤ min_n ≤ max_n).
        max_requests: the most sequences stored (≥ 1); the oldest are evicted first.
        max_tokens: the most tokens stored (≥ 1); a longer sequence keeps its last ``max_tokens``.

    Raises:
        ValueError: for bounds outside those ranges.
    """

    def __init__(self, min_n: int, max_n: int, max_requests: int, max_tokens: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"suffix index n-gram bounds must satisfy 1 <= min_n <= max_n (got {min_n}, {max_n})")
        if max_requests < 1:
            raise ValueError(f"suffix index max_requests must be at least 1 (got {max_requests})")
        if max_tokens < 1:
            raise ValueError(f"suffix index max_tokens must be at least 1 (got {max_tokens})")
        self.min_n, self.max_n = min_n, max_n
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.clear()

    def clear(self) -> None:
        """Forget every stored sequence."""
        # id → sequence, oldest first (dicts keep insertion order): the FIFO.
        self._sequences: dict[int, _Sequence] = {}
        # sequence → id: an exact duplicate replaces the stored copy instead of taking a second slot.
        self._ids: dict[_Sequence, int] = {}
        # For each n (min_n first): n-gram → the position of the token that followed its newest
        # occurrence, encoded as id · max_tokens + index in that sequence (an index is < max_tokens).
        # NOTE: one dictionary per n, because a dictionary resizes all at once when it fills: with the
        # churn of every add, one table for all n (1.8 million entries) paused an add for 200–600 ms.
        self._tables: list[dict[tuple[int, ...], int]] = [{} for _ in range(self.min_n, self.max_n + 1)]
        self._num_tokens = 0
        self._next_id = 0

    @property
    def num_requests(self) -> int:
        """Sequences stored (≤ ``max_requests``)."""
        return len(self._sequences)

    @property
    def num_tokens(self) -> int:
        """Tokens stored, context included (≤ ``max_tokens``)."""
        return self._num_tokens

    @property
    def num_entries(self) -> int:
        """N-gram table entries (≤ ``(max_n − min_n + 1) · num_tokens``)."""
        return sum(map(len, self._tables))

    def add(self, context: Sequence[int], output: Sequence[int]) -> None:
        """Store a finished request's ``output`` after ``context`` (the last tokens of its prompt).

        Every n-gram (``min_n`` … ``max_n`` tokens) whose next token lies in ``output`` is indexed, so a
        proposal always continues into generated text; the context only lets the first output tokens be
        found. Only the context's last ``max_n`` tokens are kept (no indexed n-gram reaches further back),
        and a sequence longer than ``max_tokens`` keeps its last ``max_tokens`` tokens. Nothing is stored
        for an empty output, nor for a sequence of at most ``min_n`` tokens (it has no n-gram with a next
        token). An exact duplicate of a stored sequence (same tokens, same output start) moves that
        sequence to the newest place instead of storing it twice: agent loops repeat whole outputs, and
        copies would spend the bounds on nothing a proposal can use. The oldest sequences are then evicted
        until the new one fits both bounds.

        Cost: O((max_n − min_n + 1) · L) for L stored tokens, for the new sequence and for each evicted one.
        """
        if len(output) == 0:
            return
        kept_context = context[-self.max_n :]
        tokens = tuple(map(int, chain(kept_context, output)))
        dropped = max(0, len(tokens) - self.max_tokens)
        sequence = _Sequence(max(0, len(kept_context) - dropped), tokens[dropped:])
        if len(sequence.tokens) <= self.min_n:
            return
        duplicate = self._ids.get(sequence)
        if duplicate is not None:
            self._evict(duplicate)
        self._make_room(len(sequence.tokens))
        seq_id, self._next_id = self._next_id, self._next_id + 1
        self._sequences[seq_id] = sequence
        self._ids[sequence] = seq_id
        self._num_tokens += len(sequence.tokens)
        for table, entries in self._entries(seq_id, sequence):
            table.update(entries)  # later occurrences come later, so each n-gram ends on its newest one

    def propose(self, tail: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the newest occurrence of the longest n-gram ending ``tail``.

        ``tail`` is a running request's tokens so far (prompt and output; only the last ``max_n`` are
        read). The proposal runs to the end of the stored sequence at most, never into the next one. The
        longest match wins even when its continuation is shorter than a shorter match's: a longer context
        is the better predictor, and the engine drafts again next step.

        Returns ``[]`` when ``k`` ≤ 0, ``tail`` is shorter than ``min_n``, or no n-gram ending it is
        indexed. Cost: at most ``max_n − min_n + 1`` dictionary reads, plus O(k) for the copy.
        """
        if k <= 0:
            return []
        last = tuple(map(int, tail[-self.max_n :]))
        for n in range(len(last), self.min_n - 1, -1):
            position = self._tables[n - self.min_n].get(last[len(last) - n :])
            if position is not None:
                seq_id, start = divmod(position, self.max_tokens)
                return list(self._sequences[seq_id].tokens[start : start + k])
        return []

    def _make_room(self, num_tokens: int) -> None:
        """Evict the oldest sequences until one more of ``num_tokens`` tokens fits both bounds."""
        while self._sequences and (
            len(self._sequences) >= self.max_requests or self._num_tokens + num_tokens > self.max_tokens
        ):
            self._evict(next(iter(self._sequences)))

    def _evict(self, seq_id: int) -> None:
        """Drop a stored sequence and the table entries that still point into it."""
        sequence = self._sequences.pop(seq_id)
        del self._ids[sequence]
        self._num_tokens -= len(sequence.tokens)
        for table, entries in self._entries(seq_id, sequence):
            # An entry a newer sequence re-pointed stays; within this sequence only the last occurrence of
            # a repeated n-gram matches its entry, so each entry is deleted once.
            get = table.get
            for gram in [gram for gram, position in entries if get(gram) == position]:
                del table[gram]

    def _entries(
        self, seq_id: int, sequence: _Sequence
    ) -> Iterator[tuple[dict[tuple[int, ...], int], Iterator[tuple[tuple[int, ...], int]]]]:
        """For each n: its table, and (n-gram, encoded position of its next token) for every indexed
        n-gram of the sequence, in order of position."""
        tokens, start = sequence.tokens, sequence.output_start
        length = len(tokens)
        base = seq_id * self.max_tokens
        # One int object per next-token position, shared by the entries of every n.
        positions = list(range(base + start, base + length))
        for n, table in enumerate(self._tables, self.min_n):
            first = max(start, n)  # the first next-token index with a whole n-gram before it
            if first >= length:
                break
            grams = zip(*(tokens[first - n + i : length - n + i] for i in range(n)))
            yield table, zip(grams, positions[first - start :])
