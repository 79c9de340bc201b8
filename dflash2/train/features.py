"""Target features for training, computed once and cached on disk (spec §2.1, §7)."""

from __future__ import annotations

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


def load_or_extract(path: Path, target: Target, dataset: TokenDataset, layer_ids: tuple[int, ...]) -> torch.Tensor:
    """Cached features at ``path`` if they match ``layer_ids`` and the dataset size, else extract and save."""
    key = ",".join(map(str, layer_ids))
    if path.is_file():
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            num_tokens = f.get_slice("features").get_shape()[0]
        if metadata.get("layer_ids") == key and num_tokens == int(dataset.offsets[-1]):
            return load_file(str(path))["features"]
        logger.warning("cached features at %s do not match; extracting again", path)
    features = extract_features(target, dataset, layer_ids)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"features": features}, str(path), metadata={"layer_ids": key})
    return features
