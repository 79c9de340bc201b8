"""Grammar-constrained decoding (structured outputs) stays lossless under speculation.

- sampled: the emitted joint distribution equals the *masked* target distribution (chi-square);
- greedy: speculative output with a grammar equals autoregressive output with it, alone and in a
  batch, token for token in float32, with drafts that are mostly accepted and some illegal;
- every sampled JSON output is valid for its schema; a completed grammar ends the request.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dflash2 import LLM, SamplingParams
from dflash2.grammar import GrammarError, json_schema_grammar, lark_grammar
from dflash2.models import loader, source
from tests.integration.test_engine_sampling import PROMPT, VOCAB, _chi_square_pvalue, _exact_joint
from tests.tiny import oracle_drafter, tiny_drafter, tiny_engine, tiny_target

SMOLLM2_VOCAB = 49152
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "color", "count"],
    "additionalProperties": False,
}


def char_tokenizer() -> PreTrainedTokenizerFast:
    """Tokens 0–6 are the letters a–g, token 7 is EOS (the VOCAB of the sampling tests)."""
    vocab = {c: i for i, c in enumerate("abcdefg")} | {"<eos>": 7}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return loader.load_tokenizer(source.resolve_model(None))


@pytest.fixture(scope="module")
def wide_target():
    """A tiny random target over SmolLM2's vocabulary, so real JSON grammars apply."""
    return tiny_target(vocab_size=SMOLLM2_VOCAB, seed=5, scale=0.3)


def test_speculative_sampling_matches_the_masked_target_distribution():
    """Chi-square p > 1e-3 over the 3 tokens one verify step decides (t1, from prefill, marginalised).

    The grammar allows a different set at each position; the drafter's top-2 candidates are often
    illegal, so rejections of forbidden drafts and residual samples from the masked p are exercised.
    """
    target = tiny_target(vocab_size=VOCAB, seed=7)
    drafter = tiny_drafter(target, 2, block_size=4)
    drafter.config.__dict__["selector_top_k"] = 2
    engine = tiny_engine(target, drafter, 4, max_num_seqs=64, eos=(7,), tokenizer=char_tokenizer())
    allowed = [{0, 1, 2}, {0, 3, 4}, set(range(7)), {1, 3, 5}]
    grammar = lark_grammar("start: /[abc][ade][a-g][bdf]/")
    base = SamplingParams(max_tokens=8, temperature=1.0, grammar=grammar)
    params = [SamplingParams(**{**base.__dict__, "seed": i}) for i in range(3000)]
    outputs = LLM.from_engine(engine).generate([PROMPT] * len(params), params)
    assert all(len(o.token_ids) == 4 and o.finish_reason == "stop" for o in outputs)  # the grammar ends them
    assert sum(o.num_accepted_tokens for o in outputs) > 0
    assert sum(o.num_draft_tokens - o.num_accepted_tokens for o in outputs) > 0
    exact4 = _exact_joint(target, SamplingParams(max_tokens=4, temperature=1.0), 4, allowed)
    exact: dict[tuple[int, ...], float] = {}
    for key, p in exact4.items():
        exact[key[1:]] = exact.get(key[1:], 0.0) + p
    samples = [tuple(o.token_ids[1:]) for o in outputs]
    assert _chi_square_pvalue(samples, exact) > 1e-3


def test_greedy_speculative_equals_autoregressive_with_a_grammar(wide_target, smollm2_tokenizer):
    """Block size 8 (batch of 4 and alone) == block size 1, token for token, float32."""
    grammar = json_schema_grammar(SCHEMA)
    prompts = [[1, 2, 3], [7, 7], [100, 200, 300, 400], [5]]
    params = SamplingParams(max_tokens=40, temperature=0.0, grammar=grammar)
    ar = tiny_engine(wide_target, None, max_num_seqs=4, eos=(2,), tokenizer=smollm2_tokenizer)
    reference = LLM.from_engine(ar).generate(prompts, params)
    assert all(r.finish_reason == "stop" for r in reference)
    references = {slot: prompts[slot] + r.token_ids for slot, r in enumerate(reference)}
    drafter = oracle_drafter(wide_target, references, block_size=8, error_rate=0.3)
    spec = tiny_engine(wide_target, drafter, 8, max_num_seqs=4, eos=(2,), tokenizer=smollm2_tokenizer)
    batched = LLM.from_engine(spec).generate(prompts, params)
    assert [b.token_ids for b in batched] == [r.token_ids for r in reference]
    assert sum(b.num_accepted_tokens for b in batched) > 0
    alone = LLM.from_engine(spec).generate(prompts[2], params)[0]
    assert alone.token_ids == reference[2].token_ids
    for r in reference:
        jsonschema.validate(json.loads(smollm2_tokenizer.decode(r.token_ids, skip_special_tokens=True)), SCHEMA)


