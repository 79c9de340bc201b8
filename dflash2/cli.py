"""Command line: ``dflash2 generate``, ``data``, ``train``, ``eval``, ``serve`` and ``bench``.

Engine flags are shared by every subcommand and take their defaults from ``EngineConfig``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash2.bench.config import (
    AGENT_LOOP_MAX_CONVERSATIONS,
    AGENT_LOOP_SERVERS,
    METHOD_FAMILIES,
    PROMPT_SETS,
    BenchConfig,
)
from dflash2.bench.gguf_export import GGUF_TYPES
from dflash2.config import QUANTIZATION_CHOICES, EngineConfig
from dflash2.engine_args import (
    LOG_LEVEL_HELP,
    UNUSED_ENGINE_FLAGS,
    add_engine_args,
    default_log_level,
    engine_config_from_args,
)
from dflash2.outputs import mean_acceptance_length
from dflash2.sampling import SamplingParams

_BENCH_DEFAULTS = BenchConfig()


def _generate(args: argparse.Namespace) -> int:
    from dflash2.api import LLM
    from dflash2.engine import Engine

    llm = LLM.from_engine(Engine.from_config(engine_config_from_args(args)))
    tokenizer = llm.engine.tokenizer
    prompt = args.prompt
    if not args.raw and tokenizer is not None and tokenizer.chat_template:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed_request,
        stop=tuple(args.stop or ()),
    )
    start = time.perf_counter()
    first_token_at = None
    num_tokens = num_steps = num_accepted = num_lookup = num_tree_steps = 0
    draft_time = select_time = verify_time = 0.0
    select_in_draft = False
    error: str | None = None
    for result in llm.stream(prompt, params):
        stats = result.stats
        select_in_draft = select_in_draft or stats.select_in_draft
        num_lookup += stats.num_lookup_drafts
        num_tree_steps += stats.num_tree_nodes > 0
        draft_time, select_time, verify_time = (
            draft_time + stats.draft_time,
            select_time + stats.select_time,
            verify_time + stats.verify_time,
        )
        for out in result.outputs:
            if first_token_at is None and out.new_token_ids:
                first_token_at = time.perf_counter()
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            if out.error is not None:  # its counts are not the request's
                error = out.error
                continue
            num_tokens, num_steps, num_accepted = (
                out.num_output_tokens,
                out.num_verify_steps,
                out.num_accepted_tokens,
            )
    elapsed = time.perf_counter() - start
    tau = mean_acceptance_length(num_accepted, num_steps)
    decode_time = elapsed - ((first_token_at or start) - start)
    decode_rate = (num_tokens - 1) / decode_time if num_tokens > 1 and decode_time > 0 else 0.0
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(
        f"[dflash2] {num_tokens} tokens in {elapsed:.2f} s: {num_tokens / elapsed:.1f} tok/s overall, "
        f"{decode_rate:.1f} tok/s after the first token; block size {llm.engine.block_size}, "
        f"mean acceptance length {tau:.2f}; draft {draft_time * 1e3:.0f} ms, "
        + ("select in draft" if select_in_draft else f"select {select_time * 1e3:.0f} ms")
        + f", verify {verify_time * 1e3:.0f} ms"
        + (f"; prompt lookup drafted {num_lookup} of {num_steps} steps" if llm.engine.prompt_lookup_max else "")
        + (f"; {num_tree_steps} of {num_steps} steps verified token trees" if llm.engine.spec.tree_topk > 1 else ""),
        file=sys.stderr,
    )
    if error is not None:
        print(f"dflash2: error: the request failed in the engine: {error}", file=sys.stderr)
        return 1
    return 0


def _data(args: argparse.Namespace) -> int:
    from dflash2.engine import Engine
    from dflash2.train.data import DataConfig, build_dataset

    config = engine_config_from_args(args)
    engine = Engine.from_config(dataclasses.replace(config, block_size=1))
    data_config = DataConfig(
        num_prompts=args.num_prompts,
        max_prompt_tokens=args.max_prompt_tokens,
        max_response_tokens=args.max_response_tokens,
        response_temperature=args.response_temperature,
        multi_turn_fraction=args.multi_turn_fraction,
        heldout_fraction=args.heldout_fraction,
        seed=args.data_seed,
    )
    manifest = build_dataset(engine, data_config, Path(args.out), args.prompts, synthesize=args.num_prompts > 0)
    print(json.dumps(manifest, indent=2))
    return 0


def _offline_dtype(config: EngineConfig) -> Any:
    """The dtype of ``train`` and ``eval``, which run the target without the engine: ``auto`` is
    float32 on CPUs whose bfloat16 speed comes from the engine's packed kernel
    (:func:`dflash2.models.layers.linear_backend` ``"avx2"``), since these commands run plain
    ``nn.Linear`` layers (PyTorch's bfloat16 there is several times slower than float32);
    otherwise :func:`dflash2.runner.model_setup.resolve_dtype`."""
    import torch

    from dflash2.models.layers import linear_backend

    cpu = config.torch_device.type == "cpu"
    if config.dtype == "auto" and cpu and linear_backend(config.torch_device, torch.bfloat16) == "avx2":
        return torch.float32
    from dflash2.runner.model_setup import resolve_dtype

    return resolve_dtype(config)


def _load_target(config: EngineConfig) -> tuple[Path, Any, Any]:
    """Resolve and load the target and its tokenizer (training and evaluation need no engine), in
    :func:`_offline_dtype`."""
    from dflash2.models import loader, source
    from dflash2.platform import configure_threads

    configure_threads(config.num_threads)
    folder = source.resolve_model(config.model)
    return (
        folder,
        loader.load_tokenizer(folder),
        loader.load_target(folder, _offline_dtype(config), config.torch_device),
    )


def _train(args: argparse.Namespace) -> int:
    from dflash2.models.drafter_factory import pick_mask_token_id
    from dflash2.train.data import TokenDataset
    from dflash2.train.features import load_or_extract
    from dflash2.train.trainer import TrainConfig, Trainer, new_drafter

    if not 0.0 <= args.distill_weight <= 1.0 or args.distill_top_k < 1:
        print("error: --distill-weight must lie in [0, 1] and --distill-top-k be at least 1", file=sys.stderr)
        return 2
    engine_config = engine_config_from_args(args)
    _, tokenizer, target = _load_target(engine_config)
    dataset = TokenDataset.load(args.data / "dataset.safetensors")
    config = TrainConfig(
        num_layers=args.num_layers,
        block_size=args.train_block_size,
        use_conv=not args.no_conv,
        use_selector=not args.no_selector,
        selector_rank=args.selector_rank,
        selector_top_k=args.selector_top_k,
        selector_alpha=args.selector_alpha,
        lr=args.lr,
        steps=args.steps,
        time_budget=args.time_budget,
        blocks_per_step=args.blocks_per_step,
        anchors_per_sequence=args.anchors_per_sequence,
        init_from_target=not args.no_init_from_target,
        autocast_bf16=args.bf16,
        seed=args.train_seed,
        checkpoint_every=args.checkpoint_every,
        draft_vocab_size=args.draft_vocab_size,
        init_drafter=str(args.init_drafter) if args.init_drafter else None,
        eval_every=args.eval_every,
        distill_weight=args.distill_weight,
        distill_top_k=args.distill_top_k,
    )
    mask_token_id = pick_mask_token_id(tokenizer, target.embedding_weights()[0].shape[0])
    layer_ids = new_drafter(target, config, mask_token_id).config.target_layer_ids
    cache = args.features or args.data / f"features-{'-'.join(map(str, layer_ids))}.safetensors"
    soft_label_k = config.distill_top_k if config.distill_weight > 0 else 0
    features, soft_labels = load_or_extract(cache, target, dataset, layer_ids, soft_label_k)
    trainer = Trainer(target, dataset, features, config, args.run_dir, mask_token_id, soft_labels)
    metrics = trainer.run(export_dir=args.out)
    print(json.dumps({k: v for k, v in metrics.items() if not isinstance(v, list)}))
    print(f"exported the drafter to {args.out}", file=sys.stderr)
    return 0


def _eval(args: argparse.Namespace) -> int:
    from dflash2.models import loader
    from dflash2.runner.model_setup import resolve_drafter_path
    from dflash2.train import evaluate
    from dflash2.train.data import TokenDataset
    from dflash2.train.features import extract_features

    if args.sets and "heldout" in args.sets and args.data is None:
        print("error: the heldout set comes from a `dflash2 data` folder: pass --data", file=sys.stderr)
        return 2
    engine_config = engine_config_from_args(args)
    folder, tokenizer, target = _load_target(engine_config)
    drafter_path = resolve_drafter_path(engine_config)
    if drafter_path is None:
        print("error: dflash2 eval needs --drafter for a model other than the embedded default", file=sys.stderr)
        return 2
    drafter = loader.load_drafter(
        Path(drafter_path),
        target,
        _offline_dtype(engine_config),
        engine_config.torch_device,
        engine_config.speculative_draft_vocab_size,
    )
    eos = loader.eos_token_ids(folder, tokenizer)
    args.out.mkdir(parents=True, exist_ok=True)
    sets = evaluate.load_prompt_sets(args.data, args.num_prompts)
    sets = {k: v for k, v in sets.items() if not args.sets or k in args.sets}
    results = {}
    for name, prompts in sets.items():
        for temperature in args.temperatures:
            for block_size in args.block_sizes:
                r = evaluate.acceptance(
                    target,
                    tokenizer,
                    drafter,
                    eos,
                    prompts,
                    block_size,
                    temperature,
                    args.max_tokens,
                    engine_config.max_num_seqs,
                    engine_config.use_selector,
                )
                results[f"{name}/{temperature:g}/{block_size}"] = r.to_dict()
                print(f"{name:10s} T={temperature:g} B={block_size:2d}: tau {r.tau:.2f}", file=sys.stderr)
    recall, forced_tau, chained_tau = None, None, None
    dataset = TokenDataset.load(args.data / "dataset.safetensors") if args.data is not None else None
    if dataset is not None and args.num_recall_sequences > 0 and dataset.indices(heldout=True):
        heldout = dataset.subset(dataset.indices(heldout=True)[: args.num_recall_sequences])
        features, _ = extract_features(target, heldout, drafter.config.target_layer_ids)
        forced = evaluate.teacher_forced(
            drafter, heldout, features, max_sequences=args.num_recall_sequences, use_selector=engine_config.use_selector
        )
        recall, forced_tau = forced.recall, forced.tau
        chained_tau = evaluate.chained_teacher_forced(
            drafter, heldout, features, args.num_prompts, args.max_tokens, engine_config.use_selector
        ).tau
    summary = {
        "acceptance": results,
        "recall": recall,
        "teacher_forced_tau": forced_tau,
        "chained_teacher_forced_tau": chained_tau,
    }
    (args.out / "eval.json").write_text(json.dumps(summary, indent=2) + "\n")
    table = evaluate.markdown_table(results, recall, forced_tau, chained_tau)
    (args.out / "eval.md").write_text(table)
    evaluate.plot_acceptance({k: v for k, v in results.items() if "/0/" in k}, recall, args.out / "acceptance.png")
    print(table)
    return 0


def _serve(args: argparse.Namespace) -> int:
    # The HTTP layer is the `server` package (server → dflash2); only this subcommand imports it.
    from server.app import serve
    from server.settings import settings_from_args

    return serve(settings_from_args(args, engine_config_from_args(args)))


def _bench(args: argparse.Namespace) -> int:
    from dflash2.bench.run import run_bench

    config = BenchConfig(
        engine=engine_config_from_args(args),
        out=args.out,
        data=args.data,
        sets=tuple(args.sets),
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        methods=tuple(dict.fromkeys(args.methods)),
        block_sizes=tuple(args.block_sizes),
        temperatures=tuple(args.temperatures),
        prompt_lookup_tokens=args.prompt_lookup_tokens,
        eager_rows=args.eager_rows,
        adaptive_rows=args.adaptive_rows,
        tree_nodes=tuple(args.tree_nodes),
        tree_topk=args.tree_topk,
        tensor_parallel_rows=tuple(args.tp_rows),
        startup=args.startup,
        gguf=args.gguf,
        gguf_types=tuple(args.gguf_types),
        quantization_rows=tuple(args.quantization_rows),
        single_stream=args.single_stream,
        serving=args.serving,
        url=args.url,
        concurrency=tuple(args.concurrency),
        serving_requests=args.serving_requests,
        serving_seconds=args.serving_seconds,
        serving_rounds=args.serving_rounds,
        serving_temperature=args.serving_temperature,
        agents=args.agents,
        agent_history_tokens=args.agent_history_tokens,
        agent_conversations=args.agent_conversations,
        agent_turns=args.agent_turns,
        agent_max_tokens=args.agent_max_tokens,
        agent_loop=args.agent_loop,
        agent_loop_servers=tuple(dict.fromkeys(args.agent_loop_servers)),
        agent_loop_conversations=args.agent_loop_conversations,
        agent_loop_max_tokens=args.agent_loop_max_tokens,
        command=getattr(args, "command_line", ""),
    )
    run_bench(config, progress=lambda message: print(f"[bench] {message}", file=sys.stderr, flush=True))
    print(f"results: {config.out / 'results.md'}")
    return 0


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``dflash2 bench`` (defaults from ``BenchConfig``; docs/benchmarks.md)."""
    d = _BENCH_DEFAULTS
    parser.add_argument("--out", type=Path, default=d.out, help="results folder (results.json, results.md, PNGs)")
    parser.add_argument("--data", type=Path, default=d.data, help="`dflash2 data` folder (held-out prompt set)")
    parser.add_argument("--sets", nargs="+", choices=PROMPT_SETS, default=list(d.sets), help="prompt sets")
    parser.add_argument("--num-prompts", type=int, default=d.num_prompts, help="prompts per set")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens, help="output tokens per request")
    parser.add_argument("--repeats", type=int, default=d.repeats, help="measured repetitions (after a warm-up)")
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=METHOD_FAMILIES,
        default=list(d.methods),
        help="methods to measure (default: all)",
    )
    parser.add_argument("--block-sizes", type=int, nargs="+", default=list(d.block_sizes), help="B of dflash/dflash2")
    parser.add_argument(
        "--temperatures",
        type=float,
        nargs="+",
        default=list(d.temperatures),
        help="sampling temperatures (0 = greedy) (default: %(default)s)",
    )
    parser.add_argument(
        "--prompt-lookup-tokens",
        type=int,
        default=d.prompt_lookup_tokens,
        help="prompt_lookup_num_tokens of transformers' prompt lookup, the hf-pld row "
        "(the engine's own is --prompt-lookup-max)",
    )
    parser.add_argument("--gguf", type=Path, default=d.gguf, help="GGUF for llama.cpp (default: derived, see docs)")
    parser.add_argument(
        "--gguf-types",
        nargs="*",
        choices=list(GGUF_TYPES),
        default=list(d.gguf_types),
        metavar="TYPE",
        help="also measure llama.cpp on GGUF files of these tensor types (rows llama.cpp-Q4_1, …): the model's own "
        f"file for its type, others requantized from it ({', '.join(GGUF_TYPES)})",
    )
    parser.add_argument(
        "--quantization-rows",
        nargs="*",
        choices=list(QUANTIZATION_CHOICES),
        default=list(d.quantization_rows),
        metavar="Q",
        help="also measure the autoregressive row and each dflash2 default (adaptive) row with --quantization Q "
        "(rows ar-quant-none, dflash2-b8-adaptive-quant-gguf, …)",
    )
    parser.add_argument(
        "--single-stream", action=argparse.BooleanOptionalAction, default=d.single_stream, help="batch-1 speed"
    )
    parser.add_argument(
        "--eager-rows",
        action=argparse.BooleanOptionalAction,
        default=d.eager_rows,
        help="also measure each engine method with --enforce-eager (rows ar-eager, dflash2-b8-eager, …)",
    )
    parser.add_argument(
        "--adaptive-rows",
        action=argparse.BooleanOptionalAction,
        default=d.adaptive_rows,
        help="also measure each dflash2 method with the adaptive verify width (rows dflash2-b8-adaptive)",
    )
    parser.add_argument(
        "--tree-nodes",
        type=int,
        nargs="*",
        default=list(d.tree_nodes),
        metavar="N",
        help="also measure each dflash2 method verifying token trees of N nodes at full blocks "
        "(rows dflash2-b8-tree-N; none when given no value) (default: %(default)s)",
    )
    parser.add_argument(
        "--tree-topk",
        type=int,
        default=d.tree_topk,
        help="branching per depth of the tree rows (default: %(default)s)",
    )
    parser.add_argument(
        "--tp-rows",
        type=int,
        nargs="*",
        default=list(d.tensor_parallel_rows),
        metavar="N",
        help="also measure the autoregressive row and each dflash2 default (adaptive) row with the target split "
        "over N ranks (rows ar-tpN, dflash2-b8-adaptive-tpN; on CPU the ranks share the --threads cores)",
    )
    parser.add_argument(
        "--startup",
        action=argparse.BooleanOptionalAction,
        default=d.startup,
        help="measure start-up to ready with an empty and a warm compile cache",
    )
    parser.add_argument("--serving", action=argparse.BooleanOptionalAction, default=d.serving, help="serving load")
    parser.add_argument("--url", default=d.url, help="load this running server (loopback) instead of starting ones")
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(d.concurrency), help="streams per level")
    parser.add_argument("--serving-requests", type=int, default=d.serving_requests, help="requests per round")
    parser.add_argument("--serving-seconds", type=float, default=d.serving_seconds, help="time bound per round")
    parser.add_argument(
        "--serving-rounds",
        type=int,
        default=d.serving_rounds,
        help="rounds of every serving level, the servers' order alternating; each level reports the median over its "
        "rounds (use an odd number) (default: %(default)s)",
    )
    parser.add_argument(
        "--serving-temperature",
        type=float,
        default=d.serving_temperature,
        help="temperature of the serving requests (default: %(default)s)",
    )
    parser.add_argument(
        "--agents",
        action=argparse.BooleanOptionalAction,
        default=d.agents,
        help="multi-turn agent workload: TTFT and hit rate with and without the prefix cache",
    )
    parser.add_argument(
        "--agent-history-tokens", type=int, default=d.agent_history_tokens, help="shared system prompt, in tokens"
    )
    parser.add_argument("--agent-conversations", type=int, default=d.agent_conversations, help="conversations")
    parser.add_argument("--agent-turns", type=int, default=d.agent_turns, help="questions per conversation")
    parser.add_argument("--agent-max-tokens", type=int, default=d.agent_max_tokens, help="output tokens per answer")
    parser.add_argument(
        "--agent-loop",
        action=argparse.BooleanOptionalAction,
        default=d.agent_loop,
        help="agent-loop workload: tool-call, JSON and text turns of scripted agents, τ and tok/s per turn kind "
        "on each --agent-loop-servers server, started one after another",
    )
    parser.add_argument(
        "--agent-loop-servers",
        nargs="+",
        choices=list(AGENT_LOOP_SERVERS),
        default=list(d.agent_loop_servers),
        help="servers of the agent-loop workload (default: all)",
    )
    parser.add_argument(
        "--agent-loop-conversations",
        type=int,
        default=d.agent_loop_conversations,
        help=f"scripted conversations, 1 to {AGENT_LOOP_MAX_CONVERSATIONS} (default: %(default)s)",
    )
    parser.add_argument(
        "--agent-loop-max-tokens",
        type=int,
        default=d.agent_loop_max_tokens,
        help="output tokens per agent-loop reply (default: %(default)s)",
    )


