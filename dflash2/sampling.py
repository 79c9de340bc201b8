"""Per-request sampling parameters and the logits → target-probabilities pipeline.

Dimension letters used in shape comments:
    R  rows (running requests in the batch)
    L  positions per row (block positions being verified)
    V  vocabulary size

Processor order (the same as vLLM's): repetition / presence / frequency penalties,
logit bias, min-tokens EOS masking, then temperature, top-k, top-p and min-p.
Greedy rows (temperature 0) take the argmax after the penalties, bias and masks and
are represented as one-hot target probabilities, so greedy and sampled rows share
the rejection sampler in ``verify.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dflash2.grammar import apply_token_mask

_EPS_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler; validated in ``__post_init__``.

    Penalty semantics follow vLLM: ``repetition_penalty`` counts prompt and output tokens,
    ``presence_penalty`` / ``frequency_penalty`` count output tokens; inside a verify block
    the drafted tokens before a position count as output for that position.

    Raises:
        ValueError: on any out-of-range value (the message names the field).
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: no logprobs; k ≥ 0: the chosen token plus k alternatives
    skip_special_tokens: bool = True
    grammar: str | None = None  # an llguidance grammar (dflash2.grammar); None: unconstrained
    # The string that ends each unit of the output (a tool call's closing tag): a unit that repeats an
    # earlier one, surrounding whitespace aside, ends the request right before it (dflash2.detokenize).
    repeat_marker: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", stop_strings(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "logit_bias", {int(k): float(v) for k, v in self.logit_bias.items()})
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        checks = [
            (self.max_tokens >= 1, "max_tokens must be at least 1"),
            (self.temperature >= 0.0, "temperature must be non-negative"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be -1, 0 (disabled) or positive"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (self.repetition_penalty > 0.0, "repetition_penalty must be positive"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens must be in [0, max_tokens]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
            (all(s for s in self.stop), "stop strings must be non-empty"),
            (self.repeat_marker is None or bool(self.repeat_marker.strip()), "repeat_marker must not be blank"),
            (
                all(-100 <= v <= 100 for v in self.logit_bias.values()),
                "logit_bias values must be in [-100, 100]",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def check_vocabulary(self, vocab_size: int) -> None:
        """Checks against the loaded model's vocabulary.

        Raises:
            ValueError: naming the field: ``top_k`` above ``vocab_size``, or ``logit_bias`` /
                ``stop_token_ids`` ids outside ``[0, vocab_size)``.
        """
        if self.top_k > vocab_size:
            raise ValueError(f"top_k must be -1, 0 (disabled) or at most the vocabulary size {vocab_size}")
        check_token_ids(list(self.logit_bias), vocab_size, "logit_bias")
        check_token_ids(self.stop_token_ids, vocab_size, "stop_token_ids")

    @property
    def is_greedy(self) -> bool:
        """True when the request decodes by argmax (temperature 0)."""
        return self.temperature < _EPS_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """True when a count-based penalty changes the logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """A stop string, a list of them or None, as the tuple ``SamplingParams.stop`` holds."""
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def check_token_ids(token_ids: Sequence[int], vocab_size: int, name: str) -> None:
    """The one check of token ids against a vocabulary.

    Raises:
        ValueError: ``"<name> token ids must be in [0, V)"`` when one is outside.
    """
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise ValueError(f"{name} token ids must be in [0, {vocab_size})")


@dataclass
class LogitsContext:
    """Per-row inputs of :func:`target_probs` for one batched verify (built once per step).

    Attributes:
        params: one ``SamplingParams`` per row.
        prompt_ids: prompt token ids per row (used by the repetition penalty).
        output_ids: output tokens already committed per row (the anchor included).
        eos_token_ids: ids masked while a row is below ``min_tokens``.
    """

    params: Sequence[SamplingParams]
    prompt_ids: Sequence[Sequence[int]]
    output_ids: Sequence[Sequence[int]]
    eos_token_ids: Sequence[int]


