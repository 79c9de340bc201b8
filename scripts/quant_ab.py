"""Decode speed of the embedded model (or ``--model``) with each ``--quantization``, through the ``LLM`` API:
compiled forwards, batch 1, T = 0, fixed threads, a few prompts; one process per setting, run one after the
other (``--rounds`` alternates them), so compare ratios within one invocation.

    .venv/bin/python scripts/quant_ab.py --quantization none gguf --block-size 1 default --rounds 2

prints, per setting, the median output tok/s over the prompts (first request of each process is a warm-up)
and the acceptance length of the last request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

PROMPTS = [
    "Explain what a binary search does.",
    "Write a Python function that reverses a list.",
    "What is the capital of France? Answer in one paragraph.",
    "def fibonacci(n):",
]


def measure(quantization: str, block_size: str, model: str | None, max_tokens: int, threads: int) -> dict:
    """One setting, in this process."""
    from dflash2 import LLM, SamplingParams

    kwargs = dict(
        model=model,
        quantization=quantization,
        num_threads=threads,
        max_num_seqs=1,
        max_model_len=1024,
        adaptive_threads=False,
    )
    if block_size != "default":
        kwargs["block_size"] = int(block_size)
    start = time.perf_counter()
    llm = LLM(**kwargs)
    load = time.perf_counter() - start
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(PROMPTS[:1], params)
    rates, tau = [], 0.0
    for prompt in PROMPTS * 2:
        start = time.perf_counter()
        out = llm.generate([prompt], params)[0]
        rates.append(len(out.token_ids) / (time.perf_counter() - start))
        tau = out.mean_acceptance_length
    return {"tok_s": statistics.median(rates), "tau": tau, "load_s": load, "quantization": llm.engine.quantization}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", nargs="+", default=["none", "gguf"])
    parser.add_argument("--block-size", nargs="+", default=["1", "default"], help="1, default, or a B")
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--one", nargs=2, metavar=("Q", "B"), help=argparse.SUPPRESS)  # child process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], args.one[1], args.model, args.max_tokens, args.threads)))
        return
    settings = [(q, b) for b in args.block_size for q in args.quantization]
    for round_index in range(args.rounds):
        order = settings if round_index % 2 == 0 else settings[::-1]
        for q, b in order:
            command = [sys.executable, __file__, "--one", q, b, "--max-tokens", str(args.max_tokens)]
            command += ["--threads", str(args.threads)] + (["--model", args.model] if args.model else [])
            line = subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            result = json.loads(line)
            print(
                f"round {round_index + 1}: --quantization {q} ({result['quantization']}), block size {b}: "
                f"{result['tok_s']:.1f} tok/s, τ {result['tau']:.2f} (load {result['load_s']:.0f} s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
