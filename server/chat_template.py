"""``ChatTemplate``: chat messages (with tools and earlier tool calls) → prompt token ids through the model's chat
template, and the 400 messages for a template that fails on a request."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jinja2.exceptions

from server.errors import InvalidRequestError
from server.model_info import ModelInfo
from server.protocol import ChatMessage
from server.tool_calling import ToolPlan, render_tool_history, with_tool_prompt
from server.tool_parsers import ToolParser

logger = logging.getLogger(__name__)

# Longest template-written message passed on to the client.
MAX_TEMPLATE_MESSAGE = 300


class ChatTemplate:
    """The loaded model's chat template, rendered and tokenized (on the caller's thread: the serving layer
    calls it on its tokenizer thread, so templates and long prompts never block the event loop)."""

    def __init__(self, model: ModelInfo, tool_parser: ToolParser) -> None:
        self.model = model
        self.tool_parser = tool_parser
        source = getattr(model.tokenizer, "chat_template", None)
        self.variables = template_variables(source)
        # Templates that never mention tool_calls get earlier calls as text in the parser's format.
        self.renders_tool_calls = "tool_calls" in str(source or "")

    def prompt_ids(
        self,
        messages: Sequence[ChatMessage],
        template_kwargs: dict[str, Any] | None,
        add_generation_prompt: bool = True,
        plan: ToolPlan | None = None,
    ) -> list[int]:
        """Apply the model's chat template and tokenize. Tools go to the template's ``tools`` variable when it
        reads one, else into the system message (the tool parser's prompt); earlier tool calls are rendered as
        text when the template ignores them.

        Args:
            messages: the request's messages.
            template_kwargs: ``chat_template_kwargs`` (only variables the template reads).
            add_generation_prompt: end with the assistant's turn opening.
            plan: the request's tools, if any.

        Returns:
            The prompt's token ids.

        Raises:
            InvalidRequestError: no tokenizer or no chat template, a variable the template does not read, or a
                template that fails on these messages.
        """
        tokenizer = self.model.require_tokenizer("messages")
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError("this model has no chat template; use /v1/completions", "messages")
        self._check_kwargs(template_kwargs)
        rendered = [m.to_template() for m in messages]
        if not self.renders_tool_calls:
            rendered = render_tool_history(rendered, self.tool_parser)
        extra: dict[str, Any] = {}
        if plan is not None and plan.tools:
            if "tools" in self.variables:
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

    def _check_kwargs(self, template_kwargs: dict[str, Any] | None) -> None:
        unread = sorted(set(template_kwargs or {}) - self.variables)
        if unread:
            reads = ", ".join(sorted(self.variables - {"messages", "add_generation_prompt"})) or "none"
            raise InvalidRequestError(
                f"chat_template_kwargs: this model's chat template does not read {', '.join(unread)} "
                f"(the variables it reads: {reads})",
                "chat_template_kwargs",
            )


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
