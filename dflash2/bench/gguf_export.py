"""A GGUF file with the same weights as the benchmarked model, for llama.cpp.

When the model came from a GGUF file (the embedded SmolLM2 ships as Q4_1 GGUF; a ``--model`` that
is a ``.gguf`` file), the safetensors folder this engine and transformers load is that file
dequantized. To give llama.cpp the same weights in the same precision, that GGUF is dequantized
with the ``gguf`` package into F32 (F16 / BF16 when ``--dtype`` says so): every metadata field is
copied, every tensor is written dequantized under its own name, ``general.file_type`` is updated.
llama.cpp then computes in that precision instead of its quantized kernels.

A model that did not come from GGUF cannot be exported here: the ``gguf`` package writes GGUF
files but has no converter from a transformers folder (that converter is llama.cpp's
``convert_hf_to_gguf.py``, which is not on PyPI), so ``--gguf FILE`` must be given.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from dflash2.models import source

logger = logging.getLogger(__name__)

_FILE_TYPES = {"float32": ("F32", 0), "float16": ("F16", 1), "bfloat16": ("BF16", 32)}  # name, LlamaFileType
# The tensor types llama.cpp rows can be asked for (--gguf-types), with their LlamaFileType.
GGUF_TYPES = {"F32": 0, "F16": 1, "BF16": 32, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7}


@dataclass(frozen=True)
class GgufChoice:
    """The GGUF for llama.cpp (None when there is none) and how it was chosen."""

    path: Path | None
    note: str


def choose_gguf(model: str | None, folder: Path, dtype_name: str, explicit: Path | None) -> GgufChoice:
    """``explicit`` as given, else the model's source GGUF dequantized to ``dtype_name``."""
    if explicit is not None:
        if not explicit.is_file():
            return GgufChoice(None, f"--gguf {explicit} does not exist")
        return GgufChoice(explicit, f"{explicit} (given with --gguf)")
    origin = source.source_gguf(model, folder)
    if origin is None:
        return GgufChoice(
            None,
            f"no GGUF for {folder}: the model did not come from a GGUF file, and the gguf package cannot "
            "convert a transformers folder (llama.cpp's convert_hf_to_gguf.py does; it is not on PyPI); "
            "pass --gguf FILE",
        )
    type_name, _ = _FILE_TYPES[dtype_name]
    return _written_copy(origin, dtype_name, type_name, "dequantized to", "(the weights this engine loads)")


def typed_gguf(model: str | None, folder: Path, type_name: str) -> GgufChoice:
    """A GGUF of the model's weights in the tensor type ``type_name`` (:data:`GGUF_TYPES`): the model's own
    GGUF file when its file type (``general.file_type``) is that type, else one written from it (cached)."""
    import gguf

    origin = source.source_gguf(model, folder)
    if origin is None:
        return GgufChoice(None, f"no GGUF for {folder} to derive a {type_name} file from; pass --gguf FILE")
    field = gguf.GGUFReader(origin).fields.get(gguf.Keys.General.FILE_TYPE)
    if field is not None and int(field.contents()) == GGUF_TYPES[type_name]:
        return GgufChoice(origin, f"{origin.name} (its own {type_name} file)")
    return _written_copy(origin, type_name, type_name, "requantized to", "by the gguf package")


def _written_copy(origin: Path, dtype_name: str, type_name: str, verb: str, how: str) -> GgufChoice:
    """``origin`` rewritten in ``type_name`` (:func:`dequantize_gguf`) into the cache, once."""
    target = source.cache_dir() / "gguf" / f"{origin.stem}-{source.gguf_fingerprint(origin)}-{type_name}.gguf"
    if not target.is_file():
        try:
            dequantize_gguf(origin, target, dtype_name)
        except Exception as exc:  # the gguf package raises NotImplementedError, ValueError, …
            return GgufChoice(
                None, f"could not write {origin} as {type_name} with the gguf package: {exc}; pass --gguf FILE"
            )
    return GgufChoice(target, f"{origin.name} {verb} {type_name} {how}")


def dequantize_gguf(origin: Path, target: Path, dtype_name: str) -> Path:
    """Write ``origin`` with every matrix dequantized to ``dtype_name`` (float32, float16, bfloat16), or
    requantized to a GGUF type name of :data:`GGUF_TYPES` (``Q8_0``, ``Q4_0``, ``Q4_1``, …; round to nearest
    by the ``gguf`` package, from the dequantized weights)."""
    import gguf
    import numpy as np

    if dtype_name in _FILE_TYPES:
        type_name, file_type = _FILE_TYPES[dtype_name]
    else:
        type_name, file_type = dtype_name, GGUF_TYPES[dtype_name]
    reader = gguf.GGUFReader(origin)
    architecture = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("Writing %s (%s) from %s for llama.cpp", target, type_name, origin)
    writer = gguf.GGUFWriter(str(tmp), architecture)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = file_type if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if weights.ndim == 1 or type_name == "F32":  # norms stay F32, as llama.cpp's own converter keeps them
            writer.add_tensor(tensor.name, weights)
        elif type_name == "F16":
            writer.add_tensor(tensor.name, weights.astype(np.float16))
        else:  # BF16 and the block types: uint8 rows
            qtype = gguf.GGMLQuantizationType[type_name]
            packed = gguf.quants.quantize(weights, qtype)
            writer.add_tensor(tensor.name, packed, raw_dtype=qtype)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
