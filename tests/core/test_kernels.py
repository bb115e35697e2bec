"""Fused kernels against the pure-torch reference (bit for bit on forward) and torch's own ops/optimizers."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numba
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from robez_core import kernels
from robez_core.errors import ConfigError, InvalidInputError
from robez_core.hashing import (
    MAX_FAST_RANGE,
    PAPER_PRIME,
    paper_random_numbers,
    reference_chunk_offsets,
    reference_indices,
)
from robez_core.kernels import _jit, runtime

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
EDGE_IDS = [INT64_MIN, INT64_MIN + 1, -1, 0, 1, INT64_MAX - 1, INT64_MAX, PAPER_PRIME, -PAPER_PRIME]
RANDOM_NUMBERS = paper_random_numbers()
HASHES = ("paper", "fast")

# function_scoped_fixture: the ``paper_hash`` fixture sets one formulation for all of a test's examples
PROPERTY = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

int64s = st.integers(INT64_MIN, INT64_MAX)
id_lists = st.lists(st.one_of(int64s, st.sampled_from(EDGE_IDS)), min_size=0, max_size=40)


@pytest.fixture(autouse=True, scope="module")
def _parallel_even_for_small_batches() -> Iterator[None]:
    """The kernels run small batches serially; these tests' small inputs must reach the parallel
    compilations too (at more than one thread), so the size cut-off is lifted for this module."""
    previous = _jit._PARALLEL_MIN_WORK
    _jit._PARALLEL_MIN_WORK = 0
    try:
        yield
    finally:
        _jit._PARALLEL_MIN_WORK = previous


@pytest.fixture(params=["float64", "split32"])
def paper_hash(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both formulations of the paper hash's reductions, whichever this CPU would pick, so CI on any
    machine checks the AVX-512 (float64) and the AVX2 (split32) paths alike."""
    monkeypatch.setattr(runtime, "_PAPER_FORMULATION", request.param)
    return str(request.param)


@pytest.fixture(params=["specialised", "generic"])
def chunk_kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The row loops compiled for the chunk size (the sizes in ``_SPECIALISED_CHUNK_SIZES``) and the
    generic compilation that reads it at run time, both checked whatever chunk sizes a test draws."""
    if request.param == "generic":
        monkeypatch.setattr(_jit, "_SPECIALISED_CHUNK_SIZES", frozenset())
    return str(request.param)


def test_each_formulation_takes_its_own_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    expected = {"float64": _jit._MODE_PAPER_FLOAT, "split32": _jit._MODE_PAPER_SPLIT}
    for formulation, mode in expected.items():
        monkeypatch.setattr(runtime, "_PAPER_FORMULATION", formulation)
        assert runtime.hash_setup("paper", RANDOM_NUMBERS, 1000, 8)[0] == mode
        # P >= 2**31 is outside the split formulation's range: the float64 one takes it
        big_prime = torch.tensor([(1 << 31) + 11, *RANDOM_NUMBERS[1:].tolist()])
        assert runtime.hash_setup("paper", big_prime, 1000, 8)[0] == _jit._MODE_PAPER_FLOAT
    target = kernels.compile_target()
    assert target["paper_hash"] in expected and target["cpu"] and "sse2" in target["vector_extensions"]


@contextlib.contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _num_chunks(embedding_dim: int, chunk_size: int) -> int:
    return -(-embedding_dim // chunk_size)


def _wrap(value: int) -> int:
    return ((value + (1 << 63)) % (1 << 64)) - (1 << 63)


def _python_paper_offset(
    x: int, chunk: int, memory_size: int, chunk_size: int, val_offset: int, r: list[int]
) -> int:
    """The paper's formula on Python ints, with int64 wrap-around made explicit at every step."""
    key = _wrap(x + val_offset)
    h = _wrap(_wrap(_wrap(key * r[3]) + _wrap(chunk * r[2])) + r[1])
    return (h % r[0]) % (memory_size - chunk_size + 1)  # Python's % is floor mod, like torch's


def _python_fast_offset(
    x: int, chunk: int, memory_size: int, chunk_size: int, val_offset: int, r: list[int]
) -> int:
    mask = (1 << 64) - 1
    h = ((x + val_offset) * (r[3] | 1) + chunk * r[2] + r[1]) & mask
    for multiplier in (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53):
        h ^= h >> 33
        h = (h * multiplier) & mask
    h ^= h >> 33
    return ((h >> 32) * (memory_size - chunk_size + 1)) >> 32


# --------------------------------------------------------------------------------------------------
# the reference itself against Python ints (so "bit-exact with the reference" means "with the paper")


@PROPERTY
@given(
    ids=st.lists(st.one_of(int64s, st.sampled_from(EDGE_IDS)), min_size=1, max_size=10),
    val_offset=st.one_of(int64s, st.sampled_from([0, INT64_MIN, INT64_MAX])),
    chunk_size=st.integers(1, 40),
    extra_memory=st.integers(0, 1 << 40),
    num_chunks=st.integers(1, 5),
)
def test_reference_paper_hash_wraps_like_python_int_oracle(
    ids, val_offset, chunk_size, extra_memory, num_chunks
):
    memory_size = chunk_size + extra_memory
    r = RANDOM_NUMBERS.tolist()
    got = reference_chunk_offsets(
        torch.tensor(ids), num_chunks, chunk_size, memory_size, RANDOM_NUMBERS, _wrap(val_offset), "paper"
    )
    expected = [
        [_python_paper_offset(x, c, memory_size, chunk_size, val_offset, r) for c in range(num_chunks)]
        for x in ids
    ]
    assert got.tolist() == expected


@PROPERTY
@given(
    ids=st.lists(st.one_of(int64s, st.sampled_from(EDGE_IDS)), min_size=1, max_size=10),
    val_offset=int64s,
    chunk_size=st.integers(1, 40),
    extra_memory=st.integers(0, MAX_FAST_RANGE - 1),
)
def test_reference_fast_hash_matches_python_int_oracle(ids, val_offset, chunk_size, extra_memory):
    memory_size = chunk_size + extra_memory
    r = RANDOM_NUMBERS.tolist()
    got = reference_chunk_offsets(
        torch.tensor(ids), 3, chunk_size, memory_size, RANDOM_NUMBERS, val_offset, "fast"
    )
    expected = [
        [_python_fast_offset(x, c, memory_size, chunk_size, val_offset, r) for c in range(3)] for x in ids
    ]
    assert got.tolist() == expected


# --------------------------------------------------------------------------------------------------
# forward: bit for bit


