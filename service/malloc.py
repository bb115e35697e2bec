"""Keep freed response buffers mapped, so a large lookup does not page-fault its output in again.

glibc's malloc serves allocations above ``M_MMAP_THRESHOLD`` (128 KiB at start, then adjusted by what
is freed) with a fresh ``mmap`` and gives them back with ``munmap``; and it returns the top of a heap
to the system once more than ``M_TRIM_THRESHOLD`` is free there. A 4096-id lookup allocates about
1 MiB of rows, so in a fresh process every such request faults its output's 256 pages in again: about
a millisecond of CPU on the project's VM, ten times the lookup itself (docs/loadtest/). Whether it does
depends on what the process freed before (the dynamic threshold), so the same request cost 0.1 ms or
1 ms depending on history. Fixing both thresholds makes freed blocks up to ``mmap_threshold`` bytes
reusable and the cost the same every time; the price is that a worker keeps up to ``2 x`` that much
freed memory per malloc arena instead of returning it.

The load test's in-process baseline calls this too (``loadtest/baseline.py``), so both run with the
same allocator behaviour. On a C library other than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

# glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc caps M_MMAP_THRESHOLD at 32 MiB on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
MAX_MMAP_THRESHOLD = 32 * 1024 * 1024


def keep_freed_memory(mmap_threshold: int) -> bool:
    """Serve allocations up to ``mmap_threshold`` bytes from the heap and keep up to twice that freed
    at its top. ``0`` leaves glibc's defaults. True when the C library took both settings."""
    if mmap_threshold <= 0:
        return False
    threshold = min(mmap_threshold, MAX_MMAP_THRESHOLD)
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        logger.info("no mallopt in this C library (%s); allocator left as it is", name)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, 2 * threshold))
