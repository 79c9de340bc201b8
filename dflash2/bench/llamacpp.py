"""llama.cpp through ``llama-cpp-python``: batch-1 generation from token ids, timed like the others.

NOTE: this module imports only the standard library and ``llama_cpp``. The benchmark loads it by
file path inside its own worker process, so that process never imports torch and its peak RSS is
llama.cpp's alone.
"""

from __future__ import annotations

import time
from typing import Any


class LlamaCppRunner:
    """One GGUF loaded by ``llama_cpp.Llama``; sampling set to match this engine's.

    Greedy at T=0; at T>0 plain temperature sampling over the full vocabulary (top-k, top-p,
    min-p, typical-p and the repeat penalty switched off; llama-cpp-python's defaults are not).
    The KV cache is reset before every prompt, so no prefix is reused between prompts.
    """

    def __init__(self, gguf: str, n_ctx: int, n_threads: int, eos_token_ids: list[int], gpu: bool, seed: int) -> None:
        import llama_cpp

        self.gguf = gguf
        self.n_threads = n_threads
        self.n_gpu_layers = -1 if gpu and llama_cpp.llama_supports_gpu_offload() else 0
        self.llm = llama_cpp.Llama(
            model_path=gguf,
            n_ctx=n_ctx,
            n_threads=n_threads,
            n_threads_batch=n_threads,
            n_batch=512,
            n_gpu_layers=self.n_gpu_layers,
            seed=seed,
            verbose=False,
        )
        self.stop_ids = {int(t) for t in eos_token_ids} | {int(self.llm.token_eos())}

    def describe(self) -> dict[str, Any]:
        """Version, file, threads and GPU offload."""
        import llama_cpp

        return {
            "llama_cpp_python": getattr(llama_cpp, "__version__", "?"),
            "gguf": self.gguf,
            "n_threads": self.n_threads,
            "n_gpu_layers": self.n_gpu_layers,
        }

    def generate(self, prompt_ids: list[int], max_tokens: int, temperature: float, seed: int) -> dict[str, Any]:
        """One completion; returns the fields of ``runners.GenerationSample`` that apply."""
        self.llm.reset()
        self.llm.set_seed(seed)
        num_output = 0
        first = None
        start = time.perf_counter()
        tokens = self.llm.generate(
            prompt_ids,
            top_k=0,
            top_p=1.0,
            min_p=0.0,
            typical_p=1.0,
            temp=temperature,
            repeat_penalty=1.0,
            reset=True,
        )
        for token in tokens:
            num_output += 1
            if first is None:
                first = time.perf_counter()
            if int(token) in self.stop_ids or num_output >= max_tokens:
                break
        end = time.perf_counter()
        return {
            "num_prompt_tokens": len(prompt_ids),
            "num_output_tokens": num_output,
            "seconds": end - start,
            "ttft": (first or end) - start,
        }
