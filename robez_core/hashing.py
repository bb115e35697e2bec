"""ROBE-Z hash functions: constants and pure-torch reference implementations.

A ROBE-Z table reads row ``x`` of dimension ``d`` from a flat array ``weight`` of ``memory_size`` m as
``ceil(d / Z)`` blocks of ``chunk_size`` Z contiguous values. Block ``c`` of row ``x`` starts at
``offset(x, c)`` in ``[0, m - Z]`` and value ``j`` of the row is ``weight[offset(x, j // Z) + j % Z]``.

Two hash families give ``offset``:

``"paper"`` — exactly the paper's code (int64 arithmetic, two's-complement wrap-around, floor mod)::

    R = [P] + numpy.random.RandomState(seed).randint(0, P, 10)       P = 2038074743
    offset(x, c) = ((x + val_offset) * R[3] + c * R[2] + R[1]) mod P mod (m - Z + 1)

``"fast"`` — a 64-bit mixer (murmur3's fmix64) followed by a multiply-high range reduction, so no
64-bit division is needed; the constants come from the same ``R`` draws::

    key    = (x + val_offset) * (R[3] | 1) + c * R[2] + R[1]           (mod 2**64)
    h      = fmix64(key)
    offset = ((h >> 32) * (m - Z + 1)) >> 32                          (unsigned, m - Z + 1 <= 2**32)

The functions here are the oracle: the fused kernels (``kernels/``) must agree with them bit for bit.
They materialise an (N, d) index tensor and are deliberately simple.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from .errors import ConfigError

PAPER_PRIME = 2038074743
DEFAULT_SEED = 1024
NUM_RANDOM_NUMBERS = 11  # P followed by ten draws, as the paper's module stores them
HashName = Literal["paper", "fast"]
HASH_NAMES: tuple[str, ...] = ("paper", "fast")
MAX_FAST_RANGE = 1 << 32

# murmur3 fmix64 multipliers, as signed int64 so torch and numba agree on the bit pattern
FMIX_C1 = 0xFF51AFD7ED558CCD - (1 << 64)
FMIX_C2 = 0xC4CEB9FE1A85EC53 - (1 << 64)
_LOW32 = 0xFFFFFFFF


def paper_random_numbers(seed: int = DEFAULT_SEED) -> torch.Tensor:
    """The paper's hash constants: int64 tensor (11,) = ``[P] + RandomState(seed).randint(0, P, 10)``."""
    draws = np.random.RandomState(seed).randint(0, PAPER_PRIME, 10).astype(np.int64)
    return torch.tensor([PAPER_PRIME, *draws.tolist()], dtype=torch.int64)


def validate_random_numbers(random_numbers: torch.Tensor) -> torch.Tensor:
    """Check the (11,) int64 constants (e.g. from an imported state_dict) and return them contiguous."""
    if random_numbers.dtype != torch.int64 or tuple(random_numbers.shape) != (NUM_RANDOM_NUMBERS,):
        raise ConfigError(
            f"random_numbers must be an int64 tensor of shape ({NUM_RANDOM_NUMBERS},), "
            f"got {random_numbers.dtype} {tuple(random_numbers.shape)}"
        )
    if int(random_numbers[0]) <= 0:
        raise ConfigError(
            f"random_numbers[0] is the modulus P and must be positive, got {int(random_numbers[0])}"
        )
    return random_numbers.contiguous()


def _logical_shift_right(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``>>`` on the unsigned bit pattern of int64 values (torch's ``>>`` is arithmetic)."""
    return (values >> bits) & ((1 << (64 - bits)) - 1)


def fmix64(values: torch.Tensor) -> torch.Tensor:
    """murmur3's 64-bit finaliser on int64 bit patterns (wrapping multiplications)."""
    h = values ^ _logical_shift_right(values, 33)
    h = h * FMIX_C1
    h = h ^ _logical_shift_right(h, 33)
    h = h * FMIX_C2
    return h ^ _logical_shift_right(h, 33)


def reference_chunk_offsets(
    ids: torch.Tensor,
    num_chunks: int,
    chunk_size: int,
    memory_size: int,
    random_numbers: torch.Tensor,
    val_offset: int = 0,
    hash: HashName = "paper",
) -> torch.Tensor:
    """Start offset of every block: int64 (N, num_chunks), values in ``[0, memory_size - chunk_size]``."""
    range_size = memory_size - chunk_size + 1
    if range_size < 1:
        raise ConfigError(f"memory_size ({memory_size}) must be >= chunk_size ({chunk_size})")
    R = random_numbers.tolist()
    chunks = torch.arange(num_chunks, dtype=torch.int64)
    keys = ids.to(torch.int64).reshape(-1, 1) + val_offset
    if hash == "paper":
        prime = R[0]
        return ((keys * R[3] + chunks * R[2] + R[1]) % prime) % range_size
    if hash == "fast":
        if range_size > MAX_FAST_RANGE:
            raise ConfigError(f"hash='fast' needs memory_size - chunk_size + 1 <= 2**32, got {range_size}")
        h = fmix64(keys * (R[3] | 1) + chunks * R[2] + R[1])
        return _logical_shift_right(_logical_shift_right(h, 32) * range_size, 32)
    raise ConfigError(f"unknown hash {hash!r}; expected one of {HASH_NAMES}")


def reference_indices(
    ids: torch.Tensor,
    embedding_dim: int,
    chunk_size: int,
    memory_size: int,
    random_numbers: torch.Tensor,
    val_offset: int = 0,
    hash: HashName = "paper",
) -> torch.Tensor:
    """Index into ``weight`` of every value of every row: int64 (N, embedding_dim)."""
    j = torch.arange(embedding_dim, dtype=torch.int64)
    num_chunks = -(-embedding_dim // chunk_size)
    offsets = reference_chunk_offsets(
        ids, num_chunks, chunk_size, memory_size, random_numbers, val_offset, hash
    )
    return offsets[:, j // chunk_size] + (j % chunk_size)
