"""Tensor parallelism on CPU with gloo (2 ranks): the same tokens as one process, the target's distribution
when sampling, slots freed on every rank, and a clear end when a worker rank dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from dflash2 import LLM, EngineConfig, SamplingParams
from dflash2.engine import Engine
from dflash2.models import loader, source
from dflash2.models.tensor_parallel import shard_target
from dflash2.runner.tensor_parallel import TensorParallelError
from dflash2.runner.tensor_parallel_worker import start_workers
from tests.integration.test_engine_sampling import PROMPT, SAMPLING_CASES, VOCAB, _chi_square_pvalue, _exact_joint
from tests.integration.test_prompt_lookup_engine import FixedCosts
from tests.tiny import tiny_drafter, tiny_target

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [7, 8, 9, 7, 8], [10] * 20, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def save_target(target, folder: Path) -> Path:
    """``target`` in Hugging Face layout (config.json and safetensors), so worker ranks can load it."""
    folder.mkdir(parents=True, exist_ok=True)
    target.config.save_pretrained(folder)
    save_file({f"model.{k}": v.detach().contiguous() for k, v in target.state_dict().items()}, folder / "w.safetensors")
    return folder


def engine_for(folder: Path, world_size: int, block_size: int | None = 8, drafter_seed: int | None = 1, **kwargs):
    """An engine over the target in ``folder``: one process, or rank 0 of ``world_size`` with the workers
    started; the drafter (``tiny_drafter``, bound to the whole target) stays on rank 0."""
    kwargs.setdefault("speculative_adaptive", False)
    kwargs.setdefault("enforce_eager", True)
    config = EngineConfig(
        model=str(folder),
        device="cpu",
        dtype="float32",
        block_size=block_size if drafter_seed is not None else 1,
        max_model_len=256,
        adaptive_threads=False,
        tensor_parallel_size=world_size,
        **kwargs,
    )
    group = start_workers(config) if world_size > 1 else None
    target = loader.load_target(folder, torch.float32, torch.device("cpu"))
    drafter = None
    if drafter_seed is not None:
        drafter = tiny_drafter(target, 2, block_size or 8, seed=drafter_seed)
    if group is not None:
        shard_target(target, group.shard)
    return Engine(config, target, None, drafter, tensor_parallel=group)


def generate(engine: Engine, prompts, params, close: bool = True):
    try:
        return [c.token_ids for c in LLM.from_engine(engine).generate(prompts, params)]
    finally:
        if close:
            engine.close()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_target(tiny_target(vocab_size=16, seed=5), tmp_path_factory.mktemp("tp") / "target")


@pytest.fixture(scope="module")
def reference(folder):
    return generate(engine_for(folder, 1, drafter_seed=None), PROMPTS, GREEDY)


@pytest.mark.parametrize(
    ("mode", "kwargs"),
    [
        ("autoregressive", {"drafter_seed": None}),
        ("chain", {}),
        ("tree", {"speculative_topk": 2}),
        ("lookup", {"speculative_adaptive": True, "prompt_lookup_min": 1}),
    ],
)
def test_greedy_with_two_ranks_equals_one_process(folder, reference, mode, kwargs):
    engine = engine_for(folder, 2, max_num_seqs=4, **kwargs)
    assert engine.tensor_parallel is not None and engine.tensor_parallel.world_size == 2
    steps = []
    if mode == "lookup":  # every verify forward costs the same: lookup's free drafts win where a row matches
        engine.policy.cost_model = FixedCosts(4, engine.cost_model.widths, 0.002)
    try:
        outputs = LLM.from_engine(engine).generate(PROMPTS, GREEDY, on_step=lambda r: steps.append(r.stats))
    finally:
        engine.close()
    assert [c.token_ids for c in outputs] == reference
    if mode != "autoregressive":
        assert sum(c.num_accepted_tokens for c in outputs) > 0
    if mode == "lookup":
        assert any(s.num_lookup_drafts for s in steps)
    if mode == "tree":
        assert any(s.num_tree_nodes for s in steps)


def test_compiled_ranks_equal_one_process(folder, reference):
    engine = engine_for(folder, 2, drafter_seed=None, max_num_seqs=4, enforce_eager=False)
    assert engine.runner.compiled
    assert generate(engine, PROMPTS, GREEDY) == reference


def test_seeded_sampling_with_two_ranks_gives_the_same_tokens(folder):
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=i, ignore_eos=True) for i in range(4)]
    one = generate(engine_for(folder, 1, max_num_seqs=4), PROMPTS, params)
    assert generate(engine_for(folder, 2, max_num_seqs=4), PROMPTS, params) == one


def test_sampling_with_two_ranks_matches_target_distribution(tmp_path):
    """As ``test_speculative_sampling_matches_target_distribution``: 3000 seeded requests, a drafter whose
    2 candidates of 8 tokens leave most of the target's mass to the residual; chi-square p > 1e-3."""
    target = tiny_target(vocab_size=VOCAB, seed=7)
    folder = save_target(target, tmp_path / "target")
    engine = engine_for(folder, 2, block_size=4, max_num_seqs=64)
    engine.drafter.config.__dict__["selector_top_k"] = 2  # frozen dataclass: narrow the candidates
    assert engine.num_candidates == 2
    base = SAMPLING_CASES["temperature"]
    params = [SamplingParams(**{**base.__dict__, "seed": i}) for i in range(3000)]
    try:
        outputs = LLM.from_engine(engine).generate([PROMPT] * len(params), params)
    finally:
        engine.close()
    assert sum(o.num_accepted_tokens for o in outputs) > 0
    exact: dict[tuple[int, ...], float] = {}
    for k, p in _exact_joint(target, base, 4).items():
        exact[k[1:]] = exact.get(k[1:], 0.0) + p
    assert _chi_square_pvalue([tuple(o.token_ids[1:]) for o in outputs], exact) > 1e-3