@PROPERTY
@given(
    ids=id_lists,
    val_offset=st.one_of(int64s, st.sampled_from([0, INT64_MIN, INT64_MAX])),
    chunk_size=st.integers(1, 40),
    extra_memory=st.one_of(st.integers(0, 100), st.integers(0, 1 << 45), st.integers(0, MAX_FAST_RANGE - 1)),
    num_chunks=st.integers(1, 6),
    hash=st.sampled_from(HASHES),
)
def test_chunk_offsets_bit_exact(ids, val_offset, chunk_size, extra_memory, num_chunks, hash, paper_hash):
    memory_size = chunk_size + extra_memory
    assume(hash == "paper" or memory_size - chunk_size + 1 <= MAX_FAST_RANGE)
    ids_t = torch.tensor(ids, dtype=torch.int64)
    expected = reference_chunk_offsets(
        ids_t, num_chunks, chunk_size, memory_size, RANDOM_NUMBERS, val_offset, hash
    )
    got = kernels.chunk_offsets(ids_t, num_chunks, chunk_size, memory_size, RANDOM_NUMBERS, val_offset, hash)
    assert got.dtype == torch.int64
    assert torch.equal(got, expected)


@pytest.mark.parametrize("hash", HASHES)
def test_chunk_offsets_of_a_strided_column_equal_its_copy(hash: str, paper_hash: str) -> None:
    """A column of an (N, k) id tensor, or a stride-0 expansion, is hashed without a copy."""
    generator = torch.Generator().manual_seed(2)
    pairs = torch.randint(INT64_MIN, INT64_MAX, (1000, 3), generator=generator)
    for ids in (pairs[:, 2], pairs[::7, 0], torch.tensor([INT64_MIN]).expand(50)):
        assert not ids.is_contiguous()
        got = kernels.chunk_offsets(ids, 3, 8, 10_000, RANDOM_NUMBERS, 5, hash)
        expected = reference_chunk_offsets(ids.contiguous(), 3, 8, 10_000, RANDOM_NUMBERS, 5, hash)
        assert torch.equal(got, expected)


@PROPERTY
@given(
    ids=st.lists(int64s, min_size=1, max_size=20),
    prime=st.one_of(
        st.integers(1, 1000),
        st.integers(1 << 16, (1 << 52) - 1),  # the float64 reduction
        st.integers(1 << 16, (1 << 31) - 1),  # the split32 one (huge draws: the key sums wrap)
        st.integers(1, INT64_MAX),
        st.sampled_from(
            [PAPER_PRIME, (1 << 16) - 1, 1 << 16, (1 << 31) - 1, 1 << 31, (1 << 52) - 1, 1 << 52]
        ),
    ),
    draws=st.lists(int64s, min_size=10, max_size=10),
    extra_memory=st.one_of(st.integers(0, 1000), st.integers(0, 1 << 62)),
)
def test_paper_hash_with_imported_constants(ids, prime, draws, extra_memory, paper_hash):
    """Any P and constants (state_dicts from elsewhere) take the generic path and still agree."""
    random_numbers = torch.tensor([prime, *draws], dtype=torch.int64)
    memory_size = 8 + extra_memory
    ids_t = torch.tensor(ids, dtype=torch.int64)
    expected = reference_chunk_offsets(ids_t, 4, 8, memory_size, random_numbers, 17, "paper")
    assert torch.equal(kernels.chunk_offsets(ids_t, 4, 8, memory_size, random_numbers, 17, "paper"), expected)


@pytest.mark.parametrize("prime", [1 << 16, PAPER_PRIME, (1 << 31) - 1, (1 << 52) - 1, 999_999_999_989])
@pytest.mark.parametrize("memory_size", [1, 33, 262_144, 1 << 40])
def test_float_reduction_at_the_edges_of_its_range(prime, memory_size, paper_hash):
    """The branch-free mods are exact for 2**16 <= P < 2**52 (float64) and 2**16 <= P < 2**31 (split32;
    a larger P takes float64): the smallest and largest P (largest quotient error), huge and tiny
    ranges, on many ids spread over all of int64; draws below P as the paper's, and over all of int64,
    whose key sums wrap around (split32 corrects those by 2**64 mod P)."""
    generator = torch.Generator().manual_seed(prime % 1000)
    ids = torch.cat(
        [torch.randint(INT64_MIN, INT64_MAX, (30_000,), generator=generator), torch.tensor(EDGE_IDS)]
    )
    for draws in (
        torch.randint(0, prime, (10,), generator=generator),
        torch.randint(INT64_MIN, INT64_MAX, (10,), generator=generator),
    ):
        random_numbers = torch.cat([torch.tensor([prime]), draws])
        for val_offset in (0, INT64_MAX, INT64_MIN + 3):
            expected = reference_chunk_offsets(ids, 5, 1, memory_size, random_numbers, val_offset, "paper")
            got = kernels.chunk_offsets(ids, 5, 1, memory_size, random_numbers, val_offset, "paper")
            assert torch.equal(got, expected)


def test_split32_blocks_with_keys_at_the_int64_limits(paper_hash: str) -> None:
    """split32 skips the per-id wrap test in blocks whose keys K lie inside
    [INT64_MIN - min T, INT64_MAX - max T] (T = c * R[2] + R[1], the chunk terms, clamped at 0); a
    block holding a key outside, where K + T wraps for some chunks, must still be exact. With R[3] = 1
    the keys are the ids: one block per edge key (the last safe and the first wrapping key at each
    limit) among ordinary ids, and a block of them all; chunk terms all positive, then all negative;
    4 chunks (the rows are stored four offsets at a time) and 6."""
    generator = torch.Generator().manual_seed(13)
    block = _jit._HASH_BLOCK
    for sign, num_chunks in ((1, 4), (1, 6), (-1, 4), (-1, 6)):  # 4: rows stored whole
        r1, r2 = sign * 5, sign * 1_000_003
        random_numbers = torch.tensor([PAPER_PRIME, r1, r2, 1, 11, 13, 17, 19, 23, 29, 31])
        terms = [c * r2 + r1 for c in range(num_chunks)]
        term_min, term_max = min(0, *terms), max(0, *terms)
        edge = [INT64_MAX - term_max, INT64_MAX - term_max + 1, INT64_MAX]
        edge += [INT64_MIN - term_min, INT64_MIN - term_min - 1, INT64_MIN]
        edge = [key for key in edge if INT64_MIN <= key <= INT64_MAX]  # no wrapping key at a limit T spares
        blocks = [torch.randint(-(1 << 40), 1 << 40, (block,), generator=generator) for _ in edge]
        for position, (ids_of_block, key) in enumerate(zip(blocks, edge, strict=True)):
            ids_of_block[(position * 37) % block] = key
        ids = torch.cat([*blocks, torch.tensor(edge)])
        for memory_size in (40, 262_144, 1 << 40):
            expected = reference_chunk_offsets(ids, num_chunks, 8, memory_size, random_numbers)
            got = kernels.chunk_offsets(ids, num_chunks, 8, memory_size, random_numbers)
            assert torch.equal(got, expected)


