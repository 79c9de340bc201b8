"""Responses → chat: a ``ResponsesRequest`` as the ``ChatCompletionRequest`` that serves it, and chat field names
back as the Responses fields they came from (so errors from the chat checks name ``input[2]``, ``text.format``…).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from server.errors import APIError, InvalidRequestError, describe_validation_error
from server.protocol import ChatCompletionRequest

if TYPE_CHECKING:
    from server.responses.protocol import ResponsesRequest, TextFormat

_MESSAGE_PARAM = re.compile(r"^messages\[(\d+)\]")
_TOOL_PARAM = re.compile(r"^tools\[(\d+)\]")
_PARAM_RENAMES = (
    (re.compile(r"^max_(completion_)?tokens$"), "max_output_tokens"),
    (re.compile(r"^response_format\.json_schema(?=\.|$)"), "text.format"),
    (re.compile(r"^response_format(?=\.|$)"), "text.format"),
    (re.compile(r"^(tools\[\d+\])\.(function|custom)(?=\.|$)"), r"\1"),
    (re.compile(r"^messages$"), "input"),
)


@dataclass(frozen=True)
class ChatConversion:
    """A Responses request as a chat request; ``sources[k]`` is the Responses field that gave ``messages[k]``, and
    ``tool_indices[k]`` the index in the Responses ``tools`` of chat's ``tools[k]`` (hosted tools are left out)."""

    request: ChatCompletionRequest
    sources: list[str]
    tool_indices: list[int] | None = None

    def param(self, chat_param: str | None) -> str | None:
        """The Responses field for a field of ``request`` (see ``responses_param``)."""
        return responses_param(chat_param, self.sources, self.tool_indices)

    def rename(self, exc: APIError) -> None:
        """Make an error of the chat path name the Responses field: its ``param``, and its message when the
        message starts with the chat field's name."""
        chat_param, exc.param = exc.param, self.param(exc.param)
        if chat_param and exc.param and exc.message.startswith(chat_param):
            exc.message = exc.param + exc.message[len(chat_param) :]
            exc.args = (exc.message,)


def chat_conversion(request: ResponsesRequest) -> ChatConversion:
    """The equivalent chat completions request, and where each of its messages came from.

    ``instructions`` become a system message first; consecutive ``function_call`` and ``custom_tool_call`` items
    join one assistant message (the one right before them, if it is an assistant message); their outputs become
    ``tool`` messages; reasoning items are dropped. Hosted tools are left out (``ResponsesRequest.check`` logged
    them, and errors name the Responses tool's own index).

    Args:
        request: a validated Responses request.

    Returns:
        The chat request (validated) and the Responses field of each of its messages.

    Raises:
        InvalidRequestError: no message at all, or the chat request does not validate (naming the Responses
            field where it can).
    """
    messages, sources = chat_messages(request)
    tool_indices = [i for i, tool in enumerate(request.tools or ()) if tool.type in ("function", "custom")]
    if not messages:
        raise InvalidRequestError("input must contain at least one message (or give instructions)", "input")
    choice = request.tool_choice
    body: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "stream": request.stream,
        "user": request.user,
        "tools": [_chat_tool(request.tools[i]) for i in tool_indices] or None if request.tools else None,
        "tool_choice": (
            {"type": choice.type, choice.type: {"name": choice.name}}
            if choice is not None and not isinstance(choice, str)
            else choice
        ),
        "parallel_tool_calls": request.parallel_tool_calls,
        "response_format": _response_format(request.text.format if request.text else None),
    }
    try:
        chat = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:  # a safety net: the fields above are validated already
        message, param = describe_validation_error(exc.errors())
        raise InvalidRequestError(message, responses_param(param, sources, tool_indices)) from exc
    return ChatConversion(chat, sources, tool_indices)


def chat_messages(request: ResponsesRequest) -> tuple[list[dict[str, Any]], list[str]]:
    """``instructions`` and ``input`` as chat messages, with the Responses field of each (see
    ``chat_conversion``)."""
    messages: list[dict[str, Any]] = []
    sources: list[str] = []
    if request.instructions is not None:
        messages.append({"role": "system", "content": request.instructions})
        sources.append("instructions")
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
        sources.append("input")
        return messages, sources
    thinking: str | None = None  # a reasoning item's text, for the assistant turn that follows it
    for i, item in enumerate(request.input):
        if item.type == "reasoning":
            thinking = item.text if thinking is None else thinking + item.text
            continue
        if item.type == "message":
            messages.append({"role": item.role, "content": item.text})
        elif item.type in ("function_call", "custom_tool_call"):
            call = (
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
                if item.type == "function_call"
                else {"id": item.call_id, "type": "custom", "custom": {"name": item.name, "input": item.input}}
            )
            if messages and messages[-1]["role"] == "assistant" and thinking is None:
                messages[-1].setdefault("tool_calls", []).append(call)
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif item.type in ("function_call_output", "custom_tool_call_output"):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
        if thinking is not None and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"], thinking = thinking, None
        sources.append(f"input[{i}]")
    return messages, sources


def responses_param(
    chat_param: str | None, sources: Sequence[str], tool_indices: Sequence[int] | None = None
) -> str | None:
    """The Responses field for a chat field: ``messages[k]…`` → ``sources[k]`` (``input[2]``, ``instructions``),
    ``response_format.json_schema.schema`` → ``text.format.schema``, ``tools[0].function.parameters`` →
    ``tools[0].parameters`` (``tools[k]`` → ``tools[tool_indices[k]]`` when given), ``max_tokens`` →
    ``max_output_tokens``; other names are the same in both."""
    if chat_param is None:
        return None
    tool = _TOOL_PARAM.match(chat_param)
    if tool and tool_indices is not None and int(tool.group(1)) < len(tool_indices):
        chat_param = f"tools[{tool_indices[int(tool.group(1))]}]{chat_param[tool.end() :]}"
    message = _MESSAGE_PARAM.match(chat_param)
    if message:
        index = int(message.group(1))
        return sources[index] if index < len(sources) else "input"
    for pattern, replacement in _PARAM_RENAMES:
        chat_param = pattern.sub(replacement, chat_param)
    return chat_param


def _chat_tool(tool: Any) -> dict[str, Any]:
    """A Responses function or custom tool as a chat ``tools`` entry."""
    if tool.type == "function":
        return {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
    custom = {"name": tool.name, "description": tool.description, "format": tool.chat_format()}
    return {"type": "custom", "custom": {k: v for k, v in custom.items() if v is not None}}


def _response_format(text_format: TextFormat | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    if text_format is None:
        return None
    if text_format.type != "json_schema":
        return {"type": text_format.type}
    schema = text_format.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)
    return {"type": "json_schema", "json_schema": schema}
