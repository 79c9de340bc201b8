"""Admission and slot bookkeeping for continuous batching (plain Python, no torch)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from dflash2.engine.request import Request


class Scheduler:
    """FIFO admission of waiting requests into a fixed number of KV slots.

    Every slot holds one request for up to ``max_model_len`` tokens, so admission needs
    only a free slot; requests longer than that are rejected before they get here. A request's
    lifecycle is where it is: in ``waiting``, in ``running`` (holding a slot), or in neither (finished).
    """

    def __init__(self, max_num_seqs: int) -> None:
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots: list[int] = list(range(max_num_seqs - 1, -1, -1))

    @property
    def num_waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """Requests holding a slot."""
        return len(self.running)

    def add(self, request: Request) -> None:
        """Queue a request."""
        self.waiting.append(request)

    def admit(self, choose_slot: Callable[[Request, list[int]], int] | None = None) -> list[Request]:
        """Move waiting requests into free slots in FIFO order; returns the admitted ones.

        Args:
            choose_slot: picks one of the free slots for a request (the prefix cache's choice);
                default: the lowest.
        """
        admitted = []
        while self.waiting and self.free_slots:
            request = self.waiting.popleft()
            slot = choose_slot(request, sorted(self.free_slots)) if choose_slot else min(self.free_slots)
            self.free_slots.remove(slot)
            request.slot = slot
            self.running.append(request)
            admitted.append(request)
        return admitted

    def remove(self, request: Request) -> None:
        """Take a request out of the queue or release its slot at once."""
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
            assert request.slot is not None
            self.free_slots.append(request.slot)
            self.free_slots.sort(reverse=True)

    def find(self, request_id: str) -> Request | None:
        """The queued or running request with this id, if any."""
        for request in (*self.running, *self.waiting):
            if request.request_id == request_id:
                return request
        return None
