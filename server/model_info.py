"""``ModelInfo``: what the HTTP layer knows about the loaded model (its names, limits, tokenizer and grammar
engine), and the request checks that need it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dflash2.grammar import GrammarBackend
from dflash2.sampling import check_token_ids
from server.errors import InvalidRequestError, ModelNotFoundError

if TYPE_CHECKING:
    from dflash2.engine import Engine


@dataclass(frozen=True)
class ModelInfo:
    """What the HTTP layer needs to know about the loaded model."""

    name: str
    accepted_names: frozenset[str]
    max_model_len: int
    vocab_size: int
    tokenizer: Any | None
    grammar: GrammarBackend | None = None
    quantization: str = "none"
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def from_engine(cls, engine: Engine, served_model_name: str | None) -> ModelInfo:
        """Served under ``served_model_name`` (default: the engine's name); the engine's name is accepted too."""
        name = served_model_name or engine.model_name
        return cls(
            name=name,
            accepted_names=frozenset({name, engine.model_name}),
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
            tokenizer=engine.tokenizer,
            grammar=getattr(engine, "grammar", None),
            quantization=str(getattr(engine, "quantization", "none")),
        )

    def check(self, requested: str | None) -> None:
        """Raises ModelNotFoundError unless ``requested`` is None or one of our names."""
        if requested is not None and requested not in self.accepted_names:
            shown = requested.encode("utf-8", "backslashreplace").decode("utf-8")  # lone surrogates escaped
            raise ModelNotFoundError(f"the model {shown!r} does not exist; this server serves '{self.name}'", "model")

    def require_tokenizer(self, param: str) -> Any:
        """The tokenizer.

        Raises:
            InvalidRequestError: the model has none (naming ``param``, the field that needs it).
        """
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send prompts as token ids", param)
        return self.tokenizer

    def check_token_ids(self, token_ids: Sequence[int], param: str) -> None:
        """Raises InvalidRequestError (naming ``param``) unless every id is in the vocabulary."""
        try:
            check_token_ids(token_ids, self.vocab_size, param)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param) from exc
