"""dflash2: a speculative-decoding inference engine built around DFlash 2 block drafters.

The public surface is ``LLM`` and ``SamplingParams``; ``Engine`` and ``EngineConfig`` are
for servers and benchmarks that drive steps themselves.
"""

from dflash2.api import LLM, Completion
from dflash2.config import EngineConfig
from dflash2.engine import Engine
from dflash2.outputs import RequestOutput, StepResult, StepStats
from dflash2.sampling import SamplingParams

__all__ = [
    "LLM",
    "Completion",
    "Engine",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
    "StepResult",
    "StepStats",
]
__version__ = "0.1.0"
