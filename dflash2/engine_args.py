"""The engine's command-line flags, shared by ``dflash2`` (cli) and ``python -m server``.

Flag names follow vLLM / SGLang where they exist; each flag's destination is the name of the
``EngineConfig`` field it sets, and its default comes from ``EngineConfig``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from dflash2.config import (
    DEFAULT_PROMPT_LOOKUP_MAX,
    DEFAULT_PROMPT_LOOKUP_MIN,
    DEFAULT_SUFFIX_MAX_CACHED_TOKENS,
    DRAFT_QUANTIZATION_CHOICES,
    DTYPES,
    MAX_PROMPT_LOOKUP_N,
    QUANTIZATION_CHOICES,
    SUGGESTED_SUFFIX_MAX_CACHED_REQUESTS,
    EngineConfig,
)

_DEFAULTS = EngineConfig()


LOG_LEVEL_HELP = "DEBUG, INFO, WARNING, … (default: $DFLASH2_LOG_LEVEL or WARNING)"


def default_log_level() -> str:
    """The log level when ``--log-level`` is not given: ``$DFLASH2_LOG_LEVEL`` or WARNING."""
    return os.environ.get("DFLASH2_LOG_LEVEL", "WARNING")


# Engine flags a subcommand does not use, by destination name: they are not offered there, so a
# mistaken one (``train --block-size`` for ``--train-block-size``) is an error, not ignored.
# Flags only an engine that decodes requests reads (training and evaluation run no engine).
_DECODING_FLAGS = (
    "seed",
    "tensor_parallel_size",
    "enforce_eager",
    "enable_prefix_caching",
    "speculative_adaptive",
    "deterministic",
    "adaptive_threads",
)
_DRAFTER_FLAGS = (
    "drafter",
    "speculative_draft_quantization",
    "block_size",
    "use_selector",
    "speculative_draft_vocab_size",
    "speculative_num_draft_tokens",
    "speculative_topk",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "grammar_forced_drafts",
    "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_cached_tokens",
)
UNUSED_ENGINE_FLAGS = {
    "data": (*_DRAFTER_FLAGS, "seed", "enable_prefix_caching", "speculative_adaptive"),
    "train": (*_DRAFTER_FLAGS, "max_num_seqs", "max_model_len", "quantization", *_DECODING_FLAGS),
    # eval measures the drafter over full blocks: no adaptive policy, so no prompt lookup either.
    "eval": (
        "block_size",
        "speculative_num_draft_tokens",
        "speculative_topk",
        "max_model_len",
        "prompt_lookup_max",
        "prompt_lookup_min",
        "grammar_forced_drafts",
        "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_cached_tokens",
        "quantization",
        "speculative_draft_quantization",
        *_DECODING_FLAGS,
    ),
}


def add_engine_args(parser: argparse.ArgumentParser, omit: Sequence[str] = ()) -> None:
    """Model and engine flags (names follow SGLang / vLLM where they exist), less ``omit`` (dest names)."""
    g = _FilteredGroup(parser.add_argument_group("model and engine"), omit)
    g.add_argument(
        "--model",
        default=_DEFAULTS.model,
        help="target: local Hugging Face folder, .gguf file or hub id (default: embedded SmolLM2-135M-Instruct)",
    )
    g.add_argument(
        "--speculative-draft-model-path",
        "--drafter",
        dest="drafter",
        default=_DEFAULTS.drafter,
        help="DFlash / DFlash 2 drafter folder (config.json + model.safetensors)",
    )
    g.add_argument(
        "--block-size",
        dest="block_size",
        type=int,
        default=_DEFAULTS.block_size,
        help="block size B, anchor included: the drafter's block and the deepest path verified "
        "(1 = autoregressive; default: the drafter's)",
    )
    g.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=_DEFAULTS.speculative_num_draft_tokens,
        metavar="N",
        help="tokens verified per row, anchor included: a chain's block size (alone it sets --block-size), "
        "a token tree's node budget (default: B for a chain, 2·B − 1 for a tree)",
    )
    g.add_argument(
        "--speculative-topk",
        "--speculative-eagle-topk",
        dest="speculative_topk",
        type=int,
        default=_DEFAULTS.speculative_topk,
        metavar="K",
        help="token trees: the drafter's K best continuations kept per depth through the selector lattice, "
        "verified in one forward (default: 1, one path)",
    )
    g.add_argument(
        "--no-selector",
        dest="use_selector",
        action="store_false",
        help="draft with unary scores only (DFlash 2 selector off)",
    )
    g.add_argument(
        "--speculative-draft-vocab-size",
        type=int,
        default=_DEFAULTS.speculative_draft_vocab_size,
        metavar="N",
        help="draft over only the drafter's N most frequent tokens (a smaller draft LM head: faster drafting "
        "on CPUs; output unchanged; default: the drafter's own draft vocabulary)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=_DEFAULTS.max_num_seqs,
        help="requests decoded together (default: %(default)s)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=_DEFAULTS.max_model_len,
        help="prompt + output tokens per request (default: the model's limit, lowered if the KV cache would "
        "not fit in half of the free memory)",
    )
    g.add_argument("--device", default=_DEFAULTS.device, help="auto, cpu, cuda, cuda:1, …")
    g.add_argument(
        "--dtype",
        default=_DEFAULTS.dtype,
        choices=["auto", *DTYPES],
        help="weights and activations (auto: bfloat16 on CUDA, on CPUs with AVX512-BF16/AMX and on AVX2 CPUs "
        "where the project's bfloat16 kernel builds; else float32)",
    )
    g.add_argument(
        "--quantization",
        "-q",
        default=_DEFAULTS.quantization,
        choices=list(QUANTIZATION_CHOICES),
        help="weight-only quantized linears: gguf keeps a .gguf target's own quantized tensors (Q4_0, Q4_1, Q5_0, "
        "Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), int8/int4 quantize a float checkpoint at load (round to nearest, groups "
        "of 32), none keeps dense weights (default auto: gguf for a .gguf file given with --model on a CPU where the "
        "kernel runs; else none, the embedded model included: its dense copy runs the speculative default faster)",
    )
    g.add_argument(
        "--speculative-draft-quantization",
        default=_DEFAULTS.speculative_draft_quantization,
        choices=list(DRAFT_QUANTIZATION_CHOICES),
        help="the drafter's own linears: none, int8 or int4 (round to nearest; default: %(default)s)",
    )
    g.add_argument("--seed", type=int, default=_DEFAULTS.seed, help="seed for requests that give none")
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        default=_DEFAULTS.enforce_eager,
        help="run every forward eagerly (default: compiled decode and draft forwards, cached between runs)",
    )
    g.add_argument(
        "--speculative-adaptive",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.speculative_adaptive,
        help="choose each step's drafts per row from live acceptance and the measured step cost "
        "(--no-speculative-adaptive: always the full block; default: on)",
    )
    g.add_argument(
        "--prompt-lookup-max",
        type=int,
        default=_DEFAULTS.prompt_lookup_max,
        metavar="N",
        help="prompt lookup beside the drafter: a step may verify the tokens that followed the latest earlier "
        "occurrence of a row's last N … --prompt-lookup-min tokens instead of drafting, when the adaptive policy "
        f"predicts it faster (default: {DEFAULT_PROMPT_LOOKUP_MAX} with adaptive speculation, else off; 0: off; "
        f"at most {MAX_PROMPT_LOOKUP_N})",
    )
    g.add_argument(
        "--prompt-lookup-min",
        type=int,
        default=_DEFAULTS.prompt_lookup_min,
        metavar="N",
        help=f"the shortest n-gram prompt lookup matches (default: {DEFAULT_PROMPT_LOOKUP_MIN}; "
        f"alone, it raises --prompt-lookup-max to at least N)",
    )
    g.add_argument(
        "--grammar-forced-drafts",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.grammar_forced_drafts,
        help="where a request's grammar (tools, response_format) forces the next tokens, verify them as drafts "
        "at no drafter cost (default: on)",
    )
    g.add_argument(
        "--suffix-decoding-max-cached-requests",
        type=int,
        default=_DEFAULTS.suffix_decoding_max_cached_requests,
        metavar="N",
        help="drafts from earlier outputs (suffix decoding): keep the outputs of the last N finished requests, from "
        "which any request's last tokens retrieve a continuation, priced beside prompt lookup by the adaptive "
        f"policy; needs adaptive speculation (default: 0, off; {SUGGESTED_SUFFIX_MAX_CACHED_REQUESTS} is a good "
        "start where requests repeat each other's outputs)",
    )
    g.add_argument(
        "--suffix-decoding-max-cached-tokens",
        type=int,
        default=_DEFAULTS.suffix_decoding_max_cached_tokens,
        metavar="N",
        help="the most tokens the earlier-output index holds in all, oldest outputs dropped first "
        f"(default: {DEFAULT_SUFFIX_MAX_CACHED_TOKENS})",
    )
    g.add_argument(
        "--deterministic",
        "--enable-deterministic-inference",
        dest="deterministic",
        action="store_true",
        default=_DEFAULTS.deterministic,
        help="batch-invariant forwards: a seeded request gives the same text alone or in any batch, and greedy "
        "speculative output equals greedy autoregressive output, in bfloat16 too (CPU, eager; costs speed)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        dest="tensor_parallel_size",
        type=int,
        default=_DEFAULTS.tensor_parallel_size,
        metavar="N",
        help="split the target over N ranks (one GPU each on CUDA; gloo processes on CPU): this process runs "
        "the scheduler and rank 0, N - 1 workers the rest (default: 1)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.enable_prefix_caching,
        help="reuse the KV cache of a prompt prefix computed before (agent loops, shared system prompts); "
        "--no-enable-prefix-caching turns it off (default: on)",
    )
    g.add_argument(
        "--threads",
        dest="num_threads",
        type=int,
        default=_DEFAULTS.num_threads,
        help="torch CPU threads, the most the engine uses (default: the CPUs this process may use: its affinity "
        "and a cgroup CPU limit)",
    )
    g.add_argument(
        "--adaptive-threads",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.adaptive_threads,
        help="CPU: run with fewer threads while other processes keep the cores busy and timed steps show that "
        "is faster, back to --threads when the cores free up (off in --deterministic mode); "
        "--no-adaptive-threads keeps --threads fixed (default: %(default)s)",
    )


class _FilteredGroup:
    """An argument group that skips the arguments whose destination is in ``omit``."""

    def __init__(self, group: Any, omit: Sequence[str]) -> None:
        self.group, self.omit = group, set(omit)

    def add_argument(self, *names: str, **kwargs: Any) -> None:
        dest = kwargs.get("dest") or names[0].lstrip("-").replace("-", "_")
        if dest not in self.omit:
            self.group.add_argument(*names, **kwargs)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the frozen ``EngineConfig`` from parsed flags: every field of ``EngineConfig`` whose
    flag the parser has (a flag's destination is the field's name), defaults for the rest."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    return EngineConfig(**given)
