"""Training data for a drafter, made by its own target (no external data needed).

1. **Prompts.** Magpie-style synthesis (Xu et al. 2024, "Magpie: alignment data synthesis
   from scratch by prompting aligned LLMs with nothing"): render the chat template up to the
   start of a user turn, under a topic-steering system prompt, and let the target write the
   user's message. Temperatures and topics vary; duplicates are dropped. A JSONL file of
   prompts or conversations supplied by the user can replace or extend them.
2. **Responses.** The target answers every prompt with the engine in autoregressive mode,
   batched (greedy by default, so the drafter learns what the target emits at T=0); a
   fraction of conversations get a synthesized follow-up turn and a second answer.
3. **Storage.** Token ids of each full conversation (as the chat template renders it) with a
   loss mask on the assistant tokens, split into train / held-out by prompt, in one
   safetensors file plus ``manifest.json`` and ``prompts.jsonl``.
"""

from __future__ import annotations

import json
import logging
import random
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from dflash2.engine import Engine
from dflash2.sampling import SamplingParams

logger = logging.getLogger(__name__)

Message = dict[str, str]

# System prompts that steer what kind of user message the target writes (topic → prompt).
TOPICS: dict[str, str] = {
    "math": "You are a patient math tutor. Users ask you grade-school and middle-school math word problems "
    "about money, time, distance, shopping, recipes and ages, and you solve them step by step.",
    "code": "You are an expert Python programmer. Users ask you to write short functions, fix bugs, explain "
    "code snippets and choose data structures.",
    "explain": "You are a science teacher. Users ask you to explain how things work in nature, technology, "
    "the human body, history and economics, in plain words.",
    "lists": "You are a helpful assistant. Users ask you for lists: ideas, tips, steps, pros and cons, "
    "recommendations and summaries.",
    "writing": "You are a writing assistant. Users ask you to write short emails, poems, stories, "
    "product descriptions and to rewrite sentences.",
    "advice": "You are a friendly advisor. Users ask practical questions about studying, health, cooking, "
    "travel, work and everyday life.",
}


@dataclass(frozen=True)
class DataConfig:
    """Settings of one ``dflash2 data`` run (recorded in the manifest).

    Attributes:
        num_prompts: prompts to synthesize (before deduplication).
        max_prompt_tokens / max_response_tokens: generation lengths.
        prompt_temperatures: temperatures cycled over while writing prompts.
        response_temperature: 0 = greedy answers.
        multi_turn_fraction: fraction of conversations that get a follow-up turn.
        heldout_fraction: fraction of prompts kept out of training.
        seed: seeds topic choice, temperatures and every request.
    """

    num_prompts: int = 1000
    max_prompt_tokens: int = 96
    max_response_tokens: int = 256
    prompt_temperatures: tuple[float, ...] = (0.7, 0.9, 1.0, 1.1)
    response_temperature: float = 0.0
    multi_turn_fraction: float = 0.15
    heldout_fraction: float = 0.05
    seed: int = 0
    topics: tuple[str, ...] = tuple(TOPICS)


@dataclass
class Conversation:
    """One training conversation: messages and the topic that produced the first prompt."""

    messages: list[Message]
    topic: str = "user"
    extra: dict[str, Any] = field(default_factory=dict)


