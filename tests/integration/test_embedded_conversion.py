"""The embedded SmolLM2 converted for real (GGUF → a Hugging Face folder in a fresh dflash2 cache, about
a minute): where it lands, its config, dense weights and tokenizer, that it still answers, and that a
second resolve reuses it. The conversion's bookkeeping with stand-ins is in tests/unit/test_source.py."""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from dflash2.models import source
from dflash2.models.source import COMPLETE_MARKER, EMBEDDED_MODEL_NAME, resolve_model


@dataclass(frozen=True)
class Converted:
    cache: pathlib.Path
    folder: pathlib.Path
    seconds: float


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Converted]:
    """Convert the embedded GGUF once for this file, into a fresh cache."""
    cache = tmp_path_factory.mktemp("dflash2-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH2_CACHE", str(cache))
        started = time.perf_counter()
        folder = resolve_model(None)
        seconds = time.perf_counter() - started
    yield Converted(cache=cache, folder=folder, seconds=seconds)


@pytest.fixture(scope="module")
def tokenizer(converted: Converted) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(converted.folder)


@pytest.mark.slow
def test_embedded_conversion_lands_in_the_cache(converted: Converted) -> None:
    assert converted.folder.parent == converted.cache / "models"
    assert converted.folder.name.startswith(f"{EMBEDDED_MODEL_NAME}-")
    assert (converted.folder / COMPLETE_MARKER).is_file()
    assert not [p for p in converted.folder.parent.iterdir() if p.name.startswith(".")], "temp folder left"


@pytest.mark.slow
def test_embedded_conversion_config(converted: Converted) -> None:
    config = json.loads((converted.folder / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["vocab_size"] == 49152
    assert config["hidden_size"] == 576
    assert "quantization_config" not in config
    assert (converted.folder / "generation_config.json").is_file()


@pytest.mark.slow
def test_embedded_conversion_weights_are_dense_safetensors(converted: Converted) -> None:
    from safetensors import safe_open

    files = sorted(converted.folder.glob("*.safetensors"))
    assert files
    assert not list(converted.folder.glob("*.gguf"))
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                piece = handle.get_slice(key)
                shapes[key] = tuple(piece.get_shape())
                dtypes.add(piece.get_dtype())
    assert shapes["model.embed_tokens.weight"] == (49152, 576)
    assert dtypes == {"F32"}
    assert sum(1 for key in shapes if key.endswith("self_attn.q_proj.weight")) == 30


@pytest.mark.slow
def test_embedded_tokenizer_round_trips_and_has_chat_template(tokenizer: Any) -> None:
    ids = tokenizer("Hello world")["input_ids"]
    assert ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Hello world"
    assert isinstance(tokenizer.chat_template, str) and tokenizer.chat_template.strip()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_embedded_model_still_answers(converted: Converted, tokenizer: Any) -> None:
    """A wrong dequantization (say, unpermuted q/k projections) loads fine but produces nonsense."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(converted.folder, dtype=torch.float32)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


@pytest.mark.slow
def test_second_resolve_reuses_the_cache(converted: Converted, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH2_CACHE", str(converted.cache))
    marker = converted.folder / COMPLETE_MARKER
    marker_mtime = marker.stat().st_mtime_ns
    listing = sorted(p.name for p in (converted.cache / "models").iterdir())

    def must_not_convert(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(source, "_write_hf_folder", must_not_convert)
    started = time.perf_counter()
    again = resolve_model(None)
    elapsed = time.perf_counter() - started

    assert again == converted.folder
    assert elapsed < 2.0
    assert marker.stat().st_mtime_ns == marker_mtime
    assert sorted(p.name for p in (converted.cache / "models").iterdir()) == listing