def add_generate_args(gen: argparse.ArgumentParser) -> None:
    """Flags of ``dflash2 generate``."""
    gen.add_argument("--prompt", required=True, help="the user message (chat template applied unless --raw)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--max-tokens", type=int, default=256, help="output tokens at most (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    gen.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = off)")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument(
        "--request-seed",
        dest="seed_request",
        metavar="SEED",
        type=int,
        default=None,
        help="seed of this request (reproducible sampling)",
    )
    add_engine_args(gen)
    # One prompt: one KV slot (and only the batch-1 graphs to compile).
    gen.set_defaults(func=_generate, max_num_seqs=1)


def add_data_args(data: argparse.ArgumentParser) -> None:
    """Flags of ``dflash2 data`` (defaults from ``DataConfig``)."""
    from dflash2.train.data import DataConfig

    d = DataConfig()
    data.add_argument("--out", required=True, help="output folder (dataset.safetensors, manifest.json, …)")
    data.add_argument(
        "--num-prompts", type=int, default=d.num_prompts, help="prompts to synthesize (0 = only --prompts)"
    )
    data.add_argument("--prompts", type=Path, default=None, help="JSONL of {prompt} or {messages} to add")
    data.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=d.max_prompt_tokens,
        help="longest synthesized user message (default: %(default)s)",
    )
    data.add_argument(
        "--max-response-tokens", type=int, default=d.max_response_tokens, help="longest answer (default: %(default)s)"
    )
    data.add_argument(
        "--response-temperature",
        type=float,
        default=d.response_temperature,
        help="temperature of the answers (default: %(default)s = greedy)",
    )
    data.add_argument(
        "--multi-turn-fraction",
        type=float,
        default=d.multi_turn_fraction,
        help="share of conversations with a follow-up turn (default: %(default)s)",
    )
    data.add_argument(
        "--heldout-fraction",
        type=float,
        default=d.heldout_fraction,
        help="share of prompts held out of training (default: %(default)s)",
    )
    data.add_argument(
        "--data-seed",
        type=int,
        default=d.seed,
        help="seed of topics, temperatures and the split (default: %(default)s)",
    )
    add_engine_args(data, UNUSED_ENGINE_FLAGS["data"])
    data.set_defaults(func=_data, max_num_seqs=16)


