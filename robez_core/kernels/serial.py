"""Named serial entry points into the compiled kernels, for callers that prepare their arguments once and
call the compiled code directly: ``small.py`` (the small-batch path), ``optim.py`` and the benchmarks.

These are the one-thread compilations of ``_jit.py``, called without the checks, tensor wrapping and
thread set-up of the public API (``robez_core.kernels``): the caller passes numpy arrays of the right
dtypes and shapes, as that API would. Results are bit-identical to the public API's
(tests/core/test_table.py). The argument lists, in order:

- ``chunk_offsets(ids, val_offset, num_chunks, mode, random_numbers, range_size, out)``: int64 ``out``
  (N, C) of int64 ``ids`` (N,); ``mode``, ``random_numbers`` and ``range_size`` from ``hash_setup``,
  ``val_offset`` an ``np.int64`` of ``wrap_int64``;
- ``gather_for(Z)(weight, offsets, embedding_dim, chunk_size, streaming, prefetch, out)``: float32 rows
  ``out`` (N, d) at ``offsets`` (N, C); ``chunk_size`` is Z again;
- ``lookup_for(Z)(weight, ids, val_offset, embedding_dim, chunk_size, mode, random_numbers, streaming,
  prefetch, out)``: hash + gather;
- ``coalesce_sorted(grad_rows, offsets, embedding_dim, chunk_size)``: (sorted unique int64 locations,
  their summed float32 gradients), by sorting chunk starts (the public API takes a dense scratch instead
  when ``memory_size <= DENSE_COALESCE_FACTOR * grad_rows.size``);
- ``sgd(weight, locations, values, lr)``, ``adagrad(weight, state_sum, locations, values, lr, eps)``,
  ``adam(weight, exp_avg, exp_avg_sq, locations, values, beta1, beta2, eps, step_size)``: a step in
  place (float32 scalars); ``sgd_nonfinite`` / ``adagrad_nonfinite`` / ``adam_nonfinite`` take the same
  arguments and count the locations the step would leave non-finite, writing nothing;
- ``checked_step(offsets, grads, embedding_dim, chunk_size, optimizer, scalars, weight, first, second)``:
  coalesce, dry run and step in one call; ``optimizer`` an ``OPTIMIZER_CODES`` value, ``scalars`` float32
  [lr, eps, beta1, beta2, Adam's step size]; False, nothing written, when the dry run counts a
  non-finite value.
"""

from __future__ import annotations

from typing import Any

from . import _jit
from .runtime import hash_setup, wrap_int64

__all__ = [
    "DENSE_COALESCE_FACTOR",
    "OPTIMIZER_CODES",
    "adagrad",
    "adagrad_nonfinite",
    "adam",
    "adam_nonfinite",
    "checked_step",
    "chunk_offsets",
    "coalesce_sorted",
    "gather_for",
    "hash_setup",
    "lookup_for",
    "sgd",
    "sgd_nonfinite",
    "wrap_int64",
]

DENSE_COALESCE_FACTOR: int = _jit._DENSE_COALESCE_FACTOR
OPTIMIZER_CODES: dict[str, int] = _jit.OPTIMIZER_CODES

chunk_offsets: Any = _jit._chunk_offsets_kernel.serial
coalesce_sorted: Any = _jit._coalesce_sorted_kernel
checked_step: Any = _jit._checked_step_kernel
sgd: Any = _jit._sgd_serial
adagrad: Any = _jit._adagrad_serial
adam: Any = _jit._adam_serial
sgd_nonfinite: Any = _jit._sgd_nonfinite_serial
adagrad_nonfinite: Any = _jit._adagrad_nonfinite_serial
adam_nonfinite: Any = _jit._adam_nonfinite_serial


def gather_for(chunk_size: int) -> Any:
    """The serial gather compiled for ``chunk_size`` (its own compilation for a common size, made or
    loaded on first use; the generic one otherwise)."""
    return _jit._gather_kernel.for_chunk(chunk_size).serial


def lookup_for(chunk_size: int) -> Any:
    """The serial hash + gather compiled for ``chunk_size``, as ``gather_for``."""
    return _jit._lookup_kernel.for_chunk(chunk_size).serial