@PROPERTY
@given(
    ids=id_lists,
    val_offset=st.one_of(int64s, st.sampled_from([0, INT64_MIN, INT64_MAX])),
    embedding_dim=st.integers(1, 70),
    chunk_size=st.integers(1, 40),
    extra_memory=st.one_of(st.just(0), st.integers(0, 50), st.integers(0, 5000)),
    hash=st.sampled_from(HASHES),
)
def test_lookup_and_gather_bit_exact(
    ids, val_offset, embedding_dim, chunk_size, extra_memory, hash, paper_hash, chunk_kernels
):
    memory_size = chunk_size + extra_memory  # extra_memory == 0 is m == Z: every chunk starts at 0
    weight = torch.randn(memory_size)
    ids_t = torch.tensor(ids, dtype=torch.int64)
    expected = weight[
        reference_indices(ids_t, embedding_dim, chunk_size, memory_size, RANDOM_NUMBERS, val_offset, hash)
    ]
    got = kernels.lookup(weight, ids_t, embedding_dim, chunk_size, RANDOM_NUMBERS, val_offset, hash)
    assert torch.equal(got, expected)
    offsets = kernels.chunk_offsets(
        ids_t,
        _num_chunks(embedding_dim, chunk_size),
        chunk_size,
        memory_size,
        RANDOM_NUMBERS,
        val_offset,
        hash,
    )
    assert torch.equal(kernels.gather(weight, offsets, embedding_dim, chunk_size), expected)


@pytest.mark.parametrize("hash", HASHES)
def test_tables_sharing_one_array_read_their_own_rows(hash, paper_hash):
    weight = torch.randn(1000)
    ids = torch.tensor([INT64_MIN, -5, 0, 3, INT64_MAX])
    for val_offset in (0, 1_000_000, INT64_MAX, INT64_MIN):
        indices = reference_indices(ids, 37, 8, 1000, RANDOM_NUMBERS, val_offset, hash)
        got = kernels.lookup(weight, ids, 37, 8, RANDOM_NUMBERS, val_offset, hash)
        assert torch.equal(got, weight[indices])
    # different offsets really are different tables
    assert not torch.equal(
        kernels.lookup(weight, ids, 37, 8, RANDOM_NUMBERS, 0, hash),
        kernels.lookup(weight, ids, 37, 8, RANDOM_NUMBERS, 1_000_000, hash),
    )


def test_lookup_writes_into_out_and_handles_empty():
    weight = torch.randn(300)
    ids = torch.arange(-10, 10)
    out = torch.full((20, 50), float("nan"))
    result = kernels.lookup(weight, ids, 50, 32, RANDOM_NUMBERS, out=out)
    assert result is out
    assert torch.equal(out, weight[reference_indices(ids, 50, 32, 300, RANDOM_NUMBERS)])
    assert kernels.lookup(weight, torch.empty(0, dtype=torch.int64), 50, 32, RANDOM_NUMBERS).shape == (0, 50)


def test_large_batch_paper_configuration_bit_exact(paper_hash, chunk_kernels):
    """The benchmark's shape (d=100, Z=32, m=262144) on a real batch, through the parallel loops."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(INT64_MIN, INT64_MAX, (20_000,), generator=generator)
    weight = torch.rand(262_144, generator=generator)
    for hash in HASHES:
        expected = weight[reference_indices(ids, 100, 32, 262_144, RANDOM_NUMBERS, 0, hash)]
        # 8 MB of rows: the streaming-store path (and at one thread, the serial copy) as well
        assert kernels._streaming(expected, 100, 32)
        for threads in (1, torch.get_num_threads()):
            with _torch_threads(threads):
                assert torch.equal(kernels.lookup(weight, ids, 100, 32, RANDOM_NUMBERS, 0, hash), expected)
                offsets = kernels.chunk_offsets(ids, 4, 32, 262_144, RANDOM_NUMBERS, 0, hash)
                assert torch.equal(kernels.gather(weight, offsets, 100, 32), expected)


# --------------------------------------------------------------------------------------------------
# bags


@st.composite
def bags(draw):
    num_ids = draw(st.integers(0, 30))
    cuts = sorted(draw(st.lists(st.integers(0, num_ids), min_size=0, max_size=8)))
    return num_ids, [0, *cuts]  # leading 0 plus repeats gives empty bags, a trailing num_ids too


@PROPERTY
@given(
    bag_layout=bags(),
    embedding_dim=st.integers(1, 40),
    chunk_size=st.integers(1, 16),
    mode=st.sampled_from(["sum", "mean", "weighted"]),
    hash=st.sampled_from(HASHES),
    val_offset=int64s,
)
def test_lookup_bag_matches_embedding_bag(
    bag_layout, embedding_dim, chunk_size, mode, hash, val_offset, paper_hash
):
    num_ids, starts = bag_layout
    generator = torch.Generator().manual_seed(num_ids)
    memory_size = chunk_size + 97
    weight = torch.randn(memory_size, generator=generator)
    ids = torch.randint(INT64_MIN, INT64_MAX, (num_ids,), generator=generator)
    bag_offsets = torch.tensor(starts, dtype=torch.int64)
    per_sample_weights = torch.rand(num_ids, generator=generator) if mode == "weighted" else None
    torch_mode = "sum" if mode == "weighted" else mode
    rows = weight[
        reference_indices(ids, embedding_dim, chunk_size, memory_size, RANDOM_NUMBERS, val_offset, hash)
    ]
    expected = F.embedding_bag(
        torch.arange(num_ids), rows, bag_offsets, mode=torch_mode, per_sample_weights=per_sample_weights
    )
    got = kernels.lookup_bag(
        weight,
        ids,
        bag_offsets,
        per_sample_weights,
        torch_mode,
        embedding_dim,
        chunk_size,
        RANDOM_NUMBERS,
        val_offset,
        hash,
    )
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_lookup_bag_rejects_bad_offsets_and_mean_weights():
    weight = torch.randn(100)
    ids = torch.arange(5)
    args = (10, 4, RANDOM_NUMBERS)
    with pytest.raises(InvalidInputError):
        kernels.lookup_bag(weight, ids, torch.tensor([1, 2]), None, "sum", *args)
    with pytest.raises(InvalidInputError):
        kernels.lookup_bag(weight, ids, torch.tensor([0, 3, 2]), None, "sum", *args)
    with pytest.raises(InvalidInputError):
        kernels.lookup_bag(weight, ids, torch.tensor([0, 6]), None, "sum", *args)
    with pytest.raises(InvalidInputError):
        kernels.lookup_bag(weight, ids, torch.tensor([0]), torch.ones(5), "mean", *args)


# --------------------------------------------------------------------------------------------------
# backward


def _sparse_case(num_ids, embedding_dim, chunk_size, memory_size, seed, hash="paper", dense=True):
    """Gradients, their offsets and indices, and (``dense``) their float64 sum at every location: an
    (m,) array, 8 GB at m = 10**9, so a case that does not compare with it goes without."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(INT64_MIN, INT64_MAX, (num_ids,), generator=generator)
    if num_ids > 2:
        ids[::3] = ids[0]  # repeated ids: their gradients must be summed
    grads = torch.randn(num_ids, embedding_dim, generator=generator)
    num_chunks = _num_chunks(embedding_dim, chunk_size)
    offsets = kernels.chunk_offsets(ids, num_chunks, chunk_size, memory_size, RANDOM_NUMBERS, 0, hash)
    indices = reference_indices(ids, embedding_dim, chunk_size, memory_size, RANDOM_NUMBERS, 0, hash)
    if not dense:
        return grads, offsets, indices, None
    sums = torch.zeros(memory_size, dtype=torch.float64).index_add_(
        0, indices.reshape(-1), grads.reshape(-1).double()
    )
    return grads, offsets, indices, sums


