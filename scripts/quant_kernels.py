"""Weight bytes per second of the CPU linear kernels at the row counts decoding uses (docs/engine.md,
"Quantized weights"): the project's quantized kernel (4- and 8-bit), its bfloat16 kernel, and ATen's
weight-only kernels (``_weight_int4pack_mm_for_cpu``, ``_weight_int8pack_mm``), on the linears of one
SmolLM2-135M decoder layer (QKV 960×576, O 576×576, gate/up 3072×576, down 576×1536) and its LM head
(49152×576). Each candidate is timed interleaved with the others, median of rounds; also says whether
a row's result depends on the rows beside it.

    .venv/bin/python scripts/quant_kernels.py --rounds 7

Prints a markdown table; ``--read-bandwidth`` first measures the machine's read speed (a sum over 1 GB).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from dflash2.models import cpu_kernels
from dflash2.models.layers import PackedLinear, linear_backend
from dflash2.models.quant import QuantizedLinear, quantize_rtn

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = [(49152, 576)]


class Candidate:
    """One kernel over a set of weight shapes: ``run(x_by_k)`` and its weight bytes."""

    def __init__(self, name: str, layers: list[Callable[[torch.Tensor], torch.Tensor]], nbytes: int) -> None:
        self.name, self.layers, self.nbytes = name, layers, nbytes

    def __call__(self, inputs: dict[int, torch.Tensor], ks: list[int]) -> list[torch.Tensor]:
        return [layer(inputs[k]) for layer, k in zip(self.layers, ks)]


def aten_int4(weight: torch.Tensor, group_size: int = 32) -> tuple[Callable[[torch.Tensor], torch.Tensor], int]:
    """ATen's CPU int4 weight-only product (gpt-fast / torchao's CPU layout): asymmetric, groups of 32."""
    n, k = weight.shape
    w = weight.float().view(n, k // group_size, group_size)
    low, high = w.amin(-1), w.amax(-1)
    scales = ((high - low) / 15).clamp(min=1e-6)
    q = torch.round((w - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
    zeros = low + 8 * scales  # ATen's zero point: w = (q − 8) · scale + zero
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)

    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)

    return run, packed.numel() * packed.element_size() + scales_and_zeros.numel() * 2


def aten_int8(weight: torch.Tensor) -> tuple[Callable[[torch.Tensor], torch.Tensor], int]:
    """ATen's CPU int8 weight-only product: symmetric, one scale per output channel."""
    scales = (weight.float().abs().amax(-1) / 127).clamp(min=1e-6)
    q = torch.round(weight.float() / scales[:, None]).clamp(-127, 127).to(torch.int8)
    s = scales.to(torch.bfloat16)

    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, q, s)

    return run, q.numel() + s.numel() * 2


def build(shapes: list[tuple[int, int]]) -> list[Candidate]:
    weights = [torch.randn(n, k).to(torch.bfloat16) * 0.05 for n, k in shapes]
    candidates = []
    for bits in (4, 8):
        layers = [QuantizedLinear(quantize_rtn(w, bits)) for w in weights]
        candidates.append(Candidate(f"ours int{bits}", list(layers), sum(layer.nbytes for layer in layers)))
    backend = linear_backend(torch.device("cpu"), torch.bfloat16)
    if backend is not None:
        packed = [PackedLinear(w, backend=backend) for w in weights]
        candidates.append(Candidate(f"ours bf16 ({backend})", list(packed), sum(w.numel() * 2 for w in weights)))
    for name, make in (("ATen int4", aten_int4), ("ATen int8", aten_int8)):
        try:
            made = [make(w) for w in weights]
        except RuntimeError as error:
            print(f"{name}: unavailable ({str(error).splitlines()[0]})")
            continue
        candidates.append(Candidate(name, [m[0] for m in made], sum(m[1] for m in made)))
    return candidates


def row_invariant(candidate: Candidate, ks: list[int]) -> bool:
    inputs = {k: torch.randn(9, k).to(torch.bfloat16) for k in set(ks)}
    together = candidate(inputs, ks)
    for i in range(9):
        alone = candidate({k: x[i : i + 1] for k, x in inputs.items()}, ks)
        if not all(torch.equal(a[0], t[i]) for a, t in zip(alone, together)):
            return False
    return True


def read_bandwidth() -> float:
    """GB/s of a float32 sum over 1 GB (the memory's read speed)."""
    data = torch.ones(1 << 28)
    data.sum()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return data.numel() * 4 / min(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=30, help="calls per timing")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--read-bandwidth", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    assert cpu_kernels.QUANT.available(), "the quantized kernel does not build here"
    if args.read_bandwidth:
        print(f"read bandwidth: {read_bandwidth():.1f} GB/s")
    for title, shapes in (("one decoder layer's linears", LAYER), ("LM head", HEAD)):
        candidates = build(shapes)
        ks = [k for _, k in shapes]
        table: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.rounds):
            for rows in args.rows:
                inputs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in set(ks)}
                for c in candidates:
                    c(inputs, ks)
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        c(inputs, ks)
                    table.setdefault((c.name, rows), []).append((time.perf_counter() - start) / args.calls)
        print(f"\n{title}, {args.threads} threads: GB/s of weight bytes (µs per set), median of {args.rounds} rounds")
        print("| kernel | MB | " + " | ".join(f"{r} rows" for r in args.rows) + " | rows independent |")
        print("|---|---|" + "---|" * len(args.rows) + "---|")
        for c in candidates:
            cells = []
            for rows in args.rows:
                seconds = statistics.median(table[(c.name, rows)])
                cells.append(f"{c.nbytes / seconds / 1e9:.1f} ({seconds * 1e6:.0f})")
            invariant = "yes" if row_invariant(c, ks) else "no"
            print(f"| {c.name} | {c.nbytes / 1e6:.1f} | " + " | ".join(cells) + f" | {invariant} |")


if __name__ == "__main__":
    main()
