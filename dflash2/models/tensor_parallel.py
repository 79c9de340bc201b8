"""Megatron-style tensor parallelism of the target decoder (:class:`~dflash2.models.llama.TargetModel`).

:func:`shard_target` cuts a loaded target into rank ``r``'s share of ``N`` (Shoeybi et al. 2019,
"Megatron-LM", §3), in place:

* **Attention.** Q/K/V are column-parallel by key/value group: rank r keeps a contiguous run of KV
  heads and the query heads that read them. With at least as many KV heads as ranks the KV heads are
  split as evenly as they go (SmolLM2's 3 over 2 ranks: 2 and 1, so 6 and 3 query heads); with fewer,
  each KV head is replicated on ``N/nkv`` ranks, which split its group's query heads. The output
  projection is row-parallel: each rank multiplies its heads' slice, and one all-reduce sums the parts.
* **MLP.** Gate and up are column-parallel over the intermediate size (split as evenly as it goes),
  down is row-parallel: one more all-reduce. So a decoder layer costs two all-reduces of ``[R, L, H]``.
* **Embedding and LM head.** Vocabulary-parallel: rank r holds rows ``[r·⌈V/N⌉, …)`` of each; a token
  outside a rank's rows embeds to zeros there and an all-reduce sums the one rank that has it; the
  LM head's logits shards are all-gathered (padded to equal shards, the padding cut off).
* Norms and the rotary tables are replicated; each rank's KV cache holds its own KV heads.

The collectives are ``torch.distributed``'s functional collectives (gloo on CPU, NCCL on CUDA), which
``torch.compile`` traces into the runner's graphs. Every rank must run the same forwards in the same
order: the runner's :class:`~dflash2.runner.tensor_parallel.TensorParallelGroup` sees to that.

Dimension letters: R rows, L positions per row, H hidden size, V vocab (Vₗ a rank's share), N ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash2.models.layers import MLP
from dflash2.models.llama import TargetModel


@dataclass(frozen=True)
class ShardInfo:
    """Where a sharded target sits: ``rank`` of ``world_size``, and the process group its collectives use."""

    rank: int
    world_size: int
    group: Any


def check_shardable(config: Any, world_size: int) -> None:
    """Raise ``ValueError`` unless a target of this Hugging Face ``config`` splits over ``world_size`` ranks:
    at least as many KV heads as ranks, or a number of ranks that is a multiple of the KV heads whose
    query groups leave every rank a query head."""
    if world_size < 1:
        raise ValueError("--tensor-parallel-size must be at least 1")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if kv_heads < world_size and (world_size % kv_heads or heads // kv_heads < world_size // kv_heads):
        raise ValueError(
            f"--tensor-parallel-size {world_size} cannot split this model ({config.model_type}): it has {kv_heads} "
            f"key/value heads and {heads} query heads; with fewer key/value heads than ranks the ranks must be a "
            "multiple of the key/value heads and at most the query heads"
        )


def split(size: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s ``[start, stop)`` of ``size`` items split over ``world_size`` ranks as evenly as they go
    (the first ``size mod N`` ranks take one more)."""
    base, extra = divmod(size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def head_split(num_heads: int, num_kv_heads: int, world_size: int, rank: int) -> tuple[int, int, int, int]:
    """``(first query head, query heads, first KV head, KV heads)`` of rank ``rank`` (module docstring)."""
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= world_size:
        kv_start, kv_stop = split(num_kv_heads, world_size, rank)
        return kv_start * group, (kv_stop - kv_start) * group, kv_start, kv_stop - kv_start
    sharing = world_size // num_kv_heads  # ranks per KV head
    kv_head = rank // sharing
    start, stop = split(group, sharing, rank % sharing)
    return kv_head * group + start, stop - start, kv_head, 1


def all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of ``x`` over the group's ranks (a functional collective: traceable by ``torch.compile``)."""
    from torch.distributed import _functional_collectives as collectives

    return collectives.wait_tensor(collectives.all_reduce(x, "sum", group))


def all_gather_last(x: torch.Tensor, group: Any, world_size: int) -> torch.Tensor:
    """``x [..., D]`` of every rank concatenated in rank order along the last dimension: ``[..., N·D]``."""
    from torch.distributed import _functional_collectives as collectives

    return collectives.wait_tensor(collectives.all_gather_single(x.contiguous(), x.dim() - 1, group))


class RowParallelLinear(nn.Module):
    """A linear layer whose input features are split over the ranks: each rank multiplies its slice and
    the partial outputs are summed with one all-reduce. The bias (if any) is added on rank 0 only."""

    def __init__(self, linear: nn.Module, shard: ShardInfo) -> None:
        super().__init__()
        self.linear = linear
        self.shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.linear(x), self.shard.group)


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + Vₗ)`` of an embedding table; ids elsewhere embed to zeros on this rank and
    an all-reduce sums the rank that holds them.

    Attributes:
        num_embeddings: the full vocabulary V; weight: this rank's ``[Vₗ, H]``.
    """

    def __init__(self, weight: torch.Tensor, start: int, num_embeddings: int, shard: ShardInfo) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.num_embeddings, self.shard = start, num_embeddings, shard

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        embedded = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return all_reduce(embedded * inside[..., None].to(embedded.dtype), self.shard.group)


class VocabParallelHead(nn.Module):
    """The LM head over this rank's vocabulary rows, its logits all-gathered: ``[..., H]`` → ``[..., V]``.

    Every rank holds ``⌈V/N⌉`` rows (the last one's padded with zeros), so the gathered logits have
    ``N·⌈V/N⌉`` columns; the padding is cut off.
    """

    def __init__(self, linear: nn.Module, vocab_size: int, shard: ShardInfo) -> None:
        super().__init__()
        self.linear = linear
        self.vocab_size, self.shard = vocab_size, shard

    @property
    def weight(self) -> torch.Tensor | None:
        """This rank's ``[⌈V/N⌉, H]`` rows (what ``nn.Linear.weight`` would be)."""
        return getattr(self.linear, "weight", None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = all_gather_last(self.linear(hidden), self.shard.group, self.shard.world_size)
        return logits[..., : self.vocab_size]


def _rows(weight: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """A copy of rows ``[start, stop)`` of ``weight`` (own storage, so the full tensor can be freed)."""
    return weight[start:stop].detach().clone()


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` holding exactly ``weight [out, in]`` and ``bias [out]`` (no fresh initialisation)."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    return layer


def _column(layer: nn.Linear, start: int, stop: int) -> nn.Linear:
    """Output features ``[start, stop)`` of ``layer`` (column-parallel)."""
    bias = _rows(layer.bias, start, stop) if layer.bias is not None else None
    return _linear(_rows(layer.weight, start, stop), bias)


def _row(layer: nn.Linear, start: int, stop: int, shard: ShardInfo) -> RowParallelLinear:
    """Input features ``[start, stop)`` of ``layer``, its outputs summed over the ranks (row-parallel)."""
    weight = layer.weight[:, start:stop].detach().clone()
    bias = layer.bias.detach().clone() if layer.bias is not None and shard.rank == 0 else None
    return RowParallelLinear(_linear(weight, bias), shard)


def _vocab_rows(weight: torch.Tensor, shard: ShardInfo) -> tuple[torch.Tensor, int]:
    """This rank's ``⌈V/N⌉`` rows of a ``[V, H]`` table (zero rows past V) and the first row's index."""
    vocab = weight.shape[0]
    per_rank = -(-vocab // shard.world_size)
    start = shard.rank * per_rank
    rows = weight[start : start + per_rank].detach().clone()
    if rows.shape[0] < per_rank:
        rows = torch.cat([rows, rows.new_zeros(per_rank - rows.shape[0], rows.shape[1])])
    return rows, start


def shard_target(target: TargetModel, shard: ShardInfo) -> TargetModel:
    """Cut ``target`` (dense, unpacked, unfused: as :func:`dflash2.models.loader.load_target` returns it)
    into rank ``shard.rank``'s part, in place; see the module docstring for the layout.

    Every tensor the shard keeps is a copy, so the full weights are freed once nothing else holds them
    (the drafter on rank 0 keeps the full embedding and LM head it is bound to). Returns ``target``.

    Raises:
        ValueError: the model does not split over ``shard.world_size`` ranks (:func:`check_shardable`).
    """
    config, rank, world = target.config, shard.rank, shard.world_size
    check_shardable(config, world)
    d = target.head_dim
    for layer in target.decoder_layers():
        attn = layer.self_attn
        first, heads, kv_first, kv_heads = head_split(attn.num_heads, attn.num_kv_heads, world, rank)
        attn.q_proj = _column(attn.q_proj, first * d, (first + heads) * d)
        attn.k_proj = _column(attn.k_proj, kv_first * d, (kv_first + kv_heads) * d)
        attn.v_proj = _column(attn.v_proj, kv_first * d, (kv_first + kv_heads) * d)
        attn.register_module("o_proj", _row(attn.o_proj, first * d, (first + heads) * d, shard))
        attn.num_heads, attn.num_kv_heads = heads, kv_heads
        attn.qkv_sizes = [heads * d, kv_heads * d, kv_heads * d]
        mlp = layer.mlp
        assert isinstance(mlp, MLP), "shard the loaded target, before fused_copy"
        start, stop = split(mlp.gate_proj.out_features, world, rank)
        mlp.gate_proj = _column(mlp.gate_proj, start, stop)
        mlp.up_proj = _column(mlp.up_proj, start, stop)
        mlp.register_module("down_proj", _row(mlp.down_proj, start, stop, shard))
    vocab = target.embed_tokens.weight.shape[0]
    head_weight = target.lm_head.weight
    assert head_weight is not None, "shard the loaded target, before prepack"
    tied = head_weight is target.embed_tokens.weight
    embed_rows, start = _vocab_rows(target.embed_tokens.weight, shard)
    target.register_module("embed_tokens", VocabParallelEmbedding(embed_rows, start, vocab, shard))
    head_rows = embed_rows if tied else _vocab_rows(head_weight, shard)[0]
    target.register_module("lm_head", VocabParallelHead(_linear(head_rows, None), vocab, shard))
    target.shard = shard
    return target
