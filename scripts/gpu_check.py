"""GPU check of the compiled model runner: correctness and eager-vs-graphs timing on one device.

Runs with the machine's preinstalled torch and no downloads, in a few minutes on one GPU:

1. A Qwen3-4B-shaped target with random weights (``--tiny``: a small one, for a CPU dry run).
2. Greedy speculative decoding equals greedy autoregressive decoding in float32: an oracle
   drafter proposes the target's own greedy continuation (so random weights still give high
   acceptance) while the target's verify forward runs through the compiled runner.
3. bfloat16 timings, eager vs compiled (CUDA graphs on CUDA), batch 1: an autoregressive step,
   verify of 8 and 16 tokens, and the 5-layer DFlash 2 drafter's block of 8; then the projected
   speedup of DFlash 2 over autoregressive decoding at τ = 4.8.
4. Token-tree verify of 8, 16, 32 and 64 nodes beside the chain of 8 (eager and compiled: one CUDA
   graph per node bucket), after a float32 greedy check of trees through the compiled tree forward.
5. Tensor parallelism: whether NCCL TP can run here (two GPUs or more); if so, 2 ranks (one process
   per GPU) time a bfloat16 verify of 8 tokens on their shards, eager and compiled, and the all-reduces
   and the logits' all-gather of that step alone: the collectives' share of a TP step. On a CPU dry run
   the same with gloo.

Usage (from the repository root)::

    python scripts/gpu_check.py                      # CUDA, Qwen3-4B shape
    python scripts/gpu_check.py --tiny --device cpu  # a quick dry run of the same steps

Prints a Markdown table (also written to ``--out`` when given).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash2 import LLM, SamplingParams
from dflash2.config import EngineConfig
from dflash2.engine import Engine
from dflash2.models.drafter import DFlashDrafter
from dflash2.models.drafter_factory import drafter_config_for_target
from dflash2.models.llama import TargetModel
from dflash2.runner import ModelRunner, RunnerSpec
from dflash2.spec.tree import TokenTree

TAU = 4.8  # the seed paper's average acceptance length at B = 8 (Qwen3 8B-27B targets)


def target_config(tiny: bool) -> Any:
    """Qwen3-4B's shape (or a 4-layer miniature of it)."""
    from transformers import Qwen3Config

    if tiny:
        return Qwen3Config(
            vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, tie_word_embeddings=True,
        )  # fmt: skip
    return Qwen3Config(
        vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True,
    )  # fmt: skip


def random_target(config: Any, dtype: torch.dtype, device: torch.device) -> TargetModel:
    torch.manual_seed(0)
    with torch.device(device):
        model = TargetModel(config).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model.eval()


def random_drafter(target: TargetModel, block_size: int) -> DFlashDrafter:
    config = drafter_config_for_target(target.config, num_layers=5, block_size=block_size)
    drafter = DFlashDrafter(config)
    drafter.init_weights(std=0.02, seed=1)
    weight = target.embed_tokens.weight
    drafter.bind_target(*target.embedding_weights())
    return drafter.to(device=weight.device, dtype=weight.dtype).eval()


class OracleDrafter(DFlashDrafter):
    """Proposes the reference greedy continuation of the request in slot 0."""

    supports_compile = False

    def __init__(self, config: Any, reference: list[int]) -> None:
        super().__init__(config)
        self.reference = reference
        self._planned: torch.Tensor | None = None

    def draft_hidden(self, cache: Any, slots: Any, anchor_ids: Any, starts: Any, block_size: int) -> torch.Tensor:
        s = int(starts[0])
        ids = [self.reference[s + j] if s + j < len(self.reference) else 0 for j in range(block_size)]
        self._planned = torch.tensor([ids], device=anchor_ids.device)
        return torch.zeros(1, block_size, self.config.hidden_size, device=anchor_ids.device)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self._planned is not None
        planned = self._planned[:, -hidden.shape[1] :]
        return torch.nn.functional.one_hot(planned, self.config.vocab_size).float() * 20.0


