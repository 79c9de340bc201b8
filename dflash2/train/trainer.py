"""DFlash / DFlash 2 block training against a frozen target (docs/dflash2-spec.md §7).

Each step samples conversations, random anchors on their response tokens and blocks
``[x_a, MASK × (B−1)]``; the drafter attends to the target's cached features strictly before
each anchor and bidirectionally inside its block. The loss is the decay-weighted CE of the
unary logits plus ``selector_alpha`` × the teacher-forced top-k selector CE. The target's
embedding and LM head are shared and frozen. Checkpoints are resumable; the result is
exported in the published checkpoint layout.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dflash2.models.base import Target
from dflash2.models.drafter import DFlashDrafter
from dflash2.models.drafter_config import DrafterConfig
from dflash2.models.drafter_factory import drafter_config_for_target
from dflash2.models.loader import read_drafter, save_drafter
from dflash2.train.blocks import LossTerms, block_losses, make_blocks, sample_anchors
from dflash2.train.data import TokenDataset
from dflash2.train.features import SoftLabels

logger = logging.getLogger(__name__)

LOSS_FIELDS = tuple(f.name for f in fields(LossTerms))


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run (saved with every checkpoint).

    Attributes:
        num_layers, block_size, use_conv, use_selector, selector_rank, selector_top_k: drafter shape.
        selector_alpha: weight of the selector CE.
        lr, weight_decay, warmup_ratio, grad_clip: AdamW with linear warm-up and cosine decay to 10 %.
        steps: optimizer steps; time_budget: seconds after which training stops early (checkpointed).
        blocks_per_step, anchors_per_sequence: how many blocks one step trains on.
        gamma: slot-weight decay (None = spec default for the block size).
        init_from_target: copy the last target layers into the drafter layers and make ``fc``
            pass the deepest captured feature through.
        autocast_bf16: run forward/backward under CPU/GPU bfloat16 autocast.
        seed: sampling and initialisation seed.
        checkpoint_every: steps between checkpoints.
        draft_vocab_size: restrict the drafter's LM head to this many frequency-ranked tokens
            (``draft_vocabulary``); 0, or at least the vocabulary size, = the full vocabulary.
        init_drafter: start from the weights (and draft vocabulary) of this exported drafter
            folder instead of a fresh initialisation, e.g. to continue training in a new run;
            its shape must match these settings.
        eval_every: steps between held-out evaluations (teacher-forced τ and Recall@1 on up to
            64 held-out conversations, logged as ``heldout_tau`` / ``heldout_top1``); 0 = never.
        distill_weight: β in ``(1 − β) · CE(hard label) + β · CE(target's top-k distribution)``
            per slot (knowledge distillation; needs the soft labels of ``features.SoftLabels``);
            0 = hard labels only, as in the spec.
        distill_top_k: entries of the target's distribution kept per token for distillation.
    """

    num_layers: int = 3
    block_size: int = 8
    use_conv: bool = True
    use_selector: bool = True
    selector_rank: int = 32
    selector_top_k: int = 16
    selector_alpha: float = 0.5
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    steps: int = 1000
    time_budget: float | None = None
    blocks_per_step: int = 256
    anchors_per_sequence: int = 32
    gamma: float | None = None
    init_from_target: bool = True
    autocast_bf16: bool = False
    seed: int = 0
    checkpoint_every: int = 50
    draft_vocab_size: int = 16384
    init_drafter: str | None = None
    eval_every: int = 100
    distill_weight: float = 0.0
    distill_top_k: int = 16


# Settings that may change when a run resumes (they do not change what is trained).
RESUMABLE_CHANGES = {"steps", "time_budget", "checkpoint_every", "eval_every"}


