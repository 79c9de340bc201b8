"""``RunnerSpec``: a runner's settings, resolved once and handed whole to the model runner, its draft
runner and the tensor-parallel workers' runners."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunnerSpec:
    """What a :class:`~dflash2.runner.ModelRunner` is built with (besides its models); the engine resolves
    it from its ``EngineSpec`` and ``EngineConfig``, a tensor-parallel worker receives rank 0's.

    Attributes:
        num_slots: KV slots (``max_num_seqs``); the runner adds one scratch slot for padding.
        max_model_len: positions per slot.
        block_size: B, tokens per verify forward (1 = autoregressive).
        enforce_eager: never compile.
        deterministic: the engine runs its steps batch-invariant
            (:func:`dflash2.models.layers.batch_invariant`); forwards then run eagerly, because the compiled
            graphs fuse and reorder the very reductions that mode fixes.
        dynamic_threads: the engine changes torch's CPU thread count while it runs (``dflash2/threads.py``):
            compiled kernels then read the count when they run.
        use_selector: the drafted path walks the DFlash 2 lattice (``EngineConfig.use_selector``).
        tree_nodes: drafted nodes of a token tree (``EngineConfig.speculative_num_draft_tokens``) when steps
            verify trees (``speculative_topk`` > 1), else 0; builds the tree-masked graph.
        defer_compile: on CPU in one process, build the modules to compile but run eagerly until
            :meth:`~dflash2.runner.ModelRunner.load_deferred_graphs` loads the graphs another process
            compiled and saved (the server's background compilation); elsewhere the graphs are compiled at
            construction, as without it.
        zeroed_caches: False leaves the KV caches uninitialised, so their pages stay unbacked until written
            (the compile worker, which writes only the scratch slot). True for every runner that serves.
    """

    num_slots: int
    max_model_len: int
    block_size: int
    enforce_eager: bool = False
    deterministic: bool = False
    dynamic_threads: bool = False
    use_selector: bool = True
    tree_nodes: int = 0
    defer_compile: bool = False
    zeroed_caches: bool = True

    @property
    def eager(self) -> bool:
        """Every forward runs eagerly: asked for, or deterministic."""
        return self.enforce_eager or self.deterministic

    @property
    def scratch_slot(self) -> int:
        """The slot padding rows read and write (after the request slots)."""
        return self.num_slots
