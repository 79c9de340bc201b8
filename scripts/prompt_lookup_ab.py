"""Prompt lookup's gain, measured in one process: engines with and without it, requests interleaved.

Builds an autoregressive engine, an adaptive DFlash 2 engine without prompt lookup, one per
``--lookup MAX,MIN`` pair, and the default lookup (4 … 2) with drafts from earlier outputs added
(``--suffix-decoding-max-cached-requests 256``, ``dflash2/spec/suffix.py``), all compiled, batch 1,
greedy; then decodes every prompt of the four prompt sets with each engine in turn and prints
milliseconds per token and the speed-up over the autoregressive engine, per set and overall.
Interleaving puts a slow stretch of the host on every engine alike; ``dflash2 bench`` measures the
same rows in separate processes.

    .venv/bin/python scripts/prompt_lookup_ab.py --data data/smollm2-135m --lookup 4,2 4,3
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from dflash2 import LLM, SamplingParams
from dflash2.bench.workload import render_chat
from dflash2.train.evaluate import load_prompt_sets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=None, help="a `dflash2 data` folder (for the held-out set)")
    parser.add_argument("--num-prompts", type=int, default=4, help="prompts per set (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per request (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    parser.add_argument("--lookup", nargs="+", default=["4,2"], help="MAX,MIN pairs to measure (default: 4,2)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    no_suffix = {"suffix_decoding_max_cached_requests": 0}
    configs: dict[str, dict] = {"ar": {"block_size": 1}, "no lookup": {"prompt_lookup_max": 0, **no_suffix}}
    for pair in args.lookup:
        longest, shortest = (int(n) for n in pair.split(","))
        configs[f"lookup {longest}…{shortest}"] = {
            "prompt_lookup_max": longest,
            "prompt_lookup_min": shortest,
            **no_suffix,
        }
    configs["lookup 4…2 + earlier outputs"] = {"suffix_decoding_max_cached_requests": 256}
    common = {"max_num_seqs": 1, "max_model_len": 2048, "num_threads": args.threads, "adaptive_threads": False}
    engines = {name: LLM(**common, **config) for name, config in configs.items()}
    tokenizer = engines["ar"].engine.tokenizer
    sets = load_prompt_sets(args.data, args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for llm in engines.values():  # warm-up
        llm.generate(render_chat(tokenizer, next(iter(sets.values()))[0]), params)

    seconds = {name: {s: 0.0 for s in sets} for name in engines}
    tokens = {name: {s: 0 for s in sets} for name in engines}
    for set_name, conversations in sets.items():
        for messages in conversations:
            prompt = list(tokenizer.encode(render_chat(tokenizer, messages)))
            for name, llm in engines.items():
                start = time.perf_counter()
                completion = llm.generate(prompt, params)[0]
                seconds[name][set_name] += time.perf_counter() - start
                tokens[name][set_name] += len(completion.token_ids or [])

    def ms_per_token(name: str, set_names: list[str]) -> float:
        return 1000 * sum(seconds[name][s] for s in set_names) / sum(tokens[name][s] for s in set_names)

    for scope in [*([s] for s in sets), list(sets)]:
        label = scope[0] if len(scope) == 1 else "all"
        ar = ms_per_token("ar", scope)
        times = {name: ms_per_token(name, scope) for name in engines}
        cells = [f"{name} {ms:.2f} ms ({ar / ms:.2f}×)" for name, ms in times.items()]
        print(f"{label:10s} " + " | ".join(cells))


if __name__ == "__main__":
    main()
