"""Agent draft sources stay lossless: grammar-forced drafts and drafts from earlier outputs (suffix decoding).

- greedy: with forced drafts (and with earlier-output drafts) the output equals masked autoregressive greedy
  output token for token in float32: chains, trees (a grammar row verifies chains beside tree rows) and
  batches, with the adaptive policy choosing sources and with full blocks;
- forced drafts the target spells differently are rejected like any draft (counted, output unchanged);
- sampled: chi-square of the masked target distribution with forced drafts riding in the block;
- the accepted-by-source counts add up to the accepted counts.
"""

from __future__ import annotations

import pytest

from dflash2 import LLM, SamplingParams
from dflash2.config import EngineConfig
from dflash2.grammar import json_schema_grammar, lark_grammar
from dflash2.models import loader, source
from dflash2.outputs import DRAFT_SOURCE_NAMES
from tests.integration.test_engine_sampling import PROMPT, VOCAB, _chi_square_pvalue, _exact_joint
from tests.integration.test_grammar import SMOLLM2_VOCAB, char_tokenizer
from tests.integration.test_prompt_lookup_engine import FixedCosts
from tests.tiny import oracle_drafter, tiny_drafter, tiny_engine, tiny_target

# A tool call's arguments: required keys in order and an enum, so most of the text is forced.
CALL = {
    "type": "object",
    "properties": {
        "name": {"const": "search_flights"},
        "arguments": {
            "type": "object",
            "properties": {
                "origin": {"type": "string", "maxLength": 6},
                "cabin": {"enum": ["economy", "business", "first"]},
                "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["origin", "cabin", "passengers"],
        },
    },
    "required": ["name", "arguments"],
}
PROMPTS = [[1, 2, 3], [7, 7], [100, 200, 300, 400], [5]]


@pytest.fixture(scope="module")
def tokenizer():
    return loader.load_tokenizer(source.resolve_model(None))


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab_size=SMOLLM2_VOCAB, seed=5, scale=0.3)


def adaptive(engine, draft_cost: float = 0.002):
    """The adaptive policy with fixed step costs (the choice depends on acceptance alone)."""
    engine.policy.cost_model = FixedCosts(engine.config.max_num_seqs, engine.cost_model.widths, draft_cost)
    return engine


def generate(engine, prompts, params):
    """Outputs and the decode steps' stats."""
    steps = []
    outputs = LLM.from_engine(engine).generate(prompts, params, on_step=lambda r: steps.append(r.stats))
    return outputs, steps


def by_source(steps, field: str) -> dict[str, int]:
    total: dict[str, int] = {}
    for stats in steps:
        for name, count in getattr(stats, field).items():
            total[name] = total.get(name, 0) + count
    return total


def check_counts(outputs) -> None:
    for output in outputs:
        assert set(output.accepted_by_source) <= set(DRAFT_SOURCE_NAMES)
        assert sum(output.accepted_by_source.values()) == output.num_accepted_tokens


@pytest.mark.parametrize(
    "config",
    [
        {},  # full blocks from the drafter, the walk fills in forced tokens
        {"speculative_adaptive": True},  # the policy also verifies forced runs without a drafter forward
        {"speculative_topk": 2, "speculative_num_draft_tokens": 12},  # full-block trees
    ],
    ids=["chain", "adaptive", "tree"],
)
def test_greedy_with_forced_drafts_equals_masked_autoregressive(target, tokenizer, config):
    """Float32, a batch of grammar rows beside unconstrained ones (which verify trees where trees are on),
    then one row alone: the same tokens as block size 1 with the same grammar; forced drafts were verified,
    most accepted, and some rejected where the target spells the forced text with other tokens."""
    grammar = json_schema_grammar(CALL)
    constrained = SamplingParams(max_tokens=48, temperature=0.0, grammar=grammar)
    free = SamplingParams(max_tokens=80, temperature=0.0)  # on after the grammar rows end: trees where on
    params = [constrained, free, constrained, free]
    ar = tiny_engine(target, None, max_num_seqs=4, eos=(2,), tokenizer=tokenizer)
    reference = LLM.from_engine(ar).generate(PROMPTS, params)
    references = {slot: PROMPTS[slot] + r.token_ids for slot, r in enumerate(reference)}
    drafter = oracle_drafter(target, references, block_size=8, error_rate=0.4)
    engine = tiny_engine(target, drafter, 8, max_num_seqs=4, eos=(2,), tokenizer=tokenizer, **config)
    if config.get("speculative_adaptive"):
        adaptive(engine)
    outputs, steps = generate(engine, PROMPTS, params)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    check_counts(outputs)
    drafted, accepted = by_source(steps, "drafted_by_source"), by_source(steps, "accepted_by_source")
    assert accepted.get("grammar", 0) > 0
    assert drafted["grammar"] >= accepted["grammar"]
    if "speculative_topk" in config:
        assert sum(s.num_tree_nodes for s in steps) > 0  # the free rows verified trees once alone
    alone = LLM.from_engine(engine).generate(PROMPTS[2], constrained)[0]
    assert alone.token_ids == reference[2].token_ids


