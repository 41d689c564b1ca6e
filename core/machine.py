"""The machine a figure was measured on: CPU model and vendor, the SIMD features that decide which kernels run,
cores and the CPUs this process may use, memory. Every report and benchmark records it (`describe()`), because
the same code runs at 96 % of the memory roofline on one 2-core VM and 60 % on another.

Read from /proc/cpuinfo and /proc/meminfo (Linux); elsewhere the platform module's fields only. Torch-free: the
kernels that actually ran are the engine's to report (`decode_step`, `linear_kernel`)."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

# The features that change which kernels are fast or legal here (AMX is listed as the CPU reports it: a VM can
# report it without granting the tile state, which `make llamacpp` probes separately).
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def cpu_info(text: str | None = None) -> dict[str, Any]:
    """{model, vendor, isa, sockets_cores_threads?} from /proc/cpuinfo's text (read when not given)."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            text = ""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:          # the first processor's entry speaks for all
            fields[key.strip()] = value.strip()
    flags = set(fields.get("flags", "").split())
    return {"model": fields.get("model name") or platform.processor() or platform.machine(),
            "vendor": fields.get("vendor_id") or None,
            "isa": [f for f in ISA_FLAGS if f in flags]}


def memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def describe() -> dict[str, Any]:
    """What a report records about the machine it measured on."""
    try:
        affinity = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    cpu = cpu_info()
    return {"cpu": cpu["model"], "cpu_vendor": cpu["vendor"], "isa": cpu["isa"], "cpu_count": os.cpu_count(),
            "cpu_affinity": affinity, "memory_bytes": memory_bytes(), "platform": platform.platform(),
            "python": platform.python_version(), "host": platform.node()}


def one_line(machine: dict[str, Any]) -> str:
    """"AMD EPYC ..., 2 CPUs (avx2 avx512f ...)" for a report header."""
    isa = " ".join(machine.get("isa") or []) or "no AVX2"
    return f"{machine.get('cpu') or machine.get('platform')}, {machine.get('cpu_count')} CPUs ({isa})"


def foreign_env() -> dict[str, str]:
    """The environment for a program that is not ours (llama.cpp's servers and tools are built with OpenMP): without
    the OpenMP wait policy `import specbuild` set for torch (./__init__.py), so it runs as its users run it."""
    import specbuild

    env = dict(os.environ)
    if specbuild._OMP_SET_HERE and env.get("OMP_WAIT_POLICY") == "passive":
        del env["OMP_WAIT_POLICY"]
    return env
