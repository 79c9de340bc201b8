"""What a benchmark run measures: the frozen ``BenchConfig`` and the methods it expands into.

Method families (``--methods``):

| family | what runs | rows |
|---|---|---|
| ``ar`` | this engine, block size 1 (autoregressive, the speedup baseline) | ``ar`` |
| ``dflash`` | this engine with the drafter, selector off (per-slot argmax / unary sampling) | ``dflash-b8``, … |
| ``dflash2`` | this engine with the drafter and the DFlash 2 selector | ``dflash2-b8``, … |
| ``hf`` | transformers ``generate`` on the same folder and dtype | ``hf`` |
| ``hf-pld`` | transformers assisted generation with prompt lookup | ``hf-pld`` |
| ``llama.cpp`` | ``llama-cpp-python`` on a GGUF of the same model | ``llama.cpp`` |

Temperatures are per request, so one method (one process) runs every temperature.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from dflash2.config import EngineConfig

AR, DFLASH, DFLASH2, HF, HF_PLD, LLAMA_CPP = "ar", "dflash", "dflash2", "hf", "hf-pld", "llama.cpp"
METHOD_FAMILIES = (AR, DFLASH, DFLASH2, HF, HF_PLD, LLAMA_CPP)
PROMPT_SETS = ("heldout", "humaneval", "math", "multiturn")
#: Families whose speed is a speedup baseline (a row is compared with each at the same temperature).
BASELINES = (AR, HF, HF_PLD, LLAMA_CPP)

ENGINE, TRANSFORMERS, LLAMA = "engine", "transformers", "llama.cpp"

#: The agent-loop workload's servers (``bench/agent_loop.py``): name → (speculative, extra ``dflash2 serve``
#: flags). ``dflash2`` is the speculative default with every draft source; the others turn sources off.
AGENT_LOOP_SERVERS: dict[str, tuple[bool, tuple[str, ...]]] = {
    AR: (False, ()),
    DFLASH2: (True, ()),  # the server's default: grammar-forced drafts on, earlier outputs off
    "dflash2-suffix": (True, ("--suffix-decoding-max-cached-requests", "256")),
    "dflash2-no-grammar": (True, ("--no-grammar-forced-drafts",)),
    "dflash2-base": (True, ("--no-grammar-forced-drafts", "--suffix-decoding-max-cached-requests", "0")),
}
#: The agent-loop server without the grammar-forced and suffix draft sources (a ratio's reference).
AGENT_LOOP_BASE = "dflash2-base"
#: Conversations the agent-loop workload has scripts for.
AGENT_LOOP_MAX_CONVERSATIONS = 4


@dataclass(frozen=True)
class MethodSpec:
    """One measured method: a row family at one block size (engine) or one peer.

    Attributes:
        id: row name (``ar``, ``dflash2-b8``, ``hf-pld``, …), also the worker's log name.
        family: one of ``METHOD_FAMILIES``.
        runner: ``engine``, ``transformers`` or ``llama.cpp``.
        block_size: B for engine methods (1 = autoregressive); 0 for peers.
        use_selector: the DFlash 2 selector walk (engine methods with a drafter).
        prompt_lookup_tokens: ``prompt_lookup_num_tokens`` for ``hf-pld``, else 0.
        enforce_eager: engine methods: run every forward eagerly (the ``-eager`` rows).
        adaptive: speculative engine methods: the adaptive policy chooses each step's verify width
            up to B (the engine's default; the ``-adaptive`` rows) instead of full blocks.
        prompt_lookup: adaptive rows: prompt lookup beside the drafter (the engine's default;
            ``dflash2/spec/prompt_lookup.py``); the ``-adaptive-no-lookup`` row runs without it.
        tree_topk, tree_nodes: the ``-tree-N`` rows: token trees of ``tree_topk`` branches per depth and
            N nodes verified per row, anchor included (``--speculative-topk``,
            ``--speculative-num-draft-tokens``; ``dflash2/spec/tree.py``); 1 and 0 for chains.
        tensor_parallel_size: engine methods: ranks the target is split over (the ``-tpN`` rows;
            ``dflash2/runner/tensor_parallel.py``); 0 = the run's ``--tensor-parallel-size``.
        quantization: engine methods: ``--quantization`` of the ``-quant-Q`` rows; "" = the run's.
        gguf_type: llama.cpp methods: the GGUF tensor type of the ``llama.cpp-T`` rows (the model's own
            GGUF file when it has that type, else one requantized from it); "" = the run's ``--gguf``.
    """

    id: str
    family: str
    runner: str
    block_size: int = 0
    use_selector: bool = True
    prompt_lookup_tokens: int = 0
    enforce_eager: bool = False
    adaptive: bool = False
    prompt_lookup: bool = False
    tree_topk: int = 1
    tree_nodes: int = 0
    tensor_parallel_size: int = 0
    quantization: str = ""
    gguf_type: str = ""

    @property
    def is_speculative_engine(self) -> bool:
        """True for this engine with a drafter (block size > 1)."""
        return self.runner == ENGINE and self.block_size > 1

    @property
    def label(self) -> str:
        """Human-readable name for tables and plots."""
        ranks = f", TP {self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else ""
        weights = f", weights {self.quantization}" if self.quantization else ""
        file_type = f" on {self.gguf_type}" if self.gguf_type else ""
        return self._base_label + file_type + ranks + weights + (", eager" if self.enforce_eager else "")

    @property
    def _base_label(self) -> str:
        if self.family == AR:
            return "dflash2 engine, autoregressive (B=1)"
        if self.family == DFLASH:
            return f"DFlash, selector off (B={self.block_size})"
        if self.family == DFLASH2:
            if self.tree_topk > 1:
                tree = f"K={self.tree_topk}, N={self.tree_nodes}"
                if self.adaptive:
                    lookup = ", prompt lookup" if self.prompt_lookup else ""
                    return f"DFlash 2, token tree or chain (B≤{self.block_size}, {tree}, adaptive{lookup})"
                return f"DFlash 2, token tree (B={self.block_size}, {tree})"
            if self.adaptive:
                lookup = ", prompt lookup" if self.prompt_lookup else ""
                return f"DFlash 2, selector on (B≤{self.block_size}, adaptive{lookup})"
            return f"DFlash 2, selector on (B={self.block_size})"
        if self.family == HF:
            return "transformers generate"
        if self.family == HF_PLD:
            return f"transformers prompt lookup ({self.prompt_lookup_tokens})"
        return "llama.cpp (llama-cpp-python)"


@dataclass(frozen=True)
class BenchConfig:
    """Everything one ``dflash2 bench`` run needs; built once from the command line.

    Attributes:
        engine: model, drafter, device, dtype, threads, seed (and ``max_num_seqs`` /
            ``block_size`` / ``use_selector`` for the servers of the serving benchmark).
        out: results folder.
        data: a ``dflash2 data`` folder for the held-out set (None: that set is left out).
        sets: prompt sets to use (subset of ``PROMPT_SETS``).
        num_prompts: prompts per set.
        max_tokens: output tokens per request.
        repeats: measured repetitions (after one warm-up per method).
        methods: method families (``METHOD_FAMILIES``).
        block_sizes: B for the ``dflash`` / ``dflash2`` families.
        temperatures: sampling temperatures (0 = greedy).
        prompt_lookup_tokens: ``prompt_lookup_num_tokens`` of the ``hf-pld`` method.
        gguf: GGUF file for llama.cpp (None: derive one from the model's GGUF source when it has one).
        eager_rows: beside each compiled engine method, measure the same method with
            ``enforce_eager`` (rows ``ar-eager``, ``dflash2-b8-eager``, …) in the same run.
        adaptive_rows: beside each ``dflash2`` method (full blocks of B), measure the same drafter
            with the adaptive policy choosing the verify width (rows ``dflash2-b8-adaptive``).
        tree_nodes: beside each ``dflash2`` method, the same drafter verifying token trees of each of
            these node budgets at full blocks (rows ``dflash2-b8-tree-16``) and, with ``adaptive_rows``,
            the engine's default with trees on (rows ``dflash2-b8-adaptive-tree-16``: the policy chooses
            no draft, chain or tree per step); empty: none.
        tree_topk: the branching of those trees (``--speculative-topk``).
        tensor_parallel_rows: for each N, the autoregressive row and each dflash2 method's default (adaptive)
            row again with the target split over N ranks (rows ``ar-tp2``, ``dflash2-b8-adaptive-tp2``;
            ``dflash2/runner/tensor_parallel.py``); every other engine row runs at the run's ``--tensor-parallel-size``.
        quantization_rows: for each ``--quantization`` value, the autoregressive row and each dflash2
            method's default (adaptive) row again with the target's weights held that way (rows
            ``ar-quant-none``, ``dflash2-b8-adaptive-quant-gguf``; ``dflash2/models/quantize.py``).
        gguf_types: llama.cpp rows on GGUF files of these tensor types (rows ``llama.cpp-Q4_1``, …): the
            model's own GGUF file for its own type, others requantized from it by the ``gguf`` package
            (``Q8_0``, ``Q4_0``, ``Q4_1``, ``F16``, ``BF16``, ``F32``).
        startup: measure the speculative engine's start-up to ready, with an empty and with a
            warm compile cache (in a temporary cache folder).
        single_stream: run the single-stream benchmark.
        serving: run the serving benchmark.
        url: a running server on loopback to load (None: start ``dflash2 serve`` per server config).
        concurrency: concurrent streams per serving level.
        serving_requests: requests per round of a level (a bound; the round also stops at ``serving_seconds``).
        serving_seconds: wall-clock bound per level (per round).
        serving_rounds: rounds of every level; the servers' order alternates from round to round, and
            a level reports the median over its rounds (``× AR``: the median of the rounds' paired ratios).
        serving_temperature: temperature of the serving requests.
        agents: run the multi-turn agent workload (prefix cache on vs off; ``bench/agents.py``).
        agent_history_tokens: tokens of the system prompt the conversations share.
        agent_conversations: concurrent conversations.
        agent_turns: questions per conversation.
        agent_max_tokens: output tokens per answer.
        agent_loop: run the agent-loop workload (tool calls, JSON and text turns per server; ``bench/agent_loop.py``).
        agent_loop_servers: its servers, started one after another (names of ``AGENT_LOOP_SERVERS``).
        agent_loop_conversations: its scripted conversations (the first N of ``AGENT_LOOP_MAX_CONVERSATIONS``).
        agent_loop_max_tokens: output tokens per reply of the agent loop.
        command: the exact command line, for the report.
    """

    # Methods are compared at one fixed thread count, as llama.cpp runs at its n_threads: no thread governor
    # (the single-stream workers also load in parallel, and a governor settling then would start at 1 thread).
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(adaptive_threads=False))
    out: Path = Path("bench-results")
    data: Path | None = None
    sets: tuple[str, ...] = PROMPT_SETS
    num_prompts: int = 4
    max_tokens: int = 128
    repeats: int = 3
    methods: tuple[str, ...] = METHOD_FAMILIES
    block_sizes: tuple[int, ...] = (8, 16)
    temperatures: tuple[float, ...] = (0.0, 1.0)
    prompt_lookup_tokens: int = 10
    eager_rows: bool = True
    adaptive_rows: bool = True
    tree_nodes: tuple[int, ...] = (16,)
    tree_topk: int = 4
    tensor_parallel_rows: tuple[int, ...] = ()
    quantization_rows: tuple[str, ...] = ()
    gguf_types: tuple[str, ...] = ()
    startup: bool = True
    gguf: Path | None = None
    single_stream: bool = True
    serving: bool = True
    url: str | None = None
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    serving_requests: int = 16
    serving_seconds: float = 120.0
    serving_rounds: int = 1
    serving_temperature: float = 0.0
    agents: bool = True
    agent_history_tokens: int = 3000
    agent_conversations: int = 3
    agent_turns: int = 4
    agent_max_tokens: int = 16
    agent_loop: bool = True
    agent_loop_servers: tuple[str, ...] = tuple(AGENT_LOOP_SERVERS)
    agent_loop_conversations: int = AGENT_LOOP_MAX_CONVERSATIONS
    agent_loop_max_tokens: int = 128
    command: str = ""

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHOD_FAMILIES]
        if unknown:
            raise ValueError(f"unknown methods {unknown}; choose from {', '.join(METHOD_FAMILIES)}")
        bad_sets = [s for s in self.sets if s not in PROMPT_SETS]
        if bad_sets:
            raise ValueError(f"unknown prompt sets {bad_sets}; choose from {', '.join(PROMPT_SETS)}")
        checks = [
            (self.num_prompts >= 1, "num_prompts must be at least 1"),
            (self.max_tokens >= 2, "max_tokens must be at least 2"),
            (self.repeats >= 1, "repeats must be at least 1"),
            (all(2 <= b <= 64 for b in self.block_sizes), "block sizes must be in [2, 64]"),
            (all(t >= 0 for t in self.temperatures) and bool(self.temperatures), "temperatures must be >= 0"),
            (self.prompt_lookup_tokens >= 1, "prompt_lookup_tokens must be at least 1"),
            (all(2 <= n <= 256 for n in self.tree_nodes), "tree node budgets must be in [2, 256]"),
            (2 <= self.tree_topk <= 16, "tree_topk must be in [2, 16]"),
            (all(2 <= n <= 64 for n in self.tensor_parallel_rows), "tensor-parallel rows must be in [2, 64] ranks"),
            (all(c >= 1 for c in self.concurrency) and bool(self.concurrency), "concurrency levels must be >= 1"),
            (self.serving_requests >= 1, "serving_requests must be at least 1"),
            (self.serving_seconds > 0, "serving_seconds must be positive"),
            (self.serving_rounds >= 1, "serving_rounds must be at least 1"),
            (self.agent_history_tokens >= 1, "agent_history_tokens must be at least 1"),
            (self.agent_conversations >= 1, "agent_conversations must be at least 1"),
            (self.agent_turns >= 2, "agent_turns must be at least 2 (follow-up turns are the point)"),
            (self.agent_max_tokens >= 1, "agent_max_tokens must be at least 1"),
            (
                all(s in AGENT_LOOP_SERVERS for s in self.agent_loop_servers) and bool(self.agent_loop_servers),
                f"agent-loop servers: choose from {', '.join(AGENT_LOOP_SERVERS)}",
            ),
            (
                1 <= self.agent_loop_conversations <= AGENT_LOOP_MAX_CONVERSATIONS,
                f"agent_loop_conversations must be in [1, {AGENT_LOOP_MAX_CONVERSATIONS}]",
            ),
            (self.agent_loop_max_tokens >= 1, "agent_loop_max_tokens must be at least 1"),
        ]
        from dflash2.bench.gguf_export import GGUF_TYPES
        from dflash2.config import QUANTIZATION_CHOICES

        quantized = {q for q in (*self.quantization_rows, self.engine.quantization) if q not in ("auto", "none")}
        checks += [
            (all(q in QUANTIZATION_CHOICES for q in self.quantization_rows), "unknown --quantization-rows value"),
            (
                not quantized or (self.engine.tensor_parallel_size == 1 and not self.tensor_parallel_rows),
                "quantized rows run in one process: drop --tp-rows / --tensor-parallel-size or the quantization",
            ),
            (all(t in GGUF_TYPES for t in self.gguf_types), f"--gguf-types: choose from {', '.join(GGUF_TYPES)}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def method_specs(self) -> list[MethodSpec]:
        """The measured methods in table order: our AR, DFlash, DFlash 2, then the peers."""
        engine_specs: list[MethodSpec] = []
        if AR in self.methods:
            engine_specs.append(MethodSpec(AR, AR, ENGINE, block_size=1))
        for family, use_selector in ((DFLASH, False), (DFLASH2, True)):
            if family in self.methods:
                for b in self.block_sizes:
                    engine_specs.append(
                        MethodSpec(f"{family}-b{b}", family, ENGINE, block_size=b, use_selector=use_selector)
                    )
                    if family == DFLASH2:
                        for n in self.tree_nodes:
                            engine_specs.append(
                                MethodSpec(
                                    f"{family}-b{b}-tree-{n}",
                                    family,
                                    ENGINE,
                                    block_size=b,
                                    tree_topk=self.tree_topk,
                                    tree_nodes=n,
                                )
                            )
                    if family == DFLASH2 and self.adaptive_rows:
                        adaptive = MethodSpec(f"{family}-b{b}-adaptive", family, ENGINE, block_size=b, adaptive=True)
                        lookup = self.engine.prompt_lookup_max != 0  # the engine's default: on
                        engine_specs.append(replace(adaptive, prompt_lookup=lookup))
                        if lookup:  # its gain, visible in the same run
                            engine_specs.append(replace(adaptive, id=f"{adaptive.id}-no-lookup"))
                        for n in self.tree_nodes:  # the default with trees on: the policy prices them
                            engine_specs.append(
                                replace(
                                    adaptive,
                                    id=f"{adaptive.id}-tree-{n}",
                                    prompt_lookup=lookup,
                                    tree_topk=self.tree_topk,
                                    tree_nodes=n,
                                )
                            )
        for ranks in self.tensor_parallel_rows:  # the baseline and the default, split over the ranks
            defaults = [s for s in engine_specs if s.family == AR or (s.adaptive and s.tree_topk == 1)]
            engine_specs += [
                replace(s, id=f"{s.id}-tp{ranks}", tensor_parallel_size=ranks)
                for s in defaults
                if not s.id.endswith("-no-lookup")
            ]
        defaults = [
            s
            for s in engine_specs
            if (s.family == AR or (s.adaptive and s.tree_topk == 1))
            and not s.id.endswith("-no-lookup")
            and not s.tensor_parallel_size
        ]
        for quantization in self.quantization_rows:  # the baseline and the default, weights held that way
            engine_specs += [replace(s, id=f"{s.id}-quant-{quantization}", quantization=quantization) for s in defaults]
        specs: list[MethodSpec] = []
        for spec in engine_specs:
            if self.engine.enforce_eager:
                specs.append(replace(spec, enforce_eager=True))
                continue
            specs.append(spec)
            # The full-block chain row already shows compilation's gain.
            if (
                self.eager_rows
                and not spec.adaptive
                and spec.tree_topk == 1
                and not spec.tensor_parallel_size
                and not spec.quantization
            ):
                specs.append(replace(spec, id=f"{spec.id}-eager", enforce_eager=True))
        if HF in self.methods:
            specs.append(MethodSpec(HF, HF, TRANSFORMERS))
        if HF_PLD in self.methods:
            specs.append(MethodSpec(HF_PLD, HF_PLD, TRANSFORMERS, prompt_lookup_tokens=self.prompt_lookup_tokens))
        if LLAMA_CPP in self.methods:
            specs.append(MethodSpec(LLAMA_CPP, LLAMA_CPP, LLAMA))
            specs += [MethodSpec(f"{LLAMA_CPP}-{t}", LLAMA_CPP, LLAMA, gguf_type=t) for t in self.gguf_types]
        return specs

    @property
    def serving_block_size(self) -> int:
        """B of the speculative server: ``--block-size`` when given, else the first of ``block_sizes``."""
        return self.engine.block_size if self.engine.block_size not in (None, 1) else self.block_sizes[0]

    def engine_config(
        self,
        block_size: int,
        use_selector: bool,
        max_num_seqs: int = 1,
        enforce_eager: bool | None = None,
        speculative_adaptive: bool = False,
        prompt_lookup: bool = True,
        tree_topk: int = 1,
        tree_nodes: int = 0,
        tensor_parallel_size: int = 0,
        quantization: str = "",
    ) -> EngineConfig:
        """The engine configuration of one engine method (batch 1 by default; eager as the
        run's engine config says unless ``enforce_eager`` is given). Engine methods verify full
        blocks (their rows are named by B) unless ``speculative_adaptive`` (the ``-adaptive``
        rows); the serving benchmark's speculative server runs the adaptive policy unless the
        run says ``--no-speculative-adaptive``. Prompt lookup follows the run's flags where the
        policy runs and ``prompt_lookup`` holds, and is off otherwise. ``tree_topk`` > 1 verifies token
        trees of ``tree_nodes`` nodes (anchor included) instead of chains. ``tensor_parallel_size`` splits
        the target over that many ranks (0: the run's ``--tensor-parallel-size``); ``quantization`` holds its
        weights that way ("": the run's ``--quantization``)."""
        e = self.engine
        lookup = speculative_adaptive and prompt_lookup and block_size > 1
        return EngineConfig(
            model=e.model,
            drafter=e.drafter,
            block_size=block_size,
            use_selector=use_selector,
            speculative_draft_vocab_size=e.speculative_draft_vocab_size,
            max_num_seqs=max_num_seqs,
            max_model_len=e.max_model_len,
            device=e.device,
            dtype=e.dtype,
            seed=e.seed,
            num_threads=e.num_threads,
            enforce_eager=e.enforce_eager if enforce_eager is None else enforce_eager,
            speculative_adaptive=speculative_adaptive,
            speculative_topk=tree_topk,
            speculative_num_draft_tokens=tree_nodes if tree_topk > 1 else None,
            prompt_lookup_max=e.prompt_lookup_max if lookup else 0,
            prompt_lookup_min=e.prompt_lookup_min if lookup else None,
            deterministic=e.deterministic,
            adaptive_threads=e.adaptive_threads,
            tensor_parallel_size=tensor_parallel_size or e.tensor_parallel_size,
            quantization=quantization or e.quantization,
            speculative_draft_quantization=e.speculative_draft_quantization,
        )
