"""Compiled forwards that a restart loads instead of tracing again (CPU).

``torch.compile`` caches inductor's output, but a warm start still re-runs dynamo's trace of
the Python forward: measured on the embedded model (6 graphs, 2 cores), tracing was about 90 %
of a 60 s warm start. :class:`PrecompiledForward` compiles each shape class of a module ahead of
time (``torch.compile(...).aot_compile``, PyTorch's precompile API), saves the result — the
guards, the transformed bytecode and inductor's graph — next to inductor's cache, and loads
it on the next start with no tracing at all.

It also dispatches calls itself: the runner knows which graph a call needs (batch 1 or more,
one query token or more), so a call goes straight to that graph's code instead of through
dynamo's per-call guard evaluation (about 1.1 ms per SmolLM2 forward, most of it checks on
the ~300 weight tensors). Each graph's guards are still evaluated on its first call in a
process; a failed check compiles that shape class afresh. After that the runner's own
invariants stand in for them: every input is built the same way for a shape class, and the
weights a graph reads are its module's own tensors, never replaced.

Artifacts live in ``<inductor cache>/dflash2-graphs/<key>.bin``. The key hashes everything a
graph bakes in: the module's structure, the shapes, dtypes and devices of its weights and
buffers, its Python constants (norm eps, RoPE settings, window sizes …), the shape class,
the compiler settings, the CPU's vector ISA, and the versions of torch, Python and this
package's model code. Anything else reads weights and caches from the module when it runs.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import sys
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

FORMAT = 1  # bump when what is saved, or how it is keyed, changes
_SOURCE_ROOT = Path(__file__).resolve().parents[1]  # the dflash2 package
# The package sources a graph's code comes from (their text is part of the key): the runner (this module
# included), the selector and tree code the drafter's graph calls, and the models.
_SOURCES = ("runner/*.py", "spec/*.py", "models/*.py", "models/csrc/*.cpp")


def graphs_dir() -> Path:
    """``<inductor cache>/dflash2-graphs``: inductor's cache folder (``$TORCHINDUCTOR_CACHE_DIR``,
    which the runner points at ``<dflash2 cache>/inductor``) holds the kernels these graphs call,
    so the two are kept, moved and cleared together."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "dflash2-graphs"


class MissingGraphError(RuntimeError):
    """A :class:`PrecompiledForward` with ``load_only`` found no saved graph that loads and fits."""


@dataclasses.dataclass
class _Graph:
    function: Any  # torch._dynamo.aot_compile.AOTCompiledFunction
    checked: bool = False  # guards evaluated once in this process


