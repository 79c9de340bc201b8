"""``DrafterConfig``: the shape and DFlash settings of a drafter, parsed from its config.json.

Reads both published layouts (docs/dflash2-spec.md §1.1 DFlash v1, §1.2 DFlash 2) the way the reference loaders
read them, and writes the DFlash 2 layout (or v1 when the drafter has no convolution and no
selector).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Scaled RoPE types a drafter may carry (transformers' initialisers; ``dynamic`` depends on length).
SCALED_ROPE_TYPES = ("linear", "llama3", "yarn", "longrope")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Default ``target_layer_ids`` (spec §1.1): ``[L//2]`` for one layer, else ``round(1 + i·(L−4)/(n−1))``."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = (num_target_layers - 4) / (num_draft_layers - 1)
    return [round(1 + i * span) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DrafterConfig:
    """Shape and DFlash settings of a drafter (spec §1).

    ``conv_kernel_size == 0`` means no dynamic convolution and ``selector_top_k == 0`` means
    no candidate selector; with both zero the drafter is DFlash v1.

    Raises:
        ValueError: on inconsistent settings (the message names the key).
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    is_causal: bool | None = None
    conv_group_size: int = 0
    conv_kernel_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_hidden_layers)
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError("layer_types must have one entry per draft layer")
        if (self.conv_group_size > 0) != (self.conv_kernel_size > 0):
            raise ValueError("conv_group_size and conv_kernel_size must both be set or both be zero")
        if (self.selector_rank > 0) != (self.selector_top_k > 0):
            raise ValueError("selector_rank and selector_top_k must both be set or both be zero")
        if self.conv_group_size and self.hidden_size % self.conv_group_size:
            raise ValueError("conv_group_size must divide hidden_size")
        if self.output_multiplier <= 0:
            raise ValueError("output_multiplier must be positive")
        if self.block_size < 2:
            raise ValueError("block_size must be at least 2")
        if any(not 0 <= i < self.num_target_layers for i in self.target_layer_ids):
            raise ValueError("target_layer_ids must index layers of the target")
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type not in SCALED_ROPE_TYPES and rope_type != "default":
            raise ValueError(
                f"rope_type {rope_type!r} is not supported for drafters: use default, {', '.join(SCALED_ROPE_TYPES)}"
            )

    @property
    def rope_parameters(self) -> dict[str, Any]:
        """``{"rope_theta", "rope_type", …scaling parameters}`` as in a published ``config.json``."""
        params = {k: list(v) if isinstance(v, tuple) else v for k, v in self.rope_scaling}
        return {"rope_theta": self.rope_theta, "rope_type": "default", **params}

    @property
    def version(self) -> int:
        """2 when the drafter has a convolution or a selector, else 1."""
        return 2 if self.has_conv or self.has_selector else 1

    @property
    def has_conv(self) -> bool:
        """True when every layer carries DFlash 2 dynamic convolutions."""
        return self.conv_kernel_size > 0

    @property
    def has_selector(self) -> bool:
        """True when the checkpoint has a candidate selector."""
        return self.selector_top_k > 0

    @property
    def num_features(self) -> int:
        """F, the number of target layers fused into the context."""
        return len(self.target_layer_ids)

    @property
    def num_conv_groups(self) -> int:
        """G = hidden_size / conv_group_size (0 without convolution)."""
        return self.hidden_size // self.conv_group_size if self.conv_group_size else 0

    def layer_is_causal(self, layer: int) -> bool:
        """Causality of a draft layer's block attention (spec §2.4)."""
        if self.is_causal is not None:
            return self.is_causal
        if "causal" in self.extra:
            return bool(self.extra["causal"])
        return self.layer_types[layer] == "sliding_attention"

    def layer_window(self, layer: int) -> int | None:
        """Sliding window of a draft layer over the context, or None for full attention."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DrafterConfig:
        """Parse a published config.json (v1 or v2 layout; ``dflash_config`` first, then top level)."""
        dflash = dict(raw.get("dflash_config") or {})

        def pick(key: str, default: Any = None) -> Any:
            return dflash.get(key, raw.get(key, default))

        # RoPE: the nested ``rope_parameters`` (DFlash 2) over legacy ``rope_scaling`` and ``rope_theta``.
        rope = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
        rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = str(rope.pop("rope_type", rope.pop("type", "default")))
        rope.pop("type", None)
        rope_scaling = (
            ()
            if rope_type == "default"
            else (
                ("rope_type", rope_type),
                *sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in rope.items()),
            )
        )
        num_layers = int(raw["num_hidden_layers"])
        num_target_layers = int(pick("num_target_layers", raw.get("num_target_layers", 0)) or 0)
        layer_ids = pick("target_layer_ids")
        if layer_ids is None:
            if not num_target_layers:
                raise ValueError("drafter config needs target_layer_ids or num_target_layers")
            layer_ids = default_target_layer_ids(num_target_layers, num_layers)
        if not num_target_layers:
            num_target_layers = max(layer_ids) + 1
        if pick("mask_token_id") is None:
            raise ValueError("drafter config has no mask_token_id")
        heads = int(raw["num_attention_heads"])
        softcap = pick("final_logit_softcapping")
        # Sliding windows follow the Hugging Face Qwen3 rule every reference loader applies: none
        # unless ``use_sliding_window`` is true; without ``layer_types``, the layers from
        # ``max_window_layers`` on slide.
        window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
        layer_types = tuple(raw.get("layer_types") or ())
        if not layer_types and window is not None:
            first = int(raw.get("max_window_layers", num_layers))
            layer_types = tuple("sliding_attention" if i >= first else "full_attention" for i in range(num_layers))
        return cls(
            hidden_size=int(raw["hidden_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads", heads)),
            head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
            intermediate_size=int(raw["intermediate_size"]),
            vocab_size=int(raw["vocab_size"]),
            block_size=int(pick("block_size", 16)),
            mask_token_id=int(pick("mask_token_id")),
            target_layer_ids=tuple(layer_ids),
            num_target_layers=num_target_layers,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            layer_types=layer_types,
            sliding_window=int(window) if window is not None else None,
            is_causal=raw.get("is_causal"),
            conv_group_size=int(pick("conv_group_size", 0) or 0),
            conv_kernel_size=int(pick("conv_kernel_size", 0) or 0),
            selector_rank=int(pick("selector_rank", 0) or 0),
            selector_top_k=int(pick("selector_top_k", 0) or 0),
            output_multiplier=float(1.0 if pick("output_multiplier") is None else pick("output_multiplier")),
            final_logit_softcapping=float(softcap) if softcap and float(softcap) > 0 else None,
            input_embedding_scale=float(pick("input_embedding_scale", 1.0) or 1.0),
            rope_scaling=rope_scaling,
            extra={k: v for k, v in dflash.items() if k in ("causal",)},
        )

    @classmethod
    def from_file(cls, path: str | Path) -> DrafterConfig:
        """Read ``config.json`` (a file or the folder holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_dict(json.loads(path.read_text()))

    def to_dict(self) -> dict[str, Any]:
        """The published config.json layout: v2 (``DFlash2DraftModel``) or v1 (``DFlashDraftModel``)."""
        dflash: dict[str, Any] = {
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
        }
        out: dict[str, Any] = {
            "architectures": ["DFlash2DraftModel" if self.version == 2 else "DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
            "num_target_layers": self.num_target_layers,
            "layer_types": list(self.layer_types),
        }
        sliding = [i for i in range(self.num_hidden_layers) if self.layer_window(i) is not None]
        if sliding:
            # Read through the Hugging Face rule by every reference loader: windows need this flag.
            out.update(use_sliding_window=True, sliding_window=self.sliding_window, max_window_layers=sliding[0])
        elif self.sliding_window is not None:
            out["sliding_window"] = self.sliding_window
        if self.version == 2:
            if self.is_causal is not None:
                out["is_causal"] = self.is_causal
            elif not any(self.layer_is_causal(i) for i in range(self.num_hidden_layers)):
                out["is_causal"] = False  # the published layout; leaving it out would mean the same
            out["rope_parameters"] = self.rope_parameters
            dflash.update(
                block_size=self.block_size,
                conv_group_size=self.conv_group_size,
                conv_kernel_size=self.conv_kernel_size,
                selector_rank=self.selector_rank,
                selector_top_k=self.selector_top_k,
            )
        else:
            out["block_size"] = self.block_size
            out["rope_theta"] = self.rope_theta
            if self.rope_scaling:
                out["rope_scaling"] = {k: v for k, v in self.rope_parameters.items() if k != "rope_theta"}
            if self.is_causal is not None:
                out["is_causal"] = self.is_causal
        if self.output_multiplier != 1.0:
            dflash["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping:
            dflash["final_logit_softcapping"] = self.final_logit_softcapping
        if self.input_embedding_scale != 1.0:
            dflash["input_embedding_scale"] = self.input_embedding_scale
        dflash.update(self.extra)
        out["dflash_config"] = dflash
        return out

    def save(self, folder: str | Path) -> None:
        """Write ``config.json`` into ``folder``."""
        Path(folder, "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def as_hf_rope_config(self) -> Any:
        """A config ``RotaryEmbedding`` reads: the RoPE type and parameters, and for scaled types
        a transformers ``Qwen3Config`` with the shape fields their initialisers read."""
        from types import SimpleNamespace

        if not self.rope_scaling:
            return SimpleNamespace(rope_parameters={"rope_theta": self.rope_theta, "rope_type": "default"})
        from transformers import Qwen3Config

        return Qwen3Config(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=self.rope_parameters,
        )
