"""Per-request timestamps and token counts, filled by the engine client and read by the metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestTimings:
    """Monotonic timestamps and token counts of one engine request, for the per-request metrics.

    ``scheduled`` is the start of the engine step that prefilled the request (its first output);
    ``num_prompt_tokens`` and ``max_tokens`` are what the request was submitted to the engine with.
    """

    arrival: float
    num_prompt_tokens: int
    max_tokens: int
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    num_output_tokens: int = 0
    finish_reason: str | None = None

    @property
    def queue_time(self) -> float | None:
        """Seconds waited before the prefill step began."""
        return _interval(self.arrival, self.scheduled)

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first delivered token."""
        return _interval(self.arrival, self.first_token)

    @property
    def prefill_time(self) -> float | None:
        """Seconds from the start of the prefill step to the first delivered token."""
        return _interval(self.scheduled, self.first_token)

    @property
    def decode_time(self) -> float | None:
        """Seconds from the first delivered token to the last."""
        return _interval(self.first_token, self.last_token)

    @property
    def inference_time(self) -> float | None:
        """Seconds from the start of the prefill step to the last delivered token."""
        return _interval(self.scheduled, self.last_token)

    @property
    def e2e_latency(self) -> float | None:
        """Seconds from arrival to the end."""
        return _interval(self.arrival, self.finished)

    @property
    def time_per_output_token(self) -> float | None:
        """Decode seconds per output token after the first (None below two tokens)."""
        decode_time = self.decode_time
        return None if decode_time is None or self.num_output_tokens < 2 else decode_time / (self.num_output_tokens - 1)

    @property
    def tokens_per_second(self) -> float | None:
        """Output tokens after the first per second of decoding (None below two tokens or no time)."""
        per_token = self.time_per_output_token
        return 1.0 / per_token if per_token else None


def _interval(start: float | None, end: float | None) -> float | None:
    """Seconds from ``start`` to ``end`` (monotonic timestamps; never negative), None if either is unknown."""
    return None if start is None or end is None else max(0.0, end - start)
