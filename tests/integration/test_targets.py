"""Our decoders match the transformers reference; the generic fallback gives identical results."""

from __future__ import annotations

import pytest
import torch
import transformers

from dflash2 import LLM, EngineConfig, SamplingParams
from dflash2.engine import Engine
from dflash2.models import loader
from dflash2.models.batch import ForwardBatch
from dflash2.models.drafter import DFlashDrafter
from dflash2.models.drafter_factory import drafter_config_for_target
from dflash2.models.hf_fallback import HFCausalLMTarget
from dflash2.models.kv_cache import KVCache
from dflash2.models.llama import TargetModel
from tests.tiny import tiny_drafter_config

COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 6}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 16}),
    "llama3-rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
}


def _save_hf(tmp_path, family: str):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**COMMON, **extra)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_decoder_matches_transformers(tmp_path, family):
    reference = _save_hf(tmp_path, family)
    target = loader.load_target(tmp_path, torch.float32, torch.device("cpu"))
    assert isinstance(target, TargetModel)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7]]
    cache = target.new_cache(2, 64)
    batch = ForwardBatch.build([0, 1], prompts, [0, 0], "cpu")
    logits, _ = target.run(batch, cache)
    for r, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0]
        assert torch.allclose(logits[r, : len(prompt)], expected, atol=1e-4), family
    # Incremental: 3 more tokens on row 0 through the cache equal the full forward.
    extra = [20, 21, 22]
    step, _ = target.run(ForwardBatch.build([0], [extra], [len(prompts[0])], "cpu"), cache)
    with torch.no_grad():
        expected = reference(torch.tensor([prompts[0] + extra])).logits[0, -3:]
    assert torch.allclose(step[0], expected, atol=1e-4)


def test_features_are_layer_outputs(tmp_path):
    reference = _save_hf(tmp_path, "llama")
    target = loader.load_target(tmp_path, torch.float32, torch.device("cpu"))
    prompt = [3, 4, 5, 6]
    _, features = target.run(ForwardBatch.build([0], [prompt], [0], "cpu"), target.new_cache(1, 16), (1, 3))
    with torch.no_grad():
        hidden = reference(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    # docs/dflash2-spec.md §2.1: layer id's output is HF hidden_states[id + 1]; the last one's is before the final norm
    assert torch.allclose(features[0, :, :64], hidden[2][0], atol=1e-5)
    assert not torch.allclose(features[0, :, 64:], hidden[4][0], atol=1e-3)  # hidden[4] has the final norm
    with torch.no_grad():
        cache = KVCache(4, 1, 2, 16, 16, torch.float32, "cpu")
        _, raw = target.run(ForwardBatch.build([0], [prompt], [0], "cpu"), cache, (3,))
    assert raw is not None and raw.shape == (1, 4, 64)


def _fallback_model(tmp_path):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=96, n_embd=64, n_layer=4, n_head=4, n_positions=256)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(tmp_path)
    return model


def test_fallback_greedy_speculative_equals_autoregressive_and_transformers(tmp_path):
    reference = _fallback_model(tmp_path)
    target = loader.load_target(tmp_path, torch.float32, torch.device("cpu"))
    assert isinstance(target, HFCausalLMTarget)
    drafter = DFlashDrafter(tiny_drafter_config(2, 8, 96))
    drafter.init_weights(std=0.05, seed=0)
    loader.check_drafter_matches(drafter, target)
    drafter.bind_target(*target.embedding_weights())
    params = SamplingParams(max_tokens=24, temperature=0.0)
    prompts = [[1, 2, 3, 4], [9, 8, 7]]

    def run(d, block):
        config = EngineConfig(
            block_size=block, max_num_seqs=2, max_model_len=128, device="cpu", dtype="float32", enforce_eager=True
        )
        return [c.token_ids for c in LLM.from_engine(Engine(config, target, None, d)).generate(prompts, params)]

    ar, spec = run(None, 1), run(drafter, 8)
    assert ar == spec
    for prompt, tokens in zip(prompts, ar):
        with torch.no_grad():
            hf = reference.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0)
        assert hf[0, len(prompt) :].tolist() == tokens


