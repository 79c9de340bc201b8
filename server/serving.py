"""From validated OpenAI requests to engine requests, and from engine outputs to OpenAI responses.

One method per endpoint and one streaming generator per endpoint kind (chat, completions). SSE
chunks go out in OpenAI's order: a role delta per choice (chat) → content deltas → a finish chunk
per choice → a usage chunk when ``stream_options.include_usage`` → ``data: [DONE]``. An error after
the stream started is sent as one ``data: {"error": …}`` event, still followed by ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import jinja2.exceptions
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.responses import Response

from dflash2.errors import ContextLengthExceededError
from dflash2.grammar import GrammarBackend
from dflash2.request import RequestOutput, TokenLogprob, mean_acceptance_length
from dflash2.sampling import check_token_ids
from server.admission import Admission, Ticket
from server.engine_client import EngineClient, RequestGroup
from server.errors import (
    ContextLengthError,
    InvalidRequestError,
    ModelNotFoundError,
    error_event,
    error_kind,
    param_from_message,
)
from server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    DetokenizeRequest,
    DetokenizeResponse,
    FunctionCall,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    RequestParamError,
    SamplingRequest,
    SpecDecodeInfo,
    TokenizeRequest,
    TokenizeResponse,
    TokenLogprobInfo,
    ToolCall,
    TopLogprob,
    UsageInfo,
)
from server.tool_calling import ToolPlan, new_tool_call_id, render_tool_history, with_tool_prompt
from server.tool_parsers import ParsedToolCall, get_tool_parser

if TYPE_CHECKING:
    from dflash2.engine import Engine

logger = logging.getLogger(__name__)

T = TypeVar("T")
_MIN_LOGPROB = -9999.0  # JSON has no -inf
_REPLACEMENT_CHAR = "\ufffd"
SSE_PING_SECONDS = 15


@dataclass(frozen=True)
class ModelInfo:
    """What the HTTP layer needs to know about the loaded model."""

    name: str
    accepted_names: frozenset[str]
    max_model_len: int
    vocab_size: int
    tokenizer: Any | None
    grammar: GrammarBackend | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def from_engine(cls, engine: Engine, served_model_name: str | None) -> ModelInfo:
        """Served under ``served_model_name`` (default: the engine's name); the engine's name is accepted too."""
        name = served_model_name or engine.model_name
        return cls(
            name=name,
            accepted_names=frozenset({name, engine.model_name}),
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
            tokenizer=engine.tokenizer,
            grammar=getattr(engine, "grammar", None),
        )

    def check(self, requested: str | None) -> None:
        """Raises ModelNotFoundError unless ``requested`` is None or one of our names."""
        if requested is not None and requested not in self.accepted_names:
            shown = requested.encode("utf-8", "backslashreplace").decode("utf-8")  # lone surrogates escaped
            raise ModelNotFoundError(f"the model {shown!r} does not exist; this server serves '{self.name}'", "model")


def template_variables(chat_template: Any) -> frozenset[str]:
    """The variables a Jinja chat template (or a dict of named templates) reads: the only names
    ``chat_template_kwargs`` may set, so a client can neither replace the template nor pass
    tokenizer options (``chat_template``, ``padding``, ``max_length`` …) through it."""
    import jinja2
    from jinja2 import meta

    sources = list(chat_template.values()) if isinstance(chat_template, dict) else [chat_template]
    names: set[str] = set()
    environment = jinja2.Environment()
    for source in sources:
        if isinstance(source, str):
            try:
                names |= meta.find_undeclared_variables(environment.parse(source))
            except jinja2.TemplateError:
                continue
    return frozenset(names)


def visible_text(output: RequestOutput) -> str:
    """The text of one engine output as clients see it.

    NOTE: when a request ends (max_tokens, EOS) in the middle of a multi-byte character, the
    detokenizer's final flush releases the incomplete bytes as U+FFFD. A response never ends in a
    broken character, so that tail is dropped here (its tokens still count in usage and logprobs).
    """
    if output.finished and not isinstance(output.stop_reason, str):
        return output.new_text.rstrip(_REPLACEMENT_CHAR)
    return output.new_text


@dataclass
class ChoiceState:
    """Everything one choice has produced so far."""

    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    last: RequestOutput | None = None

    def add(self, output: RequestOutput) -> None:
        """Fold in one engine output."""
        self.text += visible_text(output)
        self.num_tokens += len(output.new_token_ids)
        self.logprobs.extend(output.new_logprobs or ())
        self.finish_reason, self.stop_reason, self.last = output.finish_reason, output.stop_reason, output


@dataclass
class Generation:
    """One admitted HTTP generation request: its id, engine requests and concurrency ticket."""

    id: str
    created: int
    num_prompt_tokens: int
    group: RequestGroup
    ticket: Ticket
    states: list[ChoiceState]

    def close(self) -> None:
        """Abort what is unfinished and give the concurrency slot back (idempotent)."""
        self.group.close()
        self.ticket.release()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Engine outputs as they arrive, folded into ``states`` first."""
        async for index, output in self.group:
            self.states[index].add(output)
            yield index, output

    async def collect(self) -> list[ChoiceState]:
        """Run to completion (closing the generation either way)."""
        try:
            async for _ in self.outputs():
                pass
        finally:
            self.close()
        return self.states


def tool_finish_reason(finish_reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's ``tool_calls`` when a choice that stopped normally made calls; otherwise unchanged
    (a reply cut by ``length`` stays ``length``)."""
    return "tool_calls" if has_calls and finish_reason == "stop" else finish_reason


def usage_info(num_prompt_tokens: int, states: Sequence[ChoiceState]) -> UsageInfo:
    """Prompt counted once, completion tokens summed over the choices; cached prompt tokens are the
    fewest any choice reused (each choice is an engine request over the same prompt)."""
    completion = sum(s.num_tokens for s in states)
    cached = min((s.last.num_cached_tokens for s in states if s.last is not None), default=0)
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=completion,
        total_tokens=num_prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def spec_decode_info(states: Sequence[ChoiceState]) -> SpecDecodeInfo:
    """Speculative statistics summed over the choices; τ includes the bonus token."""
    drafted = sum(s.last.num_draft_tokens for s in states if s.last)
    accepted = sum(s.last.num_accepted_tokens for s in states if s.last)
    steps = sum(s.last.num_verify_steps for s in states if s.last)
    return SpecDecodeInfo(
        draft_tokens=drafted,
        accepted_tokens=accepted,
        verify_steps=steps,
        mean_acceptance_length=mean_acceptance_length(accepted, steps),
    )


class TokenText:
    """Token id → display string for logprobs (cached; partial UTF-8 shows as U+FFFD)."""

    def __init__(self, tokenizer: Any | None) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id]) if self._tokenizer is not None else f"token_id:{token_id}"
            self._cache[token_id] = text
        return text


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB


class OpenAIServing:
    """The OpenAI endpoints over one engine client.

    Prompts are tokenized and chat templates rendered on one worker thread, so templates and
    long prompts never block the event loop. The tokenizer is used from two more threads, for
    decoding only: the event loop (a request's incremental detokenizer decodes the prompt's tail
    when the request is submitted; logprob token strings) and the engine thread (output text).
    Hugging Face's fast tokenizers are safe to share between threads.
    """

    def __init__(
        self,
        client: EngineClient,
        model: ModelInfo,
        admission: Admission,
        tool_call_parser: str = "hermes",
        stream_send_timeout: float = 0.0,
        default_parallel_tool_calls: bool = False,
    ) -> None:
        self.client = client
        self.default_parallel_tool_calls = default_parallel_tool_calls
        self.stream_send_timeout = stream_send_timeout
        self.model = model
        self.admission = admission
        self.tool_parser = get_tool_parser(tool_call_parser)
        self._token_text = TokenText(model.tokenizer)
        self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="dflash2-tokenizer")
        chat_template = getattr(model.tokenizer, "chat_template", None)
        self._template_variables = template_variables(chat_template)
        # Templates that never mention tool_calls get earlier calls as text in the parser's format.
        self._template_renders_tool_calls = "tool_calls" in str(chat_template or "")

    def close(self) -> None:
        """Stop the tokenizer thread."""
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    # ---- endpoints ------------------------------------------------------------------------------

    async def create_chat_completion(self, request: ChatCompletionRequest) -> Response:
        """``POST /v1/chat/completions`` (tools and ``response_format`` through ``ToolPlan``)."""
        generation, plan = await self.start_chat(request)
        if request.stream:
            return self.event_stream(self._chat_chunks(request, generation, plan), generation)
        states = await generation.collect()
        return JSONResponse(self._chat_response(request, generation, states, plan).model_dump())

    async def start_chat(self, request: ChatCompletionRequest) -> tuple[Generation, ToolPlan]:
        """Check and plan tools and structured outputs, render the template and submit."""
        self.model.check(request.model)
        _convert_param_errors(request.check)
        plan = ToolPlan.for_request(request, self.tool_parser, self.default_parallel_tool_calls)
        if self.model.grammar is None:
            plan.without_grammar_engine()
        messages, kwargs = request.messages, request.chat_template_kwargs

        def prompt_ids() -> list[int]:  # on the tokenizer thread: schemas compile there too
            plan.check(self.model.grammar)
            return self._chat_prompt_ids(messages, kwargs, plan=plan)

        generation = await self._start(
            request, "chatcmpl", prompt_ids, grammar=plan.grammar, repeat_marker=plan.repeat_marker
        )
        return generation, plan

    async def create_completion(self, request: CompletionRequest) -> Response:
        """``POST /v1/completions``."""
        generation = await self._start(request, "cmpl", lambda: self._completion_prompt_ids(request.prompt))
        try:
            echo = await self._echo_text(request) if request.echo else ""
        except BaseException:
            generation.close()
            raise
        if request.stream:
            return self.event_stream(self._completion_chunks(request, generation, echo), generation)
        states = await generation.collect()
        return JSONResponse(self._completion_response(request, generation, states, echo).model_dump())

    def list_models(self) -> ModelList:
        """``GET /v1/models``."""
        card = ModelCard(id=self.model.name, created=self.model.created, max_model_len=self.model.max_model_len)
        return ModelList(data=[card])

    def retrieve_model(self, model_id: str) -> ModelCard:
        """``GET /v1/models/{id}``.

        Raises:
            ModelNotFoundError: ``model_id`` is not a name this server answers to.
        """
        self.model.check(model_id)
        return self.list_models().data[0]

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        """``POST /tokenize``: text, or messages through the chat template."""
        self.model.check(request.model)
        _convert_param_errors(request.check)
        if request.messages is not None:
            messages, kwargs, add_prompt = request.messages, request.chat_template_kwargs, request.add_generation_prompt
            ids = await self._on_tokenizer_thread(lambda: self._chat_prompt_ids(messages, kwargs, add_prompt))
        else:
            text = request.prompt or ""
            ids = await self._on_tokenizer_thread(lambda: self._encode(text, request.add_special_tokens))
        return TokenizeResponse(count=len(ids), max_model_len=self.model.max_model_len, tokens=ids)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        """``POST /detokenize``."""
        self.model.check(request.model)
        tokens = request.tokens
        self._check_token_ids(tokens, "tokens")
        tokenizer = self._require_tokenizer("tokens")
        return DetokenizeResponse(prompt=await self._on_tokenizer_thread(lambda: tokenizer.decode(tokens)))

    # ---- starting a generation -------------------------------------------------------------------

    async def _start(
        self,
        request: SamplingRequest,
        prefix: str,
        prompt_ids: Callable[[], list[int]],
        grammar: str | None = None,
        repeat_marker: str | None = None,
    ) -> Generation:
        """Check, admit, tokenize and submit; on any failure nothing stays admitted or queued."""
        self.model.check(request.model)
        _convert_param_errors(request.check)
        ticket = self.admission.enter()
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            ids = await self._on_tokenizer_thread(prompt_ids)
            group = self._submit(request, ids, request_id, grammar, repeat_marker)
        except BaseException:
            ticket.release()
            raise
        # repr: a client's text never starts a new log line or carries control characters.
        logger.info("%s: %d prompt tokens, n=%d, user=%r", request_id, len(ids), request.n, request.user)
        states = [ChoiceState() for _ in range(request.n)]
        return Generation(request_id, int(time.time()), len(ids), group, ticket, states)

    def _submit(
        self,
        request: SamplingRequest,
        prompt_ids: list[int],
        request_id: str,
        grammar: str | None = None,
        repeat_marker: str | None = None,
    ) -> RequestGroup:
        default_max_tokens = max(1, self.model.max_model_len - len(prompt_ids))
        params = _convert_param_errors(lambda: request.to_sampling_params(default_max_tokens))
        if grammar is not None or repeat_marker is not None:
            params = [dataclasses.replace(p, grammar=grammar, repeat_marker=repeat_marker) for p in params]
        try:
            return self.client.submit(prompt_ids, params, request_id)
        except ContextLengthExceededError as exc:
            raise ContextLengthError(str(exc), "max_tokens") from exc
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param_from_message(str(exc))) from exc

    async def _on_tokenizer_thread(self, work: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, work)

    def _chat_prompt_ids(
        self,
        messages: Sequence[ChatMessage],
        template_kwargs: dict[str, Any] | None,
        add_generation_prompt: bool = True,
        plan: ToolPlan | None = None,
    ) -> list[int]:
        """Apply the model's chat template and tokenize (runs on the tokenizer thread). Tools go to the
        template's ``tools`` variable when it reads one, else into the system message (the tool
        parser's prompt); earlier tool calls are rendered as text when the template ignores them."""
        tokenizer = self._require_tokenizer("messages")
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError("this model has no chat template; use /v1/completions", "messages")
        unread = sorted(set(template_kwargs or {}) - self._template_variables)
        if unread:
            reads = ", ".join(sorted(self._template_variables - {"messages", "add_generation_prompt"})) or "none"
            raise InvalidRequestError(
                f"chat_template_kwargs: this model's chat template does not read {', '.join(unread)} "
                f"(the variables it reads: {reads})",
                "chat_template_kwargs",
            )
        rendered = [m.to_template() for m in messages]
        if not self._template_renders_tool_calls:
            rendered = render_tool_history(rendered, self.tool_parser)
        extra: dict[str, Any] = {}
        if plan is not None and plan.tools:
            if "tools" in self._template_variables:
                extra["tools"] = plan.template_tools()
            else:
                rendered = with_tool_prompt(rendered, self.tool_parser.system_prompt(plan.tools))
        try:
            ids = tokenizer.apply_chat_template(
                rendered,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
                **(template_kwargs or {}),
                **extra,
            )
        except Exception as exc:  # the template is user-driven input: its failures are request errors
            raise InvalidRequestError(template_error_message(exc), "messages") from exc
        return [int(t) for t in ids]

    def _completion_prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self._encode(prompt, add_special_tokens=True)
        self._check_token_ids(prompt, "prompt")
        return list(prompt)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        tokenizer = self._require_tokenizer("prompt")
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def _echo_text(self, request: CompletionRequest) -> str:
        if isinstance(request.prompt, str):
            return request.prompt
        tokenizer = self._require_tokenizer("echo")
        prompt = request.prompt
        return await self._on_tokenizer_thread(lambda: tokenizer.decode(prompt))

    def _require_tokenizer(self, param: str) -> Any:
        if self.model.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send prompts as token ids", param)
        return self.model.tokenizer

    def _check_token_ids(self, token_ids: Sequence[int], param: str) -> None:
        try:
            check_token_ids(token_ids, self.model.vocab_size, param)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param) from exc

    # ---- responses -----------------------------------------------------------------------------

    def _chat_response(
        self, request: ChatCompletionRequest, generation: Generation, states: list[ChoiceState], plan: ToolPlan
    ) -> ChatCompletionResponse:
        choices = []
        for i, state in enumerate(states):
            content, calls = plan.parse(state.text, cut=state.finish_reason == "length")
            tool_calls = [ToolCall(id=new_tool_call_id(), function=FunctionCall(**vars(c))) for c in calls]
            choices.append(
                ChatChoice(
                    index=i,
                    message=AssistantMessage(content=content, tool_calls=tool_calls or None),
                    logprobs=self._chat_logprobs(state.logprobs) if request.logprobs else None,
                    finish_reason=tool_finish_reason(state.finish_reason, bool(calls)),
                    stop_reason=state.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=generation.id,
            created=generation.created,
            model=self.model.name,
            choices=choices,
            usage=usage_info(generation.num_prompt_tokens, states),
            dflash2=spec_decode_info(states),
        )

    def _completion_response(
        self, request: CompletionRequest, generation: Generation, states: list[ChoiceState], echo: str
    ) -> CompletionResponse:
        choices = [
            CompletionChoice(
                index=i,
                text=echo + s.text,
                logprobs=self._completion_logprobs(s.logprobs, 0) if request.logprobs is not None else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for i, s in enumerate(states)
        ]
        return CompletionResponse(
            id=generation.id,
            created=generation.created,
            model=self.model.name,
            choices=choices,
            usage=usage_info(generation.num_prompt_tokens, states),
            dflash2=spec_decode_info(states),
        )

    # ---- streams -------------------------------------------------------------------------------

    def event_stream(self, chunks: AsyncIterator[Any], generation: Generation) -> EventSourceResponse:
        """The SSE response for a generation's events. An event that waits longer than
        ``stream_send_timeout`` for the client ends the stream, and closing the stream aborts the
        generation; the background task also closes a stream whose generator never started."""
        return EventSourceResponse(
            chunks,
            sep="\n",
            ping=SSE_PING_SECONDS,
            send_timeout=self.stream_send_timeout or None,
            background=BackgroundTask(generation.close),
        )

    async def _chat_chunks(
        self, request: ChatCompletionRequest, generation: Generation, plan: ToolPlan
    ) -> AsyncIterator[str]:
        def chunk(choice: ChatStreamChoice | None, **extras: Any) -> str:
            return ChatCompletionChunk(
                id=generation.id,
                created=generation.created,
                model=self.model.name,
                choices=[choice] if choice else [],
                **extras,
            ).model_dump_json()

        streamers = [plan.streamer() for _ in range(request.n)]
        num_calls = [0] * request.n

        def call_deltas(i: int, calls: list[ParsedToolCall]) -> Iterator[str]:
            """OpenAI's tool-call deltas: id, type and name with empty arguments, then the arguments."""
            for call in calls:
                index = num_calls[i]
                num_calls[i] += 1
                head = DeltaToolCall(
                    index=index, id=new_tool_call_id(), type="function", function=DeltaFunctionCall(name=call.name)
                )
                yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(tool_calls=[head])))
                arguments = DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=call.arguments))
                yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(tool_calls=[arguments])))

        async def body() -> AsyncIterator[str]:
            for i in range(request.n):
                yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
            async for i, output in generation.outputs():
                logprobs = self._chat_logprobs(output.new_logprobs or []) if request.logprobs else None
                text, calls = visible_text(output), list[ParsedToolCall]()
                streamer = streamers[i]
                if streamer is not None:
                    text, calls = streamer.feed(text)
                    if output.finished:
                        tail, more = streamer.finish(cut=output.finish_reason == "length")
                        text, calls = text + tail, calls + more
                if text or (logprobs and logprobs.content):
                    yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(content=text), logprobs=logprobs))
                for event in call_deltas(i, calls):
                    yield event
                if output.finished:
                    finish = ChatStreamChoice(
                        index=i,
                        delta=DeltaMessage(),
                        finish_reason=tool_finish_reason(output.finish_reason, num_calls[i] > 0),
                        stop_reason=output.stop_reason,
                    )
                    yield chunk(finish, dflash2=spec_decode_info([generation.states[i]]))
            if request.include_usage:
                states = generation.states
                yield chunk(
                    None, usage=usage_info(generation.num_prompt_tokens, states), dflash2=spec_decode_info(states)
                )

        async for event in _framed(body(), generation):
            yield event

    async def _completion_chunks(
        self, request: CompletionRequest, generation: Generation, echo: str
    ) -> AsyncIterator[str]:
        def chunk(choice: CompletionChoice | None, **extras: Any) -> str:
            return CompletionChunk(
                id=generation.id,
                created=generation.created,
                model=self.model.name,
                choices=[choice] if choice else [],
                **extras,
            ).model_dump_json()

        async def body() -> AsyncIterator[str]:
            if echo:
                for i in range(request.n):
                    yield chunk(CompletionChoice(index=i, text=echo))
            offsets = [0] * request.n
            async for i, output in generation.outputs():
                new_logprobs = output.new_logprobs or []
                logprobs = self._completion_logprobs(new_logprobs, offsets[i]) if request.logprobs is not None else None
                offsets[i] += sum(len(self._token_text(lp.token_id)) for lp in new_logprobs)
                text = visible_text(output)
                if text or (new_logprobs and logprobs):
                    yield chunk(CompletionChoice(index=i, text=text, logprobs=logprobs))
                if output.finished:
                    finish = CompletionChoice(
                        index=i, text="", finish_reason=output.finish_reason, stop_reason=output.stop_reason
                    )
                    yield chunk(finish, dflash2=spec_decode_info([generation.states[i]]))
            if request.include_usage:
                states = generation.states
                yield chunk(
                    None, usage=usage_info(generation.num_prompt_tokens, states), dflash2=spec_decode_info(states)
                )

        async for event in _framed(body(), generation):
            yield event

    # ---- logprobs ------------------------------------------------------------------------------

    def _chat_logprobs(self, logprobs: Sequence[TokenLogprob]) -> ChatLogprobs:
        def entry(token_id: int, logprob: float) -> TopLogprob:
            text = self._token_text(token_id)
            return TopLogprob(token=text, logprob=_finite(logprob), bytes=list(text.encode("utf-8")))

        content = []
        for lp in logprobs:
            chosen = entry(lp.token_id, lp.logprob)
            top = [entry(t, v) for t, v in lp.top]
            content.append(TokenLogprobInfo(**chosen.model_dump(), top_logprobs=top))
        return ChatLogprobs(content=content)

    def _completion_logprobs(self, logprobs: Sequence[TokenLogprob], offset: int) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for lp in logprobs:
            text = self._token_text(lp.token_id)
            result.tokens.append(text)
            result.token_logprobs.append(_finite(lp.logprob))
            top = {self._token_text(t): _finite(v) for t, v in lp.top}
            top.setdefault(text, _finite(lp.logprob))
            result.top_logprobs.append(top)
            result.text_offset.append(offset)
            offset += len(text)
        return result


