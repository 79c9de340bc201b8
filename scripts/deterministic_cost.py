"""What ``--deterministic`` costs (docs/engine.md, "Deterministic mode").

Runs the embedded SmolLM2 with its shipped drafter in bfloat16 at block 1 (autoregressive) and
block 8 (full blocks), in three engine configurations: eager, eager + deterministic, and compiled.
Four chat prompts × ``--max-tokens`` greedy tokens, one at a time (batch 1) and all together
(batch 4); the configurations are interleaved round by round, the first round warms up, and the
median of the others is printed in tok/s.

    .venv/bin/python scripts/deterministic_cost.py [--threads 2] [--max-tokens 96] [--rounds 4]
    .venv/bin/python scripts/deterministic_cost.py --cpu-kernels onednn avx512bf16   # eager only, per path
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from dflash2 import LLM, SamplingParams

QUESTIONS = [
    "Write a short poem about the sea.",
    "What is 17 times 23? Explain step by step.",
    "Explain what a hash table is.",
    "Why is the sky blue?",
]
CONFIGS = {
    "eager": {"enforce_eager": True},
    "eager + deterministic": {"enforce_eager": True, "deterministic": True},
    "compiled": {"enforce_eager": False},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=4, help="rounds; the first one warms up")
    parser.add_argument(
        "--cpu-kernels",
        nargs="+",
        default=None,
        help="instead: the two eager configurations on each of these linear paths (DFLASH2_CPU_KERNEL values)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    configs: dict[str, tuple[str | None, dict[str, bool]]]
    if args.cpu_kernels:  # the eager configurations only, once per linear path
        eager = [name for name, extra in CONFIGS.items() if extra["enforce_eager"]]
        configs = {f"{kernel}: {name}": (kernel, CONFIGS[name]) for kernel in args.cpu_kernels for name in eager}
    else:
        configs = {name: (None, extra) for name, extra in CONFIGS.items()}
    llms = {}
    for name, (kernel, extra) in configs.items():
        if kernel:  # read when the engine packs its linears
            os.environ["DFLASH2_CPU_KERNEL"] = kernel
        for block in (1, 8):
            llms[name, block] = LLM(
                block_size=block,
                max_num_seqs=4,
                max_model_len=2048,
                dtype="bfloat16",
                speculative_adaptive=False,
                enable_prefix_caching=False,
                **extra,
            )
    tokenizer = next(iter(llms.values())).engine.tokenizer
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in QUESTIONS
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rates: dict[tuple[str, int, int], list[float]] = {}
    for round_index in range(args.rounds):
        for (name, block), llm in llms.items():
            for batch in (1, 4):
                start = time.perf_counter()
                if batch == 1:
                    tokens = sum(len(llm.generate([p], params)[0].token_ids) for p in prompts)
                else:
                    tokens = sum(len(c.token_ids) for c in llm.generate(prompts, params))
                if round_index > 0:
                    rates.setdefault((name, block, batch), []).append(tokens / (time.perf_counter() - start))
    print(f"{'configuration':36s} {'block':>5s} {'batch':>5s} {'tok/s':>8s}")
    for (name, block, batch), values in rates.items():
        print(f"{name:36s} {block:5d} {batch:5d} {statistics.median(values):8.1f}")


if __name__ == "__main__":
    main()