def check_greedy(config: Any, device: torch.device, num_tokens: int, topk: int = 1) -> tuple[bool, float]:
    """Float32: eager AR tokens == compiled-verify speculative tokens with an oracle drafter (token trees
    of ``topk`` branches and 16 nodes through the compiled tree forward when ``topk`` > 1)."""
    target = random_target(config, torch.float32, device)
    prompt = list(range(3, 40))
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    base = {"max_num_seqs": 1, "max_model_len": 512, "device": str(device), "dtype": "float32"}
    ar = Engine(EngineConfig(block_size=1, enforce_eager=True, **base), target, None, None)
    reference = LLM.from_engine(ar).generate(prompt, params)[0].token_ids or []
    del ar
    oracle = OracleDrafter(drafter_config_for_target(config, num_layers=1, block_size=8), prompt + reference)
    oracle.init_weights(seed=2)
    oracle.bind_target(*target.embedding_weights())
    oracle = oracle.to(device)
    # Full blocks: the adaptive policy would measure the oracle's cost and may decline to draft,
    # leaving the verify path untested (τ 1.00 on the first H200 run).
    trees = {"speculative_topk": topk, "speculative_num_draft_tokens": 16} if topk > 1 else {}
    spec = Engine(EngineConfig(block_size=8, speculative_adaptive=False, **base, **trees), target, None, oracle)
    assert spec.runner.compiled, "the target's verify forward did not compile"
    assert topk == 1 or spec.runner._tree_forward is not None, "the tree forward did not compile"
    out = LLM.from_engine(spec).generate(prompt, params)[0]
    return out.token_ids == reference, out.mean_acceptance_length


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Any, device: torch.device, repeats: int = 30) -> float:
    """Median milliseconds of ``fn()`` after 5 warm-up calls."""
    for _ in range(5):
        fn()
    sync(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def time_runner(
    config: Any, device: torch.device, block_size: int, with_drafter: bool, eager: bool
) -> dict[str, float]:
    """Timings of one runner over a fresh bfloat16 target (a runner pre-packs its eager modules on CPU)."""
    target = random_target(config, torch.bfloat16, device)
    drafter = random_drafter(target, block_size) if with_drafter else None
    runner = ModelRunner(target, drafter, RunnerSpec(1, 2048, block_size, enforce_eager=eager))
    context = 1024
    runner.prefill([0], [list(range(context))], [0])
    tokens = [TokenTree.chain([5] * block_size)]
    result = {"compile_s": sum(runner.compile_times.values())}
    with torch.inference_mode():
        result["verify_ms"] = timed(lambda: runner.verify([0], tokens, [context]), device)
        if drafter is not None:
            anchors = torch.tensor([5], device=device)
            starts = torch.tensor([context], device=device)
            runner.drafting.append_context(
                [0], [0], torch.zeros(1, context, drafter.fc.in_features, device=device), [context]
            )
            result["draft_ms"] = timed(lambda: runner.drafting.draft_block([0], anchors, starts, block_size), device)
    return result


TREE_NODES = (8, 16, 32, 64)


def time_trees(config: Any, device: torch.device, eager: bool) -> dict[int, float]:
    """Milliseconds of one tree-masked verify forward (``ModelRunner.verify`` of a branching tree) at batch 1
    after 1024 tokens, for each node count in :data:`TREE_NODES` (a binary tree: node i's parent is (i − 1) // 2).
    Compiled: CUDA graphs recorded per node bucket (``dflash2.runner.graph_inputs.node_buckets``) on CUDA, one
    dynamic inductor graph on CPU."""
    target = random_target(config, torch.bfloat16, device)
    drafter = random_drafter(target, 8)
    runner = ModelRunner(target, drafter, RunnerSpec(1, 2048, 8, enforce_eager=eager, tree_nodes=max(TREE_NODES) - 1))
    context = 1024
    runner.prefill([0], [list(range(context))], [0])
    result = {}
    with torch.inference_mode():
        for n in TREE_NODES:
            tree = TokenTree([5] * n, [-1, *((i - 1) // 2 for i in range(1, n))])
            result[n] = timed(lambda tree=tree: runner.verify([0], [tree], [context]), device)
    return result


TP_RANKS = 2


def tp_rank(rank: int, port: int, config: Any, device_type: str, results: Any) -> None:
    """One rank of the TP timing: a bfloat16 target built from the same seed on every rank, cut to this
    rank's shard; both ranks run the same calls in the same order (no rank-0 messages needed)."""
    import datetime

    import torch.distributed as dist
    from torch.distributed import _functional_collectives as collectives

    from dflash2.models.tensor_parallel import ShardInfo, shard_target

    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, TP_RANKS, is_master=rank == 0, timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=TP_RANKS)
    shard = ShardInfo(rank, TP_RANKS, dist.group.WORLD)
    out: dict[str, float] = {}
    context = 1024
    for mode in ("eager", "compiled"):
        target = shard_target(random_target(config, torch.bfloat16, torch.device("cpu")), shard).to(device)
        runner = ModelRunner(target, None, RunnerSpec(1, 2048, 8, enforce_eager=mode == "eager"))
        runner.prefill([0], [list(range(context))], [0])
        with torch.inference_mode():
            out[mode] = timed(lambda runner=runner: runner.verify([0], [TokenTree.chain([5] * 8)], [context]), device)
        del runner, target
    hidden = torch.randn(1, 8, config.hidden_size, dtype=torch.bfloat16, device=device)
    logits = torch.randn(1, 8, -(-config.vocab_size // TP_RANKS), dtype=torch.bfloat16, device=device)

    def collectives_of_a_step() -> None:  # two all-reduces per layer, the embedding's, the logits' gather
        for _ in range(2 * config.num_hidden_layers + 1):
            collectives.wait_tensor(collectives.all_reduce(hidden, "sum", dist.group.WORLD))
        collectives.wait_tensor(collectives.all_gather_single(logits, 2, dist.group.WORLD))

    out["collectives"] = timed(collectives_of_a_step, device)
    if rank == 0:
        results.put(out)
    dist.barrier()
    dist.destroy_process_group()


def check_tensor_parallel(config: Any, device: torch.device) -> list[str]:
    """Section 5 of the report (see the module docstring)."""
    import socket

    import torch.multiprocessing as mp

    if device.type == "cuda":
        gpus = torch.cuda.device_count()
        nccl = torch.distributed.is_available() and torch.distributed.is_nccl_available()
        if gpus < TP_RANKS or not nccl:
            why = f"{gpus} GPU(s)" + ("" if nccl else ", no NCCL in this torch build")
            return [f"- tensor parallelism: not possible here ({why}): TP 1 only; NCCL TP needs two GPUs or more"]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(tp_rank, args=(port, config, device.type, results), nprocs=TP_RANKS, start_method="spawn")
    out = results.get()
    backend = "NCCL" if device.type == "cuda" else "gloo"
    return [
        f"Tensor parallelism, {TP_RANKS} ranks over {backend}, bfloat16 verify of 8 tokens after 1024, batch 1 (ms):",
        "",
        "| forwards | TP step | its collectives alone | share |",
        "|---|---|---|---|",
        *(
            f"| {mode} | {out[mode]:.2f} | {out['collectives']:.2f} | {out['collectives'] / out[mode]:.0%} |"
            for mode in ("eager", "compiled")
        ),
        "",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a small model (CPU dry run)")
    parser.add_argument("--tokens", type=int, default=48, help="greedy tokens compared")
    parser.add_argument("--out", type=Path, default=None, help="also write the Markdown report here")
    args = parser.parse_args()
    device = torch.device(args.device)
    config = target_config(args.tiny)
    lines = [f"# dflash2 GPU check ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'})", ""]
    lines.append(f"torch {torch.__version__}; target {'tiny' if args.tiny else 'Qwen3-4B'} shape, random weights")

    start = time.perf_counter()
    same, tau = check_greedy(config, device, args.tokens)
    lines.append(
        f"- float32 greedy, compiled verify + oracle drafter vs eager AR, {args.tokens} tokens: "
        f"{'identical' if same else 'DIFFERENT'} (τ {tau:.2f}; {time.perf_counter() - start:.0f} s)"
    )
    start = time.perf_counter()
    same, tau = check_greedy(config, device, args.tokens, topk=4)
    lines.append(
        f"- the same with token trees (K = 4, N = 16, compiled tree forward): "
        f"{'identical' if same else 'DIFFERENT'} (τ {tau:.2f}; {time.perf_counter() - start:.0f} s)"
    )
    print("\n".join(lines), flush=True)

    rows = []
    costs: dict[str, dict[str, float]] = {}
    for mode in ("eager", "compiled"):
        eager = mode == "eager"
        ar = time_runner(config, device, 1, False, eager)
        v8 = time_runner(config, device, 8, True, eager)
        v16 = time_runner(config, device, 16, False, eager)
        costs[mode] = {"ar": ar["verify_ms"], "v8": v8["verify_ms"], "v16": v16["verify_ms"], "draft": v8["draft_ms"]}
        compile_s = ar["compile_s"] + v8["compile_s"] + v16["compile_s"]
        rows.append(
            f"| {mode} | {ar['verify_ms']:.2f} | {v8['verify_ms']:.2f} | {v16['verify_ms']:.2f} | "
            f"{v8['draft_ms']:.2f} | {compile_s:.0f} |"
        )
        print(rows[-1], flush=True)
    lines += [
        "",
        "bfloat16, batch 1, 1024 tokens of context, median of 30 (ms):",
        "",
        "| forwards | AR step | verify 8 | verify 16 | draft (5 layers, B = 8) | compile s |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    tree_rows = []
    for mode in ("eager", "compiled"):
        trees = time_trees(config, device, mode == "eager")
        tree_rows.append(
            f"| {mode} | {costs[mode]['v8']:.2f} | " + " | ".join(f"{trees[n]:.2f}" for n in TREE_NODES) + " |"
        )
        print(tree_rows[-1], flush=True)
    lines += [
        "Token-tree verify (one tree-masked forward; compiled = CUDA graphs per node bucket on CUDA), ms:",
        "",
        "| forwards | chain of 8 | " + " | ".join(f"tree of {n}" for n in TREE_NODES) + " |",
        "|---|---|" + "---|" * len(TREE_NODES),
        *tree_rows,
        "",
    ]
    for mode, c in costs.items():
        projected = TAU * c["ar"] / (c["v8"] + c["draft"])
        lines.append(f"- {mode}: projected DFlash 2 speedup over AR at τ = {TAU}, B = 8: {projected:.2f}×")
    c, e = costs["compiled"], costs["eager"]
    lines.append(f"- compiled vs eager: AR step {e['ar'] / c['ar']:.2f}×, verify 8 {e['v8'] / c['v8']:.2f}×")
    lines += ["", *check_tensor_parallel(config, device)]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
