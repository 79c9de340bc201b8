"""Drafter shapes for a given target: used for fresh training runs and untrained defaults."""

from __future__ import annotations

from typing import Any

from dflash2.models.drafter_config import DrafterConfig, default_target_layer_ids


def pick_mask_token_id(tokenizer: Any | None, vocab_size: int) -> int:
    """A target embedding row to use as the MASK token (docs/dflash2-spec.md §1.1).

    Order: a ``<|MASK|>`` token; a spare embedding row past the tokenizer; the last added
    special token that is not BOS/EOS/PAD or part of a chat turn (for SmolLM2 ``<empty_output>``).
    """
    if tokenizer is None:
        return vocab_size - 1
    vocab = tokenizer.get_vocab()
    if "<|MASK|>" in vocab and vocab["<|MASK|>"] < vocab_size:
        return int(vocab["<|MASK|>"])
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    reserved = {
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        tokenizer.unk_token_id,
    }
    reserved |= set(tokenizer.convert_tokens_to_ids(tokenizer.all_special_tokens))
    candidates = [
        i for i, tok in tokenizer.added_tokens_decoder.items() if i not in reserved and i < vocab_size and tok.special
    ]
    return int(max(candidates)) if candidates else vocab_size - 1


def drafter_config_for_target(
    target_config: Any,
    *,
    num_layers: int = 3,
    block_size: int = 8,
    conv: bool = True,
    selector: bool = True,
    selector_rank: int = 64,
    selector_top_k: int = 16,
    conv_group_size: int = 16,
    mask_token_id: int | None = None,
) -> DrafterConfig:
    """A drafter config whose layers are shaped like the target's (hidden size must match).

    A multimodal checkpoint's config is shaped from its language model's (``text_config``); where the
    target's layers differ (``per_layer_config``: Gemma 4's wider full-attention heads) the drafter takes
    the shape most of them have, and the RoPE settings of its sliding-window layers when RoPE is set per
    layer type (the drafter attends over a short block and its context like those layers do).
    """
    target_config = getattr(target_config, "text_config", None) or target_config
    hidden = int(target_config.hidden_size)
    heads = int(_most_layers(target_config, "num_attention_heads", None))
    num_target_layers = int(target_config.num_hidden_layers)
    rope = getattr(target_config, "rope_parameters", None) or {}
    if rope and all(isinstance(value, dict) for value in rope.values()):  # per layer type
        rope = rope.get("sliding_attention") or next(iter(rope.values()))
    return DrafterConfig(
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(_most_layers(target_config, "num_key_value_heads", heads)),
        head_dim=int(_most_layers(target_config, "head_dim", hidden // heads)),
        intermediate_size=int(target_config.intermediate_size),
        vocab_size=int(target_config.vocab_size),
        block_size=block_size,
        mask_token_id=mask_token_id if mask_token_id is not None else int(target_config.vocab_size) - 1,
        target_layer_ids=tuple(default_target_layer_ids(num_target_layers, num_layers)),
        num_target_layers=num_target_layers,
        rms_norm_eps=float(getattr(target_config, "rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0))),
        max_position_embeddings=int(getattr(target_config, "max_position_embeddings", 8192)),
        conv_group_size=conv_group_size if conv else 0,
        conv_kernel_size=2 if conv else 0,
        selector_rank=selector_rank if selector else 0,
        selector_top_k=selector_top_k if selector else 0,
    )


def _most_layers(config: Any, name: str, default: Any) -> Any:
    """``config.<name>``, or where it is set per layer (``per_layer_config``) the value most layers have
    (the first of those on a tie); ``default`` where it is unset."""
    layers = getattr(config, "per_layer_config", None)
    if layers is None:
        return getattr(config, name, None) or default
    values = [getattr(layer, name, None) or default for layer in layers]
    return max(values, key=values.count)
