"""Token-tree builders compared offline, on the drafter lattices recorded at every position of greedy decodes.

``record`` decodes the bench prompt sets greedily with SmolLM2 and its shipped drafter (bf16, block 8), but
makes every tree step verify the anchor alone: each step commits exactly the target's next token, and the
drafter's lattice (``candidate_ids [J, k]``, ``log_probs [J, k, k]``) is saved at every position. Greedy
decoding is lossless and the drafter's context comes from committed tokens only, so the lattice saved at a
position is the one a real run sees when its anchor sits there. ``evaluate`` then replays decoding for any
tree configuration: at position p the tree is built from p's lattice, the accepted length a is the longest
root path equal to the recorded continuation, and decoding moves to p + a + 1; τ = committed tokens ÷ steps
(per set, then the mean over sets, as ``scripts/tree_tau.py`` reports it). Seconds per configuration, no
timing involved (docs/engine.md, "Token trees": replayed τ is within 0.01 of the engine's).

    .venv/bin/python scripts/tree_offline.py record --data data/smollm2-135m --num-prompts 8 --out runs/lattices.pt
    .venv/bin/python scripts/tree_offline.py evaluate runs/lattices.pt --configs 1:8 4:8 4:16 --depth-penalty 0 0.5

A configuration ``K:N`` is ``--speculative-topk K --speculative-num-draft-tokens N`` (``1:8`` = the chain);
trees are calibrated online in replay order as the engine calibrates them (``TreeCalibration``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from dflash2.spec import tree as tree_module
from dflash2.spec.tree import TokenTree, TreeCalibration, build_trees

BLOCK_SIZE = 8


def record(data: Path | None, num_prompts: int, max_tokens: int, out: Path) -> None:
    """Decode every prompt of the bench sets with root-only trees, saving each step's lattice."""
    from dflash2 import LLM, SamplingParams
    from dflash2.bench.workload import render_chat
    from dflash2.engine import executor
    from dflash2.train.evaluate import load_prompt_sets

    steps: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []

    def root_only(
        candidate_ids: torch.Tensor,
        log_probs: torch.Tensor,
        anchor_ids: list[int],
        topk: int,
        num_nodes: list[int],
        max_depths: list[int],
        offsets: torch.Tensor | None = None,
    ) -> list[TokenTree]:
        for row, anchor in enumerate(anchor_ids):
            steps.append(
                (int(anchor), int(max_depths[row]), candidate_ids[row].cpu().clone(), log_probs[row].float().cpu())
            )
        return [TokenTree([int(a)], [-1], [0.0]) for a in anchor_ids]

    executor.build_trees = root_only
    llm = LLM(
        block_size=BLOCK_SIZE,
        dtype="bfloat16",
        max_num_seqs=1,
        max_model_len=2048,
        speculative_adaptive=False,
        prompt_lookup_max=0,
        speculative_topk=2,
    )
    tokenizer = llm.engine.tokenizer
    assert tokenizer is not None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    recorded: dict[str, list[dict[str, Any]]] = {}
    for name, conversations in load_prompt_sets(data, num_prompts).items():
        recorded[name] = []
        for messages in conversations:
            steps.clear()
            completion = llm.generate([list(tokenizer.encode(render_chat(tokenizer, messages)))], params)[0]
            recorded[name].append({"tokens": list(completion.token_ids or []), "steps": list(steps)})
        print(f"{name}: {len(recorded[name])} prompts, {sum(len(p['steps']) for p in recorded[name])} lattices")
    llm.engine.close()
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(recorded, out)
    print(f"wrote {out}")


def replay(recorded: dict[str, list[dict[str, Any]]], topk: int, nodes: int) -> dict[str, float]:
    """τ per set (and ``mean``) of decoding with ``topk`` branches and ``nodes`` drafted nodes per tree."""
    calibration = TreeCalibration(BLOCK_SIZE - 1)
    result = {}
    for name, prompts in recorded.items():
        committed = num_steps = 0
        for prompt in prompts:
            tokens, steps = prompt["tokens"], prompt["steps"]
            position = 0
            while position < len(steps):
                anchor, depth, candidate_ids, log_probs = steps[position]
                offsets = calibration.offsets()[None] if topk > 1 else None
                tree = build_trees(candidate_ids[None], log_probs[None], [anchor], topk, [nodes], [depth], offsets)[0]
                accepted = tree.follow(tokens[position + 1 : position + 1 + depth])  # a greedy row's nodes
                if topk > 1:
                    calibration.observe(tree, accepted)
                num_steps += 1
                committed += len(accepted) + 1
                position += len(accepted) + 1
        result[name] = committed / max(num_steps, 1)
    result["mean"] = sum(result.values()) / len(result)
    return result


def evaluate(path: Path, configs: list[str], penalties: list[float]) -> None:
    """Print τ of every configuration and depth penalty, and its ratio to the chain's."""
    recorded = torch.load(path, weights_only=False)
    chain = replay(recorded, 1, BLOCK_SIZE - 1)["mean"]
    for config in configs:
        topk, tokens = (int(n) for n in config.split(":"))
        for penalty in penalties if topk > 1 else [0.0]:
            tree_module.DEPTH_PENALTY = penalty  # build_trees reads the module's value at every call
            tau = replay(recorded, topk, tokens - 1)
            sets = "  ".join(f"{k} {v:.3f}" for k, v in tau.items() if k != "mean")
            label = f"{config} λ {penalty:g}" if topk > 1 else config
            print(f"{label:14s} τ {tau['mean']:.3f} ({tau['mean'] / chain:.3f}× chain)  {sets}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="decode the prompt sets and save every position's lattice")
    rec.add_argument("--data", type=Path, default=None, help="a `dflash2 data` folder (adds the held-out set)")
    rec.add_argument("--num-prompts", type=int, default=8, help="prompts per set")
    rec.add_argument("--max-tokens", type=int, default=96)
    rec.add_argument("--out", type=Path, required=True)
    ev = commands.add_parser("evaluate", help="replay decoding for tree configurations")
    ev.add_argument("lattices", type=Path, help="a file `record` wrote")
    ev.add_argument("--configs", nargs="+", default=["1:8", "4:16"], help="K:N pairs")
    ev.add_argument("--depth-penalty", nargs="+", type=float, default=[tree_module.DEPTH_PENALTY])
    args = parser.parse_args()
    if args.command == "record":
        record(args.data, args.num_prompts, args.max_tokens, args.out)
    else:
        evaluate(args.lattices, args.configs, args.depth_penalty)


if __name__ == "__main__":
    main()
