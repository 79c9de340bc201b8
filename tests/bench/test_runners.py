"""The runners in-process on the tiny folder: this engine (counters, conv probe) and transformers generate."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from dflash2.bench.conv_probe import convs_disabled, measure_conv_overhead
from dflash2.bench.gguf_export import choose_gguf, dequantize_gguf, typed_gguf
from dflash2.bench.runners import EngineRunner, TransformersRunner
from dflash2.config import EngineConfig
from dflash2.models import loader
from tests.bench.conftest import TinyFolders


def _prompt(folder: Path) -> list[int]:
    tokenizer = loader.load_tokenizer(folder)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Add 2 and 3."}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(text))


def _engine_runner(tiny: TinyFolders, block_size: int) -> EngineRunner:
    config = EngineConfig(
        model=str(tiny.model),
        drafter=str(tiny.drafter),
        block_size=block_size,
        max_num_seqs=1,
        device="cpu",
        dtype="float32",
        num_threads=1,
        enforce_eager=True,
        speculative_adaptive=False,  # full blocks, as the benchmark's single-stream engine rows run
    )
    return EngineRunner(config)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("prompt_lookup_tokens", [0, 4])
def test_transformers_generate_on_the_tiny_folder(
    tiny_folders: TinyFolders, temperature: float, prompt_lookup_tokens: int
) -> None:
    runner = TransformersRunner(tiny_folders.model, torch.float32, torch.device("cpu"), [257], prompt_lookup_tokens)
    config = runner.generation_config(6, temperature)
    assert config.do_sample == (temperature > 0)
    if temperature > 0:
        assert (config.top_k, config.top_p, config.temperature) == (0, 1.0, temperature)  # full-vocabulary sampling
    sample = runner.generate(_prompt(tiny_folders.model), 6, temperature, seed=0)
    assert 1 <= sample.num_output_tokens <= 6
    assert 0 < sample.ttft <= sample.seconds
    assert runner.describe()["prompt_lookup_num_tokens"] == (prompt_lookup_tokens or None)


def test_transformers_greedy_matches_this_engine(tiny_folders: TinyFolders) -> None:
    """Same folder, same prompt ids, greedy: both make the same number of tokens (same stop, same length)."""
    prompt = _prompt(tiny_folders.model)
    hf = TransformersRunner(tiny_folders.model, torch.float32, torch.device("cpu"), [257]).generate(prompt, 8, 0.0, 0)
    ours = _engine_runner(tiny_folders, 1).generate(prompt, 8, 0.0, 0)
    assert hf.num_output_tokens == ours.num_output_tokens


def test_engine_runner_sends_unseeded_requests(tiny_folders: TinyFolders, monkeypatch: pytest.MonkeyPatch) -> None:
    """A seeded request verifies full blocks without prompt lookup; the benchmark measures the engine a
    user without a seed gets, so its requests carry none (sampling draws from the engine's seed)."""
    runner = _engine_runner(tiny_folders, 4)
    sent = []
    stream = runner.llm.stream
    monkeypatch.setattr(runner.llm, "stream", lambda prompt, params: sent.append(params) or stream(prompt, params))
    runner.generate(_prompt(tiny_folders.model), 4, 1.0, seed=7)
    assert [p.seed for p in sent] == [None] and sent[0].temperature == 1.0


def test_engine_runner_counts_verify_steps_and_the_cost_split(tiny_folders: TinyFolders) -> None:
    runner = _engine_runner(tiny_folders, 4)
    sample = runner.generate(_prompt(tiny_folders.model), 12, 0.0, seed=0)
    assert sample.num_output_tokens >= 1
    committed_after_prefill = sample.num_output_tokens - 1
    # each verify step commits its accepted drafts + 1 (one less when EOS lands inside the accepted drafts)
    assert 0 <= sample.num_verify_steps + sample.num_accepted_tokens - committed_after_prefill <= 1
    assert len(sample.drafted_per_position) == 3
    assert sum(sample.accepted_per_position) == sample.num_accepted_tokens
    assert sample.num_decode_steps == sample.num_verify_steps - 1  # the first cycle shares a step with the prefill
    assert sample.decode_time >= sample.draft_time + sample.select_time + sample.verify_time > 0
    info = runner.describe()
    assert info["block_size"] == 4 and info["has_conv"] and info["drafter"] == str(tiny_folders.drafter)


def test_sync_timing_matches_the_engine_and_times_every_phase(tiny_folders: TinyFolders) -> None:
    """The runner's synchronizing phase timing (the benchmark's, for CUDA) runs on CPU too: same
    tokens, same phases timed."""
    from dflash2.engine import Engine
    from dflash2.sampling import SamplingParams

    config = EngineConfig(
        model=str(tiny_folders.model),
        drafter=str(tiny_folders.drafter),
        block_size=4,
        device="cpu",
        dtype="float32",
        enforce_eager=True,
        speculative_adaptive=False,  # every step drafts, so every phase is timed (the policy may choose none)
    )
    prompt = _prompt(tiny_folders.model)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for sync_timing in (False, True):
        engine = Engine.from_config(config)
        engine.runner.sync_timing = sync_timing
        engine.add_request(prompt, params)
        tokens, times = [], [0.0, 0.0, 0.0]
        while engine.has_unfinished_requests():
            result = engine.step()
            tokens += [t for o in result.outputs for t in o.new_token_ids]
            times = [
                a + b
                for a, b in zip(times, (result.stats.draft_time, result.stats.select_time, result.stats.verify_time))
            ]
        outputs[sync_timing] = tokens
        assert all(t > 0 for t in times)
    assert len(outputs[False]) == 12 and outputs[True] == outputs[False]


def test_conv_probe_times_both_variants_and_leaves_the_drafter_intact(tiny_folders: TinyFolders) -> None:
    runner = _engine_runner(tiny_folders, 4)
    drafter = runner.engine.drafter
    assert drafter is not None
    prompt = _prompt(tiny_folders.model)
    before = runner.generate(prompt, 8, 0.0, seed=0)
    probe = measure_conv_overhead(runner, prompt, 8, repeats=2)
    after = runner.generate(prompt, 8, 0.0, seed=0)
    assert probe["num_calls"] >= 1 and probe["num_pairs"] == 2 * probe["num_calls"]
    assert probe["with_conv_ms"] > 0 and probe["without_conv_ms"] > 0
    assert "draft_hidden" not in vars(drafter)  # the interception is gone
    assert all(layer.attention_conv is not None and layer.mlp_conv is not None for layer in drafter.draft_layers())
    assert (before.num_output_tokens, before.num_accepted_tokens) == (
        after.num_output_tokens,
        after.num_accepted_tokens,
    )


def test_conv_probe_says_why_it_skips_a_compiled_drafter(
    tiny_folders: TinyFolders, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compiled drafter never calls ``draft_hidden``: the probe says so instead of timing nothing."""
    runner = _engine_runner(tiny_folders, 4)
    monkeypatch.setattr(type(runner.engine.runner), "drafter_compiled", property(lambda self: True))
    probe = measure_conv_overhead(runner, _prompt(tiny_folders.model), 8, repeats=2)
    assert probe == {"skipped": "the drafter runs compiled (see the eager row)"}


def test_convs_disabled_changes_the_forward_and_restores(tiny_folders: TinyFolders) -> None:
    runner = _engine_runner(tiny_folders, 4)
    drafter = runner.engine.drafter
    assert drafter is not None
    with convs_disabled(drafter):
        assert all(layer.attention_conv is None and layer.mlp_conv is None for layer in drafter.draft_layers())
    assert all(layer.attention_conv is not None for layer in drafter.draft_layers())


def test_no_gguf_for_a_plain_transformers_folder(tiny_folders: TinyFolders) -> None:
    choice = choose_gguf(str(tiny_folders.model), tiny_folders.model, "float32", None)
    assert choice.path is None and "--gguf" in choice.note
    missing = choose_gguf(None, tiny_folders.model, "float32", tiny_folders.model / "nope.gguf")
    assert missing.path is None and "does not exist" in missing.note


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
def test_dequantize_gguf_keeps_metadata_and_values(tmp_path: Path, dtype_name: str) -> None:
    source = tmp_path / "q.gguf"
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((8, 64)).astype(np.float32)
    norm = np.ones(64, dtype=np.float32)
    writer = gguf.GGUFWriter(str(source), "llama")
    writer.add_name("tiny")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_token_list(["a", "b"])
    quantized = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("w", quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("norm", norm)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    target = dequantize_gguf(source, tmp_path / "out.gguf", dtype_name)
    reader = gguf.GGUFReader(target)
    assert reader.fields["general.name"].contents() == "tiny"
    assert reader.fields["tokenizer.ggml.tokens"].contents() == ["a", "b"]
    assert reader.fields["general.file_type"].contents() == {"float32": 0, "float16": 1, "bfloat16": 32}[dtype_name]
    tensors = {t.name: t for t in reader.tensors}
    expected = gguf.quants.dequantize(quantized, gguf.GGMLQuantizationType.Q8_0)
    written = gguf.quants.dequantize(tensors["w"].data, tensors["w"].tensor_type)
    assert written.shape == (8, 64)
    np.testing.assert_allclose(written, expected, rtol=1e-2, atol=1e-2)
    assert tensors["norm"].tensor_type == gguf.GGMLQuantizationType.F32  # norms stay float32


def test_typed_gguf_uses_the_file_of_that_type_or_requantizes_it(tmp_path: Path) -> None:
    source = tmp_path / "m.Q8_0.gguf"
    weight = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    writer = gguf.GGUFWriter(str(source), "llama")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_tensor(
        "w", gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0
    )
    writer.add_tensor("norm", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    own = typed_gguf(str(source), tmp_path, "Q8_0")
    assert own.path == source and "its own Q8_0 file" in own.note
    derived = typed_gguf(str(source), tmp_path, "Q4_0")
    assert derived.path is not None and derived.path != source
    reader = gguf.GGUFReader(derived.path)
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["w"].tensor_type == gguf.GGMLQuantizationType.Q4_0
    assert tensors["norm"].tensor_type == gguf.GGMLQuantizationType.F32
    assert reader.fields["general.file_type"].contents() == 2  # MOSTLY_Q4_0
    written = gguf.quants.dequantize(tensors["w"].data, tensors["w"].tensor_type)
    np.testing.assert_allclose(written, weight, atol=0.2 * np.abs(weight).max())  # 4-bit rounding of the same weights


def test_workers_load_one_at_a_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each worker is started only once the one before is ready: a loading engine times its step costs
    (adaptive speculation), and another worker loading beside it would skew that table."""
    from dflash2.bench import single_stream
    from dflash2.bench.config import BenchConfig
    from dflash2.bench.workload import Workload

    events: list[str] = []

    class FakeHandle:
        def __init__(self, name: str, spec: dict, log_path: Path) -> None:
            self.name = name

        def start(self) -> None:
            events.append(f"start {self.name}")

        def wait_ready(self, timeout: float) -> dict:
            events.append(f"ready {self.name}")
            return {"load_seconds": 1.0, "info": {}}

    monkeypatch.setattr(single_stream, "WorkerHandle", FakeHandle)
    config = BenchConfig(methods=("ar", "dflash2"), block_sizes=(4,))
    session = single_stream._Session(config, Workload(tmp_path, [], 64), progress=lambda _: None)
    session.start([0], tmp_path)
    names = [m.id for m in config.method_specs()]
    assert len(names) >= 2
    assert events == [e for name in names for e in (f"start {name}", f"ready {name}")]


def test_a_worker_killed_by_a_signal_is_a_crash_not_a_failure(tmp_path: Path) -> None:
    """A peer whose native code segfaults (llama.cpp's AMX build did) is reported as crashed, with the signal."""
    import subprocess
    import sys

    from dflash2.bench.worker import WorkerHandle

    handle = WorkerHandle("llama.cpp-Q4_1", {}, tmp_path / "w.log")
    handle.process = subprocess.Popen(
        [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"], text=True
    )
    handle.process.wait()
    assert handle.crashed and handle.exit_description() == "crashed: killed by signal SIGSEGV"
    handle.process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], text=True)
    handle.process.wait()
    assert not handle.crashed and handle.exit_description() == "the worker exited with 3"
