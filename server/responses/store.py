"""``ResponseStore``: the Responses API responses this server keeps, in memory, for ``previous_response_id`` and
``GET`` / ``DELETE /v1/responses/{id}``.

Bounded three ways: at most ``max_entries`` responses and ``max_bytes`` bytes (the least recently used response
goes first), and each response for ``ttl`` seconds after it was stored. A response is kept as the JSON the client
received and the JSON of every input item it was generated from: with ``previous_response_id`` that is the
previous response's input items, then its output items, then the request's own input, so each entry holds its
whole conversation and continuing it never depends on another entry still being there. Items are shared between
entries (never copied), but each entry's size counts all of its items, so ``num_bytes`` is an upper bound of the
memory held.

The store remembers why a recent id is gone (expired, evicted, deleted, too large), so a 404 can say so.

NOTE: not thread-safe: the server uses it from the event loop only, where each call runs to its end.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

EvictionReason = Literal["expired", "max_entries", "max_bytes"]
EVICTION_REASONS: tuple[EvictionReason, ...] = ("expired", "max_entries", "max_bytes")
GoneReason = Literal["expired", "max_entries", "max_bytes", "deleted"]

JSONObject = dict[str, Any]


@dataclass(frozen=True)
class StoredResponse:
    """One stored response.

    Attributes:
        response: the Response object as the client received it (``output`` included).
        input_items: every input item it was generated from, oldest first, each with an ``id``.
        num_bytes: the JSON size of ``response`` and ``input_items``.
        expires_at: when it expires, on the store's clock.
    """

    response: JSONObject
    input_items: tuple[JSONObject, ...]
    num_bytes: int
    expires_at: float

    @property
    def id(self) -> str:
        """The response's id (``resp_…``)."""
        response_id: str = self.response["id"]
        return response_id

    @property
    def context(self) -> tuple[JSONObject, ...]:
        """What a response continuing this one is generated from first: its input items, then its output."""
        return (*self.input_items, *self.response["output"])


def json_size(value: Any) -> int:
    """Bytes of ``value`` as compact JSON (UTF-8)."""
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


class ResponseStore:
    """Stored responses by id, bounded in entries, bytes and time.

    Args:
        max_entries: responses kept at most; 0 disables the store (``put`` keeps nothing).
        max_bytes: JSON bytes kept at most (a response larger than this alone is not kept).
        ttl: seconds a response is kept after ``put``.
        clock: seconds, monotonic (injectable for tests).
        on_evict: called with the reason each time a response leaves the store other than by ``delete``
            (for metrics).
    """

    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        ttl: float,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[EvictionReason], None] | None = None,
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl = ttl
        self.clock = clock
        self.on_evict = on_evict
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # least recently used first
        self._by_age: OrderedDict[str, float] = OrderedDict()  # id → expires_at, oldest first
        self._num_bytes = 0
        # Why recent ids are gone, bounded like the entries (a few dozen bytes each).
        self._gone: OrderedDict[str, GoneReason] = OrderedDict()

    @property
    def is_enabled(self) -> bool:
        """False when the store keeps nothing (``max_entries`` 0)."""
        return self.max_entries > 0

    @property
    def num_responses(self) -> int:
        """Responses held now (expired ones dropped first)."""
        self._expire()
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        """JSON bytes held now (expired responses dropped first)."""
        self._expire()
        return self._num_bytes

    def put(self, response: JSONObject, input_items: Sequence[JSONObject]) -> None:
        """Keep ``response`` (a Response object with ``id`` and ``output``) and the input items it was generated
        from, evicting the least recently used responses to make room. Nothing is kept when the store is
        disabled; a response larger than ``max_bytes`` alone is not kept (it is remembered as evicted)."""
        if not self.is_enabled:
            return
        self._expire()
        entry = StoredResponse(
            response=response,
            input_items=tuple(input_items),
            num_bytes=json_size(response) + sum(json_size(item) for item in input_items),
            expires_at=self.clock() + self.ttl,
        )
        self._remove(entry.id)
        if entry.num_bytes > self.max_bytes:
            self._evicted(entry.id, "max_bytes")
            return
        while self._entries and (
            len(self._entries) >= self.max_entries or self._num_bytes + entry.num_bytes > self.max_bytes
        ):
            oldest = next(iter(self._entries.values()))
            reason: EvictionReason = "max_entries" if len(self._entries) >= self.max_entries else "max_bytes"
            self._remove(oldest.id)
            self._evicted(oldest.id, reason)
        self._entries[entry.id] = entry
        self._by_age[entry.id] = entry.expires_at
        self._num_bytes += entry.num_bytes
        self._gone.pop(entry.id, None)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response (now the most recently used), or None when it is not here (``why_missing``)."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        """Forget a response; False when it is not here."""
        self._expire()
        if self._remove(response_id) is None:
            return False
        self._remember(response_id, "deleted")
        return True

    def why_missing(self, response_id: str) -> str:
        """Why ``response_id`` is not here, as the end of a sentence (for error messages)."""
        reason = self._gone.get(response_id)
        if reason == "expired":
            return f"it expired (responses are kept {self.ttl:g} s after they are created)"
        if reason == "deleted":
            return "it was deleted"
        if reason == "max_entries":
            return f"it was evicted to keep the store within {self.max_entries} responses"
        if reason == "max_bytes":
            return f"it was evicted to keep the store within {self.max_bytes} bytes"
        if not self.is_enabled:
            return "this server stores no responses (--responses-store-max-entries 0)"
        return (
            "no response with this id is stored on this server (it was created with store: false, by another "
            "server or replica, before a restart, or expired long ago)"
        )

    def _expire(self) -> None:
        """Drop the responses whose time is up (``_by_age`` is in expiry order: one ``ttl`` for all)."""
        now = self.clock()
        while self._by_age:
            response_id, expires_at = next(iter(self._by_age.items()))
            if expires_at > now:
                return
            self._remove(response_id)
            self._evicted(response_id, "expired")

    def _remove(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            del self._by_age[response_id]
            self._num_bytes -= entry.num_bytes
        return entry

    def _evicted(self, response_id: str, reason: EvictionReason) -> None:
        self._remember(response_id, reason)
        if self.on_evict is not None:
            self.on_evict(reason)

    def _remember(self, response_id: str, reason: GoneReason) -> None:
        self._gone[response_id] = reason
        self._gone.move_to_end(response_id)
        while len(self._gone) > self.max_entries:
            self._gone.popitem(last=False)
