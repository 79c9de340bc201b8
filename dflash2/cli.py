"""Command line: ``dflash2 generate``.

Engine flags are shared by every subcommand and take their defaults from ``EngineConfig``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence

from dflash2.config import DTYPES, EngineConfig
from dflash2.sampling import SamplingParams

_DEFAULTS = EngineConfig()


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Model and engine flags (names follow SGLang / vLLM where they exist)."""
    g = parser.add_argument_group("model and engine")
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
        "--speculative-num-draft-tokens",
        "--block-size",
        dest="block_size",
        type=int,
        default=_DEFAULTS.block_size,
        help="block size B, anchor included (1 = autoregressive; default: the drafter's)",
    )
    g.add_argument(
        "--no-selector",
        dest="use_selector",
        action="store_false",
        help="draft with unary scores only (DFlash 2 selector off)",
    )
    g.add_argument("--max-num-seqs", type=int, default=_DEFAULTS.max_num_seqs, help="requests decoded together")
    g.add_argument(
        "--max-model-len",
        type=int,
        default=_DEFAULTS.max_model_len,
        help="prompt + output tokens per request (default: min(model limit, 2048))",
    )
    g.add_argument("--device", default=_DEFAULTS.device, help="auto, cpu, cuda, cuda:1, …")
    g.add_argument("--dtype", default=_DEFAULTS.dtype, choices=["auto", *DTYPES])
    g.add_argument("--seed", type=int, default=_DEFAULTS.seed, help="seed for requests that give none")
    g.add_argument(
        "--threads",
        dest="num_threads",
        type=int,
        default=_DEFAULTS.num_threads,
        help="torch CPU threads (default: torch's choice)",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the frozen ``EngineConfig`` from parsed flags."""
    return EngineConfig(
        model=args.model,
        drafter=args.drafter,
        block_size=args.block_size,
        use_selector=args.use_selector,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        num_threads=args.num_threads,
    )


def _generate(args: argparse.Namespace) -> int:
    from dflash2.engine import LLM, Engine

    llm = LLM.from_engine(Engine.from_config(engine_config_from_args(args)))
    tokenizer = llm.engine.tokenizer
    prompt = args.prompt
    if not args.raw and tokenizer is not None and tokenizer.chat_template:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed_request,
        stop=tuple(args.stop or ()),
    )
    start = time.perf_counter()
    first_token_at = None
    num_tokens = num_steps = num_accepted = 0
    draft_time = select_time = verify_time = 0.0
    for result in llm.stream(prompt, params):
        stats = result.stats
        draft_time, select_time, verify_time = (
            draft_time + stats.draft_time,
            select_time + stats.select_time,
            verify_time + stats.verify_time,
        )
        for out in result.outputs:
            if first_token_at is None and out.new_token_ids:
                first_token_at = time.perf_counter()
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            num_tokens, num_steps, num_accepted = (
                out.num_output_tokens,
                out.num_verify_steps,
                out.num_accepted_tokens,
            )
    elapsed = time.perf_counter() - start
    tau = (num_accepted + num_steps) / num_steps if num_steps else 0.0
    decode_time = elapsed - ((first_token_at or start) - start)
    decode_rate = (num_tokens - 1) / decode_time if num_tokens > 1 and decode_time > 0 else 0.0
    sys.stdout.write("\n")
    print(
        f"[dflash2] {num_tokens} tokens in {elapsed:.2f} s: {num_tokens / elapsed:.1f} tok/s overall, "
        f"{decode_rate:.1f} tok/s after the first token; block size {llm.engine.block_size}, "
        f"mean acceptance length {tau:.2f}; draft {draft_time * 1e3:.0f} ms, select {select_time * 1e3:.0f} ms, "
        f"verify {verify_time * 1e3:.0f} ms",
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``dflash2`` argument parser with all subcommands."""
    parser = argparse.ArgumentParser(prog="dflash2", description="DFlash 2 speculative decoding")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING, …")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt and print a speed summary")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--request-seed", dest="seed_request", type=int, default=None)
    add_engine_args(gen)
    gen.set_defaults(func=_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dflash2`` command."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except ValueError as exc:  # ModelSourceError, ModelLoadError and bad arguments
        print(f"dflash2: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