def _assert_float32_sums_close(actual, grads, indices, dense, locations=None):
    """Compare float32 sums with their float64 reference `dense` (at `locations`, or everywhere).

    A location that sums k values in float32, in any order, is off by at most (k - 1) * 2**-24 * sum(|x|)
    plus one rounding of the result, so a fixed tolerance fails on locations shared by hundreds of
    values; a wrong index or a lost gradient is off by a whole value and still fails.
    """
    flat = indices.reshape(-1)
    counts = torch.zeros_like(dense).index_add_(0, flat, torch.ones(flat.numel(), dtype=torch.float64))
    magnitudes = torch.zeros_like(dense).index_add_(0, flat, grads.reshape(-1).double().abs())
    expected = dense
    if locations is not None:
        counts, magnitudes, expected = counts[locations], magnitudes[locations], dense[locations]
    bound = counts * 2.0**-24 * magnitudes + 2.0**-24 * expected.abs() + 1e-12
    error = (actual.double() - expected).abs()
    assert error.shape == bound.shape
    if error.numel():
        worst = int(torch.argmax(error - bound))
        message = f"element {worst}: error {error[worst]:.3g} > bound {bound[worst]:.3g}"
        assert bool((error <= bound).all()), message


@PROPERTY
@given(
    num_ids=st.integers(0, 60),
    embedding_dim=st.integers(1, 50),
    chunk_size=st.integers(1, 20),
    extra_memory=st.one_of(st.integers(0, 30), st.integers(0, 20_000)),
    hash=st.sampled_from(HASHES),
    seed=st.integers(0, 1000),
)
def test_scatter_and_coalesce_match_index_add(
    num_ids, embedding_dim, chunk_size, extra_memory, hash, seed, chunk_kernels
):
    memory_size = chunk_size + extra_memory
    grads, offsets, indices, dense = _sparse_case(num_ids, embedding_dim, chunk_size, memory_size, seed, hash)
    out = torch.zeros(memory_size)
    kernels.scatter_grad(grads, offsets, chunk_size, out)
    _assert_float32_sums_close(out, grads, indices, dense)

    locations, values = kernels.coalesce_grad(grads, offsets, chunk_size, memory_size)
    expected_locations = torch.unique(indices.reshape(-1))
    assert torch.equal(locations, expected_locations)
    _assert_float32_sums_close(values, grads, indices, dense, expected_locations)


@pytest.mark.parametrize("memory_size", [40, 5_000, 10**9])
def test_coalesce_both_strategies(memory_size):
    """m small next to N*d uses the dense scratch buffer, m huge the sort; both give the same answer."""
    grads, offsets, indices, _ = _sparse_case(50, 45, 16, memory_size, seed=3, dense=False)
    locations, values = kernels.coalesce_grad(grads, offsets, 16, memory_size)
    flat = indices.reshape(-1)
    expected_locations, inverse = torch.unique(flat, return_inverse=True)
    expected_values = torch.zeros(len(expected_locations), dtype=torch.float64).index_add_(
        0, inverse, grads.reshape(-1).double()
    )
    assert torch.equal(locations, expected_locations)
    torch.testing.assert_close(values, expected_values.float(), rtol=1e-5, atol=1e-5)


@PROPERTY
@given(keys=st.lists(st.one_of(st.integers(0, 50), st.integers(0, INT64_MAX)), max_size=300))
def test_radix_argsort_is_a_stable_argsort(keys):
    array = np.array(keys, dtype=np.int64)
    assert np.array_equal(_jit._radix_argsort(array), np.argsort(array, kind="stable"))


