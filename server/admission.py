"""Admission of generation requests: the concurrency limit (429) and the drain after SIGTERM (503).

Everything here runs on the event loop, so plain counters are enough.
"""

from __future__ import annotations

from server.errors import ServiceUnavailableError, TooManyRequestsError


class Admission:
    """Counts generation requests in flight (a stream counts until its last chunk)."""

    def __init__(self, max_concurrency: int) -> None:
        self.max_concurrency = max_concurrency
        self.num_in_flight = 0
        self.is_draining = False

    def enter(self) -> Ticket:
        """Admit one request; release the ticket when it is done.

        Raises:
            ServiceUnavailableError: while draining.
            TooManyRequestsError: at the concurrency limit.
        """
        if self.is_draining:
            raise ServiceUnavailableError("the server is shutting down")
        if self.num_in_flight >= self.max_concurrency:
            raise TooManyRequestsError(f"too many requests in flight (limit {self.max_concurrency}); retry later")
        self.num_in_flight += 1
        return Ticket(self)

    def begin_drain(self) -> None:
        """Stop admitting (readiness turns 503); requests in flight go on."""
        self.is_draining = True


class Ticket:
    """One admitted request; ``release`` is idempotent."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._is_released = False

    def release(self) -> None:
        """Give the slot back."""
        if not self._is_released:
            self._is_released = True
            self._admission.num_in_flight -= 1
