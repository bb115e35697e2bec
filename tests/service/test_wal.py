"""The update log's format on its own: round trips, torn tails at every byte, bit flips, bad headers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from robez_core.errors import CorruptionError
from service.wal import (
    LOG_HEADER_SIZE,
    RECORD_HEADER_SIZE,
    decode_record,
    encode_log_header,
    encode_record,
    scan_log,
)

DIM = 4


def _record_bytes(version: int, ids: torch.Tensor, grads: torch.Tensor, lr: float) -> bytes:
    return b"".join(encode_record(version, ids, grads, lr))


def _random_update(
    generator: torch.Generator, num_ids: int, dim: int = DIM
) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(-(2**62), 2**62, (num_ids,), generator=generator, dtype=torch.int64)
    grads = torch.randn(num_ids, dim, generator=generator)
    return ids, grads


def _log(
    num_records: int, *, base_version: int = 0, generation: int = 1, seed: int = 0
) -> tuple[bytes, list]:
    """A log of ``num_records`` updates and the (ids, grads, lr) that went into it."""
    generator = torch.Generator().manual_seed(seed)
    parts = [encode_log_header(DIM, generation, base_version)]
    updates = []
    for index in range(num_records):
        ids, grads = _random_update(generator, num_ids=1 + index % 3)
        lr = 0.01 * (index + 1)
        parts.append(_record_bytes(base_version + index + 1, ids, grads, lr))
        updates.append((ids, grads, lr))
    return b"".join(parts), updates


def _flip_bit(data: bytes, byte_offset: int, bit: int = 0) -> bytes:
    damaged = bytearray(data)
    damaged[byte_offset] ^= 1 << bit
    return bytes(damaged)


@settings(max_examples=60, deadline=None)
@given(
    num_ids=st.integers(0, 20),
    dim=st.integers(1, 9),
    version=st.integers(1, 2**63 - 1),
    lr=st.floats(1e-9, 10.0),
    seed=st.integers(0, 2**31),
)
def test_record_round_trip_is_bitwise(num_ids: int, dim: int, version: int, lr: float, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    ids, grads = _random_update(generator, num_ids, dim)
    buf = encode_log_header(dim, 3, version - 1) + _record_bytes(version, ids, grads, lr)
    scan = scan_log(buf)
    assert (scan.generation, scan.base_version, scan.embedding_dim) == (3, version - 1, dim)
    assert scan.tail_problem is None and scan.good_length == len(buf)
    [span] = scan.records
    assert (span.version, span.lr, span.num_ids) == (version, lr, num_ids)
    got_ids, got_grads = decode_record(buf, span)
    assert torch.equal(got_ids, ids)
    assert got_grads.shape == (num_ids, dim)
    assert np.array_equal(got_grads.numpy().view(np.int32), grads.numpy().view(np.int32))


def test_many_records_come_back_in_order() -> None:
    buf, updates = _log(7, base_version=40)
    scan = scan_log(buf)
    assert [span.version for span in scan.records] == list(range(41, 48))
    for span, (ids, grads, lr) in zip(scan.records, updates, strict=True):
        got_ids, got_grads = decode_record(buf, span)
        assert torch.equal(got_ids, ids) and torch.equal(got_grads, grads) and span.lr == lr


def test_empty_log_has_no_records() -> None:
    scan = scan_log(encode_log_header(DIM, 1, 5))
    assert scan.records == [] and scan.tail_problem is None and scan.good_length == LOG_HEADER_SIZE


def test_torn_tail_at_every_byte_of_the_last_record_is_dropped() -> None:
    buf, _ = _log(3)
    last_start = scan_log(buf).records[-1].offset
    for cut in range(last_start, len(buf)):
        scan = scan_log(buf[:cut])
        assert [span.version for span in scan.records] == [1, 2], cut
        assert scan.good_length == last_start
        assert (scan.tail_problem is None) == (cut == last_start), cut


@pytest.mark.parametrize("bit", [0, 7])
def test_bit_flip_in_the_last_record_is_dropped(bit: int) -> None:
    buf, _ = _log(3)
    last_start = scan_log(buf).records[-1].offset
    for position in range(last_start, len(buf)):
        scan = scan_log(_flip_bit(buf, position, bit))
        assert [span.version for span in scan.records] == [1, 2], position
        assert scan.good_length == last_start and scan.tail_problem is not None


@pytest.mark.parametrize("bit", [0, 5])
def test_bit_flip_in_a_middle_record_is_corruption(bit: int) -> None:
    buf, _ = _log(3)
    middle = scan_log(buf).records[1]
    for position in range(middle.offset, middle.offset + middle.length):
        with pytest.raises(CorruptionError, match="damaged in the middle"):
            scan_log(_flip_bit(buf, position, bit))


def test_bit_flip_in_the_log_header_is_corruption() -> None:
    buf, _ = _log(2)
    for position in range(LOG_HEADER_SIZE):
        with pytest.raises(CorruptionError, match="log header"):
            scan_log(_flip_bit(buf, position))


def test_garbage_after_the_last_record_is_a_torn_tail() -> None:
    buf, _ = _log(2)
    for tail in (b"\x00" * 100, b"RZUP" + b"\x00" * RECORD_HEADER_SIZE, b"\xff"):
        scan = scan_log(buf + tail)
        assert len(scan.records) == 2 and scan.good_length == len(buf) and scan.tail_problem


def test_a_missing_record_in_the_sequence_is_corruption() -> None:
    generator = torch.Generator().manual_seed(1)
    ids, grads = _random_update(generator, 2)
    buf = encode_log_header(DIM, 1, 0) + _record_bytes(1, ids, grads, 0.1) + _record_bytes(3, ids, grads, 0.1)
    with pytest.raises(CorruptionError, match="expected 2"):
        scan_log(buf)


def test_a_record_of_another_dim_is_corruption() -> None:
    generator = torch.Generator().manual_seed(2)
    ids, grads = _random_update(generator, 2, dim=DIM + 1)
    with pytest.raises(CorruptionError, match="dim"):
        scan_log(encode_log_header(DIM, 1, 0) + _record_bytes(1, ids, grads, 0.1))


def test_short_file_is_corruption() -> None:
    with pytest.raises(CorruptionError, match="too short"):
        scan_log(encode_log_header(DIM, 1, 0)[:-1])
