"""From validated OpenAI requests to engine requests, and from engine outputs to OpenAI responses.

One method per endpoint and one streaming generator per endpoint kind (chat, completions). SSE
chunks go out in OpenAI's order: a role delta per choice (chat) → content deltas → a finish chunk
per choice → a usage chunk when ``stream_options.include_usage`` → ``data: [DONE]``. An error after
the stream started is sent as one ``data: {"error": …}`` event, still followed by ``[DONE]``
(``server/streaming.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse
from starlette.responses import Response

from dflash2.errors import ContextLengthExceededError
from server.admission import Admission
from server.chat_template import ChatTemplate
from server.engine_client import EngineClient, RequestGroup
from server.errors import ContextLengthError, InvalidRequestError, error_event, param_from_message
from server.generation import ChoiceState, Generation, spec_decode_info, usage_info, visible_text
from server.logprobs import TokenText, chat_logprobs, completion_logprobs
from server.model_info import ModelInfo
from server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    CustomCall,
    CustomToolCall,
    DeltaCustomCall,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    DetokenizeRequest,
    DetokenizeResponse,
    FunctionCall,
    ModelCard,
    ModelList,
    RequestParamError,
    SamplingRequest,
    TokenizeRequest,
    TokenizeResponse,
    ToolCall,
)
from server.reasoning import Reasoning
from server.replies import ReplyStream, parse_reply, tool_finish_reason
from server.streaming import DONE, E, event_stream
from server.tool_calling import ToolPlan, new_tool_call_id
from server.tool_parsers import ParsedToolCall, get_tool_parser

logger = logging.getLogger(__name__)

T = TypeVar("T")


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
        reasoning_parser: str | None = None,
    ) -> None:
        self.client = client
        self.default_parallel_tool_calls = default_parallel_tool_calls
        self.stream_send_timeout = stream_send_timeout
        self.model = model
        self.admission = admission
        self.tool_parser = get_tool_parser(tool_call_parser)
        self._token_text = TokenText(model.tokenizer)
        self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="dflash2-tokenizer")
        self.chat_template = ChatTemplate(model, self.tool_parser)
        self.reasoning = (
            Reasoning.for_tokenizer(reasoning_parser, model.tokenizer) if reasoning_parser is not None else None
        )

    def close(self) -> None:
        """Stop the tokenizer thread."""
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    # ---- endpoints ------------------------------------------------------------------------------

    async def create_chat_completion(self, request: ChatCompletionRequest) -> Response:
        """``POST /v1/chat/completions`` (tools and ``response_format`` through ``ToolPlan``)."""
        generation, plan = await self.start_chat(request)
        if request.stream:
            return self.event_stream(self._chat_chunks(request, generation, plan), generation, error_event, DONE)
        states = await generation.collect()
        return JSONResponse(self._chat_response(request, generation, states, plan).model_dump())

    async def start_chat(self, request: ChatCompletionRequest) -> tuple[Generation, ToolPlan]:
        """Check the request, plan its tools and structured outputs, render the template and submit.

        Returns:
            The admitted generation and the request's tool plan (for reading the replies back).

        Raises:
            APIError: the request cannot be served (``ModelNotFoundError``, ``InvalidRequestError`` naming the
                field, ``ContextLengthError``, ``TooManyRequestsError``); nothing stays admitted or queued.
        """
        self._check(request)
        plan = ToolPlan.for_request(request, self.tool_parser, self.default_parallel_tool_calls)
        if self.model.grammar is None:
            plan.without_grammar_engine()
        messages, kwargs, reasoning = request.messages, request.chat_template_kwargs, self.reasoning

        def prompt_ids() -> list[int]:  # on the tokenizer thread: schemas compile there too
            plan.check(self.model.grammar)
            ids = self.chat_template.prompt_ids(messages, kwargs, plan=plan)
            if reasoning is not None:  # the thinking block comes first; the grammar starts after it
                plan.with_reasoning(reasoning, reasoning.start_state(ids), self.model.grammar)
            return ids

        generation = await self._start(request, "chatcmpl", prompt_ids, plan=plan)
        return generation, plan

    async def create_completion(self, request: CompletionRequest) -> Response:
        """``POST /v1/completions``."""
        self._check(request)
        generation = await self._start(request, "cmpl", lambda: self._completion_prompt_ids(request.prompt))
        try:
            echo = await self._echo_text(request) if request.echo else ""
        except BaseException:
            generation.close()
            raise
        if request.stream:
            return self.event_stream(self._completion_chunks(request, generation, echo), generation, error_event, DONE)
        states = await generation.collect()
        return JSONResponse(self._completion_response(request, generation, states, echo).model_dump())

    def list_models(self) -> ModelList:
        """``GET /v1/models``."""
        card = ModelCard(
            id=self.model.name,
            created=self.model.created,
            max_model_len=self.model.max_model_len,
            quantization=self.model.quantization,
        )
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
        self._check(request)
        if request.messages is not None:
            messages, kwargs, add_prompt = request.messages, request.chat_template_kwargs, request.add_generation_prompt
            ids = await self._on_tokenizer_thread(lambda: self.chat_template.prompt_ids(messages, kwargs, add_prompt))
        else:
            text = request.prompt or ""
            ids = await self._on_tokenizer_thread(lambda: self._encode(text, request.add_special_tokens))
        return TokenizeResponse(count=len(ids), max_model_len=self.model.max_model_len, tokens=ids)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        """``POST /detokenize``."""
        self.model.check(request.model)
        tokens = request.tokens
        self.model.check_token_ids(tokens, "tokens")
        tokenizer = self.model.require_tokenizer("tokens")
        return DetokenizeResponse(prompt=await self._on_tokenizer_thread(lambda: tokenizer.decode(tokens)))

    # ---- starting a generation -------------------------------------------------------------------

    async def _start(
        self,
        request: SamplingRequest,
        prefix: str,
        prompt_ids: Callable[[], list[int]],
        plan: ToolPlan | None = None,
    ) -> Generation:
        """Admit, tokenize and submit a checked request (its grammar and repeat marker from ``plan``, read once
        the prompt is rendered); on any failure nothing stays admitted or queued."""
        ticket = self.admission.enter()
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            ids = await self._on_tokenizer_thread(prompt_ids)
            grammar, repeat_marker = (plan.grammar, plan.repeat_marker) if plan is not None else (None, None)
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

    def _completion_prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self._encode(prompt, add_special_tokens=True)
        self.model.check_token_ids(prompt, "prompt")
        return list(prompt)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        tokenizer = self.model.require_tokenizer("prompt")
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def _echo_text(self, request: CompletionRequest) -> str:
        if isinstance(request.prompt, str):
            return request.prompt
        tokenizer = self.model.require_tokenizer("echo")
        prompt = request.prompt
        return await self._on_tokenizer_thread(lambda: tokenizer.decode(prompt))

    # ---- responses -----------------------------------------------------------------------------

    def _chat_response(
        self, request: ChatCompletionRequest, generation: Generation, states: list[ChoiceState], plan: ToolPlan
    ) -> ChatCompletionResponse:
        choices = []
        for i, state in enumerate(states):
            reply = parse_reply(plan, state)
            calls = reply.calls
            tool_calls = [_tool_call(c) for c in calls]
            message = AssistantMessage(
                content=reply.content, reasoning_content=reply.reasoning, tool_calls=tool_calls or None
            )
            choices.append(
                ChatChoice(
                    index=i,
                    message=message,
                    logprobs=chat_logprobs(state.logprobs, self._token_text) if request.logprobs else None,
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
                logprobs=completion_logprobs(s.logprobs, 0, self._token_text) if request.logprobs is not None else None,
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

    def event_stream(
        self, events: AsyncIterator[E], generation: Generation, on_error: Callable[[Exception], E], done: E | None
    ) -> EventSourceResponse:
        """The SSE response for a generation's events, framed as every stream is (``streaming.event_stream``,
        with the server's ``stream_send_timeout``)."""
        return event_stream(events, generation, on_error, done, self.stream_send_timeout)

    async def _chat_chunks(
        self, request: ChatCompletionRequest, generation: Generation, plan: ToolPlan
    ) -> AsyncIterator[str]:
        """The chunks of a chat stream: role deltas, content and tool-call deltas, finish chunks, usage."""

        def chunk(choice: ChatStreamChoice | None, **extras: Any) -> str:
            return ChatCompletionChunk(
                id=generation.id,
                created=generation.created,
                model=self.model.name,
                choices=[choice] if choice else [],
                **extras,
            ).model_dump_json()

        replies = [ReplyStream(plan) for _ in range(request.n)]

        def call_deltas(i: int, first_index: int, calls: list[ParsedToolCall]) -> Iterator[str]:
            """OpenAI's tool-call deltas: id, type and name with empty arguments (input), then the arguments
            (input)."""
            for index, call in enumerate(calls, first_index):
                for delta in _call_deltas(index, call):
                    yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(tool_calls=[delta])))

        for i in range(request.n):
            yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
        async for i, output in generation.outputs():
            logprobs = chat_logprobs(output.new_logprobs or [], self._token_text) if request.logprobs else None
            first_index = replies[i].num_calls
            reply = replies[i].feed(output)
            if reply.reasoning:
                yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(reasoning_content=reply.reasoning)))
            if reply.content or (logprobs and logprobs.content):
                yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(content=reply.content), logprobs=logprobs))
            for event in call_deltas(i, first_index, reply.calls):
                yield event
            if output.finished:
                finish = ChatStreamChoice(
                    index=i,
                    delta=DeltaMessage(),
                    finish_reason=tool_finish_reason(output.finish_reason, replies[i].num_calls > 0),
                    stop_reason=output.stop_reason,
                )
                yield chunk(finish, dflash2=spec_decode_info([generation.states[i]]))
        if request.include_usage:
            states = generation.states
            yield chunk(None, usage=usage_info(generation.num_prompt_tokens, states), dflash2=spec_decode_info(states))

    async def _completion_chunks(
        self, request: CompletionRequest, generation: Generation, echo: str
    ) -> AsyncIterator[str]:
        """The chunks of a completion stream: the echoed prompt, text deltas, finish chunks, usage."""

        def chunk(choice: CompletionChoice | None, **extras: Any) -> str:
            return CompletionChunk(
                id=generation.id,
                created=generation.created,
                model=self.model.name,
                choices=[choice] if choice else [],
                **extras,
            ).model_dump_json()

        if echo:
            for i in range(request.n):
                yield chunk(CompletionChoice(index=i, text=echo))
        offsets = [0] * request.n
        async for i, output in generation.outputs():
            new_logprobs = output.new_logprobs or []
            logprobs = (
                completion_logprobs(new_logprobs, offsets[i], self._token_text)
                if request.logprobs is not None
                else None
            )
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
            yield chunk(None, usage=usage_info(generation.num_prompt_tokens, states), dflash2=spec_decode_info(states))

    # ---- checks ----------------------------------------------------------------------------------

    def _check(self, request: SamplingRequest | TokenizeRequest) -> None:
        """The model and the request's cross-field checks, once per request.

        Raises:
            ModelNotFoundError: ``model`` is not a name this server answers to.
            InvalidRequestError: a cross-field problem, naming the field.
        """
        self.model.check(request.model)
        _convert_param_errors(request.check)


