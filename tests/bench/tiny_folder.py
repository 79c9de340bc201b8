"""A tiny model *folder* for the benchmark tests: byte-level tokenizer with a chat template, a random
4-layer Llama saved by transformers (so both this engine and transformers load it), and a DFlash 2
drafter folder for it. Everything is built in code in a second or two."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from dflash2.models.drafter import DFlashDrafter
from dflash2.models.loader import save_drafter
from tests.tiny import tiny_drafter_config

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<pad>", "<mask>"]
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # the mask token is the last id, as tiny_drafter_config expects
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    """Byte-level BPE without merges: one token per byte, plus the chat special tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<pad>")
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(folder)
    return wrapped


def write_tiny_model(folder: Path, seed: int = 0) -> Path:
    """Tokenizer + random Llama (vocab 260, 4 layers of 64) in Hugging Face layout."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer(folder)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=eos,
        bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
        model.lm_head.weight.mul_(10)
    model.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}) + "\n")
    return folder


def write_tiny_drafter(folder: Path, block_size: int = 8, seed: int = 1) -> Path:
    """A DFlash 2 drafter (convolutions + selector, random non-identity extras) for ``write_tiny_model``."""
    drafter = DFlashDrafter(tiny_drafter_config(2, block_size, VOCAB_SIZE))
    drafter.init_weights(std=0.08, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    save_drafter(drafter, folder)
    return folder