def test_not_a_causal_lm_is_rejected(tmp_path):
    transformers.ViTConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4).save_pretrained(tmp_path)
    with pytest.raises(loader.ModelLoadError, match=r"model_type 'vit' is not a causal language model.*llama"):
        loader.load_target(tmp_path, torch.float32, torch.device("cpu"))


def test_missing_files_are_reported(tmp_path):
    with pytest.raises(loader.ModelLoadError, match=r"config\.json"):
        loader.load_target(tmp_path, torch.float32, torch.device("cpu"))
    with pytest.raises(loader.ModelLoadError, match="drafter"):
        loader.load_drafter(tmp_path, None, torch.float32, torch.device("cpu"))  # type: ignore[arg-type]


# Families the fallback serves whose transformers caches keep less than the whole past: Gated DeltaNet
# linear attention (a recurrent state and a convolution window), sliding windows (smaller than the prompts
# and outputs here, so they fill), gpt-oss's sliding windows with attention sinks and experts, and plain
# experts as a control; Gemma 4's per-layer head dims.
HYBRID_FAMILIES = {
    "qwen3_5_text": {
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
    },
    "gemma3_text": {
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    },
    "gpt_oss": {
        "sliding_window": 8,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    # Per-layer configs: the full-attention layers' heads are wider, so ``config.head_dim`` raises.
    "gemma4_text": {"sliding_window": 8},
}


def _fallback_completions(target, drafter, block, prompts, params):
    """Completions of ``prompts`` on a float32 eager engine over ``target`` with full blocks (no adaptive
    policy), none of them failed."""
    config = EngineConfig(
        block_size=block,
        max_num_seqs=2,
        max_model_len=128,
        device="cpu",
        dtype="float32",
        enforce_eager=True,
        speculative_adaptive=False,  # full blocks every step, however few drafts are accepted
    )
    completions = LLM.from_engine(Engine(config, target, None, drafter)).generate(prompts, params)
    assert all(c.error is None for c in completions)
    return completions


def _hybrid_model(tmp_path, model_type):
    base = {**COMMON, "max_position_embeddings": 512, **HYBRID_FAMILIES[model_type]}
    if model_type != "gemma4_text":  # its head dims are per layer
        base["head_dim"] = 16
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **base))
    model.eval().save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("model_type", list(HYBRID_FAMILIES))
def test_fallback_speculation_rolls_back_windows_and_recurrent_states(tmp_path, model_type):
    # (The drafter below is shaped for the target by hand; drafter_config_for_target is checked apart.)
    """Greedy DFlash 2 through the transformers fallback equals autoregressive decoding and transformers'
    own ``generate`` on families whose caches drop the past (the rollback goes through transformers'
    past recording: without it a rejected draft would stay in the recurrent state or the window), prompts
    and outputs well past the window, random drafts so most blocks are partly rejected."""
    reference = _hybrid_model(tmp_path, model_type)
    target = loader.load_target(tmp_path, torch.float32, torch.device("cpu"))
    assert isinstance(target, HFCausalLMTarget)
    drafter = DFlashDrafter(tiny_drafter_config(2, 8, 96))
    drafter.init_weights(std=0.05, seed=0)
    drafter.bind_target(*target.embedding_weights())
    params = SamplingParams(max_tokens=32, temperature=0.0)
    prompts = [list(range(1, 13)), [9, 8, 7]]

    def run(d, block):
        completions = _fallback_completions(target, d, block, prompts, params)
        return [c.token_ids for c in completions], sum(c.num_draft_tokens - c.num_accepted_tokens for c in completions)

    (ar, _), (spec, rejected) = run(None, 1), run(drafter, 8)
    assert rejected > 0  # drafts were rolled back
    assert spec == ar
    for prompt, tokens in zip(prompts, ar):
        with torch.no_grad():
            hf = reference.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, pad_token_id=0)
        expected = hf[0, len(prompt) :].tolist()  # transformers stops at the config's EOS; the engine has none
        assert len(expected) >= 8 and tokens[: len(expected)] == expected
    sampled = _fallback_completions(target, drafter, 8, prompts, SamplingParams(max_tokens=32, temperature=1.0, seed=3))
    assert all(len(c.token_ids) == 32 for c in sampled)  # rejection sampling rolls back too


