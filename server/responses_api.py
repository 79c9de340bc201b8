"""``POST /v1/responses``: OpenAI's Responses API, stateless, over the chat completions path.

A Responses request is converted into a validated ``ChatCompletionRequest`` (``ResponsesRequest.to_chat``), so
tools, ``tool_choice``, grammar-enforced structured outputs and prompt rendering are exactly those of chat
completions; the chat outputs are then written as a Response object, or as Responses stream events.

The server keeps nothing between requests: ``store: true``, ``previous_response_id``, ``conversation`` and
``background: true`` are 400s that say so (the client sends the whole conversation as ``input`` each time).
Errors name the Responses field (``input[2].type``, ``text.format.schema``, ``max_output_tokens``), also when
they come from the chat checks.

Stream events (``event: <type>`` and ``data: <json>``, each with an increasing ``sequence_number``, no
``[DONE]``): ``response.created`` → ``response.in_progress`` → per text item ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta``…, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done`` → per tool call ``response.output_item.added``,
``response.function_call_arguments.delta``, ``response.function_call_arguments.done``,
``response.output_item.done`` → ``response.completed`` or ``response.incomplete`` carrying the whole response.
An error after the stream started is one ``response.failed`` event.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError
from sse_starlette.sse import ServerSentEvent
from starlette.responses import Response

from server.errors import APIError, InvalidRequestError, describe_validation_error, error_body, error_kind
from server.protocol import (
    MAX_TOOLS,
    NAME_PATTERN,
    ChatCompletionRequest,
    FunctionDefinition,
    NamedToolChoice,
    StrictModel,
    UsageInfo,
)
from server.serving import Generation, OpenAIServing, usage_info, visible_text
from server.tool_calling import ToolPlan, new_tool_call_id
from server.tool_parsers import ParsedToolCall

logger = logging.getLogger(__name__)

# Accepted and ignored (logged at debug): they do not change what this server generates.
IGNORED_RESPONSES_FIELDS = (
    "metadata",
    "reasoning",
    "truncation",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "safety_identifier",
)
# ``include`` entries that cannot apply here (no reasoning, no hosted tools, no images): accepted, no effect.
INAPPLICABLE_INCLUDES = frozenset(
    {
        "reasoning.encrypted_content",
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
    }
)
_STATELESS = "this server is stateless and stores no responses or conversations; send the whole conversation as input"
_TEXT_PART_TYPES = ("input_text", "output_text")

ItemStatus = Literal["in_progress", "completed", "incomplete"]


# ---- request -----------------------------------------------------------------------------------


class InputTextPart(StrictModel):
    """A text content part: ``input_text`` (user side) or ``output_text`` (an earlier reply sent back)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputMessage(StrictModel):
    """``{"type": "message", "role", "content"}`` (``type`` may be left out); ``developer`` renders as ``system``."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputTextPart]
    id: str | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    @property
    def text(self) -> str:
        """The content as one string (text parts joined)."""
        return _joined(self.content)


class InputFunctionCall(StrictModel):
    """An earlier tool call of the model, sent back: ``arguments`` is JSON text."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None


class InputFunctionCallOutput(StrictModel):
    """The result of the tool call ``call_id`` (text, or a list of text parts)."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputTextPart]
    id: str | None = None
    status: ItemStatus | None = None


class InputReasoning(BaseModel):
    """A reasoning item from an earlier reply: accepted and dropped (this model has no reasoning to resume)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["reasoning"]


def _item_kind(value: Any) -> Any:
    """The tag of an input item (a message may leave ``type`` out)."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[InputFunctionCall, Tag("function_call")]
    | Annotated[InputFunctionCallOutput, Tag("function_call_output")]
    | Annotated[InputReasoning, Tag("reasoning")],
    Discriminator(_item_kind),
]
_ITEM_TYPES: dict[str, type[BaseModel]] = {
    "message": InputMessage,
    "function_call": InputFunctionCall,
    "function_call_output": InputFunctionCallOutput,
    "reasoning": InputReasoning,
}


class FunctionToolParam(FunctionDefinition):
    """A function tool, flat (``{"type": "function", "name", "parameters", …}``); the only tool type served.
    The fields and checks are chat's ``tools[i].function`` (``FunctionDefinition``)."""

    type: Literal["function"]