def _token_counts(rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Occurrence counts per row: ``[R, V]`` float32."""
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
    for r, ids in enumerate(rows):
        if ids:
            index = torch.tensor(list(ids), dtype=torch.long, device=device)
            counts[r].index_add_(0, index, torch.ones(len(index), device=device))
    return counts


def _block_counts(draft_ids: torch.Tensor, num_positions: int, vocab_size: int) -> torch.Tensor:
    """Counts of the drafted tokens *before* each block position: ``[R, L, V]``.

    Position i of the verify block predicts the token after ``draft_ids[:, :i]`` so those
    i tokens count as output for it (position 0 sees none of them).
    """
    num_rows = draft_ids.shape[0]
    counts = torch.zeros(num_rows, num_positions, vocab_size, dtype=torch.float32, device=draft_ids.device)
    if draft_ids.shape[1] == 0 or num_positions <= 1:
        return counts
    one_hot = torch.nn.functional.one_hot(draft_ids[:, : num_positions - 1], vocab_size).float()  # [R, L-1, V]
    counts[:, 1:] = one_hot.cumsum(dim=1)
    return counts


def apply_penalties(logits: torch.Tensor, ctx: LogitsContext, draft_ids: torch.Tensor) -> torch.Tensor:
    """Apply repetition / presence / frequency penalties position by position.

    Args:
        logits: ``[R, L, V]`` float32 target logits of the verify block.
        ctx: per-row parameters and token histories.
        draft_ids: ``[R, L-1]`` drafted tokens of the block (position i counts ``draft_ids[:, :i]``).

    Returns:
        Penalised logits, same shape (a new tensor; rows without penalties are unchanged).
    """
    rows = [r for r, p in enumerate(ctx.params) if p.has_penalties]
    if not rows:
        return logits
    logits = logits.clone()
    num_positions, vocab_size = logits.shape[1], logits.shape[2]
    index = torch.tensor(rows, device=logits.device)
    block = _block_counts(draft_ids[index], num_positions, vocab_size)  # [r, L, V]
    output = _token_counts([ctx.output_ids[r] for r in rows], vocab_size, logits.device)[:, None] + block
    prompt = _token_counts([ctx.prompt_ids[r] for r in rows], vocab_size, logits.device)[:, None]
    params = [ctx.params[r] for r in rows]
    rep = torch.tensor([p.repetition_penalty for p in params], device=logits.device)[:, None, None]
    pres = torch.tensor([p.presence_penalty for p in params], device=logits.device)[:, None, None]
    freq = torch.tensor([p.frequency_penalty for p in params], device=logits.device)[:, None, None]
    sub = logits[index]
    seen = (output + prompt) > 0
    sub = torch.where(seen & (sub > 0), sub / rep, torch.where(seen, sub * rep, sub))
    sub = sub - freq * output - pres * (output > 0).float()
    logits[index] = sub
    return logits


def apply_bias_and_min_tokens(logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
    """Add ``logit_bias`` and mask EOS / stop ids at positions still below ``min_tokens``.

    Args:
        logits: ``[R, L, V]``; position i of row r would be output token number
            ``len(output_ids[r]) + i + 1``.

    Returns:
        The processed logits (a new tensor only when something applies).
    """
    vocab_size = logits.shape[-1]
    cloned = False
    for r, p in enumerate(ctx.params):
        masked_positions = p.min_tokens - len(ctx.output_ids[r])
        if not p.logit_bias and masked_positions <= 0:
            continue
        if not cloned:
            logits, cloned = logits.clone(), True
        for token_id, bias in p.logit_bias.items():
            if 0 <= token_id < vocab_size:
                logits[r, :, token_id] += bias
        if masked_positions > 0:
            banned = [t for t in (*ctx.eos_token_ids, *p.stop_token_ids) if 0 <= t < vocab_size]
            if banned:
                logits[r, :masked_positions, banned] = float("-inf")
    return logits


def probs_from_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Turn processed logits into the target distribution each row samples from.

    Greedy rows become one-hot at the argmax (lowest index on ties); sampled rows get
    temperature, then top-k, top-p and min-p filtering, then softmax.

    Args:
        logits: ``[R, L, V]`` float32.
        params: one ``SamplingParams`` per row.

    Returns:
        ``[R, L, V]`` float32 probabilities, each row summing to 1.
    """
    num_rows = logits.shape[0]
    device = logits.device
    greedy = torch.tensor([p.is_greedy for p in params], device=device)
    temperature = torch.tensor([max(p.temperature, _EPS_TEMPERATURE) for p in params], device=device)
    scaled = logits / temperature[:, None, None]
    if any(p.top_k > 0 for p in params):
        top_k = torch.tensor([p.top_k if p.top_k > 0 else logits.shape[-1] for p in params], device=device)
        scaled = _filter_top_k(scaled, top_k)
    if any(p.top_p < 1.0 for p in params):
        scaled = _filter_top_p(scaled, torch.tensor([p.top_p for p in params], device=device))
    probs = torch.softmax(scaled, dim=-1)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device)[:, None, None]
        probs = torch.where(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0, probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if bool(greedy.any()):
        one_hot = torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).to(probs.dtype)
        probs = torch.where(greedy.view(num_rows, 1, 1), one_hot, probs)
    return probs


