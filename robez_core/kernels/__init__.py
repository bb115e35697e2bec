"""Fused CPU kernels for ROBE-Z tables: hash + gather, bags, scatter, coalesce, optimizer steps.

The checked API (the collections' part lives in ``collection.py``, re-exported here): every function
validates its tensors, sets the thread count (``runtime.py``) and calls the compiled code of ``_jit.py``,
the only compiled code of the project, which agrees with the pure-torch reference in ``hashing.py`` bit
for bit on forward and within float tolerance on gradients and optimizer updates
(``tests/core/test_kernels.py``, ``tests/core/test_collection.py``).

All functions take and return CPU torch tensors; numba works on zero-copy ``.numpy()`` views, so
``weight`` and optimizer state are updated in place (they may live in shared memory). Outputs are
allocated by numpy (huge pages) rather than ``torch.empty``, large ones (rows, the dense backward's (m,)
gradient) from the pool of ``buffers.py``, which hands a batch nobody holds any more to the next call,
and the coalesce's dense scratch is reused per thread, because fresh multi-megabyte buffers page-fault
on every call.

Determinism: the coalesce runs serially in a fixed order and the optimizer steps touch each location
once, so ``Table.apply_gradients`` / ``apply_gradients_at`` and the lookups give the same bits at any
thread count (replicas may run different counts; ``tests/core/test_table.py`` checks 1 vs 2). The
module-level dense ``scatter_grad`` at several threads (``RobezEmbedding``'s dense backward) sums
per-thread partial arrays, so its float sums are grouped differently from the serial one's.

Threads: every public function sets numba's thread count to ``torch.get_num_threads()`` (capped at
numba's pool size), so ``torch.set_num_threads(1)`` makes the kernels single-threaded too.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

from .. import buffers
from ..errors import ConfigError, InvalidInputError
from ._jit import (
    _DENSE_COALESCE_FACTOR,
    _adagrad_checked_kernel,
    _adagrad_kernel,
    _adagrad_nonfinite_kernel,
    _adam_checked_kernel,
    _adam_kernel,
    _adam_nonfinite_kernel,
    _chunk_offsets_kernel,
    _coalesce_dense_kernel,
    _coalesce_sorted_kernel,
    _gather_kernel,
    _lookup_bag_kernel,
    _lookup_kernel,
    _restore_kernel,
    _scatter_partitioned_kernel,
    _scatter_private_kernel,
    _scatter_serial_kernel,
    _sgd_checked_kernel,
    _sgd_kernel,
    _sgd_nonfinite_kernel,
    _warm_kernel,
)
from ._jit import OPTIMIZER_CODES as OPTIMIZER_CODES
from .collection import (
    FeatureLayout,
    TableHash,
    coalesce_chunk_rows,
    coalesce_table_pushes,
    collection_coalesce_grad,
    collection_first_bad_id,
    collection_lookup,
    collection_scatter_grad,
    distinct_by_table,
)
from .runtime import PREFETCH_READ_MIN_BYTES, PREFETCH_WRITE_MIN_BYTES, compile_target, set_kernel_threads
from .runtime import hash_setup as _hash_setup
from .runtime import wrap_int64 as _wrap_int64

__all__ = [
    "FeatureLayout",
    "TableHash",
    "adagrad_step",
    "adam_step",
    "checked_step",
    "chunk_offsets",
    "coalesce_chunk_rows",
    "coalesce_grad",
    "coalesce_table_pushes",
    "collection_coalesce_grad",
    "collection_first_bad_id",
    "collection_lookup",
    "collection_scatter_grad",
    "compile_target",
    "distinct_by_table",
    "fits_int32_offsets",
    "gather",
    "lookup",
    "lookup_bag",
    "scatter_grad",
    "set_kernel_threads",
    "sgd_step",
]

BagMode = Literal["sum", "mean"]

# Batches of rows at least this big are written with streaming (non-temporal) stores: bigger than L2,
# and a large share of L3, so caching them would only evict the table
# (docs/benchmarks/kernel-constants.md#_streaming_min_bytes).
_STREAMING_MIN_BYTES = 4 << 20
# A parallel dense backward gives each thread a private (m,) copy while they all fit in this many floats
# (64 MB); past that, threads split the array into ranges and bucket the chunks by range.
_PRIVATE_SCATTER_MAX_FLOATS = 16 << 20
# Per-thread scratch buffers up to this size are kept for the next call (see ``_scratch``).
_SCRATCH_MAX_BYTES = 64 << 20
_thread_scratch = threading.local()
# Where prefetching starts: runtime.PREFETCH_READ_MIN_BYTES / PREFETCH_WRITE_MIN_BYTES (tests patch these).
_PREFETCH_READ_MIN_BYTES = PREFETCH_READ_MIN_BYTES
_PREFETCH_WRITE_MIN_BYTES = PREFETCH_WRITE_MIN_BYTES
# Below the read-prefetch size, a gather that reads at least this many times the table's bytes first
# reads the whole table once in order (``_warm_kernel``): in training the table is out of the caches
# when the forward runs, and a sequential pass is streamed by the hardware prefetcher where random chunk
# reads wait on one miss after another (docs/benchmarks/kernel-constants.md#_warm_table_ratio).
_WARM_TABLE_RATIO = 8


def _warm_table(weight_np: np.ndarray, gathered_bytes: int) -> None:
    """Stream a table below the read-prefetch size through the caches before a gather that reads at
    least ``_WARM_TABLE_RATIO`` times its bytes (see ``_WARM_TABLE_RATIO``)."""
    if weight_np.nbytes < _PREFETCH_READ_MIN_BYTES and weight_np.nbytes * _WARM_TABLE_RATIO <= gathered_bytes:
        _warm_kernel(weight_np)


def _ids_np(ids: torch.Tensor, strided: bool = False) -> np.ndarray:
    """A numpy view of 1-D int64 ``ids``; contiguous unless ``strided`` lets a strided view through."""
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise InvalidInputError(
            f"ids must be a 1-D int64 tensor, got {ids.dtype} of shape {tuple(ids.shape)}"
        )
    return ids.numpy() if strided else ids.contiguous().numpy()


def _weight_np(weight: torch.Tensor) -> np.ndarray:
    if weight.dtype != torch.float32 or weight.dim() != 1 or not weight.is_contiguous():
        raise ConfigError("weight must be a contiguous 1-D float32 tensor")
    return weight.detach().numpy()


def _num_chunks(embedding_dim: int, chunk_size: int) -> int:
    return -(-embedding_dim // chunk_size)


def chunk_offsets(
    ids: torch.Tensor,
    num_chunks: int,
    chunk_size: int,
    memory_size: int,
    random_numbers: torch.Tensor,
    val_offset: int = 0,
    hash: str = "paper",
    dtype: torch.dtype = torch.int64,
) -> torch.Tensor:
    """Start offset of every chunk of every id: int64 (N, num_chunks) in ``[0, memory_size - chunk_size]``.

    Bit-exact with ``hashing.reference_chunk_offsets``. ``ids`` is int64 (N,); any int64 value is valid.
    ``dtype=torch.int32`` gives the same offsets as int32 (for ``gather`` and ``scatter_grad``; only
    when ``memory_size - chunk_size < 2**31``): half the bytes to write, keep and read back.
    """
    hash_mode, constants, range_size = _hash_setup(hash, random_numbers, memory_size, chunk_size)
    if dtype not in _OFFSET_DTYPES:
        raise ConfigError(f"offsets dtype must be torch.int64 or torch.int32, got {dtype}")
    if dtype == torch.int32 and not fits_int32_offsets(memory_size, chunk_size):
        raise ConfigError(f"int32 offsets need memory_size - chunk_size < 2**31 (m = {memory_size})")
    # A strided column (``pairs[:, 0]``) is hashed where it lies: the kernel reads each id once, and a
    # copy costs the training share (docs/benchmarks/kernel-constants.md#strided-ids).
    ids_np = _ids_np(ids, strided=True)
    out = _empty((ids_np.shape[0], num_chunks), _OFFSET_DTYPES[dtype])
    if ids_np.shape[0] and num_chunks:
        set_kernel_threads()
        _chunk_offsets_kernel(
            ids_np,
            np.int64(_wrap_int64(val_offset)),
            num_chunks,
            hash_mode,
            constants,
            range_size,
            out.numpy(),
            work=ids_np.shape[0] * num_chunks,
        )
    return out


# Chunk offsets may be int32 where every one fits: the training forward keeps them for the backward, and
# int32 halves what the hash writes and the gather and the backward read back
# (docs/benchmarks/kernel-constants.md#_offset_dtypes).
_OFFSET_DTYPES = {torch.int64: np.int64, torch.int32: np.int32}


def fits_int32_offsets(memory_size: int, chunk_size: int) -> bool:
    """Whether every chunk offset of an array of ``memory_size`` floats fits an int32."""
    return memory_size - chunk_size < 1 << 31


def _empty(shape: tuple[int, ...], dtype: type) -> torch.Tensor:
    """A new uninitialised CPU tensor whose memory numpy allocated, from ``buffers``' pool when large.

    glibc serves a multi-megabyte ``torch.empty`` with a fresh ``mmap`` every call, so writing a batch of
    rows first takes thousands of page faults (docs/benchmarks/kernel-constants.md#_empty). numpy asks
    the kernel for transparent huge pages on large arrays, which makes those faults far fewer, and the
    pool hands a freed batch's memory to the next one, so that whether it faults does not depend on what
    else the process allocated before (see ``buffers.py``). ``torch.from_numpy`` shares the memory; the
    tensor behaves like any other.
    """
    return torch.from_numpy(buffers.empty(shape, dtype))


def _streaming(out: torch.Tensor, embedding_dim: int, chunk_size: int) -> bool:
    """Stream rows past the cache when the batch outgrows it and every chunk lands 16-byte aligned."""
    return (
        out.numel() * 4 >= _STREAMING_MIN_BYTES
        and embedding_dim % 4 == 0
        and chunk_size % 4 == 0
        and out.data_ptr() % 16 == 0
    )


def _out_rows(out: torch.Tensor | None, num_rows: int, embedding_dim: int) -> torch.Tensor:
    if out is None:
        return _empty((num_rows, embedding_dim), np.float32)
    if out.dtype != torch.float32 or tuple(out.shape) != (num_rows, embedding_dim) or not out.is_contiguous():
        raise ConfigError(f"out must be a contiguous float32 tensor of shape ({num_rows}, {embedding_dim})")
    return out


def gather(
    weight: torch.Tensor,
    offsets: torch.Tensor,
    embedding_dim: int,
    chunk_size: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows from chunk offsets: float32 (N, embedding_dim); ``offsets`` int64 or int32 (N, ceil(d / Z)).

    Offsets are trusted to lie in ``[0, len(weight) - chunk_size]`` (as ``chunk_offsets`` makes them).
    """
    weight_np = _weight_np(weight)
    if offsets.dtype not in _OFFSET_DTYPES or offsets.dim() != 2:
        raise InvalidInputError("offsets must be a 2-D int64 or int32 tensor")
    if offsets.shape[1] != _num_chunks(embedding_dim, chunk_size):
        raise InvalidInputError(f"offsets must have {_num_chunks(embedding_dim, chunk_size)} columns")
    result = _out_rows(out, offsets.shape[0], embedding_dim)
    if offsets.shape[0]:
        set_kernel_threads()
        _warm_table(weight_np, result.numel() * 4)
        _gather_kernel.for_chunk(chunk_size)(
            weight_np,
            offsets.contiguous().numpy(),
            embedding_dim,
            chunk_size,
            _streaming(result, embedding_dim, chunk_size),
            weight_np.nbytes >= _PREFETCH_READ_MIN_BYTES,
            result.numpy(),
            work=result.numel(),
        )
    return result


def lookup(
    weight: torch.Tensor,
    ids: torch.Tensor,
    embedding_dim: int,
    chunk_size: int,
    random_numbers: torch.Tensor,
    val_offset: int = 0,
    hash: str = "paper",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused hash + gather: float32 (N, embedding_dim) rows of int64 ``ids`` (N,) from ``weight`` (m,)."""
    hash_mode, constants, _ = _hash_setup(hash, random_numbers, weight.shape[0], chunk_size, embedding_dim)
    weight_np = _weight_np(weight)
    ids_np = _ids_np(ids)
    result = _out_rows(out, ids_np.shape[0], embedding_dim)
    if ids_np.shape[0]:
        set_kernel_threads()
        _warm_table(weight_np, result.numel() * 4)
        _lookup_kernel.for_chunk(chunk_size)(
            weight_np,
            ids_np,
            np.int64(_wrap_int64(val_offset)),
            embedding_dim,
            chunk_size,
            hash_mode,
            constants,
            _streaming(result, embedding_dim, chunk_size),
            weight_np.nbytes >= _PREFETCH_READ_MIN_BYTES,
            result.numpy(),
            work=result.numel(),
        )
    return result


def lookup_bag(
    weight: torch.Tensor,
    ids: torch.Tensor,
    bag_offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    mode: BagMode,
    embedding_dim: int,
    chunk_size: int,
    random_numbers: torch.Tensor,
    val_offset: int = 0,
    hash: str = "paper",
) -> torch.Tensor:
    """Fused pooled lookup: float32 (B, embedding_dim), like ``F.embedding_bag(..., offsets=bag_offsets)``.

    ``bag_offsets`` int64 (B,) are the start of each bag in ``ids`` (N,) (non-decreasing, first 0, last
    <= N; a bag runs to the next start or to N). ``per_sample_weights`` float32 (N,) scales each row
    before pooling (``mode="sum"`` only, as in torch). Empty bags give zeros.
    """
    hash_mode, constants, _ = _hash_setup(hash, random_numbers, weight.shape[0], chunk_size, embedding_dim)
    if mode not in ("sum", "mean"):
        raise ConfigError(f"mode must be 'sum' or 'mean', got {mode!r}")
    weight_np = _weight_np(weight)
    ids_np = _ids_np(ids)
    if bag_offsets.dtype != torch.int64 or bag_offsets.dim() != 1:
        raise InvalidInputError("bag offsets must be a 1-D int64 tensor")
    offsets_np = bag_offsets.contiguous().numpy()
    if offsets_np.shape[0] and (
        offsets_np[0] != 0 or offsets_np[-1] > ids_np.shape[0] or np.any(np.diff(offsets_np) < 0)
    ):
        raise InvalidInputError("bag offsets must start at 0, be non-decreasing and not exceed len(ids)")
    if per_sample_weights is None:
        weights_np = np.empty(0, dtype=np.float32)
    else:
        if mode != "sum":
            raise InvalidInputError("per_sample_weights is only supported with mode='sum'")
        if per_sample_weights.dtype != torch.float32 or tuple(per_sample_weights.shape) != tuple(ids.shape):
            raise InvalidInputError("per_sample_weights must be float32 with the shape of ids")
        weights_np = per_sample_weights.detach().contiguous().numpy()
    out = _empty((offsets_np.shape[0], embedding_dim), np.float32)
    if offsets_np.shape[0]:
        set_kernel_threads()
        _lookup_bag_kernel(
            weight_np,
            ids_np,
            offsets_np,
            weights_np,
            per_sample_weights is not None,
            mode == "mean",
            np.int64(_wrap_int64(val_offset)),
            embedding_dim,
            chunk_size,
            hash_mode,
            constants,
            weight_np.nbytes >= _PREFETCH_READ_MIN_BYTES,
            out.numpy(),
            work=ids_np.shape[0] * embedding_dim,
        )
    return out


def _scratch(name: str, size: int, dtype: type) -> np.ndarray:
    """A 1-D scratch array of at least ``size`` elements (contents undefined), kept per thread.

    A fresh multi-megabyte buffer per call costs page faults: glibc hands freed memory back to the kernel
    (docs/benchmarks/kernel-constants.md#_scratch_max_bytes). Buffers up to
    ``_SCRATCH_MAX_BYTES`` are kept for the next call of the same thread (kernels run without the GIL,
    so threads must not share them); bigger ones are allocated each time.
    """
    nbytes = size * np.dtype(dtype).itemsize
    if nbytes > _SCRATCH_MAX_BYTES:
        return np.empty(size, dtype=dtype)
    buffers: dict[str, np.ndarray] | None = getattr(_thread_scratch, "buffers", None)
    if buffers is None:
        buffers = _thread_scratch.buffers = {}
    buffer = buffers.get(name)
    if buffer is None or buffer.shape[0] < size or buffer.dtype != dtype:
        buffer = buffers[name] = np.empty(size, dtype=dtype)
    return buffer


def _grad_inputs(
    grad_rows: torch.Tensor, offsets: torch.Tensor, chunk_size: int, keep_int32: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """numpy views for a backward kernel; offsets as int64 unless ``keep_int32`` lets int32 ones through."""
    if grad_rows.dim() != 2 or offsets.dim() != 2 or grad_rows.shape[0] != offsets.shape[0]:
        raise InvalidInputError("grad_rows (N, d) and offsets (N, C) must have the same N")
    if offsets.shape[1] != _num_chunks(grad_rows.shape[1], chunk_size):
        raise InvalidInputError("offsets must have ceil(d / chunk_size) columns")
    grads = grad_rows.detach().to(torch.float32).contiguous().numpy()
    keep = keep_int32 and offsets.dtype == torch.int32
    return grads, (offsets if keep else offsets.to(torch.int64)).contiguous().numpy()


def scatter_grad(grad_rows: torch.Tensor, offsets: torch.Tensor, chunk_size: int, out: torch.Tensor) -> None:
    """Dense backward, in place: ``out[offsets[n, c] + j] += grad_rows[n, c * Z + j]``; out float32 (m,).
    ``offsets`` int64 or int32 (as ``chunk_offsets(..., dtype=torch.int32)`` gives them)."""
    grads, offsets_np = _grad_inputs(grad_rows, offsets, chunk_size, keep_int32=True)
    if out.dtype != torch.float32 or out.dim() != 1 or not out.is_contiguous():
        raise ConfigError("out must be a contiguous 1-D float32 tensor")
    if grads.shape[0] == 0:
        return
    threads = set_kernel_threads()
    out_np = out.detach().numpy()
    memory_size = out.shape[0]
    if threads == 1 or grads.shape[0] < 256:
        prefetch = out_np.nbytes >= _PREFETCH_WRITE_MIN_BYTES
        kernel = _scatter_serial_kernel.for_chunk(chunk_size).serial
        kernel(grads, offsets_np, grads.shape[1], chunk_size, prefetch, out_np)
    elif memory_size * threads <= _PRIVATE_SCATTER_MAX_FLOATS:
        kernel = _scatter_private_kernel.for_chunk(chunk_size).parallel
        kernel(grads, offsets_np, grads.shape[1], chunk_size, out_np, threads)
    else:
        _scatter_partitioned_kernel(grads, offsets_np, grads.shape[1], chunk_size, out_np, threads)


def coalesce_grad(
    grad_rows: torch.Tensor, offsets: torch.Tensor, chunk_size: int, memory_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse backward: sorted unique locations int64 (K,) and their summed gradients float32 (K,).

    Uses a dense (m,) scratch buffer when ``memory_size`` is small next to the number of gradient values,
    and a sort of the chunk starts otherwise, so a huge array never costs O(m) memory or time.
    """
    grads, offsets_np = _grad_inputs(grad_rows, offsets, chunk_size)
    if grads.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.float32)
    if memory_size <= _DENSE_COALESCE_FACTOR * grads.size:
        values_dense = _scratch("coalesce.values", memory_size, np.float32)
        coverage = _scratch("coalesce.coverage", memory_size + 1, np.int32)
        locations, values = _coalesce_dense_kernel(
            grads, offsets_np, grads.shape[1], chunk_size, memory_size, values_dense, coverage
        )
    else:
        locations, values = _coalesce_sorted_kernel(grads, offsets_np, grads.shape[1], chunk_size)
    return torch.from_numpy(locations), torch.from_numpy(values)


def _step_inputs(
    weight: torch.Tensor, locations: torch.Tensor, values: torch.Tensor
) -> tuple[np.ndarray, ...]:
    if (
        locations.dtype != torch.int64
        or locations.dim() != 1
        or tuple(values.shape) != tuple(locations.shape)
    ):
        raise InvalidInputError("locations must be int64 (K,) and values (K,)")
    return (
        _weight_np(weight),
        locations.contiguous().numpy(),
        values.detach().to(torch.float32).contiguous().numpy(),
    )


def _state_np(state: torch.Tensor, weight: torch.Tensor, name: str) -> np.ndarray:
    if state.dtype != torch.float32 or state.shape != weight.shape or not state.is_contiguous():
        raise ConfigError(f"{name} must be a contiguous float32 tensor shaped like weight")
    return state.detach().numpy()


def sgd_step(weight: torch.Tensor, locations: torch.Tensor, values: torch.Tensor, lr: float) -> None:
    """In place ``weight[loc] -= lr * g`` (like ``torch.optim.SGD``); ``locations`` must be unique."""
    weight_np, loc_np, val_np = _step_inputs(weight, locations, values)
    set_kernel_threads()
    _sgd_kernel(weight_np, loc_np, val_np, np.float32(lr), work=loc_np.shape[0])


def sgd_nonfinite(weight: torch.Tensor, locations: torch.Tensor, values: torch.Tensor, lr: float) -> int:
    """How many of ``locations`` ``sgd_step`` would leave non-finite (or have a non-finite gradient);
    reads only, so a caller can refuse the step before changing anything."""
    weight_np, loc_np, val_np = _step_inputs(weight, locations, values)
    set_kernel_threads()
    return int(_sgd_nonfinite_kernel(weight_np, loc_np, val_np, np.float32(lr), work=loc_np.shape[0]))


def adagrad_nonfinite(
    weight: torch.Tensor,
    state_sum: torch.Tensor,
    locations: torch.Tensor,
    values: torch.Tensor,
    lr: float,
    eps: float,
) -> int:
    """As ``sgd_nonfinite`` for ``adagrad_step`` (its weight and its ``state_sum``)."""
    weight_np, loc_np, val_np = _step_inputs(weight, locations, values)
    set_kernel_threads()
    state_np = _state_np(state_sum, weight, "state_sum")
    work = loc_np.shape[0]
    return int(
        _adagrad_nonfinite_kernel(
            weight_np, state_np, loc_np, val_np, np.float32(lr), np.float32(eps), work=work
        )
    )


def adam_nonfinite(
    weight: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    locations: torch.Tensor,
    values: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
) -> int:
    """As ``sgd_nonfinite`` for ``adam_step`` (its weight and both moments) taken as step ``step``."""
    step_size = adam_step_size(lr, beta1, beta2, step)
    weight_np, loc_np, val_np = _step_inputs(weight, locations, values)
    set_kernel_threads()
    return int(
        _adam_nonfinite_kernel(
            weight_np,
            _state_np(exp_avg, weight, "exp_avg"),
            _state_np(exp_avg_sq, weight, "exp_avg_sq"),
            loc_np,
            val_np,
            np.float32(beta1),
            np.float32(beta2),
            np.float32(eps),
            np.float32(step_size),
            work=loc_np.shape[0],
        )
    )


def checked_step(
    optimizer: str,
    weight: torch.Tensor,
    states: Sequence[torch.Tensor],
    locations: torch.Tensor,
    values: torch.Tensor,
    scalars: Sequence[float],
) -> int:
    """``<optimizer>_nonfinite`` and ``<optimizer>_step`` in one pass over ``locations`` (unique): the step
    is applied and 0 returned, or, when it would leave any value non-finite, the count of such locations
    is returned and every array holds what it held before (the locations written before the count was
    known are put back). One read of each touched location where the two calls make two. Meanwhile a
    reader without the caller's lock may see a refused step's finite new values.

    ``states``: sgd none, adagrad (sum,), adam (exp_avg, exp_avg_sq); ``scalars``: sgd (lr,), adagrad
    (lr, eps), adam (lr, beta1, beta2, eps, step)."""
    weight_np, loc_np, val_np = _step_inputs(weight, locations, values)
    arrays = [weight_np] + [_state_np(state, weight, "the optimizer state") for state in states]
    kept = [_scratch(f"checked_step.{i}", loc_np.shape[0], np.float32) for i in range(len(arrays))]
    set_kernel_threads()
    work = loc_np.shape[0]
    if optimizer == "sgd":
        (lr,) = scalars
        bad = _sgd_checked_kernel(weight_np, loc_np, val_np, np.float32(lr), *kept, work=work)
    elif optimizer == "adagrad":
        lr, eps = scalars
        bad = _adagrad_checked_kernel(
            *arrays, loc_np, val_np, np.float32(lr), np.float32(eps), *kept, work=work
        )
    elif optimizer == "adam":
        lr, beta1, beta2, eps, step = scalars
        step_size = np.float32(adam_step_size(lr, beta1, beta2, int(step)))
        f32 = np.float32
        bad = _adam_checked_kernel(
            *arrays, loc_np, val_np, f32(beta1), f32(beta2), f32(eps), step_size, *kept, work=work
        )
    else:
        raise ConfigError(f"unknown optimizer {optimizer!r}")
    if bad:
        for array, old in zip(arrays, kept, strict=True):
            _restore_kernel(array, loc_np, old, work=work)
    return int(bad)


def adam_step_size(lr: float, beta1: float, beta2: float, step: int) -> float:
    """The bias-corrected step size of Adam step number ``step`` (1 for the first update), in float64: the
    one formula every Adam path (``adam_step``, ``adam_nonfinite``, the small-batch step) must share to stay
    bit-identical."""
    if step < 1:
        raise ConfigError(f"step must be >= 1, got {step}")
    return lr * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)


def adagrad_step(
    weight: torch.Tensor,
    state_sum: torch.Tensor,
    locations: torch.Tensor,
    values: torch.Tensor,
    lr: float,
    eps: float,
) -> None:
    """In place Adagrad (``torch.optim.Adagrad``, lr_decay=0): ``sum += g*g; w -= lr*g / (sqrt(sum)+eps)``.

    ``state_sum`` float32 (m,) starts at the initial accumulator value; ``locations`` must be unique.
    """
    weight_np, loc_np, val_np = _step_inputs(weight, locations, values)
    set_kernel_threads()
    _adagrad_kernel(
        weight_np,
        _state_np(state_sum, weight, "state_sum"),
        loc_np,
        val_np,
        np.float32(lr),
        np.float32(eps),
        work=loc_np.shape[0],
    )


def adam_step(
    weight: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    locations: torch.Tensor,
    values: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
) -> None:
    """In place lazy Adam, as ``torch.optim.SparseAdam``: only ``locations`` (unique) are touched.

    ``step`` is the step number being taken (1 for the first update); the bias corrections use it.
    """
    step_size = adam_step_size(lr, beta1, beta2, step)
    weight_np, loc_np, val_np = _step_inputs(weight, locations, values)
    set_kernel_threads()
    _adam_kernel(
        weight_np,
        _state_np(exp_avg, weight, "exp_avg"),
        _state_np(exp_avg_sq, weight, "exp_avg_sq"),
        loc_np,
        val_np,
        np.float32(beta1),
        np.float32(beta2),
        np.float32(eps),
        np.float32(step_size),
        work=loc_np.shape[0],
    )
