"""Errors the engine raises to its callers (the server maps them to OpenAI error objects)."""

from __future__ import annotations


class ContextLengthExceededError(ValueError):
    """prompt tokens + max_tokens exceed ``max_model_len``."""


class EngineClosedError(RuntimeError):
    """The engine (or the ``LLM`` over it) was closed: its models and processes are released."""
