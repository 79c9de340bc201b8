"""Serving a target (and drafter) with weight-only quantized linears (:mod:`dflash2.models.quant`).

``--quantization`` (vLLM's flag name) chooses how, per :data:`QUANTIZATION_CHOICES`:

* ``gguf``: a ``.gguf`` target keeps its own quantized tensors, repacked without changing a weight
  (:mod:`dflash2.models.gguf_quants`: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K); its other
  tensors (norms, the embedding) are the file's, dequantized, as before;
* ``int8`` / ``int4``: every linear of a float checkpoint quantized at load, round to nearest per
  group of 32 (:func:`dflash2.models.quant.quantize_rtn`: int8 symmetric, int4 asymmetric);
* ``none``: dense weights in the serving dtype (the path without quantization);
* ``auto`` (the default): ``gguf`` for a ``.gguf`` file the user names, where the kernel runs; else
  ``none``, the embedded default model included (its dense bfloat16 copy ran the speculative default
  faster on the CPUs measured: docs/engine.md, "Quantized weights").

The kernel runs on x86 CPUs with AVX2, FMA and F16C; elsewhere ``auto`` serves dense weights and an
explicit method is an error.
"""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from dflash2.models.quant import GroupQuantized, QuantizedLinear, dequantize, quantize_rtn

logger = logging.getLogger(__name__)

# The values of --quantization / --speculative-draft-quantization (dflash2.config checks them at the boundary).
QUANTIZATION_CHOICES = ("auto", "none", "gguf", "int8", "int4")
DRAFT_QUANTIZATION_CHOICES = ("none", "int8", "int4")
GROUP_SIZE = 32  # inputs per scale of --quantization int8/int4
FLOAT_TYPES = ("F32", "F16", "BF16")  # GGUF tensor types that are their own exact, dense form

# GGUF tensor names of the Llama-family decoder's linears (llama.cpp's LLM_TENSOR_NAMES).
_GGUF_LAYER_TENSORS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


class QuantizationError(ValueError):
    """A ``--quantization`` that cannot be served here; the message says what to do instead."""


@dataclass(frozen=True)
class QuantizationReport:
    """What was quantized, for the start-up log, ``/v1/models`` and the metrics' label.

    Attributes:
        method: ``none``, ``gguf``, ``int8`` or ``int4``.
        formats: layers per weight format (``{"Q4_1": 210, "Q8_0": 1}``); empty for ``none``.
        dense: linears left dense, with why (``{"layers.0.mlp.down_proj": "F16"}``).
        weight_bytes: bytes of the quantized linears' codes, scales and offsets.
    """

    method: str
    formats: dict[str, int]
    dense: dict[str, str]
    weight_bytes: int

    @property
    def label(self) -> str:
        """One word for logs and metrics: ``none``, ``int4``, or the GGUF formats (``gguf:Q4_1+Q8_0``)."""
        if self.method != "gguf":
            return self.method
        return "gguf:" + "+".join(sorted(self.formats)) if self.formats else "gguf"

    def describe(self) -> str:
        """A sentence for the start-up log."""
        if self.method == "none":
            return "weights: dense (no quantization)"
        layers = ", ".join(f"{count} {name}" for name, count in sorted(self.formats.items()))
        text = f"weights: {self.label} ({layers} linear layers, {self.weight_bytes / 1e6:.1f} MB quantized)"
        if self.dense:
            text += f"; {len(self.dense)} left dense ({', '.join(sorted(set(self.dense.values())))})"
        return text


NOT_QUANTIZED = QuantizationReport("none", {}, {}, 0)


def kernel_available() -> bool:
    """Whether the quantized kernel runs here (an x86 CPU with AVX2, FMA and F16C, and a C++ compiler)."""
    from dflash2.models.cpu_kernels import QUANT

    return QUANT.available()