class FunctionToolChoice(StrictModel):
    """``tool_choice: {"type": "function", "name": …}``: this tool must be called."""

    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    """``text.format``: ``text`` (free), ``json_object`` (any JSON object) or ``json_schema`` (``name``,
    ``schema``)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, pattern=NAME_PATTERN)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_fields(self) -> TextFormat:
        if self.type == "json_schema" and self.name is None:
            raise ValueError("name is required with type json_schema")
        given = [key for key in ("name", "schema_", "description", "strict") if getattr(self, key) is not None]
        if self.type != "json_schema" and given:
            raise ValueError(f"{given[0].rstrip('_')} is only allowed with type json_schema")
        return self


class TextConfig(StrictModel):
    """``text``: the output format (``verbosity`` is accepted and ignored)."""

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(StrictModel):
    """``POST /v1/responses`` (stateless: the whole conversation comes as ``input`` each time)."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionToolParam] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    user: str | None = None
    include: list[str] | None = None
    # Stateful features: only their "off" values are accepted (see ``check``).
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    # IGNORED_RESPONSES_FIELDS: accepted, logged, no effect here.
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _typed_items(cls, data: Any) -> Any:
        """Validate input items and tools one by one, so that errors name ``input[i]…`` / ``tools[i]…`` exactly
        (an unsupported item, part or tool type is named by its ``type``)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if isinstance(data.get("input"), list):
            data["input"] = [_input_item(item, ("input", i)) for i, item in enumerate(data["input"])]
        if isinstance(data.get("tools"), list):
            data["tools"] = [_tool(tool, ("tools", i)) for i, tool in enumerate(data["tools"])]
        return data

    def check(self) -> None:
        """Reject what a stateless server cannot do, and ``include`` entries it cannot honour; log ignored fields.

        Raises:
            InvalidRequestError: naming the field.
        """
        if self.store:
            raise InvalidRequestError(f"store: true is not supported: {_STATELESS} (set store to false)", "store")
        if self.previous_response_id is not None:
            raise InvalidRequestError(f"previous_response_id is not supported: {_STATELESS}", "previous_response_id")
        if self.conversation is not None:
            raise InvalidRequestError(f"conversation is not supported: {_STATELESS}", "conversation")
        if self.background:
            raise InvalidRequestError(
                "background: true is not supported: this server is stateless and cannot be polled for a response "
                "later (use stream: true for long generations)",
                "background",
            )
        for i, entry in enumerate(self.include or ()):
            if entry not in INAPPLICABLE_INCLUDES:
                raise InvalidRequestError(f"include: {entry!r} is not supported by this server", f"include[{i}]")
        ignored = [name for name in IGNORED_RESPONSES_FIELDS if getattr(self, name) is not None]
        if self.text is not None and self.text.verbosity is not None:
            ignored.append("text.verbosity")
        if ignored:
            logger.debug("ignoring %s (no effect on this server's output)", ", ".join(ignored))

    def to_chat(self) -> ChatConversion:
        """The equivalent chat completions request, and where each of its messages came from.

        ``instructions`` become a system message first; consecutive ``function_call`` items join one assistant
        message (the one right before them, if it is an assistant message); ``function_call_output`` items become
        ``tool`` messages; reasoning items are dropped.

        Raises:
            InvalidRequestError: no message at all, or the chat request does not validate (naming the Responses
                field where it can).
        """
        messages: list[dict[str, Any]] = []
        sources: list[str] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
            sources.append("instructions")
        items = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for i, item in enumerate(items):
            source = "input" if isinstance(self.input, str) else f"input[{i}]"
            if isinstance(item, InputMessage):
                messages.append({"role": item.role, "content": item.text})
            elif isinstance(item, InputFunctionCall):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                if messages and messages[-1]["role"] == "assistant":
                    messages[-1].setdefault("tool_calls", []).append(call)
                    continue
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, InputFunctionCallOutput):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _joined(item.output)})
            else:
                continue  # reasoning
            sources.append(source)
        if not messages:
            raise InvalidRequestError("input must contain at least one message (or give instructions)", "input")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "user": self.user,
            "tools": [
                {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                for tool in self.tools or ()
            ]
            or None,
            "tool_choice": (
                {"type": "function", "function": {"name": self.tool_choice.name}}
                if isinstance(self.tool_choice, FunctionToolChoice)
                else self.tool_choice
            ),
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": _response_format(self.text.format if self.text else None),
        }
        try:
            chat = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as exc:  # a safety net: the fields above are validated already
            message, param = describe_validation_error(exc.errors())
            raise InvalidRequestError(message, responses_param(param, sources)) from exc
        return ChatConversion(chat, sources)


@dataclass(frozen=True)
class ChatConversion:
    """A Responses request as a chat request; ``sources[k]`` is the Responses field that gave ``messages[k]``."""

    request: ChatCompletionRequest
    sources: list[str]

    def param(self, chat_param: str | None) -> str | None:
        """The Responses field for a field of ``request`` (see ``responses_param``)."""
        return responses_param(chat_param, self.sources)


_MESSAGE_PARAM = re.compile(r"^messages\[(\d+)\]")
_PARAM_RENAMES = (
    (re.compile(r"^max_(completion_)?tokens$"), "max_output_tokens"),
    (re.compile(r"^response_format\.json_schema(?=\.|$)"), "text.format"),
    (re.compile(r"^response_format(?=\.|$)"), "text.format"),
    (re.compile(r"^(tools\[\d+\])\.function(?=\.|$)"), r"\1"),
    (re.compile(r"^messages$"), "input"),
)


def responses_param(chat_param: str | None, sources: Sequence[str]) -> str | None:
    """The Responses field for a chat field: ``messages[k]…`` → ``sources[k]`` (``input[2]``, ``instructions``),
    ``response_format.json_schema.schema`` → ``text.format.schema``, ``tools[0].function.parameters`` →
    ``tools[0].parameters``, ``max_tokens`` → ``max_output_tokens``; other names are the same in both."""
    if chat_param is None:
        return None
    message = _MESSAGE_PARAM.match(chat_param)
    if message:
        index = int(message.group(1))
        return sources[index] if index < len(sources) else "input"
    for pattern, replacement in _PARAM_RENAMES:
        chat_param = pattern.sub(replacement, chat_param)
    return chat_param


def _joined(content: str | list[InputTextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _response_format(text_format: TextFormat | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    if text_format is None:
        return None
    if text_format.type != "json_schema":
        return {"type": text_format.type}
    schema = text_format.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)
    return {"type": "json_schema", "json_schema": schema}


def _fail(loc: tuple[str | int, ...], kind: str, message: str, value: Any) -> ValidationError:
    """A validation error at ``loc`` (below the request body)."""
    error = PydanticCustomError(kind, message)
    return ValidationError.from_exception_data("ResponsesRequest", [InitErrorDetails(type=error, loc=loc, input=value)])


def _validated(model: type[BaseModel], value: Any, loc: tuple[str | int, ...]) -> BaseModel:
    """``model`` from ``value``, its errors re-located below ``loc``."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        details = [
            InitErrorDetails(
                type=PydanticCustomError(error["type"], error["msg"]),
                loc=(*loc, *error["loc"]),
                input=error.get("input"),
            )
            for error in exc.errors()
        ]
        raise ValidationError.from_exception_data("ResponsesRequest", details) from None


