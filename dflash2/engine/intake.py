"""A new request checked against the loaded model and built with its per-request state (generator,
detokenizer, grammar matcher)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import torch

from dflash2.config import EngineSpec
from dflash2.engine.request import Request
from dflash2.errors import ContextLengthExceededError
from dflash2.grammar import GrammarBackend
from dflash2.sampling import SamplingParams, check_token_ids


def new_request(
    spec: EngineSpec,
    tokenizer: Any | None,
    grammar: GrammarBackend | None,
    prompt: str | Sequence[int],
    params: SamplingParams,
    request_id: str | None,
    seed_source: torch.Generator,
) -> Request:
    """Validate a request and build it (not yet queued).

    Args:
        spec: the engine's resolved settings; tokenizer: None when the engine has none;
        grammar: compiles ``params.grammar``; prompt: text or token ids; params: its sampling;
        request_id: None for a fresh one; seed_source: seeds requests without their own seed.

    Raises:
        ValueError: empty prompt, token ids outside the vocabulary (prompt, logit bias, stop ids),
            top_k above the vocabulary size, stop strings or a grammar without a tokenizer, text without
            a tokenizer.
        dflash2.grammar.GrammarError: a grammar that does not compile (a ValueError).
        ContextLengthExceededError: prompt + max_tokens > max_model_len.
    """
    prompt_ids = encode(tokenizer, prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    check_token_ids(prompt_ids, spec.vocab_size, "prompt")
    params.check_vocabulary(spec.vocab_size)
    if (params.stop or params.repeat_marker) and tokenizer is None:
        raise ValueError("stop strings need a tokenizer")
    if params.grammar is not None and grammar is None:
        raise ValueError("grammar: structured outputs need a tokenizer")
    matcher = grammar.matcher(params.grammar) if grammar is not None and params.grammar is not None else None
    if len(prompt_ids) + params.max_tokens > spec.max_model_len:
        raise ContextLengthExceededError(
            f"this model's maximum context length is {spec.max_model_len} tokens; the prompt has "
            f"{len(prompt_ids)} tokens and max_tokens is {params.max_tokens}"
        )
    seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=seed_source))
    return Request(
        request_id=request_id or uuid.uuid4().hex,
        prompt_ids=prompt_ids,
        params=params,
        generator=torch.Generator().manual_seed(seed),
        detokenizer=_detokenizer(tokenizer, prompt_ids, params),
        matcher=matcher,
    )


def encode(tokenizer: Any | None, text: str) -> list[int]:
    """Tokenize a prompt (no special tokens added beyond what the tokenizer adds by default).

    Raises:
        ValueError: when there is no tokenizer.
    """
    if tokenizer is None:
        raise ValueError("this engine has no tokenizer: pass token ids")
    return list(tokenizer.encode(text))


def _detokenizer(tokenizer: Any | None, prompt_ids: list[int], params: SamplingParams) -> Any:
    if tokenizer is None:
        return None
    from dflash2.detokenize import IncrementalDetokenizer

    return IncrementalDetokenizer(
        tokenizer,
        prompt_ids,
        stop=params.stop,
        skip_special_tokens=params.skip_special_tokens,
        include_stop_str_in_output=params.include_stop_str_in_output,
        repeat_marker=params.repeat_marker,
    )