def test_coalesce_merges_touching_and_overlapping_chunks():
    """Chunks that overlap, touch end to start, nest, or repeat, on the dense and the sorted path."""
    offsets = torch.tensor([[40, 0], [48, 4], [10, 14], [40, 0], [200, 1000]], dtype=torch.int64)
    grads = torch.arange(5 * 12, dtype=torch.float32).reshape(5, 12)  # d = 12, Z = 8: chunks of 8 and 4
    for memory_size in (1_010, 10**12):  # dense scratch buffer, then the sort
        locations, values = kernels.coalesce_grad(grads, offsets, 8, memory_size)
        indices = offsets[:, torch.arange(12) // 8] + torch.arange(12) % 8
        expected_locations, inverse = torch.unique(indices.reshape(-1), return_inverse=True)
        expected_values = torch.zeros(len(expected_locations)).index_add_(0, inverse, grads.reshape(-1))
        assert torch.equal(locations, expected_locations)
        assert torch.equal(values, expected_values)


@pytest.mark.parametrize("strategy", ["serial", "private", "partitioned"])
@pytest.mark.parametrize("memory_size", [40, 5_000, 262_144])
def test_scatter_strategies_agree(strategy, memory_size, chunk_kernels, monkeypatch: pytest.MonkeyPatch):
    """One thread adds in order; more threads use private copies (small m) or range partitions (large m,
    forced here by lowering the size limit), chunks straddling range boundaries included."""
    if strategy == "partitioned":
        monkeypatch.setattr(kernels, "_PRIVATE_SCATTER_MAX_FLOATS", 0)
    grads, offsets, _, dense = _sparse_case(3000, 100, 32, memory_size, seed=5)
    out = torch.ones(memory_size)
    threads = 1 if strategy == "serial" else max(2, torch.get_num_threads())
    with _torch_threads(threads):
        kernels.scatter_grad(grads, offsets, 32, out)
    torch.testing.assert_close(out, (dense + 1).float(), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("chunk_size", sorted(_jit._SPECIALISED_CHUNK_SIZES))
def test_each_specialised_chunk_size_runs_its_own_compilation(chunk_size: int):
    """Every chunk size with compilations of its own reads and adds rows as the reference does, for row
    widths below, at and past a multiple of it (a shorter last chunk or none), serially and in parallel;
    and those compilations are what ran."""
    generator = torch.Generator().manual_seed(chunk_size)
    memory_size = 5_000
    weight = torch.randn(memory_size, generator=generator)
    ids = torch.randint(INT64_MIN, INT64_MAX, (300,), generator=generator)  # >= 256: the parallel scatter
    widths = sorted({max(1, chunk_size - 1), chunk_size, 2 * chunk_size + 3, 100})
    for embedding_dim in widths:
        indices = reference_indices(ids, embedding_dim, chunk_size, memory_size, RANDOM_NUMBERS)
        offsets = kernels.chunk_offsets(
            ids, _num_chunks(embedding_dim, chunk_size), chunk_size, memory_size, RANDOM_NUMBERS
        )
        grads = torch.randn(300, embedding_dim, generator=generator)
        dense = torch.zeros(memory_size, dtype=torch.float64).index_add_(
            0, indices.reshape(-1), grads.reshape(-1).double()
        )
        for threads in (1, max(2, torch.get_num_threads())):
            with _torch_threads(threads):
                rows = kernels.lookup(weight, ids, embedding_dim, chunk_size, RANDOM_NUMBERS)
                assert torch.equal(rows, weight[indices])
                gathered = kernels.gather(weight, offsets, embedding_dim, chunk_size)
                assert torch.equal(gathered, weight[indices])
                out = torch.zeros(memory_size)
                kernels.scatter_grad(grads, offsets, chunk_size, out)
                torch.testing.assert_close(out, dense.float(), rtol=1e-5, atol=1e-4)
    for pair in (
        _jit._gather_kernel,
        _jit._lookup_kernel,
        _jit._scatter_serial_kernel,
        _jit._scatter_private_kernel,
    ):
        specialised = pair.for_chunk(chunk_size)
        assert specialised is not pair and specialised.chunk_size == chunk_size
        assert specialised.for_chunk(chunk_size) is specialised
        if pair is _jit._scatter_private_kernel and numba.config.NUMBA_NUM_THREADS < 2:  # type: ignore[attr-defined]
            continue  # one core: the parallel backward never runs
        compiled = [*specialised.serial.signatures, *specialised.parallel.signatures]
        assert compiled, f"{pair.serial.__name__} for Z = {chunk_size} never ran"


@pytest.mark.parametrize("chunk_size", [4, 32, 5])
def test_int32_offsets_give_the_same_rows_and_gradients(
    chunk_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``chunk_offsets(..., dtype=torch.int32)`` holds the same offsets; ``gather`` and ``scatter_grad``
    read them as they read int64 ones (specialised and generic chunk sizes; every backward strategy)."""
    generator = torch.Generator().manual_seed(chunk_size)
    weight = torch.randn(20_000, generator=generator)
    ids = torch.randint(INT64_MIN, INT64_MAX, (500, 2), generator=generator)[:, 1]
    wide = kernels.chunk_offsets(ids, _num_chunks(70, chunk_size), chunk_size, 20_000, RANDOM_NUMBERS)
    narrow = kernels.chunk_offsets(
        ids, _num_chunks(70, chunk_size), chunk_size, 20_000, RANDOM_NUMBERS, dtype=torch.int32
    )
    assert narrow.dtype == torch.int32 and torch.equal(narrow.to(torch.int64), wide)
    assert torch.equal(
        kernels.gather(weight, narrow, 70, chunk_size), kernels.gather(weight, wide, 70, chunk_size)
    )
    grads = torch.randn(500, 70, generator=generator)
    parallel = max(2, torch.get_num_threads())
    for threads, private_limit in (
        (1, None),
        (parallel, None),
        (parallel, 0),
    ):  # serial, private, partitioned
        if private_limit is not None:
            monkeypatch.setattr(kernels, "_PRIVATE_SCATTER_MAX_FLOATS", private_limit)
        with _torch_threads(threads):
            out_wide, out_narrow = torch.zeros(20_000), torch.zeros(20_000)
            kernels.scatter_grad(grads, wide, chunk_size, out_wide)
            kernels.scatter_grad(grads, narrow, chunk_size, out_narrow)
            assert torch.equal(out_wide, out_narrow)


def test_int32_offsets_are_refused_where_they_do_not_fit() -> None:
    ids = torch.arange(3)
    assert kernels.fits_int32_offsets((1 << 31) + 7, 8) and not kernels.fits_int32_offsets((1 << 31) + 8, 8)
    with pytest.raises(ConfigError):
        kernels.chunk_offsets(ids, 1, 8, (1 << 31) + 8, RANDOM_NUMBERS, dtype=torch.int32)
    with pytest.raises(ConfigError):
        kernels.chunk_offsets(ids, 1, 8, 1000, RANDOM_NUMBERS, dtype=torch.int16)
    with pytest.raises(InvalidInputError):
        kernels.gather(torch.randn(100), torch.zeros(3, 1, dtype=torch.int16), 8, 8)


def test_other_chunk_sizes_take_the_generic_compilation():
    for chunk_size in (3, 5, 24, 65, 1000):
        assert chunk_size not in _jit._SPECIALISED_CHUNK_SIZES
        assert _jit._gather_kernel.for_chunk(chunk_size) is _jit._gather_kernel


# --------------------------------------------------------------------------------------------------
# optimizer steps vs torch.optim on the same sparse gradient


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("memory_size", [50, 4_000])
def test_optimizer_steps_match_torch(optimizer, memory_size):
    lr, eps, betas, initial_accumulator = 0.05, 1e-8, (0.8, 0.95), 0.1
    weight = torch.randn(memory_size, generator=torch.Generator().manual_seed(1))
    param = torch.nn.Parameter(weight.clone())
    torch_optimizer: torch.optim.Optimizer
    if optimizer == "sgd":
        torch_optimizer = torch.optim.SGD([param], lr=lr)
    elif optimizer == "adagrad":
        torch_optimizer = torch.optim.Adagrad(
            [param], lr=lr, eps=eps, initial_accumulator_value=initial_accumulator
        )
        state_sum = torch.full((memory_size,), initial_accumulator)
    else:
        torch_optimizer = torch.optim.SparseAdam([param], lr=lr, betas=betas, eps=eps)
        exp_avg, exp_avg_sq = torch.zeros(memory_size), torch.zeros(memory_size)
    for step in range(1, 5):
        grads, offsets, indices, _ = _sparse_case(40, 37, 8, memory_size, seed=step, dense=False)
        param.grad = torch.sparse_coo_tensor(
            indices.reshape(1, -1), grads.reshape(-1), (memory_size,), check_invariants=True
        )
        torch_optimizer.step()
        locations, values = kernels.coalesce_grad(grads, offsets, 8, memory_size)
        if optimizer == "sgd":
            kernels.sgd_step(weight, locations, values, lr)
        elif optimizer == "adagrad":
            kernels.adagrad_step(weight, state_sum, locations, values, lr, eps)
        else:
            kernels.adam_step(weight, exp_avg, exp_avg_sq, locations, values, lr, *betas, eps, step)
        torch.testing.assert_close(weight, param.detach(), rtol=1e-5, atol=1e-6)
    if optimizer == "adagrad":
        torch.testing.assert_close(state_sum, torch_optimizer.state[param]["sum"], rtol=1e-5, atol=1e-6)
    if optimizer == "adam":
        torch.testing.assert_close(exp_avg, torch_optimizer.state[param]["exp_avg"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            exp_avg_sq, torch_optimizer.state[param]["exp_avg_sq"], rtol=1e-5, atol=1e-6
        )


def test_steps_touch_only_the_given_locations():
    weight = torch.randn(100)
    exp_avg, exp_avg_sq = torch.zeros(100), torch.zeros(100)
    before = weight.clone()
    locations = torch.tensor([3, 50, 99])
    kernels.adam_step(weight, exp_avg, exp_avg_sq, locations, torch.ones(3), 0.1, 0.9, 0.999, 1e-8, 1)
    changed = (weight != before).nonzero().reshape(-1)
    assert torch.equal(changed, locations)
    assert torch.equal(exp_avg.nonzero().reshape(-1), locations)


# --------------------------------------------------------------------------------------------------
# validation, threads, GIL, cache


def test_invalid_configurations_raise():
    ids = torch.arange(3)
    with pytest.raises(ConfigError):
        kernels.chunk_offsets(ids, 2, 32, 31, RANDOM_NUMBERS)
    with pytest.raises(ConfigError):
        kernels.chunk_offsets(ids, 2, 32, 1000, RANDOM_NUMBERS, hash="nope")
    with pytest.raises(ConfigError):
        kernels.chunk_offsets(ids, 2, 1, MAX_FAST_RANGE + 1, RANDOM_NUMBERS, hash="fast")
    with pytest.raises(ConfigError):
        kernels.chunk_offsets(ids, 2, 4, 100, torch.tensor([0, *RANDOM_NUMBERS[1:].tolist()]))
    with pytest.raises(InvalidInputError):
        kernels.lookup(torch.randn(100), ids.int(), 8, 4, RANDOM_NUMBERS)
    with pytest.raises(ConfigError):
        kernels.adam_step(
            torch.zeros(4), torch.zeros(4), torch.zeros(4), ids, torch.ones(3), 0.1, 0.9, 0.9, 1e-8, 0
        )


def test_one_thread_runs_the_serial_copy(monkeypatch: pytest.MonkeyPatch):
    """At one thread no OpenMP team is started: the serial compilation runs in the caller's thread."""

    def refuse(*args: object) -> None:
        raise AssertionError("parallel kernel used at one thread")

    monkeypatch.setattr(_jit._gather_kernel.for_chunk(4), "parallel", refuse)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        weight = torch.randn(100)
        offsets = torch.tensor([[0, 50], [96, 3]])
        assert torch.equal(kernels.gather(weight, offsets, 8, 4), reference_gather(weight, offsets, 8, 4))
    finally:
        torch.set_num_threads(previous)


def reference_gather(weight: torch.Tensor, offsets: torch.Tensor, embedding_dim: int, chunk_size: int):
    j = torch.arange(embedding_dim)
    return weight[offsets[:, j // chunk_size] + j % chunk_size]


def test_kernel_threads_follow_torch():
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        kernels.lookup(torch.randn(100), torch.arange(10), 8, 4, RANDOM_NUMBERS)
        assert numba.get_num_threads() == 1
        torch.set_num_threads(max(previous, 2))
        assert kernels.set_kernel_threads() == min(max(previous, 2), numba.config.NUMBA_NUM_THREADS)
    finally:
        torch.set_num_threads(previous)


def test_concurrent_calls_from_python_threads_agree():
    """Kernels release the GIL and may run from several threads at once (the service does)."""
    weight = torch.randn(262_144)
    ids = torch.randint(INT64_MIN, INT64_MAX, (4096,), generator=torch.Generator().manual_seed(9))
    expected = weight[reference_indices(ids, 100, 32, 262_144, RANDOM_NUMBERS)]
    results: list[bool] = []

    def worker() -> None:
        for _ in range(5):
            results.append(torch.equal(kernels.lookup(weight, ids, 100, 32, RANDOM_NUMBERS), expected))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results == [True] * 20


_CACHE_PROBE = """
import json, torch, warnings
from numba.core.errors import NumbaWarning
from robez_core import kernels, paper_random_numbers
from robez_core.kernels import _jit
warnings.simplefilter("error", NumbaWarning)  # "Cannot cache compiled function ..." fails the probe
weight, ids, constants = torch.randn(100), torch.arange(10), paper_random_numbers()
_jit._PARALLEL_MIN_WORK = 0  # reach the parallel compilation with this tiny batch
counts = {}
for threads, flavour in ((1, "serial"), (2, "parallel")):
    torch.set_num_threads(threads)
    if kernels.set_kernel_threads() != threads:
        continue  # a one-core machine never runs the parallel copy
    kernels.lookup(weight, ids, 8, 4, constants)
    kernels.sgd_step(weight, ids, torch.ones(10), 0.5)
    # Z = 4: its own compilation; both parallel copies run the serial one on parts (_jit._split_kernel)
    for name, pair in (("lookup", _jit._lookup_kernel.for_chunk(4)), ("sgd", _jit._sgd_kernel)):
        stats = getattr(pair, flavour).stats
        hits, misses = sum(stats.cache_hits.values()), sum(stats.cache_misses.values())
        counts[f"{name} {flavour}"] = {"hits": hits, "misses": misses}
print(json.dumps(counts))
"""


@pytest.mark.slow
def test_compiled_kernels_are_cached_on_disk(tmp_path: Path):
    """A second process loads the machine code from NUMBA_CACHE_DIR instead of compiling again."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    root = Path(__file__).resolve().parents[2]
    runs = []
    for _ in range(2):
        completed = subprocess.run(
            [sys.executable, "-c", _CACHE_PROBE],
            env=env,
            cwd=root,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert completed.returncode == 0, completed.stderr
        runs.append(json.loads(completed.stdout.strip().splitlines()[-1]))
    for name in ("lookup", "sgd"):
        assert runs[0][f"{name} serial"] == {"hits": 0, "misses": 1}
        assert runs[1][f"{name} serial"] == {"hits": 1, "misses": 0}
        if f"{name} parallel" in runs[0]:
            assert runs[0][f"{name} parallel"] == {"hits": 0, "misses": 1}
            assert runs[1][f"{name} parallel"] == {"hits": 1, "misses": 0}
    assert any(tmp_path.rglob("*.nbi"))


_AVX2_PROBE = """
import json, re, torch
from robez_core import kernels, paper_random_numbers
from robez_core.hashing import reference_chunk_offsets
from robez_core.kernels import _jit
ids = torch.randint(-(1 << 63), (1 << 63) - 1, (5000,))
got = kernels.chunk_offsets(ids, 4, 32, 262_144, paper_random_numbers())
exact = torch.equal(got, reference_chunk_offsets(ids, 4, 32, 262_144, paper_random_numbers()))
asm = "".join(_jit._chunk_offsets_kernel.serial.inspect_asm().values())
print(json.dumps({**kernels.compile_target(), "exact": exact, "zmm": len(re.findall("%zmm", asm)),
                  "ymm": len(re.findall("%ymm", asm))}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not _jit._X86, reason="the emulated AVX2 target is an x86-64 CPU")
def test_avx2_emulation_compiles_without_avx512_and_picks_split32(tmp_path: Path):
    """The bench's --emulate-avx2 environment really makes numba emit AVX2 code (no zmm register in
    the hash kernel), the kernels then choose the split32 hash, and it stays bit-exact."""
    from benchmarks.common import avx2_emulation_env

    env = {**os.environ, **avx2_emulation_env(), "NUMBA_CACHE_DIR": str(tmp_path)}
    completed = subprocess.run(
        [sys.executable, "-c", _AVX2_PROBE],
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr
    probe = json.loads(completed.stdout.strip().splitlines()[-1])
    assert probe["cpu"] == "znver2" and probe["emulated"] == "yes" and probe["paper_hash"] == "split32"
    assert "avx2" in probe["vector_extensions"].split() and "avx512f" not in probe["vector_extensions"]
    assert probe["exact"] and probe["zmm"] == 0 and probe["ymm"] > 0


_THREADS_PROBE = """
import torch
torch.set_num_threads(1)
import numba
from robez_core import kernels, paper_random_numbers
kernels.lookup(torch.randn(100), torch.arange(10), 8, 4, paper_random_numbers())
print(torch.get_num_threads(), numba.get_num_threads())
"""


@pytest.mark.slow
def test_importing_kernels_keeps_torch_thread_count():
    """numba's OpenMP start-up resets the process's thread count; the kernels module undoes that."""
    root = Path(__file__).resolve().parents[2]
    completed = subprocess.run(
        [sys.executable, "-c", _THREADS_PROBE], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == ["1", "1"]


@pytest.mark.parametrize("threads", [1, 2])
def test_prefetching_paths_agree(threads, chunk_kernels, monkeypatch: pytest.MonkeyPatch):
    """Prefetching is switched on by table size; forced on for a small table, results are unchanged."""
    monkeypatch.setattr(kernels, "_PREFETCH_READ_MIN_BYTES", 0)
    monkeypatch.setattr(kernels, "_PREFETCH_WRITE_MIN_BYTES", 0)
    generator = torch.Generator().manual_seed(threads)
    weight = torch.randn(5_000, generator=generator)
    ids = torch.randint(INT64_MIN, INT64_MAX, (300,), generator=generator)
    indices = reference_indices(ids, 100, 32, 5_000, RANDOM_NUMBERS)
    expected = weight[indices]
    grads = torch.randn(300, 100, generator=generator)
    with _torch_threads(threads):
        assert torch.equal(kernels.lookup(weight, ids, 100, 32, RANDOM_NUMBERS), expected)
        offsets = kernels.chunk_offsets(ids, 4, 32, 5_000, RANDOM_NUMBERS)
        assert torch.equal(kernels.gather(weight, offsets, 100, 32), expected)
        bags = kernels.lookup_bag(weight, ids, torch.tensor([0, 100]), None, "sum", 100, 32, RANDOM_NUMBERS)
        torch.testing.assert_close(bags, torch.stack([expected[:100].sum(0), expected[100:].sum(0)]))
        out = torch.zeros(5_000)
        kernels.scatter_grad(grads, offsets, 32, out)
    dense = torch.zeros(5_000).index_add_(0, indices.reshape(-1), grads.reshape(-1))
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-4)


def test_a_small_table_is_read_in_order_before_a_gather_many_times_its_size(monkeypatch: pytest.MonkeyPatch):
    """The sequential pass runs for a table below the read-prefetch size when the gather reads at least
    ``_WARM_TABLE_RATIO`` times its bytes (lookup and gather alike), not otherwise; rows are unchanged."""
    passes: list[int] = []
    warm = kernels._warm_kernel

    def recording(weight_np):
        passes.append(weight_np.shape[0])
        return warm(weight_np)

    monkeypatch.setattr(kernels, "_warm_kernel", recording)
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(1_000, generator=generator)  # 4 kB; 300 rows of 100 floats are 120 kB
    ids = torch.randint(INT64_MIN, INT64_MAX, (300,), generator=generator)
    expected = weight[reference_indices(ids, 100, 32, 1_000, RANDOM_NUMBERS)]
    offsets = kernels.chunk_offsets(ids, 4, 32, 1_000, RANDOM_NUMBERS)
    assert torch.equal(kernels.gather(weight, offsets, 100, 32), expected)
    assert torch.equal(kernels.lookup(weight, ids, 100, 32, RANDOM_NUMBERS), expected)
    assert passes == [1_000, 1_000]
    monkeypatch.setattr(kernels, "_WARM_TABLE_RATIO", 100)  # 120 kB < 100 x 4 kB: no pass
    assert torch.equal(kernels.gather(weight, offsets, 100, 32), expected)
    monkeypatch.setattr(kernels, "_WARM_TABLE_RATIO", 1)
    monkeypatch.setattr(kernels, "_PREFETCH_READ_MIN_BYTES", 4_000)  # a table this big is prefetched
    assert torch.equal(kernels.gather(weight, offsets, 100, 32), expected)
    assert passes == [1_000, 1_000]
    assert warm(weight.numpy()) == pytest.approx(float(weight[::16].sum()), rel=1e-5, abs=1e-5)


def test_small_batches_run_serially_at_several_threads():
    """Below the work cut-off no OpenMP team is woken: the serial compilation runs, with the same rows."""
    weight, constants = torch.randn(1000), paper_random_numbers()
    ids = torch.arange(-5, 5, dtype=torch.int64)
    expected = kernels.lookup(weight, ids, 16, 4, constants)
    calls: list[str] = []
    kernel = _jit._lookup_kernel.for_chunk(4)
    serial, parallel = kernel.serial, kernel.parallel
    previous_cutoff = _jit._PARALLEL_MIN_WORK
    try:
        _jit._PARALLEL_MIN_WORK = 1 << 16
        kernel.serial = lambda *args: (calls.append("serial"), serial(*args))[1]
        kernel.parallel = lambda *args: (calls.append("parallel"), parallel(*args))[1]
        with _torch_threads(2):
            rows = kernels.lookup(weight, ids, 16, 4, constants)
    finally:
        kernel.serial, kernel.parallel = serial, parallel
        _jit._PARALLEL_MIN_WORK = previous_cutoff
    assert calls == ["serial"]
    assert torch.equal(rows, expected)


def _split_cases(n: int) -> dict[str, tuple[_jit._KernelPair, Callable[[], tuple[object, ...]], list[int]]]:
    """Every kernel whose parallel copy runs its serial compilation on parts (``_jit._split_kernel``): the
    pair, a function making fresh arguments for ``n`` ids (bags, locations) and which arguments it writes.
    Arrays as ``robez_core.kernels`` passes them, so the serial signatures are the ones the other tests
    compile."""
    rng = np.random.default_rng(n)
    memory_size, dim, chunk = 5_000, 8, 4
    mode, constants, range_size = runtime.hash_setup("paper", RANDOM_NUMBERS, memory_size, chunk, dim)
    weight = rng.standard_normal(memory_size).astype(np.float32)
    ids = rng.integers(INT64_MIN, INT64_MAX, n, dtype=np.int64, endpoint=True)
    offsets = rng.integers(0, range_size, (n, dim // chunk), dtype=np.int64)
    bags = np.sort(rng.integers(0, n + 1, max(1, n // 3)))  # empty bags and bags of several ids
    bags[0] = 0
    locations = np.sort(rng.choice(memory_size, min(n, memory_size), replace=False)).astype(np.int64)
    values = rng.standard_normal(locations.shape[0]).astype(np.float32)
    values[::97] = np.nan  # the checked step counts them and refuses
    k = locations.shape[0]

    states = [rng.random(memory_size, dtype=np.float32) for _ in range(2)]
    sample_weights = rng.random(n, dtype=np.float32)

    def arrays(count: int) -> list[np.ndarray]:
        return [weight.copy(), *(state.copy() for state in states[: count - 1])]

    def f32(*xs: float) -> tuple[np.float32, ...]:
        return tuple(np.float32(x) for x in xs)

    def undo(count: int) -> list[np.ndarray]:
        return [np.zeros(k, np.float32) for _ in range(count)]

    adam = f32(0.9, 0.999, 1e-8, 1e-3)
    return {
        "chunk_offsets": (
            _jit._chunk_offsets_kernel,
            lambda: (ids, np.int64(7), 2, mode, constants, range_size, np.zeros((n, 2), np.int64)),
            [6],
        ),
        "gather": (
            _jit._gather_kernel.for_chunk(chunk),
            lambda: (weight, offsets, dim, chunk, True, True, np.zeros((n, dim), np.float32)),
            [6],
        ),
        "lookup": (
            _jit._lookup_kernel.for_chunk(chunk),
            lambda: (
                weight,
                ids,
                np.int64(-3),
                dim,
                chunk,
                mode,
                constants,
                True,
                True,
                np.zeros((n, dim), np.float32),
            ),
            [9],
        ),
        "lookup_bag": (
            _jit._lookup_bag_kernel,
            lambda: (
                weight,
                ids,
                bags,
                sample_weights,
                True,
                False,
                np.int64(0),
                dim,
                chunk,
                mode,
                constants,
                True,
                np.zeros((bags.shape[0], dim), np.float32),
            ),
            [12],
        ),
        "lookup_bag mean": (
            _jit._lookup_bag_kernel,
            lambda: (
                weight,
                ids,
                bags,
                np.empty(0, np.float32),
                False,
                True,
                np.int64(0),
                dim,
                chunk,
                mode,
                constants,
                False,
                np.zeros((bags.shape[0], dim), np.float32),
            ),
            [12],
        ),
        "sgd": (_jit._sgd_kernel, lambda: (*arrays(1), locations, values, *f32(0.1)), [0]),
        "adagrad": (_jit._adagrad_kernel, lambda: (*arrays(2), locations, values, *f32(0.1, 1e-8)), [0, 1]),
        "adam_checked": (
            _jit._adam_checked_kernel,
            lambda: (*arrays(3), locations, values, *adam, *undo(3)),
            [0, 1, 2, 9, 10, 11],
        ),
    }


@pytest.mark.parametrize("name", sorted(_split_cases(1)))
def test_split_parallel_copies_give_the_serial_bits(name: str) -> None:
    """The parallel copy that runs the serial compilation on parts writes (and returns) the serial bits,
    whatever the parts: uneven, a short last block, more parts than hash blocks (empty parts)."""
    for n in (1, 300, 1000, 2053):
        pair, make_args, written = _split_cases(n)[name]
        expected_args = make_args()
        expected = pair.serial(*expected_args)
        for parts in (2, 3, 5):
            args = make_args()
            assert pair.parallel(*args, parts) == expected, (name, n, parts)
            for position in written:
                want, got = np.asarray(expected_args[position]), np.asarray(args[position])
                assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (name, n, parts, position)


def test_split_parallel_copies_reach_the_serial_dispatcher_through_their_globals() -> None:
    """numba caches a compiled function that calls a dispatcher it finds in its globals, not one held in a
    closure ("uses dynamic globals"): each split pair's parallel copy sees its own serial compilation."""
    pairs = [pair for pair, _, _ in _split_cases(1).values()]
    assert {pair.serial.py_func.__name__ for pair in pairs} >= {
        "_lookup_kernel_z4_serial",
        "_sgd_kernel_serial",
    }
    for pair in pairs:
        source = pair.parallel.py_func
        assert source.__closure__ is None and source.__globals__["_serial_part"] is pair.serial
        assert source.__name__.endswith("_parts" + (f"_z{pair.chunk_size}" if pair.chunk_size else ""))
