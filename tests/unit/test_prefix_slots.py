"""The slot choice of the prefix cache (plain Python)."""

from __future__ import annotations

import pytest

from dflash2.engine.prefix_cache import PrefixCache, PrefixMatch, common_prefix_length


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0


def test_next_turn_reuses_its_own_slot_in_place():
    cache = PrefixCache(3)
    cache.record(1, [1, 2, 3, 4, 5])
    assert cache.choose([1, 2, 3, 4, 5, 6, 7], [0, 1, 2], {}) == PrefixMatch(1, 5)


def test_at_least_the_last_prompt_token_is_recomputed():
    cache = PrefixCache(2)
    cache.record(0, [1, 2, 3, 4])
    assert cache.choose([1, 2, 3, 4], [0, 1], {}) == PrefixMatch(0, 3)


def test_a_new_conversation_copies_a_shared_prefix_instead_of_evicting_a_history():
    """Slots 0 and 1 hold two agents' histories (same system prompt 1, 2, 3); a third agent takes the
    empty slot 2 and copies the system prompt, leaving both histories in place."""
    cache = PrefixCache(3)
    cache.record(0, [1, 2, 3, 10, 11])
    cache.record(1, [1, 2, 3, 20, 21])
    match = cache.choose([1, 2, 3, 30], [0, 1, 2], {})
    assert match.slot == 2 and match.num_cached == 3 and match.source in (0, 1)


def test_copies_from_a_running_slot():
    cache = PrefixCache(2)
    assert cache.choose([7, 8, 9, 1], [1], {0: [7, 8, 9, 5, 5]}) == PrefixMatch(1, 3, source=0)


def test_eviction_is_least_recently_used_and_empty_slots_go_first():
    cache = PrefixCache(3)
    cache.record(0, [1])
    cache.record(1, [2])
    assert cache.choose([9, 9], [0, 1, 2], {}).slot == 2  # empty
    assert cache.choose([9, 9], [0, 1], {}).slot == 0  # least recently used
    cache.assign(0, [9, 9], 0)  # a request took slot 0 and cached nothing there yet
    assert cache.entries[0] == []
    cache.record(0, [9, 9, 4])  # … and finished: now slot 1 is the least recently used
    assert cache.choose([8, 8], [0, 1], {}).slot == 1


def test_cleared_and_evicted_entries_are_never_matched():
    cache = PrefixCache(2)
    cache.record(0, [1, 2, 3])
    cache.clear(0)
    assert cache.choose([1, 2, 3, 4], [0, 1], {}).num_cached == 0
    cache.record(1, [5, 6, 7])
    cache.assign(1, [5, 9, 9], 1)  # a request took slot 1 keeping only [5]
    assert cache.choose([5, 6, 7, 8], [0], {}).num_cached == 0  # slot 1 is busy now; its old tokens are gone
    assert cache.choose([5, 6, 7, 8], [0], {1: cache.entries[1]}).num_cached == 1


def test_disabled_cache_always_prefills_cold():
    cache = PrefixCache(2, enabled=False)
    cache.record(1, [1, 2, 3])
    assert cache.entries[1] == []
    assert cache.choose([1, 2, 3, 4], [0, 1], {}) == PrefixMatch(0, 0)


def test_no_free_slot_is_an_error():
    with pytest.raises(ValueError):
        PrefixCache(1).choose([1, 2], [], {})
