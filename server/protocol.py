"""OpenAI request and response schemas (pydantic), with the request → ``SamplingParams`` conversion.

Requests are strict and closed: a field we do not implement, a wrong JSON type or an out-of-range
value is a 400 that names the field, never something accepted and ignored. Cross-field checks and
the conversion to engine parameters live on the request types (``to_sampling_params``), so
``serving`` only ever sees validated requests.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from dflash2.sampling import SamplingParams, stop_strings

logger = logging.getLogger(__name__)

MAX_STOP_STRINGS = 16
MAX_CHOICES = 16
MAX_LOGPROBS = 20
MAX_SEED = 2**63 - MAX_CHOICES  # seed + choice index stays a valid torch seed
MAX_TEMPLATE_VALUE_CHARS = 256
# Keys a client may not pass through chat_template_kwargs: the server sets these itself.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tokenize", "add_generation_prompt", "return_dict", "return_tensors"}
)
MAX_TOOLS = 128
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function and schema names
# Accepted and ignored (logged at debug): they do not change what this server generates. Fields that
# would constrain the output and are not honoured stay 400s. docs/server.md lists them.
IGNORED_FIELDS = (
    "store",
    "metadata",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "safety_identifier",
    "verbosity",
    "reasoning_effort",
)


class StrictModel(BaseModel):
    """Base of request models: unknown fields and type coercions are errors, and every string
    must be valid Unicode (JSON's ``"\\ud800"`` escapes can smuggle in lone surrogates, which no
    tokenizer, template or response encoder accepts)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, value in data.items():
                if key == "model":  # an unknown model name is a 404 (ModelInfo.check), not a 400
                    continue
                where = _lone_surrogate(value, (key,))
                if where is not None:
                    raise ValidationError.from_exception_data(
                        cls.__name__,
                        [
                            InitErrorDetails(
                                type=PydanticCustomError(
                                    "invalid_unicode", "text must be valid Unicode (it contains a lone surrogate)"
                                ),
                                loc=where,
                                input="…",
                            )
                        ],
                    )
        return data


def _lone_surrogate(value: Any, loc: tuple[str | int, ...]) -> tuple[str | int, ...] | None:
    """The location of the first string under ``value`` that does not encode as UTF-8, if any."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return loc
        return None
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        if isinstance(key, str) and _lone_surrogate(key, loc) is not None:
            return loc
        found = _lone_surrogate(item, (*loc, key))
        if found is not None:
            return found
    return None


class RequestParamError(ValueError):
    """A cross-field problem found by ``to_sampling_params``; ``param`` names the field."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


# ---- requests ----------------------------------------------------------------------------------


def check_template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """``chat_template_kwargs`` are template variables: plain values (booleans, numbers, strings of
    at most ``MAX_TEMPLATE_VALUE_CHARS``) that may not override what the server sets itself. Which
    names the model's template reads is checked against the loaded model (``OpenAIServing``)."""
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(value or {}))
    if reserved:
        raise ValueError(f"{', '.join(reserved)} cannot be set here")
    for key, item in (value or {}).items():
        if not isinstance(item, bool | int | float | str) or (
            isinstance(item, str) and len(item) > MAX_TEMPLATE_VALUE_CHARS
        ):
            raise ValueError(
                f"{key}: template variables are booleans, numbers or strings of at most "
                f"{MAX_TEMPLATE_VALUE_CHARS} characters"
            )
    return value


