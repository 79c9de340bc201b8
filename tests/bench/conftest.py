"""Fixtures of the benchmark tests: the tiny model and drafter folders (built once per session)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.bench.tiny_folder import write_tiny_drafter, write_tiny_model


@dataclass(frozen=True)
class TinyFolders:
    """A tiny target folder and a DFlash 2 drafter folder for it."""

    model: Path
    drafter: Path


@pytest.fixture(scope="session")
def tiny_folders(tmp_path_factory: pytest.TempPathFactory) -> TinyFolders:
    root = tmp_path_factory.mktemp("bench-tiny")
    return TinyFolders(write_tiny_model(root / "model"), write_tiny_drafter(root / "drafter"))
