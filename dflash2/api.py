"""The offline API: ``LLM(...).generate(prompts, params)`` and ``LLM(...).stream(...)`` over one engine."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from dflash2.config import EngineConfig
from dflash2.engine import Engine
from dflash2.outputs import RequestOutput, StepResult, TokenLogprob, mean_acceptance_length
from dflash2.sampling import SamplingParams


class LLM:
    """Offline convenience API: ``LLM().generate(prompts, params)`` and ``LLM().stream(...)``.

    Keyword arguments are ``EngineConfig`` fields (model, drafter, block_size, …).

    Close it when done — ``llm.close()``, or ``with LLM(...) as llm:`` — to stop its processes
    (tensor-parallel workers, the background compile worker) and release its models and caches at once;
    another engine, tensor-parallel or not, can then start in the same process. Afterwards ``generate``
    and ``stream`` raise :class:`~dflash2.errors.EngineClosedError`. An ``LLM`` that is dropped
    without ``close`` stops its processes when it is garbage-collected.

    Raises:
        dflash2.runner.tensor_parallel.TensorParallelError: with ``tensor_parallel_size`` > 1, a worker
            failed to start, another tensor-parallel engine is still open in this process, or the script
            builds the engine outside ``if __name__ == "__main__":`` (the message says which).
    """

    def __init__(self, model: str | None = None, drafter: str | None = None, **kwargs: Any) -> None:
        self.engine = Engine.from_config(EngineConfig(model=model, drafter=drafter, **kwargs))

    def close(self) -> None:
        """Close the engine (:meth:`dflash2.engine.Engine.close`): stop its processes, release its models,
        caches and compiled graphs. Idempotent."""
        self.engine.close()

    @property
    def is_closed(self) -> bool:
        """True once :meth:`close` has run (here or on the engine)."""
        return self.engine.is_closed

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @classmethod
    def from_engine(cls, engine: Engine) -> LLM:
        """Wrap an existing engine (tests build tiny ones directly)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    def stream(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[StepResult]:
        """Submit the prompts and yield every step's ``StepResult`` (deltas + ``StepStats``) until done.

        Raises:
            EngineClosedError: after :meth:`close` (at the first ``next``).
        """
        yield from self._steps(self._submit(prompts, params))

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_step: Callable[[StepResult], None] | None = None,
    ) -> list[Completion]:
        """Generate to completion; returns one ``Completion`` per prompt, in order.

        Raises:
            EngineClosedError: after :meth:`close`.
        """
        ids = self._submit(prompts, params)
        completions = {rid: Completion(request_id=rid) for rid in ids}
        for result in self._steps(ids):
            if on_step is not None:
                on_step(result)
            for output in result.outputs:
                completions[output.request_id].add(output)
        return [completions[rid] for rid in ids]

    def _steps(self, ids: list[str]) -> Iterator[StepResult]:
        """Step the engine until every request of ``ids`` has finished; outputs of others are dropped."""
        wanted, remaining = set(ids), set(ids)
        while remaining:
            result = self.engine.step()
            result.outputs = [o for o in result.outputs if o.request_id in wanted]
            remaining -= {o.request_id for o in result.outputs if o.finished}
            yield result

    def _submit(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[str]:
        batch: list[Any]
        if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int)):
            batch = [prompts]
        else:
            batch = list(prompts)
        params = params or SamplingParams()
        param_list = [params] * len(batch) if isinstance(params, SamplingParams) else list(params)
        if len(param_list) != len(batch):
            raise ValueError("pass one SamplingParams or one per prompt")
        return [self.engine.add_request(p, sp) for p, sp in zip(batch, param_list)]


@dataclass
class Completion:
    """The accumulated result of one request from ``LLM.generate``."""

    request_id: str
    text: str = ""
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    error: str | None = None

    def add(self, output: RequestOutput) -> None:
        """Fold one step's ``RequestOutput`` into the completion."""
        self.text += output.new_text
        self.token_ids = [*(self.token_ids or []), *output.new_token_ids]
        if output.new_logprobs is not None:
            self.logprobs = [*(self.logprobs or []), *output.new_logprobs]
        self.finish_reason, self.stop_reason, self.error = (
            output.finish_reason,
            output.stop_reason,
            output.error,
        )
        self.num_prompt_tokens = output.num_prompt_tokens
        self.num_cached_prompt_tokens = output.num_cached_tokens
        self.num_verify_steps = output.num_verify_steps
        self.num_draft_tokens = output.num_draft_tokens
        self.num_accepted_tokens = output.num_accepted_tokens
        self.accepted_by_source = dict(output.accepted_by_source)

    @property
    def mean_acceptance_length(self) -> float:
        """Committed tokens per verify step (bonus included)."""
        return mean_acceptance_length(self.num_accepted_tokens, self.num_verify_steps)