def response_token_counts(dataset: TokenDataset, indices: list[int], vocab_size: int) -> torch.Tensor:
    """How often each token id occurs among the response (loss-mask) tokens of the conversations
    ``indices``: ``[vocab_size]`` int64."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in indices:
        ids, mask = dataset.sequence(i)
        counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts


def draft_vocabulary(counts: torch.Tensor, size: int) -> torch.Tensor:
    """A frequency-ranked draft vocabulary of ``size`` token ids (FR-Spec, Zhao et al. 2025).

    Tokens are ranked by ``counts [V]`` (:func:`response_token_counts`: their count among the
    training responses); the rest of the budget goes to the lowest unseen ids, since a BPE
    vocabulary is ordered by merge rank, a proxy for frequency in the tokenizer's own corpus.

    Returns:
        ``[min(size, V)]`` int64 token ids, sorted.
    """
    vocab_size = len(counts)
    size = min(size, vocab_size)
    seen = int((counts > 0).sum())
    ranked = counts.argsort(descending=True, stable=True)[: min(seen, size)]
    chosen = torch.zeros(vocab_size, dtype=torch.bool)
    chosen[ranked] = True
    fill = (~chosen).nonzero().flatten()[: size - len(ranked)]
    chosen[fill] = True
    return chosen.nonzero().flatten()


def new_drafter(target: Target, config: TrainConfig, mask_token_id: int) -> DFlashDrafter:
    """A freshly initialised drafter for ``target`` (identity convs, zero successor codebook)."""
    drafter_config = drafter_config_for_target(
        target.config,
        num_layers=config.num_layers,
        block_size=config.block_size,
        conv=config.use_conv,
        selector=config.use_selector,
        selector_rank=config.selector_rank,
        selector_top_k=config.selector_top_k,
        mask_token_id=mask_token_id,
    )
    drafter = DFlashDrafter(drafter_config)
    drafter.init_weights(seed=config.seed)
    if config.init_from_target:
        init_from_target(drafter, target)
    return drafter


def init_from_target(drafter: DFlashDrafter, target: Target) -> None:
    """Copy the target's last decoder layers into the drafter and make ``fc`` select the deepest feature.

    Only tensors with identical names and shapes are copied (attention, MLP, norms); Qwen3-style
    q/k norms absent from Llama targets stay at 1.
    """
    target_state = target.state_dict() if isinstance(target, torch.nn.Module) else {}
    num_target = target.num_layers
    num_draft = drafter.config.num_hidden_layers
    copied = 0
    with torch.no_grad():
        for i, layer in enumerate(drafter.draft_layers()):
            source = num_target - num_draft + i
            for name, param in layer.named_parameters():
                key = f"layers.{source}.{name}"
                if key in target_state and target_state[key].shape == param.shape:
                    param.copy_(target_state[key])
                    copied += 1
        hidden = drafter.config.hidden_size
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, -hidden:] = torch.eye(hidden)
        if "norm.weight" in target_state:
            drafter.norm.weight.copy_(target_state["norm.weight"])
    logger.info("initialised %d drafter tensors from the target's last %d layers", copied, num_draft)


class Trainer:
    """Runs, checkpoints and resumes training of one drafter."""

    def __init__(
        self,
        target: Target,
        dataset: TokenDataset,
        features: torch.Tensor,
        config: TrainConfig,
        run_dir: Path,
        mask_token_id: int,
        soft_labels: SoftLabels | None = None,
    ) -> None:
        """
        Args:
            features: ``[total tokens, F·H]`` cached target features of ``dataset``.
            soft_labels: the target's top-k next-token distributions of ``dataset``, needed
                when ``config.distill_weight > 0``.

        Raises:
            ValueError: distillation without soft labels.
        """
        if config.distill_weight > 0 and soft_labels is None:
            raise ValueError("distill_weight > 0 needs the target's soft labels (see features.load_or_extract)")
        self.target, self.dataset, self.features, self.config = target, dataset, features, config
        self.soft_labels = soft_labels if config.distill_weight > 0 else None
        self.run_dir = run_dir
        self.train_ids = dataset.indices(heldout=False)
        for p in target.parameters() if isinstance(target, torch.nn.Module) else []:
            p.requires_grad_(False)
        self.drafter = new_drafter(target, config, mask_token_id)
        self.drafter.bind_target(*target.embedding_weights())
        vocab_size = self.drafter.config.vocab_size
        if 0 < config.draft_vocab_size < vocab_size:
            counts = response_token_counts(dataset, self.train_ids, vocab_size)
            ids = draft_vocabulary(counts, config.draft_vocab_size)
            self.drafter.set_draft_vocab(ids, counts[ids])
        if config.init_drafter:
            self._init_from_drafter(Path(config.init_drafter))
        self.optimizer = torch.optim.AdamW(
            self.drafter.parameters(), lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95)
        )
        self.step = 0
        self.rng = random.Random(config.seed)
        self.generator = torch.Generator().manual_seed(config.seed)
        self._resume()

    def _init_from_drafter(self, folder: Path) -> None:
        """Copy an exported drafter's weights (and draft vocabulary) into the fresh drafter.

        Raises:
            ValueError: when its shape differs from this run's settings.
        """
        device = self.drafter.fc.weight.device
        source = read_drafter(folder, dtype=torch.float32, device=device)
        if source.config.to_dict() != self.drafter.config.to_dict():
            raise ValueError(f"{folder} was trained with another drafter shape than this run's settings")
        self.drafter.load_state_dict(source.state_dict())
        if source.draft_vocab is not None:
            self.drafter.set_draft_vocab(source.draft_vocab, source.draft_vocab_counts)
        logger.info("initialised the drafter from %s", folder)

    # ---- checkpoints ------------------------------------------------------------------------

    @property
    def checkpoint_path(self) -> Path:
        """Where the resumable checkpoint lives."""
        return self.run_dir / "checkpoint.pt"

    def _resume(self) -> None:
        if not self.checkpoint_path.is_file():
            return
        state = torch.load(self.checkpoint_path, map_location="cpu", weights_only=False)
        saved = {f.name: f.default for f in fields(TrainConfig)} | state["config"]  # older runs lack newer fields
        if saved != asdict(self.config):
            changed = {k for k, v in asdict(self.config).items() if saved[k] != v}
            if saved["distill_weight"] == self.config.distill_weight == 0:
                changed.discard("distill_top_k")  # unused without distillation
            if changed - RESUMABLE_CHANGES:
                raise ValueError(f"{self.checkpoint_path} was trained with other settings ({sorted(changed)})")
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        self.rng.setstate(state["python_rng"])
        self.generator.set_state(state["torch_rng"])
        logger.info("resumed from %s at step %d", self.checkpoint_path, self.step)

    def save_checkpoint(self) -> None:
        """Write the resumable checkpoint atomically."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        state = {
            "config": asdict(self.config),
            "drafter": self.drafter.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "python_rng": self.rng.getstate(),
            "torch_rng": self.generator.get_state(),
        }
        tmp = self.checkpoint_path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.checkpoint_path)

    def export(self, folder: Path, dtype: torch.dtype = torch.bfloat16) -> DrafterConfig:
        """Save the drafter in the published layout (``config.json`` + ``model.safetensors``)."""
        save_drafter(self.drafter, folder, dtype=dtype)
        return self.drafter.config

    # ---- training ---------------------------------------------------------------------------

    def learning_rate(self, step: int) -> float:
        """Linear warm-up, then cosine decay to 10 % of the peak."""
        c = self.config
        warmup = max(1, int(c.warmup_ratio * c.steps))
        if step < warmup:
            return c.lr * (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, c.steps - warmup))
        return c.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    def _sample_sequences(self) -> list[tuple[int, Any]]:
        """Conversations and their blocks until ``blocks_per_step`` blocks are collected."""
        c = self.drafter.config
        picked, total = [], 0
        while total < self.config.blocks_per_step:
            i = self.rng.choice(self.train_ids)
            ids, mask = self.dataset.sequence(i)
            anchors = sample_anchors(mask, c.block_size, self.config.anchors_per_sequence, self.generator)
            if len(anchors) == 0:
                continue
            anchors = anchors[: self.config.blocks_per_step - total]
            soft = None
            if self.soft_labels is not None:
                soft = self.soft_labels[int(self.dataset.offsets[i]) : int(self.dataset.offsets[i + 1])]
            picked.append((i, make_blocks(ids, mask, anchors, c.block_size, c.mask_token_id, self.config.gamma, soft)))
            total += len(anchors)
        return picked

    def train_step(self) -> dict[str, Any]:
        """One optimizer step; returns the step's metrics."""
        self.drafter.train()
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate(self.step)
        picked = self._sample_sequences()
        base_weight = sum(float(b.weights[:, 1:].sum()) for _, b in picked)
        sums: dict[str, Any] = {}
        selector = self.drafter.selector_weights()
        top_k = self.drafter.config.selector_top_k or 16
        self.optimizer.zero_grad(set_to_none=True)
        autocast = self._autocast()
        for i, blocks in picked:
            a, b = int(self.dataset.offsets[i]), int(self.dataset.offsets[i + 1])
            with autocast:
                hidden = self.drafter.forward_blocks(self.features[a:b].float(), blocks.block_ids, blocks.anchors)
                hidden = hidden[:, 1:]
                logits = self.drafter.logits(hidden)
            terms = block_losses(logits, hidden, blocks, selector, top_k, self.drafter.draft_vocab)
            beta = self.config.distill_weight
            loss = ((1 - beta) * terms.base_loss + beta * terms.distill_loss) / base_weight
            if selector is not None and self.config.selector_alpha > 0:
                # The selector CE is normalised by its own weight sum (estimated from this sequence's share).
                share = float(terms.base_weight) / base_weight
                loss = loss + self.config.selector_alpha * share * terms.selector_loss / terms.selector_weight.clamp(
                    min=1e-6
                )
            loss.backward()
            for name in LOSS_FIELDS:
                value = getattr(terms, name).detach()
                sums[name] = sums[name] + value if name in sums else value
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.step += 1
        count = sums["count"].clamp(min=1)
        return {
            "step": self.step,
            "lr": self.learning_rate(self.step - 1),
            "loss": float(sums["base_loss"] / sums["base_weight"].clamp(min=1e-6)),
            "selector_loss": float(sums["selector_loss"] / sums["selector_weight"].clamp(min=1e-6)),
            "distill_loss": float(sums["distill_loss"] / sums["base_weight"].clamp(min=1e-6)),
            "top1": float(sums["top1"].sum() / count.sum()),
            "topk": float(sums["topk"].sum() / count.sum()),
            "selector_top1": float(sums["selector_top1"].sum() / sums["topk"].sum().clamp(min=1)),
            "top1_per_position": (sums["top1"] / count).tolist(),
        }

    def _autocast(self) -> torch.autocast:
        device_type = self.features.device.type if self.features.device.type != "mps" else "cpu"
        return torch.autocast(device_type, dtype=torch.bfloat16, enabled=self.config.autocast_bf16)

    def evaluate_heldout(self, max_sequences: int = 64) -> dict[str, Any]:
        """Teacher-forced τ and Recall@1 (mean and per position) on the held-out conversations.

        Returns:
            ``{"heldout_tau", "heldout_top1", "heldout_top1_per_position"}``, or ``{}`` without
            held-out conversations.
        """
        from dflash2.train.evaluate import teacher_forced

        self.drafter.eval()
        try:
            with self._autocast():
                forced = teacher_forced(
                    self.drafter,
                    self.dataset,
                    self.features,
                    ks=(1,),
                    max_sequences=max_sequences,
                    anchors_per_sequence=32,
                    use_selector=self.config.use_selector,
                )
        finally:
            self.drafter.train()
        if forced.num_blocks == 0:
            return {}
        top1 = forced.recall[1]
        return {"heldout_tau": forced.tau, "heldout_top1": sum(top1) / len(top1), "heldout_top1_per_position": top1}

    def run(self, export_dir: Path | None = None) -> dict[str, Any]:
        """Train until ``steps`` or the time budget; checkpoint, log to ``log.jsonl``, export."""
        start = time.time()
        last: dict[str, Any] = {}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "train_config.json").write_text(json.dumps(asdict(self.config), indent=2) + "\n")
        log = (self.run_dir / "log.jsonl").open("a")
        bar = tqdm(total=self.config.steps, initial=self.step, desc="training", unit="step", dynamic_ncols=True)
        try:
            while self.step < self.config.steps:
                metrics = self.train_step()
                every = self.config.eval_every
                if every and (self.step % every == 0 or self.step == self.config.steps):
                    metrics.update(self.evaluate_heldout())
                metrics["elapsed"] = time.time() - start
                log.write(json.dumps(metrics) + "\n")
                log.flush()
                bar.update(1)
                bar.set_postfix(
                    loss=f"{metrics['loss']:.3f}", top1=f"{metrics['top1']:.3f}", topk=f"{metrics['topk']:.3f}"
                )
                last = metrics
                if self.step % self.config.checkpoint_every == 0:
                    self.save_checkpoint()
                if self.config.time_budget is not None and time.time() - start > self.config.time_budget:
                    logger.info("time budget reached at step %d", self.step)
                    break
        finally:
            bar.close()
            log.close()
            self.save_checkpoint()
        plot_training_log(self.run_dir / "log.jsonl", self.run_dir / "loss.png")
        if export_dir is not None:
            self.export(export_dir)
        return last


