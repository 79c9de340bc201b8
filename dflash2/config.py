"""Configuration: the frozen ``EngineConfig`` (what was asked for) and ``EngineSpec`` (what an engine runs
with: the request resolved against the loaded models; ``resolve_spec``).

A drafter's ``config.json`` is parsed by ``dflash2.models.drafter_config.DrafterConfig``.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# --quantization and --speculative-draft-quantization (dflash2.models.quantize says what each means).
QUANTIZATION_CHOICES = ("auto", "none", "gguf", "int8", "int4")
DRAFT_QUANTIZATION_CHOICES = ("none", "int8", "int4")
DEFAULT_PROMPT_LOOKUP_MAX = 4  # the longest n-gram prompt lookup matches when prompt_lookup_max is None
DEFAULT_PROMPT_LOOKUP_MIN = 2  # the shortest, when prompt_lookup_min is None
SUGGESTED_SUFFIX_MAX_CACHED_REQUESTS = 256  # earlier outputs to keep when turning suffix decoding on
DEFAULT_SUFFIX_MAX_CACHED_TOKENS = 65_536  # and the most tokens they hold in all (~40 MB of index)
# The longest n-gram either bound may name: each request indexes (max − min + 1) n-grams of up to max
# tokens per token of its context, so memory grows with the context length times max².
MAX_PROMPT_LOOKUP_N = 16
# The widest token tree's branching per depth (the drafter's candidates per slot bound it too).
MAX_SPECULATIVE_TOPK = 16


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
        device, dtype: where and in what precision weights and caches live (``auto``: see
            ``torch_device`` and ``dflash2.runner.model_setup.resolve_dtype``).
        seed: seeds the per-request generators of requests that give no seed.
        num_threads: torch intra-op threads on CPU (None = the CPUs this process may use).
        adaptive_threads: on CPU, run with fewer threads while that is measurably faster (other
            processes busy on the same cores; ``dflash2/threads.py``); ``num_threads`` is the most.
            False: always ``num_threads``. Off in deterministic mode.
        enforce_eager: run every forward eagerly; by default the verify / decode forward and
            the drafter's block are compiled (inductor on CPU, CUDA graphs on CUDA) and fall
            back to eager mode with a warning when compilation fails (docs/engine.md).
        background_compile: build the compiled forwards in a background process while the engine
            serves with its eager forwards, and switch to them between two steps once they are built
            (``dflash2/runner/background.py``; CPU, one process; elsewhere compiled up front). The
            server's default (``--wait-for-compile`` turns it off); ``LLM``, ``generate`` and the
            benchmarks compile before they decode. No effect with ``enforce_eager``.
        enable_prefix_caching: reuse the target KV and drafter context of the longest prompt
            prefix another request already computed (``dflash2/engine/prefix_cache.py``).
        speculative_adaptive: choose each step's verify width (drafts per row, 0 … B−1) from live
            acceptance and the measured step cost (``dflash2/spec/adaptive.py``); False: always the
            full block.
        prompt_lookup_max, prompt_lookup_min: prompt lookup beside the drafter
            (``dflash2/spec/prompt_lookup.py``): a step may verify the tokens that followed the latest
            earlier occurrence of a row's last ``prompt_lookup_max`` … ``prompt_lookup_min`` tokens
            instead of running the drafter, when the adaptive policy predicts more tokens per second
            from it. Needs adaptive speculation and a drafter. Both None (the default): on with
            4 … 2 where the engine speculates adaptively, else off. ``prompt_lookup_max`` 0: off;
            either bound given: on, and an error where it cannot run; ``prompt_lookup_min`` alone
            raises the maximum to at least itself. Each is at most ``MAX_PROMPT_LOOKUP_N`` (16).
        grammar_forced_drafts: where a request's grammar forces the next tokens (the rest of a JSON key,
            a tool call's markers), verify them as drafts (``dflash2.grammar.walk_drafts``): accepted
            whenever the target agrees, at no drafter cost. Speculative engines only.
        suffix_decoding_max_cached_requests, suffix_decoding_max_cached_tokens: drafts from earlier
            outputs (suffix decoding, ``dflash2/spec/suffix.py``; vLLM's ``suffix_decoding_max_cached_requests``):
            the outputs of the most recent finished requests, at most this many and this many tokens
            in all, from which any row's last tokens retrieve a continuation, priced beside prompt lookup
            by the adaptive policy. 0 (the default): off — measured, it gained nothing on the agent loop,
            where each request's own history holds the repeats, and lost a few percent on two of the four
            prompt sets (docs/engine.md); ``SUGGESTED_SUFFIX_MAX_CACHED_REQUESTS`` is a good start where
            requests repeat each other's outputs. A positive count where the engine does not speculate
            adaptively is an error.
        speculative_topk: branching of the token tree a drafted step verifies (SGLang's
            ``--speculative-eagle-topk``; ``dflash2/spec/tree.py``): the beam keeps this many paths
            per depth through the selector lattice. 1 (the default): one path, the chain.
        speculative_num_draft_tokens: tokens a drafted step verifies per row, the anchor included
            (SGLang's ``--speculative-num-draft-tokens``): for a chain that is the block size (given
            alone it sets ``block_size``), for a tree its node budget at the full block (a narrower
            step keeps the same share of it); None = B for a chain, ``2 · B − 1`` for a tree.
        deterministic: batch-invariant forwards (``dflash2.models.layers.batch_invariant``): a
            seeded request gives the same text alone or in any batch, and greedy speculative
            output equals greedy autoregressive output token for token, in bfloat16 too. CPU with
            AVX512-BF16 or AMX only; every forward runs eagerly (docs/engine.md, "Deterministic mode").
        quantization: weight-only quantized linears (vLLM's ``--quantization``;
            :mod:`dflash2.models.quantize`): ``gguf`` keeps a ``.gguf`` target's own quantized tensors,
            ``int8`` / ``int4`` quantize a float checkpoint at load (round to nearest, groups of 32),
            ``none`` keeps dense weights; ``auto``: ``gguf`` for a ``.gguf`` file given as ``model`` on a
            CPU where the kernel runs, else ``none`` (the embedded default too: measured faster dense).
        speculative_draft_quantization: the drafter's own linears, ``none``, ``int8`` or ``int4``
            (round to nearest; its KV cache stays in the serving dtype).
        tensor_parallel_size: ranks the target is split over (vLLM's ``--tensor-parallel-size``): this
            process and N − 1 workers, one GPU each on CUDA (``dflash2/runner/tensor_parallel.py``,
            ``dflash2/models/tensor_parallel.py``); 1 = one process.
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
    background_compile: bool = False
    enable_prefix_caching: bool = True
    speculative_adaptive: bool = True
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    grammar_forced_drafts: bool = True
    suffix_decoding_max_cached_requests: int = 0
    suffix_decoding_max_cached_tokens: int = DEFAULT_SUFFIX_MAX_CACHED_TOKENS
    speculative_topk: int = 1
    speculative_num_draft_tokens: int | None = None
    deterministic: bool = False
    tensor_parallel_size: int = 1
    quantization: str = "auto"
    speculative_draft_quantization: str = "none"

    def __post_init__(self) -> None:
        if self.block_size is not None and not 1 <= self.block_size <= 64:
            raise ValueError("block_size must be in [1, 64]")
        if self.speculative_draft_vocab_size is not None and self.speculative_draft_vocab_size < 1:
            raise ValueError("speculative_draft_vocab_size (--speculative-draft-vocab-size) must be at least 1")
        self._check_prompt_lookup()
        self._check_suffix_decoding()
        if not 1 <= self.speculative_topk <= MAX_SPECULATIVE_TOPK:
            raise ValueError(f"speculative_topk (--speculative-topk) must be 1 … {MAX_SPECULATIVE_TOPK}")
        if self.speculative_num_draft_tokens is not None and not 1 <= self.speculative_num_draft_tokens <= 256:
            raise ValueError("speculative_num_draft_tokens (--speculative-num-draft-tokens) must be 1 … 256")
        if self.speculative_topk > 1 and self.speculative_num_draft_tokens == 1:
            raise ValueError("a token tree (--speculative-topk > 1) needs --speculative-num-draft-tokens ≥ 2")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError("num_threads (--threads) must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
        if not 1 <= self.tensor_parallel_size <= 64:
            raise ValueError("tensor_parallel_size (--tensor-parallel-size) must be 1 … 64")
        if self.tensor_parallel_size > 1 and self.deterministic:
            raise ValueError(
                "--deterministic runs in one process: its batch-invariant kernels do not cover a sum split over "
                "ranks; drop --tensor-parallel-size or --deterministic"
            )
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization (--quantization) must be one of {', '.join(QUANTIZATION_CHOICES)}")
        if self.speculative_draft_quantization not in DRAFT_QUANTIZATION_CHOICES:
            raise ValueError(
                "speculative_draft_quantization (--speculative-draft-quantization) must be one of "
                + ", ".join(DRAFT_QUANTIZATION_CHOICES)
            )
        if self.tensor_parallel_size > 1 and self.speculative_draft_quantization != "none":
            raise ValueError(
                "--speculative-draft-quantization runs in one process: drop --tensor-parallel-size or the flag"
            )
        if self.tensor_parallel_size > 1 and self.quantization not in ("auto", "none"):
            raise ValueError(
                f"--quantization {self.quantization} runs in one process: drop --tensor-parallel-size or use "
                "--quantization none"
            )

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

    def _check_suffix_decoding(self) -> None:
        requests, tokens = self.suffix_decoding_max_cached_requests, self.suffix_decoding_max_cached_tokens
        if requests < 0:
            raise ValueError(
                "suffix_decoding_max_cached_requests (--suffix-decoding-max-cached-requests) must be 0 (off) or more"
            )
        if tokens < 1:
            raise ValueError(
                "suffix_decoding_max_cached_tokens (--suffix-decoding-max-cached-tokens) must be at least 1"
            )
        if requests and not self.speculative_adaptive:
            raise ValueError(
                "suffix decoding (--suffix-decoding-max-cached-requests) needs adaptive speculation: the policy "
                "chooses between its drafts and the drafter from measured step costs (drop "
                "--no-speculative-adaptive or set --suffix-decoding-max-cached-requests 0)"
            )
        if requests and self.block_size == 1:
            raise ValueError(
                "suffix decoding (--suffix-decoding-max-cached-requests) runs beside a drafter: block size 1 "
                "decodes without one (set --suffix-decoding-max-cached-requests 0)"
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

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict view (for logging)."""
        return asdict(self)


