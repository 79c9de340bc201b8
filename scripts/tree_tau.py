"""Acceptance length τ of fixed chains and token trees on the bench prompt sets (docs/engine.md, "Token trees").

Greedy decoding is lossless, so every configuration commits the same tokens and only τ (tokens per
verify step, bonus included) differs: no timing, so the result does not depend on the machine's load.
Fixed blocks of 8, adaptive policy and prompt lookup off, SmolLM2 + its shipped drafter in bfloat16.

    .venv/bin/python scripts/tree_tau.py --data data/smollm2-135m --num-prompts 8 --configs 1:8 4:16
    .venv/bin/python scripts/tree_tau.py --data data/smollm2-135m --configs 4:16 --no-calibration
    .venv/bin/python scripts/tree_tau.py --data data/smollm2-135m --configs 4:16 --depth-penalty 0

A configuration ``K:N`` is ``--speculative-topk K --speculative-num-draft-tokens N`` (``1:8`` = the chain).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dflash2 import LLM, SamplingParams
from dflash2.bench.workload import render_chat
from dflash2.spec import tree
from dflash2.spec.tree import TreeCalibration
from dflash2.train.evaluate import load_prompt_sets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=None, help="a `dflash2 data` folder (adds the held-out set)")
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts per set")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--configs", nargs="+", default=["1:8", "4:16"], help="K:N pairs")
    parser.add_argument("--no-calibration", action="store_true", help="trees from the drafter's own probabilities")
    parser.add_argument(
        "--depth-penalty",
        type=float,
        default=tree.DEPTH_PENALTY,
        help="nats off each tree level's score (default: %(default)s, dflash2.spec.tree.DEPTH_PENALTY)",
    )
    args = parser.parse_args()
    tree.DEPTH_PENALTY = args.depth_penalty  # build_trees reads the module's value at every call
    sets = load_prompt_sets(args.data, args.num_prompts)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    for config in args.configs:
        topk, nodes = map(int, config.split(":"))
        llm = LLM(
            block_size=8,
            dtype="bfloat16",
            max_num_seqs=1,
            max_model_len=2048,
            speculative_adaptive=False,
            prompt_lookup_max=0,
            speculative_topk=topk,
            speculative_num_draft_tokens=nodes if topk > 1 else None,
        )
        if args.no_calibration:  # a prior so heavy that every offset stays 0
            llm.engine.policy.tree_calibration = TreeCalibration(7, prior_weight=1e12)
        tokenizer = llm.engine.tokenizer
        per_set = {}
        for name, conversations in sets.items():
            committed = steps = 0
            for messages in conversations:
                completion = llm.generate([list(tokenizer.encode(render_chat(tokenizer, messages)))], params)[0]
                committed += completion.num_accepted_tokens + completion.num_verify_steps
                steps += completion.num_verify_steps
            per_set[name] = committed / steps
        mean = sum(per_set.values()) / len(per_set)
        print(f"{config:>6s}  τ {mean:.3f}  " + "  ".join(f"{k} {v:.3f}" for k, v in per_set.items()), flush=True)
        llm.engine.close()


if __name__ == "__main__":
    main()
