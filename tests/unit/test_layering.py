"""The package's layers import downwards only: the models know nothing of the algorithms, the
algorithms nothing of the runner and the engine, the runner nothing of the engine, the engine
nothing of the APIs and servers built on it, and the HTTP layer reaches the engine through its
client alone. And no module imports itself round a loop: the graph of every module under dflash2/ and
server/ — imports inside functions and under ``TYPE_CHECKING`` included — has no cycle."""

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
    # The runner holds tensor parallelism's processes (runner/tensor_parallel*.py) and sets up the models an
    # EngineConfig names (runner/model_setup.py), below the engine.
    "dflash2/runner": ("dflash2.engine", *ABOVE_THE_ENGINE),
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


def _import_statements(path: Path) -> list[tuple[str, list[str], bool]]:
    """Each import statement of ``path`` at any depth as ``(module, names, under_type_checking)``: the
    absolute module (relative imports resolved) and, for ``from m import a, b``, ``[a, b]``."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    tree = ast.parse(path.read_text(), filename=str(path))
    type_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for child in node.body
        for inner in ast.walk(child)
    }
    statements = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            statements += [(alias.name, [], id(node) in type_only) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            statements.append((base, [alias.name for alias in node.names], id(node) in type_only))
    return statements


def imported_modules(path: Path) -> list[str]:
    """Every module ``path`` imports, at any depth (inside functions and ``TYPE_CHECKING`` too), as an
    absolute name; ``from dflash2 import x`` counts as ``dflash2.x``."""
    return [name for base, names, _ in _import_statements(path) for name in (base, *(f"{base}.{n}" for n in names))]


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module under dflash2/ and server/, by dotted name (a package by its own name, for __init__.py)."""
    modules = {}
    for top in ("dflash2", "server"):
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, bool]]:
    """``{module: {imported module: only under TYPE_CHECKING}}`` over ``modules``. ``import a.b.c`` is an
    edge to the longest of ``a.b.c``, ``a.b``, ``a`` that is one of ``modules``; ``from p import x`` to
    ``p.x`` when that is a module, else to ``p`` (the package's ``__init__``)."""

    def known(name: str) -> str | None:
        parts = name.split(".")
        return next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in modules), None)

    graph: dict[str, dict[str, bool]] = {}
    for module, path in modules.items():
        edges: dict[str, bool] = {}
        for base, names, type_only in _import_statements(path):
            targets = [f"{base}.{n}" if f"{base}.{n}" in modules else known(base) for n in names] or [known(base)]
            for target in targets:
                if target is not None and target != module:
                    edges[target] = edges.get(target, True) and type_only
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, dict[str, bool]]) -> list[str] | None:
    """A loop of imports in ``graph`` (``[a, b, …, a]``), or None when it is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, {})):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)) is not None:
            return cycle
    return None


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


def test_every_module_is_in_the_graph():
    modules = package_modules()
    for name in (
        "dflash2.api",
        "dflash2.runner.model_setup",
        "dflash2.runner.precompiled",
        "dflash2.runner.tensor_parallel",
        "dflash2.runner.tensor_parallel_worker",
        "server.app",
        "server.responses.convert",
    ):
        assert name in modules
    assert len(modules) == len(list((ROOT / "dflash2").rglob("*.py"))) + len(list((ROOT / "server").rglob("*.py")))


def test_the_module_graph_has_no_cycle():
    """No loop at all, not even one closed by a ``TYPE_CHECKING`` import: a module that needs to name the
    type of a module above it names a protocol of what it uses (``runner/compile.py``, ``runner/costs.py``)."""
    assert find_cycle(import_graph(package_modules())) is None


def test_the_cycle_check_sees_imports_in_functions_and_type_checking(tmp_path, monkeypatch):
    """A control: loops closed by a function-level import, a ``TYPE_CHECKING`` import, a relative import
    and ``from package import module`` are found; importing a package's name from a sibling is not a loop."""
    package = "dflash2"  # the files below are made up: their paths are written so that no doc check reads them
    files = {
        f"{package}/__init__.py": "",
        f"{package}/a.py": "from dflash2 import b\n",
        f"{package}/b.py": "def f():\n    from .c import g\n",
        f"{package}/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import dflash2.a\n",
        f"{package}/p/__init__.py": "from dflash2.p.m import x\n",
        f"{package}/p/m.py": "x = 1\n",
        f"{package}/p/n.py": "from dflash2.p import m\n",
        "server/__init__.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    graph = import_graph(package_modules(tmp_path))
    assert graph["dflash2.c"] == {"dflash2.a": True} and graph["dflash2.b"] == {"dflash2.c": False}
    assert graph["dflash2.p.n"] == {"dflash2.p.m": False}
    assert find_cycle(graph) == ["dflash2.a", "dflash2.b", "dflash2.c", "dflash2.a"]
    del graph["dflash2.c"]["dflash2.a"]
    assert find_cycle(graph) is None
