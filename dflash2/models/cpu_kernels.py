"""The project's bfloat16 linear kernels for x86 CPUs: few rows (decoding, verify blocks, small batches).

Decoding multiplies 1 … 16 rows by every weight matrix, so a forward's cost is reading the weights;
general matrix libraries are written for many rows and read them slower. Three kernels, like
llama.cpp's CPU matrix-vector kernels written for exactly this case, each with weights pre-packed
once at load into blocks of output features and float32 accumulation in a fixed order (a row's
result does not depend on the other rows):

- :data:`AVX512_BF16` (``csrc/bf16_dot_linear.cpp``, op ``dflash2::bf16_dot_linear``): CPUs with
  native bfloat16 dot products (AVX512-BF16: AMD Zen 4 and later, Intel Cooper Lake, Sapphire
  Rapids and later). ``vdpbf16ps`` on pairs of inputs, blocks of 32 outputs. oneDNN reads the
  weights there at about half the memory's speed for one row (docs/engine.md).
- :data:`AMX` (``csrc/bf16_amx_linear.cpp``, op ``dflash2::bf16_amx_linear``): CPUs with AMX (Intel
  Sapphire Rapids and later). The AVX512-BF16 kernel's packed weight read as tiles: one ``tdpbf16ps``
  multiplies up to 16 rows by 32 inputs of 16 outputs, so a verify block or a token tree of 16 rows
  costs about what one row does (with ``vdpbf16ps`` the arithmetic grows with the rows: on a 2-core
  Sapphire Rapids-class Xeon an 8-token verify of SmolLM2 cost 1.7× one token). Layers whose inputs are
  not a multiple of 32 run the AVX512-BF16 op on the same packed weight.
- :data:`AVX2` (``csrc/bf16_linear.cpp``, op ``dflash2::bf16_linear``): CPUs with AVX2 and FMA but
  no native bfloat16 (AMD Zen 2/3, Intel before Cooper Lake), where oneDNN and ATen fall back to
  generic code for bfloat16 matrices (an 8-row verify block of SmolLM2-135M: 126 ms of linears
  against 9–25 ms at the memory bandwidth). bfloat16 weights widened to float32 in registers,
  blocks of 24 outputs.

Each is built from source the first time it is needed (``torch.utils.cpp_extension``, with the C++
compiler inductor uses; about 10 s on 2 cores) into ``<dflash2 cache>/kernels/<name>-<hash>``, and
loaded from there afterwards. When it cannot be built, :meth:`CpuKernel.available` is False and the
caller takes the next path (with a warning). ``DFLASH2_DISABLE_CPU_KERNELS=1`` turns both off;
:func:`dflash2.models.layers.linear_backend` chooses between them and oneDNN
(``DFLASH2_CPU_KERNEL`` forces one).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import pathlib
import threading
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

BLOCK = 24  # output features per packed block of the AVX2 kernel (kBlock in bf16_linear.cpp)
PAIRED = 16  # of which the first 16 are stored as pairs in 32-bit lanes, the last 8 singly
DOT_BLOCK = 32  # output features per packed block of the AVX512-BF16 kernel (two vectors of 16)
_CSRC = pathlib.Path(__file__).with_name("csrc")
SOURCE = _CSRC / "bf16_linear.cpp"
_lock = threading.RLock()  # reentrant: the AMX kernel loads the AVX512-BF16 one inside its own load


def _check_weight(weight: torch.Tensor) -> None:
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        raise ValueError("pack() takes a 2-D bfloat16 CPU weight")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """Pack a bfloat16 ``[N, K]`` weight into the AVX2 kernel's layout ``[⌈N/24⌉, 24·K]``.

    Row ``b`` holds output features ``24b … 24b + 23``: first ``K × 16`` pairs, where within one
    ``k`` place ``2i`` holds feature ``24b + i`` and place ``2i + 1`` feature ``24b + 8 + i`` (so one
    32-bit lane holds a pair that the kernel splits into two float32 vectors with a shift and a mask),
    then ``K × 8`` singles, features ``24b + 16 … 24b + 23``. Features past ``N`` are zero.

    Raises:
        ValueError: when ``weight`` is not a 2-D bfloat16 CPU tensor.
    """
    _check_weight(weight)
    n, k = weight.shape
    blocks = -(-n // BLOCK)
    padded = weight.detach().new_zeros(blocks * BLOCK, k).view(blocks, BLOCK, k)
    padded.view(blocks * BLOCK, k)[:n] = weight.detach()
    # [blocks, half, i, K] → [blocks, K, i, half]: place 2i + half holds feature 24b + 8·half + i.
    pairs = padded[:, :PAIRED].reshape(blocks, 2, PAIRED // 2, k).permute(0, 3, 2, 1).reshape(blocks, k * PAIRED)
    singles = padded[:, PAIRED:].transpose(1, 2).reshape(blocks, k * (BLOCK - PAIRED))
    return torch.cat([pairs, singles], dim=1).contiguous()


def unpack(packed: torch.Tensor, out_features: int, in_features: int | None = None) -> torch.Tensor:
    """The dense ``[out_features, K]`` weight back from :func:`pack`'s layout (for checks)."""
    blocks, width = packed.shape
    k = width // BLOCK
    pairs = packed[:, : k * PAIRED].reshape(blocks, k, PAIRED // 2, 2).permute(0, 3, 2, 1)
    singles = packed[:, k * PAIRED :].reshape(blocks, k, BLOCK - PAIRED).transpose(1, 2)
    dense = torch.cat([pairs.reshape(blocks, PAIRED, k), singles], dim=1).reshape(blocks * BLOCK, k)
    return dense[:out_features].contiguous()


def pack_dot(weight: torch.Tensor) -> torch.Tensor:
    """Pack a bfloat16 ``[N, K]`` weight into the AVX512-BF16 kernel's layout ``[⌈N/32⌉, 64·⌈K/2⌉]``.

    Row ``b`` holds output features ``32b … 32b + 31``, one input pair after the other: for pair
    ``p``, 64 values ``[h][i][j] = W[32b + 16h + i][2p + j]`` (``h, j < 2``, ``i < 16``), the two
    64-byte operands of ``vdpbf16ps`` for 16 outputs each. Features past ``N`` and an odd ``K``'s
    last input are zero.

    Raises:
        ValueError: when ``weight`` is not a 2-D bfloat16 CPU tensor.
    """
    _check_weight(weight)
    n, k = weight.shape
    blocks, pairs = -(-n // DOT_BLOCK), -(-k // 2)
    padded = weight.detach().new_zeros(blocks * DOT_BLOCK, 2 * pairs)
    padded[:n, :k] = weight.detach()
    # [blocks, h, i, p, j] → [blocks, p, h, i, j]
    layout = padded.view(blocks, 2, DOT_BLOCK // 2, pairs, 2).permute(0, 3, 1, 2, 4)
    return layout.reshape(blocks, pairs * 2 * DOT_BLOCK).contiguous()


def unpack_dot(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The dense ``[out_features, in_features]`` weight back from :func:`pack_dot`'s layout (for checks)."""
    blocks, width = packed.shape
    pairs = width // (2 * DOT_BLOCK)
    dense = packed.view(blocks, pairs, 2, DOT_BLOCK // 2, 2).permute(0, 2, 3, 1, 4)
    return dense.reshape(blocks * DOT_BLOCK, 2 * pairs)[:out_features, :in_features].contiguous()


@dataclasses.dataclass(frozen=True)
class CpuKernel:
    """One of the project's bfloat16 linear kernels: its source, the CPU features it needs, its
    weight layout and its op.

    Attributes:
        name: ``"amx"``, ``"avx512bf16"`` or ``"avx2"`` (values of ``DFLASH2_CPU_KERNEL``).
        source: the C++ file, built on first use.
        cpu_flags: ``/proc/cpuinfo`` flags the instructions need.
        cflags: the compiler's instruction-set flags.
        op_name: the op in the ``dflash2`` namespace.
        block: output features per packed block.
        pack: ``[N, K]`` bfloat16 → the packed layout; unpack: its inverse ``(packed, N, K)`` (None for
            the quantized kernel, whose layout is :func:`dflash2.models.quant.pack`'s).
        extra_sources: more C++ files built into the same library (other ops needing the same flags).
    """

    name: str
    source: pathlib.Path
    cpu_flags: frozenset[str]
    cflags: tuple[str, ...]
    op_name: str
    block: int
    pack: Callable[[torch.Tensor], torch.Tensor] | None = None
    unpack: Callable[..., torch.Tensor] | None = None
    extra_sources: tuple[pathlib.Path, ...] = ()

    def supported_cpu(self) -> bool:
        """True on an x86-64 Linux CPU with the flags this kernel's instructions need."""
        from dflash2.platform import cpu_flags

        return self.cpu_flags <= cpu_flags()

    def build_dir(self) -> pathlib.Path:
        """``<dflash2 cache>/kernels/<name>-<hash>``, the hash over the sources, the shared headers they
        include (``csrc/*.h``: a changed header builds every kernel again) and the torch version."""
        from dflash2.models.source import cache_dir

        headers = sorted(_CSRC.glob("*.h"))  # included by the sources
        sources = b"".join(path.read_bytes() for path in (self.source, *self.extra_sources, *headers))
        key = hashlib.sha256(sources + torch.__version__.encode()).hexdigest()[:16]
        return cache_dir() / "kernels" / f"{self.source.stem}-{key}"

    def available(self) -> bool:
        """Whether the op can run here: a CPU with :attr:`cpu_flags` and the kernel built (now, the
        first time; cached) and loaded. Never raises; False after a failed build (logged)."""
        with _lock:
            if self.name not in _loaded:
                _loaded[self.name] = self._load()
            return _loaded[self.name]

    def _load(self) -> bool:
        if not self.supported_cpu():
            return False
        if os.environ.get("DFLASH2_DISABLE_CPU_KERNELS", "") not in ("", "0"):
            logger.info("DFLASH2_DISABLE_CPU_KERNELS is set: the %s bfloat16 CPU kernel is not used", self.name)
            return False
        from torch.utils.cpp_extension import load

        directory = self.build_dir()
        directory.mkdir(parents=True, exist_ok=True)
        if not any(directory.glob("*.so")):
            logger.info("building the %s CPU linear kernel (once, about 10 s) in %s", self.name, directory)
        try:
            load(
                name=f"dflash2_{self.source.stem}",
                sources=[str(path) for path in (self.source, *self.extra_sources)],
                # -fopenmp: at::parallel_for's OpenMP loop is in the header (without it, one thread).
                # The library links libgomp.so.1 by name, which resolves to the copy torch loaded.
                extra_cflags=["-O3", *self.cflags, "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                is_python_module=False,
                verbose=False,
            )
        except Exception as error:  # a missing compiler, a failed build or load
            logger.warning("the %s CPU kernel could not be built (%s)", self.name, error)
            return False
        _register_fake(self.op_name)
        if self.name == "amx":
            return _amx_runs()
        return True

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
    ) -> torch.Tensor:
        """``x [..., K]`` (bfloat16 or float32) times the packed weight (plus ``bias [N]``) →
        ``[..., N]`` in ``x``'s dtype, accumulated in float32 (the AVX512-BF16 kernel first rounds a
        float32 ``x`` to bfloat16). Requires :meth:`available`.

        Raises:
            RuntimeError: shapes or dtypes that do not match the packed weight.
        """
        if self.name == "avx2":
            return torch.ops.dflash2.bf16_linear(x, packed, bias, out_features)
        return dot_linear(self.name, x, packed, bias, x.shape[-1], out_features)


def dot_linear(
    name: str, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, in_features: int, out_features: int
) -> torch.Tensor:
    """The product of the AMX (``name == "amx"``) or AVX512-BF16 kernel on a :func:`pack_dot` weight; the AMX
    kernel's layers whose ``in_features`` is not a multiple of 32 run the AVX512-BF16 op (the same packing)."""
    if name == "amx" and in_features % AMX_CHUNK == 0:
        return torch.ops.dflash2.bf16_amx_linear(x, packed, bias, in_features, out_features)
    return torch.ops.dflash2.bf16_dot_linear(x, packed, bias, in_features, out_features)


AMX_CHUNK = 32  # inputs per tile step of the AMX kernel (kChunk in bf16_amx_linear.cpp)


def _amx_runs() -> bool:
    """The AMX kernel's first product, checked: Linux must grant the process AMX's tile state (a kernel
    older than 5.16, or a sandbox that blocks ``arch_prctl``, refuses), and the AVX512-BF16 kernel must
    load too (it serves the layers AMX cannot)."""
    if not AVX512_BF16.available():
        return False
    weight = torch.ones(32, 64, dtype=torch.bfloat16)
    try:
        out = torch.ops.dflash2.bf16_amx_linear(torch.ones(2, 64, dtype=torch.bfloat16), pack_dot(weight), None, 64, 32)
    except RuntimeError as error:
        logger.warning("the AMX bfloat16 CPU kernel cannot run here (%s)", error)
        return False
    return bool((out.float() == 64).all())


_loaded: dict[str, bool] = {}


def _register_fake(op_name: str) -> None:
    """The op's shape function, so compiled graphs can call it with the packed weight as an input."""
    if op_name == "bf16_amx_linear":

        @torch.library.register_fake("dflash2::bf16_amx_linear")
        def _(
            x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, in_features: int, out_features: int
        ) -> torch.Tensor:
            return x.new_empty((*x.shape[:-1], out_features))

    elif op_name == "quant_linear":

        @torch.library.register_fake("dflash2::quant_linear")
        def _(
            x: torch.Tensor,
            qweight: torch.Tensor,
            scales: torch.Tensor,
            offsets: torch.Tensor | None,
            bias: torch.Tensor | None,
            bits: int,
            group_size: int,
            out_features: int,
        ) -> torch.Tensor:
            return x.new_empty((*x.shape[:-1], out_features))

    elif op_name == "bf16_linear":

        @torch.library.register_fake("dflash2::bf16_linear")
        def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
            return x.new_empty((*x.shape[:-1], out_features))

    else:

        @torch.library.register_fake("dflash2::bf16_dot_linear")
        def _(
            x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, in_features: int, out_features: int
        ) -> torch.Tensor:
            return x.new_empty((*x.shape[:-1], out_features))


AVX2 = CpuKernel(
    name="avx2",
    source=SOURCE,
    cpu_flags=frozenset({"avx2", "fma"}),
    cflags=("-mavx2", "-mfma"),
    op_name="bf16_linear",
    block=BLOCK,
    pack=pack,
    unpack=unpack,
)
AVX512_BF16 = CpuKernel(
    name="avx512bf16",
    source=_CSRC / "bf16_dot_linear.cpp",
    cpu_flags=frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}),
    cflags=("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx2", "-mfma"),
    op_name="bf16_dot_linear",
    block=DOT_BLOCK,
    pack=pack_dot,
    unpack=unpack_dot,
    # Deterministic mode's attention (dflash2.models.layers.invariant_attention) needs the same flags.
    extra_sources=(_CSRC / "invariant_attention.cpp",),
)
AMX = CpuKernel(
    name="amx",
    source=_CSRC / "bf16_amx_linear.cpp",
    cpu_flags=frozenset({"amx_tile", "amx_bf16", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"}),
    cflags=(*AVX512_BF16.cflags, "-mamx-tile", "-mamx-bf16"),
    op_name="bf16_amx_linear",
    block=DOT_BLOCK,
    pack=pack_dot,
    unpack=unpack_dot,
)
KERNELS = {kernel.name: kernel for kernel in (AMX, AVX512_BF16, AVX2)}
# Weight-only quantized linears (dflash2.models.quant): 4-/8-bit codes dequantized in registers.
QUANT = CpuKernel(
    name="quant",
    source=_CSRC / "quant_linear.cpp",
    cpu_flags=frozenset({"avx2", "fma", "f16c"}),
    cflags=("-mavx2", "-mfma", "-mf16c"),
    op_name="quant_linear",
    block=8,
)


def supported_cpu() -> bool:
    """True on an x86-64 Linux CPU with AVX2 and FMA (what the AVX2 kernel's instructions need)."""
    return AVX2.supported_cpu()


def build_dir() -> pathlib.Path:
    """The AVX2 kernel's build folder (see :meth:`CpuKernel.build_dir`)."""
    return AVX2.build_dir()


def available() -> bool:
    """Whether ``torch.ops.dflash2.bf16_linear`` (the AVX2 kernel) can run here (see
    :meth:`CpuKernel.available`)."""
    return AVX2.available()


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """The AVX2 kernel's product (see :meth:`CpuKernel.linear`). Requires :func:`available`."""
    return AVX2.linear(x, packed, bias, out_features)