def resolve_method(
    method: str,
    gguf_path: pathlib.Path | None,
    device: torch.device,
    tensor_parallel: bool,
    embedded: bool = False,
    dtype: torch.dtype = torch.bfloat16,
) -> str:
    """The method ``--quantization method`` means for this target and device: ``none``, ``gguf``,
    ``int8`` or ``int4``. ``embedded``: the target is the embedded default model, which ``auto`` serves
    dense; ``dtype``: the activations' (the kernel takes bfloat16 and float32).

    Raises:
        QuantizationError: an unknown method, ``gguf`` without a ``.gguf`` target, or an explicit
            method where the kernel cannot run (not a CPU, no AVX2/FMA/F16C or compiler, tensor
            parallelism).
    """
    if method not in QUANTIZATION_CHOICES:
        raise QuantizationError(f"--quantization {method!r}: expected one of {', '.join(QUANTIZATION_CHOICES)}")
    if method == "none":
        return "none"
    if method == "auto":
        if embedded or gguf_path is None or device.type != "cpu" or tensor_parallel or dtype == torch.float16:
            return "none"
        if not kernel_available():
            return "none"
        return "gguf"
    if method == "gguf" and gguf_path is None:
        raise QuantizationError(
            "--quantization gguf keeps a .gguf file's own quantized tensors, but the target is not a .gguf file: "
            "pass --model FILE.gguf, or --quantization int8/int4 to quantize this checkpoint at load"
        )
    if tensor_parallel:
        raise QuantizationError(
            f"--quantization {method} runs in one process: drop --tensor-parallel-size or use --quantization none"
        )
    if device.type != "cpu":
        raise QuantizationError(
            f"--quantization {method} runs on CPUs only ({device} asked): use --quantization none on this device"
        )
    if dtype == torch.float16:
        raise QuantizationError(
            f"--quantization {method} takes bfloat16 or float32 activations: use --dtype bfloat16 or float32"
        )
    if not kernel_available():
        raise QuantizationError(
            f"--quantization {method} needs an x86 CPU with AVX2, FMA and F16C and a C++ compiler (the quantized "
            "kernel is built on first use); use --quantization none here"
        )
    return method


def _linears(model: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Linear]]:
    """Every ``nn.Linear`` under ``model`` as ``(parent, attribute, layer)``."""
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                yield parent, f"{parent_name}.{name}" if parent_name else name, child


def quantize_linears(
    model: nn.Module,
    bits: int,
    skip: tuple[str, ...] = (),
    keep_weight: tuple[str, ...] = (),
    group_size: int = GROUP_SIZE,
) -> QuantizationReport:
    """Replace every ``nn.Linear`` of ``model`` (but those whose qualified name is in ``skip`` or starts
    with one of them) by a round-to-nearest :class:`QuantizedLinear` of ``bits`` bits, in place. A
    layer whose inputs are not a multiple of ``group_size`` stays dense (reported); the layers named in
    ``keep_weight`` keep their dense weight as ``.weight`` (an LM head the drafter shares).

    Returns:
        The :class:`QuantizationReport` of ``int{bits}``.
    """
    formats: dict[str, int] = {}
    dense: dict[str, str] = {}
    total = 0
    for parent, name, layer in list(_linears(model)):
        if any(name == s or name.startswith(s + ".") for s in skip):
            continue
        if layer.in_features % group_size:
            dense[name] = f"{layer.in_features} inputs"
            continue
        quantized = QuantizedLinear(
            quantize_rtn(layer.weight.detach(), bits, group_size),
            None if layer.bias is None else layer.bias.detach(),
            f"int{bits}",
            weight=layer.weight if name in keep_weight else None,
        )
        setattr(parent, name.rsplit(".", 1)[-1], quantized)
        formats[f"int{bits}"] = formats.get(f"int{bits}", 0) + 1
        total += quantized.nbytes
    return QuantizationReport(f"int{bits}", formats, dense, total)