def add_train_args(train: argparse.ArgumentParser) -> None:
    """Flags of ``dflash2 train`` (defaults from ``TrainConfig``)."""
    from dflash2.train.trainer import TrainConfig

    t = TrainConfig()
    train.add_argument("--data", type=Path, required=True, help="folder written by `dflash2 data`")
    train.add_argument("--run-dir", type=Path, required=True, help="checkpoints and log.jsonl (resumed if present)")
    train.add_argument("--out", type=Path, required=True, help="export folder (config.json + model.safetensors)")
    train.add_argument("--features", type=Path, default=None, help="feature cache file (default: in --data)")
    train.add_argument("--steps", type=int, default=t.steps, help="optimizer steps (default: %(default)s)")
    train.add_argument("--time-budget", type=float, default=None, help="stop after this many seconds")
    train.add_argument(
        "--train-block-size", type=int, default=t.block_size, help="block size B trained at (default: %(default)s)"
    )
    train.add_argument("--num-layers", type=int, default=t.num_layers, help="drafter layers (default: %(default)s)")
    train.add_argument("--no-conv", action="store_true", help="no DFlash 2 dynamic convolution")
    train.add_argument(
        "--no-train-selector", dest="no_selector", action="store_true", help="no DFlash 2 candidate selector"
    )
    train.add_argument(
        "--selector-rank", type=int, default=t.selector_rank, help="selector rank r (default: %(default)s)"
    )
    train.add_argument(
        "--selector-top-k", type=int, default=t.selector_top_k, help="candidates per slot (default: %(default)s)"
    )
    train.add_argument(
        "--selector-alpha",
        type=float,
        default=t.selector_alpha,
        help="weight of the selector loss (default: %(default)s)",
    )
    train.add_argument(
        "--draft-vocab-size",
        type=int,
        default=t.draft_vocab_size,
        help="restrict the drafter's LM head to this many frequency-ranked tokens (0 = full vocabulary)",
    )
    train.add_argument("--lr", type=float, default=t.lr, help="peak AdamW learning rate (default: %(default)s)")
    train.add_argument(
        "--blocks-per-step",
        type=int,
        default=t.blocks_per_step,
        help="blocks per optimizer step (default: %(default)s)",
    )
    train.add_argument(
        "--distill-weight",
        type=float,
        default=t.distill_weight,
        help="β of (1−β)·CE(hard label) + β·CE(target's top-k distribution); >0 caches the target's "
        "top-k log-probabilities with the features (default: %(default)s)",
    )
    train.add_argument(
        "--distill-top-k",
        type=int,
        default=t.distill_top_k,
        help="entries of the target's distribution kept per token for --distill-weight (default: %(default)s)",
    )
    train.add_argument(
        "--anchors-per-sequence",
        type=int,
        default=t.anchors_per_sequence,
        help="blocks drawn from one conversation at most (default: %(default)s)",
    )
    train.add_argument(
        "--no-init-from-target",
        action="store_true",
        help="random drafter layers instead of copies of the target's last layers",
    )
    train.add_argument(
        "--init-drafter",
        type=Path,
        default=None,
        help="start from this exported drafter's weights (continue training in a new run)",
    )
    train.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    train.add_argument(
        "--train-seed", type=int, default=t.seed, help="seed of initialisation and sampling (default: %(default)s)"
    )
    train.add_argument(
        "--checkpoint-every",
        type=int,
        default=t.checkpoint_every,
        help="steps between checkpoints (default: %(default)s)",
    )
    train.add_argument(
        "--eval-every",
        type=int,
        default=t.eval_every,
        help="steps between held-out evaluations: teacher-forced τ and top-1, logged and plotted "
        "(0 = never; default: %(default)s)",
    )
    add_engine_args(train, UNUSED_ENGINE_FLAGS["train"])
    train.set_defaults(func=_train)


