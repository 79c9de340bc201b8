"""Suffix index: n-gram continuations from earlier requests' outputs, its bounds and its eviction."""

from __future__ import annotations

import random

import pytest

from dflash2.spec.suffix import SuffixIndex


def index(min_n=1, max_n=3, max_requests=16, max_tokens=1024) -> SuffixIndex:
    return SuffixIndex(min_n, max_n, max_requests, max_tokens)


class Reference:
    """The definition, by brute force: a FIFO list of sequences, scanned newest-first at each proposal."""

    def __init__(self, min_n, max_n, max_requests, max_tokens):
        self.min_n, self.max_n = min_n, max_n
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.sequences: list[tuple[int, list[int]]] = []  # (output start, tokens), oldest first

    def add(self, context, output):
        if not output:
            return
        kept_context = list(context)[-self.max_n :]
        tokens = kept_context + list(output)
        dropped = max(0, len(tokens) - self.max_tokens)
        sequence = (max(0, len(kept_context) - dropped), tokens[dropped:])
        if len(sequence[1]) <= self.min_n:
            return
        if sequence in self.sequences:
            self.sequences.remove(sequence)
        while self.sequences and (
            len(self.sequences) >= self.max_requests or self.num_tokens + len(sequence[1]) > self.max_tokens
        ):
            self.sequences.pop(0)
        self.sequences.append(sequence)

    @property
    def num_tokens(self):
        return sum(len(tokens) for _, tokens in self.sequences)

    def indexed(self, n):
        """(end of the n-gram, tokens) for every indexed n-gram of every sequence, newest first."""
        for start, tokens in reversed(self.sequences):
            for j in range(len(tokens) - 1, max(start, n) - 1, -1):
                yield j, tokens

    def distinct_ngrams(self):
        return {tuple(tokens[j - n : j]) for n in range(self.min_n, self.max_n + 1) for j, tokens in self.indexed(n)}

    def propose(self, tail, k):
        if k <= 0:
            return []
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            for j, tokens in self.indexed(n):
                if tokens[j - n : j] == list(tail[-n:]):
                    return tokens[j : j + k]
        return []


@pytest.mark.parametrize(
    "bounds,message",
    [
        ((0, 3, 4, 100), "1 <= min_n <= max_n"),
        ((3, 2, 4, 100), "1 <= min_n <= max_n"),
        ((1, 3, 0, 100), "max_requests"),
        ((1, 3, 4, 0), "max_tokens"),
    ],
)
def test_bad_bounds_are_rejected(bounds, message):
    with pytest.raises(ValueError, match=message):
        SuffixIndex(*bounds)


def test_the_newest_occurrence_is_proposed():
    suffixes = index(min_n=2)
    suffixes.add([], [1, 2, 3, 5])
    suffixes.add([], [7, 1, 2, 4, 6])
    assert suffixes.propose([9, 1, 2], 3) == [4, 6]  # the newer request's continuation, to its end
    suffixes.add([], [1, 2, 8, 1, 2, 9])
    assert suffixes.propose([9, 1, 2], 3) == [9]  # within a request too, the later occurrence


def test_the_longest_match_wins_over_a_newer_shorter_one():
    suffixes = index(min_n=2, max_n=3)
    suffixes.add([], [5, 1, 2, 7, 7])
    suffixes.add([], [6, 1, 2, 8, 8])
    assert suffixes.propose([5, 1, 2], 4) == [7, 7]  # "5 1 2" (older) beats "1 2" (newer)
    assert suffixes.propose([4, 1, 2], 4) == [8, 8]  # no 3-gram: the newest "1 2"
    assert suffixes.propose([4, 4, 2], 4) == []  # "4 2" never occurred; min_n = 2


def test_a_proposal_never_runs_into_the_next_sequence():
    suffixes = index(min_n=1)
    suffixes.add([], [1, 2, 3])
    suffixes.add([], [4, 5, 6])
    assert suffixes.propose([1, 2], 10) == [3]
    assert suffixes.propose([5], 10) == [6]


def test_the_context_finds_the_first_output_tokens_but_is_never_proposed():
    suffixes = index(min_n=1, max_n=3)
    suffixes.add([1, 2, 3], [9, 8])
    assert suffixes.propose([1, 2, 3], 4) == [9, 8]  # the prompt's last tokens lead into the output
    assert suffixes.propose([0, 3], 4) == [9, 8]
    # n-grams whose next token is in the context are not indexed: nothing continues into it.
    assert suffixes.propose([1], 4) == []
    assert suffixes.propose([1, 2], 4) == []
    assert suffixes.propose([2], 4) == []
    assert suffixes.num_tokens == 5


def test_only_the_last_max_n_context_tokens_are_stored():
    suffixes = index(min_n=1, max_n=2)
    suffixes.add([1, 2, 3, 4], [9])
    assert suffixes.num_tokens == 3  # 3 4 9
    assert suffixes.propose([3, 4], 2) == [9]


def test_nothing_to_propose_or_nothing_stored():
    suffixes = index(min_n=2)
    suffixes.add([1, 2], [])  # empty output
    suffixes.add([], [1, 2])  # too short to hold a 2-gram with a next token
    assert suffixes.num_requests == 0 and suffixes.num_tokens == 0
    suffixes.add([], [1, 2, 3])
    assert suffixes.propose([1, 2], 0) == []
    assert suffixes.propose([2], 3) == []  # tail shorter than min_n
    assert suffixes.propose([], 3) == []
    assert suffixes.propose([1, 2], 3) == [3]