async def _framed(body: AsyncIterator[str], generation: Generation) -> AsyncIterator[str]:
    """Wrap a chunk stream: an error becomes one error event, ``[DONE]`` always ends it, and the
    generation is closed however the stream ends (a client that went away aborts it)."""
    try:
        async for event in body:
            yield event
    except Exception as exc:
        if error_kind(exc).status == 500:
            logger.error("stream %s failed", generation.id, exc_info=exc)
        yield error_event(exc)
    finally:
        generation.close()
    yield "[DONE]"


# Longest template-written message passed on to the client.
MAX_TEMPLATE_MESSAGE = 300


def template_error_message(exc: BaseException) -> str:
    """The 400 message for a chat template that failed on a request's messages.

    A template's own ``raise_exception('…')`` (a plain ``jinja2.TemplateError``) is a message its
    author wrote for users, so it is passed on, with control characters and lone surrogates escaped
    and at most ``MAX_TEMPLATE_MESSAGE`` characters. Anything else (an undefined attribute, a type
    error inside the template or the tokenizer) is internal text: the client gets the error's kind,
    the log gets the rest.
    """
    prefix = "the chat template could not render these messages"
    if type(exc) is jinja2.exceptions.TemplateError and exc.message:
        text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in exc.message)
        if len(text) > MAX_TEMPLATE_MESSAGE:
            text = text[:MAX_TEMPLATE_MESSAGE] + " …"
        return f"{prefix}: {text}"
    logger.info("chat template failed: %r", exc)
    return f"{prefix} ({type(exc).__name__}); check the roles and content of the messages"


def _convert_param_errors(work: Callable[[], T]) -> T:
    """Run a request check / conversion, turning its errors into 400s that name the field."""
    try:
        return work()
    except RequestParamError as exc:
        raise InvalidRequestError(str(exc), exc.param) from exc
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param_from_message(str(exc))) from exc
