"""Serving quantized targets: greedy speculative output equals greedy autoregressive output on the quantized
model (chains, trees, prompt lookup, batches, compiled), the sampled path keeps the quantized target's
distribution, a GGUF file's K-quant tensors load as the same weights, and what cannot run says so."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from dflash2 import LLM, SamplingParams
from dflash2.config import EngineConfig
from dflash2.engine_args import add_engine_args
from dflash2.models import cpu_kernels
from dflash2.models.llama import TargetModel
from dflash2.models.loader import save_drafter
from dflash2.models.quant import QuantizedLinear
from dflash2.models.quantize import (
    QuantizationError,
    quantize_drafter,
    quantize_from_gguf,
    quantize_target,
    resolve_method,
)
from tests.integration.test_engine_sampling import SAMPLING_CASES, VOCAB, _chi_square_pvalue, _exact_joint
from tests.integration.test_prompt_lookup_engine import decode_steps, lookup_engine
from tests.tiny import tiny_drafter, tiny_engine, tiny_target

pytestmark = pytest.mark.skipif(not cpu_kernels.QUANT.available(), reason="needs AVX2, FMA, F16C and a compiler")

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10] * 20, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def quantized_target(method: str, vocab_size: int = 96, seed: int = 0, model_type: str = "llama") -> TargetModel:
    target = tiny_target(model_type, vocab_size=vocab_size, seed=seed)
    report = quantize_target(target, method)
    assert report.formats == {method: 4 * 7 + 1}  # every decoder linear and the LM head
    assert isinstance(target.lm_head, QuantizedLinear)
    return target


@pytest.fixture(scope="module", params=["int4", "int8"])
def target(request):
    return quantized_target(request.param)


@pytest.fixture(scope="module")
def reference(target):
    return [c.token_ids for c in LLM.from_engine(tiny_engine(target, None)).generate(PROMPTS, GREEDY)]


def test_quantization_changes_the_model_but_not_much():
    dense, quantized = tiny_target(), quantized_target("int8")
    x = torch.randint(0, 96, (1, 12))
    from dflash2.models.batch import ForwardBatch
    from dflash2.models.kv_cache import KVCache

    logits = []
    for model in (dense, quantized):
        cache = KVCache(model.num_layers, 1, 2, 32, 16, torch.float32, "cpu")
        out, _ = model.run(ForwardBatch.build([0], [x[0].tolist()], [0], "cpu"), cache, last_only=False)
        logits.append(out)
    assert not torch.equal(logits[0], logits[1])
    torch.testing.assert_close(logits[1], logits[0], rtol=0.1, atol=0.5)


@pytest.mark.parametrize("block_size", [2, 8])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_chain_equals_autoregressive(target, reference, block_size, batch):
    drafter = tiny_drafter(target, 2, block_size)
    llm = LLM.from_engine(tiny_engine(target, drafter, block_size, max_num_seqs=batch))
    outputs = llm.generate(PROMPTS[:batch] if batch == 1 else PROMPTS, GREEDY)
    assert [c.token_ids for c in outputs] == reference[: len(outputs)]


def test_greedy_tree_equals_autoregressive(target, reference):
    engine = tiny_engine(target, tiny_drafter(target, 2, 8), 8, speculative_topk=2, speculative_num_draft_tokens=12)
    outputs = LLM.from_engine(engine).generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in outputs] == reference


def test_greedy_with_prompt_lookup_equals_autoregressive():
    target = quantized_target("int4", vocab_size=16, seed=5)
    engine = lookup_engine(target, tiny_drafter(target, 2, 8), draft_cost=0.002, prompt_lookup_min=1)
    reference = LLM.from_engine(tiny_engine(target, None)).generate(PROMPTS, GREEDY)
    outputs, steps = decode_steps(LLM.from_engine(engine), PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    assert any(s.num_lookup_drafts for s in steps)  # lookup steps ran


def test_quantized_drafter_keeps_greedy_output(target, reference):
    drafter = tiny_drafter(target, 2, 8)
    report = quantize_drafter(drafter, "int4")
    assert report.formats["int4"] >= 2 * 7  # its decoder layers at least
    assert drafter.candidate_selector is None or not any(
        isinstance(m, QuantizedLinear) for m in drafter.candidate_selector.modules()
    )
    outputs = LLM.from_engine(tiny_engine(target, drafter, 8)).generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in outputs] == reference
    with pytest.raises(RuntimeError, match="quantized drafter has no dense linear weights"):
        save_drafter(drafter, "unused")


def test_compiled_quantized_target_equals_eager(target, reference):
    engine = tiny_engine(target, tiny_drafter(target, 2, 8), 8, enforce_eager=False)
    outputs = LLM.from_engine(engine).generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in outputs] == reference


def test_sampling_matches_the_quantized_target_distribution():
    """As tests/integration/test_engine_sampling.py, on an int4 target: the joint of the 3 tokens one
    verify step decides, 3000 seeded requests, chi-square p > 1e-3."""
    target = quantized_target("int4", vocab_size=VOCAB, seed=7)
    drafter = tiny_drafter(target, 2, block_size=4)
    drafter.config.__dict__["selector_top_k"] = 2
    engine = tiny_engine(target, drafter, 4, max_num_seqs=64)
    base = SAMPLING_CASES["temperature"]
    params = [SamplingParams(**{**base.__dict__, "seed": i}) for i in range(3000)]
    outputs = LLM.from_engine(engine).generate([[1, 5, 2]] * len(params), params)
    assert sum(o.num_accepted_tokens for o in outputs) > 0
    exact: dict[tuple[int, ...], float] = {}
    for k, p in _exact_joint(target, base, 4).items():
        exact[k[1:]] = exact.get(k[1:], 0.0) + p
    assert _chi_square_pvalue([tuple(o.token_ids[1:]) for o in outputs], exact) > 1e-3


# ---- GGUF ------------------------------------------------------------------------------------------


def k_quant_config() -> LlamaConfig:
    """K-quants need rows of a multiple of 256 inputs."""
    return LlamaConfig(
        vocab_size=96,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )


def random_blocks(qtype_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid random raw blocks of a GGUF type: random code bytes, small finite float16 scale fields."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)

    def f16(values: np.ndarray) -> np.ndarray:
        return values.astype(np.float16).view(np.uint8).reshape(len(blocks), -1)

    if qtype_name == "Q4_K":  # d, dmin at bytes 0–3
        blocks[:, 0:2] = f16(rng.uniform(1e-4, 2e-3, len(blocks)))
        blocks[:, 2:4] = f16(rng.uniform(1e-4, 2e-3, len(blocks)))
    elif qtype_name == "Q6_K":  # d at the last 2 bytes; int8 sub-block scales before it
        blocks[:, -2:] = f16(rng.uniform(1e-4, 1e-3, len(blocks)))
    elif qtype_name == "Q2_K":  # d, dmin at the last 4 bytes
        blocks[:, -4:-2] = f16(rng.uniform(1e-4, 2e-3, len(blocks)))
        blocks[:, -2:] = f16(rng.uniform(1e-4, 2e-3, len(blocks)))
    return blocks.reshape(rows, -1)


def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order (convert_hf_to_gguf.py), the inverse of what transformers undoes."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf(path: Path, config: LlamaConfig, types: dict[str, str]) -> dict[str, np.ndarray]:
    """A GGUF holding the model's linears in the given types (by GGUF tensor suffix); returns each tensor
    dequantized by the ``gguf`` package, in the checkpoint's row order (Q/K permutation undone the way
    transformers' GGUF loader undoes it)."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    writer = gguf.GGUFWriter(str(path), "llama")
    shapes = {
        "attn_q": (config.num_attention_heads * config.head_dim, config.hidden_size),
        "attn_k": (config.num_key_value_heads * config.head_dim, config.hidden_size),
        "attn_v": (config.num_key_value_heads * config.head_dim, config.hidden_size),
        "attn_output": (config.hidden_size, config.num_attention_heads * config.head_dim),
        "ffn_gate": (config.intermediate_size, config.hidden_size),
        "ffn_up": (config.intermediate_size, config.hidden_size),
        "ffn_down": (config.hidden_size, config.intermediate_size),
    }
    processor = LlamaTensorProcessor(
        {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads}
    )
    dense: dict[str, np.ndarray] = {}
    names = [(f"blk.{i}.{suffix}.weight", suffix, shape) for i in range(2) for suffix, shape in shapes.items()]
    names.append(("output.weight", "output", (config.vocab_size, config.hidden_size)))
    for seed, (name, suffix, (rows, cols)) in enumerate(names):
        qtype = gguf.GGMLQuantizationType[types[suffix]]
        data = random_blocks(types[suffix], rows, cols, seed)
        writer.add_tensor(name, data, raw_dtype=qtype)
        weights = gguf.quants.dequantize(data, qtype).reshape(rows, cols)
        dense[name] = processor.process(weights, name).weights  # llama.cpp's Q/K order undone
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dense