def test_greedy_speculative_equals_autoregressive_when_the_budget_closes_the_grammar(wide_target, smollm2_tokenizer):
    """20 tokens, where the random target's JSON takes 18–20 and the shortest takes about 17: the budget
    rule closes every output early (as ``length``), in float32 the same tokens with block size 8 as with
    block size 1, and every output parses and validates."""
    max_tokens = 20
    grammar = json_schema_grammar(SCHEMA)
    prompts = [[1, 2, 3], [7, 7], [100, 200, 300, 400], [5]]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, grammar=grammar)
    ar = tiny_engine(wide_target, None, max_num_seqs=4, eos=(2,), tokenizer=smollm2_tokenizer)
    reference = LLM.from_engine(ar).generate(prompts, params)
    references = {slot: prompts[slot] + r.token_ids for slot, r in enumerate(reference)}
    drafter = oracle_drafter(wide_target, references, block_size=8, error_rate=0.3)
    spec = tiny_engine(wide_target, drafter, 8, max_num_seqs=4, eos=(2,), tokenizer=smollm2_tokenizer)
    batched = LLM.from_engine(spec).generate(prompts, params)
    assert [b.token_ids for b in batched] == [r.token_ids for r in reference]
    assert sum(b.num_accepted_tokens for b in batched) > 0
    for r in reference:
        assert len(r.token_ids) <= max_tokens
        jsonschema.validate(json.loads(r.text), SCHEMA)
    assert all(r.finish_reason == "length" for r in reference)  # closed by the budget, and said so
    free = LLM.from_engine(ar).generate(prompts, SamplingParams(max_tokens=200, temperature=0.0, grammar=grammar))
    assert all(f.finish_reason == "stop" for f in free)
    assert [f.text for f in free] != [r.text for r in reference]  # the budget changed what was written


def test_the_closing_path_and_the_budget_mask(smollm2_tokenizer):
    from dflash2.grammar import GrammarBackend, json_object_grammar, unpack_bitmask

    backend = GrammarBackend(smollm2_tokenizer, SMOLLM2_VOCAB)
    matcher = backend.matcher(json_object_grammar())
    ids = smollm2_tokenizer.encode('{"name": "Molecute-L-L', add_special_tokens=False)
    assert matcher.consume_tokens(ids)
    assert backend.closing_bytes(matcher) == b'"}'
    row = torch.zeros((SMOLLM2_VOCAB + 31) // 32, dtype=torch.int32)
    matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
    free = unpack_bitmask(row[None].clone(), SMOLLM2_VOCAB)[0]
    assert not backend._budget_mask(matcher, row.clone(), 40)  # far from the end: unchanged
    assert backend._budget_mask(matcher, row, 1)  # one token left: only what closes it in one token
    allowed = unpack_bitmask(row[None], SMOLLM2_VOCAB)[0]
    assert bool((allowed <= free).all())
    assert {smollm2_tokenizer.decode([t]) for t in allowed.nonzero()[:, 0].tolist()} == {'"}'}
    assert backend.closing_bytes(matcher) == b'"}'  # the walk leaves the matcher where it was


def test_sampled_json_outputs_validate(wide_target, smollm2_tokenizer):
    """T = 1 with speculation (untrained drafter) and a batch: every output parses and validates."""
    drafter = tiny_drafter(wide_target, 2, block_size=8)
    engine = tiny_engine(wide_target, drafter, 8, max_num_seqs=8, eos=(2,), tokenizer=smollm2_tokenizer)
    grammar = json_schema_grammar(SCHEMA)
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=s, grammar=grammar) for s in range(8)]
    outputs = LLM.from_engine(engine).generate([[3, 4, 5]] * 8, params)
    for output in outputs:
        assert output.finish_reason == "stop", output.text
        jsonschema.validate(json.loads(output.text), SCHEMA)


