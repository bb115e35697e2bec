"""Compress trained full embedding tables into one ROBE-Z array (least squares).

A ROBE-Z table reads value j of row i from ``weight[loc(i, j)]``, ``loc`` given by the hash. Given full
tables ``W_t`` (n_t, d) sharing one array (each with its own ``val_offset``), the array minimising
``sum_t sum_{i,j} (weight[loc_t(i, j)] - W_t[i, j])**2`` sets every slot to the mean of the full-table
values hashed onto it; a slot nothing maps to keeps its initial value (it does not enter the loss).

:func:`least_squares_array` computes that with the fused kernels: ids are hashed block by block
(``kernels.chunk_offsets``) and the values and their counts are added into two (m,) accumulators with the
multi-threaded dense backward (``kernels.scatter_grad``), so the only Python loop is over blocks of
``block_rows`` rows. ``RobezEmbedding.from_pretrained`` and ``robez import --compress`` build on it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from . import kernels
from .config import DEFAULT_INIT_SCALE
from .errors import ConfigError
from .hashing import DEFAULT_SEED, HashName, paper_random_numbers, validate_random_numbers
from .init import init_weight

__all__ = ["DEFAULT_BLOCK_ROWS", "least_squares_array"]

# Rows hashed and scattered per kernel call: the block's (rows, d) float32 copy, its ones and its
# offsets stay a few MB at d = 128 (a 10M-row table in 300 calls).
DEFAULT_BLOCK_ROWS = 1 << 13


def least_squares_array(
    weights: Sequence[Tensor],
    memory_size: int,
    *,
    val_offsets: Sequence[int] | None = None,
    chunk_size: int = 32,
    seed: int = DEFAULT_SEED,
    hash: HashName = "paper",
    init_scale: float = DEFAULT_INIT_SCALE,
    random_numbers: Tensor | None = None,
    block_rows: int = DEFAULT_BLOCK_ROWS,
) -> Tensor:
    """The float32 (m,) array whose ROBE-Z tables best reproduce ``weights`` in the least-squares sense.

    Args:
        weights: full tables, each (n_t, d) with the same d (row i is id i); any float dtype.
        memory_size: m, the array's size.
        val_offsets: one per table (default all 0), as the ROBE-Z tables will use them.
        chunk_size, seed, hash, random_numbers: the hash of the ROBE-Z tables (as ``RobezEmbedding``).
        init_scale: slots no value maps to keep ``init_weight(memory_size, init_scale, seed)``.
        block_rows: rows per kernel call (memory vs call overhead).

    Every slot's value is the mean of the full-table values hashed to it, accumulated in float32.
    """
    if not weights:
        raise ConfigError("give at least one full table")
    offsets_per_table = [0] * len(weights) if val_offsets is None else list(val_offsets)
    if len(offsets_per_table) != len(weights):
        raise ConfigError(f"{len(offsets_per_table)} val_offsets for {len(weights)} tables")
    dims = {int(weight.shape[1]) if weight.dim() == 2 else -1 for weight in weights}
    if len(dims) != 1 or -1 in dims:
        raise ConfigError(
            f"full tables must be 2-D (n, d) with one d, got {[tuple(w.shape) for w in weights]}"
        )
    embedding_dim = dims.pop()
    if chunk_size < 1 or memory_size < chunk_size:
        raise ConfigError(f"need 1 <= chunk_size <= memory_size, got Z={chunk_size}, m={memory_size}")
    if block_rows < 1:
        raise ConfigError(f"block_rows must be >= 1, got {block_rows}")
    constants = (
        paper_random_numbers(seed) if random_numbers is None else validate_random_numbers(random_numbers)
    )
    num_chunks = -(-embedding_dim // chunk_size)
    sums = torch.zeros(memory_size, dtype=torch.float32)
    counts = torch.zeros(memory_size, dtype=torch.float32)
    ones = torch.ones(min(block_rows, max(int(w.shape[0]) for w in weights)), embedding_dim)
    with torch.no_grad():
        for weight, val_offset in zip(weights, offsets_per_table, strict=True):
            for start in range(0, int(weight.shape[0]), block_rows):
                rows = weight[start : start + block_rows].detach().to("cpu", torch.float32).contiguous()
                ids = torch.arange(start, start + rows.shape[0], dtype=torch.int64)
                offsets = kernels.chunk_offsets(
                    ids, num_chunks, chunk_size, memory_size, constants, val_offset, hash
                )
                kernels.scatter_grad(rows, offsets, chunk_size, sums)
                kernels.scatter_grad(ones[: rows.shape[0]], offsets, chunk_size, counts)
    array = init_weight(memory_size, init_scale, seed)
    hit = counts > 0
    array[hit] = sums[hit] / counts[hit]
    return array
