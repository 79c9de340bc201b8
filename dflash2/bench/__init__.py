"""``dflash2 bench``: single-stream speed against peers, serving load, and a report.

Modules, one concern each:

| module | role |
|---|---|
| ``config.py`` | ``BenchConfig`` (frozen) and ``MethodSpec``: what to measure |
| ``workload.py`` | the prompt sets as token ids, identical for every method |
| ``runners.py`` | one generation per call: this engine, transformers ``generate`` (optionally prompt lookup) |
| ``llamacpp.py`` | the llama.cpp runner (standard library + ``llama_cpp`` only, so its process carries no torch) |
| ``worker.py`` | the child process that holds one method, and the parent's handle on it |
| ``conv_probe.py`` | drafter forward timed with and without the DFlash 2 dynamic convolutions |
| ``gguf_export.py`` | a GGUF of the same weights for llama.cpp |
| ``single_stream.py`` | warm-up, interleaved repetitions, collection |
| ``stats.py`` | pure aggregation: medians, percentiles, speedups, cost split |
| ``serving.py`` | a server on loopback under concurrent streaming load |
| ``machine.py`` | machine description for the report |
| ``report.py`` | results.json, results.md and the PNG plots |
| ``run.py`` | ``run_bench``: the whole benchmark, in order |
"""

from dflash2.bench.config import BenchConfig, MethodSpec

__all__ = ["BenchConfig", "MethodSpec"]