def test_drafter_config_for_per_layer_and_multimodal_configs():
    """A drafter shaped for Gemma 4 (per-layer head dims, RoPE per layer type) takes the shape most layers
    have and the sliding layers' RoPE; a multimodal config is read through its text config."""
    config = transformers.AutoConfig.for_model(
        "gemma4_text", **{**COMMON, "max_position_embeddings": 512, "sliding_window": 8}
    )
    drafter = drafter_config_for_target(config)
    head_dims = [layer.head_dim for layer in config.per_layer_config]
    assert len(set(head_dims)) > 1 and drafter.head_dim == max(head_dims, key=head_dims.count)
    assert drafter.rope_theta == config.rope_parameters["sliding_attention"]["rope_theta"]
    assert drafter.hidden_size == 64 and drafter.num_target_layers == 4
    multimodal = transformers.AutoConfig.for_model("muse_glimmer")
    assert drafter_config_for_target(multimodal).hidden_size == multimodal.text_config.hidden_size


VISION = {
    "gemma3": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2},
    "qwen3_5": {"hidden_size": 32, "intermediate_size": 64, "depth": 1, "num_heads": 2, "out_hidden_size": 64},
}


@pytest.mark.parametrize("model_type", ["gemma3", "qwen3_5"])
def test_a_multimodal_checkpoint_serves_its_language_model(tmp_path, model_type):
    """A Gemma 3- or Qwen3.5-shaped image-text-to-text checkpoint (random weights, a small vision tower):
    the fallback serves its language model, text only, with a drafter shaped from its text config; greedy
    DFlash 2 equals autoregressive decoding and transformers' text-only ``generate``."""
    text = {**COMMON, "head_dim": 16, "max_position_embeddings": 512}
    text.update(HYBRID_FAMILIES["gemma3_text" if model_type == "gemma3" else "qwen3_5_text"])
    extra = {"image_size": 32, "patch_size": 8} if model_type == "gemma3" else {}
    config = transformers.AutoConfig.for_model(
        model_type, text_config=text, vision_config={**VISION[model_type], **extra}
    )
    torch.manual_seed(0)
    reference = transformers.AutoModelForImageTextToText.from_config(config).eval()
    reference.save_pretrained(tmp_path)
    target = loader.load_target(tmp_path, torch.float32, torch.device("cpu"))
    assert isinstance(target, HFCausalLMTarget) and target.num_layers == 4 and target.config.vocab_size == 96
    drafter = DFlashDrafter(drafter_config_for_target(config, num_layers=1, selector_top_k=8))
    drafter.init_weights(std=0.05, seed=0)
    loader.check_drafter_matches(drafter, target)
    drafter.bind_target(*target.embedding_weights())
    params = SamplingParams(max_tokens=24, temperature=0.0)
    prompts = [list(range(1, 13)), [9, 8, 7]]

    def run(d, block):
        return [c.token_ids for c in _fallback_completions(target, d, block, prompts, params)]

    ar = run(None, 1)
    assert run(drafter, 8) == ar
    for prompt, tokens in zip(prompts, ar):
        with torch.no_grad():
            hf = reference.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0)
        expected = hf[0, len(prompt) :].tolist()
        assert len(expected) >= 8 and tokens[: len(expected)] == expected
