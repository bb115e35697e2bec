"""The checked kernel API of collections: many features over one shared array in one call each way.

A collection's batch is jagged and key-major, like a torchrec ``KeyedJaggedTensor``: F features of B bags
each, bag ``f * B + b`` holding ``ids[bag_bounds[g]:bag_bounds[g + 1]]``. ``FeatureLayout`` gives each
feature its dim, ``val_offset``, pooling and output columns; ``collection_lookup`` pools every feature in
one compiled call (``_jit._collection_forward_kernel``), ``collection_coalesce_grad`` and
``collection_scatter_grad`` are its sparse and dense backward, one call each, ``coalesce_chunk_rows``
coalesces several tables' row gradients into one update of their array, and ``coalesce_table_pushes``
does the same from the tables' ids, hashing and checking them in the same call (a server's step of a
collection). Re-exported by ``robez_core.kernels``; tests: tests/core/test_collection.py.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .. import buffers
from ..errors import ConfigError, InvalidInputError
from ._jit import (
    _DENSE_COALESCE_FACTOR,
    TABLES_NON_FINITE,
    TABLES_OUT_OF_RANGE,
    _coalesce_chunks_kernel,
    _coalesce_tables_kernel,
    _collection_coalesce_kernel,
    _collection_first_bad_id,
    _collection_forward_kernel,
    _collection_scatter_kernel,
    _distinct_by_table_kernel,
    _row_chunk_sources,
)
from .runtime import (
    PREFETCH_READ_MIN_BYTES,
    PREFETCH_WRITE_MIN_BYTES,
    hash_setup,
    set_kernel_threads,
    wrap_int64,
)

__all__ = [
    "FeatureLayout",
    "coalesce_chunk_rows",
    "coalesce_table_pushes",
    "collection_coalesce_grad",
    "collection_first_bad_id",
    "collection_lookup",
    "collection_scatter_grad",
    "distinct_by_table",
]


def _ids_np(ids: torch.Tensor) -> np.ndarray:
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
        raise InvalidInputError("ids must be a 1-D int64 tensor")
    return ids.contiguous().numpy()


def _weight_np(weight: torch.Tensor) -> np.ndarray:
    if weight.dtype != torch.float32 or weight.dim() != 1 or not weight.is_contiguous():
        raise ConfigError("weight must be a contiguous 1-D float32 tensor")
    return weight.detach().numpy()


@dataclass(frozen=True)
class FeatureLayout:
    """The per-feature numbers of a collection's kernels, F features over one array: numpy (F,) arrays.

    ``val_offsets`` int64 (already wrapped to int64), ``dims`` int64 d_f, ``columns`` int64 (where feature
    f's d_f values start in the (B, width) output), ``mean`` bool (mean pooling, else sum),
    ``num_embeddings`` int64 (ids must lie in ``[0, n_f)``); ``chunk_size`` Z and ``width`` = sum of dims.
    """

    val_offsets: np.ndarray
    dims: np.ndarray
    columns: np.ndarray
    mean: np.ndarray
    num_embeddings: np.ndarray
    chunk_size: int
    width: int

    @classmethod
    def build(
        cls,
        val_offsets: Sequence[int],
        dims: Sequence[int],
        mean: Sequence[bool],
        num_embeddings: Sequence[int],
        chunk_size: int,
        columns: Sequence[int] | None = None,
    ) -> FeatureLayout:
        """Checked layout; output ``columns`` default to the features' order (a collection fed its
        features in another order passes where each one's values go)."""
        if not len(val_offsets) == len(dims) == len(mean) == len(num_embeddings) or not dims:
            raise ConfigError("a collection needs one val_offset, dim, pooling and size per feature (>= 1)")
        if chunk_size < 1 or min(dims) < 1 or min(num_embeddings) < 1:
            raise ConfigError("chunk_size, embedding dims and num_embeddings must be >= 1")
        dims_np = np.asarray(dims, dtype=np.int64)
        width = int(dims_np.sum())
        if columns is None:
            columns_np = np.concatenate([[0], np.cumsum(dims_np)[:-1]]).astype(np.int64)
        else:
            columns_np = np.asarray(columns, dtype=np.int64)
            covered = np.zeros(width + 1, dtype=np.int64)
            if (
                columns_np.shape != dims_np.shape
                or columns_np.min() < 0
                or (columns_np + dims_np).max() > width
            ):
                raise ConfigError("feature columns must place every feature inside the output width")
            np.add.at(covered, columns_np, 1)
            np.add.at(covered, columns_np + dims_np, -1)
            if not np.all(np.cumsum(covered)[:width] == 1):
                raise ConfigError("feature columns must cover the output once, without overlap")
        return cls(
            np.asarray([wrap_int64(v) for v in val_offsets], dtype=np.int64),
            dims_np,
            columns_np,
            np.asarray(mean, dtype=np.bool_),
            np.asarray(num_embeddings, dtype=np.int64),
            int(chunk_size),
            width,
        )

    @property
    def num_features(self) -> int:
        return int(self.dims.shape[0])

    @property
    def num_chunks(self) -> np.ndarray:
        """C_f = ceil(d_f / Z) per feature: int64 (F,)."""
        return -(-self.dims // self.chunk_size)


def _bag_bounds_np(
    ids: torch.Tensor, bag_bounds: torch.Tensor, layout: FeatureLayout
) -> tuple[np.ndarray, int]:
    """numpy view of key-major ``bag_bounds`` (F * B + 1,) checked against ``ids``; returns it and B."""
    if bag_bounds.dtype != torch.int64 or bag_bounds.dim() != 1:
        raise InvalidInputError("bag bounds must be a 1-D int64 tensor (offsets, F * B + 1 entries)")
    bounds = bag_bounds.contiguous().numpy()
    num_bags = bounds.shape[0] - 1
    if num_bags < 0 or num_bags % layout.num_features:
        raise InvalidInputError(
            f"{num_bags} bags do not split into {layout.num_features} features of B bags each"
        )
    if bounds[0] != 0 or bounds[-1] != ids.shape[0] or (num_bags and np.any(bounds[1:] < bounds[:-1])):
        raise InvalidInputError("offsets must start at 0, be non-decreasing and end at len(values)")
    return bounds, num_bags // layout.num_features


def _chunk_base(bounds: np.ndarray, batch_size: int, layout: FeatureLayout) -> np.ndarray:
    """Where each feature's chunks start in the flat chunk array: int64 (F + 1,)."""
    feature_ids = np.diff(bounds[::batch_size]) if batch_size else np.zeros(layout.num_features, np.int64)
    return np.concatenate([[0], np.cumsum(feature_ids * layout.num_chunks)]).astype(np.int64)


def collection_first_bad_id(ids: torch.Tensor, bag_bounds: torch.Tensor, layout: FeatureLayout) -> int:
    """Index of the first id outside ``[0, num_embeddings)`` of its feature, or -1 when all are in range."""
    ids_np = _ids_np(ids)
    bounds, batch_size = _bag_bounds_np(ids, bag_bounds, layout)
    if batch_size == 0:
        return -1
    return int(_collection_first_bad_id(ids_np, bounds, batch_size, layout.num_embeddings))


def collection_lookup(
    weight: torch.Tensor,
    ids: torch.Tensor,
    bag_bounds: torch.Tensor,
    layout: FeatureLayout,
    random_numbers: torch.Tensor,
    hash: str = "paper",
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """Every feature's pooled rows in one call: (pooled float32 (B, width), chunk offsets int64 (K_c,),
    chunk base int64 (F + 1,)).

    ``ids`` int64 (N,) and ``bag_bounds`` int64 (F * B + 1,) are a key-major jagged batch (a torchrec
    ``KeyedJaggedTensor``'s values and offsets): bag ``f * B + b`` is sample b of feature f. Feature f
    is pooled into columns ``[columns[f], columns[f] + dims[f])`` exactly as ``lookup_bag`` pools it (the
    same bits); the chunk offsets of every id, feature by feature, are what the backward takes.
    """
    max_dim = int(layout.dims.max())
    hash_mode, constants, _ = hash_setup(hash, random_numbers, weight.shape[0], layout.chunk_size, max_dim)
    weight_np = _weight_np(weight)
    ids_np = _ids_np(ids)
    bounds, batch_size = _bag_bounds_np(ids, bag_bounds, layout)
    chunk_base = _chunk_base(bounds, batch_size, layout)
    out = torch.from_numpy(buffers.empty((batch_size, layout.width), np.float32))
    chunk_offsets = np.empty(int(chunk_base[-1]), dtype=np.int64)
    if batch_size:
        set_kernel_threads()
        _collection_forward_kernel(
            weight_np,
            ids_np,
            bounds,
            batch_size,
            layout.val_offsets,
            layout.dims,
            layout.columns,
            layout.mean,
            chunk_base,
            layout.chunk_size,
            hash_mode,
            constants,
            weight_np.nbytes >= PREFETCH_READ_MIN_BYTES,
            out.numpy(),
            chunk_offsets,
            work=ids_np.shape[0] * max_dim,
        )
    return out, torch.from_numpy(chunk_offsets), chunk_base


def _collection_grad_np(grad_output: torch.Tensor, batch_size: int, layout: FeatureLayout) -> np.ndarray:
    if tuple(grad_output.shape) != (batch_size, layout.width):
        raise InvalidInputError(
            f"the output gradient must be ({batch_size}, {layout.width}), got {tuple(grad_output.shape)}"
        )
    return grad_output.detach().to(torch.float32).contiguous().numpy()


def _backward_inputs(
    grad_output: torch.Tensor,
    ids: torch.Tensor,
    bag_bounds: torch.Tensor,
    layout: FeatureLayout,
    chunk_offsets: torch.Tensor,
) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
    """What both backwards of ``collection_lookup`` read, checked: the bags' bounds, the batch size, the
    output gradient as float32 numpy and each feature's first chunk; the forward's chunk offsets must
    match."""
    bounds, batch_size = _bag_bounds_np(ids, bag_bounds, layout)
    grads = _collection_grad_np(grad_output, batch_size, layout)
    chunk_base = _chunk_base(bounds, batch_size, layout)
    if chunk_offsets.dtype != torch.int64 or tuple(chunk_offsets.shape) != (int(chunk_base[-1]),):
        raise InvalidInputError("chunk offsets must be the int64 (K_c,) that collection_lookup returned")
    return bounds, batch_size, grads, chunk_base


def collection_scatter_grad(
    grad_output: torch.Tensor,
    ids: torch.Tensor,
    bag_bounds: torch.Tensor,
    layout: FeatureLayout,
    chunk_offsets: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Dense backward of ``collection_lookup``, in place into ``out`` float32 (m,): every feature's
    gradient (``grad_output`` (B, width); mean bags divided by their length) added at its chunks. Serial,
    so at any thread count the sums are grouped as one thread's ``scatter_grad`` of the rows."""
    bounds, batch_size, grads, chunk_base = _backward_inputs(
        grad_output, ids, bag_bounds, layout, chunk_offsets
    )
    out_np = _weight_np(out)
    if chunk_base[-1] == 0:
        return
    _collection_scatter_kernel(
        grads,
        bounds,
        batch_size,
        layout.dims,
        layout.columns,
        layout.mean,
        chunk_base,
        layout.chunk_size,
        chunk_offsets.contiguous().numpy(),
        out_np.nbytes >= PREFETCH_WRITE_MIN_BYTES,
        out_np,
    )


def _coalesce_scratch(memory_size: int, total_values: int) -> tuple[bool, np.ndarray, np.ndarray]:
    """(dense?, values scratch, coverage scratch) by ``coalesce_grad``'s rule, so the same gradient gives
    the same variant and the same bits."""
    if memory_size <= _DENSE_COALESCE_FACTOR * total_values:  # small m: scratch of m is cheap
        return True, np.empty(memory_size, np.float32), np.empty(memory_size + 1, np.int32)
    return False, np.empty(0, np.float32), np.empty(0, np.int32)


def collection_coalesce_grad(
    grad_output: torch.Tensor,
    ids: torch.Tensor,
    bag_bounds: torch.Tensor,
    layout: FeatureLayout,
    chunk_offsets: torch.Tensor,
    memory_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse backward of ``collection_lookup``: sorted unique locations int64 (K,) and their summed
    gradients float32 (K,), all features at once. The same bits as ``coalesce_grad`` of the per-feature
    gradient rows concatenated in feature order (``coalesce_chunk_rows``): one update of the array."""
    bounds, batch_size, grads, chunk_base = _backward_inputs(
        grad_output, ids, bag_bounds, layout, chunk_offsets
    )
    if chunk_base[-1] == 0:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.float32)
    feature_ids = np.diff(bounds[::batch_size])
    dense, values_dense, coverage = _coalesce_scratch(memory_size, int((feature_ids * layout.dims).sum()))
    locations, values = _collection_coalesce_kernel(
        grads,
        bounds,
        batch_size,
        layout.dims,
        layout.columns,
        layout.mean,
        chunk_base,
        layout.chunk_size,
        chunk_offsets.contiguous().numpy(),
        memory_size,
        dense,
        values_dense,
        coverage,
    )
    return torch.from_numpy(locations), torch.from_numpy(values)


def coalesce_chunk_rows(
    offsets: Sequence[torch.Tensor], grad_rows: Sequence[torch.Tensor], chunk_size: int, memory_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One coalesced update of an array from several tables' updates: sorted unique locations int64 (K,)
    and summed gradients float32 (K,) of table t's rows ``grad_rows[t]`` (N_t, d_t) at chunk
    ``offsets[t]`` (N_t, C_t), tables in the order given (dims may differ).

    What a server needs to apply one step of a collection's features that share an array: the same bits
    as ``collection_coalesce_grad`` when table t is feature t with its per-id gradients, and, for one
    table or equal dims, as ``coalesce_grad`` of the concatenated rows.
    """
    if len(offsets) != len(grad_rows) or not offsets:
        raise InvalidInputError("give one offsets tensor per grad_rows tensor (at least one)")
    keys, flat = [], []
    table_rows = np.empty(len(offsets), dtype=np.int64)
    table_dims = np.empty(len(offsets), dtype=np.int64)
    for t, (table_offsets, rows) in enumerate(zip(offsets, grad_rows, strict=True)):
        if rows.dim() != 2 or table_offsets.dim() != 2 or rows.shape[0] != table_offsets.shape[0]:
            raise InvalidInputError("each table's grad_rows (N, d) and offsets (N, C) must have the same N")
        if table_offsets.shape[1] != -(-rows.shape[1] // chunk_size):
            raise InvalidInputError("offsets must have ceil(d / chunk_size) columns")
        keys.append(table_offsets.to(torch.int64).contiguous().numpy().reshape(-1))
        flat.append(rows.detach().to(torch.float32).contiguous().numpy().reshape(-1))
        table_rows[t], table_dims[t] = rows.shape
    keys_np = np.concatenate(keys) if len(keys) > 1 else keys[0]
    if keys_np.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.float32)
    if int(keys_np.min()) < 0 or int(keys_np.max()) > memory_size - chunk_size:
        raise InvalidInputError(f"offsets must lie in [0, {memory_size - chunk_size}]")
    grads = np.concatenate(flat) if len(flat) > 1 else flat[0]
    # One compiled pass lays out every chunk's source (a Python loop of numpy calls per table cost
    # ~2 ms of a server's 26-table push: docs/benchmarks/dlrm-*.md).
    sources, lengths = _row_chunk_sources(table_rows, table_dims, chunk_size)
    dense, values_dense, coverage = _coalesce_scratch(memory_size, int(grads.shape[0]))
    locations, values = _coalesce_chunks_kernel(
        grads,
        keys_np,
        sources,
        lengths,
        np.ones(keys_np.shape[0], dtype=np.float32),
        memory_size,
        dense,
        values_dense,
        coverage,
    )
    return torch.from_numpy(locations), torch.from_numpy(values)


_probe_tables = threading.local()  # per thread: the last (keys, tags), tags left all 0 by each call
_KEPT_PROBE_BITS = 20  # up to 2**20 slots (16 MiB, batches of 512k ids) kept between calls


def distinct_by_table(
    ids: torch.Tensor, feature_starts: Sequence[int], feature_tables: np.ndarray, feature_limits: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor, list[int], int]:
    """Every table's distinct ids of a batch in one compiled pass (a remote collection's pull).

    Feature f's ids are ``ids[feature_starts[f]:feature_starts[f + 1]]`` (int64), read by table
    ``feature_tables[f]`` (int64 (F,), in ``[0, T)`` with T = its max + 1). Returns ``distinct`` int64 (U,):
    table t's distinct ids are ``distinct[starts[t]:starts[t + 1]]``, in order of first appearance;
    ``inverse`` int64 (N,): each id's index into ``distinct``; ``starts`` (T + 1 ints); the index of the
    first id outside its feature's ``[0, feature_limits[f])``, or -1 (it is still counted: ids a table
    does not hold are the server's to refuse). One hash of (table, id) per id: no sort, no int64 range
    arithmetic, so any ids and table sizes (``torch.unique`` per table gives the same sets, sorted).
    """
    ids_np = _ids_np(ids)
    bounds = np.asarray(feature_starts, dtype=np.int64)
    tables = np.ascontiguousarray(feature_tables, dtype=np.int64)
    limits = np.ascontiguousarray(feature_limits, dtype=np.int64)
    if bounds.shape != (tables.shape[0] + 1,) or limits.shape != tables.shape:
        raise InvalidInputError("give F + 1 feature starts and F tables and limits")
    if bounds[0] != 0 or bounds[-1] != ids_np.shape[0] or np.any(bounds[1:] < bounds[:-1]):
        raise InvalidInputError("feature starts must start at 0, be non-decreasing and end at len(ids)")
    if tables.shape[0] and int(tables.min()) < 0:
        raise InvalidInputError("feature tables must be >= 0")
    num_tables = int(tables.max()) + 1 if tables.shape[0] else 0
    bits = max(4, int(2 * ids_np.shape[0]).bit_length())  # 2**bits slots: at least twice the ids
    scratch = getattr(_probe_tables, "last", None)
    if scratch is None or scratch[0].shape[0] != 1 << bits:
        scratch = (np.empty(1 << bits, dtype=np.int64), np.zeros(1 << bits, dtype=np.int64))
        if bits <= _KEPT_PROBE_BITS:  # kept for this thread's next batch (one size: the last)
            _probe_tables.last = scratch
    keys, tags = scratch
    distinct, inverse, starts, bad = _distinct_by_table_kernel(
        ids_np, bounds, tables, limits, num_tables, keys, tags, bits
    )
    return torch.from_numpy(distinct), torch.from_numpy(inverse), starts.tolist(), int(bad)


@dataclass(frozen=True)
class TableHash:
    """How one table of a shared array hashes its ids (``coalesce_table_pushes``): its ``val_offset``,
    chunks per id, hash mode, constants (numpy int64 (11,)) and hash range, as ``hash_setup`` gives them."""

    val_offset: int
    num_chunks: int
    mode: int
    constants: np.ndarray
    range_size: int

    @classmethod
    def of(
        cls,
        hash: str,
        random_numbers: torch.Tensor,
        memory_size: int,
        chunk_size: int,
        embedding_dim: int,
        val_offset: int,
    ) -> TableHash:
        mode, constants, range_size = hash_setup(hash, random_numbers, memory_size, chunk_size, embedding_dim)
        num_chunks = -(-embedding_dim // chunk_size)
        return cls(wrap_int64(val_offset), num_chunks, mode, constants, range_size)


def _joined(arrays: Sequence[np.ndarray], dtype: type) -> np.ndarray:
    """The values of ``arrays`` one after the other, flat and read-only: a view when they already lie so
    in memory, each C-contiguous right after the one before (a decoded push's tables:
    ``service.codec.decode_multi_update_binary``), else a copy. The view spans exactly their bytes, so it
    reads nothing else, and is valid while they all live (it keeps only the first alive): the caller
    holds them for as long as it uses it."""
    joined: np.ndarray
    first = arrays[0]
    address = first.ctypes.data
    for array in arrays:
        if array.dtype != dtype or not array.flags.c_contiguous or array.ctypes.data != address:
            joined = np.concatenate([np.ravel(array) for array in arrays]).astype(dtype, copy=False)
            break
        address += array.nbytes
    else:
        size = sum(array.size for array in arrays)
        joined = np.lib.stride_tricks.as_strided(
            first.reshape(-1), (size,), (first.itemsize,), writeable=False
        )
    joined.flags.writeable = False  # one compiled signature either way
    return joined


def coalesce_table_pushes(
    hashes: Sequence[TableHash],
    ids: Sequence[np.ndarray],
    grad_rows: Sequence[np.ndarray],
    chunk_size: int,
    memory_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``coalesce_chunk_rows`` of every table's hashed ids, the tables hashed in the same compiled call:
    table t's int64 (N_t,) ``ids[t]`` hashed as its ``hashes[t]`` says (the bits of ``chunk_offsets``)
    and its float32 (N_t, d_t) ``grad_rows[t]`` coalesced with every other table's, in order, into one
    update of their array. The caller has checked each table's arrays' dtypes and shapes; this checks
    the gradients are finite (``InvalidInputError`` "grads contain NaN or Inf", as
    ``Table.validate_grads``) and, as ``coalesce_chunk_rows``, that each table's chunks are ceil(d_t / Z)
    and lie in the array. One call where hashing the tables one by one and checking their gradients
    with numpy cost ~1 ms of a 26-table push (docs/benchmarks/dlrm-apply-2026-11-28.md)."""
    if not len(hashes) == len(ids) == len(grad_rows) or not hashes:
        raise InvalidInputError("give one hash, ids and grad_rows per table (at least one table)")
    count = len(hashes)
    id_bounds = np.zeros(count + 1, dtype=np.int64)
    table_dims = np.empty(count, dtype=np.int64)
    num_chunks = np.empty(count, dtype=np.int64)
    for t, (table, rows) in enumerate(zip(hashes, grad_rows, strict=True)):
        id_bounds[t + 1] = id_bounds[t] + rows.shape[0]
        table_dims[t] = rows.shape[1]
        num_chunks[t] = table.num_chunks
        if table.num_chunks != -(-rows.shape[1] // chunk_size):
            raise InvalidInputError("offsets must have ceil(d / chunk_size) columns")
    if id_bounds[-1] == 0:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.float32)
    ids_np = _joined(ids, np.int64)
    grads = _joined(grad_rows, np.float32)
    dense, values_dense, coverage = _coalesce_scratch(memory_size, int(grads.shape[0]))
    locations, values, status = _coalesce_tables_kernel(
        ids_np,
        id_bounds,
        np.array([table.val_offset for table in hashes], dtype=np.int64),
        num_chunks,
        np.array([table.mode for table in hashes], dtype=np.int64),
        np.stack([table.constants for table in hashes]),
        np.array([table.range_size for table in hashes], dtype=np.int64),
        table_dims,
        grads,
        chunk_size,
        memory_size,
        dense,
        values_dense,
        coverage,
    )
    if status == TABLES_NON_FINITE:
        raise InvalidInputError("grads contain NaN or Inf")
    if status == TABLES_OUT_OF_RANGE:
        raise InvalidInputError(f"offsets must lie in [0, {memory_size - chunk_size}]")
    return torch.from_numpy(locations), torch.from_numpy(values)
