"""Saved compiled graphs (dflash2/runner/precompiled.py): a second module of the same shape loads them
instead of tracing, reads its own weights, and a file that does not fit is compiled again."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflash2.runner import precompiled
from dflash2.runner.precompiled import PrecompiledForward

WIDTH = 16


class Block(nn.Module):
    """Weights, a buffer and a Python constant (baked into the graph), like the static modules."""

    def __init__(self, eps: float = 1e-5, width: int = WIDTH, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.linear = nn.Linear(width, width, dtype=dtype)
        self.scale: torch.Tensor
        self.register_buffer("scale", torch.rand(width, dtype=dtype) + 0.5, persistent=False)

    def forward(self, x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(self.linear(x), (x.shape[-1],), eps=self.eps) * self.scale
        return h + keys.float().mean()


def by_rows(inputs) -> str:
    return "rows=1" if inputs[0].shape[0] == 1 else "rows=2+"


def keep_all(guards) -> list[bool]:
    return [True] * len(guards)


@pytest.fixture(autouse=True)
def graphs_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "graphs"
    monkeypatch.setattr(precompiled, "graphs_dir", lambda: folder)
    return folder


def run(forward: PrecompiledForward, rows: int, keys: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``(compiled, eager)`` outputs for ``rows`` rows, the inputs marked as the runner marks them."""
    x, k = torch.randn(rows, WIDTH), torch.arange(keys)
    torch._dynamo.maybe_mark_dynamic(k, 0)
    if rows >= 2:
        torch._dynamo.maybe_mark_dynamic(x, 0)
    with torch.no_grad():
        return forward(x, k), forward.module(x, k)


def test_a_second_module_loads_the_saved_graph_and_runs_its_own_weights(graphs_dir: Path) -> None:
    first = PrecompiledForward(Block(), "block", by_rows, keep_all)
    got, expected = run(first, 3)
    assert first.last_source == "compiled"
    torch.testing.assert_close(got, expected)
    assert len(list(graphs_dir.glob("block-*.bin"))) == 1

    second = PrecompiledForward(Block(), "block", by_rows, keep_all)  # other random weights
    got, expected = run(second, 5, keys=128)  # another row count and key length: same graph
    assert second.last_source == "loaded" and second.shape_classes == ("rows=2+",)
    torch.testing.assert_close(got, expected)

    with torch.no_grad():
        second.module.linear.weight.mul_(-2.0)  # weights are read when the graph runs
    got, expected = run(second, 4)
    torch.testing.assert_close(got, expected)


def test_each_shape_class_has_its_own_graph(graphs_dir: Path) -> None:
    forward = PrecompiledForward(Block(), "block", by_rows, keep_all)
    for rows in (1, 3, 6):
        got, expected = run(forward, rows)
        torch.testing.assert_close(got, expected)
    assert forward.shape_classes == ("rows=1", "rows=2+")
    assert len(list(graphs_dir.glob("block-*.bin"))) == 2


def test_the_key_covers_constants_shapes_dtypes_and_settings() -> None:
    base = PrecompiledForward(Block(), "block", by_rows, keep_all).path("rows=1")
    assert PrecompiledForward(Block(), "block", by_rows, keep_all).path("rows=1") == base  # weights do not count
    others = [
        PrecompiledForward(Block(eps=1e-6), "block", by_rows, keep_all).path("rows=1"),
        PrecompiledForward(Block(width=32), "block", by_rows, keep_all).path("rows=1"),
        PrecompiledForward(Block(dtype=torch.bfloat16), "block", by_rows, keep_all).path("rows=1"),
        PrecompiledForward(Block(), "block", by_rows, keep_all, settings="slots=4").path("rows=1"),
        PrecompiledForward(Block(), "block", by_rows, keep_all).path("rows=2+"),
    ]
    assert len({base, *others}) == 1 + len(others)


def test_an_unreadable_file_is_compiled_again(graphs_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    forward = PrecompiledForward(Block(), "block", by_rows, keep_all)
    graphs_dir.mkdir(parents=True)
    forward.path("rows=2+").write_bytes(b"not a graph")
    with caplog.at_level(logging.WARNING, logger="dflash2.runner.precompiled"):
        got, expected = run(forward, 3)
    assert "could not load" in caplog.text and forward.last_source == "compiled"
    torch.testing.assert_close(got, expected)
    fresh = PrecompiledForward(Block(), "block", by_rows, keep_all)
    run(fresh, 2)
    assert fresh.last_source == "loaded"  # the bad file was replaced


def test_a_saved_graph_whose_guards_fail_is_compiled_again(caplog: pytest.LogCaptureFixture) -> None:
    """A shape class that lumps batch 1 (a graph specialised on one row) with larger batches: the
    loaded graph's guards catch the mismatch on its first call, and a fresh graph serves."""
    one_class = PrecompiledForward(Block(), "block", lambda inputs: "all", keep_all)
    run(one_class, 1)
    again = PrecompiledForward(Block(), "block", lambda inputs: "all", keep_all)
    with caplog.at_level(logging.WARNING, logger="dflash2.runner.precompiled"):
        got, expected = run(again, 3)
    assert "does not fit" in caplog.text and again.last_source == "compiled"
    torch.testing.assert_close(got, expected)


def test_load_only_loads_a_saved_graph_and_never_compiles(graphs_dir: Path) -> None:
    """A server whose graphs another process compiles loads them, and a shape class without a saved
    graph raises instead of compiling on the engine thread."""
    loader = PrecompiledForward(Block(), "block", by_rows, keep_all, load_only=True)
    with pytest.raises(precompiled.MissingGraphError, match="no saved block graph"):
        run(loader, 3)
    assert not list(graphs_dir.glob("*.bin")) and loader.shape_classes == ()

    run(PrecompiledForward(Block(), "block", by_rows, keep_all), 3)  # the compiling process saves it
    got, expected = run(loader, 4)
    assert loader.last_source == "loaded"
    torch.testing.assert_close(got, expected)
    with pytest.raises(precompiled.MissingGraphError):
        run(loader, 1)  # batch 1 was never saved


def test_load_only_refuses_an_unreadable_file(graphs_dir: Path) -> None:
    loader = PrecompiledForward(Block(), "block", by_rows, keep_all, load_only=True)
    path = loader.path("rows=2+")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a graph")
    with pytest.raises(precompiled.MissingGraphError, match="could not load"):
        run(loader, 3)
