"""Prefix caching: a new request reuses the target KV and the drafter context of a shared history.

Design: **longest-prefix slot reuse with copy** (llama.cpp's ``cache_prompt`` slots, extended to copy
from any slot). The KV caches are already one contiguous region per slot, so a finished request's
slot keeps what it computed: its prompt and its committed output. A new request then

1. takes the free slot whose whole entry is a prefix of its prompt, the longest such (no copy at
   all: the next turn of an agent loop lands on the slot of the previous turn), or else the least
   recently used free slot (an empty one first), evicting what that slot held, so that a new
   conversation never evicts another agent's history merely because they share a system prompt;
2. if another slot, free or running, shares a longer prefix (a system prompt common to several
   concurrent agents), copies that prefix's target KV and drafter context into its own slot: one
   memory copy of ``n`` positions, far cheaper than a forward over them;
3. prefills only the rest of its prompt, at least its last token (the logits of the first output
   token come from that forward).

Why not block hashing into a block pool (vLLM's APC, SGLang's radix tree): the engine's caches, its
compiled forwards and its O(1) rollback are built on one contiguous region per slot; paging them
would touch every forward for a benefit (sharing without copying) that a memory copy buys back at
this scale. Memory stays bounded by the slots themselves (``max_num_seqs × max_model_len``): the
cache is what the free slots still hold, evicted least recently used first.

Invariants (tests/integration/test_prefix_cache.py):

- only committed tokens are recorded: a slot's entry is the prompt plus the output whose KV is
  committed (``Request.num_cached`` tokens), never a rejected draft;
- the drafter context of a reused prefix was written by the same committed tokens' target features
  (a prefill, or the verify steps that accepted them), position by position;
- a request that ends with an error or an abort leaves its slot empty, and an evicted entry is
  gone: neither is ever read back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixMatch:
    """Where a new request's prompt prefix comes from.

    Attributes:
        slot: the free slot the request takes.
        num_cached: prompt tokens whose KV it will not recompute (0: a cold prefill).
        source: the slot to copy those tokens from, or None when ``slot`` already holds them.
    """

    slot: int
    num_cached: int
    source: int | None = None


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    """Which committed tokens every KV slot holds, and the choice of slot for a new request.

    Plain Python; the engine owns the copies and keeps the entries up to date: ``record`` when a
    request's slot is released (its committed tokens), ``clear`` when a slot's contents cannot be
    trusted (an error or an abort), ``assign`` when a request takes a slot.

    Args:
        num_slots: KV slots (``max_num_seqs``).
        enabled: False: every request gets a cold prefill and slots are chosen lowest first.
    """

    def __init__(self, num_slots: int, enabled: bool = True) -> None:
        self.enabled = enabled
        self.entries: list[list[int]] = [[] for _ in range(num_slots)]
        self._last_used = [0] * num_slots
        self._clock = 0

    def choose(
        self, prompt_ids: Sequence[int], free_slots: Sequence[int], busy: Mapping[int, Sequence[int]]
    ) -> PrefixMatch:
        """The slot for a new request and how much of its prompt is cached.

        Args:
            prompt_ids: the new request's prompt.
            free_slots: slots no request holds (their entries are reusable, or evictable).
            busy: running slots → the tokens whose KV is committed there (copy sources only).

        Returns:
            A ``PrefixMatch``; ``num_cached`` is at most ``len(prompt_ids) − 1``.

        Raises:
            ValueError: ``free_slots`` is empty.
        """
        if not free_slots:
            raise ValueError("no free slot")
        if not self.enabled:
            return PrefixMatch(min(free_slots), 0)
        limit = len(prompt_ids) - 1
        shared = {slot: common_prefix_length(self.entries[slot], prompt_ids) for slot in free_slots}
        extended = [s for s in free_slots if self.entries[s] and shared[s] == len(self.entries[s])]
        if extended:  # the prompt continues this slot's history: reuse it in place
            slot = max(extended, key=lambda s: (shared[s], -s))
        else:  # evict the least recently used free slot (an empty one first)
            slot = min(free_slots, key=lambda s: (bool(self.entries[s]), self._last_used[s], s))
        num_cached, source = min(shared[slot], limit), None
        others: dict[int, Sequence[int]] = {s: self.entries[s] for s in free_slots if s != slot}
        others.update(busy)
        for other, tokens in others.items():
            length = min(common_prefix_length(tokens, prompt_ids), limit)
            if length > num_cached:
                num_cached, source = length, other
        return PrefixMatch(slot, num_cached, source)

    def assign(self, slot: int, prompt_ids: Sequence[int], num_cached: int) -> None:
        """A request took ``slot`` holding ``prompt_ids[:num_cached]``: the rest of the old entry is gone."""
        self._clock += 1
        self._last_used[slot] = self._clock
        self.entries[slot] = list(prompt_ids[:num_cached])

    def record(self, slot: int, tokens: Sequence[int]) -> None:
        """The request in ``slot`` finished with ``tokens`` committed there (prompt + output in the KV)."""
        self._clock += 1
        self._last_used[slot] = self._clock
        self.entries[slot] = list(tokens) if self.enabled else []

    def clear(self, slot: int) -> None:
        """Forget ``slot``'s entry (its KV may not hold what the entry says)."""
        self.entries[slot] = []

    @property
    def num_cached_tokens(self) -> int:
        """Tokens held by all entries (free and running slots' last recorded contents)."""
        return sum(len(entry) for entry in self.entries)
