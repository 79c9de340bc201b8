"""Load a target (own decoder or transformers fallback), its tokenizer and a drafter.

Raises ``ModelLoadError`` with a message that says what to do for every unsupported input:
not a causal LM, missing files, or a drafter whose vocabulary does not match the target.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash2.models.base import Target
from dflash2.models.drafter import DFlashDrafter
from dflash2.models.drafter_config import DrafterConfig
from dflash2.models.hf_fallback import HFCausalLMTarget
from dflash2.models.llama import SUPPORTED_MODEL_TYPES, TargetModel

logger = logging.getLogger(__name__)


class ModelLoadError(ValueError):
    """A model or drafter cannot be used; the message says what to do instead."""


def load_hf_config(folder: Path) -> Any:
    """The transformers config of a local model folder."""
    from transformers import AutoConfig

    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{folder} has no config.json: pass a Hugging Face model folder, a .gguf file or a hub id")
    return AutoConfig.from_pretrained(str(folder))


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no .safetensors weights: convert the checkpoint to safetensors first")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
                state[key] = f.get_tensor(key)
    return state


def load_target(folder: Path, dtype: torch.dtype, device: torch.device) -> Target:
    """Build the target for ``folder``: ``TargetModel`` for the Llama family, else the fallback.

    Raises:
        ModelLoadError: when the folder is not a causal LM or its weights do not match.
    """
    config = load_hf_config(folder)
    if config.model_type in SUPPORTED_MODEL_TYPES:
        with torch.device("meta"):
            model = TargetModel(config)
        state = {k.removeprefix("model."): v for k, v in _read_safetensors(folder).items()}
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
            state["lm_head.weight"] = state["embed_tokens.weight"]
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        missing = sorted(set(expected) - set(state))
        wrong = sorted(k for k in expected.keys() & state.keys() if tuple(state[k].shape) != expected[k])
        if missing or wrong:
            raise ModelLoadError(
                f"{folder}: weights do not match config.json (missing {missing[:5]}, wrong shape {wrong[:5]})"
            )
        unexpected = sorted(set(state) - set(expected))
        if unexpected:
            logger.warning("ignoring %d unexpected target tensors, e.g. %s", len(unexpected), unexpected[:3])
        model.load_state_dict({k: state[k].to(dtype) for k in expected}, assign=True)
        if getattr(config, "tie_word_embeddings", False):
            model.lm_head.weight = model.embed_tokens.weight
        return model.to(device).eval()
    return _load_fallback(folder, config, dtype, device)


def _load_fallback(folder: Path, config: Any, dtype: torch.dtype, device: torch.device) -> HFCausalLMTarget:
    """A model the project does not decode itself, through transformers: a causal LM, or the language model
    of a multimodal checkpoint (``*ForConditionalGeneration``, served text only).

    Raises:
        ModelLoadError: for a model type transformers can load as neither, naming it and what is supported.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    multimodal = getattr(config, "text_config", None) is not None
    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        loader: Any = AutoModelForCausalLM
    elif multimodal and config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        loader = AutoModelForImageTextToText
    else:
        raise ModelLoadError(
            f"{folder}: model_type {config.model_type!r} is not a causal language model; dflash2 serves "
            f"decoder-only text generation: {', '.join(SUPPORTED_MODEL_TYPES)} on its own decoders, any other "
            "model type transformers loads as a causal LM, and the language model of a multimodal "
            "(image-text-to-text) checkpoint, text only"
        )
    logger.warning(
        "model_type %r has no batched decoder here; using the transformers fallback (batch 1, slower)",
        config.model_type,
    )
    if multimodal:
        logger.warning(
            "%s is a multimodal checkpoint (%s): serving its language model, text only",
            folder,
            config.model_type,
        )
    try:
        model = loader.from_pretrained(str(folder), dtype=dtype)
    except (OSError, ValueError, AttributeError, KeyError, RuntimeError, TypeError) as error:
        raise ModelLoadError(
            f"{folder}: transformers could not load model_type {config.model_type!r}: {type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}"
        ) from error
    model = model.to(device)
    return HFCausalLMTarget(model.eval())


