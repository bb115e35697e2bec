"""The one reader of the machine's facts: CPU model and flags, cores, memory, load average, and what the
compiled code was built for. Benchmarks, load tests and quality runs print these next to their figures.

Linux facts come from ``/proc``; elsewhere the readers fall back to :mod:`platform` or say "unknown".
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import platform
import socket
from collections.abc import Iterable
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
MEMINFO = Path("/proc/meminfo")
# The prefixes of the SIMD flags the kernels (numba's LLVM) and torch can use: x86 and Arm.
VECTOR_FLAG_PREFIXES = ("sse", "ssse", "avx", "fma", "f16c", "asimd", "sve")


@functools.cache
def _first_processor() -> dict[str, str]:
    """The first processor block of /proc/cpuinfo as {key: value}; empty where there is none."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in CPUINFO.read_text().splitlines():
            if not line.strip():
                if fields:
                    break
                continue
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_model() -> str:
    """The CPU's model name, e.g. ``AMD EPYC 7B13``; the platform's processor or machine without one."""
    return _first_processor().get("model name") or platform.processor() or platform.machine() or "unknown"


def cpu_flags() -> frozenset[str] | None:
    """The flags /proc/cpuinfo lists (``flags`` on x86, ``Features`` on Arm); None where it lists none."""
    fields = _first_processor()
    line = fields.get("flags", fields.get("Features"))
    return None if line is None else frozenset(line.split())


def vector_extensions() -> str:
    """The host's SIMD flags, sorted and space-separated (what the hardware has, whatever numba targets)."""
    flags = cpu_flags()
    if flags is None:
        return "unknown"
    return " ".join(sorted(flag for flag in flags if flag.startswith(VECTOR_FLAG_PREFIXES)))


def listed_flags(candidates: Iterable[str]) -> list[str] | None:
    """Those of ``candidates`` the CPU lists, in the order given; None where the flags are unknown."""
    flags = cpu_flags()
    return None if flags is None else [flag for flag in candidates if flag in flags]


def logical_cpus() -> int:
    """Logical CPUs of the machine (``os.cpu_count()``)."""
    return os.cpu_count() or 1


def usable_cpus() -> int:
    """Logical CPUs this process may run on (its affinity mask)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical_cpus()


def memory_gib() -> float:
    """Total memory in GiB (``MemTotal``); NaN where it cannot be read."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    return math.nan


def process_alive(pid: int) -> bool:
    """A process ``pid`` runs on this machine (another user's counts): whether what it owns (a shared
    directory, a copy's slot, a scratch file) is still in use."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def load_average() -> tuple[float, float, float]:
    """The 1, 5 and 15 minute load averages (NaN where the system keeps none): a busy machine inflates
    every figure, so reports record it."""
    try:
        return os.getloadavg()
    except OSError:
        return (math.nan, math.nan, math.nan)


def kernel_target() -> str:
    """What the fused kernels are compiled for (numba's target CPU, emulated or the host's)."""
    from . import kernels

    target = kernels.compile_target()
    how = (
        " — **emulated**: numba told to compile for this CPU (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES), "
        "the host has more"
        if target["emulated"] == "yes"
        else " (the host CPU)"
    )
    return (
        f"{target['cpu']}{how}; vector extensions: {target['vector_extensions']}; "
        f"paper hash formulation: {target['paper_hash']}"
    )


def torch_capability() -> str:
    """The CPU capability torch dispatches its kernels for, and whether the environment forced it."""
    import torch

    forced = os.environ.get("ATEN_CPU_CAPABILITY")
    capability = torch.backends.cpu.get_cpu_capability()
    return capability + (f" (forced by ATEN_CPU_CAPABILITY={forced})" if forced else "")


def threading_layer() -> str:
    """numba's threading layer, once a parallel kernel has chosen one."""
    import numba

    try:
        return str(numba.threading_layer())
    except ValueError:  # no parallel kernel has run yet
        return "not initialised"


def machine_facts() -> dict[str, str]:
    """Where the numbers came from, as reports print it: host, CPU and its vector extensions, what the
    kernels and torch were compiled / dispatched for, cores, memory, library versions, malloc."""
    import numba
    import numpy as np
    import torch

    from .allocator import malloc_setting

    return {
        "host": socket.gethostname(),
        "cpu": cpu_model(),
        "cpu vector extensions": vector_extensions(),
        "fused kernels compiled for": kernel_target(),
        "torch kernels dispatched for": torch_capability(),
        "logical cpus": str(os.cpu_count()),
        "memory": f"{memory_gib():.1f} GiB",
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numba": numba.__version__,
        "numpy": np.__version__,
        "numba threading layer": threading_layer(),
        "malloc": malloc_setting(),
    }