@dataclass(frozen=True)
class EngineSpec:
    """An engine's settings resolved against its loaded models, fixed at start-up (``resolve_spec``).

    Attributes:
        block_size: B, tokens per verify block, anchor included (1: autoregressive decoding).
        speculative: steps draft blocks (B > 1, a drafter is loaded).
        adaptive: the adaptive policy chooses each step's verify width (speculative and
            ``config.speculative_adaptive``).
        prompt_lookup_max, prompt_lookup_min: the longest and shortest n-gram prompt lookup matches
            (``prompt_lookup_max`` 0: off).
        grammar_forced_drafts: grammar-forced tokens are verified as drafts (speculative engines).
        suffix_max_requests, suffix_max_tokens: the bounds of the earlier-output index (suffix decoding;
            ``suffix_max_requests`` 0: off).
        max_num_seqs: KV slots (rows decoded together).
        max_model_len: positions per KV slot (longest prompt + output).
        device: where the weights and caches live.
        vocab_size: the target's vocabulary.
        tree_topk: branching of the token trees drafted steps verify (1: chains).
        tree_nodes: drafted nodes of a full-block tree per row, the anchor not counted (0: chains).
    """

    block_size: int
    speculative: bool
    adaptive: bool
    prompt_lookup_max: int
    prompt_lookup_min: int
    max_num_seqs: int
    max_model_len: int
    device: torch.device
    vocab_size: int
    tree_topk: int = 1
    tree_nodes: int = 0
    grammar_forced_drafts: bool = False
    suffix_max_requests: int = 0
    suffix_max_tokens: int = DEFAULT_SUFFIX_MAX_CACHED_TOKENS

    @property
    def tree(self) -> bool:
        """Drafted steps may verify token trees rather than chains."""
        return self.tree_nodes > 0

    def tree_budget(self, width: int) -> int:
        """Drafted nodes per row of a tree step at block width W (2 … B): the configured budget at the full
        block, the same share of it for a narrower step, never fewer than its W − 1 drafts."""
        return max(width - 1, round(self.tree_nodes * (width - 1) / (self.block_size - 1)))