def model_from(dense: dict[str, np.ndarray], config: LlamaConfig) -> TargetModel:
    """A float32 target holding the dequantized tensors (norms and embedding random)."""
    torch.manual_seed(0)
    model = TargetModel(config)
    suffixes = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    state = model.state_dict()
    for name, weights in dense.items():
        if name == "output.weight":
            state["lm_head.weight"] = torch.from_numpy(np.ascontiguousarray(weights)).float()
            continue
        _, layer, suffix, _ = name.split(".")
        state[f"layers.{layer}.{suffixes[suffix]}.weight"] = torch.from_numpy(np.ascontiguousarray(weights)).float()
    state["embed_tokens.weight"] = torch.randn(config.vocab_size, config.hidden_size) * 0.5
    model.load_state_dict(state)
    return model.eval()


K_MIX = {  # a Q4_K_M-like mix: V and down in Q6_K
    "attn_q": "Q4_K",
    "attn_k": "Q4_K",
    "attn_v": "Q6_K",
    "attn_output": "Q4_K",
    "ffn_gate": "Q4_K",
    "ffn_up": "Q4_K",
    "ffn_down": "Q6_K",
    "output": "Q6_K",
}


def test_a_k_quant_gguf_loads_as_the_same_weights_and_decodes_like_its_float_copy(tmp_path):
    config = k_quant_config()
    dense = write_gguf(tmp_path / "tiny.gguf", config, K_MIX)
    float_copy, quantized = model_from(dense, config), model_from(dense, config)
    report = quantize_from_gguf(quantized, tmp_path / "tiny.gguf", strict=True)
    assert report.formats == {"Q4_K": 10, "Q6_K": 5} and not report.dense
    assert report.label == "gguf:Q4_K+Q6_K"
    for name, module in quantized.named_modules():  # every repacked weight is the file's, exactly
        if isinstance(module, QuantizedLinear):
            assert torch.equal(module.dequantized(), float_copy.get_submodule(name).weight), name
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = [c.token_ids for c in LLM.from_engine(tiny_engine(float_copy, None)).generate(prompts, greedy)]
    engine = tiny_engine(quantized, None)  # Q/K fused where formats agree, V alone (Q6_K)
    assert [c.token_ids for c in LLM.from_engine(engine).generate(prompts, greedy)] == expected


