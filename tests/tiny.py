"""Tiny random-weight models for tests: a Llama/Qwen3-style target and matching drafters."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, Qwen3Config

from dflash2.config import EngineConfig
from dflash2.engine import Engine
from dflash2.models.drafter import DFlashDrafter
from dflash2.models.drafter_config import DrafterConfig
from dflash2.models.llama import TargetModel


def tiny_target_config(model_type: str = "llama", vocab_size: int = 96, num_layers: int = 4):
    """A 4-layer, 64-wide config of the given family."""
    cls = Qwen3Config if model_type == "qwen3" else LlamaConfig
    return cls(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )


def tiny_target(model_type: str = "llama", vocab_size: int = 96, seed: int = 0, scale: float = 1.0) -> TargetModel:
    """Random-weight target; ``scale`` sharpens its distributions (larger = more peaked)."""
    torch.manual_seed(seed)
    model = TargetModel(tiny_target_config(model_type, vocab_size))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
        model.lm_head.weight.mul_(scale * 10)
    return model.eval()


def tiny_drafter_config(version: int = 2, block_size: int = 8, vocab_size: int = 96, top_k: int = 8) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        vocab_size=vocab_size,
        block_size=block_size,
        mask_token_id=vocab_size - 1,
        target_layer_ids=(1, 2),
        num_target_layers=4,
        conv_group_size=16 if version == 2 else 0,
        conv_kernel_size=2 if version == 2 else 0,
        selector_rank=8 if version == 2 else 0,
        selector_top_k=top_k if version == 2 else 0,
    )


def tiny_drafter(target: TargetModel, version: int = 2, block_size: int = 8, seed: int = 1, random_extras: bool = True):
    """A drafter bound to ``target``; v2 extras get random (non-identity) weights by default."""
    drafter = DFlashDrafter(tiny_drafter_config(version, block_size, target.config.vocab_size))
    drafter.init_weights(std=0.08, seed=seed)
    if random_extras and version == 2:
        g = torch.Generator().manual_seed(seed + 100)
        with torch.no_grad():
            for name, p in drafter.named_parameters():
                if "conv" in name or "candidate_selector" in name:
                    p.add_(torch.randn(p.shape, generator=g) * 0.1)
    drafter.bind_target(target.embed_tokens.weight, target.lm_head.weight)
    return drafter.eval()


def tiny_engine(
    target: TargetModel,
    drafter: DFlashDrafter | None,
    block_size: int | None = None,
    max_num_seqs: int = 4,
    eos: tuple[int, ...] = (),
    enforce_eager: bool = True,
    tokenizer=None,
    **kwargs,
) -> Engine:
    """A CPU engine, float32 unless ``dtype=`` says otherwise; eager unless ``enforce_eager=False``
    (compiling takes seconds)."""
    kwargs.setdefault("speculative_adaptive", False)  # full blocks unless a test asks for the policy
    kwargs.setdefault("adaptive_threads", False)  # the thread count tests set stays set
    kwargs.setdefault("dtype", "float32")
    config = EngineConfig(
        enforce_eager=enforce_eager,
        block_size=block_size if drafter is not None else 1,
        max_num_seqs=max_num_seqs,
        max_model_len=256,
        device="cpu",
        **kwargs,
    )
    return Engine(config, target, tokenizer, drafter, eos_token_ids=eos)


class OracleDrafter(DFlashDrafter):
    """Test double: drafts the reference continuation of each slot, corrupting a fraction of slots.

    ``references[slot]`` is the full token sequence (prompt + greedy target output) that the
    request in that slot will produce; the drafter proposes ``reference[s+1 : s+B]`` for a
    block anchored at position s, so acceptance is high and full blocks are exercised.
    """

    supports_compile = False  # it overrides draft_hidden and logits

    def __init__(
        self,
        config: DrafterConfig,
        references: dict[int, list[int]],
        error_rate: float,
        seed: int = 0,
        runner_up: bool = False,
    ):
        super().__init__(config)
        self.references = references
        self.error_rate = error_rate
        self.runner_up = runner_up  # a corrupted slot ranks the reference token second (a tree finds it)
        self.generator = torch.Generator().manual_seed(seed)
        self._planned: torch.Tensor | None = None
        self._truth: torch.Tensor | None = None

    def draft_hidden(self, cache, slots, anchor_ids, starts, block_size):
        planned = torch.zeros(len(slots), block_size, dtype=torch.long)
        truth = torch.zeros(len(slots), block_size, dtype=torch.long)
        for r, slot in enumerate(slots):
            ref, s = self.references.get(slot, []), int(starts[r])
            for j in range(1, block_size):
                token = truth[r, j] = ref[s + j] if s + j < len(ref) else 0
                if float(torch.rand(1, generator=self.generator)) < self.error_rate:
                    token = int(torch.randint(self.config.vocab_size, (1,), generator=self.generator))
                planned[r, j] = token
        self._planned, self._truth = planned, truth
        return torch.zeros(len(slots), block_size, self.config.hidden_size)

    def logits(self, hidden):
        assert self._planned is not None
        planned = self._planned[:, -hidden.shape[1] :]
        logits = torch.nn.functional.one_hot(planned, self.config.vocab_size).float() * 20.0
        if self.runner_up:
            assert self._truth is not None
            logits += torch.nn.functional.one_hot(self._truth[:, -hidden.shape[1] :], self.config.vocab_size) * 10.0
        return logits


def oracle_drafter(
    target: TargetModel,
    references: dict[int, list[int]],
    block_size: int,
    error_rate: float = 0.2,
    seed: int = 0,
    runner_up: bool = False,
):
    config = tiny_drafter_config(2, block_size, target.config.vocab_size)
    drafter = OracleDrafter(config, references, error_rate, seed, runner_up)
    drafter.init_weights(std=0.02, seed=3)
    drafter.bind_target(target.embed_tokens.weight, target.lm_head.weight)
    return drafter.eval()
