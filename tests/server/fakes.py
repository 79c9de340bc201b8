"""A fake engine for fast HTTP tests: the ``Engine`` surface the server uses, no model.

Every running request receives one token per step (``a``, ``b``, ``c``, … as character codes) and
finishes at ``max_tokens`` ("length"). A prompt that contains ``FAIL`` makes ``step()`` raise while
that request runs; ``step_delay`` slows steps down so requests stay in flight.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import jinja2.exceptions

from dflash2.errors import ContextLengthExceededError
from dflash2.outputs import RequestOutput, StepResult, StepStats, TokenLogprob
from dflash2.sampling import SamplingParams, check_token_ids

FAIL_MARKER = "FAIL"


FAKE_THREADS = 2  # the CPU thread count the fake engine reports for its steps


class FakeTokenizer:
    """One token per character (code point < 256); the chat template tags each message with its role."""

    chat_template = "{{ messages }}{% if enable_thinking %}{% endif %}{% if explode %}{% endif %}"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 256 for c in text]

    def decode(self, ids: list[int], **kwargs: object) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs):
        if kwargs.get("explode") == "raise_exception":  # what a template's raise_exception('…') raises
            raise jinja2.exceptions.TemplateError("Conversation roles must alternate user/assistant")
        if kwargs.get("explode"):  # internal text: a path and a repr the client must not see
            raise jinja2.exceptions.UndefinedError("'dict object' has no attribute 'content' (/srv/x/template.jinja)")
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))


@dataclass
class FakeRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)


@dataclass
class FakeScheduler:
    max_num_seqs: int
    running: list[FakeRequest] = field(default_factory=list)
    waiting: deque[FakeRequest] = field(default_factory=deque)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)


class FakeEngine:
    """Duck-types ``dflash2.engine.Engine`` for the server (add_request / abort / step on one thread)."""

    model_name = "fake-model"
    vocab_size = 256
    block_size = 4
    eos_token_ids = (0,)

    def __init__(self, max_model_len: int = 64, max_num_seqs: int = 2, step_delay: float = 0.0) -> None:
        self.max_model_len = max_model_len
        self.step_delay = step_delay
        self.tokenizer = FakeTokenizer()
        self.scheduler = FakeScheduler(max_num_seqs)
        self.num_steps = 0
        self.submitted: list[SamplingParams] = []
        self._inbox: deque[tuple[str, object]] = deque()
        self._lock = threading.Lock()

    @property
    def kv_cache_usage(self) -> float:
        return len(self.scheduler.running) / self.scheduler.max_num_seqs

    fatal_error: str | None = None
    closed = False

    def add_failure_listener(self, listener) -> None:
        self.failure_listeners = [*getattr(self, "failure_listeners", []), listener]

    def fail_for_good(self, message: str) -> None:
        """What a tensor-parallel engine does when a worker rank exits: tell the listeners."""
        self.fatal_error = message
        for listener in getattr(self, "failure_listeners", []):
            listener(message)

    def close(self) -> None:
        self.closed = True

    @property
    def is_closed(self) -> bool:
        return self.closed

    def running_request_ids(self) -> list[str]:
        return [r.request_id for r in self.scheduler.running]

    def add_request(self, prompt, params: SamplingParams, request_id: str | None = None) -> str:
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        check_token_ids(prompt_ids, self.vocab_size, "prompt")  # the engine's own checks
        params.check_vocabulary(self.vocab_size)
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ContextLengthExceededError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(prompt_ids)} tokens and max_tokens is {params.max_tokens}"
            )
        request_id = request_id or f"fake-{time.monotonic_ns()}"
        self.submitted.append(params)
        with self._lock:
            self._inbox.append(("add", FakeRequest(request_id, prompt_ids, params)))
        return request_id

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("abort", request_id))

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._inbox) or bool(self.scheduler.running) or bool(self.scheduler.waiting)

    def step(self) -> StepResult:
        self.num_steps += 1
        outputs = self._drain_inbox()
        while self.scheduler.waiting and len(self.scheduler.running) < self.scheduler.max_num_seqs:
            self.scheduler.running.append(self.scheduler.waiting.popleft())
        if any(FAIL_MARKER in self.tokenizer.decode(r.prompt_ids) for r in self.scheduler.running):
            raise RuntimeError("simulated engine failure")
        stats = StepStats(
            block_size=self.block_size, accepted_per_position=[0] * (self.block_size - 1), num_threads=FAKE_THREADS
        )
        for request in list(self.scheduler.running):
            outputs.append(self._advance(request, stats))
        time.sleep(self.step_delay)
        stats.num_running, stats.num_waiting = self.scheduler.num_running, self.scheduler.num_waiting
        stats.kv_cache_usage = self.kv_cache_usage
        return StepResult(outputs, stats)

    def _drain_inbox(self) -> list[RequestOutput]:
        with self._lock:
            items, self._inbox = list(self._inbox), deque()
        outputs = []
        for kind, item in items:
            if kind == "add":
                assert isinstance(item, FakeRequest)
                self.scheduler.waiting.append(item)
                continue
            for queue in (self.scheduler.running, self.scheduler.waiting):
                for request in list(queue):
                    if request.request_id == item:
                        queue.remove(request)
                        outputs.append(_output(request, [], "abort"))
        return outputs

    def _advance(self, request: FakeRequest, stats: StepStats) -> RequestOutput:
        token = ord("a") + len(request.output_ids) % 26
        request.output_ids.append(token)
        is_first = len(request.output_ids) == 1
        stats.num_generated_tokens += 1
        if is_first:
            stats.num_prefill_tokens += len(request.prompt_ids)
        else:
            stats.num_drafts += 1
            stats.num_draft_tokens += self.block_size - 1
            stats.acceptance_lengths.append(1)
            stats.draft_lengths.append(self.block_size - 1)
            stats.predicted_tokens += 1.5  # as an adaptive engine reports it
        reason = "length" if len(request.output_ids) >= request.params.max_tokens else None
        if reason:
            self.scheduler.running.remove(request)
        return _output(request, [token], reason)


def _output(request: FakeRequest, token_ids: list[int], finish_reason: str | None) -> RequestOutput:
    logprobs = None
    if request.params.logprobs is not None:
        logprobs = [TokenLogprob(t, -0.5, [(t, -0.5), (ord("z"), -1.5)][: request.params.logprobs]) for t in token_ids]
    num_steps = max(0, len(request.output_ids) - 1)
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=token_ids,
        new_text="".join(chr(t) for t in token_ids),
        finished=finish_reason is not None,
        finish_reason=finish_reason,
        stop_reason=None,
        new_logprobs=logprobs,
        num_prompt_tokens=len(request.prompt_ids),
        num_output_tokens=len(request.output_ids),
        num_draft_tokens=num_steps * 3,
        num_accepted_tokens=0,
        num_verify_steps=num_steps,
    )
