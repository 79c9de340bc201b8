"""DFlash / DFlash 2 drafter: identity equivalence, checkpoint layout, conv and mask invariants.

docs/dflash2-spec.md §1 (checkpoint layout), §2.4 (mask), §3 (dynamic convolution), §4.4 (selector init), §10.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash2.models.drafter import DFlashDrafter, DraftLayer, DynamicConv
from dflash2.models.drafter_config import DrafterConfig, default_target_layer_ids
from dflash2.models.loader import (
    ModelLoadError,
    check_drafter_matches,
    load_drafter_weights,
    read_drafter,
    save_drafter,
)
from dflash2.spec.selector import lattice_scores, topk_candidates, walk
from tests.tiny import tiny_drafter, tiny_drafter_config, tiny_target

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
TINY_V2 = FIXTURES / "dflash2-tiny"
TINY_V2_HEADER = FIXTURES / "dflash2-tiny-header.json"
CPU = torch.device("cpu")


def _v1_config_of(config: DrafterConfig) -> DrafterConfig:
    """The same drafter with the DFlash 2 convolution and selector switched off."""
    return dataclasses.replace(config, conv_group_size=0, conv_kernel_size=0, selector_rank=0, selector_top_k=0)


def _header() -> dict[str, list[int]]:
    raw = json.loads(TINY_V2_HEADER.read_text())
    return {k: v for k, v in raw.items() if not k.startswith("_")}


def _fill_context(drafter: DFlashDrafter, lengths: list[int], seed: int = 0, max_len: int = 32):
    """A draft cache with ``lengths[r]`` context tokens (positions 0..len−1) in slot r."""
    g = torch.Generator().manual_seed(seed)
    cache = drafter.new_cache(len(lengths), max_len, torch.float32, CPU)
    slots = torch.cat([torch.full((n,), r, dtype=torch.long) for r, n in enumerate(lengths)])
    positions = torch.cat([torch.arange(n) for n in lengths])
    features = torch.randn(len(slots), drafter.config.num_features * drafter.config.hidden_size, generator=g)
    drafter.append_context(cache, slots, positions, features)
    return cache


def _randomize(module: torch.nn.Module, seed: int, std: float = 0.1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * std)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)


# ---- 1. identity equivalence (spec §3.4, §4.4, §10) --------------------------------------------


@torch.no_grad()
def test_identity_init_dflash2_equals_dflash_v1():
    target = tiny_target("qwen3")
    v2 = DFlashDrafter(tiny_drafter_config(2, block_size=8, vocab_size=96, top_k=8))
    v2.init_weights(std=0.08, seed=1)
    v2.bind_target(target.embed_tokens.weight, target.lm_head.weight)
    v2.eval()

    v1 = DFlashDrafter(_v1_config_of(v2.config))
    assert v1.config.version == 1 and v2.config.version == 2
    v1_keys = set(v1.state_dict())
    assert v1_keys < set(v2.state_dict())
    assert not any("conv" in k or "candidate_selector" in k for k in v1_keys)
    v1.load_state_dict({k: v for k, v in v2.state_dict().items() if k in v1_keys}, strict=True)
    v1.bind_target(target.embed_tokens.weight, target.lm_head.weight)
    v1.eval()

    lengths = [5, 11]
    anchors = torch.tensor([7, 42])
    starts = torch.tensor(lengths)
    h2 = v2.draft_hidden(_fill_context(v2, lengths), [0, 1], anchors, starts, 8)
    h1 = v1.draft_hidden(_fill_context(v1, lengths), [0, 1], anchors, starts, 8)
    assert h2.shape == (2, 8, 64)
    assert torch.isfinite(h2).all()
    # The two rows and the block positions really differ (the comparison is not between constants).
    assert not torch.allclose(h2[0], h2[1], atol=1e-3)
    assert not torch.allclose(h2[:, 1], h2[:, 2], atol=1e-3)
    assert torch.equal(h2, h1)

    l2, l1 = v2.logits(h2), v1.logits(h1)
    assert l2.shape == (2, 8, 96) and l2.dtype == torch.float32
    assert torch.equal(l2, l1)
    greedy = l1[:, 1:].argmax(-1)
    assert torch.equal(l2[:, 1:].argmax(-1), greedy)

    # Selector at init: successor codebook is zero, the other two are not, so the lattice is
    # the unary scores and the greedy walk is the per-slot argmax.
    weights = v2.selector_weights()
    assert weights is not None
    assert torch.count_nonzero(weights.successor_codebook) == 0
    assert weights.predecessor_codebook.abs().sum() > 0 and weights.hidden_projection.abs().sum() > 0
    cand, unary = topk_candidates(l2[:, 1:], v2.config.selector_top_k)
    lattice = lattice_scores(h2[:, 1:], anchors, cand, unary, weights)
    assert torch.allclose(lattice, unary[:, :, None, :].expand_as(lattice), atol=1e-6, rtol=0)
    proposal = walk(cand, unary, lattice, torch.zeros(2), torch.rand(2, 7))
    assert torch.equal(proposal.draft_ids, greedy)

    # Non-vacuous: a non-zero successor codebook makes the lattice differ from the unary scores,
    # and non-identity convolutions change the hidden states.
    with torch.no_grad():
        v2.candidate_selector.successor_codebook.normal_(0.0, 1.0)
    assert not torch.allclose(lattice_scores(h2[:, 1:], anchors, cand, unary, v2.selector_weights()), lattice)
    with torch.no_grad():
        for layer in v2.layers:
            layer.attention_conv.kernel_projection.weight.normal_(0.0, 0.1)
    moved = v2.draft_hidden(_fill_context(v2, lengths), [0, 1], anchors, starts, 8)
    assert not torch.allclose(moved, h1, atol=1e-3)


def test_draft_hidden_rows_are_independent_and_ignore_stale_context():
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target, version=2, block_size=6)  # random, non-identity convs
    lengths = [4, 9]
    anchors = torch.tensor([3, 50])
    starts = torch.tensor(lengths)
    cache = _fill_context(drafter, lengths)
    both = drafter.draft_hidden(cache, [0, 1], anchors, starts, 6)
    alone0 = drafter.draft_hidden(cache, [0], anchors[:1], starts[:1], 6)
    alone1 = drafter.draft_hidden(cache, [1], anchors[1:], starts[1:], 6)
    assert torch.allclose(both[0], alone0[0], atol=1e-5)
    assert torch.allclose(both[1], alone1[0], atol=1e-5)

    # Stale entries at positions >= start of slot 0 (read because row 1 is longer) are masked.
    g = torch.Generator().manual_seed(9)
    features = torch.randn(5, drafter.config.num_features * 64, generator=g) * 3
    drafter.append_context(cache, torch.zeros(5, dtype=torch.long), torch.arange(4, 9), features)
    after = drafter.draft_hidden(cache, [0, 1], anchors, starts, 6)
    assert torch.allclose(after, both, atol=1e-6, rtol=0)
    # ...while changing a visible context entry (position 2 < start) does change row 0.
    drafter.append_context(cache, torch.zeros(1, dtype=torch.long), torch.tensor([2]), features[:1])
    changed = drafter.draft_hidden(cache, [0, 1], anchors, starts, 6)
    assert not torch.allclose(changed[0], both[0], atol=1e-4)
    assert torch.allclose(changed[1], both[1], atol=1e-6, rtol=0)


# ---- 2. checkpoint layout (spec §1.2, §1.3) ----------------------------------------------------


def test_fixture_config_parses_as_published_dflash2():
    config = DrafterConfig.from_file(TINY_V2)
    assert config.version == 2 and config.has_conv and config.has_selector
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (64, 2, 12)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert (config.intermediate_size, config.vocab_size) == (112, 96)
    assert config.block_size == 8
    assert config.rope_theta == 500000.0
    assert config.rms_norm_eps == 1e-5
    assert config.is_causal is False
    assert config.layer_types == ("sliding_attention", "sliding_attention")
    assert config.sliding_window == 32
    assert not config.layer_is_causal(0) and config.layer_window(0) == 32
    assert (config.conv_group_size, config.conv_kernel_size, config.num_conv_groups) == (16, 2, 4)
    assert (config.selector_rank, config.selector_top_k) == (8, 4)
    assert config.mask_token_id == 95
    assert config.target_layer_ids == (1, 2) and config.num_features == 2
    assert config.num_target_layers == 4


def test_saved_checkpoint_has_published_tensor_names_and_shapes(tmp_path):
    config = DrafterConfig.from_file(TINY_V2)
    drafter = DFlashDrafter(config)
    _randomize(drafter, seed=3)
    save_drafter(drafter, tmp_path)

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        saved = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    assert saved == _header()
    assert not any("embed_tokens" in k or "lm_head" in k or "rotary" in k for k in saved)

    raw = json.loads((tmp_path / "config.json").read_text())
    published = json.loads((TINY_V2 / "config.json").read_text())
    published.pop("transformers_version")
    # Every key of the published layout is written back with the same value and placement.
    assert {k: raw.get(k) for k in published} == published
    assert raw["architectures"] == ["DFlash2DraftModel"]
    assert raw["is_causal"] is False
    assert "block_size" not in raw and raw["dflash_config"]["block_size"] == 8
    assert "rope_theta" not in raw and raw["rope_parameters"] == {
        "rope_theta": 500000.0,
        "rope_type": "default",
    }
    assert DrafterConfig.from_dict(raw) == config

    loaded = read_drafter(tmp_path, torch.float32, "cpu")
    assert loaded.config == config
    original, reloaded = drafter.state_dict(), loaded.state_dict()
    assert original.keys() == reloaded.keys()
    for name, tensor in original.items():
        assert reloaded[name].dtype == torch.float32
        assert torch.equal(reloaded[name], tensor), name


def test_load_handmade_checkpoint_from_published_header(tmp_path):
    """A checkpoint written from the header alone (not by our save) loads tensor for tensor."""
    g = torch.Generator().manual_seed(4)
    tensors = {name: torch.randn(shape, generator=g) for name, shape in _header().items()}
    (tmp_path / "config.json").write_text((TINY_V2 / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    loaded = read_drafter(tmp_path, torch.float32, "cpu")
    state = loaded.state_dict()
    assert state.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(state[name], tensor), name
    # The published side index is 0 = pre, 1 = post (spec §1.3); our module keeps that order.
    conv = loaded.layers[1].mlp_conv
    assert torch.equal(conv.base_kernel[1], tensors["layers.1.mlp_conv.base_kernel"][1])


def test_load_keeps_rope_frequencies_in_float32(tmp_path):
    config = DrafterConfig.from_file(TINY_V2)
    drafter = DFlashDrafter(config)
    drafter.init_weights(seed=0)
    save_drafter(drafter, tmp_path)
    loaded = read_drafter(tmp_path, torch.bfloat16, "cpu")
    assert loaded.fc.weight.dtype == torch.bfloat16
    assert loaded.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(loaded.rotary.inv_freq, drafter.rotary.inv_freq)


@pytest.mark.parametrize(
    ("name", "replacement"),
    [
        ("layers.1.mlp_conv.base_kernel", None),
        ("candidate_selector.hidden_projection.weight", torch.zeros(64, 8)),
        ("layers.0.attention_conv.kernel_projection.weight", torch.zeros(32, 64)),
    ],
)
def test_load_rejects_missing_or_misshaped_tensor(tmp_path, name, replacement):
    config = DrafterConfig.from_file(TINY_V2)
    drafter = DFlashDrafter(config)
    drafter.init_weights(seed=0)
    save_drafter(drafter, tmp_path)
    path = tmp_path / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    if replacement is None:
        del tensors[name]
    else:
        tensors[name] = replacement
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        read_drafter(tmp_path, torch.float32, "cpu")


def test_load_weights_accepts_model_prefix_and_vendor_aliases():
    config = DrafterConfig.from_file(TINY_V2)
    source = DFlashDrafter(config)
    _randomize(source, seed=5)
    renamed = {}
    for key, value in source.state_dict().items():
        if key.startswith("layers.0."):
            key = "midlayer." + key.removeprefix("layers.0.")
        elif key.startswith("fc."):
            key = "encoder.fc." + key.removeprefix("fc.")
        elif key.startswith("hidden_norm."):
            key = "encoder.output_norm_enc." + key.removeprefix("hidden_norm.")
        renamed["model." + key] = value.clone()
    assert any(k.startswith("model.midlayer.") for k in renamed)
    target = DFlashDrafter(config)
    load_drafter_weights(target, renamed)
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value), key


def test_v1_layout_round_trips():
    raw = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "hidden_size": 64,
        "num_hidden_layers": 5,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "vocab_size": 96,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "block_size": 16,
        "num_target_layers": 36,
        "layer_types": ["full_attention"] * 5,
        "dflash_config": {"mask_token_id": 95, "target_layer_ids": [1, 9, 17, 25, 33]},
    }
    config = DrafterConfig.from_dict(raw)
    assert config.version == 1 and not config.has_conv and not config.has_selector
    assert config.block_size == 16 and config.rope_theta == 1e6
    assert config.target_layer_ids == (1, 9, 17, 25, 33) and config.num_target_layers == 36
    assert config.mask_token_id == 95
    assert not config.layer_is_causal(0)

    out = config.to_dict()
    assert out["architectures"] == ["DFlashDraftModel"]
    assert out["block_size"] == 16 and out["rope_theta"] == 1e6
    assert "rope_parameters" not in out and "is_causal" not in out
    assert out["dflash_config"] == {"mask_token_id": 95, "target_layer_ids": [1, 9, 17, 25, 33]}
    assert DrafterConfig.from_dict(out) == config

    # Without target_layer_ids the default formula of spec §1.1 applies.
    del raw["dflash_config"]["target_layer_ids"]
    assert DrafterConfig.from_dict(raw).target_layer_ids == (1, 9, 17, 25, 33)

    drafter = DFlashDrafter(config)
    assert not any("conv" in k or "candidate_selector" in k for k in drafter.state_dict())
    assert drafter.selector_weights() is None


@pytest.mark.parametrize(
    "overrides",
    [
        {"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 16},  # legacy rule (§2.4)
        {"extra": {"causal": True}},  # dflash_config.causal
        {"is_causal": True},
        {"is_causal": False, "layer_types": ("sliding_attention", "sliding_attention"), "sliding_window": 16},
        {},
    ],
)
def test_saved_config_keeps_layer_causality(overrides):
    """Writing and re-reading a DFlash 2 config must not change which layers are causal."""
    config = dataclasses.replace(tiny_drafter_config(2), **overrides)
    reread = DrafterConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    for layer in range(config.num_hidden_layers):
        assert reread.layer_is_causal(layer) == config.layer_is_causal(layer), layer
        assert reread.layer_window(layer) == config.layer_window(layer), layer


def test_half_set_conv_or_selector_is_rejected():
    base = tiny_drafter_config(2)
    with pytest.raises(ValueError, match="conv_"):
        dataclasses.replace(base, conv_kernel_size=0)
    with pytest.raises(ValueError, match="selector_"):
        dataclasses.replace(base, selector_top_k=0)


# ---- 3. default target_layer_ids (spec §1.1, §10) ----------------------------------------------


@pytest.mark.parametrize(
    ("num_target_layers", "num_draft_layers", "expected"),
    [
        (36, 5, [1, 9, 17, 25, 33]),
        (64, 5, [1, 16, 31, 46, 61]),
        (52, 5, [1, 13, 25, 37, 49]),
        (33, 4, [1, 11, 20, 30]),  # fractional step: rounded, not truncated
        (30, 5, [1, 8, 14, 20, 27]),  # Python round (half to even) as in spec §1.1
        (36, 1, [18]),
        (27, 1, [13]),
    ],
)
def test_default_target_layer_ids(num_target_layers, num_draft_layers, expected):
    assert default_target_layer_ids(num_target_layers, num_draft_layers) == expected


# ---- 4. convolution invariants (spec §3.2, §3.3, §10) ------------------------------------------


def _reference_conv(conv: DynamicConv, x: torch.Tensor, y: torch.Tensor, side: int) -> torch.Tensor:
    """Direct per-channel loop of spec §3.2 with flat index side·K·G + tap·G + group."""
    num_rows, block, hidden = x.shape
    k_taps, g = conv.kernel_size, conv.group_size
    groups = hidden // g
    w = conv.kernel_projection.weight.tolist()  # [2·K·G, H]
    base = conv.base_kernel.tolist()  # [2, K, H]
    xs, ys = x.tolist(), y.tolist()
    out = [[[0.0] * hidden for _ in range(block)] for _ in range(num_rows)]
    for r in range(num_rows):
        for t in range(block):
            flat = [sum(wi * xi for wi, xi in zip(row, xs[r][t])) for row in w]
            for c in range(hidden):
                acc = 0.0
                for j in range(k_taps):
                    if t - j < 0:
                        continue
                    coeff = base[side][j][c] + flat[side * k_taps * groups + j * groups + c // g]
                    acc += coeff * ys[r][t - j][c]
                out[r][t][c] = acc
    return torch.tensor(out)


@torch.no_grad()
@pytest.mark.parametrize(("hidden", "group_size", "kernel_size"), [(32, 8, 2), (24, 4, 3)])
def test_dynamic_conv_matches_direct_loop(hidden, group_size, kernel_size):
    conv = DynamicConv(hidden, group_size, kernel_size)
    _randomize(conv, seed=6, std=0.5)
    assert conv.kernel_projection.weight.shape == (2 * kernel_size * (hidden // group_size), hidden)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 5, hidden, generator=g)
    y = torch.randn(2, 5, hidden, generator=g)
    coeff = conv.coefficients(x)
    assert coeff.shape == (2, 5, 2, kernel_size, hidden)
    for side in (0, 1):
        signal = x if side == 0 else y
        expected = _reference_conv(conv, x, signal, side)
        assert torch.allclose(DynamicConv.convolve(signal, coeff[:, :, side]), expected, atol=1e-5), side


@torch.no_grad()
def test_identity_conv_is_exact_identity():
    conv = DynamicConv(32, 8, 2)
    x = torch.randn(2, 6, 32)
    y = torch.randn(2, 6, 32)
    coeff = conv.coefficients(x)
    assert torch.equal(DynamicConv.convolve(x, coeff[:, :, 0]), x)
    assert torch.equal(DynamicConv.convolve(y, coeff[:, :, 1]), y)


@torch.no_grad()
def test_conv_position_zero_and_causality_within_block():
    conv = DynamicConv(32, 8, 2)
    _randomize(conv, seed=8, std=0.5)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(1, 6, 32, generator=g)
    y = torch.randn(1, 6, 32, generator=g)
    for t in range(6):
        x2, y2 = x.clone(), y.clone()
        x2[:, t + 1 :] += torch.randn(1, 5 - t, 32, generator=g)
        y2[:, t + 1 :] += torch.randn(1, 5 - t, 32, generator=g)
        c, c2 = conv.coefficients(x), conv.coefficients(x2)
        for side, (a, b) in enumerate(((x, x2), (y, y2))):
            out = DynamicConv.convolve(a, c[:, :, side])
            out2 = DynamicConv.convolve(b, c2[:, :, side])
            assert torch.equal(out[:, : t + 1], out2[:, : t + 1]), (t, side)
    # Non-vacuous: position 1 does read position 0 (tap 1).
    y3 = y.clone()
    y3[:, 0] += 1.0
    c = conv.coefficients(x)
    assert not torch.allclose(DynamicConv.convolve(y3, c[:, :, 1])[:, 1], DynamicConv.convolve(y, c[:, :, 1])[:, 1])


@torch.no_grad()
def test_conv_batched_rows_equal_single_rows():
    conv = DynamicConv(32, 8, 2)
    _randomize(conv, seed=10, std=0.5)
    x = torch.randn(2, 6, 32)
    y = torch.randn(2, 6, 32)
    both = DynamicConv.convolve(y, conv.coefficients(x)[:, :, 1])
    for r in range(2):
        alone = DynamicConv.convolve(y[r : r + 1], conv.coefficients(x[r : r + 1])[:, :, 1])
        assert torch.allclose(both[r : r + 1], alone, atol=1e-5, rtol=1e-5)


def _layer_inputs(drafter: DFlashDrafter, starts: list[int], block: int, seed: int):
    """Block hidden, rotary tables, random context K/V (zeros past each start) and the mask."""
    c = drafter.config
    g = torch.Generator().manual_seed(seed)
    starts_t = torch.tensor(starts)
    context_len = max(starts)
    h = torch.randn(len(starts), block, c.hidden_size, generator=g)
    positions = starts_t[:, None] + torch.arange(block)[None]
    cos, sin = drafter.rotary(positions, torch.float32)
    ctx_k = torch.randn(len(starts), c.num_key_value_heads, context_len, c.head_dim, generator=g)
    ctx_v = torch.randn(len(starts), c.num_key_value_heads, context_len, c.head_dim, generator=g)
    for r, s in enumerate(starts):
        ctx_k[r, :, s:] = 0
        ctx_v[r, :, s:] = 0
    mask = drafter.block_mask(starts_t, block, context_len, 0)
    return h, cos, sin, ctx_k, ctx_v, mask


@torch.no_grad()
def test_causal_draft_layer_position_zero_ignores_later_positions():
    config = dataclasses.replace(tiny_drafter_config(2, block_size=6), is_causal=True)
    drafter = DFlashDrafter(config)
    _randomize(drafter, seed=11)
    layer = drafter.layers[0]
    h, cos, sin, ctx_k, ctx_v, mask = _layer_inputs(drafter, [7], 6, seed=12)
    out = layer(h, cos, sin, ctx_k, ctx_v, mask)
    for t in range(5):
        h2 = h.clone()
        h2[:, t + 1 :] += torch.randn(1, 5 - t, config.hidden_size)
        out2 = layer(h2, cos, sin, ctx_k, ctx_v, mask)
        assert torch.allclose(out2[:, : t + 1], out[:, : t + 1], atol=1e-6, rtol=0), t
        assert not torch.allclose(out2[:, t + 1], out[:, t + 1], atol=1e-4), t


@torch.no_grad()
def test_draft_layer_batched_rows_equal_single_rows():
    drafter = DFlashDrafter(tiny_drafter_config(2, block_size=5))
    _randomize(drafter, seed=13)
    layer = drafter.layers[1]
    h, cos, sin, ctx_k, ctx_v, mask = _layer_inputs(drafter, [3, 8], 5, seed=14)
    both = layer(h, cos, sin, ctx_k, ctx_v, mask)
    for r, s in enumerate([3, 8]):
        single_mask = drafter.block_mask(torch.tensor([s]), 5, s, 1)
        alone = layer(
            h[r : r + 1],
            cos[r : r + 1],
            sin[r : r + 1],
            ctx_k[r : r + 1, :, :s],
            ctx_v[r : r + 1, :, :s],
            single_mask,
        )
        assert torch.allclose(both[r : r + 1], alone, atol=1e-5), r


@torch.no_grad()
def test_post_side_coefficients_come_from_pre_sublayer_input():
    drafter = DFlashDrafter(tiny_drafter_config(2, block_size=5))
    _randomize(drafter, seed=15, std=0.2)
    layer: DraftLayer = drafter.layers[0]
    h, cos, sin, ctx_k, ctx_v, mask = _layer_inputs(drafter, [2, 6], 5, seed=16)

    def run(attn_post_from: str, mlp_post_from: str) -> torch.Tensor:
        u = layer.input_layernorm(h)
        ca = layer.attention_conv.coefficients(u)
        u2 = DynamicConv.convolve(u, ca[:, :, 0])
        a = layer.self_attn(u2, cos, sin, ctx_k, ctx_v, mask)
        post = {
            "pre": ca,
            "convolved": layer.attention_conv.coefficients(u2),
            "output": layer.attention_conv.coefficients(a),
        }
        x = h + DynamicConv.convolve(a, post[attn_post_from][:, :, 1])
        m = layer.post_attention_layernorm(x)
        cm = layer.mlp_conv.coefficients(m)
        m2 = DynamicConv.convolve(m, cm[:, :, 0])
        y = layer.mlp(m2)
        post = {
            "pre": cm,
            "convolved": layer.mlp_conv.coefficients(m2),
            "output": layer.mlp_conv.coefficients(y),
        }
        return x + DynamicConv.convolve(y, post[mlp_post_from][:, :, 1])

    out = layer(h, cos, sin, ctx_k, ctx_v, mask)
    assert torch.allclose(out, run("pre", "pre"), atol=1e-6)
    for wrong in (("convolved", "pre"), ("output", "pre"), ("pre", "convolved"), ("pre", "output")):
        assert not torch.allclose(out, run(*wrong), atol=1e-4), wrong


# ---- 5. attention mask (spec §2.4) -------------------------------------------------------------


def _expected_mask(starts, block, context_len, causal, window):
    rows = []
    for s in starts:
        row = []
        for q in range(block):
            pos = s + q
            ctx = [j < s and (window is None or pos - j < window) for j in range(context_len)]
            blk = [not causal or b <= q for b in range(block)]
            row.append(ctx + blk)
        rows.append([row])
    return torch.tensor(rows)


@pytest.mark.parametrize(
    ("overrides", "layer", "causal", "window"),
    [
        ({}, 0, False, None),
        ({"is_causal": True}, 1, True, None),
        (
            {"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 3, "is_causal": False},
            0,
            False,
            3,
        ),
        (
            {"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 3, "is_causal": False},
            1,
            False,
            None,
        ),
        # Legacy rule: with no is_causal, a sliding layer is causal and a full layer is not.
        ({"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 3}, 0, True, 3),
        ({"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 3}, 1, False, None),
    ],
)
def test_block_mask(overrides, layer, causal, window):
    drafter = DFlashDrafter(dataclasses.replace(tiny_drafter_config(1, block_size=4), **overrides))
    starts = [3, 6, 0]
    mask = drafter.block_mask(torch.tensor(starts), 4, 8, layer)
    assert mask.dtype == torch.bool and mask.shape == (3, 1, 4, 12)
    assert torch.equal(mask, _expected_mask(starts, 4, 8, causal, window))


def test_block_mask_literal_values():
    config = dataclasses.replace(
        tiny_drafter_config(1, block_size=4),
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=3,
        is_causal=False,
    )
    drafter = DFlashDrafter(config)
    mask = drafter.block_mask(torch.tensor([6]), 4, 8, 0)[0, 0]
    # Query at position 6 sees context 4, 5 (6 − j < 3); query at 9 sees no context at all.
    assert mask[0, :8].tolist() == [False, False, False, False, True, True, False, False]
    assert mask[1, :8].tolist() == [False] * 5 + [True, False, False]
    assert not mask[3, :8].any()
    assert mask[:, 8:].all()
    full = drafter.block_mask(torch.tensor([6]), 4, 8, 1)[0, 0]
    assert full[3, :8].tolist() == [True] * 6 + [False, False]


# ---- 6. vocab mismatch ---------------------------------------------------------------------------


def test_check_drafter_matches_rejects_other_vocab():
    target = tiny_target("qwen3")
    check_drafter_matches(DFlashDrafter(tiny_drafter_config(2, vocab_size=96)), target)
    other = DFlashDrafter(tiny_drafter_config(2, vocab_size=80))
    with pytest.raises(ModelLoadError, match="vocab"):
        check_drafter_matches(other, target)
    with pytest.raises(ValueError, match="different target"):
        other.bind_target(target.embed_tokens.weight, target.lm_head.weight)


def test_rope_frequencies_stay_float32_under_bfloat16():
    from tests.tiny import tiny_drafter_config as _cfg

    drafter = DFlashDrafter(_cfg(2, 8, 96)).to(dtype=torch.bfloat16)
    assert drafter.rotary.inv_freq.dtype == torch.float32


def test_output_multiplier_and_softcap_transform_the_logits():
    from tests.tiny import tiny_drafter, tiny_target

    target = tiny_target()
    plain = tiny_drafter(target, 2, 8)
    hidden = torch.randn(2, 3, 64)
    raw = plain.logits(hidden)
    scaled = tiny_drafter(target, 2, 8)
    scaled.config = dataclasses.replace(plain.config, output_multiplier=0.25, final_logit_softcapping=2.0)
    expected = 2.0 * torch.tanh(raw * 0.25 / 2.0)
    assert torch.allclose(scaled.logits(hidden), expected, atol=1e-6)
    assert scaled.logits(hidden).abs().max() < 2.0
    # the published config keys round-trip
    raw_config = scaled.config.to_dict()
    assert raw_config["dflash_config"]["output_multiplier"] == 0.25
    assert raw_config["dflash_config"]["final_logit_softcapping"] == 2.0


# ---- published configs read as the reference loaders read them (spec §1.1, §1.2) ----------------


def _raw_config(**overrides):
    raw = json.loads((TINY_V2 / "config.json").read_text())
    raw.update(overrides)
    return raw


YARN = {"rope_theta": 1e7, "rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096}


def test_scaled_rope_reaches_the_drafters_rotary_embedding():
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = DrafterConfig.from_dict(_raw_config(rope_parameters=YARN, max_position_embeddings=262144))
    assert config.rope_parameters == YARN and config.rope_theta == 1e7
    reference = Qwen3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
        max_position_embeddings=262144, rope_parameters=dict(YARN),
    )  # fmt: skip
    inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](reference, torch.device("cpu"))
    rotary = DFlashDrafter(config).rotary
    torch.testing.assert_close(rotary.inv_freq, inv_freq.float())
    assert rotary.scaling == pytest.approx(scaling) and scaling != 1.0
    plain = DFlashDrafter(DrafterConfig.from_dict(_raw_config())).rotary
    assert not torch.allclose(plain.inv_freq, rotary.inv_freq)


def test_legacy_rope_scaling_is_read_and_scaled_rope_round_trips(tmp_path):
    legacy = _raw_config(rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=1e6)
    del legacy["rope_parameters"]
    config = DrafterConfig.from_dict(legacy)
    assert config.rope_parameters == {"rope_theta": 1e6, "rope_type": "linear", "factor": 2.0}
    config.save(tmp_path)
    assert DrafterConfig.from_file(tmp_path) == config
    assert json.loads((tmp_path / "config.json").read_text())["rope_parameters"]["rope_type"] == "linear"


@pytest.mark.parametrize("rope_type", ["dynamic", "made-up"])
def test_unsupported_rope_types_are_rejected(rope_type):
    with pytest.raises(ValueError, match="rope_type"):
        DrafterConfig.from_dict(_raw_config(rope_parameters={"rope_theta": 1e6, "rope_type": rope_type, "factor": 2.0}))


def test_sliding_windows_follow_the_hugging_face_rule():
    without_flag = _raw_config()
    del without_flag["use_sliding_window"]
    assert DrafterConfig.from_dict(without_flag).layer_window(0) is None  # as z-lab's, SGLang's, vLLM's loaders
    assert DrafterConfig.from_dict(_raw_config(use_sliding_window=False)).layer_window(0) is None
    assert DrafterConfig.from_dict(_raw_config()).layer_window(1) == 32
    no_types = _raw_config(max_window_layers=1)
    del no_types["layer_types"]
    config = DrafterConfig.from_dict(no_types)
    assert config.layer_types == ("full_attention", "sliding_attention") and config.layer_window(1) == 32


def test_saved_windows_load_in_the_reference_layout(tmp_path):
    from transformers import Qwen3Config

    config = DrafterConfig.from_file(TINY_V2)
    config.save(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["use_sliding_window"] is True and raw["sliding_window"] == 32
    reference = Qwen3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "dflash_config")})
    assert reference.sliding_window == 32 and reference.layer_types == ["sliding_attention"] * 2
    assert DrafterConfig.from_file(tmp_path) == config


def test_load_skips_derived_rotary_tensors():
    config = DrafterConfig.from_file(TINY_V2)
    source = DFlashDrafter(config)
    _randomize(source, seed=6)
    state = {k: v.clone() for k, v in source.state_dict().items()}
    state["layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(6)
    state["rotary_emb.inv_freq"] = torch.ones(6)
    loaded = DFlashDrafter(config)
    load_drafter_weights(loaded, state)
    assert torch.equal(loaded.fc.weight, source.fc.weight)
