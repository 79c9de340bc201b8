"""Target features for training, computed once and cached on disk (docs/dflash2-spec.md §2.1, §7)."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from dflash2.models.base import Target
from dflash2.models.batch import ForwardBatch
from dflash2.train.data import TokenDataset

logger = logging.getLogger(__name__)


@dataclass
class SoftLabels:
    """The target's top-k next-token distribution at every dataset token (for distillation).

    Row ``t`` is the target's prediction after reading token ``t``, i.e. its distribution of
    token ``t + 1``: a drafted slot whose label is ``x_{a+k}`` uses row ``a + k − 1``.

    Attributes:
        logprobs: ``[N, k]`` float16 log-probabilities (log-softmax over the full vocabulary,
            so they sum to at most 1 in probability), highest first.
        ids: ``[N, k]`` int32 token ids of those entries.
    """

    logprobs: torch.Tensor
    ids: torch.Tensor

    def __getitem__(self, rows: slice) -> SoftLabels:
        return SoftLabels(self.logprobs[rows], self.ids[rows])

    def top(self, k: int) -> SoftLabels:
        """The ``k`` most likely entries per token (``k`` ≤ :attr:`top_k`)."""
        return self if k == self.top_k else SoftLabels(self.logprobs[:, :k].contiguous(), self.ids[:, :k].contiguous())

    @property
    def top_k(self) -> int:
        """Entries kept per token."""
        return int(self.ids.shape[1])


@torch.inference_mode()
def extract_features(
    target: Target,
    dataset: TokenDataset,
    layer_ids: tuple[int, ...],
    batch_tokens: int = 4096,
    soft_label_k: int = 0,
) -> tuple[torch.Tensor, SoftLabels | None]:
    """Features ``[total tokens, F·H]`` float16 of every dataset token at ``layer_ids``.

    Sequences run in length-sorted batches of about ``batch_tokens`` tokens. With
    ``soft_label_k > 0`` the same forward also yields the target's top-k next-token
    log-probabilities at every token (:class:`SoftLabels`, for ``--distill-weight``); this adds
    the LM head over every token, about a quarter more time for a small target.

    Returns:
        ``(features, soft labels or None)``.
    """
    order = sorted(range(len(dataset)), key=lambda i: int(dataset.offsets[i + 1] - dataset.offsets[i]))
    hidden = target.embedding_weights()[0].shape[1]
    total = int(dataset.offsets[-1])
    out = torch.empty(total, len(layer_ids) * hidden, dtype=torch.float16)
    soft = None
    if soft_label_k > 0:
        soft = SoftLabels(
            torch.empty(total, soft_label_k, dtype=torch.float16), torch.empty(total, soft_label_k, dtype=torch.int32)
        )
    max_len = max(int(dataset.offsets[i + 1] - dataset.offsets[i]) for i in range(len(dataset)))
    device = target.embedding_weights()[0].device
    batches: list[list[int]] = [[]]
    for i in order:
        length = int(dataset.offsets[i + 1] - dataset.offsets[i])
        if batches[-1] and (len(batches[-1]) + 1) * length > batch_tokens:
            batches.append([])
        batches[-1].append(i)
    cache = target.new_cache(max(len(b) for b in batches), max_len)
    for batch_ids in tqdm(batches, desc="target features", unit="batch", dynamic_ncols=True):
        rows = [dataset.sequence(i)[0].tolist() for i in batch_ids]
        batch = ForwardBatch.build(list(range(len(rows))), rows, [0] * len(rows), device)
        logits, features = target.run(batch, cache, layer_ids, last_only=soft is None)
        assert features is not None
        top = torch.log_softmax(logits, dim=-1).topk(soft_label_k, dim=-1) if soft is not None else None
        for r, i in enumerate(batch_ids):
            a, b = int(dataset.offsets[i]), int(dataset.offsets[i + 1])
            out[a:b] = features[r, : b - a].to("cpu", torch.float16)
            if soft is not None and top is not None:
                soft.logprobs[a:b] = top.values[r, : b - a].to("cpu", torch.float16)
                soft.ids[a:b] = top.indices[r, : b - a].to("cpu", torch.int32)
    return out, soft


def tokens_digest(dataset: TokenDataset, num_tokens: int) -> str:
    """SHA-256 of the first ``num_tokens`` token ids, the key that ties a feature cache to its data."""
    return hashlib.sha256(dataset.tokens[:num_tokens].to(torch.int32).numpy().tobytes()).hexdigest()


def load_or_extract(
    path: Path, target: Target, dataset: TokenDataset, layer_ids: tuple[int, ...], soft_label_k: int = 0
) -> tuple[torch.Tensor, SoftLabels | None]:
    """Features of ``dataset`` at ``layer_ids`` (and soft labels), cached in ``path`` (safetensors).

    A cache for the same layers, token ids and at least ``soft_label_k`` soft labels is loaded
    as is (soft labels cut to ``soft_label_k``). A cache for a prefix of the conversations (a
    data set grown by ``dflash2 data`` with more prompts) is extended: only the new
    conversations run through the target. Anything else is extracted again.

    Returns:
        ``(features [N, F·H] float16, soft labels or None when soft_label_k is 0)``.
    """
    key = ",".join(map(str, layer_ids))
    total = int(dataset.offsets[-1])
    if path.is_file():
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            num_tokens = f.get_slice("features").get_shape()[0]
        cached_k = int(metadata.get("soft_label_k", 0))
        boundaries = dataset.offsets.tolist()
        same_prefix = (
            metadata.get("layer_ids") == key
            and num_tokens in boundaries
            and metadata.get("tokens_sha256") == tokens_digest(dataset, num_tokens)
            and cached_k >= soft_label_k
        )
        if same_prefix:
            cached = load_file(str(path))
            features, soft = cached["features"], _soft(cached, cached_k)
            if num_tokens < total:
                # Grown data set: extend, keeping every soft label the cache holds.
                first_new = boundaries.index(num_tokens)
                logger.info(
                    "extending cached features at %s from %d to %d conversations", path, first_new, len(dataset)
                )
                new, new_soft = extract_features(
                    target, dataset.subset(list(range(first_new, len(dataset)))), layer_ids, soft_label_k=cached_k
                )
                features = torch.cat([features, new])
                if soft is not None and new_soft is not None:
                    soft = SoftLabels(
                        torch.cat([soft.logprobs, new_soft.logprobs]), torch.cat([soft.ids, new_soft.ids])
                    )
                _save(path, features, soft, key, dataset)
            return features, (soft.top(soft_label_k) if soft is not None and soft_label_k else None)
        logger.warning("cached features at %s do not match the data set or settings; extracting again", path)
    features, soft = extract_features(target, dataset, layer_ids, soft_label_k=soft_label_k)
    _save(path, features, soft, key, dataset)
    return features, soft


def _soft(tensors: dict[str, torch.Tensor], k: int) -> SoftLabels | None:
    return SoftLabels(tensors["soft_logprobs"], tensors["soft_ids"]) if k else None


def _save(path: Path, features: torch.Tensor, soft: SoftLabels | None, key: str, dataset: TokenDataset) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"layer_ids": key, "tokens_sha256": tokens_digest(dataset, len(features))}
    tensors = {"features": features}
    if soft is not None:
        tensors |= {"soft_logprobs": soft.logprobs, "soft_ids": soft.ids}
        metadata["soft_label_k"] = str(soft.top_k)
    save_file(tensors, str(path), metadata=metadata)