def check_tool_choice_type(value: Any) -> Any:
    """A clear refusal for the ``tool_choice`` objects this server does not implement: ``allowed_tools`` and
    choices of hosted tools (anything but ``function`` and ``custom``); other values pass on to validation."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "allowed_tools":
        raise ValueError("allowed_tools is not supported; send only the allowed tools in tools instead")
    if isinstance(kind, str) and kind not in ("function", "custom"):
        raise ValueError(f"a tool choice of type {kind!r} is not supported (only function and custom tools are served)")
    return value


class StreamOptions(StrictModel):
    """``stream_options``: ``include_usage`` adds a usage chunk before ``[DONE]``."""

    include_usage: bool = False


class TextContentPart(StrictModel):
    """A ``{"type": "text", "text": …}`` content part (the only kind this server accepts)."""

    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    """One chat message; ``content`` is a string or a list of text parts. ``developer`` (OpenAI's
    newer name for instructions) is rendered as ``system``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    # An earlier reply's thinking, sent back (vLLM's name, and the newer ``reasoning``): templates that render
    # it (Qwen3's, for tool-call turns) read ``reasoning_content``.
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_validator(mode="after")
    def _reasoning_on_assistant_turns(self) -> ChatMessage:
        if (self.reasoning_content is not None or self.reasoning is not None) and self.role != "assistant":
            raise ValueError("reasoning_content / reasoning are only for assistant messages")
        if self.reasoning_content is not None and self.reasoning is not None:
            raise ValueError("set reasoning_content or reasoning, not both")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"content parts of type {kind!r} are not supported (only 'text')")
        return value

    @property
    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates expect it (string content; custom tool calls as calls of a function whose
        one argument is ``input``, the way custom tools are presented to the model)."""
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.text}
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        if self.tool_calls is not None:
            message["tool_calls"] = [_function_form(call) for call in self.tool_calls]
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return message


def _function_form(call: dict[str, Any]) -> dict[str, Any]:
    """A history tool call of ``type: "custom"`` (``{"custom": {"name", "input"}}``) as a function call with the
    arguments ``{"input": …}``; other calls unchanged."""
    custom = call.get("custom")
    if call.get("type") != "custom" or not isinstance(custom, dict):
        return call
    arguments = json.dumps({"input": custom.get("input", "")}, ensure_ascii=False)
    function = {"name": custom.get("name", ""), "arguments": arguments}
    return {**{k: v for k, v in call.items() if k != "custom"}, "type": "function", "function": function}


class FunctionDefinition(StrictModel):
    """``tools[i].function``: a function the model may call; ``parameters`` is a JSON Schema object."""

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type", "object") != "object":
            raise ValueError("the parameters schema must describe an object (type: object)")
        return value


class TextInputFormat(StrictModel):
    """``format: {"type": "text"}``: the custom tool takes free text."""

    type: Literal["text"]


class GrammarDefinition(StrictModel):
    """A grammar the custom tool's input must follow: ``lark`` (llguidance's Lark dialect) or ``regex`` (Rust
    ``regex`` syntax, matched against the whole input)."""

    syntax: Literal["lark", "regex"]
    definition: str = Field(min_length=1)


class ChatGrammarFormat(StrictModel):
    """``format: {"type": "grammar", "grammar": {"syntax", "definition"}}`` (chat's nested shape)."""

    type: Literal["grammar"]
    grammar: GrammarDefinition


class CustomToolDefinition(StrictModel):
    """``tools[i].custom``: a tool that takes text (free, or following a grammar) instead of JSON arguments."""

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    format: TextInputFormat | ChatGrammarFormat | None = None

    @property
    def grammar(self) -> GrammarDefinition | None:
        """The grammar of the input, or None for free text."""
        return self.format.grammar if isinstance(self.format, ChatGrammarFormat) else None


class ChatTool(StrictModel):
    """One entry of ``tools``: ``{"type": "function", "function": {…}}`` or ``{"type": "custom", "custom": {…}}``."""

    type: Literal["function", "custom"]
    function: FunctionDefinition | None = None
    custom: CustomToolDefinition | None = None

    @model_validator(mode="after")
    def _body_of_its_type(self) -> ChatTool:
        given = "function" if self.function is not None else "custom" if self.custom is not None else None
        if given != self.type or (self.function is not None and self.custom is not None):
            raise ValueError(f"a tool of type {self.type!r} carries its definition in {self.type!r}, and only there")
        return self

    @property
    def name(self) -> str:
        """The tool's name (function or custom)."""
        return self.function.name if self.function is not None else self.custom.name  # type: ignore[union-attr]


class FunctionName(StrictModel):
    """``{"name": …}`` of a named tool choice."""

    name: str


class NamedToolChoice(StrictModel):
    """``tool_choice: {"type": "function", "function": {"name": …}}`` or ``{"type": "custom", "custom": {"name":
    …}}``: this tool must be called."""

    type: Literal["function", "custom"]
    function: FunctionName | None = None
    custom: FunctionName | None = None

    @model_validator(mode="after")
    def _name_of_its_type(self) -> NamedToolChoice:
        if (self.function if self.type == "function" else self.custom) is None or (
            self.function is not None and self.custom is not None
        ):
            raise ValueError(f"a tool choice of type {self.type!r} names the tool in {self.type!r}, and only there")
        return self

    @property
    def name(self) -> str:
        """The name of the tool that must be called."""
        return (self.function or self.custom).name  # type: ignore[union-attr]


class JsonSchemaFormat(StrictModel):
    """``response_format.json_schema``: ``schema`` is the JSON Schema the output must satisfy."""

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """``response_format``: ``text`` (free), ``json_object`` (any JSON object) or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self


class SamplingRequest(StrictModel):
    """Fields shared by chat and text completions."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    user: str | None = None
    # IGNORED_FIELDS: accepted, logged, no effect here.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None

    @model_validator(mode="after")
    def _log_ignored(self) -> SamplingRequest:
        ignored = [name for name in IGNORED_FIELDS if getattr(self, name, None) is not None]
        if ignored:
            logger.debug("ignoring %s (no effect on this server's output)", ", ".join(ignored))
        return self

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError("values must be in [-100, 100]")
        return value

    @property
    def include_usage(self) -> bool:
        """True when a streamed response ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        """The client's output limit, if it gave one (endpoint-specific)."""
        raise NotImplementedError

    def requested_logprobs(self) -> int | None:
        """Alternatives per token for the engine (None = no logprobs; endpoint-specific)."""
        raise NotImplementedError

    def check(self) -> None:
        """Cross-field checks shared by both endpoints.

        Raises:
            RequestParamError: naming the field.
        """
        if self.stream_options is not None and not self.stream:
            raise RequestParamError("stream_options is only allowed when stream is true", "stream_options")

    def to_sampling_params(self, default_max_tokens: int) -> list[SamplingParams]:
        """Engine parameters, one per choice (seeded choices get seed, seed+1, …); call
        :meth:`check` first. Checks against the loaded model (token ids, ``top_k`` within the
        vocabulary) are the engine's, at submission.

        Args:
            default_max_tokens: the limit when the client gives none.

        Raises:
            RequestParamError: a cross-field problem.
            ValueError: an engine-side range check (the message names the field).
        """
        max_tokens = self.requested_max_tokens() or default_max_tokens
        if self.min_tokens > max_tokens:
            raise RequestParamError(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens")
        bias = {int(k): v for k, v in (self.logit_bias or {}).items()}
        stop_ids = tuple(self.stop_token_ids or ())
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=bias,
            seed=self.seed,
            stop=stop_strings(self.stop),
            stop_token_ids=stop_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=self.requested_logprobs(),
        )
        if self.seed is None:
            return [params] * self.n
        return [dataclasses.replace(params, seed=self.seed + i) for i in range(self.n)]


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_template_kwargs(value)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _known_tool_choice(cls, value: Any) -> Any:
        return check_tool_choice_type(value)

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """``tool_choice`` with OpenAI's default: ``auto`` when tools are given, else ``none``."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (or its older name ``max_tokens``)."""
        return self.max_completion_tokens or self.max_tokens

    def requested_logprobs(self) -> int | None:
        """``top_logprobs`` alternatives when ``logprobs`` is true."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def check(self) -> None:
        """Chat-specific cross-field checks (see ``SamplingRequest.check``)."""
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestParamError("top_logprobs needs logprobs set to true", "top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens not in (None, self.max_tokens):
            raise RequestParamError("max_tokens and max_completion_tokens disagree; set one", "max_tokens")
        for i, message in enumerate(self.messages):
            if message.content is None and not (message.role == "assistant" and message.tool_calls):
                raise RequestParamError("content is required", f"messages[{i}].content")
        names = [tool.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            raise RequestParamError("tool names must be unique", "tools")
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise RequestParamError("tool_choice needs tools", "tool_choice")
        if isinstance(choice, NamedToolChoice):
            kinds = {tool.name: tool.type for tool in self.tools or ()}
            if kinds.get(choice.name) != choice.type:
                raise RequestParamError(
                    f"tool_choice names {choice.type} tool {choice.name!r}, which is not in tools", "tool_choice"
                )


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: ``prompt`` is text or a list of token ids."""

    prompt: str | list[int]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    def requested_max_tokens(self) -> int | None:
        """``max_tokens`` (OpenAI's default for completions is 16; null = the rest of the context)."""
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        """``logprobs`` alternatives per token."""
        return self.logprobs

    def check(self) -> None:
        """Completion-specific cross-field checks (see ``SamplingRequest.check``)."""
        super().check()
        if not self.prompt:
            raise RequestParamError("prompt must not be empty", "prompt")
        if self.echo and self.logprobs is not None:
            raise RequestParamError("echo with logprobs is not supported (no prompt logprobs)", "echo")


class TokenizeRequest(StrictModel):
    """``POST /tokenize``: exactly one of ``prompt`` (text) and ``messages`` (chat template applied)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_template_kwargs(value)

    def check(self) -> None:
        """Raises RequestParamError unless exactly one of prompt / messages is given."""
        if (self.prompt is None) == (self.messages is None):
            raise RequestParamError("give exactly one of prompt and messages", "prompt")


class DetokenizeRequest(StrictModel):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


# ---- responses ---------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    """The inside of the OpenAI error envelope."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """``{"error": {...}}``."""

    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    """``usage.prompt_tokens_details``: ``cached_tokens`` came from the prefix cache."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """Token counts of one response (all choices)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class SpecDecodeInfo(BaseModel):
    """Speculative-decoding statistics of one request (the ``dflash2`` extension object).

    ``mean_acceptance_length`` = (accepted_tokens + verify_steps) / verify_steps: committed tokens
    per verify step, bonus token included (0 before the first verify step). ``accepted_tokens_by_source``
    splits ``accepted_tokens`` by where the drafts came from: ``drafter``, ``lookup`` (the request's own
    tokens), ``suffix`` (earlier requests' outputs), ``grammar`` (forced by the request's grammar).
    """

    draft_tokens: int
    accepted_tokens: int
    verify_steps: int
    mean_acceptance_length: float
    accepted_tokens_by_source: dict[str, int] = Field(default_factory=dict)


class TopLogprob(BaseModel):
    """One alternative token in chat logprobs."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobInfo(TopLogprob):
    """One emitted token in chat logprobs, with its alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """``choices[i].logprobs`` of a chat response."""

    content: list[TokenLogprobInfo]


class CompletionLogprobs(BaseModel):
    """``choices[i].logprobs`` of a text completion (the legacy OpenAI shape)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class FunctionCall(BaseModel):
    """The function of a tool call: ``arguments`` is JSON text."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One entry of ``message.tool_calls``: a function call."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class CustomCall(BaseModel):
    """The custom tool of a tool call and the text it gets."""

    name: str
    input: str


class CustomToolCall(BaseModel):
    """One entry of ``message.tool_calls``: a call of a custom tool."""

    id: str
    type: Literal["custom"] = "custom"
    custom: CustomCall


class AssistantMessage(BaseModel):
    """``choices[i].message``: ``content`` is null when the reply is only tool calls; ``tool_calls`` is
    left out when there are none, ``reasoning_content`` (the thinking block, with ``--reasoning-parser``)
    when the reply has none."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall | CustomToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler: Any) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for key in ("tool_calls", "reasoning_content"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class ChatChoice(BaseModel):
    """One choice of a chat response."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    """A complete chat response."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    dflash2: SpecDecodeInfo


class DeltaFunctionCall(BaseModel):
    """A fragment of a streamed function call: the name comes once, arguments in pieces."""

    name: str | None = None
    arguments: str = ""

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaCustomCall(BaseModel):
    """A fragment of a streamed custom tool call: the name comes once, the input in pieces."""

    name: str | None = None
    input: str = ""

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    """A streamed tool-call delta, matched to its call by ``index`` (``id`` and ``type`` on the first one);
    ``function`` for a function call, ``custom`` for a custom tool call."""

    index: int
    id: str | None = None
    type: Literal["function", "custom"] | None = None
    function: DeltaFunctionCall | None = None
    custom: DeltaCustomCall | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaMessage(BaseModel):
    """A streamed message delta; unset parts are left out (``{}`` on the finish chunk)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class _Chunk(BaseModel):
    """Stream chunks leave out ``usage`` and ``dflash2`` except on the chunks that carry them."""

    @model_serializer(mode="wrap")
    def _drop_empty_extras(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for key in ("usage", "dflash2"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class ChatStreamChoice(BaseModel):
    """One choice of a chat stream chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(_Chunk):
    """One SSE chunk of a streamed chat response."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    dflash2: SpecDecodeInfo | None = None


class CompletionChoice(BaseModel):
    """One choice of a text completion (also used in stream chunks)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionResponse(BaseModel):
    """A complete text completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    dflash2: SpecDecodeInfo


class CompletionChunk(_Chunk):
    """One SSE chunk of a streamed text completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    dflash2: SpecDecodeInfo | None = None


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models``."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dflash2"
    max_model_len: int
    quantization: str = Field(
        "none",
        description="how the linear weights are held: none, int8, int4, or a GGUF file's own types (gguf:Q4_1+Q8_0)",
    )


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    """``POST /tokenize``."""

    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    """``POST /detokenize``."""

    prompt: str


class VersionResponse(BaseModel):
    """``GET /version``."""

    version: str


class HealthResponse(BaseModel):
    """``GET /health`` and ``GET /health/ready``."""

    status: str
