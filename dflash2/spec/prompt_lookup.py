"""Prompt lookup: drafts copied from earlier in the request's own tokens, beside the drafter.

Text often repeats what its context holds: code names the identifiers of its prompt, a second answer
quotes the first, a list repeats its own pattern. Prompt lookup decoding (Saxena, 2023; vLLM's
``ngram`` method, whose ``prompt_lookup_min`` / ``prompt_lookup_max`` name the same bounds; SuffixDecoding,
Oliaro et al., 2024, and Arctic Inference's hybrid of it with a model drafter) proposes the tokens that
followed the latest earlier occurrence of the request's last n tokens. Such a proposal costs no forward
at all, so where it is likely to be accepted it beats a drafter forward that would propose the same or
less: the adaptive policy (``dflash2/spec/adaptive.py``, :func:`~dflash2.spec.adaptive.choose_lookup_width`)
compares the two per step from the measured step costs and each source's live acceptance.

A lookup draft is deterministic: its proposal distribution is one-hot on the copied token, so
rejection sampling accepts it with probability ``p(d)`` and the residual is ``p`` without ``d``
(``dflash2/spec/verify.py``): lossless like any other draft.
"""

from __future__ import annotations

from collections.abc import Sequence


class PromptLookup:
    """The n-grams of one request's tokens (prompt + output), indexed as they are committed.

    ``propose(k)`` finds the longest n-gram, ``max_n`` down to ``min_n`` tokens, that ends the tokens
    and occurred before, and returns up to ``k`` tokens that followed its latest earlier occurrence.
    Indexing is incremental: each new token costs ``max_n − min_n + 1`` dictionary writes, and a
    lookup at most as many reads.

    Args:
        min_n, max_n: the shortest and longest n-gram matched (1 ≤ min_n ≤ max_n).
        prompt: the request's prompt, indexed now (the engine builds the index when a request is
            added, so a long prompt is not indexed inside an engine step that other rows share).

    Raises:
        ValueError: for bounds outside that range.
    """

    def __init__(self, min_n: int, max_n: int, prompt: Sequence[int] = ()) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup n-gram bounds must satisfy 1 <= min <= max (got {min_n}, {max_n})")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # n-gram → end index of its latest occurrence, for the n-grams that end before the last token.
        self._latest: dict[tuple[int, ...], int] = {}
        self.extend(prompt)
        self._prompt_length = len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append committed tokens (in order) and index the n-grams they complete."""
        for token in tokens:
            end = len(self.tokens) - 1  # the n-grams ending at the previous last token become findable
            if end >= 0:
                for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                    self._latest[tuple(self.tokens[end - n + 1 : end + 1])] = end
            self.tokens.append(int(token))

    def sync(self, output: Sequence[int]) -> None:
        """Catch up with the request's output so far (it only grows; the prompt is indexed already)."""
        self.extend(output[len(self.tokens) - self._prompt_length :])

    def propose(self, k: int, after: Sequence[int] = ()) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix
        (``[]`` when no suffix of at least ``min_n`` tokens occurred before, or ``k`` ≤ 0). ``after``: tokens
        known to come next (a grammar forces them), matched as if they were already the last tokens."""
        tail = [*self.tokens[-self.max_n :], *after] if after else self.tokens
        last = len(tail) - 1
        if k <= 0 or last < 0:
            return []
        for n in range(min(self.max_n, last + 1), self.min_n - 1, -1):
            end = self._latest.get(tuple(tail[last - n + 1 :]))
            if end is not None:
                return self.tokens[end + 1 : end + 1 + k]
        return []
