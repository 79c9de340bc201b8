"""What grammar masks cost per engine step (docs/server.md, "The grammar engine").

Runs the embedded SmolLM2 with its shipped drafter (compiled, the machine's default dtype) on one
JSON prompt, free and with a JSON schema, at batch 1 and 4, and prints per decode step: the step
time, the time spent computing masks (``StepStats.grammar_time``) and τ. The first of two runs per
case warms up; the second is reported. "json schema" includes the budget rule (the closing path walked
at every masked position within reach of ``max_tokens``); "json schema, no budget" leaves it out, so
the difference is what the rule costs.

    .venv/bin/python scripts/grammar_mask_cost.py [--threads 2] [--max-tokens 96] [--enforce-eager]
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch

from dflash2 import LLM, SamplingParams
from dflash2.grammar import json_schema_grammar

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
    },
    "required": ["name", "age", "hobbies"],
}
QUESTION = "Describe a person as JSON with name, age and hobbies."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(max_num_seqs=4, max_model_len=1024, enable_prefix_caching=False, enforce_eager=args.enforce_eager)
    backend = llm.engine.grammar
    assert backend is not None
    with_budget = backend.masks
    without_budget = functools.partial(lambda masks, m, d, n, *_: masks(m, d, n), with_budget)
    tokenizer = llm.engine.tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False
    )
    grammar = json_schema_grammar(SCHEMA)
    for batch in (1, 4):
        for label, constraint, budget in (
            ("free", None, True),
            ("json schema", grammar, True),
            ("json schema, no budget", grammar, False),
        ):
            backend.masks = with_budget if budget else without_budget  # type: ignore[method-assign]
            params = SamplingParams(max_tokens=args.max_tokens, temperature=0, grammar=constraint)
            for repeat in range(2):
                results: list = []
                outputs = llm.generate([prompt] * batch, params, on_step=results.append)
                if repeat == 0:
                    continue
                steps = [r.stats for r in results if r.stats.num_decode_rows]
                total = sum(s.total_time for s in steps)
                masks = sum(s.grammar_time for s in steps)
                tau = statistics.mean(o.mean_acceptance_length for o in outputs)
                print(
                    f"batch {batch}, {label}: {len(steps)} steps, {1000 * total / len(steps):.2f} ms/step, "
                    f"masks {1000 * masks / len(steps):.3f} ms/step ({100 * masks / total:.1f} %), tau {tau:.2f}, "
                    f"output {outputs[0].text[:50]!r}"
                )


if __name__ == "__main__":
    main()