def test_an_aborted_request_leaves_every_rank_ready_for_the_next(folder, reference):
    """An abort mid-generation frees the slot on rank 0 and, with the next forward's message, on the
    workers: the prompts decoded next, one of them in that slot, give the one-process text."""
    engine = engine_for(folder, 2, max_num_seqs=2)
    try:
        request_id = engine.add_request([1, 2, 3], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        for _ in range(3):
            engine.step()
        engine.abort(request_id)
        engine.step()
        assert not engine.has_unfinished_requests()
        assert generate(engine, PROMPTS, GREEDY, close=False) == reference
    finally:
        engine.close()


def test_a_killed_worker_fails_the_engine_naming_its_rank(folder):
    engine = engine_for(folder, 2, max_num_seqs=2)
    messages = []
    engine.add_failure_listener(messages.append)
    worker = engine.tensor_parallel.processes[0]
    os.kill(worker.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while engine.fatal_error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.fatal_error is not None and "rank 1" in engine.fatal_error
    assert messages == [engine.fatal_error]
    with pytest.raises(TensorParallelError, match="rank 1"):
        generate(engine, PROMPTS[:1], GREEDY)


def _spawned_children(pid: int) -> list[int]:
    """Child processes of ``pid`` started by multiprocessing's spawn (the workers; not its resource tracker)."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            children.append(int(entry.name))
    return children


def test_the_server_exits_non_zero_when_a_worker_is_killed(tmp_path):
    from tests.bench.tiny_folder import write_tiny_model
    from tests.server.test_cli import free_port

    model = write_tiny_model(tmp_path / "model")
    port = free_port()
    command = [sys.executable, "-m", "server", "--model", str(model), "--dtype", "float32", "--port", str(port)]
    command += ["--tensor-parallel-size", "2", "--enforce-eager", "--max-model-len", "256"]
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None, log_path.read_text()[-2000:]
            time.sleep(0.2)
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": str(model), "prompt": "hello", "max_tokens": 4},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        workers = _spawned_children(server.pid)
        assert len(workers) == 1
        killed = time.monotonic()
        os.kill(workers[0], signal.SIGKILL)
        server.wait(timeout=30)
        assert time.monotonic() - killed < 15
        output = log_path.read_text()
        assert server.returncode != 0, output[-2000:]
        assert "error: the engine stopped: tensor-parallel worker rank 1" in output and "killed by signal 9" in output
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


@pytest.mark.slow
def test_smollm2_with_two_ranks_equals_one_process():
    """The embedded SmolLM2-135M in float32 (9 query and 3 KV heads: ranks hold 6 + 3 query heads, 2 + 1 KV
    heads), autoregressive and with its shipped drafter."""
    folder = source.resolve_model(None)
    tokenizer = loader.load_tokenizer(folder)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "List three prime numbers."}], add_generation_prompt=True, tokenize=False
    )
    params = SamplingParams(max_tokens=24, temperature=0.0)
    common = {"dtype": "float32", "device": "cpu", "enforce_eager": True, "max_model_len": 512, "max_num_seqs": 2}
    results = {}
    for world_size in (1, 2):
        for block_size in (1, None):
            llm = LLM(tensor_parallel_size=world_size, block_size=block_size, adaptive_threads=False, **common)
            try:
                results[(world_size, block_size)] = llm.generate([prompt], params)[0].token_ids
            finally:
                llm.engine.close()
    assert results[(2, 1)] == results[(1, 1)]
    assert results[(2, None)] == results[(1, None)] == results[(1, 1)]


def test_a_model_that_cannot_split_fails_before_any_process_starts(monkeypatch):
    def no_launch(config):
        raise AssertionError("workers were started")

    monkeypatch.setattr("dflash2.engine.llm_engine.start_workers", no_launch)
    # SmolLM2: 3 KV heads, which 4 ranks can neither split nor share evenly.
    with pytest.raises(ValueError, match="--tensor-parallel-size 4 cannot split this model"):
        Engine.from_config(EngineConfig(tensor_parallel_size=4, device="cpu", dtype="float32"))
