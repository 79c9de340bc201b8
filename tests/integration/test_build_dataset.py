"""Building a training dataset with the engine (dflash2.train.data.build_dataset): the embedded model
answers the prompts, and a second build resumes from the journal instead of asking the engine again."""

from __future__ import annotations

import json


def test_build_dataset_resumes_from_its_journal(tmp_path):
    from dflash2 import EngineConfig
    from dflash2.engine import Engine
    from dflash2.train.data import DataConfig, build_dataset

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["What is 2+2?", "Name a color.", "Hi!"]))
    engine = Engine.from_config(
        EngineConfig(block_size=1, max_num_seqs=4, max_model_len=256, dtype="float32", enforce_eager=True)
    )
    config = DataConfig(
        num_prompts=0, max_prompt_tokens=8, max_response_tokens=8, multi_turn_fraction=0.0, heldout_fraction=0.0
    )
    first = build_dataset(engine, config, tmp_path / "out", prompts, synthesize=False)
    assert first["num_conversations"] == 3 and first["num_loss_tokens"] > 0
    submitted = []
    original = engine.add_request
    engine.add_request = lambda *a, **k: submitted.append(a) or original(*a, **k)  # type: ignore[method-assign]
    second = build_dataset(engine, config, tmp_path / "out", prompts, synthesize=False)
    assert submitted == []  # everything came from journal.jsonl
    assert second["num_tokens"] == first["num_tokens"]
