"""Reasoning models: the thinking block split out of the reply, and grammars that begin after it.

A reasoning model writes ``<think> … </think>`` before its answer. With ``--reasoning-parser NAME`` (vLLM's
names) the server:

- reads the thinking text into ``message.reasoning_content`` (``delta.reasoning_content`` when streaming) and
  Responses ``reasoning`` output items, and parses content and tool calls from what follows the block only;
- starts a request's grammar (tools, ``response_format``) at the end of the block: the grammar the engine
  enforces becomes *thinking block, then the request's grammar*, so the model thinks freely and its answer is
  still constrained — a JSON grammar that began at the first token would forbid the thinking block;
- keeps speculation lossless through the block: the wrapped grammar is one llguidance grammar, masked along
  the drafts like any other, and its budget rule closes the block (``</think>``) and then the answer within
  ``max_tokens`` (``GrammarBackend.closing_path``).

Where the output starts is read from the rendered prompt (``ReasoningParser.start_state``): a template that
opens the block itself (DeepSeek-R1, Qwen3's thinking releases) ends the prompt inside it; one that closes it
(``enable_thinking: false``) ends the prompt after it, and then the reply is all content and the grammar starts
at once; otherwise the parser's default decides (``deepseek_r1``: inside; ``qwen3``: the block is optional and
opens with ``<think>``).

The block's tags must be single tokens of the loaded tokenizer (as in every model of these families: their
tokenizers encode the tag text as that token, and the models write it so). The wrapped grammar ends the block
on the end token only; the split reads decoded text, so a model that spelled ``</think>`` in pieces would end
the block for the split but not for the grammar — these models do not, and the grammar does not pay for
excluding it (see ``wrap_grammar``).

Peers: vLLM's and SGLang's ``--reasoning-parser`` (``deepseek_r1``, ``qwen3``) and ``reasoning_content``;
llama.cpp's ``--reasoning-format``; grammars after the thinking block: sgl-project/sglang issue 14821.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from dflash2.grammar import lark_grammar


class StartState(enum.Enum):
    """Where a reply starts relative to the thinking block."""

    INSIDE = "inside"  # the prompt opened the block: the reply thinks first
    OPTIONAL = "optional"  # the reply may open a block with the start tag, or answer at once
    AFTER = "after"  # the prompt closed the block (thinking disabled): the reply is all content


@dataclass(frozen=True)
class ReasoningParser:
    """A thinking-block format.

    Attributes:
        name: the ``--reasoning-parser`` name.
        start, end: the block's tags.
        implicit_start: a reply whose prompt neither opened nor closed a block starts inside one (DeepSeek-R1
            writes its thinking without the start tag); otherwise the block is optional.
    """

    name: str
    start: str = "<think>"
    end: str = "</think>"
    implicit_start: bool = False

    def start_state(
        self, prompt_ids: list[int], start_id: int, end_id: int, whitespace_ids: frozenset[int]
    ) -> StartState:
        """Where the reply to this prompt starts.

        Args:
            prompt_ids: the rendered prompt's token ids.
            start_id, end_id: the tags' token ids.
            whitespace_ids: token ids that decode to whitespace only (skipped at the prompt's end).
        """
        last_start = _last_index(prompt_ids, start_id)
        last_end = _last_index(prompt_ids, end_id)
        if last_start > last_end:
            return StartState.INSIDE
        tail = len(prompt_ids)
        while tail > 0 and prompt_ids[tail - 1] in whitespace_ids:
            tail -= 1
        if last_end >= 0 and last_end == tail - 1:
            return StartState.AFTER
        return StartState.INSIDE if self.implicit_start else StartState.OPTIONAL

    def split(self, text: str, state: StartState) -> tuple[str | None, str]:
        """The reasoning and the content of a whole reply.

        Returns:
            ``(reasoning, content)``: reasoning is None when the reply has no thinking block; a block that
            ``max_tokens`` cut before its end is all reasoning (content ``""``).
        """
        splitter = ReasoningSplitter(self, state)
        reasoning, content = splitter.feed(text)
        more_reasoning, more_content = splitter.finish()
        return (reasoning + more_reasoning if splitter.had_block else None), content + more_content

    def wrap_grammar(self, grammar: str | None, state: StartState, start_id: int, end_id: int) -> str | None:
        """The grammar the engine enforces for a request whose own grammar is ``grammar``.

        ``INSIDE``: free thinking text, the end token, at most two newlines, then ``grammar``. ``OPTIONAL``: the
        same block opened by the start tag, or nothing, before ``grammar``. ``AFTER`` or no grammar: unchanged.
        The block ends with the end *token*; its text is unconstrained (free text masks in microseconds, where
        a regex that also excluded the tag spelled in pieces costs about 1 ms per position on a 49k vocabulary).

        Args:
            grammar: an llguidance grammar (the JSON or Lark text that ``dflash2.grammar`` builds), or None.
            state: where the reply starts.
            start_id, end_id: the tags' token ids.

        Returns:
            The wrapped llguidance grammar (the request's grammar is a named sub-grammar of it), or ``grammar``.
        """
        if grammar is None or state is StartState.AFTER:
            return grammar
        block = f"THINK <[{end_id}]> BREAK"
        if state is StartState.OPTIONAL:
            block = f"(<[{start_id}]> {block})?"
        lark = f"start: {block} @{_BODY}\nTHINK: /(?s:.*)/\nBREAK: /\\n{{0,2}}/\n"
        return lark_grammar(lark, {_BODY: grammar})


_BODY = "answer"


def _last_index(ids: list[int], token: int) -> int:
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    return -1


class ReasoningSplitter:
    """One reply's text, split into reasoning and content as it streams.

    Text that may still become a tag (a prefix of ``<think>`` at the reply's start, of ``</think>`` inside the
    block) is held back until it is decided, so a client never sees half a tag as text.
    """

    def __init__(self, parser: ReasoningParser, state: StartState) -> None:
        self.parser = parser
        self._inside = state is StartState.INSIDE
        self._may_open = state is StartState.OPTIONAL
        self.had_block = self._inside
        self._held = ""
        self._after_tag = False

    def feed(self, delta: str) -> tuple[str, str]:
        """The reasoning and content deltas that ``delta`` completes (either may be ``""``)."""
        text = self._held + delta
        self._held = ""
        if self._after_tag:  # the newlines that follow a tag belong to neither part
            text = text.lstrip("\n")
            if not text:
                return "", ""
            self._after_tag = False
        if self._may_open:
            stripped = text.lstrip()
            if stripped.startswith(self.parser.start):
                self._may_open, self._inside, self.had_block = False, True, True
                self._after_tag = True
                return self.feed(stripped[len(self.parser.start) :])
            if self.parser.start.startswith(stripped):  # still undecided (empty, or part of the tag)
                self._held = text
                return "", ""
            self._may_open = False
        if not self._inside:
            return "", text
        end = text.find(self.parser.end)
        if end < 0:
            keep = _partial_suffix(text, self.parser.end)
            self._held = text[len(text) - keep :] if keep else ""
            return text[: len(text) - keep], ""
        self._inside, self._after_tag = False, True
        reasoning = text[:end]
        _, content = self.feed(text[end + len(self.parser.end) :])
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held back, once the reply ended."""
        held, self._held = self._held, ""
        if self._inside:
            return held, ""
        return "", held


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


REASONING_PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", implicit_start=True),
    "qwen3": ReasoningParser("qwen3"),
}


@dataclass(frozen=True)
class Reasoning:
    """A reasoning parser bound to the loaded tokenizer (built once at start-up).

    Raises:
        ValueError: the tokenizer lacks the parser's tags as single tokens.
    """

    parser: ReasoningParser
    start_id: int
    end_id: int
    whitespace_ids: frozenset[int]

    @classmethod
    def for_tokenizer(cls, name: str, tokenizer: Any) -> Reasoning:
        """Bind the parser called ``name`` to ``tokenizer``.

        Raises:
            ValueError: an unknown name, no tokenizer, or tags that are not single tokens of it.
        """
        parser = get_reasoning_parser(name)
        if tokenizer is None:
            raise ValueError(f"--reasoning-parser {name} needs the model's tokenizer")
        ids = []
        for tag in (parser.start, parser.end):
            encoded = tokenizer.encode(tag, add_special_tokens=False)
            if len(encoded) != 1:
                raise ValueError(
                    f"--reasoning-parser {name}: {tag!r} is not one token of this model's tokenizer "
                    f"(it encodes to {len(encoded)}); this model does not write {parser.start}…{parser.end} blocks"
                )
            if int(encoded[0]) in set(getattr(tokenizer, "all_special_ids", ())):
                raise ValueError(
                    f"--reasoning-parser {name}: {tag!r} is a special token of this tokenizer, left out of decoded "
                    "text, so the thinking block could not be read back"
                )
            ids.append(int(encoded[0]))
        whitespace = frozenset(
            int(t) for text in ("\n", "\n\n", " ", "  ") for t in tokenizer.encode(text, add_special_tokens=False)
        )
        return cls(parser, ids[0], ids[1], whitespace)

    def start_state(self, prompt_ids: list[int]) -> StartState:
        """Where the reply to ``prompt_ids`` starts (``ReasoningParser.start_state``)."""
        return self.parser.start_state(prompt_ids, self.start_id, self.end_id, self.whitespace_ids)

    def wrap_grammar(self, grammar: str | None, state: StartState) -> str | None:
        """``ReasoningParser.wrap_grammar`` with this tokenizer's end token."""
        return self.parser.wrap_grammar(grammar, state, self.start_id, self.end_id)


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser called ``name``; ValueError naming the known ones."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}") from None
