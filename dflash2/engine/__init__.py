"""The engine: continuous batching over the speculative step (``Engine``; the step's rooms are this
package's modules, in the order ``Engine.step`` runs them — see ``llm_engine.py``)."""

from dflash2.engine.llm_engine import Engine

__all__ = ["Engine"]
