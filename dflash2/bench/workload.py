"""The prompt sets as token ids: every method gets the same ids, max_tokens and seeds.

Prompts come from ``dflash2.train.evaluate.load_prompt_sets`` (held-out synthetic, HumanEval,
math, multi-turn) and go through the model's chat template once, here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash2.bench.config import BenchConfig

logger = logging.getLogger(__name__)

Messages = list[dict[str, str]]
_SEED_STRIDE = 1000  # seed = set index × stride + prompt index: distinct per prompt, equal across methods


@dataclass
class PromptSet:
    """One prompt set, tokenized: ``prompt_ids[i]`` is generated with ``seeds[i]`` by every method."""

    name: str
    prompt_ids: list[list[int]]
    seeds: list[int]
    messages: list[Messages] = field(default_factory=list)


@dataclass
class Workload:
    """The prompt sets of a run, the model folder they were tokenized for (with its EOS ids), and what was
    left out."""

    folder: Path
    sets: list[PromptSet]
    max_model_len: int
    eos_token_ids: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def messages(self) -> list[Messages]:
        """Every prompt's chat messages, set after set (the serving benchmark cycles through them)."""
        return [m for s in self.sets for m in s.messages]


def render_chat(tokenizer: Any, messages: Messages) -> str:
    """The chat template with the generation prompt (plain ``role: content`` lines without a template)."""
    if getattr(tokenizer, "chat_template", None):
        return str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


BENCH_MAX_MODEL_LEN = 2048  # every method's context unless --max-model-len says otherwise


def model_max_len(folder: Path, max_model_len: int | None) -> int:
    """The context every benchmarked method gets: as configured, else min(model limit,
    ``BENCH_MAX_MODEL_LEN``) (the engine's own default is the model's whole limit; the benchmark
    keeps caches, and so peak RSS, comparable with llama.cpp's ``n_ctx``; ``run_bench`` passes it on)."""
    if max_model_len:
        return max_model_len
    from dflash2.models.loader import load_hf_config

    limit = getattr(load_hf_config(folder), "max_position_embeddings", BENCH_MAX_MODEL_LEN) or BENCH_MAX_MODEL_LEN
    return min(int(limit), BENCH_MAX_MODEL_LEN)


def build_workload(config: BenchConfig) -> Workload:
    """Resolve the model, load its tokenizer and tokenize the selected prompt sets.

    Prompts that do not fit ``max_model_len`` with ``max_tokens`` are left out with a note; the
    held-out set needs ``config.data``.
    """
    from dflash2.models import loader, source
    from dflash2.train.evaluate import load_prompt_sets

    folder = source.resolve_model(config.engine.model)
    tokenizer = loader.load_tokenizer(folder)
    max_len = model_max_len(folder, config.engine.max_model_len)
    workload = Workload(folder, [], max_len, loader.eos_token_ids(folder, tokenizer))
    if "heldout" in config.sets and config.data is None:
        workload.notes.append("held-out set left out: pass --data with a `dflash2 data` folder")
    loaded = load_prompt_sets(config.data, config.num_prompts)
    for index, name in enumerate(s for s in config.sets if s in loaded):
        prompt_set = PromptSet(name, [], [])
        for i, messages in enumerate(loaded[name]):
            ids = list(tokenizer.encode(render_chat(tokenizer, messages)))
            if len(ids) + config.max_tokens > max_len:
                workload.notes.append(f"{name} prompt {i} left out: {len(ids)} tokens + max_tokens > {max_len}")
                continue
            prompt_set.prompt_ids.append(ids)
            prompt_set.seeds.append(index * _SEED_STRIDE + i)
            prompt_set.messages.append(messages)
        if prompt_set.prompt_ids:
            workload.sets.append(prompt_set)
        else:
            workload.notes.append(f"{name}: no prompt loaded")
    for note in workload.notes:
        logger.warning(note)
    if not workload.sets:
        raise ValueError("no prompts to benchmark: check --sets, --data and --max-tokens")
    return workload
