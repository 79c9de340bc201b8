"""The package's layers import downwards only: the models know nothing of the algorithms, the
algorithms nothing of the runner and the engine, the runner nothing of the engine, the engine
nothing of the APIs and servers built on it, and the HTTP layer reaches the engine through its
client alone."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The layers, top to bottom: api / cli / bench / train → engine → spec, runner → models → platform.
# What each folder or module (a path under the repository root) may not import: a module or anything
# under it.
ABOVE_THE_ENGINE = ("dflash2.api", "dflash2.cli", "dflash2.bench", "dflash2.train", "server")
FORBIDDEN = {
    "dflash2/models": (
        "dflash2.spec",
        "dflash2.runner",
        "dflash2.engine",
        "dflash2.config",
        "dflash2.engine_args",
        "dflash2.sampling",
        "dflash2.outputs",
        *ABOVE_THE_ENGINE,
    ),
    "dflash2/spec": ("dflash2.engine", "dflash2.runner", "dflash2.config", *ABOVE_THE_ENGINE),
    "dflash2/runner": ("dflash2.engine", *ABOVE_THE_ENGINE),
    # Tensor parallelism's processes run the runner on the models, below the engine.
    "dflash2/parallel.py": ("dflash2.engine", *ABOVE_THE_ENGINE),
    # The background compile worker builds a runner from the models, as an engine would, without one.
    "dflash2/compile_worker.py": ("dflash2.engine", *ABOVE_THE_ENGINE),
    "dflash2/engine": ABOVE_THE_ENGINE,
    "dflash2/config.py": ("dflash2.models", "dflash2.engine", "dflash2.runner", *ABOVE_THE_ENGINE),
    "dflash2/outputs.py": ("dflash2.engine", "dflash2.runner", "dflash2.models", *ABOVE_THE_ENGINE),
    # The HTTP layer reaches the engine only through the client that drives it.
    "server/serving.py": ("dflash2.engine", "dflash2.runner"),
    "server/responses": ("dflash2.engine", "dflash2.runner"),
    "server/protocol.py": ("dflash2.engine", "dflash2.runner"),
}


def imported_modules(path: Path) -> list[str]:
    """Every module ``path`` imports, at any depth (inside functions and ``TYPE_CHECKING`` too), as an
    absolute name; ``from dflash2 import x`` counts as ``dflash2.x``."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names += [base, *(f"{base}.{alias.name}" for alias in node.names)]
    return names


def _modules(where: str) -> list[Path]:
    path = ROOT / where
    return [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))


def _violations(where: str) -> list[str]:
    found = []
    for path in _modules(where):
        for name in imported_modules(path):
            for forbidden in FORBIDDEN[where]:
                if name == forbidden or name.startswith(forbidden + "."):
                    found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


@pytest.mark.parametrize("where", sorted(FORBIDDEN))
def test_no_upward_imports(where):
    assert _modules(where) and all(path.exists() for path in _modules(where)), f"nothing at {where}"
    assert _violations(where) == []


def test_the_check_sees_every_form_of_import(tmp_path, monkeypatch):
    """A control: each import form of a forbidden module is reported."""
    sources = {
        "a.py": "import dflash2.spec.selector\n",
        "b.py": "from dflash2.spec.selector import walk\n",
        "c.py": "from dflash2 import engine\n",
        "d.py": "def f():\n    from ..runner import ModelRunner\n",
        "e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dflash2.config import EngineConfig\n",
        "ok.py": "from dflash2.models.layers import RMSNorm\nfrom . import layers\n",
    }
    folder = tmp_path / "dflash2" / "models"
    folder.mkdir(parents=True)
    for name, text in sources.items():
        (folder / name).write_text(text)
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    reported = {line.split()[0].rsplit("/", 1)[-1] for line in _violations("dflash2/models")}
    assert reported == {"a.py", "b.py", "c.py", "d.py", "e.py"}
