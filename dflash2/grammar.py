"""Structured outputs: grammar-constrained decoding with llguidance, lossless under speculation.

A request with ``SamplingParams.grammar`` (an llguidance grammar: Lark text, or the JSON form that
``llguidance.LLMatcher.grammar_from_*`` returns) gets one ``LLMatcher``. The engine masks the
*target's* logits at every position it samples from:

- prefill: the mask of the matcher's current state for the first token;
- verify: the masks along the drafted path (position 0 at the current state, position j after the
  first j drafts), computed in one llguidance call that advances a copy of the state through the
  legal drafts and restores it. Positions after the first illegal draft keep an all-allowed mask:
  that draft has masked probability 0, so it is rejected and no later position is ever sampled.

Rejection sampling then runs on the masked distribution p′ with the drafter's q unchanged: a
forbidden draft has p′ = 0 and is rejected, the residual max(0, p′ − q) holds only legal tokens and
the bonus token comes from p′, so the output is distributed exactly as masked target-only decoding
(the argument of docs/dflash2-spec.md §5.2 with p′ for p). The matcher itself advances only by committed
tokens; a rejected draft never touches it, so nothing needs rolling back.

**Budget.** A grammar also has to *finish* within ``max_tokens``. At every masked position the backend
knows the tokens left r (this one included). From the matcher's state it walks a *closing path*: the
bytes the grammar forces, else the first allowed of ``"`` ``}`` ``]`` ``)`` ``>`` ``0`` ``\\n`` and then any
printable byte, until the grammar accepts (``closing_bytes``; about 0.1 ms; a walk that picks the same byte
32 times running is in free text and finds no path); when that walk finds no end (an unbounded run of
digits), a second one tries punctuation before digits and letters. Where the grammar forces nothing and a
special token is allowed after which a walk succeeds, the path starts with that token (``closing_path``):
the end of a reasoning model's thinking block, whose free text the byte walks alone never leave. D, what
the grammar needs to finish, is the token count of that path. While r > D + ``BUDGET_RESERVE`` nothing
changes; from then on only tokens that follow the path are allowed, and only those after which the rest of the path fits
in r − 1 tokens (where the grammar may already end, nothing is restricted: free text may go on). The
walk is a function of the state, so the rest of the path after such a token is the walk from the
state it leads to: the output closes within the budget and parses, however it ends. The reserve
leaves room for a free token that raises D (opening an object whose keys are required); a single
token that raises it by more than the reserve right at the edge is the one case that can still end
unclosed (as does a ``max_tokens`` below the shortest valid output). The mask is a function of the state
and of r, both the same for a drafted position and for target-only decoding, so speculation stays
lossless with respect to this masked distribution. A request whose output was closed this way
finishes with ``length`` (``Engine._advance_grammar``): the budget, not the model, ended it.

Peers: vLLM's structured outputs with speculative decoding (``grammar_bitmask`` along the drafts),
SGLang's ``generate_token_bitmask``; llguidance: https://github.com/guidance-ai/llguidance.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

# JSON is written the way json.dumps writes it, with no free whitespace: small models otherwise
# loop on spaces and newlines inside an object that the grammar cannot end for them.
JSON_FORMAT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}

# Tokens the budget rule keeps in hand beyond what the closing path needs (see the module docstring).
BUDGET_RESERVE = 3
# The longest closing path walked (bytes); a grammar that needs more is not budgeted.
MAX_CLOSING_BYTES = 256
# A walk that chose the same byte this many times running is in free text it would only extend.
MAX_REPEATED_CLOSER = 32
# Bytes the closing walk tries first, in order, when the grammar forces none.
# A newline comes before the printable bytes: it ends a line of a raw-text grammar (a Lark custom tool's input,
# followed by "\n</tool_call>") where printable bytes may go on forever.
_CLOSERS = tuple(b'"}])>0\n') + tuple(range(32, 127))
# The second walk's order, when the first finds no path: punctuation before digits and letters, so an unbounded
# repetition of digits or letters (a regex tool's ``[0-9]+\+[0-9]+``) is left by the next delimiter it allows.
_PUNCTUATION_FIRST = (
    tuple(b'"}])>\n')
    + tuple(b for b in range(32, 127) if not chr(b).isalnum())
    + tuple(b for b in range(32, 127) if chr(b).isalnum())
)


# Keys whose values are data, not subschemas (close_objects leaves them alone).
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example", "x-guidance"})


def close_objects(schema: Any) -> Any:
    """A copy of a JSON schema in which objects with ``properties`` allow no other keys unless the schema
    says otherwise (``additionalProperties``, ``patternProperties`` or ``unevaluatedProperties``).

    The same default as xgrammar's strict mode and OpenAI's strict schemas: without it the grammar
    lets a model invent keys forever (a small model copies the schema itself into the arguments).
    """
    if isinstance(schema, list):
        return [close_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: value if key in _DATA_KEYWORDS else close_objects(value) for key, value in schema.items()}
    if "properties" in closed and not {"additionalProperties", "patternProperties", "unevaluatedProperties"} & set(
        closed
    ):
        closed["additionalProperties"] = False
    return closed


class GrammarError(ValueError):
    """A grammar (or JSON schema) the engine cannot compile; the message says why."""


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The llguidance grammar of JSON text valid for ``schema`` (JSON Schema, draft 2020-12 subset), with
    undeclared keys closed off (``close_objects``).

    Raises:
        GrammarError: ``schema`` is not a JSON object.
    """
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(close_objects(schema)), overrides=JSON_FORMAT)  # type: ignore[arg-type]
    except ValueError as exc:
        raise GrammarError(str(exc)) from exc


