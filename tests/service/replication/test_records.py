"""The log's update payload and the X-Robez-Min-Version header, without any server."""

from __future__ import annotations

import pytest
import torch

from robez_core.errors import InvalidInputError
from service.consistency import parse_min_versions
from service.replication.jetstream import server_address
from service.replication.records import (
    KIND,
    LR,
    SHAPE,
    LoadRecord,
    decode_entry,
    encode_load,
    encode_update,
)
from service.store.journal import SkippedRecord, UpdateRecord


def test_update_round_trips_bit_exactly() -> None:
    ids = torch.tensor([5, -3, 2**62, 5], dtype=torch.int64)
    grads = torch.randn(4, 6)
    grads[1, 2] = 1e-42  # a subnormal survives too
    lr = 0.1 + 1e-17  # not a "nice" float: sent as float.hex
    payload, headers = encode_update(ids, grads, lr)
    record = decode_entry("t", 7, payload, headers)
    assert isinstance(record, UpdateRecord)
    assert (record.table, record.version, record.lr) == ("t", 7, lr)
    assert torch.equal(record.ids, ids)
    assert torch.equal(record.grads.view(torch.int32), grads.view(torch.int32))


def test_empty_update_round_trips() -> None:
    payload, headers = encode_update(torch.zeros(0, dtype=torch.int64), torch.zeros(0, 4), 0.5)
    record = decode_entry("t", 1, payload, headers)
    assert isinstance(record, UpdateRecord)
    assert record.ids.shape == (0,) and record.grads.shape == (0, 4)


@pytest.mark.parametrize(
    "headers, cut, reason",
    [
        ({SHAPE: "2,3", LR: "0x1p-1"}, 1, "bad_payload"),
        ({SHAPE: "two,3", LR: "0x1p-1"}, 0, "bad_headers"),
        ({SHAPE: "2,3"}, 0, "bad_headers"),
        ({SHAPE: "-1,-8", LR: "0x1p-1"}, 0, "bad_headers"),
        ({SHAPE: "2,3", LR: "0x1p-1", KIND: "delete"}, 0, "bad_headers"),
        ({KIND: "load", "Robez-Object": "x"}, 0, "bad_headers"),
    ],
)
def test_damaged_entries_are_skipped_records(headers: dict[str, str], cut: int, reason: str) -> None:
    payload, _ = encode_update(torch.tensor([1, 2]), torch.zeros(2, 3), 0.5)
    record = decode_entry("t", 4, payload[: len(payload) - cut], headers)
    assert isinstance(record, SkippedRecord)
    assert (record.table, record.version, record.reason) == ("t", 4, reason)


def test_load_entry_round_trips() -> None:
    payload, headers = encode_load("load.t.abc.1", "AB" * 32)
    assert decode_entry("t", 9, payload, headers) == LoadRecord("t", 9, "load.t.abc.1", "ab" * 32)


def test_min_version_header() -> None:
    assert parse_min_versions(None, "t") == {}
    assert parse_min_versions("12", "t") == {"t": 12}
    assert parse_min_versions("a=3, b=4,a=1") == {"a": 3, "b": 4}
    for bad, default in (("x", "t"), ("-1", "t"), ("3", None), ("a=", None), ("a=1.5", None)):
        with pytest.raises(InvalidInputError):
            parse_min_versions(bad, default)


@pytest.mark.parametrize(
    "netloc, shown",
    [
        ("127.0.0.1:4222", "127.0.0.1:4222"),
        ("robez:s3cret@nats-0.nats:4222", "nats-0.nats:4222"),
        ("robez:p@ss@[::1]:4222", "[::1]:4222"),
    ],
)
def test_the_log_server_shown_never_carries_credentials(netloc: str, shown: str) -> None:
    """``connected_to`` (logs, ``/readyz?writes=true``) names the server without a login put in its URL."""
    assert server_address(netloc) == shown
