"""Grouped-query attention: the folded path for few queries equals the reference."""

from __future__ import annotations

import pytest
import torch

from dflash2.models.layers import FOLD_MAX_QUERIES, attention


def _reference(q, k, v, mask):
    """Each query head attends over its K/V head (h // g), materialised, in float64."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = (q.double() @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    out = probs @ v  # [R, nh, L, d]
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


@pytest.mark.parametrize("num_queries", [1, 8, FOLD_MAX_QUERIES, FOLD_MAX_QUERIES + 1])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_attention_matches_the_materialised_reference(num_queries, num_heads, num_kv_heads):
    g = torch.Generator().manual_seed(num_queries * 100 + num_heads * 10 + num_kv_heads)
    rows, head_dim, max_len = 3, 16, 96
    context = torch.tensor([5, 20, 30])  # per-row context before the queries
    key_len = int(context.max()) + num_queries
    # K/V as strided views of a larger cache, as the engine reads them.
    cache_k = torch.randn(rows, num_kv_heads, max_len + num_queries, head_dim, generator=g)
    cache_v = torch.randn(rows, num_kv_heads, max_len + num_queries, head_dim, generator=g)
    k, v = cache_k[:, :, :key_len], cache_v[:, :, :key_len]
    q = torch.randn(rows, num_queries, num_heads, head_dim, generator=g).transpose(1, 2)  # non-contiguous
    # Causal over each row's own context + queries; a row's later positions are padding.
    query_pos = context[:, None] + torch.arange(num_queries)[None]  # [R, L]
    mask = (torch.arange(key_len)[None, None] <= query_pos[..., None])[:, None]  # [R, 1, L, T]
    out = attention(q, k, v, mask)
    assert out.shape == (rows, num_queries, num_heads * head_dim)
    torch.testing.assert_close(out.double(), _reference(q, k, v, mask), atol=1e-5, rtol=1e-5)