def load_tokenizer(folder: Path) -> Any:
    """The Hugging Face tokenizer saved with the model."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def eos_token_ids(folder: Path, tokenizer: Any) -> list[int]:
    """EOS ids from ``generation_config.json`` (falling back to the tokenizer's EOS)."""
    ids: list[int] = []
    path = folder / "generation_config.json"
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids = list(eos) if isinstance(eos, list) else ([eos] if eos is not None else [])
    if not ids and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    return [int(i) for i in ids]


def load_drafter(
    folder: Path, target: Target, dtype: torch.dtype, device: torch.device, draft_vocab_size: int | None = None
) -> DFlashDrafter:
    """Load a drafter and bind it to the target's embedding and LM head.

    Args:
        draft_vocab_size: keep only this many of the draft vocabulary's most frequent tokens
            (:meth:`DFlashDrafter.limit_draft_vocab`); None = the drafter's own.

    Raises:
        ModelLoadError: missing files, a vocabulary or hidden-size mismatch with the target,
            target_layer_ids outside the target's layers, or a ``draft_vocab_size`` below the
            drafter's top-k.
    """
    try:
        drafter = read_drafter(folder, dtype=dtype, device=device)
        if draft_vocab_size is not None:
            own = drafter.draft_vocab_size
            drafter.limit_draft_vocab(draft_vocab_size)
            kept = drafter.draft_vocab_size
            logger.info(
                "drafting over the %d most frequent of the drafter's %d draft-vocabulary tokens%s",
                kept,
                own,
                "" if kept < own else f" (--speculative-draft-vocab-size {draft_vocab_size} keeps them all)",
            )
    except (FileNotFoundError, ValueError) as exc:
        raise ModelLoadError(f"cannot load drafter from {folder}: {exc}") from exc
    check_drafter_matches(drafter, target)
    drafter.bind_target(*target.embedding_weights())
    return drafter.eval()


def check_drafter_matches(drafter: DFlashDrafter, target: Target) -> None:
    """Raise ``ModelLoadError`` unless the drafter was built for this target's shapes."""
    c = drafter.config
    vocab, hidden = target.embedding_weights()[0].shape
    if c.vocab_size != vocab:
        raise ModelLoadError(
            f"drafter vocab_size {c.vocab_size} != target vocab size {vocab}: use a drafter trained for this target "
            "(dflash2 train) or the target the drafter was trained for"
        )
    if c.hidden_size != hidden:
        raise ModelLoadError(f"drafter hidden_size {c.hidden_size} != target hidden size {hidden}")
    if max(c.target_layer_ids) >= target.num_layers:
        raise ModelLoadError(
            f"drafter target_layer_ids {list(c.target_layer_ids)} exceed the target's {target.num_layers} layers"
        )


# ---- drafter checkpoints (the published layout, docs/dflash2-spec.md §1) ------------------------------------

# Optional frequency-ranked draft vocabulary, kept beside (not inside) the published layout.
DRAFT_VOCAB_FILE = "draft_vocab.json"

# Tensors some checkpoints carry that are recomputed at load time, never learned.
_DERIVED_TENSORS = ("rotary_emb.inv_freq",)

# Names used by other publishers for the same tensors (spec §1.3).
_KEY_ALIASES = (
    ("encoder.fc.", "fc."),
    ("encoder.output_norm_enc.", "hidden_norm."),
    ("midlayer.", "layers.0."),
)


def save_drafter(drafter: DFlashDrafter, folder: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write ``config.json`` + ``model.safetensors`` in the published layout (spec §1), plus
    ``draft_vocab.json`` when the drafter has a draft vocabulary (``token_ids``, sorted, and their
    training ``counts`` when known; other loaders ignore the file and draft over the full vocabulary).

    Raises:
        RuntimeError: for a pre-packed or quantized drafter, which has no dense linear weights.
    """
    if drafter.is_prepacked:
        raise RuntimeError("a pre-packed drafter has no dense linear weights to save: save it before prepack()")
    from dflash2.models.quant import QuantizedLinear

    if any(isinstance(module, QuantizedLinear) for module in drafter.modules()):
        raise RuntimeError("a quantized drafter has no dense linear weights to save: save it before quantizing")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    drafter.config.save(folder)
    tensors = {k: (v.to(dtype) if dtype else v).detach().cpu().contiguous() for k, v in drafter.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    vocab_file = folder / DRAFT_VOCAB_FILE
    if drafter.draft_vocab is not None:
        entry: dict[str, list[int]] = {"token_ids": drafter.draft_vocab.tolist()}
        if drafter.draft_vocab_counts is not None:
            entry["counts"] = drafter.draft_vocab_counts.tolist()
        vocab_file.write_text(json.dumps(entry) + "\n")
    elif vocab_file.exists():
        vocab_file.unlink()


def read_drafter(folder: str | Path, dtype: torch.dtype, device: torch.device | str) -> DFlashDrafter:
    """A drafter folder as an unbound ``DFlashDrafter``; every tensor name and shape must match
    the config (:func:`load_drafter` also binds it to a target and checks that they match).

    Raises:
        FileNotFoundError: when config.json or the weights are missing.
        ValueError: on missing, unexpected or mis-shaped tensors (all are listed).
    """
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no config.json: pass a drafter folder (config.json + model.safetensors)")
    config = DrafterConfig.from_dict(json.loads((folder / "config.json").read_text()))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no .safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    drafter = DFlashDrafter(config)
    load_drafter_weights(drafter, state)
    if (folder / DRAFT_VOCAB_FILE).is_file():
        entry = json.loads((folder / DRAFT_VOCAB_FILE).read_text())
        counts = entry.get("counts")
        drafter.set_draft_vocab(torch.tensor(entry["token_ids"]), None if counts is None else torch.tensor(counts))
    return drafter.to(device=device, dtype=dtype)  # RoPE frequencies stay float32 (not a buffer)


def load_drafter_weights(drafter: DFlashDrafter, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into ``drafter`` after alias remapping and a strict name/shape check
    (tensors that are computed, not learned — ``rotary_emb.inv_freq`` — are skipped).

    Raises:
        ValueError: on missing, unexpected or mis-shaped tensors (all are listed).
    """
    remapped = {}
    for key, value in state.items():
        if key.endswith(_DERIVED_TENSORS):
            logger.debug("skipping derived tensor %s", key)
            continue
        key = key.removeprefix("model.")
        for old, new in _KEY_ALIASES:
            if key.startswith(old):
                key = new + key[len(old) :]
        remapped[key] = value
    expected = {k: v.shape for k, v in drafter.state_dict().items()}
    missing = sorted(set(expected) - set(remapped))
    unexpected = sorted(set(remapped) - set(expected))
    wrong = sorted(k for k in expected.keys() & remapped.keys() if tuple(remapped[k].shape) != tuple(expected[k]))
    if missing or unexpected or wrong:
        raise ValueError(
            "drafter checkpoint does not match its config.json: "
            f"missing {missing[:8]}, unexpected {unexpected[:8]}, wrong shape {wrong[:8]}"
        )
    drafter.load_state_dict(remapped, strict=True)
