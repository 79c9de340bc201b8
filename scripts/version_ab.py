"""The same engines from two source trees, timed with requests interleaved: does a change keep the speed?

Starts one worker process per tree (``PYTHONPATH`` set to it, so each imports its own ``dflash2``), each
building the same engines (``--configs``: the default adaptive engine with prompt lookup, a fixed chain of
the block, token trees, autoregressive decoding), compiled, batch 1. The parent then sends every prompt of
the four prompt sets to each engine of both trees in turn, ``--rounds`` times, after one warm-up pass, and
prints per engine and temperature the median milliseconds per token of each tree, their ratio, the
interquartile range of the per-request ratios, τ, and how many greedy requests decoded the same tokens in
both trees. Interleaving puts a slow stretch of the host on both trees alike.

    .venv/bin/python scripts/version_ab.py --before ../before --after . --data data/smollm2-135m --rounds 2

A worker reads one JSON request per line on stdin and answers one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CONFIGS: dict[str, dict[str, Any]] = {
    "ar": {"block_size": 1},
    "default": {},
    "chain-b8": {"block_size": 8, "speculative_adaptive": False},
    "tree-4:16": {"speculative_topk": 4, "speculative_num_draft_tokens": 16, "speculative_adaptive": False},
}


def worker(threads: int) -> None:
    """Serve requests from stdin: ``{"config", "messages", "temperature", "seed", "max_tokens"}`` →
    ``{"seconds", "token_ids", "drafts", "accepted", "steps"}``; engines are built on first use, a chat is
    rendered with the engine's tokenizer."""
    logging.basicConfig(level=logging.WARNING)
    from dflash2 import LLM, SamplingParams
    from dflash2.bench.workload import render_chat

    engines: dict[str, Any] = {}
    common: dict[str, Any] = {
        "max_num_seqs": 1,
        "max_model_len": 2048,
        "num_threads": threads,
        "adaptive_threads": False,
    }
    print(json.dumps({"ready": True, "dflash2": str(Path(str(sys.modules["dflash2"].__file__)).parent)}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        name = request["config"]
        if name not in engines:
            engines[name] = LLM(**common, **CONFIGS[name])
        params = SamplingParams(
            max_tokens=request["max_tokens"], temperature=request["temperature"], seed=request["seed"]
        )
        llm = engines[name]
        prompt = list(llm.engine.tokenizer.encode(render_chat(llm.engine.tokenizer, request["messages"])))
        start = time.perf_counter()
        completion = llm.generate(prompt, params)[0]
        seconds = time.perf_counter() - start
        answer = {
            "seconds": seconds,
            "token_ids": completion.token_ids,
            "drafts": completion.num_draft_tokens,
            "accepted": completion.num_accepted_tokens,
            "steps": completion.num_verify_steps,
        }
        print(json.dumps(answer), flush=True)


class Worker:
    """One tree's worker process."""

    def __init__(self, tree: Path, threads: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(tree.resolve()), "OMP_NUM_THREADS": str(threads)}
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--threads", str(threads)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        hello = json.loads(self._read())
        self.package = hello["dflash2"]

    def _read(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker exited with code {self.process.wait()}")
        return line

    def run(self, **request: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return json.loads(self._read())

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--before", type=Path, help="the source tree measured first in each pair")
    parser.add_argument("--after", type=Path, help="the source tree measured second in each pair")
    parser.add_argument("--data", type=Path, default=None, help="a `dflash2 data` folder (for the held-out set)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS), help="engines")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--num-prompts", type=int, default=2, help="prompts per set (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per request (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per worker (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="measured passes (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None, help="write every measurement here (JSON)")
    args = parser.parse_args()
    if args.worker:
        worker(args.threads)
        return
    if args.before is None or args.after is None:
        parser.error("--before and --after are required")

    from dflash2.train.evaluate import load_prompt_sets

    sets = load_prompt_sets(args.data, args.num_prompts)
    prompts = [(name, messages) for name, group in sets.items() for messages in group]
    workers = {"before": Worker(args.before, args.threads), "after": Worker(args.after, args.threads)}
    for label, w in workers.items():
        print(f"{label}: dflash2 from {w.package}", file=sys.stderr)
    records: list[dict[str, Any]] = []
    try:
        for round_index in range(args.rounds + 1):  # round 0: warm-up (compilation, caches), not counted
            for config in args.configs:
                for temperature in args.temperatures:
                    for i, (set_name, messages) in enumerate(prompts):
                        request = {
                            "config": config,
                            "messages": messages,
                            "temperature": temperature,
                            "seed": 1000 + i,
                            "max_tokens": args.max_tokens,
                        }
                        pair = {label: w.run(**request) for label, w in workers.items()}
                        if round_index:
                            records.append({"config": config, "temperature": temperature, "set": set_name, **pair})
            print(f"round {round_index} done", file=sys.stderr)
    finally:
        for w in workers.values():
            w.close()
    if args.out is not None:
        args.out.write_text(json.dumps(records, indent=1))
    report(records, args.configs, args.temperatures)


def report(records: list[dict[str, Any]], configs: list[str], temperatures: list[float]) -> None:
    """Print the table: per engine and temperature, ms/token of each tree, the ratio after/before and τ."""
    print(
        "| engine | T | before ms/tok | after ms/tok | after / before | per-request ratio IQR "
        "| τ before | τ after | same greedy text |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for config in configs:
        for temperature in temperatures:
            rows = [r for r in records if r["config"] == config and r["temperature"] == temperature]
            if not rows:
                continue
            ms = {
                label: [1e3 * r[label]["seconds"] / max(len(r[label]["token_ids"]), 1) for r in rows]
                for label in ("before", "after")
            }
            ratios = sorted(a / b for a, b in zip(ms["after"], ms["before"]))
            quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
            tau = {
                label: sum(r[label]["accepted"] + r[label]["steps"] for r in rows)
                / max(sum(r[label]["steps"] for r in rows), 1)
                for label in ("before", "after")
            }
            same = (
                f"{sum(r['before']['token_ids'] == r['after']['token_ids'] for r in rows)}/{len(rows)}"
                if temperature == 0
                else "–"
            )
            before, after = statistics.median(ms["before"]), statistics.median(ms["after"])
            print(
                f"| {config} | {temperature:g} | {before:.2f} | {after:.2f} | {after / before:.3f} | "
                f"{quartiles[0]:.3f}–{quartiles[2]:.3f} | {tau['before']:.2f} | {tau['after']:.2f} | {same} |"
            )


if __name__ == "__main__":
    main()
