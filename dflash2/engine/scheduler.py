"""Scheduling for continuous batching: the FIFO queue, the KV slots (one per running request) and what
moves between them. At admission a request takes a free slot (the prefix cache's choice, with the cached
part of its prompt copied in or kept there); at release its slot becomes free again, keeping what it
committed for the prefix cache.

A request's lifecycle is where it is: in ``waiting``, in ``running`` (holding a slot), or in neither
(finished).
"""

from __future__ import annotations

from collections import deque

from dflash2.engine.drafter_context import write_context
from dflash2.engine.prefix_cache import PrefixCache
from dflash2.engine.request import Request, committed_tokens, slot_of
from dflash2.outputs import FinishReason
from dflash2.runner import ModelRunner


class Scheduler:
    """FIFO admission of waiting requests into a fixed number of KV slots, and their release.

    Every slot holds one request for up to ``max_model_len`` tokens, so admission needs only a free
    slot; requests longer than that are rejected before they get here.

    Args:
        max_num_seqs: KV slots.
        runner: owns the caches (prefix copies, freed slots, the drafter context written at release).
        prefix_cache: what each slot holds (``enabled`` False: never reused).
    """

    def __init__(self, max_num_seqs: int, runner: ModelRunner, prefix_cache: PrefixCache) -> None:
        self.runner, self.prefix_cache = runner, prefix_cache
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

    def find(self, request_id: str) -> Request | None:
        """The queued or running request with this id, if any."""
        for request in (*self.running, *self.waiting):
            if request.request_id == request_id:
                return request
        return None

    def admit(self) -> list[Request]:
        """Move waiting requests into free slots in FIFO order (:meth:`choose` picks each one's slot);
        returns the admitted ones."""
        admitted = []
        while self.waiting and self.free_slots:
            request = self.waiting.popleft()
            slot = self.choose(request, sorted(self.free_slots))
            self.free_slots.remove(slot)
            request.slot = slot
            self.running.append(request)
            admitted.append(request)
        return admitted

    def choose(self, request: Request, free_slots: list[int]) -> int:
        """The slot for ``request`` and the cached part of its prompt (copied here when it lives in
        another slot); ``request.num_cached`` is set to it."""
        running = {r.slot: r for r in self.running if r.slot is not None}
        # Copy sources only matter with the cache on: no token lists are built on every admission otherwise.
        busy = {slot: committed_tokens(r) for slot, r in running.items()} if self.prefix_cache.enabled else {}
        match = self.prefix_cache.choose(request.prompt_ids, free_slots, busy)
        if match.source is not None:
            if match.source in running:  # its drafter context must be complete before it is copied
                write_context(self.runner, [running[match.source]])
            self.runner.copy_prefix(match.source, match.slot, match.num_cached)
        self.prefix_cache.assign(match.slot, request.prompt_ids, match.num_cached)
        request.num_cached = request.num_cached_prompt_tokens = match.num_cached
        return match.slot

    def decode_rows(self) -> list[Request]:
        """The running requests that decode this step, in slot order: when the running slots are
        contiguous (a full batch), the KV cache reads are views instead of gathers."""
        return sorted((r for r in self.running if not r.is_finished), key=slot_of)

    def release(self, request: Request) -> None:
        """End a request's time here: out of the queue, or its slot freed at once. What it committed stays
        in the slot for the prefix cache, unless it was aborted or failed (then nothing there is trusted)."""
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            slot = slot_of(request)
            if request.finish_reason is FinishReason.ABORT:
                self.prefix_cache.clear(slot)
            elif self.prefix_cache.enabled:
                write_context(self.runner, [request])
                self.prefix_cache.record(slot, committed_tokens(request))
            self.runner.free(slot)
            self.running.remove(request)
            self.free_slots.append(slot)
            self.free_slots.sort(reverse=True)
        request.pending_context.clear()

    def release_finished(self) -> None:
        """Release every running request that finished this step."""
        for request in [r for r in self.running if r.is_finished]:
            self.release(request)
