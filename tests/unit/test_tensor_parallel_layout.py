"""How a target splits over tensor-parallel ranks, and the flag's validation (no processes here:
tests/integration/test_tensor_parallel.py runs the ranks)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from dflash2.config import EngineConfig
from dflash2.engine_args import engine_config_from_args
from dflash2.models.tensor_parallel import check_shardable, head_split, split


@pytest.mark.parametrize(("size", "world"), [(1536, 2), (7, 3), (5, 4), (9, 2)])
def test_split_covers_every_item_once_as_evenly_as_it_goes(size, world):
    parts = [split(size, world, rank) for rank in range(world)]
    assert parts[0][0] == 0 and parts[-1][1] == size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(parts))
    lengths = [stop - start for start, stop in parts]
    assert max(lengths) - min(lengths) <= 1


@pytest.mark.parametrize(("heads", "kv_heads", "world"), [(9, 3, 2), (8, 2, 4), (32, 8, 8), (4, 2, 2), (12, 4, 8)])
def test_each_rank_keeps_whole_query_groups_with_their_kv_heads(heads, kv_heads, world):
    group = heads // kv_heads
    query_heads = []
    for rank in range(world):
        first, count, kv_first, kv_count = head_split(heads, kv_heads, world, rank)
        assert count >= 1 and kv_count >= 1
        mine = list(range(first, first + count))
        # Every query head this rank holds reads a KV head this rank holds.
        assert all(kv_first <= q // group < kv_first + kv_count for q in mine)
        query_heads += mine
    assert query_heads == list(range(heads))  # each query head on exactly one rank, in order


def test_smollm2_splits_over_two_ranks_unevenly():
    assert [head_split(9, 3, 2, rank) for rank in range(2)] == [(0, 6, 0, 2), (6, 3, 2, 1)]


@pytest.mark.parametrize(("heads", "kv_heads", "world"), [(9, 3, 4), (4, 2, 8), (6, 2, 3)])
def test_a_model_that_cannot_split_says_so(heads, kv_heads, world):
    config = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads, model_type="llama")
    if kv_heads >= world:
        check_shardable(config, world)  # (6, 2, 3) has fewer KV heads than ranks: rejected below
        return
    with pytest.raises(ValueError, match=f"--tensor-parallel-size {world} cannot split"):
        check_shardable(config, world)


def test_the_flag_and_its_validation():
    from dflash2.cli import build_parser

    args = build_parser().parse_args(["generate", "-tp", "2", "--prompt", "x"])
    assert engine_config_from_args(args).tensor_parallel_size == 2
    with pytest.raises(ValueError, match="1 … 64"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="--deterministic runs in one process"):
        EngineConfig(tensor_parallel_size=2, deterministic=True)
