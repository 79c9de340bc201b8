"""Microbenchmark of the bfloat16 CPU linear paths: GB/s of weights read, per row count and shape.

For each of a model's matrix shapes (default SmolLM2-135M's: fused QKV, O, fused gate/up, down, the
LM head) and each row count, times ``y = x · Wᵀ`` through oneDNN (the pre-packed weight PyTorch's
``mkldnn._linear_pointwise`` takes), the project's AVX2, AVX512-BF16 and AMX kernels, each on
its own packed copies of the weights. Each shape gets enough distinct weight matrices (≥ 160 MB) that
a pass reads them from memory, as a decode forward does, not from the cache. Passes of the methods
are interleaved and the median kept. The last line is the machine's memory bandwidth (bytes read per
second by a 512 MB ``Tensor.copy_`` and by a ``Tensor.sum``), the physical limit a decode forward
approaches.

Usage::

    .venv/bin/python scripts/kernel_bench.py                 # Markdown table on stdout
    .venv/bin/python scripts/kernel_bench.py --rows 1 8 --repeats 9
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash2.models import cpu_kernels
from dflash2.models.layers import onednn_bf16
from dflash2.platform import cpu_flags

# (name, out_features N, in_features K) of SmolLM2-135M's linears (hidden 576, 9 + 2·3 heads of 64,
# intermediate 1536, vocabulary 49152).
SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("lm_head", 49152, 576)]
FOOTPRINT = 160e6  # bytes of distinct weights per shape (larger than any L3 of a 2-core slice)


def methods() -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[..., torch.Tensor]]]:
    """name → (pack a dense bfloat16 weight, multiply ``(x, packed, N)``)."""
    found: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[..., torch.Tensor]]] = {}
    if onednn_bf16(torch.device("cpu"), torch.bfloat16):
        found["oneDNN"] = (
            torch.ops.mkldnn._reorder_linear_weight,
            lambda x, w, n: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
        )
    for kernel in (cpu_kernels.AVX2, cpu_kernels.AVX512_BF16, cpu_kernels.AMX):
        if kernel.available():
            found[kernel.name] = (kernel.pack, lambda x, w, n, kernel=kernel: kernel.linear(x, w, None, n))
    return found


def memory_bandwidth(repeats: int) -> tuple[float, float]:
    """GB/s read by ``Tensor.copy_`` of 512 MB (which also writes as much) and by ``Tensor.sum`` of
    512 MB of float32 (reads only, like a decode forward), medians of ``repeats``."""
    source = torch.ones(128 * 2**20, dtype=torch.float32)
    target = torch.empty_like(source)
    copies, sums = [], []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        target.copy_(source)
        copies.append(time.perf_counter() - start)
        start = time.perf_counter()
        source.sum()
        sums.append(time.perf_counter() - start)
    size = source.numel() * 4
    return size / statistics.median(copies[1:]) / 1e9, size / statistics.median(sums[1:]) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=7, help="interleaved passes per method (median kept)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    found = methods()
    flags = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU flags: {', '.join(flags)}\n")
    print("| rows | shape (N × K) | " + " | ".join(f"{name} GB/s" for name in found) + " |")
    print("|---|---|" + "---|" * len(found))
    torch.manual_seed(0)
    with torch.inference_mode():
        for name, n, k in SHAPES:
            copies = max(2, int(FOOTPRINT // (n * k * 2)))
            dense = [torch.randn(n, k).to(torch.bfloat16) for _ in range(copies)]
            packed = {method: [pack(w) for w in dense] for method, (pack, _) in found.items()}
            del dense
            for rows in args.rows:
                x = torch.randn(rows, k).to(torch.bfloat16)
                samples: dict[str, list[float]] = {method: [] for method in found}
                for _ in range(args.repeats + 1):  # the first pass warms up
                    for method, (_, multiply) in found.items():
                        start = time.perf_counter()
                        for w in packed[method]:
                            multiply(x, w, n)
                        samples[method].append((time.perf_counter() - start) / copies)
                cells = [f"{n * k * 2 / statistics.median(s[1:]) / 1e9:.1f}" for s in samples.values()]
                print(f"| {rows} | {name} ({n} × {k}) | " + " | ".join(cells) + " |", flush=True)
            del packed
    copy, read = memory_bandwidth(args.repeats)
    print(f"\nmemory: {copy:.1f} GB/s read by a 512 MB Tensor.copy_ (as much written), {read:.1f} GB/s by a Tensor.sum")
    return 0


if __name__ == "__main__":
    sys.exit(main())