def json_object_grammar() -> str:
    """The grammar of any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
    return json_schema_grammar({"type": "object"})


def lark_grammar(lark: str, subgrammars: dict[str, str] | None = None) -> str:
    """An llguidance grammar from Lark text (``%json {…}`` inlines a JSON schema); ``subgrammars`` are more
    grammars by name (Lark text, or any grammar this module builds), each referenced as ``@name`` in ``lark`` and
    lexed on its own (its ``%ignore`` and terminals stay inside it)."""
    import llguidance

    if not subgrammars:
        return llguidance.LLMatcher.grammar_from_lark(lark)
    grammars: list[dict[str, Any]] = [{"lark_grammar": lark}]
    for name, grammar in subgrammars.items():
        first, *rest = _grammar_list(grammar)
        grammars += [{**first, "name": name}, *rest]
    return json.dumps({"grammars": grammars})


def _grammar_list(grammar: str) -> list[dict[str, Any]]:
    """The ``grammars`` list of an llguidance grammar: its JSON form's, or one entry for Lark text (what
    ``grammar_from_lark`` returns)."""
    try:
        parsed = json.loads(grammar)
    except ValueError:
        return [{"lark_grammar": grammar}]
    return list(parsed["grammars"])


class GrammarBackend:
    """Compiles grammars for one tokenizer and vocabulary and computes token masks.

    The llguidance tokenizer is built on first use (about 0.3 s for a 49k vocabulary). Thread-safe:
    the server checks grammars on its tokenizer thread while the engine thread masks.

    Args:
        tokenizer: a Hugging Face fast tokenizer.
        vocab_size: V, the model's logit width (may exceed the tokenizer's vocabulary; the extra
            ids are never allowed).
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self._byte_tokens: dict[int, int] | None = None  # byte → its single-byte token
        self._by_bytes: dict[bytes, list[int]] | None = None  # a token's bytes → the tokens with those bytes
        self._longest: int | None = None  # the most bytes a token spells
        self._specials: torch.Tensor | None = None  # the special tokens (a closing path may start with one)

    @property
    def llg_tokenizer(self) -> Any:
        """The ``llguidance.LLTokenizer`` (built once)."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size)
            return self._tokenizer

    def check(self, grammar: str) -> None:
        """Raises GrammarError (with llguidance's reason) unless ``grammar`` compiles for this tokenizer."""
        import llguidance

        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.llg_tokenizer)
        if is_error:
            raise GrammarError(messages[0] if messages else "invalid grammar")

    def matcher(self, grammar: str) -> Any:
        """A fresh ``LLMatcher`` at the start of ``grammar``.

        Raises:
            GrammarError: the grammar does not compile.
        """
        import llguidance

        self.check(grammar)
        matcher = llguidance.LLMatcher(self.llg_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher

    def masks(
        self,
        matchers: Sequence[Any | None],
        drafts: Sequence[Sequence[int]],
        num_positions: int,
        budgets: Sequence[int] | None = None,
        closing: list[int | None] | None = None,
    ) -> torch.Tensor:
        """Allowed-token masks for a batch of blocks.

        Args:
            matchers: one ``LLMatcher`` (or None: unconstrained) per row, at the row's committed state.
            drafts: per row, the drafted tokens after the anchor (position j's mask is the state after
                ``drafts[r][:j]``); at most ``num_positions − 1`` each.
            num_positions: L, positions per row.
            budgets: per row, the tokens it may still emit counting position 0's (``max_tokens`` left);
                None: no budget rule.
            closing: filled, when given, with each row's first position whose mask the budget rule
                restricted (None where it restricted none).

        Returns:
            ``[R, L, V]`` bool, True where a token is allowed. Unconstrained rows, and positions after a
            row's first illegal draft, allow everything.
        """
        num_rows = len(matchers)
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((num_rows * num_positions, words), -1, dtype=torch.int32)
        row_bytes = words * bitmask.element_size()
        if closing is not None:
            closing[:] = [None] * num_rows
        for r, matcher in enumerate(matchers):
            if matcher is None:
                continue
            # On the calling thread: llguidance's worker-thread executor competes with the OpenMP
            # threads the target forward leaves spinning (3.6 vs 2.0 ms a step at batch 4, 2 cores).
            consumed = 0
            for j in range(num_positions):
                row = bitmask[r * num_positions + j]
                matcher.unsafe_compute_mask_ptr(row.data_ptr(), row_bytes)
                restricted = budgets is not None and self._budget_mask(matcher, row, budgets[r] - j)
                if restricted and closing is not None and closing[r] is None:
                    closing[r] = j
                if j == len(drafts[r]) or j == num_positions - 1:
                    break
                token = int(drafts[r][j])
                word = int(row[token // 32]) if token < self.vocab_size else 0
                if not (word >> (token % 32)) & 1 or not matcher.consume_token(token):
                    break  # an illegal draft: it will be rejected, later positions are never sampled
                consumed += 1
            if consumed:
                matcher.rollback(consumed)
        return unpack_bitmask(bitmask, self.vocab_size).view(num_rows, num_positions, self.vocab_size)

    def _budget_mask(self, matcher: Any, row: torch.Tensor, left: int) -> bool:
        """Restrict one position's mask ``row`` (the matcher's state; ``left`` tokens left, this one
        included) to tokens that close the grammar in time, once the budget is that close; True when it did."""
        if left > MAX_CLOSING_BYTES + BUDGET_RESERVE:  # no closing path is that long: nothing to check
            return False
        specials = self._special_tokens()
        if specials.numel():  # only the special tokens this position's mask allows can lead the path
            specials = specials[((row[specials // 32] >> (specials % 32)) & 1).bool()]
        found = self.closing_path(matcher, specials.tolist())
        if found is None:  # no path found
            return False
        lead, path = found
        if not lead and not path:  # the grammar may end here (free text may go on)
            return False
        tokenizer = self.llg_tokenizer
        if left > len(lead) + len(tokenizer.tokenize_bytes(path)) + BUDGET_RESERVE:
            return False
        if lead:  # the path starts with a special token (a thinking block's end): nothing else closes in time
            keep = lead[:1]
        else:
            by_bytes = self._tokens_by_bytes()
            # Only the path's prefixes that are tokens (a handful: tokens are short) need the rest tokenized.
            prefixes = [
                (k, ids) for k in range(1, min(len(path), self._longest_token()) + 1) if (ids := by_bytes.get(path[:k]))
            ]
            keep = [t for k, ids in prefixes if len(tokenizer.tokenize_bytes(path[k:])) <= left - 1 for t in ids]
            if not keep:  # too late to fit: close as fast as the path goes
                keep = [t for _, ids in prefixes for t in ids]
        allowed = unpack_bitmask(row[None], self.vocab_size)[0]
        keep_mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        keep_mask[[t for t in keep if t < self.vocab_size]] = True
        if not bool((allowed & keep_mask).any()):
            return False
        row.copy_(pack_bitmask(allowed & keep_mask))
        return True

    def closing_path(self, matcher: Any, specials: Sequence[int] | None = None) -> tuple[list[int], bytes] | None:
        """The closing path from the matcher's state: ``(lead, path)``, at most one special token ``lead``
        followed by the bytes of ``closing_bytes`` from the state after it, or None when none is found.

        A special token leads the path only where the grammar forces no bytes and allows that token, and
        the walk after it succeeds: the end token of a thinking block (``server/reasoning.py``) is the only
        way out of the block's free text, which the byte walk alone would extend forever. ``specials``: the
        candidates to try (the masking path passes those its mask allows); None = every special token but
        EOS. The matcher is left where it was.
        """
        candidates = self._special_tokens().tolist() if specials is None else specials
        if candidates and not matcher.is_accepting() and not matcher.compute_ff_bytes():
            for token in candidates:
                if matcher.try_consume_tokens([token]) != 1:
                    continue
                try:
                    after = self.closing_bytes(matcher)
                finally:
                    matcher.rollback(1)
                if after is not None:
                    return [token], after
        path = self.closing_bytes(matcher)
        return None if path is None else ([], path)

    def closing_bytes(self, matcher: Any) -> bytes | None:
        """The closing path from the matcher's state (bytes; see the module docstring), or None when the
        walks find none within ``MAX_CLOSING_BYTES`` (trying ``_CLOSERS`` first, then ``_PUNCTUATION_FIRST``;
        a walk that chose the same byte ``MAX_REPEATED_CLOSER`` times running is in free text it would only
        extend, and gives up). The matcher is left where it was."""
        path = self._walk(matcher, _CLOSERS)
        return path if path is not None else self._walk(matcher, _PUNCTUATION_FIRST)

    def _walk(self, matcher: Any, order: tuple[int, ...]) -> bytes | None:
        byte_tokens = self._single_byte_tokens()
        path = bytearray()
        consumed = 0
        repeated = 0  # the last chosen byte's run
        try:
            while not matcher.is_accepting():
                if len(path) >= MAX_CLOSING_BYTES or matcher.is_error():
                    return None
                forced = matcher.compute_ff_bytes()
                if forced:
                    for byte in forced[: MAX_CLOSING_BYTES - len(path)]:
                        token = byte_tokens.get(byte)
                        if token is None or not matcher.consume_token(token):
                            return None
                        path.append(byte)
                        consumed += 1
                    continue
                for byte in order:
                    token = byte_tokens.get(byte)
                    if token is not None and matcher.try_consume_tokens([token]) == 1:
                        consumed += 1
                        repeated = repeated + 1 if path and path[-1] == byte else 1
                        if repeated > MAX_REPEATED_CLOSER:
                            return None
                        path.append(byte)
                        break
                else:
                    return None
            return bytes(path)
        finally:
            if consumed:
                matcher.rollback(consumed)

    def _single_byte_tokens(self) -> dict[int, int]:
        if self._byte_tokens is None:
            tokenizer = self.llg_tokenizer
            singles = {b: tokenizer.tokenize_bytes(bytes([b])) for b in range(256)}
            self._byte_tokens = {b: ids[0] for b, ids in singles.items() if len(ids) == 1}
        return self._byte_tokens

    def _special_tokens(self) -> torch.Tensor:
        """``[S]`` int64: the special token ids but EOS (built once)."""
        if self._specials is None:
            tokenizer = self.llg_tokenizer
            eos = set(tokenizer.eos_tokens)
            ids = [
                t
                for t in range(min(self.vocab_size, tokenizer.vocab_size))
                if tokenizer.is_special_token(t) and t not in eos
            ]
            self._specials = torch.tensor(ids, dtype=torch.int64)
        return self._specials

    def _longest_token(self) -> int:
        """The most bytes any token spells (computed once)."""
        if self._longest is None:
            self._longest = max(map(len, self._tokens_by_bytes()), default=0)
        return self._longest

    def _tokens_by_bytes(self) -> dict[bytes, list[int]]:
        if self._by_bytes is None:
            tokenizer = self.llg_tokenizer
            by_bytes: dict[bytes, list[int]] = {}
            for token in range(min(self.vocab_size, tokenizer.vocab_size)):
                if not tokenizer.is_special_token(token):
                    by_bytes.setdefault(tokenizer.decode_bytes([token]), []).append(token)
            self._by_bytes = by_bytes
        return self._by_bytes


@dataclass
class WalkedDrafts:
    """One row's drafts after the grammar walk (:func:`walk_drafts`).

    Attributes:
        token_ids: the drafts, in order.
        forced: per draft, True where the grammar forced it (the state admitted exactly this
            continuation; llguidance's canonical tokenization of the forced bytes).
        replaced: per draft, True where the token is not the proposal's own draft at that position
            (forced, or a greedy row's best allowed candidate); its proposal distribution is then
            one-hot on the token.
    """

    token_ids: list[int]
    forced: list[bool]
    replaced: list[bool]


def walk_drafts(
    matcher: Any,
    drafts: Sequence[int],
    candidates: Sequence[Sequence[int]] | None,
    limit: int,
    greedy: bool,
) -> WalkedDrafts:
    """A row's drafts with the tokens its grammar forces filled in: grammar-forced drafts.

    From the matcher's committed state, position by position up to ``limit`` drafts: where the grammar
    forces a continuation (``LLMatcher.compute_ff_tokens``), its tokens are the drafts; elsewhere the
    proposal's draft at that position (the drafter's, prompt lookup's or an earlier output's). A greedy
    row whose proposed draft the grammar forbids takes its best allowed candidate at that position
    instead (any draft is lossless for a greedy row); a sampled row keeps it (it is rejected, and the
    residual sample keeps the output exact) and the walk ends there. The walk also ends where the
    grammar forces nothing and the proposal has no draft.

    Lossless: whether a position is forced depends only on the drafts before it, which are the accepted
    tokens whenever that position is verified; a forced draft is a deterministic proposal (one-hot), and a
    kept draft keeps the proposal's own distribution. Where the forced bytes have several tokenizations
    the canonical one is just a draft: rejection sampling accepts it with the target's masked probability.
    Peers: SGLang's jump-forward decoding (forced strings skipped); ToolSpec (arXiv 2604.13519) verifies
    schema-forced tokens as drafts.

    Args:
        matcher: the row's ``LLMatcher`` at its committed state (left there: the walk rolls back).
        drafts: the proposal's drafts, position by position (may be shorter than ``limit``).
        candidates: per proposed position, the proposal's candidates best first (a greedy row's
            alternatives); None: none.
        limit: the most drafts (the row's verify budget, ≤ B − 1).
        greedy: the row decodes greedily.

    Returns:
        The walked drafts (at most ``limit``).
    """
    walked = WalkedDrafts([], [], [])
    consumed = 0
    try:
        while len(walked.token_ids) < limit and not matcher.is_stopped():
            forced = matcher.compute_ff_tokens()
            if forced:
                for token in forced[: limit - len(walked.token_ids)]:
                    if not matcher.consume_token(token):
                        return walked
                    consumed += 1
                    j = len(walked.token_ids)
                    walked.token_ids.append(int(token))
                    walked.forced.append(True)
                    walked.replaced.append(j >= len(drafts) or int(drafts[j]) != token)
                continue
            j = len(walked.token_ids)
            if j >= len(drafts):
                return walked
            options = [int(drafts[j])]
            if greedy and candidates is not None and j < len(candidates):
                options += [int(c) for c in candidates[j] if int(c) != options[0]]
            for token in options:
                if matcher.try_consume_tokens([token]) == 1:
                    consumed += 1
                    walked.token_ids.append(token)
                    walked.forced.append(False)
                    walked.replaced.append(token != options[0])
                    break
            else:
                if not greedy:  # kept: it is rejected, and the residual sample keeps the output exact
                    walked.token_ids.append(options[0])
                    walked.forced.append(False)
                    walked.replaced.append(False)
                return walked
        return walked
    finally:
        if consumed:
            matcher.rollback(consumed)


def forced_tokens(matcher: Any, limit: int) -> list[int]:
    """The tokens the grammar forces from the matcher's state, at most ``limit`` (``[]`` when it forces
    none or has ended)."""
    if limit <= 0 or matcher.is_stopped():
        return []
    return [int(t) for t in matcher.compute_ff_tokens()[:limit]]


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """``[V]`` bool → ``[⌈V/32⌉]`` int32 bitmask (bit i of word w = token 32·w + i)."""
    words = (allowed.shape[0] + 31) // 32
    padded = torch.zeros(words * 32, dtype=torch.int64)
    padded[: allowed.shape[0]] = allowed.long()
    packed = (padded.view(words, 32) << torch.arange(32, dtype=torch.int64)).sum(dim=1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[N, ⌈V/32⌉]`` int32 bitmask (bit i of word w = token 32·w + i) → ``[N, V]`` bool."""
    bits = torch.arange(32, dtype=torch.int32)
    unpacked = (bitmask[..., None] >> bits) & 1  # [N, W, 32]
    return unpacked.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_mask(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Set disallowed tokens' logits to −inf.

    Args:
        logits: ``[R, L, V]`` float32 processed logits.
        allowed: ``[R, L, V]`` bool, or None (nothing to do).

    Returns:
        The masked logits (a new tensor). A position where the other processors already removed
        every allowed token (``min_tokens`` banning the EOS a finished grammar needs) keeps the
        grammar's choice: the grammar wins, so the output stays valid.
    """
    if allowed is None:
        return logits
    allowed = allowed.to(logits.device)
    masked = logits.masked_fill(~allowed, float("-inf"))
    empty = torch.isneginf(masked).all(dim=-1, keepdim=True)
    if bool(empty.any()):
        masked = torch.where(empty, torch.where(allowed, 0.0, float("-inf")), masked)
    return masked
