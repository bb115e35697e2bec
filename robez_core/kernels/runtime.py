"""What a kernel call takes from the process it runs in: numba's thread count (kept to torch's), the CPU
the kernels are compiled for, and the hash formulation and constants a table's kernels run with.

Threads: every public kernel sets numba's thread count to ``torch.get_num_threads()`` (capped at
numba's pool size), so ``torch.set_num_threads(1)`` makes the kernels single-threaded too.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import binding as llvm_binding
from numba.core import codegen as numba_codegen

from ..errors import ConfigError
from ..hashing import HASH_NAMES, MAX_FAST_RANGE, NUM_RANDOM_NUMBERS
from ._jit import (
    _FLOAT_PRIME_RANGE,
    _MODE_FAST,
    _MODE_PAPER_FLOAT,
    _MODE_PAPER_GENERIC,
    _MODE_PAPER_SPLIT,
    _SPLIT_PRIME_RANGE,
)

__all__ = [
    "PREFETCH_READ_MIN_BYTES",
    "PREFETCH_WRITE_MIN_BYTES",
    "compile_target",
    "hash_setup",
    "set_kernel_threads",
    "wrap_int64",
]

# Prefetching pays once the table misses the caches. Reads: past L2 (below, it slows a lookup repeated
# over a hot table). The dense backward's writes: from the size of a core's L2 (1 MB on Zen 4/5; Zen 2/3
# have 512 KB), because in training the array is no longer in cache when the backward runs
# (docs/benchmarks/kernel-constants.md#_prefetch_read_min_bytes-and-_prefetch_write_min_bytes).
PREFETCH_READ_MIN_BYTES = 4 << 20
PREFETCH_WRITE_MIN_BYTES = 1 << 20


_numba_threads_started = False


def _start_numba_threads() -> None:
    """Start numba's thread pool (once, at the first kernel call), keeping torch's thread count.

    Both use the process's OpenMP runtime, and numba's first start resets its thread count to every core:
    a ``torch.set_num_threads(1)`` made before the first kernel call would silently become ``cpu_count``.
    Not at import: GNU OpenMP cannot be forked once its pool runs (the child's first parallel region
    aborts the process), and ``robez serve --workers N`` forks its workers from a process that imported
    the kernels; each worker starts a pool of its own.
    """
    global _numba_threads_started
    torch_threads = torch.get_num_threads()
    numba.get_num_threads()  # starts the threading layer
    if torch.get_num_threads() != torch_threads:
        torch.set_num_threads(torch_threads)
    _numba_threads_started = True


def _target_features() -> set[str]:
    """The CPU features numba compiles for: the host's, or ``NUMBA_CPU_FEATURES`` when set."""
    features = numba.config.CPU_FEATURES or numba_codegen.get_host_cpu_features()  # type: ignore[attr-defined]
    return {item[1:] for item in features.split(",") if item.startswith("+")}


_VECTOR_PREFIXES = ("sse", "ssse", "avx", "fma", "f16c", "neon", "sve", "asimd")


def compile_target() -> dict[str, str]:
    """What the kernels are compiled for: ``cpu`` (numba's target CPU name, ``NUMBA_CPU_NAME`` when set),
    ``vector_extensions`` (its enabled SIMD features), ``paper_hash`` (the formulation chosen for it)
    and whether ``emulated`` (numba told to target another CPU than the host's)."""
    vector = sorted(f for f in _target_features() if f.startswith(_VECTOR_PREFIXES))
    emulated = numba.config.CPU_NAME is not None or numba.config.CPU_FEATURES is not None  # type: ignore[attr-defined]
    return {
        "cpu": numba.config.CPU_NAME or llvm_binding.get_host_cpu_name(),  # type: ignore[attr-defined]
        "vector_extensions": " ".join(vector),
        "paper_hash": _PAPER_FORMULATION,
        "emulated": "yes" if emulated else "no",
    }


def set_kernel_threads() -> int:
    """Make numba use ``torch.get_num_threads()`` threads (capped at numba's pool); returns the count."""
    if not _numba_threads_started:
        _start_numba_threads()
    threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)
    return threads


# The paper hash's mod P for 2**16 <= P < 2**31: "split32" (32-bit halves, exact corrections, then the
# per-chunk reduction in float64) or "float64" (int64 <-> float64 conversions and 64-bit multiplies,
# which only AVX-512 DQ + VL has in vector registers). split32 is ahead on both kinds of CPU
# (docs/benchmarks/kernel-constants.md#_paper_formulation); float64 still takes a P in [2**31, 2**52).
# Tests set it to force either path on any CPU.
_PAPER_FORMULATION = "split32"


def _check_shape(memory_size: int, chunk_size: int, embedding_dim: int, hash: str) -> int:
    """Validate a table shape; returns the hash range ``memory_size - chunk_size + 1``."""
    if chunk_size < 1 or embedding_dim < 1:
        raise ConfigError(f"chunk_size and embedding_dim must be >= 1, got {chunk_size}, {embedding_dim}")
    if hash not in HASH_NAMES:
        raise ConfigError(f"unknown hash {hash!r}; expected one of {HASH_NAMES}")
    range_size = memory_size - chunk_size + 1
    if range_size < 1:
        raise ConfigError(f"memory_size ({memory_size}) must be >= chunk_size ({chunk_size})")
    if hash == "fast" and range_size > MAX_FAST_RANGE:
        raise ConfigError(f"hash='fast' needs memory_size - chunk_size + 1 <= 2**32, got {range_size}")
    return range_size


def hash_setup(
    hash: str, random_numbers: torch.Tensor, memory_size: int, chunk_size: int, embedding_dim: int = 1
) -> tuple[int, np.ndarray, int]:
    """(kernel hash mode, constants as numpy int64 (11,), range size) for a validated table shape."""
    range_size = _check_shape(memory_size, chunk_size, embedding_dim, hash)
    if random_numbers.dtype != torch.int64 or tuple(random_numbers.shape) != (NUM_RANDOM_NUMBERS,):
        raise ConfigError(f"random_numbers must be int64 ({NUM_RANDOM_NUMBERS},)")
    constants = random_numbers.contiguous().numpy()
    prime = int(constants[0])
    if prime <= 0:
        raise ConfigError("random_numbers[0] is the modulus P and must be positive")
    if hash == "fast":
        return _MODE_FAST, constants, range_size
    if _PAPER_FORMULATION == "split32" and _SPLIT_PRIME_RANGE[0] <= prime < _SPLIT_PRIME_RANGE[1]:
        return _MODE_PAPER_SPLIT, constants, range_size
    if _FLOAT_PRIME_RANGE[0] <= prime < _FLOAT_PRIME_RANGE[1]:
        return _MODE_PAPER_FLOAT, constants, range_size
    return _MODE_PAPER_GENERIC, constants, range_size


def wrap_int64(value: int) -> int:
    """Python int -> the int64 with the same low 64 bits (val_offset is added with wrap-around)."""
    return ((int(value) + (1 << 63)) % (1 << 64)) - (1 << 63)