def test_an_unsupported_gguf_type_is_named(tmp_path, caplog):
    config = k_quant_config()
    types = {**K_MIX, "ffn_down": "Q2_K"}
    dense = write_gguf(tmp_path / "q2.gguf", config, types)
    with pytest.raises(QuantizationError, match=r"Q2_K.*--quantization none"):
        quantize_from_gguf(model_from(dense, config), tmp_path / "q2.gguf", strict=True)
    with caplog.at_level(logging.WARNING):
        report = quantize_from_gguf(model_from(dense, config), tmp_path / "q2.gguf")
    assert report.dense == {"layers.0.mlp.down_proj": "Q2_K", "layers.1.mlp.down_proj": "Q2_K"}
    assert "GGUF type Q2_K has no quantized kernel" in caplog.text


def test_a_gguf_that_does_not_match_the_model_is_refused(tmp_path):
    config = k_quant_config()
    dense = write_gguf(tmp_path / "tiny.gguf", config, K_MIX)
    other = model_from({k: v * 2 for k, v in dense.items()}, config)
    with pytest.raises(QuantizationError, match="does not dequantize to the model's"):
        quantize_from_gguf(other, tmp_path / "tiny.gguf")


# ---- choosing the method -----------------------------------------------------------------------------


def test_methods_resolve_or_say_what_to_do(tmp_path):
    cpu, gguf = torch.device("cpu"), tmp_path / "m.gguf"
    assert resolve_method("auto", gguf, cpu, tensor_parallel=False) == "gguf"
    assert resolve_method("auto", gguf, cpu, tensor_parallel=False, embedded=True) == "none"
    assert resolve_method("gguf", gguf, cpu, tensor_parallel=False, embedded=True) == "gguf"
    assert resolve_method("auto", gguf, cpu, tensor_parallel=False, dtype=torch.float16) == "none"
    with pytest.raises(QuantizationError, match="--dtype bfloat16 or float32"):
        resolve_method("int4", None, cpu, tensor_parallel=False, dtype=torch.float16)
    assert resolve_method("auto", None, cpu, tensor_parallel=False) == "none"
    assert resolve_method("auto", gguf, cpu, tensor_parallel=True) == "none"
    assert resolve_method("auto", gguf, torch.device("cuda"), tensor_parallel=False) == "none"
    assert resolve_method("int4", None, cpu, tensor_parallel=False) == "int4"
    with pytest.raises(QuantizationError, match=r"not a \.gguf file"):
        resolve_method("gguf", None, cpu, tensor_parallel=False)
    with pytest.raises(QuantizationError, match="CPUs only"):
        resolve_method("int8", None, torch.device("cuda"), tensor_parallel=False)
    with pytest.raises(QuantizationError, match="one process"):
        resolve_method("int8", None, cpu, tensor_parallel=True)
    with pytest.raises(ValueError, match="--quantization"):
        EngineConfig(quantization="fp8")
    with pytest.raises(ValueError, match="one process"):
        EngineConfig(quantization="int4", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="one process"):
        EngineConfig(speculative_draft_quantization="int8", tensor_parallel_size=2)