def _llama_rope_permutation(num_rows: int, num_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation for rotary embeddings: GGUF row ``perm[n]`` is
    the checkpoint's row ``n`` (llama.cpp's ``convert_hf_to_gguf.py`` interleaves each head's halves)."""
    head_dim = num_rows // num_heads
    rows = torch.arange(num_rows).view(num_heads, 2, head_dim // 2).transpose(1, 2).reshape(-1)
    return torch.argsort(rows)


def _matching_rows(g: GroupQuantized, dense: torch.Tensor, heads: tuple[int, ...]) -> GroupQuantized | None:
    """``g`` with its rows ordered as ``dense`` holds them (identity, or undoing llama.cpp's Q/K
    permutation for one of ``heads``), or None when no order gives exactly ``dense``."""
    weights = dequantize(g).to(dense.dtype)
    if torch.equal(weights, dense):
        return g
    for num_heads in heads:
        if num_heads <= 0 or g.shape[0] % (2 * num_heads):
            continue
        perm = _llama_rope_permutation(g.shape[0], num_heads)
        if torch.equal(weights[perm], dense):
            offsets = None if g.offsets is None else g.offsets[perm]
            return GroupQuantized(g.bits, g.group_size, g.q[perm], g.scales[perm], offsets)
    return None


def quantize_from_gguf(model: nn.Module, gguf_path: pathlib.Path, strict: bool = False) -> QuantizationReport:
    """Replace the linears of a Llama-family :class:`~dflash2.models.llama.TargetModel` by the
    ``.gguf`` file's own quantized tensors, repacked (:func:`dflash2.models.gguf_quants.to_group_form`).

    Each repacked weight is checked against the dense weight the model was loaded with (the same file,
    dequantized by transformers): it must dequantize to exactly that weight (in the model's dtype),
    in the file's row order or with llama.cpp's Q/K permutation undone. A float tensor (F32, F16, BF16)
    stays dense (it is its own exact form); a block type without a kernel (Q2_K, Q3_K, IQ…) stays dense
    with a warning naming the type.

    Args:
        strict: raise for a block type without a kernel instead of leaving it dense.

    Raises:
        QuantizationError: (``strict``) a block type without a kernel, naming it; a file whose tensors
            do not match the loaded model or cannot be read as their type says.
    """
    from gguf import GGMLQuantizationType, GGUFReader

    from dflash2.models.gguf_quants import UnsupportedGGUFType, to_group_form

    reader = GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    config = getattr(model, "config", None)
    heads = tuple(
        int(h) for h in (getattr(config, "num_attention_heads", 0), getattr(config, "num_key_value_heads", 0)) if h
    )
    formats: dict[str, int] = {}
    dense: dict[str, str] = {}
    total = 0
    targets: list[tuple[nn.Module, str, str, nn.Linear]] = []
    for parent, name, layer in _linears(model):
        if name == "lm_head":
            gguf_name = "output.weight" if "output.weight" in tensors else "token_embd.weight"
        else:
            parts = name.split(".")  # layers.{i}.self_attn.q_proj
            suffix = _GGUF_LAYER_TENSORS.get(".".join(parts[2:]))
            if parts[0] != "layers" or suffix is None:
                dense[name] = "no GGUF tensor"
                continue
            gguf_name = f"blk.{parts[1]}.{suffix}.weight"
        targets.append((parent, name, gguf_name, layer))
    for parent, name, gguf_name, layer in targets:
        tensor = tensors.get(gguf_name)
        if tensor is None:
            raise QuantizationError(f"{gguf_path.name} has no tensor {gguf_name} for the model's {name}")
        qtype = GGMLQuantizationType(tensor.tensor_type)
        try:
            g = to_group_form(tensor.data, qtype, (layer.out_features, layer.in_features))
        except UnsupportedGGUFType as error:
            if strict and qtype.name not in FLOAT_TYPES:
                raise QuantizationError(f"{gguf_name}: {error}") from error
            dense[name] = qtype.name
            continue
        except ValueError as error:  # a shape or size that does not match the model
            raise QuantizationError(f"{gguf_path.name}: tensor {gguf_name}: {error}") from error
        matched = _matching_rows(g, layer.weight.detach(), heads)
        if matched is None:
            raise QuantizationError(
                f"{gguf_path.name}: tensor {gguf_name} ({qtype.name}) does not dequantize to the model's {name}; "
                "serve the file with --quantization none"
            )
        bias = None if layer.bias is None else layer.bias.detach()
        keep = layer.weight if name == "lm_head" else None  # the drafter reads the LM head's dense weight
        quantized = QuantizedLinear(matched, bias, qtype.name, weight=keep)
        setattr(parent, name.rsplit(".", 1)[-1], quantized)
        formats[qtype.name] = formats.get(qtype.name, 0) + 1
        total += quantized.nbytes
    by_type: dict[str, list[str]] = {}
    for name, why in dense.items():
        by_type.setdefault(why, []).append(name)
    for why, names in sorted(by_type.items()):
        if why in FLOAT_TYPES:
            logger.info("%d linear layers stay dense: their GGUF tensors are %s", len(names), why)
        elif why == "no GGUF tensor":
            logger.warning("%d linear layers stay dense: no GGUF tensor maps to them (%s)", len(names), names[0])
        else:
            logger.warning(
                "%d linear layers stay dense: GGUF type %s has no quantized kernel (%s, …)", len(names), why, names[0]
            )
    return QuantizationReport("gguf", formats, dense, total)


def quantize_target(
    model: object, method: str, gguf_path: pathlib.Path | None = None, strict: bool = False
) -> QuantizationReport:
    """Quantize a loaded target in place by a resolved ``method`` (:func:`resolve_method`).

    ``int8``/``int4`` quantize every decoder linear and the LM head (the LM head keeps its dense weight
    as ``.weight``, which the drafter shares — the embedding's own tensor when tied, an extra copy when
    not; the embedding stays dense: a lookup reads one row). ``gguf`` repacks the file's tensors
    (:func:`quantize_from_gguf`).

    Raises:
        QuantizationError: see :func:`quantize_from_gguf`; a target without its own decoder (the
            transformers fallback).
    """
    if method == "none":
        return NOT_QUANTIZED
    from dflash2.models.llama import TargetModel

    if not isinstance(model, TargetModel):
        raise QuantizationError(
            f"--quantization {method} needs a natively decoded target (Llama, Mistral, Qwen2, Qwen3); "
            f"{type(model).__name__} runs through transformers: use --quantization none"
        )
    if method == "gguf":
        assert gguf_path is not None
        return quantize_from_gguf(model, gguf_path, strict=strict)
    return quantize_linears(model, 8 if method == "int8" else 4, keep_weight=("lm_head",))


def quantize_drafter(drafter: nn.Module, method: str) -> QuantizationReport:
    """Quantize a drafter's own linears (its decoder layers and feature projection; not the selector,
    whose weights the walk reads, nor the LM head it shares with the target) by round to nearest.

    Raises:
        QuantizationError: an unknown method, or where the kernel cannot run.
    """
    if method == "none":
        return NOT_QUANTIZED
    if method not in DRAFT_QUANTIZATION_CHOICES:
        raise QuantizationError(
            f"--speculative-draft-quantization {method!r}: expected one of {', '.join(DRAFT_QUANTIZATION_CHOICES)}"
        )
    device = next(drafter.parameters()).device
    if device.type != "cpu":
        raise QuantizationError(
            f"--speculative-draft-quantization {method} runs on CPUs only ({device} asked): drop it on this device"
        )
    if not kernel_available():
        raise QuantizationError(
            f"--speculative-draft-quantization {method} needs an x86 CPU with AVX2, FMA and F16C and a C++ compiler"
        )
    return quantize_linears(drafter, 8 if method == "int8" else 4, skip=("candidate_selector",))
