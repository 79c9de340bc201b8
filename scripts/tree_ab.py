"""Token trees against chains under the adaptive policy, measured in one process with requests interleaved.

Builds an autoregressive engine, the default engine (adaptive chains + prompt lookup) and one adaptive
engine with token trees per ``--trees K:N`` (prompt lookup on: its drafts alone, or as a branch of the
tree), all compiled, batch 1, greedy; decodes every prompt of the four prompt sets with each engine in
turn and prints, per set and overall, milliseconds per token, the speed-up over the autoregressive
engine and over the default, τ, and the mix of steps each engine chose (no draft / chain / tree /
lookup alone). Interleaving puts a slow stretch of the host on every engine alike.

    .venv/bin/python scripts/tree_ab.py --data data/smollm2-135m --trees 4:16 --rounds 2
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections import Counter
from functools import partial
from pathlib import Path

from dflash2 import LLM, SamplingParams
from dflash2.bench.workload import render_chat
from dflash2.outputs import StepResult, StepStats
from dflash2.train.evaluate import load_prompt_sets


def step_kind(stats: StepStats) -> str:
    """What a decode step verified: nothing drafted, a chain, token trees or prompt-lookup drafts alone."""
    if stats.num_tree_nodes:
        return "tree"
    if stats.num_lookup_drafts:
        return "lookup"
    return "chain" if stats.verify_width > 1 else "none"


def _record(into: list[StepStats], result: StepResult) -> None:
    into.append(result.stats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=None, help="a `dflash2 data` folder (for the held-out set)")
    parser.add_argument("--num-prompts", type=int, default=2, help="prompts per set (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per request (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    parser.add_argument("--trees", nargs="+", default=["4:16"], help="K:N pairs to measure (default: 4:16)")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the prompts (default: %(default)s)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    configs: dict[str, dict] = {"ar": {"block_size": 1}, "default": {}}
    for pair in args.trees:
        topk, nodes = (int(n) for n in pair.split(":"))
        configs[f"trees {topk}:{nodes}"] = {"speculative_topk": topk, "speculative_num_draft_tokens": nodes}
    common = {"max_num_seqs": 1, "max_model_len": 2048, "num_threads": args.threads, "adaptive_threads": False}
    engines = {name: LLM(**common, **config) for name, config in configs.items()}
    tokenizer = engines["ar"].engine.tokenizer
    assert tokenizer is not None
    sets = load_prompt_sets(args.data, args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for llm in engines.values():  # warm-up
        llm.generate(render_chat(tokenizer, next(iter(sets.values()))[0]), params)

    # per engine and set: seconds per round (the median is reported), tokens, verify steps, step kinds
    seconds = {name: {s: [0.0] * args.rounds for s in sets} for name in engines}
    tokens: dict[str, Counter[str]] = {name: Counter() for name in engines}
    accepted: dict[str, Counter[str]] = {name: Counter() for name in engines}
    steps: dict[str, Counter[str]] = {name: Counter() for name in engines}
    kinds: dict[str, dict[str, Counter[str]]] = {name: {s: Counter() for s in sets} for name in engines}
    for round_index in range(args.rounds):
        for set_name, conversations in sets.items():
            for messages in conversations:
                prompt = list(tokenizer.encode(render_chat(tokenizer, messages)))
                for name, llm in engines.items():
                    taken: list[StepStats] = []
                    start = time.perf_counter()
                    completion = llm.generate(prompt, params, on_step=partial(_record, taken))[0]
                    seconds[name][set_name][round_index] += time.perf_counter() - start
                    if round_index == 0:
                        tokens[name][set_name] += len(completion.token_ids or [])
                        accepted[name][set_name] += completion.num_accepted_tokens
                        steps[name][set_name] += completion.num_verify_steps
                        kinds[name][set_name].update(step_kind(s) for s in taken if s.num_decode_rows)

    def ms_per_token(name: str, scope: list[str]) -> float:
        total = sum(statistics.median(seconds[name][s]) for s in scope)
        return 1000 * total / sum(tokens[name][s] for s in scope)

    for scope in [*([s] for s in sets), list(sets)]:
        label = scope[0] if len(scope) == 1 else "all"
        ar, default = ms_per_token("ar", scope), ms_per_token("default", scope)
        print(f"== {label}")
        for name in engines:
            ms = ms_per_token(name, scope)
            verify_steps = sum(steps[name][s] for s in scope)
            tau = (sum(accepted[name][s] for s in scope) + verify_steps) / max(1, verify_steps)
            mix: Counter[str] = sum((kinds[name][s] for s in scope), Counter())
            total = max(1, sum(mix.values()))
            shares = " ".join(f"{k} {100 * mix[k] / total:.0f}%" for k in ("none", "chain", "tree", "lookup"))
            print(
                f"  {name:12s} {ms:6.2f} ms/token  {ar / ms:.2f}× AR  {default / ms:.2f}× default  "
                f"τ {tau:.2f}  steps: {shares}"
            )


if __name__ == "__main__":
    main()