def resolve_spec(config: EngineConfig, target: Any, drafter: Any | None) -> EngineSpec:
    """Resolve ``config`` against the loaded ``target`` and ``drafter`` (None: none).

    The block size is the config's, else the drafter's trained one (1 without a drafter); prompt lookup
    is on by default where the engine speculates adaptively; ``max_model_len`` defaults to the model's
    limit, halved while the KV caches of every slot would take more than half of the free memory.

    Raises:
        ValueError: a block size > 1 without a drafter; prompt lookup asked for where the engine does not
            speculate adaptively (before anything is compiled).
    """
    embed_weight = target.embedding_weights()[0]
    block_size = _block_size(config, drafter)
    speculative = block_size > 1
    adaptive = speculative and config.speculative_adaptive
    if config.prompt_lookup_requested and not adaptive:
        raise ValueError(
            "prompt lookup (--prompt-lookup-max/--prompt-lookup-min) runs beside a drafter: this engine does "
            "not speculate (block size 1 or no drafter); drop the prompt lookup flags"
        )
    if config.suffix_decoding_max_cached_requests and not adaptive:
        raise ValueError(
            "suffix decoding (--suffix-decoding-max-cached-requests) runs beside a drafter: this engine does not "
            "speculate (block size 1 or no drafter); set --suffix-decoding-max-cached-requests 0"
        )
    suffix_requests = config.suffix_decoding_max_cached_requests
    longest, shortest = config.prompt_lookup_bounds
    device = embed_weight.device
    tree_topk, tree_nodes = _tree(config, target, drafter, block_size)
    kv_bytes = _kv_bytes_per_token(target, drafter if speculative else None)
    return EngineSpec(
        block_size=block_size,
        speculative=speculative,
        adaptive=adaptive,
        prompt_lookup_max=longest if adaptive else 0,
        prompt_lookup_min=shortest,
        max_num_seqs=config.max_num_seqs,
        max_model_len=config.max_model_len or _default_max_model_len(target, kv_bytes, config.max_num_seqs, device),
        device=device,
        vocab_size=int(getattr(target, "vocab_size", embed_weight.shape[0])),
        tree_topk=tree_topk,
        tree_nodes=tree_nodes,
        grammar_forced_drafts=speculative and config.grammar_forced_drafts,
        suffix_max_requests=suffix_requests if adaptive else 0,
        suffix_max_tokens=config.suffix_decoding_max_cached_tokens,
    )


