"""Setting up the models an ``EngineConfig`` names: resolve the target's source, the dtype and the
drafter, then load, quantize and (for tensor parallelism's rank 0) shard them on the resolved device.

Reading a checkpoint folder is :mod:`dflash2.models.loader`'s; this module decides what to read and how
to hold it for one engine (the engine, the compile worker, the worker ranks, the offline commands and the
benchmarks share it)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash2.config import DTYPES, EngineConfig
from dflash2.models import cpu_kernels
from dflash2.models.base import Target
from dflash2.models.drafter import DFlashDrafter
from dflash2.models.llama import TargetModel
from dflash2.models.quantize import NOT_QUANTIZED, QuantizationReport, quantize_target
from dflash2.models.tensor_parallel import ShardInfo, shard_target
from dflash2.platform import cpu_has_native_bf16
from dflash2.runner.tensor_parallel import threads_per_rank

logger = logging.getLogger(__name__)


@dataclass
class LoadedModels:
    """The models an engine is built from.

    Attributes:
        tokenizer: Hugging Face tokenizer; target: the loaded target; drafter: bound to the target, or
        None (autoregressive decoding); eos_token_ids: ids that end a request; model_name: the name
        reported to clients; quantization: how the target's linear weights are held.
    """

    tokenizer: Any
    target: Target
    drafter: DFlashDrafter | None
    eos_token_ids: tuple[int, ...]
    model_name: str
    quantization: QuantizationReport = NOT_QUANTIZED


def resolve_dtype(config: EngineConfig) -> torch.dtype:
    """The dtype ``config.dtype`` names. ``auto``: bfloat16 on CUDA, on CPUs with native bfloat16 matrix
    instructions (AVX512-BF16 or AMX) and on other CPUs with AVX2 where the project's bfloat16 kernel
    builds (:mod:`dflash2.models.cpu_kernels`, built the first time it is asked); float32 elsewhere."""
    if config.dtype != "auto":
        return DTYPES[config.dtype]
    device = config.torch_device
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu" and (cpu_has_native_bf16() or cpu_kernels.available()):
        return torch.bfloat16
    return torch.float32


def load_models(config: EngineConfig, shard: ShardInfo | None = None) -> LoadedModels:
    """Resolve and load target, tokenizer and drafter as ``config`` says (and set torch's CPU threads).

    With ``shard`` (rank 0 of a tensor-parallel group, :mod:`dflash2.runner.tensor_parallel`) the target is loaded on
    the CPU, the drafter bound to its whole embedding and LM head (on the device), and the target cut
    to rank 0's share (:func:`dflash2.models.tensor_parallel.shard_target`) before it moves to the device.

    Raises:
        ValueError: with ``shard``, a target that does not split over the ranks.
        dflash2.models.source.ModelSourceError / dflash2.models.loader.ModelLoadError: with a message
            that says what to do.
    """
    from dflash2.models import loader, source
    from dflash2.platform import configure_threads

    configure_threads(config.num_threads if shard is None else threads_per_rank(config))
    folder = source.resolve_model(config.model)
    device, dtype = config.torch_device, resolve_dtype(config)
    tokenizer = loader.load_tokenizer(folder)
    target = loader.load_target(folder, dtype, device if shard is None else torch.device("cpu"))
    gguf = source.source_gguf(config.model, folder)
    quantization = quantize_loaded_target(config, target, gguf, dtype, tensor_parallel=shard is not None)
    drafter = None
    drafter_path = resolve_drafter_path(config)
    if config.block_size != 1:
        if drafter_path is not None:
            drafter = loader.load_drafter(
                Path(drafter_path), target, dtype, device, config.speculative_draft_vocab_size
            )
        elif config.model is None:
            drafter = untrained_default_drafter(target, dtype, device)
            if config.speculative_draft_vocab_size is not None:
                drafter.limit_draft_vocab(config.speculative_draft_vocab_size)
    if drafter is not None and config.speculative_draft_quantization != "none":
        from dflash2.models.quantize import quantize_drafter

        report = quantize_drafter(drafter, config.speculative_draft_quantization)
        logger.info("drafter %s", report.describe())
    if shard is not None:
        if drafter is not None and device.type != "cpu":  # the drafter keeps the whole embedding and head
            embed, head = target.embedding_weights()
            embed_on_device = embed.to(device)
            drafter.bind_target(embed_on_device, embed_on_device if head is embed else head.to(device))
        assert isinstance(target, TargetModel)  # Engine.from_config checked the family before starting workers
        target = shard_target(target, shard).to(device)
    name = source.EMBEDDED_MODEL_NAME if config.model is None else config.model
    return LoadedModels(tokenizer, target, drafter, tuple(loader.eos_token_ids(folder, tokenizer)), name, quantization)


def quantize_loaded_target(
    config: EngineConfig, target: Target, gguf: Path | None, dtype: torch.dtype, tensor_parallel: bool
) -> QuantizationReport:
    """Apply ``config.quantization`` to a loaded target in place (:mod:`dflash2.models.quantize`), log
    what it did and record it on the target (``target.quantization``).

    Raises:
        dflash2.models.quantize.QuantizationError: a method that cannot run here, with what to do.
    """
    from dflash2.models.quantize import resolve_method

    if not isinstance(target, TargetModel) and config.quantization in ("auto", "none"):
        return NOT_QUANTIZED  # the transformers fallback: dense; an explicit method raises below
    method = resolve_method(
        config.quantization, gguf, config.torch_device, tensor_parallel, config.model is None, dtype
    )
    report = quantize_target(target, method, gguf, strict=config.quantization == "gguf")
    if isinstance(target, TargetModel):
        target.quantization = report
    logger.info("target %s", report.describe())
    return report


def default_drafter_path() -> Path | None:
    """The drafter shipped for the embedded default model, if this installation has one."""
    path = Path(__file__).resolve().parents[1] / "assets" / "smollm2-135m-dflash2"
    return path if (path / "config.json").is_file() else None


def resolve_drafter_path(config: EngineConfig) -> str | Path | None:
    """The drafter folder a config asks for: ``config.drafter``, else the shipped one for the
    embedded default model, else None."""
    return config.drafter or (default_drafter_path() if config.model is None else None)


def untrained_default_drafter(target: Target, dtype: torch.dtype, device: torch.device) -> DFlashDrafter:
    """A randomly initialised DFlash 2 drafter shaped for the target (used until one is trained)."""
    from dflash2.models.drafter_factory import drafter_config_for_target

    logger.warning("no trained drafter found for the embedded model; using an untrained drafter (low acceptance)")
    drafter = DFlashDrafter(drafter_config_for_target(target.config))
    drafter.init_weights(seed=0)
    drafter.bind_target(*target.embedding_weights())
    return drafter.to(device=device, dtype=dtype).eval()
