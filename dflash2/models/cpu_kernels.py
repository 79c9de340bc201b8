"""The bfloat16 linear kernel for x86 CPUs without native bfloat16 arithmetic.

On CPUs with AVX2 and FMA but neither AVX512-BF16 nor AMX (e.g. AMD Zen 2/3, Intel before Cooper
Lake), oneDNN does not run bfloat16 matrices and ATen's generic fallback multiplies a verify block
of 8 rows at about 2 GB/s of weights (measured: the 210 decoder linears and LM head of SmolLM2-135M
took 126 ms for 8 rows, 20 ms for one, against 9–25 ms for either at the memory bandwidth).
``csrc/bf16_linear.cpp`` is a small matrix kernel for exactly this case: weights pre-packed into
blocks of 24 output features, expanded to float32 in registers (a bfloat16 is the top half of a
float32), float32 accumulation; see the file's header. Like llama.cpp's CPU matrix-vector kernels
it is written for few rows: decoding and verify blocks.

It is built from source the first time it is needed (``torch.utils.cpp_extension``, with the C++
compiler inductor uses; about 10 s on 2 cores) into ``<dflash2 cache>/kernels/<hash>``, and loaded from
there afterwards. When it cannot be built, :func:`available` is False and the caller keeps the
plain PyTorch path (with a warning).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
import threading

import torch

logger = logging.getLogger(__name__)

BLOCK = 24  # output features per packed block (kBlock in the C++ source)
PAIRED = 16  # of which the first 16 are stored as pairs in 32-bit lanes, the last 8 singly
SOURCE = pathlib.Path(__file__).with_name("csrc") / "bf16_linear.cpp"
_lock = threading.Lock()


def supported_cpu() -> bool:
    """True on an x86-64 Linux CPU with AVX2 and FMA (what the kernel's instructions need)."""
    from dflash2.platform import cpu_flags

    return {"avx2", "fma"} <= cpu_flags()


def build_dir() -> pathlib.Path:
    """``<dflash2 cache>/kernels/<hash of the source and the torch version>``."""
    from dflash2.models.source import cache_dir

    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"bf16_linear-{key}"


@functools.cache
def _load() -> bool:
    if not supported_cpu():
        return False
    if os.environ.get("DFLASH2_DISABLE_CPU_KERNELS", "") not in ("", "0"):
        logger.info("DFLASH2_DISABLE_CPU_KERNELS is set: the bfloat16 CPU kernel is not used")
        return False
    from torch.utils.cpp_extension import load

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    built = any(directory.glob("*.so"))
    if not built:
        logger.info("building the bfloat16 CPU linear kernel (once, about 10 s) in %s", directory)
    try:
        load(
            name="dflash2_bf16_linear",
            sources=[str(SOURCE)],
            # -fopenmp: at::parallel_for's OpenMP loop is in the header (without it, one thread). The
            # library links libgomp.so.1 by name, which resolves to the copy torch already loaded.
            extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
    except Exception as error:  # a missing compiler, a failed build or load
        logger.warning("the bfloat16 CPU kernel could not be built (%s): bfloat16 linears run in PyTorch", error)
        return False

    @torch.library.register_fake("dflash2::bf16_linear")
    def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], out_features))

    return True


def available() -> bool:
    """Whether ``torch.ops.dflash2.bf16_linear`` can run here: an AVX2 + FMA CPU and the kernel built
    (now, the first time; cached) and loaded. Never raises; False after a failed build (logged)."""
    with _lock:
        return _load()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """Pack a bfloat16 ``[N, K]`` weight into the kernel's layout ``[⌈N/24⌉, 24·K]``.

    Row ``b`` holds output features ``24b … 24b + 23``: first ``K × 16`` pairs, where within one
    ``k`` place ``2i`` holds feature ``24b + i`` and place ``2i + 1`` feature ``24b + 8 + i`` (so one
    32-bit lane holds a pair that the kernel splits into two float32 vectors with a shift and a mask),
    then ``K × 8`` singles, features ``24b + 16 … 24b + 23``. Features past ``N`` are zero.

    Raises:
        ValueError: when ``weight`` is not a 2-D bfloat16 CPU tensor.
    """
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        raise ValueError("pack() takes a 2-D bfloat16 CPU weight")
    n, k = weight.shape
    blocks = -(-n // BLOCK)
    padded = weight.detach().new_zeros(blocks * BLOCK, k).view(blocks, BLOCK, k)
    padded.view(blocks * BLOCK, k)[:n] = weight.detach()
    # [blocks, half, i, K] → [blocks, K, i, half]: place 2i + half holds feature 24b + 8·half + i.
    pairs = padded[:, :PAIRED].reshape(blocks, 2, PAIRED // 2, k).permute(0, 3, 2, 1).reshape(blocks, k * PAIRED)
    singles = padded[:, PAIRED:].transpose(1, 2).reshape(blocks, k * (BLOCK - PAIRED))
    return torch.cat([pairs, singles], dim=1).contiguous()


def unpack(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The dense ``[out_features, K]`` weight back from :func:`pack`'s layout (for checks)."""
    blocks, width = packed.shape
    k = width // BLOCK
    pairs = packed[:, : k * PAIRED].reshape(blocks, k, PAIRED // 2, 2).permute(0, 3, 2, 1)
    singles = packed[:, k * PAIRED :].reshape(blocks, k, BLOCK - PAIRED).transpose(1, 2)
    dense = torch.cat([pairs.reshape(blocks, PAIRED, k), singles], dim=1).reshape(blocks * BLOCK, k)
    return dense[:out_features].contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x [..., K]`` (bfloat16 or float32) times the packed weight (plus ``bias [N]``) → ``[..., N]``
    in ``x``'s dtype, accumulated in float32. Requires :func:`available`."""
    return torch.ops.dflash2.bf16_linear(x, packed, bias, out_features)