def _filter_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's ``top_k[r]`` largest logits (ties at the threshold kept): ``[R, L, V]``."""
    max_k = int(top_k.max())
    values = logits.topk(max_k, dim=-1).values  # [R, L, max_k]
    threshold = values.gather(-1, (top_k - 1).view(-1, 1, 1).expand(-1, logits.shape[1], 1))
    return logits.masked_fill(logits < threshold, float("-inf"))


def _filter_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches ``top_p[r]``: ``[R, L, V]``."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    remove_sorted = mass_before >= top_p.view(-1, 1, 1)
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def target_probs(
    logits: torch.Tensor, ctx: LogitsContext, draft_ids: torch.Tensor, allowed: torch.Tensor | None = None
) -> torch.Tensor:
    """Full pipeline: penalties → bias / min_tokens → grammar mask → temperature / top-k / top-p / min-p.

    Args:
        logits: ``[R, L, V]`` raw target logits of the verify block (any float dtype).
        ctx: per-row parameters and histories.
        draft_ids: ``[R, L-1]`` drafted tokens (empty second dim for autoregressive steps).
        allowed: ``[R, L, V]`` bool grammar masks (``dflash2.grammar``), or None.

    Returns:
        ``[R, L, V]`` float32 target probabilities.
    """
    return probs_from_logits(process_logits(logits, ctx, draft_ids, allowed), ctx.params)


def process_logits(
    logits: torch.Tensor, ctx: LogitsContext, draft_ids: torch.Tensor, allowed: torch.Tensor | None = None
) -> torch.Tensor:
    """The logits processors of :func:`target_probs` (penalties → bias / min_tokens → grammar mask),
    without the distribution: ``[R, L, V]`` float32 (what a greedy row takes the argmax of)."""
    logits = logits.float()
    logits = apply_penalties(logits, ctx, draft_ids)
    logits = apply_bias_and_min_tokens(logits, ctx)
    return apply_token_mask(logits, allowed)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling, one uniform per row: ``probs [R, V]``, ``uniforms [R]`` → ids ``[R]``.

    Deterministic given the uniforms, so a request's per-request generator alone decides
    its samples whatever else is in the batch. Zero-probability tokens are never chosen.
    """
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    ids = torch.searchsorted(cdf, uniforms[:, None] * total, right=True).squeeze(-1)
    ids = ids.clamp(max=probs.shape[-1] - 1)
    # Guard against landing on a zero-probability token at the top edge through rounding.
    bad = probs.gather(-1, ids[:, None]).squeeze(-1) <= 0
    if bool(bad.any()):
        ids = torch.where(bad, probs.argmax(dim=-1), ids)
    return ids