def _tree(config: EngineConfig, target: Any, drafter: Any | None, block_size: int) -> tuple[int, int]:
    """``(topk, nodes)`` of the token trees drafted steps verify; ``(1, 0)`` for chains.

    Raises:
        ValueError: a tree asked for where it cannot run (no drafter, the transformers fallback target,
            deterministic mode, topk above the drafter's candidates), or a chain given a node budget other
            than its B − 1 drafts.
    """
    topk, nodes = config.speculative_topk, config.speculative_num_draft_tokens
    if topk == 1:
        if nodes is not None and nodes != block_size:
            raise ValueError(
                f"--speculative-num-draft-tokens {nodes} differs from --block-size {block_size}: a chain verifies "
                "its block (give one of them, or --speculative-topk > 1 for a tree)"
            )
        return 1, 0
    if drafter is None:
        raise ValueError("--speculative-topk > 1 verifies token trees of drafted tokens: it needs a drafter")
    if block_size == 1:
        raise ValueError("--speculative-topk > 1 verifies token trees of drafted tokens: --block-size 1 drafts none")
    if not hasattr(target, "forward_slots"):  # the transformers fallback
        raise ValueError(f"token trees need a target the project decodes itself, not {type(target).__name__}")
    if config.deterministic:
        raise ValueError("--deterministic verifies chains only: drop --speculative-topk")
    if topk > drafter.num_candidates:
        raise ValueError(
            f"--speculative-topk {topk} is more than the drafter's {drafter.num_candidates} candidates per position"
        )
    # More nodes than the chain's B − 1 cost little while a verify forward is memory-bound.
    return topk, (nodes - 1) if nodes is not None else 2 * (block_size - 1)


