"""A tiny end-to-end training run: the loss drops and the export loads and drafts losslessly."""

from __future__ import annotations

import json

import pytest
import torch

from dflash2 import LLM, SamplingParams
from dflash2.models.batch import ForwardBatch
from dflash2.models.loader import read_drafter
from dflash2.train.data import TokenDataset
from dflash2.train.evaluate import chained_teacher_forced, teacher_forced
from dflash2.train.features import extract_features
from dflash2.train.trainer import TrainConfig, Trainer, response_token_counts
from tests.tiny import tiny_engine, tiny_target


def _dataset(target) -> TokenDataset:
    """Greedy continuations of the tiny target as 'responses' after 4-token 'prompts'."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 90, (4,), generator=g).tolist() for _ in range(24)]
    outs = LLM.from_engine(tiny_engine(target, None, max_num_seqs=8)).generate(
        prompts, SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True)
    )
    tokens, masks, offsets = [], [], [0]
    for p, o in zip(prompts, outs):
        tokens += p + o.token_ids
        masks += [0] * len(p) + [1] * len(o.token_ids)
        offsets.append(len(tokens))
    heldout = torch.zeros(len(prompts), dtype=torch.bool)
    heldout[-2:] = True
    return TokenDataset(
        torch.tensor(tokens, dtype=torch.int32), torch.tensor(masks, dtype=torch.uint8), torch.tensor(offsets), heldout
    )


@pytest.mark.parametrize("draft_vocab_size", [0, 48])
def test_tiny_training_lowers_the_loss_and_exports_a_loadable_drafter(tmp_path, draft_vocab_size):
    torch.manual_seed(0)
    target = tiny_target(vocab_size=96, seed=2)
    dataset = _dataset(target)
    config = TrainConfig(
        num_layers=2,
        block_size=4,
        selector_rank=8,
        selector_top_k=8,
        steps=30,
        lr=3e-3,
        blocks_per_step=64,
        anchors_per_sequence=16,
        checkpoint_every=10,
        draft_vocab_size=draft_vocab_size,
        eval_every=10,
    )
    trainer = Trainer(target, dataset, torch.empty(0), config, tmp_path / "run", mask_token_id=95)
    trainer.features, _ = extract_features(target, dataset, trainer.drafter.config.target_layer_ids)
    trainer.run(export_dir=tmp_path / "drafter")
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    first = sum(m["loss"] for m in log[:5]) / 5
    last = sum(m["loss"] for m in log[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    assert log[-1]["top1"] > log[0]["top1"]
    assert [m["step"] for m in log if "heldout_tau" in m] == [10, 20, 30]
    assert 1.0 <= log[-1]["heldout_tau"] <= 4.0 and 0.0 <= log[-1]["heldout_top1"] <= 1.0
    assert (tmp_path / "run" / "loss.png").stat().st_size > 0
    # The export is the published layout and drafts losslessly in the engine.
    drafter = read_drafter(tmp_path / "drafter", torch.float32, "cpu")
    assert json.loads((tmp_path / "drafter" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    drafter.bind_target(*target.embedding_weights())
    assert (drafter.draft_vocab is None) == (draft_vocab_size == 0)
    if draft_vocab_size:
        assert len(drafter.draft_vocab) == draft_vocab_size
        # Exported with each token's count in the training responses: what the engine ranks by.
        counts = response_token_counts(dataset, trainer.train_ids, target.config.vocab_size)
        assert torch.equal(drafter.draft_vocab_counts, counts[drafter.draft_vocab])
    prompts = [dataset.sequence(i)[0][:4].tolist() for i in dataset.indices(heldout=True)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    ar = LLM.from_engine(tiny_engine(target, None)).generate(prompts, params)
    spec = LLM.from_engine(tiny_engine(target, drafter.eval(), 4)).generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in ar]
    _teacher_forced_tau_matches_the_engine(target, drafter, dataset, trainer.features)
    _chained_teacher_forced_steps_match_a_decode(target, drafter, dataset, trainer.features)


def _teacher_forced_tau_matches_the_engine(target, drafter, dataset, features) -> None:
    """The held-out teacher-forced τ equals the engine's first verify step from every anchor.

    The responses are the target's greedy output, so prefilling the tokens before an anchor
    makes the engine's first block exactly the teacher-forced block at that anchor.
    """
    block_size = drafter.config.block_size
    forced = teacher_forced(drafter, dataset, features, anchors_per_sequence=10_000)
    lengths = []
    llm = LLM.from_engine(tiny_engine(target, drafter, block_size, max_num_seqs=1))
    for i in dataset.indices(heldout=True):
        ids, mask = dataset.sequence(i)
        for anchor in range(len(ids) - block_size + 1):
            if mask[anchor]:
                steps = []
                llm.generate(
                    [ids[:anchor].tolist()],
                    SamplingParams(max_tokens=2 * block_size, temperature=0.0, ignore_eos=True),
                    on_step=lambda r, steps=steps: steps.extend(r.stats.acceptance_lengths),
                )
                lengths.append(steps[0])
    assert forced.num_blocks == len(lengths)
    assert forced.tau == pytest.approx(sum(lengths) / len(lengths))
    assert 1.0 < forced.tau < block_size  # the check is not vacuous: some drafts accepted, some rejected
    assert 0.0 < forced.recall[1][0] <= forced.recall[16][0] <= 1.0


def _chained_teacher_forced_steps_match_a_decode(target, drafter, dataset, features) -> None:
    """Walking the teacher-forced blocks along a decode's anchors gives the decode's verify steps."""
    chained = chained_teacher_forced(drafter, dataset, features, max_tokens=1000)
    llm = LLM.from_engine(tiny_engine(target, drafter, drafter.config.block_size, max_num_seqs=1))
    decoded_steps = []
    for i in dataset.indices(heldout=True):
        ids, mask = dataset.sequence(i)
        start = int(mask.nonzero()[0])
        steps: list[int] = []
        params = SamplingParams(max_tokens=len(ids) - start, temperature=0.0, ignore_eos=True)
        out = llm.generate(
            [ids[:start].tolist()], params, on_step=lambda r, steps=steps: steps.extend(r.stats.acceptance_lengths)
        )
        assert out[0].token_ids == ids[start:].tolist()  # the answers are the target's greedy output
        decoded_steps.append(steps)
    assert len(chained.steps) == len(decoded_steps) == 2
    for forced, decoded in zip(chained.steps, decoded_steps):
        # The first answer token comes from prefill; the last step may be cut by max_tokens.
        assert forced[:-1] == decoded[: len(forced) - 1] and len(forced) == len(decoded)
    assert 1.0 < chained.tau < drafter.config.block_size


def _one_layer_config(**overrides) -> TrainConfig:
    """A one-layer, block-4 run of a few steps on the tiny target."""
    settings = dict(num_layers=1, block_size=4, selector_rank=8, selector_top_k=8, blocks_per_step=32)
    return TrainConfig(**{**settings, "init_from_target": False, **overrides})


def test_training_resumes_from_its_checkpoint(tmp_path):
    target = tiny_target(vocab_size=96, seed=2)
    dataset = _dataset(target)
    config = _one_layer_config(steps=4, checkpoint_every=2)
    features, _ = extract_features(target, dataset, (2,))
    first = Trainer(target, dataset, features, config, tmp_path, mask_token_id=95)
    first.run()
    resumed = Trainer(target, dataset, features, TrainConfig(**{**config.__dict__, "steps": 6}), tmp_path, 95)
    assert resumed.step == 4
    for a, b in zip(first.drafter.state_dict().values(), resumed.drafter.state_dict().values()):
        assert torch.equal(a, b)
    resumed.run()
    assert resumed.step == 6


def test_a_new_run_can_start_from_an_exported_drafter(tmp_path):
    target = tiny_target(vocab_size=96, seed=2)
    dataset = _dataset(target)
    config = _one_layer_config(steps=2, draft_vocab_size=48)
    features, _ = extract_features(target, dataset, (2,))
    first = Trainer(target, dataset, features, config, tmp_path / "first", mask_token_id=95)
    first.run(export_dir=tmp_path / "export")
    exported = read_drafter(tmp_path / "export", torch.float32, "cpu")
    second_config = TrainConfig(**{**config.__dict__, "seed": 7, "init_drafter": str(tmp_path / "export")})
    second = Trainer(target, dataset, features, second_config, tmp_path / "second", 95)
    for name, value in exported.state_dict().items():
        assert torch.equal(second.drafter.state_dict()[name], value), name
    assert torch.equal(second.drafter.draft_vocab, exported.draft_vocab)
    wider = TrainConfig(**{**second_config.__dict__, "num_layers": 2})
    with pytest.raises(ValueError, match="another drafter shape"):
        Trainer(target, dataset, features, wider, tmp_path / "third", 95)


def test_feature_cache_is_reused_extended_for_new_conversations_and_rebuilt_for_changed_ones(tmp_path, monkeypatch):
    from dflash2.train import features as features_module

    target = tiny_target(vocab_size=96, seed=2)
    dataset = _dataset(target)
    path = tmp_path / "features.safetensors"
    extracted: list[int] = []  # conversations sent through the target, per extraction
    real_extract = features_module.extract_features

    def counting_extract(target, data, layer_ids, soft_label_k=0):
        extracted.append(len(data))
        return real_extract(target, data, layer_ids, soft_label_k=soft_label_k)

    monkeypatch.setattr(features_module, "extract_features", counting_extract)
    expected, _ = real_extract(target, dataset, (2,))

    features_module.load_or_extract(path, target, dataset.subset(list(range(16))), (2,))
    grown, soft = features_module.load_or_extract(path, target, dataset, (2,))
    assert extracted == [16, len(dataset) - 16] and soft is None
    torch.testing.assert_close(grown, expected, atol=1e-3, rtol=0)

    again, _ = features_module.load_or_extract(path, target, dataset, (2,))
    assert extracted == [16, len(dataset) - 16]
    assert torch.equal(again, grown)

    changed = dataset.subset(list(range(len(dataset))))
    changed.tokens[3] = (changed.tokens[3] + 1) % 90
    features_module.load_or_extract(path, target, changed, (2,))
    assert extracted[-1] == len(dataset)
    features_module.load_or_extract(path, target, changed, (1,))
    assert extracted[-1] == len(dataset) and len(extracted) == 4


def test_soft_labels_are_the_targets_top_k_and_survive_cache_growth(tmp_path):
    from dflash2.train import features as features_module

    target = tiny_target(vocab_size=96, seed=2)
    dataset = _dataset(target)
    features, soft = extract_features(target, dataset, (2,), soft_label_k=5)
    plain, none = extract_features(target, dataset, (2,))
    assert none is None and torch.equal(features, plain)
    # Row t of a conversation is the target's log-softmax top-5 after reading tokens 0..t.
    i = dataset.indices(heldout=False)[3]
    ids, _ = dataset.sequence(i)
    a = int(dataset.offsets[i])
    cache = target.new_cache(1, len(ids))
    logits, _ = target.run(ForwardBatch.build([0], [ids.tolist()], [0], torch.device("cpu")), cache)
    top = torch.log_softmax(logits[0], -1).topk(5, dim=-1)
    assert torch.equal(soft.ids[a : a + len(ids)].long(), top.indices)
    torch.testing.assert_close(soft.logprobs[a : a + len(ids)].float(), top.values, atol=1e-3, rtol=1e-3)  # float16
    # A cache with soft labels serves a run without them and a smaller k; it keeps them when the data grows.
    path = tmp_path / "features.safetensors"
    features_module.load_or_extract(path, target, dataset.subset(list(range(16))), (2,), soft_label_k=5)
    _, without = features_module.load_or_extract(path, target, dataset, (2,))
    assert without is None
    _, three = features_module.load_or_extract(path, target, dataset, (2,), soft_label_k=3)
    assert torch.equal(three.ids, soft.ids[:, :3])
    # Asking for more entries than the cache holds extracts again.
    _, six = features_module.load_or_extract(path, target, dataset, (2,), soft_label_k=6)
    assert six.top_k == 6 and torch.equal(six.ids[:, :5], soft.ids)


def test_distillation_trains_and_needs_soft_labels(tmp_path):
    target = tiny_target(vocab_size=96, seed=2)
    dataset = _dataset(target)
    config = _one_layer_config(steps=30, lr=1e-2, distill_weight=0.5, distill_top_k=8, draft_vocab_size=64)
    features, soft = extract_features(target, dataset, (2,), soft_label_k=8)
    with pytest.raises(ValueError, match="soft labels"):
        Trainer(target, dataset, features, config, tmp_path / "no-soft", 95)
    trainer = Trainer(target, dataset, features, config, tmp_path / "run", 95, soft)
    trainer.run()
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert all(m["distill_loss"] > 0 for m in log)
    assert sum(m["distill_loss"] for m in log[-3:]) < 0.8 * sum(m["distill_loss"] for m in log[:3])