def user_turn_prefix(tokenizer: Any, system: str, history: Sequence[Message] = ()) -> list[int]:
    """Token ids of the chat template rendered up to the start of the next user message.

    Raises:
        ValueError: when the template does not render a user message verbatim.
    """
    marker = "\u2063MAGPIE\u2063"
    messages = [{"role": "system", "content": system}, *history, {"role": "user", "content": marker}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    if marker not in text:
        raise ValueError("the chat template does not render user messages verbatim; pass --prompts instead")
    return list(tokenizer.encode(text[: text.index(marker)], add_special_tokens=False))


def _clean(text: str) -> str | None:
    """A usable synthesized user message, or None."""
    text = text.strip()
    if len(text) < 12 or len(text) > 600 or "<|" in text or text.count("\n") > 12:
        return None
    return text


def _dedup_key(text: str) -> str:
    return re.sub(r"\W+", " ", text.lower()).strip()[:80]


class Journal:
    """Append-only record of finished generations (``journal.jsonl``), so a run can resume.

    Each line is ``{"key", "text", "finish_reason"}``; a rerun with the same settings skips
    every key already recorded and produces the same dataset.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.done: dict[str, tuple[str, str | None]] = {}
        if path is not None and path.is_file():
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line cut off by an interrupted run
                    continue
                self.done[row["key"]] = (row["text"], row["finish_reason"])

    def record(self, key: str, text: str, finish_reason: str | None) -> None:
        """Remember one finished generation (flushed at once)."""
        self.done[key] = (text, finish_reason)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps({"key": key, "text": text, "finish_reason": finish_reason}) + "\n")


def _run(
    engine: Engine,
    jobs: list[tuple[str, list[int], SamplingParams]],
    journal: Journal,
    desc: str,
) -> list[tuple[str, str | None]]:
    """Generate ``(key, prompt ids, params)`` jobs with continuous batching, skipping journaled keys.

    Returns ``(text, finish_reason)`` per job, in order.
    """
    pending = [job for job in jobs if job[0] not in journal.done]
    keys = {engine.add_request(prompt, params): key for key, prompt, params in pending}
    texts: dict[str, str] = {}
    with tqdm(total=len(jobs), initial=len(jobs) - len(pending), desc=desc, unit="req", dynamic_ncols=True) as bar:
        remaining = len(pending)
        while remaining:
            for out in engine.step().outputs:
                key = keys[out.request_id]
                texts[key] = texts.get(key, "") + out.new_text
                if out.finished:
                    journal.record(key, texts[key], out.finish_reason)
                    remaining -= 1
                    bar.update(1)
    return [journal.done[key] for key, _, _ in jobs]


def synthesize_prompts(engine: Engine, config: DataConfig, journal: Journal) -> list[Conversation]:
    """Magpie prompts: the target writes user messages under topic system prompts; deduplicated."""
    rng = random.Random(config.seed)
    topics = [rng.choice(config.topics) for _ in range(config.num_prompts)]
    prefixes = {t: user_turn_prefix(engine.tokenizer, TOPICS[t]) for t in set(topics)}
    params = [
        SamplingParams(
            max_tokens=config.max_prompt_tokens,
            temperature=config.prompt_temperatures[i % len(config.prompt_temperatures)],
            top_p=0.95,
            seed=config.seed * 1_000_003 + i,
        )
        for i in range(config.num_prompts)
    ]
    jobs = [(f"prompt-{i}", prefixes[t], p) for i, (t, p) in enumerate(zip(topics, params))]
    texts = _run(engine, jobs, journal, "writing prompts")
    seen: set[str] = set()
    conversations = []
    for topic, (text, reason) in zip(topics, texts):
        cleaned = _clean(text) if reason == "stop" else None  # drop messages cut off by the length limit
        if cleaned is None or _dedup_key(cleaned) in seen:
            continue
        seen.add(_dedup_key(cleaned))
        conversations.append(Conversation([{"role": "user", "content": cleaned}], topic))
    logger.info("kept %d of %d synthesized prompts", len(conversations), config.num_prompts)
    return conversations


def answer(engine: Engine, conversations: list[Conversation], config: DataConfig, journal: Journal, desc: str) -> None:
    """Append the target's answer to every conversation (in place)."""
    tokenizer = engine.tokenizer
    assert tokenizer is not None
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(c.messages, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        for c in conversations
    ]
    params = [
        SamplingParams(max_tokens=config.max_response_tokens, temperature=config.response_temperature, seed=i)
        for i in range(len(conversations))
    ]
    jobs = [(f"answer-{c.extra['index']}-{len(c.messages)}", p, sp) for c, p, sp in zip(conversations, prompts, params)]
    for conversation, (text, _) in zip(conversations, _run(engine, jobs, journal, desc)):
        conversation.messages.append({"role": "assistant", "content": text.strip()})


def add_follow_ups(
    engine: Engine, conversations: list[Conversation], config: DataConfig, journal: Journal
) -> list[Conversation]:
    """Synthesize a follow-up user message for a fraction of conversations; returns those extended."""
    rng = random.Random(config.seed + 1)
    chosen = [c for c in conversations if rng.random() < config.multi_turn_fraction]
    if not chosen:
        return []
    system = "You are a helpful assistant. The user continues the conversation with a follow-up request."
    prefixes = [user_turn_prefix(engine.tokenizer, system, c.messages) for c in chosen]
    params = [
        SamplingParams(max_tokens=config.max_prompt_tokens, temperature=0.9, top_p=0.95, seed=i)
        for i in range(len(chosen))
    ]
    extended = []
    jobs = [(f"follow-up-{c.extra['index']}", p, sp) for c, p, sp in zip(chosen, prefixes, params)]
    for conversation, (text, reason) in zip(chosen, _run(engine, jobs, journal, "writing follow-ups")):
        cleaned = _clean(text) if reason == "stop" else None
        if cleaned is not None:
            conversation.messages.append({"role": "user", "content": cleaned})
            extended.append(conversation)
    return extended


def read_prompts_jsonl(path: Path) -> list[Conversation]:
    """Read user prompts: each line ``{"prompt": str}`` or ``{"messages": [...]}``.

    A conversation that ends with an assistant message is kept as is (its answers are trained
    on); otherwise the target writes the answer.

    Raises:
        ValueError: on a line that has neither field (the message gives the line number).
    """
    conversations = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "messages" in row:
            conversations.append(Conversation(list(row["messages"]), str(row.get("topic", "user"))))
        elif "prompt" in row:
            conversations.append(Conversation([{"role": "user", "content": str(row["prompt"])}], "user"))
        else:
            raise ValueError(f"{path}:{number}: expected a 'prompt' or 'messages' field")
    return conversations


def tokenize_conversation(tokenizer: Any, messages: list[Message]) -> tuple[list[int], list[int]]:
    """Token ids of a whole conversation and a loss mask that is 1 on assistant answer tokens.

    The mask covers each assistant message's content and its end-of-turn token(s), found by
    rendering the conversation prefix by prefix.
    """
    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        rendered = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False, add_generation_prompt=False)
        if message["role"] == "assistant":
            prompt = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            head = tokenizer.encode(prompt, add_special_tokens=False)
            full = tokenizer.encode(rendered, add_special_tokens=False)
            new_head = head[len(ids) :]
            ids += new_head
            mask += [0] * len(new_head)
            answer_ids = full[len(ids) :]  # the answer and its end-of-turn token(s)
            ids += answer_ids
            mask += [1] * len(answer_ids)
        else:
            full = tokenizer.encode(rendered, add_special_tokens=False)
            new = full[len(ids) :]
            ids += new
            mask += [0] * len(new)
    return ids, mask