def _check_parts(parts: Any, loc: tuple[str | int, ...]) -> None:
    """Text parts only: an image, file or audio part is a 400 naming its ``type``."""
    if not isinstance(parts, list):
        return
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind is not None and kind not in _TEXT_PART_TYPES:
            raise _fail(
                (*loc, j, "type"),
                "unsupported_part",
                f"content parts of type {kind!r} are not supported by this server (only input_text, output_text)",
                kind,
            )


def _input_item(item: Any, loc: tuple[str | int, ...]) -> Any:
    if not isinstance(item, dict):
        raise _fail(loc, "invalid_item", "input items must be objects", item)
    kind = _item_kind(item)
    model = _ITEM_TYPES.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise _fail(
            (*loc, "type"),
            "unsupported_item",
            f"input items of type {kind!r} are not supported by this server (only {', '.join(sorted(_ITEM_TYPES))})",
            kind,
        )
    _check_parts(item.get("content"), (*loc, "content"))
    _check_parts(item.get("output"), (*loc, "output"))
    return _validated(model, item, loc)


def _tool(tool: Any, loc: tuple[str | int, ...]) -> Any:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if isinstance(tool, dict) and kind != "function":
        raise _fail(
            (*loc, "type"),
            "unsupported_tool",
            f"tools of type {kind!r} are not supported by this server (only function tools)",
            kind,
        )
    return _validated(FunctionToolParam, tool, loc) if isinstance(tool, dict) else tool