def _block_size(config: EngineConfig, drafter: Any | None) -> int:
    if drafter is None:
        if config.block_size not in (None, 1):
            raise ValueError("block_size > 1 needs a drafter (pass a drafter path)")
        if config.speculative_topk == 1 and config.speculative_num_draft_tokens not in (None, 1):
            raise ValueError("--speculative-num-draft-tokens > 1 needs a drafter (pass a drafter path)")
        return 1
    if config.block_size is None:
        if config.speculative_topk == 1 and config.speculative_num_draft_tokens is not None:
            return config.speculative_num_draft_tokens  # a chain verifies its block
        return int(drafter.config.block_size)
    if config.block_size != drafter.config.block_size:
        logger.warning(
            "block size %d differs from the drafter's trained block size %d",
            config.block_size,
            drafter.config.block_size,
        )
    return config.block_size


def _default_max_model_len(target: Any, kv_bytes_per_token: int, num_slots: int, device: torch.device) -> int:
    """The model's own context limit (``max_position_embeddings``), halved while the KV caches of
    every slot at that length would take more than half of the free memory (down to 2048)."""
    limit = int(getattr(target.config, "max_position_embeddings", 0) or 2048)
    per_token = kv_bytes_per_token * (num_slots + 1)  # + the scratch slot
    if device.type == "cuda":
        free: int | None = torch.cuda.mem_get_info(device)[0]
    else:
        from dflash2.platform import available_memory_bytes

        free = available_memory_bytes()
    length = limit
    while free is not None and length > 2048 and per_token * length > free // 2:
        length //= 2
    if length < limit:
        logger.warning(
            "max_model_len %d (the model's limit is %d, but %d slots at that length need %.1f GiB of KV "
            "cache and %.1f GiB is free); set --max-model-len to choose",
            length,
            limit,
            num_slots,
            per_token * limit / 2**30,
            (free or 0) / 2**30,
        )
    return length


def _layer_kv_shapes(config: Any) -> list[tuple[int, int]]:
    """Per decoder layer, ``(key-value heads, head dim)``: from ``per_layer_config`` where a config's
    layers differ (Gemma 4: the full-attention layers' heads are wider; reading ``config.head_dim``
    there raises), else the config's own values for every layer."""
    layers = getattr(config, "per_layer_config", None)
    configs = list(layers) if layers is not None else [config] * int(config.num_hidden_layers)
    shapes = []
    for layer in configs:
        heads = int(getattr(layer, "num_key_value_heads", None) or layer.num_attention_heads)
        head_dim = int(getattr(layer, "head_dim", None) or layer.hidden_size // layer.num_attention_heads)
        shapes.append((heads, head_dim))
    return shapes


def _kv_bytes_per_token(target: Any, drafter: Any | None) -> int:
    """KV-cache bytes one token takes in one slot: target (+ drafter context)."""

    def per_token(config: Any, dtype: torch.dtype) -> int:
        return 2 * sum(heads * head_dim for heads, head_dim in _layer_kv_shapes(config)) * dtype.itemsize

    total = per_token(target.config, target.embedding_weights()[0].dtype)
    if drafter is not None:
        total += per_token(drafter.config, drafter.dtype)
    return total
