"""What the DFlash 2 dynamic convolutions cost: the drafter forward with and without them.

Method: during one extra greedy generation (not part of the timed repetitions), every call the
engine makes to ``DFlashDrafter.draft_hidden`` is intercepted. With the real inputs of that call
(the same draft cache, slots, anchors, positions and block size) the forward is timed
``repeats`` times with the convolutions and ``repeats`` times without them (every layer's
``attention_conv`` and ``mlp_conv`` set to None, which the layer skips), alternating which goes
first. ``draft_hidden`` only reads the cache, so the timed calls change nothing; the engine then
gets the result of an ordinary call and decodes on as usual. The overhead is the median over all
pairs of (with − without); it covers the coefficient projections and the four convolutions per
layer, nothing else.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from dflash2.bench.runners import synchronize
from dflash2.models.drafter import DFlashDrafter

if TYPE_CHECKING:
    from dflash2.bench.runners import EngineRunner


@contextmanager
def convs_disabled(drafter: DFlashDrafter) -> Iterator[None]:
    """Run the drafter without its dynamic convolutions inside the ``with`` block (restored after)."""
    layers = drafter.draft_layers()
    saved = [(layer.attention_conv, layer.mlp_conv) for layer in layers]
    try:
        for layer in layers:
            layer.attention_conv, layer.mlp_conv = None, None
        yield
    finally:
        for layer, (attention_conv, mlp_conv) in zip(layers, saved):
            layer.attention_conv, layer.mlp_conv = attention_conv, mlp_conv


def _timed(call: Callable[[], Any], drafter: DFlashDrafter) -> float:
    device = drafter.device
    synchronize(device)
    start = time.perf_counter()
    call()
    synchronize(device)
    return time.perf_counter() - start


def measure_conv_overhead(
    runner: EngineRunner, prompt_ids: list[int], max_tokens: int, repeats: int = 3
) -> dict[str, Any]:
    """Paired timings of ``draft_hidden`` with and without convolutions over one generation.

    Returns:
        ``{"num_calls", "num_pairs", "with_conv_ms", "without_conv_ms", "overhead_ms",
        "overhead_fraction_of_forward"}`` (medians), or ``{"skipped": reason}``.
    """
    drafter = runner.engine.drafter
    if drafter is None or not drafter.config.has_conv:
        return {"skipped": "the drafter has no dynamic convolutions"}
    if runner.engine.runner.drafter_compiled:
        # Its graph was built with the convolutions; the method's eager row (--enforce-eager) times them.
        return {"skipped": "the drafter runs compiled (see the eager row)"}
    original = drafter.draft_hidden
    with_conv: list[float] = []
    without_conv: list[float] = []

    def probed(*args: Any, **kwargs: Any) -> Any:
        def call() -> Any:
            return original(*args, **kwargs)

        for i in range(repeats):
            if i % 2 == 0:  # alternate the order, so neither variant always runs second (warmer caches)
                on = _timed(call, drafter)
                with convs_disabled(drafter):
                    off = _timed(call, drafter)
            else:
                with convs_disabled(drafter):
                    off = _timed(call, drafter)
                on = _timed(call, drafter)
            with_conv.append(on)
            without_conv.append(off)
        return call()

    setattr(drafter, "draft_hidden", probed)  # noqa: B010 - an instance attribute shadows the method here only
    try:
        runner.generate(prompt_ids, max_tokens, 0.0, seed=0)
    finally:
        delattr(drafter, "draft_hidden")
    if not with_conv:
        return {"skipped": "the drafter was never called"}
    differences = [a - b for a, b in zip(with_conv, without_conv)]
    with_ms, without_ms = statistics.median(with_conv) * 1e3, statistics.median(without_conv) * 1e3
    overhead_ms = statistics.median(differences) * 1e3
    return {
        "num_calls": len(with_conv) // repeats,
        "num_pairs": len(with_conv),
        "with_conv_ms": with_ms,
        "without_conv_ms": without_ms,
        "overhead_ms": overhead_ms,
        "overhead_fraction_of_forward": overhead_ms / with_ms if with_ms else 0.0,
    }