def test_the_flags_reach_the_config():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--quantization", "int4", "--speculative-draft-quantization", "int8"])
    assert (args.quantization, args.speculative_draft_quantization) == ("int4", "int8")
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "awq"])


def test_the_fallback_target_refuses_an_explicit_method():
    with pytest.raises(QuantizationError, match="runs through transformers"):
        quantize_target(object(), "int4")


@pytest.mark.slow
def test_the_embedded_q4_1_file_served_at_its_own_quantization_keeps_greedy_output_exact():
    """The real file end to end: SmolLM2's own Q4_1 GGUF named as --model (auto keeps its quantization),
    float32 activations, the shipped drafter: greedy speculative output equals autoregressive output."""
    from dflash2.models.source import embedded_gguf_path
    from dflash2.runner.model_setup import default_drafter_path

    kwargs = dict(
        model=str(embedded_gguf_path()),
        dtype="float32",
        enforce_eager=True,
        max_num_seqs=2,
        max_model_len=512,
        adaptive_threads=False,
        speculative_adaptive=False,
    )
    ar = LLM(**kwargs, block_size=1)
    assert ar.engine.quantization == "gguf:Q4_1+Q8_0"
    speculative = LLM(**kwargs, drafter=str(default_drafter_path()), block_size=8)
    prompts = ["Explain what a binary search does.", "def fibonacci(n):"]
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    expected = [c.token_ids for c in ar.generate(prompts, greedy)]
    outputs = speculative.generate(prompts, greedy)
    assert [c.token_ids for c in outputs] == expected
    assert sum(c.num_accepted_tokens for c in outputs) > 0
