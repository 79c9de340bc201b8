"""What a seed costs: the same chat prompts sampled with and without a seed, interleaved in one engine.

A seeded request verifies the drafter's full block on every step (its text must not depend on the
adaptive policy's timings) and never takes prompt-lookup drafts; on a multi-core CPU its steps also run
at the configured thread count whatever the load. This script measures the first two, the ones that
cost on idle cores: seconds per output token of seeded against unseeded requests (T = 0.8).

    .venv/bin/python scripts/seeded_cost.py --rounds 3 --threads 1 [--enforce-eager]
"""

from __future__ import annotations

import argparse
import statistics
import time

from dflash2 import LLM, SamplingParams

PROMPTS = [
    "Give me a JSON object about cats.",
    "Explain what a binary search does.",
    "Write a short story about a robot learning to paint.",
    "List five facts about the Moon.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()
    llm = LLM(num_threads=args.threads, enforce_eager=args.enforce_eager)
    tokenizer = llm.engine.tokenizer
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in PROMPTS
    ]
    per_token: dict[str, list[float]] = {"unseeded": [], "seeded": []}
    widths: dict[str, list[int]] = {"unseeded": [], "seeded": []}
    for round_index in range(args.rounds + 1):  # round 0 warms up
        for i, prompt in enumerate(prompts):
            for kind in ("unseeded", "seeded"):
                seed = 1000 * round_index + i if kind == "seeded" else None
                params = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=seed, ignore_eos=True)
                steps: list[int] = []
                start = time.perf_counter()
                (completion,) = llm.generate(
                    prompt,
                    params,
                    on_step=lambda r, steps=steps: (
                        steps.append(r.stats.verify_width) if r.stats.num_decode_rows else None
                    ),
                )
                seconds = time.perf_counter() - start
                if round_index:
                    per_token[kind].append(seconds / len(completion.token_ids))
                    widths[kind] += steps
    for kind in ("unseeded", "seeded"):
        ms = 1000 * statistics.median(per_token[kind])
        mean_width = statistics.fmean(widths[kind])
        print(f"{kind:9s} {ms:6.2f} ms/token ({1000 / ms:5.1f} tok/s), mean verify width {mean_width:.2f}")
    ratio = statistics.median(per_token["seeded"]) / statistics.median(per_token["unseeded"])
    print(f"seeded / unseeded time per token: {ratio:.3f}")


if __name__ == "__main__":
    main()