def test_completed_grammar_ends_the_request_even_with_ignore_eos(wide_target, smollm2_tokenizer):
    engine = tiny_engine(wide_target, None, eos=(2,), tokenizer=smollm2_tokenizer)
    grammar = lark_grammar('start: "yes" | "no"')
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=1, ignore_eos=True, grammar=grammar)
    output = LLM.from_engine(engine).generate([[1, 2]], params)[0]
    assert output.text in ("yes", "no") and output.finish_reason == "stop"


@pytest.mark.parametrize("block_size", [1, 4])
def test_a_call_that_repeats_an_earlier_one_ends_the_request_before_it(wide_target, smollm2_tokenizer, block_size):
    """The grammar allows only one call, written again and again; EOS is banned until token 60 (min_tokens).
    With the call's closing tag as ``repeat_marker`` the request ends after the first call; without it, the
    same request writes the call again."""
    one = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    grammar = lark_grammar(f'start: call ("\\n" call)*\ncall: {json.dumps(one)}')
    drafter = tiny_drafter(wide_target, 2, block_size=block_size) if block_size > 1 else None
    engine = tiny_engine(wide_target, drafter, block_size, eos=(2,), tokenizer=smollm2_tokenizer)
    base = SamplingParams(max_tokens=80, min_tokens=60, temperature=1.0, seed=4, grammar=grammar)
    guarded = LLM.from_engine(engine).generate(
        [[1, 2, 3]], SamplingParams(**{**base.__dict__, "repeat_marker": "</tool_call>"})
    )[0]
    assert guarded.text == one and guarded.finish_reason == "stop" and guarded.stop_reason is None
    # The tokens that wrote the repeat count (as a stop string's do); none of its text is returned.
    assert len(guarded.token_ids) > len(smollm2_tokenizer.encode(one))
    unguarded = LLM.from_engine(engine).generate([[1, 2, 3]], base)[0]
    assert unguarded.text.startswith(f"{one}\n{one}")


def test_a_grammar_that_does_not_compile_is_refused_at_submission(wide_target, smollm2_tokenizer):
    engine = tiny_engine(wide_target, None, tokenizer=smollm2_tokenizer)
    bad = json_schema_grammar({"type": "object", "properties": {"a": {"type": "frobnicate"}}})
    with pytest.raises(GrammarError, match="frobnicate"):
        engine.add_request([1, 2], SamplingParams(grammar=bad))
    with pytest.raises(ValueError, match="tokenizer"):
        tiny_engine(wide_target, None).add_request([1, 2], SamplingParams(grammar=lark_grammar('start: "a"')))


def test_grammar_rows_do_not_change_unconstrained_neighbours(wide_target, smollm2_tokenizer):
    """Masks apply per row: a free request's greedy output is the same next to grammar requests."""
    drafter = tiny_drafter(wide_target, 2, block_size=8)
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = tiny_engine(wide_target, drafter, 8, max_num_seqs=4, tokenizer=smollm2_tokenizer)
    alone = LLM.from_engine(engine).generate([[9, 8, 7]], free)[0]
    constrained = SamplingParams(max_tokens=24, temperature=0.0, grammar=json_schema_grammar(SCHEMA))
    mixed = LLM.from_engine(engine).generate([[1, 2], [9, 8, 7], [3]], [constrained, free, constrained])
    assert mixed[1].token_ids == alone.token_ids
    assert torch.tensor(mixed[0].token_ids).numel() > 0


def test_close_objects_closes_only_objects_that_leave_extra_keys_open():
    from dflash2.grammar import close_objects

    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
            "c": {"type": "object", "additionalProperties": {"type": "string"}},
            "d": {"const": {"properties": {}}},
        },
        "$defs": {"e": {"properties": {"f": {}}, "patternProperties": {"^x": {}}}},
    }
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["c"]["additionalProperties"] == {"type": "string"}
    assert closed["properties"]["d"] == {"const": {"properties": {}}}  # data, not a schema
    assert "additionalProperties" not in closed["$defs"]["e"]
    assert "additionalProperties" not in schema  # a copy