def add_eval_args(ev: argparse.ArgumentParser) -> None:
    """Flags of ``dflash2 eval``."""
    ev.add_argument("--out", type=Path, required=True, help="folder for eval.json, eval.md and acceptance.png")
    ev.add_argument("--data", type=Path, default=None, help="`dflash2 data` folder (held-out prompts, recall)")
    ev.add_argument(
        "--sets",
        nargs="+",
        choices=PROMPT_SETS,
        default=None,
        help="prompt sets (default: all; heldout needs --data)",
    )
    ev.add_argument(
        "--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="sampling temperatures (default: %(default)s)"
    )
    ev.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16], help="block sizes (default: %(default)s)")
    ev.add_argument("--num-prompts", type=int, default=16, help="prompts per set (default: %(default)s)")
    ev.add_argument(
        "--num-recall-sequences",
        type=int,
        default=64,
        help="held-out conversations for Recall@k and the teacher-forced tau (the chained tau uses the first "
        "--num-prompts of them); 0 skips them (default: %(default)s)",
    )
    ev.add_argument("--max-tokens", type=int, default=128, help="output tokens per prompt (default: %(default)s)")
    add_engine_args(ev, UNUSED_ENGINE_FLAGS["eval"])
    ev.set_defaults(func=_eval)


def build_parser() -> argparse.ArgumentParser:
    """The ``dflash2`` argument parser with all subcommands."""
    parser = argparse.ArgumentParser(prog="dflash2", description="DFlash 2 speculative decoding")
    parser.add_argument("--log-level", default=default_log_level(), help=LOG_LEVEL_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt and print a speed summary")
    add_generate_args(gen)
    data = sub.add_parser("data", help="synthesize a drafter training set from the target itself")
    add_data_args(data)
    train = sub.add_parser("train", help="train a DFlash / DFlash 2 drafter against the target")
    add_train_args(train)
    ev = sub.add_parser("eval", help="acceptance length, per-position acceptance and recall of a drafter")
    add_eval_args(ev)

    from server.settings import add_server_args  # standard library only: no FastAPI while parsing

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (docs/server.md)")
    add_server_args(srv)
    add_engine_args(srv)
    srv.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="speed vs peers at batch 1, serving load, report (docs/benchmarks.md)")
    add_bench_args(bench)
    add_engine_args(bench)
    # The bench's own default (fixed threads, BenchConfig), not the engine's.
    bench.set_defaults(func=_bench, adaptive_threads=_BENCH_DEFAULTS.engine.adaptive_threads)
    for subparser in sub.choices.values():
        # Also accepted after the subcommand (container CMD / Kubernetes args append there).
        subparser.add_argument("--log-level", default=argparse.SUPPRESS, help=LOG_LEVEL_HELP)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dflash2`` command."""
    args = build_parser().parse_args(argv)
    args.command_line = shlex.join(["dflash2", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except ValueError as exc:  # ModelSourceError, ModelLoadError and bad arguments
        print(f"dflash2: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