@dataclass
class TokenDataset:
    """Tokenized conversations: ``tokens``/``loss_mask`` concatenated, ``offsets[i]..offsets[i+1]``."""

    tokens: torch.Tensor  # [total] int32
    loss_mask: torch.Tensor  # [total] uint8
    offsets: torch.Tensor  # [n + 1] int64
    is_heldout: torch.Tensor  # [n] bool

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sequence(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(token ids [S] int64, loss mask [S] bool)`` of conversation i."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b].long(), self.loss_mask[a:b].bool()

    def indices(self, heldout: bool) -> list[int]:
        """Indices of the training (False) or held-out (True) conversations."""
        return [i for i in range(len(self)) if bool(self.is_heldout[i]) == heldout]

    def subset(self, indices: list[int]) -> TokenDataset:
        """A new dataset with only the given conversations (their split flags kept)."""
        parts = [self.sequence(i) for i in indices]
        offsets = torch.tensor([0, *torch.tensor([len(p[0]) for p in parts]).cumsum(0).tolist()])
        return TokenDataset(
            torch.cat([p[0] for p in parts]).to(torch.int32),
            torch.cat([p[1] for p in parts]).to(torch.uint8),
            offsets,
            self.is_heldout[indices],
        )

    def save(self, path: Path) -> None:
        """Write ``path`` (safetensors)."""
        save_file(
            {
                "tokens": self.tokens,
                "loss_mask": self.loss_mask,
                "offsets": self.offsets,
                "is_heldout": self.is_heldout.to(torch.uint8),
            },
            str(path),
        )

    @classmethod
    def load(cls, path: Path) -> TokenDataset:
        """Read a dataset written by :meth:`save`."""
        t = load_file(str(path))
        return cls(t["tokens"], t["loss_mask"], t["offsets"], t["is_heldout"].bool())


def build_dataset(
    engine: Engine, config: DataConfig, out_dir: Path, user_prompts: Path | None = None, synthesize: bool = True
) -> dict[str, Any]:
    """Make prompts, answers and the token dataset in ``out_dir``; returns the manifest.

    Files: ``dataset.safetensors``, ``conversations.jsonl`` (text, with split), ``manifest.json``,
    and ``journal.jsonl`` (every generation as it finishes: rerunning the same command resumes).
    """
    if engine.tokenizer is None:
        raise ValueError("data synthesis needs a tokenizer with a chat template")
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.time()
    journal = Journal(out_dir / "journal.jsonl")
    if journal.done:
        logger.info("resuming: %d generations already in %s", len(journal.done), journal.path)
    conversations: list[Conversation] = []
    if synthesize:
        conversations += synthesize_prompts(engine, config, journal)
    if user_prompts is not None:
        conversations += read_prompts_jsonl(user_prompts)
    for index, conversation in enumerate(conversations):
        conversation.extra["index"] = index
    rng = random.Random(config.seed + 2)
    heldout = {id(c) for c in conversations if rng.random() < config.heldout_fraction}
    to_answer = [c for c in conversations if c.messages[-1]["role"] != "assistant"]
    answer(engine, to_answer, config, journal, "answering")
    follow = add_follow_ups(engine, [c for c in to_answer if id(c) not in heldout], config, journal)
    answer(engine, follow, config, journal, "answering follow-ups")

    tokens, masks, offsets, flags = [], [], [0], []
    with (out_dir / "conversations.jsonl").open("w") as f:
        for c in conversations:
            ids, mask = tokenize_conversation(engine.tokenizer, c.messages)
            tokens += ids
            masks += mask
            offsets.append(len(tokens))
            flags.append(id(c) in heldout)
            split = "heldout" if id(c) in heldout else "train"
            f.write(json.dumps({"split": split, "topic": c.topic, "messages": c.messages}) + "\n")
    dataset = TokenDataset(
        torch.tensor(tokens, dtype=torch.int32),
        torch.tensor(masks, dtype=torch.uint8),
        torch.tensor(offsets, dtype=torch.int64),
        torch.tensor(flags, dtype=torch.bool),
    )
    dataset.save(out_dir / "dataset.safetensors")
    manifest = {
        "model": engine.model_name,
        "chat_template_sha": _sha(engine.tokenizer.chat_template or ""),
        "config": asdict(config),
        "user_prompts": str(user_prompts) if user_prompts else None,
        "num_conversations": len(conversations),
        "num_train": len(dataset.indices(False)),
        "num_heldout": len(dataset.indices(True)),
        "num_multi_turn": len(follow),
        "num_tokens": len(tokens),
        "num_loss_tokens": int(sum(masks)),
        "topics": {t: sum(c.topic == t for c in conversations) for t in sorted({c.topic for c in conversations})},
        "seconds": round(time.time() - start, 1),
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _sha(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:16]