class PrecompiledForward:
    """``module.forward`` compiled once per shape class, saved, and dispatched without dynamo.

    Args:
        module: the static module (its weights and buffers are read at every call).
        name: for log lines.
        shape_class: maps a call's positional inputs to a hashable label of the graph they need
            (e.g. ``("rows=1", "width=2+")``); inputs of one class must also carry the same
            dynamic-dimension marks (``torch._dynamo.maybe_mark_dynamic``).
        guard_filter: dynamo guard filter (``guard_filter_fn``); guards that cannot be saved
            (object identities, globals) are dropped as well.
        settings: extra text for the cache key (compiler settings that change the generated code).
        load_only: only load saved graphs, never compile: a shape class without a saved graph that
            loads and fits raises :class:`MissingGraphError` (a server whose graphs another process
            compiled, ``dflash2/runner/background.py``, must not stall on a compilation).

    Calls return whatever ``module(*inputs)`` returns. Building a graph raises what
    ``torch.compile`` raises (the runner falls back to eager); failing to save or load one only
    logs (the graph is then compiled, or kept in memory only), unless ``load_only``.
    """

    def __init__(
        self,
        module: nn.Module,
        name: str,
        shape_class: Callable[[Sequence[Any]], Hashable],
        guard_filter: Callable[[Sequence[Any]], list[bool]],
        settings: str = "",
        load_only: bool = False,
    ) -> None:
        self.module, self.name, self.shape_class = module, name, shape_class
        self.load_only = load_only
        self.guard_filter = guard_filter
        self._module_key = _module_key(module, settings)
        self._graphs: dict[Hashable, _Graph] = {}
        self.last_source: str | None = None  # "compiled" / "loaded", of the graph built last

    def __call__(self, *inputs: Any) -> Any:
        label = self.shape_class(inputs)
        graph = self._graphs.get(label)
        if graph is None:
            graph = self._graphs[label] = self._build(label, inputs)
        if not graph.checked:
            reason = self._guard_failure(graph, inputs)
            if reason is not None:
                if self.load_only:
                    raise MissingGraphError(f"the saved {self.name} graph for {label} does not fit ({reason})")
                # A saved graph whose assumptions do not hold here (the key should prevent it).
                logger.warning(
                    "the saved %s graph for %s does not fit (%s); compiling it again", self.name, label, reason
                )
                graph = self._graphs[label] = self._compile(label, inputs)
                reason = self._guard_failure(graph, inputs)
                if reason is not None:
                    raise RuntimeError(f"the {self.name} graph for {label} fails its own guards: {reason}")
            graph.checked = True
        return graph.function.fn(self.module, *inputs)

    def _guard_failure(self, graph: _Graph, inputs: Sequence[Any]) -> str | None:
        """None when ``graph``'s guards hold for ``inputs``, else the failed guards. The check runs on
        copies without dynamic-dimension marks: a saved graph no longer knows the marks it was traced
        with, and unmarked inputs pass the marking guard either way (shapes are still checked)."""
        plain = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
        if graph.function.guard_check(self.module, *plain):
            return None
        f_locals = graph.function.prepare_f_locals(self.module, *plain)
        return str(graph.function._artifacts.guard_manager.check_verbose(f_locals).verbose_code_parts)

    @property
    def shape_classes(self) -> tuple[Hashable, ...]:
        """The shape classes with a graph built or loaded in this process."""
        return tuple(self._graphs)

    def path(self, label: Hashable) -> Path:
        """Where the graph of shape class ``label`` is saved."""
        digest = hashlib.sha256(f"{self._module_key}|{label!r}".encode()).hexdigest()[:32]
        return graphs_dir() / f"{self.name}-{digest}.bin"

    def _build(self, label: Hashable, inputs: Sequence[Any]) -> _Graph:
        path = self.path(label)
        if path.exists():
            try:
                with open(path, "rb") as f:
                    function = torch.compiler.load_compiled_function(f)
                self.last_source = "loaded"
                return _Graph(function)
            except Exception as error:  # a stale or truncated file: compile again
                if self.load_only:
                    raise MissingGraphError(f"could not load {path} ({type(error).__name__}: {error})") from error
                logger.warning("could not load %s (%s: %s); compiling again", path, type(error).__name__, error)
        if self.load_only:
            raise MissingGraphError(f"no saved {self.name} graph for {label} ({path})")
        return self._compile(label, inputs)

    def _compile(self, label: Hashable, inputs: Sequence[Any]) -> _Graph:
        compiled: Any = torch.compile(
            self.module.forward,
            fullgraph=True,
            dynamic=None,  # only the dimensions the inputs mark are dynamic
            options={"guard_filter_fn": self._savable_guards},
        )
        function = compiled.aot_compile((tuple(inputs), {}))
        path = self.path(label)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            function.save_compiled_function(str(path))
        except Exception as error:
            logger.warning("could not save the %s graph for %s (%s: %s)", self.name, label, type(error).__name__, error)
        self.last_source = "compiled"
        return _Graph(function)

    def _savable_guards(self, guards: Sequence[Any]) -> list[bool]:
        from torch._dynamo.guards import CheckFunctionManager

        unsavable = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
        keep = self.guard_filter(guards)
        return [k and not g.is_global and g.guard_type not in unsavable for k, g in zip(keep, guards)]


def _module_key(module: nn.Module, settings: str) -> str:
    """Text that changes whenever a graph of ``module`` compiled here would not fit another."""
    from torch._inductor import config as inductor_config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    parts = [
        f"format={FORMAT}",
        f"torch={torch.__version__}",
        f"python={sys.version_info[:3]}",
        f"isa={pick_vec_isa()}",
        f"freezing={inductor_config.freezing} dynamic_threads={inductor_config.cpp.dynamic_threads}",
        f"asserts={inductor_config.size_asserts},{inductor_config.alignment_asserts},{inductor_config.scalar_asserts}",
        f"settings={settings}",
        f"sources={_sources_digest()}",
    ]
    for name, sub in module.named_modules():
        constants = {k: v for k, v in sorted(vars(sub).items()) if not k.startswith("_") and _is_constant(v)}
        parts.append(f"{name}:{type(sub).__module__}.{type(sub).__qualname__}:{constants!r}")
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        parts.append(f"{name}:{tuple(tensor.shape)}:{tuple(tensor.stride())}:{tensor.dtype}:{tensor.device}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _is_constant(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_is_constant(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_constant(v) for k, v in value.items())
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


@functools.cache
def _sources_digest() -> str:
    h = hashlib.sha256()
    for pattern in _SOURCES:
        for path in sorted(_SOURCE_ROOT.glob(pattern)):
            h.update(path.relative_to(_SOURCE_ROOT).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()
