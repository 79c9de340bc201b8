"""Which bfloat16 linear path a CPU gets: the project's AMX, AVX512-BF16 or AVX2 kernel, oneDNN,
or none, from the CPU's flags (faked here), what builds, and ``DFLASH2_CPU_KERNEL``."""

from __future__ import annotations

import logging

import pytest
import torch

import dflash2.models.layers
from dflash2.models import cpu_kernels
from dflash2.models.layers import choose_cpu_kernel, linear_backend

ZEN3 = frozenset({"sse4_2", "avx", "avx2", "fma"})  # AVX2 only: no native bfloat16
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_bf16", "amx_tile"}
COOPER_LAKE_WITHOUT_VL = ZEN3 | {"avx512f", "avx512_bf16"}  # a flag set the kernel cannot use
OLD = frozenset({"sse4_2", "avx"})


def builds(name: str) -> bool:
    return True


def never(name: str) -> bool:
    return False


@pytest.mark.parametrize(
    ("flags", "onednn", "expected"),
    [
        (ZEN4, True, "avx512bf16"),
        (SAPPHIRE_RAPIDS, True, "amx"),
        (ZEN3, False, "avx2"),
        (COOPER_LAKE_WITHOUT_VL, True, "avx2"),
        (OLD, True, "onednn"),
        (OLD, False, None),
    ],
)
def test_the_first_path_the_cpu_can_run(flags, onednn, expected):
    assert choose_cpu_kernel(flags, onednn, builds) == expected


def test_a_kernel_that_does_not_build_falls_through():
    assert choose_cpu_kernel(ZEN4, True, lambda name: name != "avx512bf16") == "avx2"
    assert choose_cpu_kernel(SAPPHIRE_RAPIDS, True, lambda name: name != "amx") == "avx512bf16"
    assert choose_cpu_kernel(ZEN4, True, never) == "onednn"
    assert choose_cpu_kernel(ZEN3, False, never) is None


def test_builds_is_asked_only_where_the_flags_allow():
    asked: list[str] = []
    choose_cpu_kernel(ZEN3, False, lambda name: asked.append(name) or True)
    assert asked == ["avx2"]


@pytest.mark.parametrize("forced", ["onednn", "avx2", "avx512bf16", "amx"])
def test_forced_paths(forced):
    assert choose_cpu_kernel(SAPPHIRE_RAPIDS, True, builds, forced) == forced


def test_forced_paths_that_cannot_run_are_errors():
    with pytest.raises(ValueError, match=r"DFLASH2_CPU_KERNEL=avx512bf16: cannot run on this CPU.*avx512_bf16"):
        choose_cpu_kernel(ZEN3, False, builds, "avx512bf16")
    with pytest.raises(ValueError, match=r"DFLASH2_CPU_KERNEL=onednn: cannot run.*oneDNN bfloat16 support"):
        choose_cpu_kernel(ZEN3, False, builds, "onednn")
    with pytest.raises(ValueError, match="cannot run"):
        choose_cpu_kernel(ZEN4, True, never, "avx2")
    with pytest.raises(ValueError, match=r"DFLASH2_CPU_KERNEL=amx: cannot run on this CPU.*amx_tile"):
        choose_cpu_kernel(ZEN4, True, builds, "amx")
    with pytest.raises(ValueError, match="expected one of amx, avx512bf16, avx2, onednn"):
        choose_cpu_kernel(ZEN4, True, builds, "avx10")


def test_the_engine_reads_the_variable_and_logs_its_choice_once(monkeypatch, caplog):
    monkeypatch.setattr(dflash2.models.layers, "onednn_bf16", lambda device, dtype: True)
    monkeypatch.setenv("DFLASH2_CPU_KERNEL", "oneDNN")  # any case
    monkeypatch.setattr(dflash2.models.layers, "_logged_choices", set())
    with caplog.at_level(logging.INFO, logger="dflash2.models.layers"):
        assert linear_backend(torch.device("cpu"), torch.bfloat16) == "onednn"
        assert linear_backend(torch.device("cpu"), torch.bfloat16) == "onednn"
    assert [r.getMessage() for r in caplog.records] == ["bfloat16 CPU linears: oneDNN (forced by DFLASH2_CPU_KERNEL)"]
    assert linear_backend(torch.device("cpu"), torch.float32) is None
    assert linear_backend(torch.device("meta"), torch.bfloat16) is None
    monkeypatch.setenv("DFLASH2_CPU_KERNEL", "mkl")
    with pytest.raises(ValueError, match="DFLASH2_CPU_KERNEL='mkl'"):
        linear_backend(torch.device("cpu"), torch.bfloat16)


def test_each_kernel_names_the_flags_its_instructions_need():
    assert cpu_kernels.AVX2.cpu_flags == {"avx2", "fma"}
    assert {"avx512_bf16", "avx512bw", "avx512vl"} <= cpu_kernels.AVX512_BF16.cpu_flags
    assert {"amx_tile", "amx_bf16"} <= cpu_kernels.AMX.cpu_flags
    assert cpu_kernels.AVX512_BF16.cpu_flags <= cpu_kernels.AMX.cpu_flags
    assert set(cpu_kernels.KERNELS) == {"avx2", "avx512bf16", "amx"}


def test_a_changed_shared_header_moves_every_kernel_to_a_new_build_folder(monkeypatch, tmp_path):
    """The kernels include csrc/kernel_common.h: editing it must rebuild them all, not reuse old builds."""
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for path in cpu_kernels._CSRC.iterdir():
        (csrc / path.name).write_bytes(path.read_bytes())
    kernels = [cpu_kernels.AVX2, cpu_kernels.AVX512_BF16, cpu_kernels.AMX, cpu_kernels.QUANT]
    monkeypatch.setattr(cpu_kernels, "_CSRC", csrc)
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path / "cache"))
    before = [kernel.build_dir() for kernel in kernels]
    (csrc / "kernel_common.h").write_text((csrc / "kernel_common.h").read_text() + "\n// edited\n")
    after = [kernel.build_dir() for kernel in kernels]
    assert all(old != new and old.name.split("-")[0] == new.name.split("-")[0] for old, new in zip(before, after))
