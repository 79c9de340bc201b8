"""Speculative decoding's algorithm: pure functions and small state over tensors, no models or caches.

The math is specified in docs/dflash2-spec.md; "spec §N" below names its sections.

| module | holds |
|---|---|
| ``selector.py`` | the drafter's top-k candidates, the lattice scores and the path walk (spec §4); ``Proposal`` |
| ``verify.py`` | greedy and rejection-sampling acceptance of a proposal against the target (spec §5.2) |
| ``tree.py`` | token trees: the beam over the selector lattice, the tree mask, lossless tree acceptance (spec §6) |
| ``adaptive.py`` | the cost model, acceptance estimates and the width / source choice per step |
| ``prompt_lookup.py`` | n-gram continuations from a request's own tokens (drafts without a drafter) |
| ``suffix.py`` | n-gram continuations from recent finished requests' outputs (drafts across requests) |

Nothing here imports the engine, the runner or the server; the engine's policy and executor call in.
"""
