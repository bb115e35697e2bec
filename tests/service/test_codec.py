"""The binary wire format: round trips, and any malformed input is an InvalidInputError (never a crash)."""

from __future__ import annotations

import contextlib
import tracemalloc

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from robez_core.errors import InvalidInputError
from service.codec import (
    decode_ids,
    decode_multi_update_binary,
    decode_update_binary,
    decode_update_json,
    milliseconds,
    parse_shape,
    parse_tables_header,
    rows_bytes,
    rows_view,
    split_ids,
    split_lookup_part,
)

int64s = st.integers(-(2**63), 2**63 - 1)


@given(st.lists(int64s, max_size=50))
def test_ids_round_trip(ids: list[int]) -> None:
    body = np.array(ids, dtype="<i8").tobytes()
    assert decode_ids(body).tolist() == ids


@given(
    st.lists(int64s, max_size=10),
    st.integers(1, 6),
    st.floats(width=32, allow_nan=False, allow_infinity=False),
)
def test_update_round_trip(ids: list[int], dim: int, value: float) -> None:
    grads = np.full((len(ids), dim), value, dtype="<f4")
    body = np.array(ids, dtype="<i8").tobytes() + grads.tobytes()
    decoded_ids, decoded_grads = decode_update_binary(body, f"{len(ids)},{dim}")
    assert decoded_ids.tolist() == ids
    assert decoded_ids.dtype == np.int64 and decoded_ids.flags.writeable
    assert decoded_grads.dtype == np.float32 and decoded_grads.flags.c_contiguous
    np.testing.assert_array_equal(decoded_grads, grads)


@settings(max_examples=200)
@given(st.binary(max_size=200), st.text(max_size=12))
def test_garbage_is_invalid_input(body: bytes, header: str) -> None:
    for call in (
        lambda: decode_update_binary(body, header),
        lambda: decode_ids(body),
        lambda: split_ids(body, [len(body) // 16]),
        lambda: parse_tables_header(header),
        lambda: decode_update_json(body, 4),
    ):
        with contextlib.suppress(InvalidInputError):
            call()


def test_rows_bytes_is_little_endian_row_major() -> None:
    rows = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert np.frombuffer(rows_bytes(rows), dtype="<f4").tolist() == [0, 1, 2, 3, 4, 5]


def test_headers() -> None:
    assert parse_shape("3,64") == (3, 64)
    assert parse_tables_header("a=1, b-2=0") == [("a", 1), ("b-2", 0)]
    for bad in ("a", "a=", "a=-1", "../x=1", "a=1;b=2"):
        with pytest.raises(InvalidInputError):
            parse_tables_header(bad)
    with pytest.raises(InvalidInputError):
        split_ids(np.arange(3, dtype="<i8").tobytes(), [1, 1])


@pytest.mark.parametrize("rows", [torch.arange(12, dtype=torch.float32).reshape(3, 4), torch.zeros(0, 4)])
def test_rows_view_is_the_bytes_of_rows_without_a_copy(rows: torch.Tensor) -> None:
    view = rows_view(rows)
    assert bytes(view) == rows_bytes(rows)
    if rows.numel():
        rows[0, 0] = 99.0  # a view of the tensor's own memory, not a copy
        assert bytes(view) == rows_bytes(rows)
    # a non-contiguous tensor is copied into row-major order first
    assert bytes(rows_view(rows.t())) == rows_bytes(rows.t())


@settings(max_examples=2000)
@given(st.floats(min_value=0.0, max_value=1e4, allow_nan=False))
def test_milliseconds_are_rounded_to_four_decimals(seconds: float) -> None:
    rounded = milliseconds(seconds)
    assert abs(rounded - seconds * 1000.0) <= 0.5e-4 + 1e-12 * max(1.0, seconds * 1000.0)
    assert rounded == round(rounded * 1e4) / 1e4  # a whole number of 0.1 us
    assert len(repr(rounded).partition(".")[2].partition("e")[0]) <= 4 or "e" in repr(rounded)


def test_a_multi_table_push_is_decoded_from_views_of_its_body() -> None:
    """Each table's part of a multi-table push is decoded from a view of the body, not a copy of its slice
    (a DLRM push is 3.8 MB): the arrays are the only allocation, and they are the values sent, writable."""
    rng = np.random.default_rng(0)
    tables = {"a": (rng.integers(0, 1000, 8192), rng.random((8192, 16), np.float32)),
              "b": (rng.integers(0, 1000, 8192), rng.random((8192, 16), np.float32))}  # fmt: skip
    body = b"".join(
        ids.astype("<i8").tobytes() + grads.astype("<f4").tobytes() for ids, grads in tables.values()
    )
    tracemalloc.start()
    try:
        parts = decode_multi_update_binary(body, "a=8192,b=8192", "8192,16;8192,16")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    for (name, ids, grads, lr), (sent_name, (sent_ids, sent_grads)) in zip(
        parts, tables.items(), strict=True
    ):
        assert name == sent_name and lr is None
        assert np.array_equal(ids, sent_ids) and grads.tobytes() == sent_grads.tobytes()
        assert ids.flags.writeable and grads.flags.writeable
    # the arrays hold len(body) bytes; a copied slice of one table's part on top was 1.5x
    assert peak < 1.2 * len(body), f"decoding allocated {peak} bytes for a {len(body)}-byte body"
    # the tables' ids, and their gradients, lie one after the other: a shared-array step reads them
    # where they lie (kernels.coalesce_table_pushes), without joining 3.4 MB of a DLRM push's gradients
    (_, ids_a, grads_a, _), (_, ids_b, grads_b, _) = parts
    assert ids_b.ctypes.data == ids_a.ctypes.data + ids_a.nbytes
    assert grads_b.ctypes.data == grads_a.ctypes.data + grads_a.nbytes


def test_a_push_s_lookup_part_is_cut_from_the_end_of_its_body() -> None:
    """``X-Robez-Lookup: name=n,...``: the last 8 * sum(n) bytes are the lookup's ids; the push's parts
    before them decode as without one (a view, no copy); a bad header is an InvalidInputError."""
    push = np.array([5], dtype="<i8").tobytes() + np.ones((1, 2), dtype="<f4").tobytes()
    ids = np.array([7, 8, 9], dtype="<i8")
    rest, lookups = split_lookup_part(push + ids.tobytes(), "a=2,b=1")
    assert bytes(rest) == push and isinstance(rest, memoryview)
    assert [(name, part.tolist()) for name, part in lookups] == [("a", [7, 8]), ("b", [9])]
    assert split_lookup_part(push, None) == (push, [])
    (part,) = decode_multi_update_binary(rest, "a=1", "1,2")
    assert part[0] == "a" and part[1].tolist() == [5]
    for header in ["", "a", "a=-1", "a=1,", "a=4"]:  # a=4: 32 bytes of ids, the body has 24
        with pytest.raises(InvalidInputError, match="X-Robez-Lookup"):
            split_lookup_part(ids.tobytes(), header)
