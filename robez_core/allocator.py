"""Opt-in glibc malloc tuning: keep freed multi-megabyte buffers in the process for the next call.

A training step or a large lookup allocates several buffers of megabytes (a 32768 x 100 batch of rows is
13 MB) and frees them at the end. glibc serves such sizes either with a fresh ``mmap`` (above its mmap
threshold) or from the heap, whose free top it hands back to the kernel once it exceeds the trim threshold;
either way the next call writes to pages the kernel must fault in and zero again. ``tune_malloc`` raises
both thresholds with ``mallopt`` (through ``ctypes``: no environment variable, no restart), so freed
buffers stay mapped and are reused.

It changes the process's memory behaviour: up to ``trim_threshold_mb`` of freed heap (plus
``top_pad_mb``) stays resident instead of going back to the system, so it is a setting the caller chooses,
not something importing robez does. ``python -m benchmarks.core.page_faults`` measures what it buys (page
faults and time per call, with and without it) and writes the report that decides whether a caller should.

Only glibc has ``mallopt`` with these parameters; elsewhere (musl, macOS) ``tune_malloc`` does nothing and
returns False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform
from dataclasses import dataclass

from .errors import ConfigError

__all__ = ["MallocTuning", "keep_freed_buffers", "malloc_setting", "trim_free_memory", "tune_malloc"]

# mallopt parameter numbers from glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
# glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2: 32 MiB on 64-bit systems.
MAX_MMAP_THRESHOLD_MB = 32
# Bounds for the kept memory: a setting above this is more likely a unit mistake than a choice.
MAX_KEEP_MB = 4096


@dataclass(frozen=True)
class MallocTuning:
    """The three ``mallopt`` values, in MiB.

    ``mmap_threshold_mb``: allocations below it come from the heap (reusable) instead of a fresh ``mmap``;
    ``trim_threshold_mb``: freed memory at the top of the heap is returned to the kernel only past this;
    ``top_pad_mb``: extra heap asked for on each growth, so a growing working set faults less often.
    """

    mmap_threshold_mb: int = MAX_MMAP_THRESHOLD_MB
    trim_threshold_mb: int = 256
    top_pad_mb: int = 64

    def __post_init__(self) -> None:
        if not 1 <= self.mmap_threshold_mb <= MAX_MMAP_THRESHOLD_MB:
            raise ConfigError(f"mmap_threshold_mb must be in [1, {MAX_MMAP_THRESHOLD_MB}] (glibc's limit)")
        for name in ("trim_threshold_mb", "top_pad_mb"):
            value = getattr(self, name)
            if not 0 <= value <= MAX_KEEP_MB:
                raise ConfigError(f"{name} must be in [0, {MAX_KEEP_MB}], got {value}")


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """glibc, looked up once per process: ``find_library`` runs ``ldconfig -p`` in a child process, which
    a worker's trim after each refused message paid again (~5 ms, and a child that shares the worker's
    pages, so the process tree read 480 MiB more while it ran)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


_applied: MallocTuning | None = None


def malloc_setting() -> str:
    """What this process's malloc runs with, for reports: glibc's defaults or the tuning applied."""
    if _applied is None:
        return "glibc defaults" if _glibc() is not None else "the platform's defaults (not glibc)"
    return (
        f"tuned by robez_core.allocator.tune_malloc: mmap threshold {_applied.mmap_threshold_mb} MiB, "
        f"trim threshold {_applied.trim_threshold_mb} MiB, top pad {_applied.top_pad_mb} MiB"
    )


def tune_malloc(tuning: MallocTuning | None = None) -> bool:
    """Apply ``tuning`` (default ``MallocTuning()``) to this process's glibc malloc; True if glibc took
    all three values. Setting the mmap threshold turns off glibc's own sliding threshold for good."""
    tuning = tuning or MallocTuning()
    libc = _glibc()
    if libc is None:
        return False
    mib = 1 << 20
    results = [
        libc.mallopt(_M_MMAP_THRESHOLD, tuning.mmap_threshold_mb * mib),
        libc.mallopt(_M_TRIM_THRESHOLD, tuning.trim_threshold_mb * mib),
        libc.mallopt(_M_TOP_PAD, tuning.top_pad_mb * mib),
    ]
    global _applied
    ok = all(result == 1 for result in results)
    if ok:
        _applied = tuning
    return ok


def keep_freed_buffers(mmap_threshold_mb: int) -> bool:
    """The tuning a server worker applies (``ROBEZ_MALLOC_MMAP_THRESHOLD_MB``) and the load test's kernel
    baseline with it: blocks up to ``mmap_threshold_mb`` come from the heap and up to twice that stays
    free at its top, no extra pad, so a large lookup's freed output is reused instead of faulted in again
    on every request (whether it was otherwise depended on what the process had freed before: 480 faults
    and ~1 ms per 4096-id call, or none). ``0`` leaves glibc's defaults and returns False."""
    if mmap_threshold_mb <= 0:
        return False
    threshold = min(mmap_threshold_mb, MAX_MMAP_THRESHOLD_MB)
    return tune_malloc(MallocTuning(threshold, 2 * threshold, 0))


def trim_free_memory() -> bool:
    """Hand the free memory of every malloc arena back to the kernel (glibc's ``malloc_trim(0)``): after
    a large refused request, whose buffers other threads' arenas would otherwise keep. True if any was
    released; False elsewhere than glibc."""
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))
