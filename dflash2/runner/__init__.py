"""The model runner: the target, the drafter, their caches and the forwards of one step.

| module | holds |
|---|---|
| ``model_runner.py`` | ``ModelRunner``: prefill, verify (chains and token trees), the tree's K/V commit, the slots |
| ``draft_runner.py`` | ``DraftRunner``: drafter context cache, propose (``Drafted``), the lattice, context writes |
| ``compile.py`` | compiler settings, the modules the graphs are built from, building and warming the graphs |
| ``settings.py`` | ``RunnerSpec``: the runner's settings, handed whole to the runner, its draft runner and TP workers |
| ``graph_inputs.py`` | static-shape forwards' inputs: slots, padding, key lengths, buckets; ``PendingWrites`` |
| ``costs.py`` | ``measure_costs``: the decode forwards timed for the adaptive policy |
"""

from dflash2.runner.compile import inductor_cache_dir
from dflash2.runner.draft_runner import Drafted, DraftRunner
from dflash2.runner.graph_inputs import PendingWrites, key_length
from dflash2.runner.model_runner import ModelRunner, check_deterministic
from dflash2.runner.settings import RunnerSpec

__all__ = [
    "DraftRunner",
    "Drafted",
    "ModelRunner",
    "PendingWrites",
    "RunnerSpec",
    "check_deterministic",
    "inductor_cache_dir",
    "key_length",
]