def read_training_log(path: Path) -> list[dict[str, Any]]:
    """Metrics lines of ``log.jsonl`` in step order; after a resume the newer line of a step wins."""
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            metrics = json.loads(line)
            by_step[int(metrics["step"])] = metrics
    return [by_step[k] for k in sorted(by_step)]


def plot_training_log(log_path: Path, png_path: Path, window: int = 20) -> None:
    """PNG of the loss (unary CE and selector CE), the top-1 / top-k recall per step and, when
    logged, the held-out teacher-forced τ and top-1.

    Raw values are drawn faintly with a ``window``-step moving average on top.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log = read_training_log(log_path)
    if not log:
        return
    steps = [m["step"] for m in log]

    def smooth(values: list[float]) -> list[float]:
        out, total = [], 0.0
        for i, v in enumerate(values):
            total += v - (values[i - window] if i >= window else 0.0)
            out.append(total / min(i + 1, window))
        return out

    heldout = [m for m in log if "heldout_tau" in m]
    fig, axes = plt.subplots(1, 3 if heldout else 2, figsize=(16 if heldout else 11, 4))
    left, right = axes[0], axes[1]
    for key, label in (("loss", "decay-weighted CE"), ("selector_loss", "selector CE")):
        values = [m[key] for m in log]
        (line,) = left.plot(steps, smooth(values), label=label)
        left.plot(steps, values, alpha=0.2, color=line.get_color())
    left.set_xlabel("step")
    left.set_title("Training loss")
    left.legend()
    for key, label in (("top1", "top-1 recall"), ("topk", "top-k recall")):
        right.plot(steps, smooth([m[key] for m in log]), label=label)
    right.set_xlabel("step")
    right.set_ylim(0, 1)
    if heldout:
        right.plot([m["step"] for m in heldout], [m["heldout_top1"] for m in heldout], "o-", label="held-out top-1")
    right.set_title("Teacher-forced recall over drafted slots")
    right.legend()
    if heldout:
        axes[2].plot([m["step"] for m in heldout], [m["heldout_tau"] for m in heldout], "o-")
        axes[2].set_xlabel("step")
        axes[2].set_title("Held-out teacher-forced τ (T = 0)")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
