"""A server's push of several tables over one array, hashed, checked and coalesced in one compiled call
(``kernels.coalesce_table_pushes`` under ``prepare_shared_step``, issue 37), against the per-table path
it replaced (each table's ``hash``, then ``coalesce_chunk_rows`` of them all) bit for bit; and the
coalesce's packed radix sort against a stable argsort."""

from __future__ import annotations

import math
import re

import numba
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from robez_core import InvalidInputError, OptimizerConfig, Table, TableConfig, kernels
from robez_core.collection import prepare_shared_step
from robez_core.kernels import _jit
from robez_core.kernels import collection as kernels_collection
from robez_core.optim import PreparedStep

OPTIMIZERS = [
    OptimizerConfig("sgd", lr=0.1),
    OptimizerConfig("adagrad", lr=0.05),
    OptimizerConfig("adam", lr=0.01),
]
DIMS = (16, 16, 8, 40)  # Z = 16: one chunk, one shorter, three (the last of 8)
NUM_EMBEDDINGS = (50, 1000, 7, 300)
CHUNK = 16


def shared_tables(
    optimizer: OptimizerConfig, memory_size: int, chunk_sizes: tuple[int, ...] = ()
) -> list[Table]:
    """Tables over one array and state, each its own dim and ``val_offset`` (a collection's layout)."""
    tables: list[Table] = []
    offset = 0
    for t, (dim, count) in enumerate(zip(DIMS, NUM_EMBEDDINGS, strict=True)):
        chunk_size = chunk_sizes[t] if chunk_sizes else CHUNK
        config = TableConfig(
            count, dim, memory_size=memory_size, chunk_size=chunk_size, seed=4, val_offset=offset
        )
        offset += count
        first = tables[0] if tables else None
        tables.append(
            Table(
                config,
                optimizer,
                weight=first.weight if first else None,
                state=first.state if first else None,
            )
        )
    return tables


def per_table_step(
    tables: list[Table], ids: list[torch.Tensor], grads: list[torch.Tensor], lr: float
) -> PreparedStep:
    """The path ``prepare_shared_step`` took before: each table hashed alone, then one coalesce."""
    for table, table_ids, table_grads in zip(tables, ids, grads, strict=True):
        table.validate_grads(table_ids, table_grads)
    offsets = [table.hash(table_ids) for table, table_ids in zip(tables, ids, strict=True)]
    first = tables[0].config
    locations, values = kernels.coalesce_chunk_rows(offsets, grads, first.chunk_size, first.memory_size)
    return PreparedStep(locations, values, lr)