# ---- response ----------------------------------------------------------------------------------


class OutputText(BaseModel):
    """An ``output_text`` content part of a message item."""

    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    """An assistant ``message`` output item."""

    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    status: ItemStatus = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class OutputFunctionCall(BaseModel):
    """A ``function_call`` output item: the client runs it and sends back a ``function_call_output``."""

    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: f"fc_{uuid.uuid4().hex}")
    call_id: str = Field(default_factory=new_tool_call_id)
    name: str
    arguments: str
    status: ItemStatus = "completed"


OutputItem = OutputMessage | OutputFunctionCall


class InputTokensDetails(BaseModel):
    """``usage.input_tokens_details`` (no prompt cache is reported)."""

    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    """``usage.output_tokens_details`` (the model has no reasoning tokens)."""

    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    """Token counts of one response."""

    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def from_usage(cls, usage: UsageInfo) -> ResponseUsage:
        """From the chat counts."""
        return cls(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens),
            output_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens,
        )


class IncompleteDetails(BaseModel):
    """Why a response is ``incomplete``."""

    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    """Why a response ``failed``."""

    code: str
    message: str


class ResponseObject(BaseModel):
    """A Response (``object: "response"``): the request's settings echoed, the output items and usage."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    max_output_tokens: int | None = None
    text: dict[str, Any]
    truncation: Literal["disabled"] = "disabled"
    metadata: dict[str, str] = Field(default_factory=dict)
    store: Literal[False] = False
    previous_response_id: None = None
    reasoning: None = None
    user: str | None = None

    def finish(self, usage: UsageInfo, incomplete: bool) -> None:
        """Final status, incomplete details and usage."""
        self.status = "incomplete" if incomplete else "completed"
        self.incomplete_details = IncompleteDetails(reason="max_output_tokens") if incomplete else None
        self.usage = ResponseUsage.from_usage(usage)


def output_items(content: str | None, calls: Sequence[ParsedToolCall], incomplete: bool) -> list[OutputItem]:
    """The output of one reply: a message item when there is text, then one ``function_call`` item per call."""
    items: list[OutputItem] = []
    if content:
        status: ItemStatus = "incomplete" if incomplete else "completed"
        items.append(OutputMessage(status=status, content=[OutputText(text=content)]))
    items += [OutputFunctionCall(name=call.name, arguments=call.arguments) for call in calls]
    return items


# ---- stream events -----------------------------------------------------------------------------


class StreamEvent(BaseModel):
    """Base of stream events; ``sequence_number`` is set when the event is sent."""

    type: str
    sequence_number: int = 0


class ResponseLifecycleEvent(StreamEvent):
    """``response.created`` / ``in_progress`` / ``completed`` / ``incomplete`` / ``failed``: the response so far."""

    type: Literal[
        "response.created", "response.in_progress", "response.completed", "response.incomplete", "response.failed"
    ]
    response: ResponseObject


class OutputItemEvent(StreamEvent):
    """``response.output_item.added`` / ``done``."""

    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(StreamEvent):
    """``response.content_part.added`` / ``done``."""

    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int = 0
    part: OutputText


class OutputTextDeltaEvent(StreamEvent):
    """``response.output_text.delta``: more text of a message item."""

    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class OutputTextDoneEvent(StreamEvent):
    """``response.output_text.done``: the whole text of a message item."""

    type: Literal["response.output_text.done"] = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int = 0
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class FunctionCallArgumentsDeltaEvent(StreamEvent):
    """``response.function_call_arguments.delta``."""

    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDoneEvent(StreamEvent):
    """``response.function_call_arguments.done``: the whole arguments of a call."""

    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    arguments: str


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

    def start(self) -> list[ServerSentEvent]:
        """``response.created`` and ``response.in_progress``."""
        self.response.status = "in_progress"
        return [
            self._send(ResponseLifecycleEvent(type="response.created", response=self.response)),
            self._send(ResponseLifecycleEvent(type="response.in_progress", response=self.response)),
        ]

    def text(self, delta: str) -> list[ServerSentEvent]:
        """A text delta (opening a message item first when none is open)."""
        if not delta:
            return []
        events = []
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
        """Completed tool calls: one ``function_call`` item each (closing an open message item first)."""
        events = self._close_message("completed") if calls else []
        for call in calls:
            item, index = (
                OutputFunctionCall(name=call.name, arguments="", status="in_progress"),
                len(self.response.output),
            )
            self.response.output.append(item)
            events.append(self._send(self._item_event("response.output_item.added", item)))
            item.arguments = call.arguments
            events.append(
                self._send(FunctionCallArgumentsDeltaEvent(item_id=item.id, output_index=index, delta=call.arguments))
            )
            events.append(
                self._send(
                    FunctionCallArgumentsDoneEvent(item_id=item.id, output_index=index, arguments=call.arguments)
                )
            )
            item.status = "completed"
            events.append(self._send(self._item_event("response.output_item.done", item)))
        return events

    def finish(self, usage: UsageInfo, incomplete: bool) -> list[ServerSentEvent]:
        """The end: close an open message item, then ``response.completed`` (or ``response.incomplete``)."""
        events = self._close_message("incomplete" if incomplete else "completed")
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
        self, kind: Literal["response.content_part.added", "response.content_part.done"], message: OutputMessage
    ) -> ContentPartEvent:
        return ContentPartEvent(
            type=kind, item_id=message.id, output_index=self._message_index, part=message.content[0]
        )

    def _send(self, event: StreamEvent) -> ServerSentEvent:
        """Number the event and encode it now (later changes to the response do not reach sent events)."""
        event.sequence_number = self._sequence
        self._sequence += 1
        return ServerSentEvent(event.model_dump_json(), event=event.type, sep="\n")


# ---- serving -----------------------------------------------------------------------------------

# For the OpenAPI schema of the route: the same 200 is an event stream with stream: true.
RESPONSES_SSE_ALTERNATIVE: dict[str, Any] = {
    "description": "JSON, or with stream: true server-sent events (event: <type>, data: <event object>)",
    "content": {"text/event-stream": {"schema": {"type": "string"}}},
}


class ResponsesServing:
    """``POST /v1/responses`` over the chat path of an ``OpenAIServing``."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create_response(self, request: ResponsesRequest) -> Response:
        """Check, convert, start the chat generation; a Response object, or its event stream."""
        request.check()
        conversion = request.to_chat()
        chat = conversion.request
        try:
            generation, plan = await self.serving.start_chat(chat)
        except APIError as exc:
            chat_param, exc.param = exc.param, conversion.param(exc.param)
            if chat_param and exc.param and exc.message.startswith(chat_param):  # the message names it too
                exc.message = exc.param + exc.message[len(chat_param) :]
                exc.args = (exc.message,)
            raise
        try:
            response = self._new_response(request, chat, generation)
        except BaseException:
            generation.close()
            raise
        if request.stream:
            return self.serving.event_stream(self._events(ResponseStream(response), generation, plan), generation)
        (state,) = await generation.collect()
        incomplete = state.finish_reason == "length"
        content, calls = plan.parse(state.text, cut=incomplete)
        response.output = output_items(content, calls, incomplete)
        response.finish(usage_info(generation.num_prompt_tokens, [state]), incomplete)
        return JSONResponse(response.model_dump())

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
            tool_choice={"type": "function", "name": choice.function.name}
            if isinstance(choice, NamedToolChoice)
            else choice,
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
        """The event stream; the generation is closed however it ends (a client that went away aborts it)."""
        try:
            for event in stream.start():
                yield event
            streamer = plan.streamer()
            async for _, output in generation.outputs():
                text, calls = visible_text(output), list[ParsedToolCall]()
                if streamer is not None:
                    text, calls = streamer.feed(text)
                    if output.finished:
                        tail, more = streamer.finish(cut=output.finish_reason == "length")
                        text, calls = text + tail, calls + more
                for event in stream.text(text) + stream.calls(calls):
                    yield event
            (state,) = generation.states
            for event in stream.finish(
                usage_info(generation.num_prompt_tokens, [state]), state.finish_reason == "length"
            ):
                yield event
        except Exception as exc:
            if error_kind(exc).status == 500:
                logger.error("stream %s failed", generation.id, exc_info=exc)
            yield stream.fail(exc)
        finally:
            generation.close()
