"""One generation per call, timed with ``time.perf_counter``: this engine and transformers.

A runner holds one loaded method and generates batch-1 completions from token ids. Every call
returns a ``GenerationSample``: output tokens, wall time, time to the first token, and for this
engine the speculative counters and the per-step cost split (draft / select / verify / other).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash2.api import LLM
from dflash2.config import EngineConfig
from dflash2.engine import Engine
from dflash2.outputs import StepResult, StepStats
from dflash2.runner.model_setup import default_drafter_path
from dflash2.sampling import SamplingParams


@dataclass
class GenerationSample:
    """One prompt generated once by one method.

    Attributes:
        num_prompt_tokens, num_output_tokens: token counts (EOS included when generated).
        seconds: wall time from the call to the last token (prefill included).
        ttft: seconds from the call to the first output token.
        num_verify_steps, num_accepted_tokens: this engine's request counters (τ = 1 + accepted / steps).
        accepted_per_position, drafted_per_position: summed over the steps (length B−1).
        num_decode_steps: engine steps without a prefill (the cost split is over these).
        draft_time, select_time, verify_time, decode_time: seconds summed over those steps
            (``decode_time`` is their whole ``StepStats.total_time``).
        select_in_draft: some step chose its drafted path inside the drafting forward (compiled on
            CPU): the selector's time is then part of ``draft_time``.
    """

    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    seconds: float = 0.0
    ttft: float = 0.0
    num_verify_steps: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    num_decode_steps: int = 0
    draft_time: float = 0.0
    select_time: float = 0.0
    select_in_draft: bool = False
    verify_time: float = 0.0
    decode_time: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON view."""
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> GenerationSample:
        """Inverse of ``to_dict`` (unknown keys ignored)."""
        return cls(**{k: v for k, v in raw.items() if k in cls.__dataclass_fields__})

    def add_step(self, stats: StepStats) -> None:
        """Fold one engine step into the counters; steps that prefilled stay out of the cost split."""
        if stats.accepted_per_position:
            if not self.accepted_per_position:
                self.accepted_per_position = [0] * len(stats.accepted_per_position)
                self.drafted_per_position = [0] * len(stats.drafted_per_position)
            for j, (a, d) in enumerate(zip(stats.accepted_per_position, stats.drafted_per_position)):
                self.accepted_per_position[j] += a
                self.drafted_per_position[j] += d
        if stats.num_prefills == 0 and stats.num_decode_rows > 0:
            self.num_decode_steps += 1
            self.draft_time += stats.draft_time
            self.select_time += stats.select_time
            self.select_in_draft = self.select_in_draft or stats.select_in_draft
            self.verify_time += stats.verify_time
            self.decode_time += stats.total_time


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels (CUDA); a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class EngineRunner:
    """This engine at one block size (1 = autoregressive), selector on or off, batch 1."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.engine: Engine = Engine.from_config(config)
        # NOTE: CUDA kernels run asynchronously: without a wait at the end of each drafting phase the
        # drafter's and the selector's time would be counted as verify time (its ``.tolist()`` waits
        # for them). It adds no work: verify would wait anyway. A no-op on CPU.
        self.engine.runner.sync_timing = True
        self.llm = LLM.from_engine(self.engine)

    def describe(self) -> dict[str, Any]:
        """What was loaded: block size, drafter (path, trained block size, convolutions, selector)."""
        engine, drafter = self.engine, self.engine.drafter
        info: dict[str, Any] = {
            "block_size": engine.block_size,
            "use_selector": self.config.use_selector,
            "compiled": engine.runner.compiled,
            "compile_seconds": engine.runner.compile_seconds,
        }
        if drafter is not None:
            c = drafter.config
            default = default_drafter_path()
            source = self.config.drafter or (str(default) if default else "untrained default drafter (random weights)")
            info.update(
                drafter=source,
                drafter_version=c.version,
                drafter_block_size=c.block_size,
                has_conv=c.has_conv,
                has_selector=c.has_selector,
                num_candidates=engine.num_candidates,
            )
            draft_vocab = getattr(drafter, "draft_vocab", None)
            if draft_vocab is not None:
                info["draft_vocab_size"] = len(draft_vocab)
        return info

    def generate(self, prompt_ids: list[int], max_tokens: int, temperature: float, seed: int) -> GenerationSample:
        """Generate one completion and collect the engine's step statistics.

        ``seed`` is not passed on: a request with its own seed verifies full blocks and never takes
        prompt-lookup drafts (its text must not depend on timings; docs/engine.md "Seeded requests
        reproduce"), which is not the engine a user without a seed gets. Sampled requests draw their
        seeds from the engine's (``EngineConfig.seed``), so a run still reproduces request by request."""
        del seed
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
        sample = GenerationSample(num_prompt_tokens=len(prompt_ids))
        start = time.perf_counter()
        first: float | None = None
        last = None
        result: StepResult
        for result in self.llm.stream(prompt_ids, params):
            if first is None and any(o.new_token_ids for o in result.outputs):
                first = time.perf_counter()
            sample.add_step(result.stats)
            last = result.outputs[-1] if result.outputs else last
        end = time.perf_counter()
        if last is None or last.error:
            raise RuntimeError(f"generation failed: {last.error if last else 'no output'}")
        sample.seconds, sample.ttft = end - start, (first or end) - start
        sample.num_output_tokens = last.num_output_tokens
        sample.num_verify_steps, sample.num_accepted_tokens = last.num_verify_steps, last.num_accepted_tokens
        return sample


class _FirstTokenClock:
    """A transformers streamer that notes when the first generated token arrives.

    ``generate`` calls ``put`` once with the prompt, then once per new token (or accepted run).
    """

    def __init__(self) -> None:
        self.num_puts = 0
        self.first: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.num_puts += 1
        if self.num_puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        """Nothing to flush."""


class TransformersRunner:
    """Hugging Face ``generate`` on the same folder, dtype and device; prompt lookup when asked.

    Sampling matches this engine's: greedy at T=0; at T>0 plain temperature sampling over the full
    vocabulary (``top_k=0``, ``top_p=1``), so transformers' own defaults (top-k 50) do not apply.
    """

    def __init__(
        self,
        folder: Path,
        dtype: torch.dtype,
        device: torch.device,
        eos_token_ids: list[int],
        prompt_lookup_tokens: int = 0,
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.device = device
        self.eos_token_ids = list(eos_token_ids)
        self.prompt_lookup_tokens = prompt_lookup_tokens
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
        self.model = model.to(device).eval()  # type: ignore[arg-type]

    def describe(self) -> dict[str, Any]:
        """transformers version, attention implementation and prompt-lookup length."""
        import transformers

        return {
            "transformers": transformers.__version__,
            "attention": getattr(self.model.config, "_attn_implementation", None),
            "prompt_lookup_num_tokens": self.prompt_lookup_tokens or None,
        }

    def generation_config(self, max_tokens: int, temperature: float) -> Any:
        """A complete ``GenerationConfig`` (nothing inherited from the model folder's defaults)."""
        from transformers import GenerationConfig

        sampling = temperature > 0
        return GenerationConfig(
            max_new_tokens=max_tokens,
            do_sample=sampling,
            temperature=temperature if sampling else None,
            top_k=0 if sampling else None,
            top_p=1.0 if sampling else None,
            eos_token_id=self.eos_token_ids or None,
            pad_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
            prompt_lookup_num_tokens=self.prompt_lookup_tokens or None,
        )

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_tokens: int, temperature: float, seed: int) -> GenerationSample:
        """Generate one completion (batch 1, no padding)."""
        input_ids = torch.tensor([prompt_ids], device=self.device)
        config = self.generation_config(max_tokens, temperature)
        clock = _FirstTokenClock()
        torch.manual_seed(seed)
        start = time.perf_counter()
        out = self.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=config,
            streamer=clock,
        )
        synchronize(self.device)
        end = time.perf_counter()
        num_output = int(out.shape[1]) - len(prompt_ids)
        return GenerationSample(
            num_prompt_tokens=len(prompt_ids),
            num_output_tokens=num_output,
            seconds=end - start,
            ttft=(clock.first or end) - start,
        )
