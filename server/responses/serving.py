"""``ResponsesServing``: ``POST /v1/responses`` over the chat completions path of an ``OpenAIServing``.

The request is converted to chat (``convert.py``) and served by ``OpenAIServing.start_chat``, so tools,
``tool_choice``, grammar-enforced structured outputs and prompt rendering are exactly those of chat completions;
errors of the chat path are renamed to the Responses fields. The reply is written as a Response object, or as its
stream events (``stream.py``). Hosted tools the request carries are not offered to the model; the response names
their types in the ``x-dflash2-ignored-tools`` header (``IGNORED_TOOLS_HEADER``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse
from sse_starlette.sse import ServerSentEvent
from starlette.responses import Response

from server.errors import APIError
from server.generation import Generation, usage_info
from server.protocol import ChatCompletionRequest, NamedToolChoice
from server.replies import ReplyStream, parse_reply
from server.responses.protocol import ResponseObject, ResponsesRequest, TextFormat, output_items
from server.responses.stream import ResponseStream
from server.serving import OpenAIServing
from server.tool_calling import ToolPlan

# Names the hosted tool types a request carried and this server left out (comma-separated), when there were any.
IGNORED_TOOLS_HEADER = "x-dflash2-ignored-tools"


class ResponsesServing:
    """``POST /v1/responses`` over the chat path of an ``OpenAIServing``."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create_response(self, request: ResponsesRequest) -> Response:
        """Check, convert and start the chat generation.

        Returns:
            A Response object (JSON), or with ``stream: true`` its event stream.

        Raises:
            APIError: the request cannot be served, naming the Responses field (``InvalidRequestError``,
                ``ModelNotFoundError``, ``TooManyRequestsError``, …).
        """
        request.check()
        conversion = request.to_chat()
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
        headers = {IGNORED_TOOLS_HEADER: ", ".join(request.ignored_tool_types)} if request.ignored_tool_types else {}
        if request.stream:
            stream = ResponseStream(response)
            reply = self.serving.event_stream(self._events(stream, generation, plan), generation, stream.fail, None)
            reply.headers.update(headers)
            return reply
        (state,) = await generation.collect()
        content, calls = parse_reply(plan, state)
        response.output = output_items(content, calls, state.is_cut)
        response.finish(usage_info(generation.num_prompt_tokens, [state]), state.is_cut)
        return JSONResponse(response.model_dump(), headers=headers)

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
            user=request.user,
        )

    async def _events(
        self, stream: ResponseStream, generation: Generation, plan: ToolPlan
    ) -> AsyncIterator[ServerSentEvent]:
        """The stream's events, from ``response.created`` to ``response.completed`` / ``response.incomplete``
        (errors and closing: ``streaming.framed``)."""
        for event in stream.start():
            yield event
        reply = ReplyStream(plan)
        async for _, output in generation.outputs():
            text, calls = reply.feed(output)
            for event in stream.text(text) + stream.calls(calls):
                yield event
        (state,) = generation.states
        for event in stream.finish(usage_info(generation.num_prompt_tokens, [state]), state.is_cut):
            yield event
