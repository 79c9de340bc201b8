"""Target features for training, computed once and cached on disk (spec §2.1, §7)."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from dflash2.models.base import Target
from dflash2.models.batch import ForwardBatch
from dflash2.train.data import TokenDataset

logger = logging.getLogger(__name__)


@torch.inference_mode()
def extract_features(
    target: Target, dataset: TokenDataset, layer_ids: tuple[int, ...], batch_tokens: int = 4096
) -> torch.Tensor:
    """Features ``[total tokens, F·H]`` float16 of every dataset token at ``layer_ids``.

    Sequences run in length-sorted batches of about ``batch_tokens`` tokens.
    """
    order = sorted(range(len(dataset)), key=lambda i: int(dataset.offsets[i + 1] - dataset.offsets[i]))
    hidden = target.embedding_weights()[0].shape[1]
    out = torch.empty(int(dataset.offsets[-1]), len(layer_ids) * hidden, dtype=torch.float16)
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
        _, features = target.run(batch, cache, layer_ids, last_only=True)
        assert features is not None
        for r, i in enumerate(batch_ids):
            a, b = int(dataset.offsets[i]), int(dataset.offsets[i + 1])
            out[a:b] = features[r, : b - a].to("cpu", torch.float16)
    return out


def tokens_digest(dataset: TokenDataset, num_tokens: int) -> str:
    """SHA-256 of the first ``num_tokens`` token ids, the key that ties a feature cache to its data."""
    return hashlib.sha256(dataset.tokens[:num_tokens].to(torch.int32).numpy().tobytes()).hexdigest()


def load_or_extract(path: Path, target: Target, dataset: TokenDataset, layer_ids: tuple[int, ...]) -> torch.Tensor:
    """Features of ``dataset`` at ``layer_ids``, cached in ``path`` (safetensors).

    A cache for the same layers and token ids is loaded as is. A cache for a prefix of the
    conversations (a data set grown by ``dflash2 data`` with more prompts) is extended: only the
    new conversations run through the target. Anything else is extracted again.
    """
    key = ",".join(map(str, layer_ids))
    total = int(dataset.offsets[-1])
    if path.is_file():
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            num_tokens = f.get_slice("features").get_shape()[0]
        boundaries = dataset.offsets.tolist()
        same_prefix = (
            metadata.get("layer_ids") == key
            and num_tokens in boundaries
            and metadata.get("tokens_sha256") == tokens_digest(dataset, num_tokens)
        )
        if same_prefix and num_tokens == total:
            return load_file(str(path))["features"]
        if same_prefix:
            first_new = boundaries.index(num_tokens)
            logger.info("extending cached features at %s from %d to %d conversations", path, first_new, len(dataset))
            new = extract_features(target, dataset.subset(list(range(first_new, len(dataset)))), layer_ids)
            features = torch.cat([load_file(str(path))["features"], new])
            _save(path, features, key, dataset)
            return features
        logger.warning("cached features at %s do not match the data set; extracting again", path)
    features = extract_features(target, dataset, layer_ids)
    _save(path, features, key, dataset)
    return features


def _save(path: Path, features: torch.Tensor, key: str, dataset: TokenDataset) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"layer_ids": key, "tokens_sha256": tokens_digest(dataset, len(features))}
    save_file({"features": features}, str(path), metadata=metadata)
