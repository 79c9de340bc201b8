"""A description of the machine for the report: CPU (lscpu), relevant ISA flags, GPU, library versions."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

#: CPU flags that decide how fast float32 / bfloat16 matrix multiplies run on CPU.
RELEVANT_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "avx_vnni",
)


def parse_lscpu(text: str) -> dict[str, str]:
    """``lscpu`` output as ``{field: value}`` (first occurrence of each field)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    return fields


def _lscpu() -> dict[str, str]:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    fields = parse_lscpu(text)
    if "Flags" not in fields:  # no lscpu: /proc/cpuinfo has the model name and flags too
        try:
            cpuinfo = parse_lscpu(Path("/proc/cpuinfo").read_text())
        except OSError:
            cpuinfo = {}
        fields.setdefault("Model name", cpuinfo.get("model name", platform.processor()))
        fields["Flags"] = cpuinfo.get("flags", "")
    return fields


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def describe_machine() -> dict[str, Any]:
    """CPU model, cores / threads, relevant flags, memory, GPU, torch version and threads, packages."""
    import torch

    cpu = _lscpu()
    flags = set(cpu.get("Flags", "").split())
    info: dict[str, Any] = {
        "cpu_model": cpu.get("Model name", "unknown"),
        "cpus": cpu.get("CPU(s)", str(os.cpu_count())),
        "threads_per_core": cpu.get("Thread(s) per core"),
        "cores_per_socket": cpu.get("Core(s) per socket"),
        "sockets": cpu.get("Socket(s)"),
        "cpu_flags": [f for f in RELEVANT_FLAGS if f in flags],
        "memory_gib": _memory_gib(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "transformers": _version("transformers"),
        "llama_cpp_python": _version("llama_cpp_python"),
    }
    try:
        info["load_average"] = list(os.getloadavg())
    except OSError:
        info["load_average"] = None
    return info


def _memory_gib() -> float | None:
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return round(pages * page_size / 2**30, 1)


def machine_summary(info: dict[str, Any]) -> list[str]:
    """Markdown bullet lines for the report."""
    cores = f"{info['cpus']} CPUs"
    if info.get("cores_per_socket") and info.get("threads_per_core"):
        cores += (
            f" ({info.get('sockets') or 1} socket(s) × {info['cores_per_socket']} cores × "
            f"{info['threads_per_core']} threads)"
        )
    lines = [
        f"- CPU: {info['cpu_model']}, {cores}, {info.get('memory_gib')} GiB memory",
        f"- CPU flags: {', '.join(info['cpu_flags']) or 'none of ' + ', '.join(RELEVANT_FLAGS[:6])}",
        f"- GPU: {info['cuda'] or 'none used'}",
        f"- torch {info['torch']} ({info['torch_threads']} threads), transformers {info['transformers']}, "
        f"llama-cpp-python {info['llama_cpp_python'] or 'not installed'}, Python {info['python']}",
        f"- OS: {info['os']}; load average at start: {info.get('load_average')}",
    ]
    return lines
