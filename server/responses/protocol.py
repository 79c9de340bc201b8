"""The Responses API's models: the request and its input items, the Response object and the stream events.

Requests are strict, as chat's (``server/protocol.py``): input items, content parts and tools are validated one by
one so that errors name ``input[i]…`` / ``tools[i]…`` exactly, and an unsupported item, part or tool type is a 400
naming its ``type``. ``store`` and ``previous_response_id`` are served by the response store (``store.py``,
``serving.py``); ``conversation`` and ``background: true`` are 400s that say so (``ResponsesRequest.check``).

Tools are function and custom tools; the hosted tool types OpenAI runs on its side (``HOSTED_TOOL_TYPES``: web
search, file search, code interpreter, MCP, …) are accepted and left out of the prompt (logged, and named in the
``x-dflash2-ignored-tools`` response header).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from server.errors import InvalidRequestError
from server.protocol import (
    MAX_TOOLS,
    NAME_PATTERN,
    FunctionDefinition,
    StrictModel,
    TextInputFormat,
    UsageInfo,
    check_tool_choice_type,
)
from server.tool_calling import new_tool_call_id
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
_NO_CONVERSATIONS = (
    "this server keeps no conversation objects; continue with previous_response_id, or send the whole "
    "conversation as input"
)
# Tool types OpenAI runs on its side (or whose calls are items this server never writes): a request carrying them is
# served with its function and custom tools only. Agent clients (Codex) send them by default.
HOSTED_TOOL_TYPES = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_2025_08_26",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "image_generation",
        "computer",
        "computer_use_preview",
        "computer_use",
        "mcp",
        "local_shell",
        "shell",
        "apply_patch",
        "namespace",
        "tool_search",
        "programmatic_tool_calling",
    }
)
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

    @property
    def text(self) -> str:
        """The output as one string (text parts joined)."""
        return _joined(self.output)


class InputCustomToolCall(StrictModel):
    """An earlier call of a custom tool, sent back: ``input`` is the text the tool got."""

    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str
    id: str | None = None
    status: ItemStatus | None = None


class InputCustomToolCallOutput(StrictModel):
    """The result of the custom tool call ``call_id`` (text, or a list of text parts)."""

    type: Literal["custom_tool_call_output"]
    call_id: str
    output: str | list[InputTextPart]
    id: str | None = None

    @property
    def text(self) -> str:
        """The output as one string (text parts joined)."""
        return _joined(self.output)


class InputReasoning(BaseModel):
    """A reasoning item from an earlier reply: its text reaches the template as the next assistant turn's
    ``reasoning_content`` (templates that render earlier thinking use it); other fields (``encrypted_content``,
    ``id``) are accepted and dropped."""

    model_config = ConfigDict(extra="allow")

    type: Literal["reasoning"]
    content: list[dict[str, Any]] | None = None
    summary: list[dict[str, Any]] | None = None

    @property
    def text(self) -> str:
        """The thinking text: the ``reasoning_text`` parts, else the ``summary_text`` parts (joined)."""
        for parts, kind in ((self.content, "reasoning_text"), (self.summary, "summary_text")):
            texts = [str(p.get("text", "")) for p in parts or () if isinstance(p, dict) and p.get("type") == kind]
            if texts:
                return "".join(texts)
        return ""


def _item_kind(value: Any) -> Any:
    """The tag of an input item (a message may leave ``type`` out)."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[InputFunctionCall, Tag("function_call")]
    | Annotated[InputFunctionCallOutput, Tag("function_call_output")]
    | Annotated[InputCustomToolCall, Tag("custom_tool_call")]
    | Annotated[InputCustomToolCallOutput, Tag("custom_tool_call_output")]
    | Annotated[InputReasoning, Tag("reasoning")],
    Discriminator(_item_kind),
]
_ITEM_TYPES: dict[str, type[BaseModel]] = {
    "message": InputMessage,
    "function_call": InputFunctionCall,
    "function_call_output": InputFunctionCallOutput,
    "custom_tool_call": InputCustomToolCall,
    "custom_tool_call_output": InputCustomToolCallOutput,
    "reasoning": InputReasoning,
}


class FunctionToolParam(FunctionDefinition):
    """A function tool, flat (``{"type": "function", "name", "parameters", …}``).
    The fields and checks are chat's ``tools[i].function`` (``FunctionDefinition``)."""

    type: Literal["function"]


