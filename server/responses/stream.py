"""``ResponseStream``: the Responses stream events of one reply, from its text deltas and completed tool calls.

Events (``event: <type>`` and ``data: <json>``, each with an increasing ``sequence_number``, no ``[DONE]``):
``response.created`` → ``response.in_progress`` → for a thinking block (``--reasoning-parser``) a reasoning item:
``response.output_item.added``, ``response.content_part.added`` (``reasoning_text``),
``response.reasoning_text.delta``…, ``response.reasoning_text.done``, ``response.content_part.done``,
``response.output_item.done`` → per text item ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta``…, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done`` → per tool call ``response.output_item.added``,
``response.function_call_arguments.delta``, ``response.function_call_arguments.done`` (a custom tool call:
``response.custom_tool_call_input.delta``, ``response.custom_tool_call_input.done``),
``response.output_item.done`` → ``response.completed`` or ``response.incomplete`` carrying the whole response.
An error after the stream started is one ``response.failed`` event.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from sse_starlette.sse import ServerSentEvent

from server.errors import error_body, error_kind
from server.protocol import UsageInfo
from server.responses.protocol import (
    ContentPartEvent,
    CustomToolCallInputDeltaEvent,
    CustomToolCallInputDoneEvent,
    FunctionCallArgumentsDeltaEvent,
    FunctionCallArgumentsDoneEvent,
    ItemStatus,
    OutputCustomToolCall,
    OutputFunctionCall,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTextDeltaEvent,
    OutputTextDoneEvent,
    ReasoningText,
    ReasoningTextDeltaEvent,
    ReasoningTextDoneEvent,
    ResponseError,
    ResponseLifecycleEvent,
    ResponseObject,
    StreamEvent,
)
from server.tool_parsers import ParsedToolCall


class ResponseStream:
    """The stream events of one response, from text deltas and completed tool calls.

    Each method returns the server-sent events to send now; the response's ``output`` grows as items are added,
    so the final event carries the same items the stream announced. Text after a tool call starts a new message
    item.
    """

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self._sequence = 0
        self._message: OutputMessage | None = None
        self._message_index = 0
        self._reasoning: OutputReasoning | None = None

    def start(self) -> list[ServerSentEvent]:
        """``response.created`` and ``response.in_progress``."""
        self.response.status = "in_progress"
        return [
            self._send(ResponseLifecycleEvent(type="response.created", response=self.response)),
            self._send(ResponseLifecycleEvent(type="response.in_progress", response=self.response)),
        ]

    def reasoning(self, delta: str) -> list[ServerSentEvent]:
        """A thinking-text delta (opening the reasoning item first when none is open)."""
        if not delta:
            return []
        events = []
        item = self._reasoning
        if item is None:
            item = self._reasoning = OutputReasoning(status="in_progress")
            self.response.output.append(item)
            events.append(self._send(self._item_event("response.output_item.added", item)))
            item.content.append(ReasoningText())
            events.append(self._send(self._part_event("response.content_part.added", item)))
        item.content[0].text += delta
        index = self.response.output.index(item)
        events.append(self._send(ReasoningTextDeltaEvent(item_id=item.id, output_index=index, delta=delta)))
        return events

    def text(self, delta: str) -> list[ServerSentEvent]:
        """A text delta (closing an open reasoning item, and opening a message item first when none is open)."""
        if not delta:
            return []
        events = self._close_reasoning("completed")
        if self._message is None:
            self._message, self._message_index = OutputMessage(status="in_progress"), len(self.response.output)
            self.response.output.append(self._message)
            events.append(self._send(self._item_event("response.output_item.added", self._message)))
            self._message.content.append(OutputText())
            events.append(self._send(self._part_event("response.content_part.added", self._message)))
        self._message.content[0].text += delta
        events.append(
            self._send(OutputTextDeltaEvent(item_id=self._message.id, output_index=self._message_index, delta=delta))
        )
        return events

    def calls(self, calls: Sequence[ParsedToolCall]) -> list[ServerSentEvent]:
        """Completed tool calls: one ``function_call`` (or ``custom_tool_call``) item each (closing an open reasoning
        or message item first)."""
        events = self._close_reasoning("completed") + self._close_message("completed") if calls else []
        for call in calls:
            index = len(self.response.output)
            item: OutputFunctionCall | OutputCustomToolCall
            if call.input is not None:
                item = OutputCustomToolCall(name=call.name, input="", status="in_progress")
                self.response.output.append(item)
                events.append(self._send(self._item_event("response.output_item.added", item)))
                item.input = call.input
                events += [
                    self._send(CustomToolCallInputDeltaEvent(item_id=item.id, output_index=index, delta=call.input)),
                    self._send(CustomToolCallInputDoneEvent(item_id=item.id, output_index=index, input=call.input)),
                ]
            else:
                item = OutputFunctionCall(name=call.name, arguments="", status="in_progress")
                self.response.output.append(item)
                events.append(self._send(self._item_event("response.output_item.added", item)))
                item.arguments = call.arguments
                events += [
                    self._send(
                        FunctionCallArgumentsDeltaEvent(item_id=item.id, output_index=index, delta=call.arguments)
                    ),
                    self._send(
                        FunctionCallArgumentsDoneEvent(item_id=item.id, output_index=index, arguments=call.arguments)
                    ),
                ]
            item.status = "completed"
            events.append(self._send(self._item_event("response.output_item.done", item)))
        return events

    def finish(self, usage: UsageInfo, incomplete: bool) -> list[ServerSentEvent]:
        """The end: close an open message item, then ``response.completed`` (or ``response.incomplete``)."""
        status: ItemStatus = "incomplete" if incomplete else "completed"
        events = self._close_reasoning(status) + self._close_message(status)
        self.response.finish(usage, incomplete)
        kind: Literal["response.completed", "response.incomplete"] = (
            "response.incomplete" if incomplete else "response.completed"
        )
        events.append(self._send(ResponseLifecycleEvent(type=kind, response=self.response)))
        return events

    def fail(self, exc: BaseException) -> ServerSentEvent:
        """``response.failed`` for an error after the stream started (internals of unexpected errors hidden)."""
        kind = error_kind(exc)
        code = "server_error" if kind.status >= 500 else (kind.code or kind.type)
        self.response.status = "failed"
        self.response.error = ResponseError(code=code, message=error_body(exc).error.message)
        return self._send(ResponseLifecycleEvent(type="response.failed", response=self.response))

    def _close_reasoning(self, status: ItemStatus) -> list[ServerSentEvent]:
        item, self._reasoning = self._reasoning, None
        if item is None:
            return []
        item.status = status
        index = self.response.output.index(item)
        return [
            self._send(ReasoningTextDoneEvent(item_id=item.id, output_index=index, text=item.content[0].text)),
            self._send(self._part_event("response.content_part.done", item)),
            self._send(self._item_event("response.output_item.done", item)),
        ]

    def _close_message(self, status: ItemStatus) -> list[ServerSentEvent]:
        message, self._message = self._message, None
        if message is None:
            return []
        index, part = self._message_index, message.content[0]
        message.status = status
        return [
            self._send(OutputTextDoneEvent(item_id=message.id, output_index=index, text=part.text)),
            self._send(self._part_event("response.content_part.done", message)),
            self._send(self._item_event("response.output_item.done", message)),
        ]

    def _item_event(
        self, kind: Literal["response.output_item.added", "response.output_item.done"], item: OutputItem
    ) -> OutputItemEvent:
        return OutputItemEvent(type=kind, output_index=self.response.output.index(item), item=item)

    def _part_event(
        self,
        kind: Literal["response.content_part.added", "response.content_part.done"],
        item: OutputMessage | OutputReasoning,
    ) -> ContentPartEvent:
        """The content-part event of a message's ``output_text`` or a reasoning item's ``reasoning_text``."""
        return ContentPartEvent(
            type=kind, item_id=item.id, output_index=self.response.output.index(item), part=item.content[0]
        )

    def _send(self, event: StreamEvent) -> ServerSentEvent:
        """Number the event and encode it now (later changes to the response do not reach sent events)."""
        event.sequence_number = self._sequence
        self._sequence += 1
        return ServerSentEvent(event.model_dump_json(), event=event.type, sep="\n")
