"""The embedded SmolLM2-135M-Instruct target: greedy equality, stop strings, detokenized text."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from dflash2 import LLM, EngineConfig, SamplingParams
from dflash2.engine import Engine
from dflash2.models import loader, source
from dflash2.models.drafter_factory import drafter_config_for_target
from dflash2.runner.model_setup import untrained_default_drafter
from tests.tiny import OracleDrafter

pytestmark = pytest.mark.slow
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def model():
    folder = source.resolve_model(None)
    tokenizer = loader.load_tokenizer(folder)
    target = loader.load_target(folder, torch.float32, torch.device("cpu"))
    return folder, tokenizer, target, loader.eos_token_ids(folder, tokenizer)


@pytest.fixture(scope="module")
def prompts(model):
    _, tokenizer, _, _ = model
    questions = [
        "What is the capital of France?",
        "Write a haiku about autumn leaves.",
        "List three prime numbers.",
    ]
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in questions
    ]


def _engine(model, drafter, block_size, max_num_seqs=3, **settings):
    _folder, tokenizer, target, eos = model
    config = EngineConfig(
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_model_len=512,
        device="cpu",
        dtype="float32",
        enforce_eager=True,
        **settings,
    )
    return Engine(config, target, tokenizer, drafter, eos, "SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def reference(model, prompts):
    llm = LLM.from_engine(_engine(model, None, 1))
    return llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))


def test_default_model_answers(reference):
    assert "Paris" in reference[0].text
    assert all(c.token_ids for c in reference)


def test_untrained_drafter_greedy_equals_autoregressive(model, prompts, reference):
    target = model[2]
    drafter = untrained_default_drafter(target, torch.float32, torch.device("cpu"))
    outputs = LLM.from_engine(_engine(model, drafter, 8)).generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    )
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    assert [o.text for o in outputs] == [r.text for r in reference]


def _oracle(model, prompts, reference, block_size=8, error_rate=0.1):
    _, tokenizer, target, _ = model
    refs = {i: tokenizer.encode(p) + r.token_ids for i, (p, r) in enumerate(zip(prompts, reference))}
    drafter = OracleDrafter(
        drafter_config_for_target(target.config, num_layers=1, block_size=block_size, selector_rank=8),
        refs,
        error_rate,
    )
    drafter.bind_target(*target.embedding_weights())
    return drafter


def test_high_acceptance_greedy_equals_autoregressive(model, prompts, reference):
    # Full blocks: with adaptive speculation τ would follow the measured step costs (noisy on busy cores).
    engine = _engine(model, _oracle(model, prompts, reference), 8, speculative_adaptive=False)
    outputs = LLM.from_engine(engine).generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    assert min(o.mean_acceptance_length for o in outputs) > 2.5


def test_stop_string_inside_an_accepted_block(model, prompts, reference):
    text = reference[1].text
    words = text.split()
    stop = words[len(words) // 2]  # a word from the middle of the answer
    cut = text.index(stop)
    llm = LLM.from_engine(_engine(model, _oracle(model, prompts, reference, error_rate=0.0), 8))
    out = llm.generate([prompts[1]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=[stop]))[0]
    assert out.text == text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < len(reference[1].token_ids)
    assert out.token_ids == reference[1].token_ids[: len(out.token_ids)]
    tokenizer = model[1]
    assert stop in tokenizer.decode(out.token_ids) and stop not in tokenizer.decode(out.token_ids[:-1])
    kept = llm.generate(
        [prompts[1]],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=[stop], include_stop_str_in_output=True),
    )[0]
    assert kept.text == text[: cut + len(stop)]


def test_streamed_text_concatenates_to_full_text(model, prompts, reference):
    llm = LLM.from_engine(_engine(model, _oracle(model, prompts, reference, error_rate=0.3), 8))
    pieces = []
    for result in llm.stream(prompts[2], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)):
        pieces += [o.new_text for o in result.outputs]
    assert "".join(pieces) == reference[2].text


def test_eos_from_generation_config(model):
    _folder, tokenizer, _, eos = model
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in eos


def test_eval_uses_the_shipped_drafter_by_default(tmp_path):
    from dflash2.cli import main

    args = ["eval", "--sets", "math", "--temperatures", "0", "--block-sizes", "8", "--num-prompts", "1"]
    data = Path(__file__).resolve().parents[2] / "data" / "smollm2-135m"  # committed; 0 recall sequences: no features
    options = ["--max-tokens", "16", "--dtype", "float32", "--threads", "2", "--num-recall-sequences", "0"]
    assert main([*args, *options, "--data", str(data), "--out", str(tmp_path)]) == 0
    assert "| math | 0 | 8 |" in (tmp_path / "eval.md").read_text()
    assert json.loads((tmp_path / "eval.json").read_text())["teacher_forced_tau"] is None
    # Another target has no shipped drafter: a clear error, not a crash.
    other = ["--model", str(source.resolve_model(None)), "--out", str(tmp_path / "other")]
    assert main([*args, *other]) == 2


def test_generate_says_how_many_steps_verified_token_trees(capsys):
    from dflash2.cli import main

    args = ["generate", "--prompt", "List three colours.", "--max-tokens", "16", "--enforce-eager", "--threads", "2"]
    tree = ["--speculative-topk", "4", "--speculative-num-draft-tokens", "16", "--no-speculative-adaptive"]
    assert main([*args, *tree]) == 0
    summary = capsys.readouterr().err
    verified = re.search(r"; (\d+) of (\d+) steps verified token trees", summary)
    assert verified is not None and int(verified.group(1)) > 0, summary
    assert main(args) == 0  # chains: no tree count
    assert "token trees" not in capsys.readouterr().err


def test_generate_exits_non_zero_when_its_request_fails_in_the_engine(capsys, monkeypatch):
    """A request that fails inside the engine (here: every decode step raises) ends the command with exit
    code 1 and one line naming the error, after the text it had."""
    from dflash2.cli import main
    from dflash2.engine.executor import StepExecutor

    def failing(self, rows, plan):
        raise RuntimeError("decode went wrong")

    monkeypatch.setattr(StepExecutor, "decode", failing)
    args = ["generate", "--prompt", "List three colours.", "--max-tokens", "16", "--enforce-eager", "--threads", "2"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "dflash2: error: the request failed in the engine: RuntimeError: decode went wrong" in err
    assert "[dflash2] 1 tokens in" in err  # the first token came from the prefill, before the failure