class GrammarFormat(StrictModel):
    """``format: {"type": "grammar", "syntax": "lark" | "regex", "definition"}`` (the Responses' flat shape)."""

    type: Literal["grammar"]
    syntax: Literal["lark", "regex"]
    definition: str = Field(min_length=1)


class CustomToolParam(StrictModel):
    """A custom tool (``{"type": "custom", "name", "description", "format"}``): it takes free text
    (``format: {"type": "text"}``, the default) or text in a grammar."""

    type: Literal["custom"]
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    format: TextInputFormat | GrammarFormat | None = None

    def chat_format(self) -> dict[str, Any] | None:
        """``format`` in chat's shape (the grammar nested under ``grammar``)."""
        if isinstance(self.format, GrammarFormat):
            grammar = {"syntax": self.format.syntax, "definition": self.format.definition}
            return {"type": "grammar", "grammar": grammar}
        return None if self.format is None else {"type": "text"}


class HostedToolParam(BaseModel):
    """A hosted tool (``HOSTED_TOOL_TYPES``): accepted, echoed in the response, and not offered to the model."""

    model_config = ConfigDict(extra="allow")

    type: str


class FunctionToolChoice(StrictModel):
    """``tool_choice: {"type": "function" | "custom", "name": …}``: this tool must be called."""

    type: Literal["function", "custom"]
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
    """``POST /v1/responses``: the conversation comes as ``input``, after the stored one of
    ``previous_response_id`` if given."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionToolParam | CustomToolParam | HostedToolParam] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    user: str | None = None
    include: list[str] | None = None
    # None = true, as OpenAI's default (kept unless the server's store is disabled).
    store: bool | None = None
    previous_response_id: str | None = None
    # Only their "off" values are accepted (see ``check``).
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

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _known_tool_choice(cls, value: Any) -> Any:
        return check_tool_choice_type(value)

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
        """Reject what this server cannot do, and ``include`` entries it cannot honour; log ignored fields.

        Raises:
            InvalidRequestError: naming the field.
        """
        if self.conversation is not None:
            raise InvalidRequestError(f"conversation is not supported: {_NO_CONVERSATIONS}", "conversation")
        if self.background:
            raise InvalidRequestError(
                "background: true is not supported: this server runs no responses in the background to be polled "
                "later (use stream: true for long generations)",
                "background",
            )
        check_include(self.include)
        ignored = [name for name in IGNORED_RESPONSES_FIELDS if getattr(self, name) is not None]
        if self.text is not None and self.text.verbosity is not None:
            ignored.append("text.verbosity")
        if ignored:
            logger.debug("ignoring %s (no effect on this server's output)", ", ".join(ignored))
        if self.ignored_tool_types:
            logger.info("ignoring hosted tools this server cannot run: %s", ", ".join(self.ignored_tool_types))

    @property
    def ignored_tool_types(self) -> list[str]:
        """The types of the hosted tools in ``tools`` (each once, in order): left out of the prompt."""
        kinds = [tool.type for tool in self.tools or () if isinstance(tool, HostedToolParam)]
        return list(dict.fromkeys(kinds))


def check_include(include: Sequence[str] | None) -> None:
    """``include`` (of a request, or of a stored response's retrieval): only entries that cannot apply here.

    Raises:
        InvalidRequestError: naming ``include[i]``.
    """
    for i, entry in enumerate(include or ()):
        if entry not in INAPPLICABLE_INCLUDES:
            raise InvalidRequestError(f"include: {entry!r} is not supported by this server", f"include[{i}]")


def _joined(content: str | list[InputTextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


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
    if kind != "reasoning":  # a reasoning item's content is reasoning_text parts
        _check_parts(item.get("content"), (*loc, "content"))
        _check_parts(item.get("output"), (*loc, "output"))
    return _validated(model, item, loc)


def _tool(tool: Any, loc: tuple[str | int, ...]) -> Any:
    if not isinstance(tool, dict):
        return tool
    kind = tool.get("type")
    if kind == "function":
        return _validated(FunctionToolParam, tool, loc)
    if kind == "custom":
        return _validated(CustomToolParam, tool, loc)
    if isinstance(kind, str) and kind in HOSTED_TOOL_TYPES:
        return HostedToolParam.model_validate(tool)
    raise _fail(
        (*loc, "type"),
        "unsupported_tool",
        f"tools of type {kind!r} are not supported by this server (function and custom tools are served; hosted "
        f"tools of these types are accepted and ignored: {', '.join(sorted(HOSTED_TOOL_TYPES))})",
        kind,
    )


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


class ReasoningText(BaseModel):
    """A ``reasoning_text`` content part of a reasoning item."""

    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class OutputReasoning(BaseModel):
    """A ``reasoning`` output item: the thinking block of a reasoning model (``--reasoning-parser``), as text
    (no summary is written)."""

    type: Literal["reasoning"] = "reasoning"
    id: str = Field(default_factory=lambda: f"rs_{uuid.uuid4().hex}")
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    encrypted_content: None = None
    status: ItemStatus = "completed"


class OutputCustomToolCall(BaseModel):
    """A ``custom_tool_call`` output item: the client runs the tool on ``input`` and sends back a
    ``custom_tool_call_output``."""

    type: Literal["custom_tool_call"] = "custom_tool_call"
    id: str = Field(default_factory=lambda: f"ctc_{uuid.uuid4().hex}")
    call_id: str = Field(default_factory=new_tool_call_id)
    name: str
    input: str
    status: ItemStatus = "completed"


OutputItem = OutputReasoning | OutputMessage | OutputFunctionCall | OutputCustomToolCall


class InputTokensDetails(BaseModel):
    """``usage.input_tokens_details``: ``cached_tokens`` were served from the prefix cache (no cache writes are
    reported)."""

    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    """``usage.output_tokens_details`` (reasoning tokens are not counted apart: they are in ``output_tokens``)."""

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
    store: bool = False
    previous_response_id: str | None = None
    reasoning: None = None
    user: str | None = None

    def finish(self, usage: UsageInfo, incomplete: bool) -> None:
        """Final status, incomplete details and usage."""
        self.status = "incomplete" if incomplete else "completed"
        self.incomplete_details = IncompleteDetails(reason="max_output_tokens") if incomplete else None
        self.usage = ResponseUsage.from_usage(usage)


def output_items(
    reasoning: str | None, content: str | None, calls: Sequence[ParsedToolCall], incomplete: bool
) -> list[OutputItem]:
    """The output of one reply: a reasoning item when it has a thinking block, a message item when there is text,
    then one ``function_call`` item per call (``custom_tool_call`` for a call of a custom tool)."""
    items: list[OutputItem] = []
    status: ItemStatus = "incomplete" if incomplete else "completed"
    if reasoning is not None:
        items.append(
            OutputReasoning(status="completed" if content or calls else status, content=[ReasoningText(text=reasoning)])
        )
    if content:
        items.append(OutputMessage(status=status, content=[OutputText(text=content)]))
    for call in calls:
        if call.input is not None:
            items.append(OutputCustomToolCall(name=call.name, input=call.input))
        else:
            items.append(OutputFunctionCall(name=call.name, arguments=call.arguments))
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


class ItemEvent(StreamEvent):
    """Base of the events about one output item (its id and place in ``output``)."""

    item_id: str
    output_index: int


class ContentEvent(ItemEvent):
    """Base of the events about one content part of an item."""

    content_index: int = 0


class ContentPartEvent(ContentEvent):
    """``response.content_part.added`` / ``done`` (a message's ``output_text`` or a reasoning item's
    ``reasoning_text``)."""

    type: Literal["response.content_part.added", "response.content_part.done"]
    part: OutputText | ReasoningText


class ReasoningTextDeltaEvent(ContentEvent):
    """``response.reasoning_text.delta``: more thinking text of a reasoning item."""

    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    delta: str


class ReasoningTextDoneEvent(ContentEvent):
    """``response.reasoning_text.done``: the whole thinking text of a reasoning item."""

    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    text: str


class OutputTextDeltaEvent(ContentEvent):
    """``response.output_text.delta``: more text of a message item."""

    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class OutputTextDoneEvent(ContentEvent):
    """``response.output_text.done``: the whole text of a message item."""

    type: Literal["response.output_text.done"] = "response.output_text.done"
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class FunctionCallArgumentsDeltaEvent(ItemEvent):
    """``response.function_call_arguments.delta``."""

    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    delta: str


class FunctionCallArgumentsDoneEvent(ItemEvent):
    """``response.function_call_arguments.done``: the whole arguments of a call."""

    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    arguments: str


class CustomToolCallInputDeltaEvent(ItemEvent):
    """``response.custom_tool_call_input.delta``."""

    type: Literal["response.custom_tool_call_input.delta"] = "response.custom_tool_call_input.delta"
    delta: str


class CustomToolCallInputDoneEvent(ItemEvent):
    """``response.custom_tool_call_input.done``: the whole input of a custom tool call."""

    type: Literal["response.custom_tool_call_input.done"] = "response.custom_tool_call_input.done"
    input: str
