"""Decode time idle and with the cores shared, per thread setting (docs/engine.md, "Threads").

Each case runs in a fresh process (OpenMP reads its settings once, at start): SmolLM2 in bfloat16,
autoregressive, one chat prompt, 64 greedy tokens, median of 3 after a warm-up. Contention is two
busy-looping processes started after the model has loaded. The default cases compare the engine's
adaptive thread count (the default) with a fixed 2 and a fixed 1, compiled and eager; ``--omp``
runs the OpenMP wait-policy cases instead (2 fixed threads, eager).

    .venv/bin/python scripts/thread_contention.py [--rounds 2] [--omp]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

TOKENS = 64
# label, threads, adaptive threads, eager, environment
CASES = [
    ("compiled, 2 threads, adaptive (default)", 2, True, False, {}),
    ("compiled, 2 threads, --no-adaptive-threads", 2, False, False, {}),
    ("compiled, 1 thread", 1, False, False, {}),
    ("eager, 2 threads, adaptive (default)", 2, True, True, {}),
    ("eager, 2 threads, --no-adaptive-threads", 2, False, True, {}),
    ("eager, 1 thread", 1, False, True, {}),
]
OMP_CASES = [
    ("eager, 2 threads (libgomp default)", 2, False, True, {}),
    ("eager, 2 threads OMP_WAIT_POLICY=PASSIVE", 2, False, True, {"OMP_WAIT_POLICY": "PASSIVE"}),
    ("eager, 2 threads GOMP_SPINCOUNT=10000", 2, False, True, {"GOMP_SPINCOUNT": "10000"}),
    ("eager, 1 thread", 1, False, True, {}),
]


def worker(threads: int, adaptive: bool, eager: bool) -> None:
    """Load, warm up, say READY, wait for a line on stdin, then time three decodes."""
    from dflash2 import LLM, SamplingParams

    llm = LLM(
        block_size=1,
        max_num_seqs=1,
        max_model_len=1024,
        dtype="bfloat16",
        enforce_eager=eager,
        num_threads=threads,
        adaptive_threads=adaptive,
    )
    message = [{"role": "user", "content": "Explain what a hash table is."}]
    prompt = llm.engine.tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=False)
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
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
    parser.add_argument("--omp", action="store_true", help="the OpenMP wait-policy cases")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        threads, adaptive, eager = json.loads(args.worker)
        worker(threads, adaptive, eager)
        return
    for round_index in range(args.rounds):
        for label, threads, adaptive, eager, settings in OMP_CASES if args.omp else CASES:
            for contended in (False, True):
                env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | settings
                command = [sys.executable, __file__, "--worker", json.dumps([threads, adaptive, eager])]
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
                print(
                    f"round {round_index} {label:44s} {state:9s} {TOKENS} tokens in {result['seconds']:6.2f} s",
                    flush=True,
                )


if __name__ == "__main__":
    main()