def test_forced_drafts_raise_acceptance_with_a_poor_drafter(target, tokenizer):
    """A drafter that is always wrong: without forced drafts a grammar row accepts almost nothing; with
    them every forced run is verified in one step (the output is the same)."""
    grammar = json_schema_grammar(CALL)
    params = SamplingParams(max_tokens=48, temperature=0.0, grammar=grammar)
    wrong = oracle_drafter(target, {0: [0] * 300}, block_size=8, error_rate=1.0)
    results = {}
    for forced in (False, True):
        engine = tiny_engine(
            target, wrong, 8, max_num_seqs=1, eos=(2,), tokenizer=tokenizer, grammar_forced_drafts=forced
        )
        results[forced] = LLM.from_engine(engine).generate(PROMPTS[0], params)[0]
    assert results[True].token_ids == results[False].token_ids
    assert results[True].num_verify_steps < results[False].num_verify_steps / 2
    assert results[True].accepted_by_source.get("grammar", 0) > 0
    assert "grammar" not in results[False].accepted_by_source


def test_sampling_with_forced_drafts_matches_the_masked_target_distribution():
    """Chi-square p > 1e-3 over the 3 tokens one verify step decides: the grammar forces the second and
    third tokens, so the block is the drafter's guess at nothing, two forced drafts and the bonus token
    sampled from the masked target after them."""
    target = tiny_target(vocab_size=VOCAB, seed=7)
    drafter = tiny_drafter(target, 2, block_size=4)
    engine = tiny_engine(target, drafter, 4, max_num_seqs=64, eos=(7,), tokenizer=char_tokenizer())
    allowed = [{0, 1, 2}, {3}, {4}, {1, 3, 5, 6}]
    grammar = lark_grammar("start: /[abc]de[bdfg]/")
    base = SamplingParams(max_tokens=8, temperature=1.0, grammar=grammar)
    params = [SamplingParams(**{**base.__dict__, "seed": i}) for i in range(3000)]
    outputs, steps = generate(engine, [PROMPT] * len(params), params)
    assert all(len(o.token_ids) == 4 and o.finish_reason == "stop" for o in outputs)
    assert by_source(steps, "accepted_by_source").get("grammar", 0) >= 2 * len(outputs)
    check_counts(outputs)
    exact4 = _exact_joint(target, SamplingParams(max_tokens=4, temperature=1.0), 4, allowed)
    exact: dict[tuple[int, ...], float] = {}
    for key, p in exact4.items():
        exact[key[1:]] = exact.get(key[1:], 0.0) + p
    assert _chi_square_pvalue([tuple(o.token_ids[1:]) for o in outputs], exact) > 1e-3


@pytest.mark.parametrize("topk", [1, 2])
def test_greedy_with_earlier_output_drafts_equals_autoregressive(topk):
    """A request whose output an earlier request already wrote (the same prompt, as an agent's retried turn)
    beside one with another prompt: the earlier-output index proposes the earlier text (prompt lookup is
    off), and every output is the target's own, chains and trees."""
    target = tiny_target(vocab_size=16, seed=5)
    drafter = tiny_drafter(target, 2, 8)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [[1, 2, 3], [1, 2, 3], [9, 4]]
    reference = LLM.from_engine(tiny_engine(target, None)).generate(prompts, params)
    tree = {"speculative_topk": topk, "speculative_num_draft_tokens": 12} if topk > 1 else {}
    engine = tiny_engine(
        target,
        drafter,
        8,
        speculative_adaptive=True,
        prompt_lookup_max=0,
        suffix_decoding_max_cached_requests=64,
        **tree,
    )
    adaptive(engine, 0.002)
    llm = LLM.from_engine(engine)
    first = llm.generate(prompts[0], params)[0]
    assert first.token_ids == reference[0].token_ids
    later, steps = generate(engine, prompts[1:], params)
    assert [o.token_ids for o in later] == [r.token_ids for r in reference[1:]]
    check_counts(later)
    assert by_source(steps, "accepted_by_source").get("suffix", 0) > 0
    assert engine.policy.suffix_index is not None and engine.policy.suffix_index.num_requests >= 1


def test_earlier_output_drafts_are_off_by_default_and_need_adaptive_speculation():
    target = tiny_target(vocab_size=16, seed=5)
    engine = tiny_engine(target, tiny_drafter(target, 2, 8), 8, speculative_adaptive=True)
    assert engine.policy.suffix_index is None
    with pytest.raises(ValueError, match="needs adaptive speculation"):
        EngineConfig(suffix_decoding_max_cached_requests=8, speculative_adaptive=False)
    with pytest.raises(ValueError, match="block size 1"):
        EngineConfig(suffix_decoding_max_cached_requests=8, block_size=1)
