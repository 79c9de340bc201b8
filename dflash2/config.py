"""Configuration: the frozen ``EngineConfig`` (everything fixed at engine start-up).

A drafter's ``config.json`` is parsed by ``dflash2.models.drafter_config.DrafterConfig``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from dflash2.models import cpu_kernels
from dflash2.platform import cpu_has_native_bf16

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_PROMPT_LOOKUP_MAX = 4  # the longest n-gram prompt lookup matches when prompt_lookup_max is None
DEFAULT_PROMPT_LOOKUP_MIN = 2  # the shortest, when prompt_lookup_min is None
# The longest n-gram either bound may name: each request indexes (max − min + 1) n-grams of up to max
# tokens per token of its context, so memory grows with the context length times max².
MAX_PROMPT_LOOKUP_N = 16


@dataclass(frozen=True)
class EngineConfig:
    """Everything fixed at engine start-up; per-request knobs live in ``SamplingParams``.

    Attributes:
        model: target (local folder, ``.gguf`` file or hub id); None = embedded default.
        drafter: drafter folder; None = the drafter shipped for the embedded default (if any).
        block_size: tokens per verify block, anchor included; 1 = autoregressive decoding;
            None = the drafter's trained block size.
        use_selector: walk the DFlash 2 selector lattice (False: per-slot unary scores only).
        speculative_draft_vocab_size: draft over only this many of the drafter's most frequent
            tokens (``DFlashDrafter.limit_draft_vocab``; FR-Spec); None = the drafter's own draft
            vocabulary (or the full one). Output is unchanged; speed and acceptance are not.
        max_num_seqs: rows decoded together (KV slots).
        max_model_len: longest prompt + output per request (KV positions per slot); None = the
            model's limit (``max_position_embeddings``), lowered while the KV caches would not
            fit in half of the free memory.
        device, dtype: where and in what precision weights and caches live.
        seed: seeds the per-request generators of requests that give no seed.
        num_threads: torch intra-op threads on CPU (None = the CPUs this process may use).
        adaptive_threads: on CPU, run with fewer threads while that is measurably faster (other
            processes busy on the same cores; ``dflash2/threads.py``); ``num_threads`` is the most.
            False: always ``num_threads``. Off in deterministic mode.
        enforce_eager: run every forward eagerly; by default the verify / decode forward and
            the drafter's block are compiled (inductor on CPU, CUDA graphs on CUDA) and fall
            back to eager mode with a warning when compilation fails (docs/engine.md).
        enable_prefix_caching: reuse the target KV and drafter context of the longest prompt
            prefix another request already computed (``dflash2/prefix_cache.py``).
        speculative_adaptive: choose each step's verify width (drafts per row, 0 … B−1) from live
            acceptance and the measured step cost (``dflash2/adaptive.py``); False: always the
            full block.
        prompt_lookup_max, prompt_lookup_min: prompt lookup beside the drafter
            (``dflash2/prompt_lookup.py``): a step may verify the tokens that followed the latest
            earlier occurrence of a row's last ``prompt_lookup_max`` … ``prompt_lookup_min`` tokens
            instead of running the drafter, when the adaptive policy predicts more tokens per second
            from it. Needs adaptive speculation and a drafter. Both None (the default): on with
            4 … 2 where the engine speculates adaptively, else off. ``prompt_lookup_max`` 0: off;
            either bound given: on, and an error where it cannot run; ``prompt_lookup_min`` alone
            raises the maximum to at least itself. Each is at most ``MAX_PROMPT_LOOKUP_N`` (16).
        deterministic: batch-invariant forwards (``dflash2.models.layers.batch_invariant``): a
            seeded request gives the same text alone or in any batch, and greedy speculative
            output equals greedy autoregressive output token for token, in bfloat16 too. CPU with
            oneDNN only; every forward runs eagerly (docs/engine.md, "Deterministic mode").
    """

    model: str | None = None
    drafter: str | None = None
    block_size: int | None = None
    use_selector: bool = True
    speculative_draft_vocab_size: int | None = None
    max_num_seqs: int = 8
    max_model_len: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    num_threads: int | None = None
    adaptive_threads: bool = True
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    speculative_adaptive: bool = True
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.block_size is not None and not 1 <= self.block_size <= 64:
            raise ValueError("block_size must be in [1, 64]")
        if self.speculative_draft_vocab_size is not None and self.speculative_draft_vocab_size < 1:
            raise ValueError("speculative_draft_vocab_size (--speculative-draft-vocab-size) must be at least 1")
        self._check_prompt_lookup()
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError("num_threads (--threads) must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}")

    def _check_prompt_lookup(self) -> None:
        longest, shortest = self.prompt_lookup_max, self.prompt_lookup_min
        if longest is not None and not 0 <= longest <= MAX_PROMPT_LOOKUP_N:
            raise ValueError(f"prompt_lookup_max (--prompt-lookup-max) must be 0 (off) … {MAX_PROMPT_LOOKUP_N}")
        if shortest is not None and not 1 <= shortest <= MAX_PROMPT_LOOKUP_N:
            raise ValueError(f"prompt_lookup_min (--prompt-lookup-min) must be 1 … {MAX_PROMPT_LOOKUP_N}")
        if longest == 0 and shortest is not None:
            raise ValueError(
                "prompt_lookup_min (--prompt-lookup-min) is given, but --prompt-lookup-max 0 turns lookup off"
            )
        if longest and shortest is not None and longest < shortest:
            raise ValueError(f"prompt_lookup_max ({longest}) must be at least prompt_lookup_min ({shortest})")
        if not self.prompt_lookup_requested:
            return
        if not self.speculative_adaptive:
            raise ValueError(
                "prompt lookup (--prompt-lookup-max/--prompt-lookup-min) needs adaptive speculation: the policy "
                "chooses between lookup and the drafter from measured step costs (drop --no-speculative-adaptive "
                "or the prompt lookup flags)"
            )
        if self.block_size == 1:
            raise ValueError(
                "prompt lookup (--prompt-lookup-max/--prompt-lookup-min) runs beside a drafter: block size 1 "
                "decodes without one (drop the prompt lookup flags)"
            )

    @property
    def prompt_lookup_requested(self) -> bool:
        """True when a prompt lookup flag asks for lookup explicitly (an error where it cannot run)."""
        return bool(self.prompt_lookup_max) or (self.prompt_lookup_max is None and self.prompt_lookup_min is not None)

    @property
    def prompt_lookup_bounds(self) -> tuple[int, int]:
        """``(longest, shortest)`` n-gram prompt lookup matches when it is on (defaults resolved;
        longest 0 when ``prompt_lookup_max`` is 0)."""
        shortest = DEFAULT_PROMPT_LOOKUP_MIN if self.prompt_lookup_min is None else self.prompt_lookup_min
        if self.prompt_lookup_max is None:
            return max(DEFAULT_PROMPT_LOOKUP_MAX, shortest), shortest
        return self.prompt_lookup_max, shortest

    @property
    def torch_device(self) -> torch.device:
        """The resolved device: CUDA when available for ``auto``."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The resolved dtype. ``auto``: bfloat16 on CUDA, on CPUs with native bfloat16 matrix
        instructions (AVX512-BF16 or AMX) and on other CPUs with AVX2 where the project's bfloat16
        kernel builds (:mod:`dflash2.models.cpu_kernels`, built the first time); float32 elsewhere."""
        if self.dtype == "auto":
            if self.torch_device.type == "cuda":
                return torch.bfloat16
            if self.torch_device.type == "cpu" and (cpu_has_native_bf16() or cpu_kernels.available()):
                return torch.bfloat16
            return torch.float32
        return DTYPES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict view (for logging)."""
        return asdict(self)