def _tool_call(call: ParsedToolCall) -> ToolCall | CustomToolCall:
    """One entry of ``message.tool_calls``: a custom tool call when the call has an ``input``."""
    if call.input is not None:
        return CustomToolCall(id=new_tool_call_id(), custom=CustomCall(name=call.name, input=call.input))
    return ToolCall(id=new_tool_call_id(), function=FunctionCall(name=call.name, arguments=call.arguments))


def _call_deltas(index: int, call: ParsedToolCall) -> tuple[DeltaToolCall, DeltaToolCall]:
    """A call as two stream deltas: its head (id, type, name) and its arguments, or its input for a custom call
    (``{"type": "custom", "custom": {"name", "input"}}``)."""
    call_id = new_tool_call_id()
    if call.input is not None:
        return (
            DeltaToolCall(index=index, id=call_id, type="custom", custom=DeltaCustomCall(name=call.name)),
            DeltaToolCall(index=index, custom=DeltaCustomCall(input=call.input)),
        )
    return (
        DeltaToolCall(index=index, id=call_id, type="function", function=DeltaFunctionCall(name=call.name)),
        DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=call.arguments)),
    )


def _convert_param_errors(work: Callable[[], T]) -> T:
    """Run a request check / conversion, turning its errors into 400s that name the field."""
    try:
        return work()
    except RequestParamError as exc:
        raise InvalidRequestError(str(exc), exc.param) from exc
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param_from_message(str(exc))) from exc
