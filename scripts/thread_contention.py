"""Decode time idle and with the cores shared, per thread count and OpenMP setting (docs/engine.md, "Threads").

Each case runs in a fresh process (OpenMP reads its settings once, at start): SmolLM2 in bfloat16,
eager, autoregressive, one chat prompt, 24 greedy tokens, median of 3 after a warm-up. Contention
is two busy-looping processes started after the model has loaded.

    .venv/bin/python scripts/thread_contention.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CASES = [
    ("threads=2 (libgomp default)", 2, {}),
    ("threads=2 OMP_WAIT_POLICY=PASSIVE", 2, {"OMP_WAIT_POLICY": "PASSIVE"}),
    ("threads=2 GOMP_SPINCOUNT=10000", 2, {"GOMP_SPINCOUNT": "10000"}),
    ("threads=1", 1, {}),
]


def worker(threads: int) -> None:
    """Load, warm up, say READY, wait for a line on stdin, then time three decodes."""
    import torch

    torch.set_num_threads(threads)
    from dflash2 import LLM, SamplingParams

    llm = LLM(block_size=1, max_num_seqs=1, max_model_len=1024, dtype="bfloat16", enforce_eager=True)
    message = [{"role": "user", "content": "Explain what a hash table is."}]
    prompt = llm.engine.tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=False)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], params)
    print("READY", flush=True)
    sys.stdin.readline()
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        llm.generate([prompt], params)
        seconds.append(time.perf_counter() - start)
    print(json.dumps({"seconds": sorted(seconds)[1]}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    for round_index in range(args.rounds):
        for label, threads, settings in CASES:
            for contended in (False, True):
                env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | settings
                command = [sys.executable, __file__, "--worker", str(threads)]
                child = subprocess.Popen(
                    command,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    env=env,
                    text=True,
                )
                assert child.stdin is not None and child.stdout is not None
                assert child.stdout.readline().strip() == "READY"
                burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * contended)]
                time.sleep(0.5)
                child.stdin.write("go\n")
                child.stdin.flush()
                try:
                    result = json.loads(child.stdout.readline())
                finally:
                    for burner in burners:
                        burner.kill()
                child.wait()
                state = "contended" if contended else "idle"
                print(f"round {round_index} {label:36s} {state:9s} 24 tokens in {result['seconds']:6.2f} s", flush=True)


if __name__ == "__main__":
    main()
