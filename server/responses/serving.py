"""``ResponsesServing``: ``POST /v1/responses`` over the chat completions path of an ``OpenAIServing``.

The request is converted to chat (``convert.py``) and served by ``OpenAIServing.start_chat``, so tools,
``tool_choice``, grammar-enforced structured outputs and prompt rendering are exactly those of chat completions;
errors of the chat path are renamed to the Responses fields. The reply is written as a Response object, or as its
stream events (``stream.py``). Hosted tools the request carries are not offered to the model; the response names
their types in the ``x-dflash2-ignored-tools`` header (``IGNORED_TOOLS_HEADER``).

With ``previous_response_id`` the stored response's input and output items come before the request's input
(``instructions`` are not carried over, as in OpenAI's API), so the prompt of the next turn starts with the
tokens of the previous turn's prompt and output wherever the chat template renders history unchanged, and the
prefix cache serves them. Unless ``store`` is false (or the server's store is disabled) the finished response
is stored (``store.py``) before the client sees its end: the JSON object returned, or the final event of a
stream; a stream that fails or is abandoned stores nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse
from sse_starlette.sse import ServerSentEvent
from starlette.responses import Response

from server.errors import APIError
from server.generation import Generation, usage_info
from server.protocol import ChatCompletionRequest, NamedToolChoice
from server.replies import ReplyStream, parse_reply
from server.responses.convert import ChatConversion, chat_conversion
from server.responses.protocol import ResponseObject, ResponsesRequest, TextFormat, output_items
from server.responses.retrieval import continued, input_items_json, previous_context
from server.responses.store import JSONObject, ResponseStore
from server.responses.stream import ResponseStream
from server.serving import OpenAIServing
from server.tool_calling import ToolPlan

# Names the hosted tool types a request carried and this server left out (comma-separated), when there were any.
IGNORED_TOOLS_HEADER = "x-dflash2-ignored-tools"


class ResponsesServing:
    """``POST /v1/responses`` over the chat path of an ``OpenAIServing``, storing responses in ``store``."""

    def __init__(self, serving: OpenAIServing, store: ResponseStore) -> None:
        self.serving = serving
        self.store = store

    async def create_response(self, request: ResponsesRequest) -> Response:
        """Check, convert and start the chat generation.

        Returns:
            A Response object (JSON), or with ``stream: true`` its event stream.

        Raises:
            APIError: the request cannot be served, naming the Responses field (``InvalidRequestError``,
                ``ModelNotFoundError``, ``TooManyRequestsError``, …).
        """
        request.check()
        context = (
            () if request.previous_response_id is None else previous_context(self.store, request.previous_response_id)
        )
        own_items = input_items_json(request)
        conversion = _with_context_sources(chat_conversion(continued(request, context)), len(context), request)
        chat = conversion.request
        try:
            generation, plan = await self.serving.start_chat(chat)
        except APIError as exc:
            conversion.rename(exc)
            raise
        try:
            response = self._new_response(request, chat, generation)
        except BaseException:
            generation.close()
            raise
        input_items = (*context, *own_items)
        headers = {IGNORED_TOOLS_HEADER: ", ".join(request.ignored_tool_types)} if request.ignored_tool_types else {}
        if request.stream:
            stream = ResponseStream(response)
            events = self._events(stream, generation, plan, input_items)
            sse = self.serving.event_stream(events, generation, stream.fail, None)
            sse.headers.update(headers)
            return sse
        (state,) = await generation.collect()
        reply = parse_reply(plan, state)
        response.output = output_items(reply.reasoning, reply.content, reply.calls, state.is_cut)
        response.finish(usage_info(generation.num_prompt_tokens, [state]), state.is_cut)
        return JSONResponse(self._stored(response, input_items), headers=headers)

    def _stored(self, response: ResponseObject, input_items: tuple[JSONObject, ...]) -> JSONObject:
        """The finished response as JSON, kept in the store when it says ``store: true``."""
        body = response.model_dump(mode="json")
        if response.store:
            self.store.put(body, input_items)
        return body

    def _new_response(
        self, request: ResponsesRequest, chat: ChatCompletionRequest, generation: Generation
    ) -> ResponseObject:
        """The response as it starts: settings echoed, no output yet."""
        choice = chat.effective_tool_choice
        text_format = request.text.format if request.text and request.text.format else TextFormat(type="text")
        text: dict[str, Any] = {"format": text_format.model_dump(by_alias=True, exclude_none=True)}
        if request.text is not None and request.text.verbosity is not None:
            text["verbosity"] = request.text.verbosity
        return ResponseObject(
            id=f"resp_{generation.id.rpartition('-')[2]}",
            created_at=generation.created,
            status="in_progress",
            model=self.serving.model.name,
            instructions=request.instructions,
            tools=[tool.model_dump(exclude_unset=True) for tool in request.tools or ()],
            tool_choice={"type": choice.type, "name": choice.name} if isinstance(choice, NamedToolChoice) else choice,
            parallel_tool_calls=self.serving.default_parallel_tool_calls
            if request.parallel_tool_calls is None
            else request.parallel_tool_calls,
            temperature=chat.temperature,
            top_p=chat.top_p,
            max_output_tokens=request.max_output_tokens,
            text=text,
            metadata=request.metadata or {},
            store=request.store is not False and self.store.is_enabled,
            previous_response_id=request.previous_response_id,
            user=request.user,
        )

    async def _events(
        self, stream: ResponseStream, generation: Generation, plan: ToolPlan, input_items: tuple[JSONObject, ...]
    ) -> AsyncIterator[ServerSentEvent]:
        """The stream's events, from ``response.created`` to ``response.completed`` / ``response.incomplete``
        (errors and closing: ``streaming.framed``); the response is stored before its final event is sent."""
        for event in stream.start():
            yield event
        reply = ReplyStream(plan)
        async for _, output in generation.outputs():
            delta = reply.feed(output)
            for event in (
                stream.reasoning(delta.reasoning or "") + stream.text(delta.content or "") + stream.calls(delta.calls)
            ):
                yield event
        (state,) = generation.states
        final = stream.finish(usage_info(generation.num_prompt_tokens, [state]), state.is_cut)
        self._stored(stream.response, input_items)
        for event in final:
            yield event


def _with_context_sources(conversion: ChatConversion, num_context: int, request: ResponsesRequest) -> ChatConversion:
    """Errors about the stored items before the input name ``previous_response_id``; the request's own items keep
    their indices (``input[k]``, or ``input`` for a string)."""
    if not num_context:
        return conversion
    sources = []
    for source in conversion.sources:
        index = int(source[len("input[") : -1]) if source.startswith("input[") else None
        if index is None:
            sources.append(source)
        elif index < num_context:
            sources.append("previous_response_id")
        else:
            sources.append("input" if isinstance(request.input, str) else f"input[{index - num_context}]")
    return dataclasses.replace(conversion, sources=sources)