def test_eviction_by_max_requests_is_oldest_first():
    suffixes = index(min_n=2, max_requests=2)
    suffixes.add([], [1, 2, 3])
    suffixes.add([], [4, 5, 6])
    suffixes.add([], [7, 8, 9])
    assert suffixes.num_requests == 2 and suffixes.num_tokens == 6
    assert suffixes.propose([1, 2], 3) == []  # the first request is gone
    assert suffixes.propose([4, 5], 3) == [6]
    assert suffixes.propose([7, 8], 3) == [9]


def test_eviction_keeps_entries_a_newer_sequence_re_pointed():
    suffixes = index(min_n=2, max_requests=2)
    suffixes.add([], [1, 2, 3, 4])
    suffixes.add([], [0, 1, 2, 5])  # re-points "1 2"
    suffixes.add([], [6, 6, 6])  # evicts the first: its "1 2" entry is not its own any more
    assert suffixes.propose([1, 2], 3) == [5]
    assert suffixes.propose([2, 3], 3) == []  # its own entries are gone
    suffixes.add([], [7, 7, 7])  # evicts the second
    assert suffixes.propose([1, 2], 3) == []


def test_a_newer_identical_sequence_survives_the_older_ones_eviction():
    suffixes = index(min_n=2, max_requests=2)
    suffixes.add([], [1, 2, 3])
    suffixes.add([], [4, 5, 6])
    suffixes.add([], [1, 2, 3])  # a duplicate moves to the newest place instead of taking a slot
    assert suffixes.num_requests == 2 and suffixes.num_tokens == 6
    suffixes.add([], [7, 8, 9])  # evicts "4 5 6", now the oldest
    assert suffixes.propose([4, 5], 3) == []
    assert suffixes.propose([1, 2], 3) == [3]
    # The same tokens with another context/output split are another sequence (other n-grams indexed).
    suffixes.add([1], [2, 3])
    assert suffixes.num_requests == 2
    assert suffixes.propose([1, 2], 3) == [3]


def test_a_sequence_longer_than_max_tokens_keeps_its_last_tokens():
    suffixes = index(min_n=1, max_n=2, max_tokens=5)
    suffixes.add([], [1, 2, 3, 4, 5, 6, 7, 8])
    assert suffixes.num_tokens == 5 and suffixes.num_requests == 1
    assert suffixes.propose([4, 5], 5) == [6, 7, 8]
    assert suffixes.propose([2], 5) == []  # dropped
    assert suffixes.propose([1, 4], 5) == [5, 6, 7, 8]  # "1 4" never occurred: the 1-gram "4"
    suffixes.add([1, 2], [3, 4, 5, 6])  # 6 tokens: the context's first token is dropped
    assert suffixes.num_tokens == 5 and suffixes.num_requests == 1
    assert suffixes.propose([2], 5) == [3, 4, 5, 6]  # the context's kept token still leads in
    assert suffixes.propose([6], 5) == []  # the last token has no next token


def test_the_memory_bound_holds_after_many_adds():
    rng = random.Random(7)
    min_n, max_n, max_tokens = 2, 8, 2000
    suffixes = SuffixIndex(min_n, max_n, max_requests=64, max_tokens=max_tokens)
    for _ in range(300):
        context = [rng.randrange(50) for _ in range(rng.randrange(12))]
        suffixes.add(context, [rng.randrange(50) for _ in range(rng.randrange(1, 400))])
        assert suffixes.num_tokens <= max_tokens and suffixes.num_requests <= 64
        assert suffixes.num_entries <= (max_n - min_n + 1) * suffixes.num_tokens
    assert suffixes.num_tokens > max_tokens // 2  # the bound was reached, not dodged by storing nothing


def test_clear_forgets_everything():
    suffixes = index(min_n=1)
    suffixes.add([1], [2, 3])
    suffixes.clear()
    assert suffixes.num_requests == 0 and suffixes.num_tokens == 0 and suffixes.num_entries == 0
    assert suffixes.propose([1, 2], 3) == []
    suffixes.add([1], [2, 3])
    assert suffixes.propose([1, 2], 3) == [3]


def test_tails_and_outputs_may_be_any_integer_sequence():
    suffixes = index(min_n=2)
    suffixes.add((4, 5), range(6, 10))
    assert suffixes.propose((0, 5, 6), 2) == [7, 8]
    assert all(type(token) is int for token in suffixes.propose(range(5, 7), 3))


@pytest.mark.parametrize("seed", range(8))
def test_proposals_agree_with_a_brute_force_scan(seed):
    rng = random.Random(seed)
    for _ in range(60):  # 8 seeds x 60 configurations x ~10 adds x 6 tails
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        bounds = (min_n, max_n, rng.randint(1, 5), rng.randint(1, 40))
        suffixes, reference = SuffixIndex(*bounds), Reference(*bounds)
        vocab = rng.randint(2, 4)
        for _ in range(rng.randint(1, 12)):
            context = [rng.randrange(vocab) for _ in range(rng.randrange(8))]
            output = [rng.randrange(vocab) for _ in range(rng.randrange(16))]
            if reference.sequences and rng.random() < 0.2:  # repeat a stored sequence now and then
                start, tokens = rng.choice(reference.sequences)
                context, output = tokens[:start], tokens[start:]
            suffixes.add(context, output)
            reference.add(context, output)
            assert suffixes.num_requests == len(reference.sequences)
            assert suffixes.num_tokens == reference.num_tokens
            assert suffixes.num_entries == len(reference.distinct_ngrams())  # no stale entries left
            for _ in range(6):
                tail = [rng.randrange(vocab) for _ in range(rng.randrange(max_n + 3))]
                k = rng.randrange(-1, 8)
                assert suffixes.propose(tail, k) == reference.propose(tail, k)