def a_push(step: int, rows: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every table's ids, with duplicates (few distinct ids, one repeated many times), and gradients."""
    generator = torch.Generator().manual_seed(step)
    ids = [torch.randint(0, count, (rows,), generator=generator) for count in NUM_EMBEDDINGS]
    ids[1][: max(2, rows // 4)] = 3  # one id many times in one table
    grads = [torch.randn(rows, dim, generator=generator) for dim in DIMS]
    return ids, grads


def snapshot(table: Table) -> list[np.ndarray]:
    return [table.weight.numpy().copy()] + [state.numpy().copy() for _, state in sorted(table.state.items())]


def assert_same_bits(left: list[np.ndarray], right: list[np.ndarray]) -> None:
    assert len(left) == len(right)
    for a, b in zip(left, right, strict=True):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.name)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("memory_size", "rows"),
    [(3000, 200), (200_000, 300), (100_000, 5)],
    ids=["dense-coalesce", "sorted-coalesce", "insertion-sort"],
)
def test_a_shared_push_is_the_per_table_path_bit_for_bit(
    optimizer: OptimizerConfig, threads: int, memory_size: int, rows: int
) -> None:
    if threads > numba.config.NUMBA_NUM_THREADS:  # type: ignore[attr-defined]
        pytest.skip("numba has one thread on this machine")
    fused, split = shared_tables(optimizer, memory_size), shared_tables(optimizer, memory_size)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in range(3):
            ids, grads = a_push(step, rows)
            new = prepare_shared_step(fused, ids, grads, optimizer.lr)
            old = per_table_step(split, ids, grads, optimizer.lr)
            assert new.locations.numpy().tobytes() == old.locations.numpy().tobytes()
            assert new.values.numpy().tobytes() == old.values.numpy().tobytes()
            fused[0].apply_checked_step(new)
            split[0].check_step(old)
            split[0].apply_step(old)
            assert_same_bits(snapshot(fused[0]), snapshot(split[0]))
    finally:
        torch.set_num_threads(previous)
    # the case is what it says: duplicate chunks, and distinct chunks overlapping in the array
    starts = np.concatenate([t.hash(i).numpy().reshape(-1) for t, i in zip(fused, ids, strict=True)])
    distinct = np.unique(starts)
    assert distinct.size < starts.size
    if rows > 5:
        assert (np.diff(distinct) < CHUNK).any()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("memory_size", [3000, 200_000])
def test_a_push_with_one_non_finite_gradient_is_refused_and_changes_nothing(
    bad: float, memory_size: int
) -> None:
    tables = shared_tables(OPTIMIZERS[1], memory_size)
    before = snapshot(tables[0])
    ids, grads = a_push(0, 64)
    grads[3][40, 39] = bad  # the last value of the last table
    with pytest.raises(InvalidInputError, match="NaN or Inf"):
        prepare_shared_step(tables, ids, grads, 0.05)
    with pytest.raises(InvalidInputError, match="NaN or Inf"):  # the per-table path's error
        per_table_step(tables, ids, grads, 0.05)
    assert_same_bits(before, snapshot(tables[0]))


def test_tables_of_other_chunk_sizes_get_the_per_table_path_s_answer() -> None:
    """A table with its own Z shares the array: its chunks past m - Z of the step are refused as the
    per-table path refused them; otherwise the same bits."""
    for memory_size, outcome in ((40, "refused"), (200_000, "applied")):
        tables = shared_tables(OPTIMIZERS[0], memory_size, chunk_sizes=(16, 16, 8, 16))
        ids, grads = a_push(1, 100)
        try:
            old = per_table_step(tables, ids, grads, 0.1)
        except InvalidInputError as error:
            assert outcome == "refused"
            with pytest.raises(InvalidInputError, match=re.escape(str(error))):
                prepare_shared_step(tables, ids, grads, 0.1)
            continue
        assert outcome == "applied"
        new = prepare_shared_step(tables, ids, grads, 0.1)
        assert new.values.numpy().tobytes() == old.values.numpy().tobytes()
        assert torch.equal(new.locations, old.locations)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    keys=st.lists(
        st.one_of(st.integers(0, 50), st.integers(0, 1 << 40), st.integers(0, np.iinfo(np.int64).max)),
        max_size=400,
    )
)
def test_sorted_chunk_starts_is_a_stable_argsort(keys: list[int]) -> None:
    """Packed (more than 64 keys, each fitting beside its position), or not, the stable argsort."""
    array = np.array(keys, dtype=np.int64)
    sorted_keys, order = _jit._sorted_chunk_starts(array)
    expected = np.argsort(array, kind="stable")
    assert np.array_equal(order, expected)
    assert np.array_equal(sorted_keys, array[expected])


def test_sorted_chunk_starts_takes_the_packed_sort_on_a_push_s_keys() -> None:
    """A push's chunk starts (many, below 2**40): sorted in packed passes, ties in their order."""
    keys = np.random.default_rng(3).integers(0, 1 << 30, 5000) // 7 * 7  # many ties
    sorted_keys, order = _jit._sorted_chunk_starts(keys)
    assert np.array_equal(order, np.argsort(keys, kind="stable"))
    assert np.array_equal(sorted_keys, np.sort(keys))


def test_tables_that_lie_one_after_the_other_are_read_where_they_lie() -> None:
    """A decoded push's tables are views of one ids and one gradients array
    (``service.codec.decode_multi_update_binary``): joined without a copy, the same bits as copies."""
    ids, grads = a_push(2, 100)
    all_ids = torch.cat(ids)
    all_grads = torch.cat([g.reshape(-1) for g in grads])
    id_views, grad_views, at, values_at = [], [], 0, 0
    for table_grads in grads:
        rows, dim = table_grads.shape
        id_views.append(all_ids[at : at + rows].numpy())
        grad_views.append(all_grads[values_at : values_at + rows * dim].numpy().reshape(rows, dim))
        at, values_at = at + rows, values_at + rows * dim
    joined = kernels_collection._joined(grad_views, np.float32)
    assert np.shares_memory(joined, all_grads.numpy()) and joined.tobytes() == all_grads.numpy().tobytes()
    copied = kernels_collection._joined([g.numpy() for g in grads], np.float32)
    assert not np.shares_memory(copied, all_grads.numpy()) and copied.tobytes() == joined.tobytes()
    tables = shared_tables(OPTIMIZERS[1], 200_000)
    specs = [table.hash_spec() for table in tables]
    in_place = kernels.coalesce_table_pushes(specs, id_views, grad_views, CHUNK, 200_000)
    old = per_table_step(tables, ids, grads, 0.05)
    assert in_place[0].numpy().tobytes() == old.locations.numpy().tobytes()
    assert in_place[1].numpy().tobytes() == old.values.numpy().tobytes()
