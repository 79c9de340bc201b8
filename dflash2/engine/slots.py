"""KV slots at admission and release: which slot a request gets (the prefix cache's choice, with the
cached part of its prompt copied in or kept) and what a finished request leaves in its slot."""

from __future__ import annotations

from dflash2.engine.drafter_context import write_context
from dflash2.engine.prefix_cache import PrefixCache
from dflash2.engine.request import Request
from dflash2.engine.scheduler import Scheduler
from dflash2.outputs import FinishReason
from dflash2.runner import ModelRunner


class SlotAllocator:
    """The allocator of the KV caches' slots (one per running request): which free slot a request gets
    at admission, and the release of a finished request's slot, over the scheduler's running requests.

    Args:
        scheduler: FIFO admission and the running set; runner: owns the caches;
        prefix_cache: what each slot holds (``enabled`` False: never reused).
    """

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, prefix_cache: PrefixCache) -> None:
        self.scheduler, self.runner, self.prefix_cache = scheduler, runner, prefix_cache

    def admit(self) -> list[Request]:
        """Move waiting requests into free slots (FIFO); returns the admitted ones."""
        return self.scheduler.admit(self.choose)

    def choose(self, request: Request, free_slots: list[int]) -> int:
        """The slot for ``request`` and the cached part of its prompt (copied here when it lives in
        another slot); ``request.num_cached`` is set to it."""
        running = {r.slot: r for r in self.scheduler.running if r.slot is not None}
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

    def release(self, request: Request) -> None:
        """Free a finished request's slot; what it committed stays there for the prefix cache, unless it
        was aborted or failed (then nothing in the slot is trusted)."""
        if request.slot is not None:
            if request.finish_reason is FinishReason.ABORT:
                self.prefix_cache.clear(request.slot)
            elif self.prefix_cache.enabled:
                write_context(self.runner, [request])
                self.prefix_cache.record(request.slot, committed_tokens(request))
            self.runner.free(request.slot)
        request.pending_context.clear()
        self.scheduler.remove(request)

    def release_finished(self) -> None:
        """Release every running request that finished this step."""
        for request in [r for r in self.scheduler.running if r.is_finished]:
            self.release(request)

    def decode_rows(self) -> list[Request]:
        """The running requests that decode this step, in slot order: when the running slots are
        contiguous (a full batch), the KV cache reads are views instead of gathers."""
        return sorted((r for r in self.scheduler.running if not r.is_finished), key=slot_of)


def committed_tokens(request: Request) -> list[int]:
    """The tokens whose target KV and drafter context a request's slot holds: prompt + output, up to
    ``num_cached`` (the anchor, the last output token, is not in the cache yet)."""
    return [*request.prompt_ids, *request.output_ids][: request.num_cached]


def slot_of(request: Request) -> int:
    """The slot of a running request."""
    assert request.slot is not None
    return request.slot
