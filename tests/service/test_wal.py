"""The update log (round trips, torn tails at every byte, bit flips) and WalJournal recovery."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from robez_core.config import OptimizerConfig, TableConfig
from robez_core.errors import ConflictError, CorruptionError, InvalidInputError
from robez_core.small import SMALL_BATCH_MAX_IDS
from robez_core.table import Table
from service.errors import StorageFullError
from service.store.journal import UpdateRecord
from service.wal import (
    LOG_FILE,
    LOG_HEADER_SIZE,
    RECORD_HEADER_SIZE,
    FsyncPolicy,
    ServerLock,
    WalJournal,
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


# ---------------------------------------------------------------------------------------------------------
# WalJournal over real tables


def _table(optimizer: str = "adam", seed: int = 3) -> Table:
    config = TableConfig(num_embeddings=1000, embedding_dim=DIM, memory_size=64, chunk_size=2, seed=seed)
    return Table(config, OptimizerConfig(name=optimizer, lr=0.05))  # type: ignore[arg-type]


def _copy(table: Table) -> Table:
    state = {name: tensor.clone() for name, tensor in table.state.items()}
    return Table(table.config, table.optimizer, weight=table.weight.clone(), state=state)


def _assert_same(left: Table, right: Table) -> None:
    assert (left.config, left.optimizer) == (right.config, right.optimizer)
    left_tensors, right_tensors = left.tensors(), right.tensors()
    assert left_tensors.keys() == right_tensors.keys()
    for key, tensor in left_tensors.items():
        assert torch.equal(tensor.view(torch.uint8), right_tensors[key].view(torch.uint8)), key


class _Server:
    """What the store does per update (append, then apply), against one live table."""

    def __init__(self, journal: WalJournal, name: str, table: Table, version: int = 0) -> None:
        self.journal, self.name, self.table, self.version = journal, name, table, version
        self.updates: list[tuple[Tensor, Tensor, float]] = []
        self.generator = torch.Generator().manual_seed(version + 17)

    def update(self, num_ids: int = 3, lr: float = 0.05) -> None:
        ids = torch.randint(0, 50, (num_ids,), generator=self.generator)
        grads = torch.randn(num_ids, self.table.config.embedding_dim, generator=self.generator)
        ticket = self.journal.append(UpdateRecord(self.name, self.version + 1, ids, grads, lr))
        self.table.apply_gradients(ids, grads, lr)
        self.version += 1
        self.updates.append((ids, grads, lr))
        self.journal.wait_durable(ticket)


def _oracle(initial: Table, updates: list[tuple[Tensor, Tensor, float]]) -> Table:
    table = _copy(initial)
    for ids, grads, lr in updates:
        table.apply_gradients(ids, grads, lr)
    return table


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[WalJournal]:
    wal = WalJournal(tmp_path / "data")
    yield wal
    wal.close()


def test_create_then_load_gives_the_same_table(journal: WalJournal) -> None:
    table = _table()
    journal.create("t", table, 0)
    assert journal.names() == ["t"]
    loaded = journal.load("t")
    assert loaded is not None and loaded[1] == 0
    _assert_same(loaded[0], table)
    assert journal.load("missing") is None


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_updates_are_replayed_bitwise(journal: WalJournal, optimizer: str) -> None:
    initial = _table(optimizer)
    journal.create("t", initial, 0)
    server = _Server(journal, "t", _copy(initial))
    for index in range(6):
        server.update(num_ids=1 + index, lr=0.01 * (index + 1))
    assert not torch.equal(server.table.weight, initial.weight)  # the updates did change something
    loaded = journal.load("t")
    assert loaded is not None and loaded[1] == 6
    _assert_same(loaded[0], server.table)


def test_a_replay_does_not_check_the_steps_again(
    journal: WalJournal, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every record in the log passed ``check_step`` before it was appended; the replay applies the same
    steps to the same bytes without checking them again (the check was a third of a restart's replay),
    and ends bitwise where the live table did."""
    initial = _table("adam")
    journal.create("t", initial, 0)
    server = _Server(journal, "t", _copy(initial))
    for _ in range(3):
        server.update(num_ids=SMALL_BATCH_MAX_IDS + 100)  # the general path, which calls check_step

    def refuse(table: Table, step: object) -> None:
        raise AssertionError("a replay checked a logged step again")

    monkeypatch.setattr(Table, "check_step", refuse)
    loaded = journal.load("t")
    assert loaded is not None and loaded[1] == 3
    _assert_same(loaded[0], server.table)


def test_snapshot_resets_the_log_and_keeps_later_updates(journal: WalJournal, tmp_path: Path) -> None:
    journal.create("t", _table(), 0)
    server = _Server(journal, "t", _table())
    for _ in range(3):
        server.update()
    journal.snapshot("t", server.table, server.version)
    directory = tmp_path / "data" / "t"
    assert sorted(p.name for p in directory.iterdir()) == [
        "meta.json",
        "snapshot-2.safetensors",
        "updates.wal",
    ]
    assert (directory / "updates.wal").stat().st_size == LOG_HEADER_SIZE
    for _ in range(2):
        server.update()
    loaded = journal.load("t")
    assert loaded is not None and loaded[1] == 5
    _assert_same(loaded[0], server.table)


def _log_and_oracle(journal: WalJournal, num_updates: int) -> tuple[Path, bytes, Table, Table]:
    """A table with ``num_updates`` logged; returns the log path, its bytes, the oracle with all the
    updates and the oracle without the last one."""
    initial = _table()
    journal.create("t", initial, 0)
    server = _Server(journal, "t", _copy(initial))
    for _ in range(num_updates):
        server.update(num_ids=2)
    path = journal.data_dir / "t" / LOG_FILE
    return path, path.read_bytes(), server.table, _oracle(initial, server.updates[:-1])


def test_torn_tail_at_every_byte_is_dropped_with_a_warning(
    journal: WalJournal, caplog: pytest.LogCaptureFixture
) -> None:
    path, full, everything, without_last = _log_and_oracle(journal, 3)
    last_start = scan_log(full).records[-1].offset
    for cut in range(last_start, len(full) + 1):
        path.write_bytes(full[:cut])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="robez.wal"):
            loaded = journal.load("t")
        assert loaded is not None
        table, version = loaded
        if cut == len(full):
            assert version == 3 and not caplog.records
            _assert_same(table, everything)
        else:
            assert version == 2, cut
            _assert_same(table, without_last)
            assert (cut == last_start) == (not caplog.records), cut
            assert path.stat().st_size == last_start  # the torn bytes are gone for good
    # After a cut the log takes new updates right where the good records end.
    path.write_bytes(full[: last_start + 5])
    loaded = journal.load("t")
    assert loaded is not None
    server = _Server(journal, "t", loaded[0], version=loaded[1])
    server.update()
    reloaded = journal.load("t")
    assert reloaded is not None and reloaded[1] == 3
    _assert_same(reloaded[0], server.table)


def test_bit_flip_in_the_middle_refuses_to_load(journal: WalJournal) -> None:
    path, full, _, _ = _log_and_oracle(journal, 3)
    middle = scan_log(full).records[1]
    for position in (
        middle.offset,
        middle.offset + RECORD_HEADER_SIZE + 3,
        middle.offset + middle.length - 1,
    ):
        path.write_bytes(_flip_bit(full, position, 3))
        with pytest.raises(CorruptionError, match="damaged in the middle"):
            journal.load("t")
        assert path.read_bytes() == _flip_bit(full, position, 3)  # nothing was "repaired"


def test_journal_drops_a_bit_flip_in_the_last_record(journal: WalJournal) -> None:
    path, full, _, without_last = _log_and_oracle(journal, 3)
    last = scan_log(full).records[-1]
    path.write_bytes(_flip_bit(full, last.offset + RECORD_HEADER_SIZE + 9, 6))
    loaded = journal.load("t")
    assert loaded is not None and loaded[1] == 2
    _assert_same(loaded[0], without_last)


def test_bit_flip_in_the_snapshot_refuses_to_load(journal: WalJournal) -> None:
    journal.create("t", _table(), 0)
    snapshot = journal.snapshot_path("t")
    assert snapshot is not None
    data = snapshot.read_bytes()
    snapshot.write_bytes(_flip_bit(data, len(data) - 10, 2))
    with pytest.raises(CorruptionError, match="checksum"):
        journal.load("t")


def test_crash_between_snapshot_commit_and_log_switch(journal: WalJournal, tmp_path: Path) -> None:
    journal.create("t", _table(), 0)
    server = _Server(journal, "t", _table())
    for _ in range(3):
        server.update()
    directory = tmp_path / "data" / "t"
    old_log = (directory / LOG_FILE).read_bytes()
    journal.snapshot("t", server.table, server.version)
    # Put the previous generation's log back: what a crash right after meta.json's rename leaves.
    (directory / LOG_FILE).write_bytes(old_log)
    loaded = journal.load("t")
    assert loaded is not None and loaded[1] == 3  # the old records are not applied a second time
    _assert_same(loaded[0], server.table)
    assert (directory / LOG_FILE).stat().st_size == LOG_HEADER_SIZE
    server.update()
    reloaded = journal.load("t")
    assert reloaded is not None and reloaded[1] == 4
    _assert_same(reloaded[0], server.table)


def test_crash_before_snapshot_commit_keeps_the_old_generation(journal: WalJournal, tmp_path: Path) -> None:
    journal.create("t", _table(), 0)
    server = _Server(journal, "t", _table())
    for _ in range(2):
        server.update()
    directory = tmp_path / "data" / "t"
    # What a crash after writing the next snapshot and log, before meta.json, leaves behind.
    server.table.save(directory / "snapshot-2.safetensors")
    (directory / f"{LOG_FILE}.new").write_bytes(encode_log_header(DIM, 2, 2))
    (directory / "meta.json.tmp-123").write_bytes(b"{")
    loaded = journal.load("t")
    assert loaded is not None and loaded[1] == 2
    _assert_same(loaded[0], server.table)
    assert sorted(p.name for p in directory.iterdir()) == [
        "meta.json",
        "snapshot-1.safetensors",
        "updates.wal",
    ]


def test_two_processes_share_one_ordered_log(tmp_path: Path) -> None:
    """Two journals on one folder (as two workers): appends and a snapshot interleave correctly."""
    first, second = WalJournal(tmp_path), WalJournal(tmp_path)
    try:
        initial = _table("adagrad")
        first.create("t", initial, 0)
        live = _copy(initial)
        server = _Server(first, "t", live)
        for journal in (first, second, first, second):
            server.journal = journal
            server.update()
        second.snapshot("t", live, server.version)
        for journal in (first, second, second, first):  # `first` must notice the new log file
            server.journal = journal
            server.update()
        loaded = WalJournal(tmp_path).load("t")
        assert loaded is not None and loaded[1] == 8
        _assert_same(loaded[0], live)
    finally:
        first.close()
        second.close()


def test_interval_policy_flushes_in_the_background(tmp_path: Path) -> None:
    wal = WalJournal(tmp_path, fsync="interval", fsync_interval_ms=1.0)
    try:
        initial = _table()
        wal.create("t", initial, 0)
        server = _Server(wal, "t", _copy(initial))
        server.update()
        deadline = time.monotonic() + 10.0
        while wal._logs["t"].dirty and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not wal._logs["t"].dirty
        server.update()
    finally:
        wal.close()
    loaded = WalJournal(tmp_path, fsync="never").load("t")
    assert loaded is not None and loaded[1] == 2
    _assert_same(loaded[0], server.table)


class _GatedSync:
    """Stands in for the log's fdatasync: counts calls, and holds the first one until ``release``."""

    def __init__(self) -> None:
        self.calls = 0
        self.entered, self.released = threading.Event(), threading.Event()

    def __call__(self, fd: int) -> None:
        self.calls += 1
        self.entered.set()
        assert self.released.wait(timeout=30)

    def release(self) -> None:
        self.released.set()


def _waiter(wal: WalJournal, ticket: int, done: list[int], errors: list[BaseException]) -> threading.Thread:
    def wait() -> None:
        try:
            wal.wait_durable(ticket)
            done.append(ticket)
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=wait)
    thread.start()
    return thread


def test_group_commit_one_flush_serves_every_writer_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """interval: writers wait for the flush that covers their record, and the records written while a
    flush runs all share the next one."""
    import service.wal.appender

    sync = _GatedSync()
    wal = WalJournal(tmp_path, fsync="interval", fsync_interval_ms=20.0)
    generator = torch.Generator().manual_seed(0)

    def append(version: int) -> int:
        ids, grads = _random_update(generator, 3, DIM)
        return wal.append(UpdateRecord("t", version, ids, grads, 0.1))

    try:
        wal.create("t", _table(), 0)
        monkeypatch.setattr(service.wal.appender, "sync_data", sync)
        done: list[int] = []
        errors: list[BaseException] = []
        first = append(1)
        threads = [_waiter(wal, first, done, errors)]
        assert sync.entered.wait(timeout=30)  # the first flush started at once (no flush for 20 ms)
        later = [append(version) for version in range(2, 9)]
        threads += [_waiter(wal, ticket, done, errors) for ticket in later]
        for _ in range(20):  # the writers cannot be done: their flush is held
            assert not done and not errors
            time.sleep(0.01)
        sync.release()
        for thread in threads:
            thread.join(timeout=30)
            assert not thread.is_alive()
        assert not errors and sorted(done) == [first, *later]
        assert sync.calls == 2  # one flush for the first writer, one for the seven written meanwhile
        assert later == list(range(first + 1, first + 8))
    finally:
        wal.close()


def test_a_failed_flush_fails_its_writers_and_every_later_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import service.wal.appender

    def broken_disk(fd: int) -> None:
        raise OSError(5, "Input/output error")

    wal = WalJournal(tmp_path, fsync="interval", fsync_interval_ms=1.0)
    generator = torch.Generator().manual_seed(1)
    try:
        wal.create("t", _table(), 0)
        monkeypatch.setattr(service.wal.appender, "sync_data", broken_disk)
        ids, grads = _random_update(generator, 3, DIM)
        ticket = wal.append(UpdateRecord("t", 1, ids, grads, 0.1))
        with pytest.raises(OSError, match="could not be flushed"):
            wal.wait_durable(ticket)
        monkeypatch.undo()  # a later fdatasync that succeeds proves nothing about the lost pages
        ticket = wal.append(UpdateRecord("t", 2, ids, grads, 0.1))
        with pytest.raises(OSError, match="restart the server"):
            wal.wait_durable(ticket)
    finally:
        with contextlib.suppress(OSError):
            wal.close()


@pytest.mark.parametrize("policy", ["always", "never"])
def test_always_and_never_have_nothing_to_wait_for(tmp_path: Path, policy: FsyncPolicy) -> None:
    wal = WalJournal(tmp_path, fsync=policy)
    try:
        wal.create("t", _table(), 0)
        ids, grads = _random_update(torch.Generator().manual_seed(2), 3, DIM)
        assert wal.append(UpdateRecord("t", 1, ids, grads, 0.1)) == 0
        wal.wait_durable(0)
        assert wal._flusher is None
    finally:
        wal.close()


def test_a_failed_write_leaves_no_partial_record(
    journal: WalJournal, monkeypatch: pytest.MonkeyPatch
) -> None:
    initial = _table()
    journal.create("t", initial, 0)
    server = _Server(journal, "t", _copy(initial))
    server.update()

    def half_write(fd: int, buffers: list[Any]) -> int:
        os.write(fd, bytes(buffers[0])[:10])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "writev", half_write)
    with pytest.raises(StorageFullError, match=r"no space left .* nothing was applied") as refused:
        journal.append(UpdateRecord("t", 2, torch.tensor([1]), torch.ones(1, DIM), 0.1))
    assert isinstance(refused.value.__cause__, OSError) and refused.value.__cause__.errno == 28
    monkeypatch.undo()
    server.update()  # version 2 again: the failed one was never applied
    loaded = journal.load("t")
    assert loaded is not None and loaded[1] == 2
    _assert_same(loaded[0], server.table)


def test_append_refuses_versions_the_snapshot_already_holds(journal: WalJournal) -> None:
    journal.create("t", _table(), 5)
    with pytest.raises(ConflictError):
        journal.append(UpdateRecord("t", 5, torch.tensor([1]), torch.ones(1, DIM), 0.1))
    with pytest.raises(InvalidInputError):
        journal.append(UpdateRecord("t", 6, torch.tensor([1]), torch.ones(1, DIM + 1), 0.1))


def test_drop_removes_the_table(journal: WalJournal, tmp_path: Path) -> None:
    journal.create("t", _table(), 0)
    journal.drop("t")
    assert journal.names() == [] and journal.load("t") is None
    assert [p.name for p in (tmp_path / "data").iterdir()] == [".robez.lock"]
    journal.create("t", _table(seed=9), 0)  # the name can be used again
    assert journal.names() == ["t"]
    with pytest.raises(ConflictError):
        journal.create("t", _table(), 0)


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", ".hidden", "a\\b", " t"])
def test_unsafe_names_never_reach_the_file_system(journal: WalJournal, name: str) -> None:
    with pytest.raises(InvalidInputError):
        journal.create(name, _table(), 0)


def test_snapshot_due_follows_the_policy(tmp_path: Path) -> None:
    wal = WalJournal(tmp_path, snapshot_every_updates=3)
    try:
        wal.create("t", _table(), 10)
        assert [wal.snapshot_due("t", version) for version in (10, 12, 13)] == [False, False, True]
    finally:
        wal.close()
    timed = WalJournal(tmp_path, snapshot_every_seconds=3600)
    assert not timed.snapshot_due("t", 11)
    timed.snapshot_every_seconds = 1e-9
    assert timed.snapshot_due("t", 11) and not timed.snapshot_due("t", 10)


def test_snapshot_due_when_the_log_outgrows_the_table(tmp_path: Path) -> None:
    """The size policy: a snapshot once the log is over max(floor, ratio x snapshot bytes), whatever the
    update count (big pushes make big records); 0 turns it off."""
    table = _table("sgd")
    ids, grads = _random_update(torch.Generator().manual_seed(1), 50)
    record_bytes = len(_record_bytes(1, ids, grads, 0.1))
    wal = WalJournal(tmp_path, snapshot_log_ratio=2.0, snapshot_log_min_bytes=3 * record_bytes)
    try:
        wal.create("t", table, 0)
        snapshot_bytes = wal.snapshot_path("t").stat().st_size  # type: ignore[union-attr]
        limit = wal.log_limit_bytes(snapshot_bytes)
        assert limit == max(3 * record_bytes, 2 * snapshot_bytes)
        due = []
        for version in range(1, 3 + limit // record_bytes):
            wal.append(UpdateRecord("t", version, ids, grads, 0.1))
            due.append(wal.snapshot_due("t", version))
        log_bytes = (tmp_path / "t" / LOG_FILE).stat().st_size
        first_due = due.index(True) + 1
        assert log_bytes > limit and all(due[first_due - 1 :])
        # Due exactly from the first record that takes the log over the limit.
        assert (
            LOG_HEADER_SIZE + (first_due - 1) * record_bytes
            <= limit
            < LOG_HEADER_SIZE + first_due * record_bytes
        )
        wal.snapshot("t", table, version)
        assert not wal.snapshot_due("t", version)
        wal.snapshot_log_ratio = 0.0  # off: the same log is never due by size
        for later in range(version + 1, version + 2 + limit // record_bytes):
            wal.append(UpdateRecord("t", later, ids, grads, 0.1))
        assert not wal.snapshot_due("t", later)
    finally:
        wal.close()


def test_offline_tools_and_servers_exclude_each_other(tmp_path: Path) -> None:
    server = WalJournal(tmp_path)
    with pytest.raises(ConflictError, match="in use"):
        WalJournal(tmp_path, exclusive=True)
    WalJournal(tmp_path).close()  # a second worker shares the directory
    server.close()
    (tmp_path / ".creating-t-1234").mkdir()  # what a crash in the middle of create leaves
    tool = WalJournal(tmp_path, exclusive=True)
    assert not (tmp_path / ".creating-t-1234").exists()
    with pytest.raises(ConflictError, match="in use"):
        WalJournal(tmp_path)
    tool.close()


def test_folders_of_killed_drops_go_at_the_next_create_of_the_name_and_at_every_open(tmp_path: Path) -> None:
    """What a drop killed between its rename and its removal leaves (``.dropped-<name>-<8 hex>``): the
    next create of that name removes its own (how the store's repair writes the table back), opening
    the directory removes them all, shared (a server's workers) or not; a create in progress elsewhere
    (``.creating-*``) is left to a server-free open."""
    wal = WalJournal(tmp_path)
    try:
        for leftover in (".dropped-t-0123abcd", ".dropped-t-x-4567cdef", ".creating-u-89abcdef"):
            (tmp_path / leftover).mkdir()
            (tmp_path / leftover / "snapshot-1.safetensors").write_bytes(b"x")
        wal.create("t", _table(), 0)
        assert sorted(path.name for path in tmp_path.glob(".[cd]*")) == [
            ".creating-u-89abcdef",
            ".dropped-t-x-4567cdef",  # table "t-x", not "t"
        ]
        WalJournal(tmp_path).close()  # a worker starting beside this one
        assert [path.name for path in tmp_path.glob(".[cd]*")] == [".creating-u-89abcdef"]
    finally:
        wal.close()


def test_one_server_per_data_directory(tmp_path: Path) -> None:
    first = ServerLock(tmp_path)
    with pytest.raises(ConflictError, match=f"another robez serve \\(pid {os.getpid()}\\)"):
        ServerLock(tmp_path)
    WalJournal(tmp_path).close()  # its workers share the directory
    with pytest.raises(ConflictError, match="in use"):
        WalJournal(tmp_path, exclusive=True)  # offline tools wait for the server to stop
    first.release()
    first.release()  # idempotent
    tool = WalJournal(tmp_path, exclusive=True)
    with pytest.raises(ConflictError, match="in use"):
        ServerLock(tmp_path)  # and a server waits for the tool
    tool.close()
    ServerLock(tmp_path).release()


def test_server_start_removes_interrupted_creates_only_when_nothing_holds_the_directory(
    tmp_path: Path,
) -> None:
    # what a create killed half-way leaves: its staging folder, with a snapshot written
    (tmp_path / ".creating-t-1234abcd").mkdir()
    (tmp_path / ".creating-t-1234abcd" / "snapshot-1.safetensors").write_bytes(b"x")
    (tmp_path / ".creating-notes.txt").write_text("not a folder of ours")
    worker = WalJournal(tmp_path)  # a worker that outlived its server holds the shared lock
    ServerLock(tmp_path).release()
    assert (tmp_path / ".creating-t-1234abcd").is_dir()  # its create may be under way
    worker.close()
    lock = ServerLock(tmp_path)
    assert not (tmp_path / ".creating-t-1234abcd").exists()
    assert (tmp_path / ".creating-notes.txt").is_file()
    WalJournal(tmp_path).close()  # and the server still shares the directory with its workers
    with pytest.raises(ConflictError, match="in use"):
        WalJournal(tmp_path, exclusive=True)
    lock.release()


def test_salvage_keeps_the_records_before_mid_log_damage(journal: WalJournal) -> None:
    path, full, _, _ = _log_and_oracle(journal, 3)
    records = scan_log(full).records
    damaged = _flip_bit(full, records[1].offset + RECORD_HEADER_SIZE + 1, 4)
    path.write_bytes(damaged)
    with pytest.raises(CorruptionError):
        journal.load("t")
    loaded = journal.load("t", salvage=True)
    assert loaded is not None and loaded[1] == 1
    assert path.stat().st_size == records[1].offset


# finish_snapshot fails after the new snapshot file is written; write_temp_file when meta.json is (its last
# step before the commit: a full disk there must not leave the new snapshot taking space either).
@pytest.mark.parametrize("failing_step", ["finish_snapshot", "write_temp_file"])
def test_a_snapshot_failing_before_its_commit_leaves_the_folder_as_it_was(
    journal: WalJournal, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing_step: str
) -> None:
    import service.wal.generations

    journal.create("t", _table(), 0)
    server = _Server(journal, "t", _table())
    server.update()
    directory = tmp_path / "data" / "t"
    before = {path.name: path.read_bytes() for path in directory.iterdir()}

    def disk_full(*args: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(service.wal.generations, failing_step, disk_full)
    with pytest.raises(StorageFullError, match="snapshot of table 't' refused"):
        journal.snapshot("t", server.table, server.version)
    assert journal.write_problem() is None  # the disk is not really full: free space says writable
    monkeypatch.undo()
    assert {path.name: path.read_bytes() for path in directory.iterdir()} == before
    server.update()  # the log is still the committed one
    loaded = journal.load("t")
    assert loaded is not None and loaded[1] == 2
    _assert_same(loaded[0], server.table)


# -- a writer that died in the middle of an update (issue: a killed worker wrote a version twice) -------


def test_append_refuses_a_version_that_does_not_follow_the_log(journal: WalJournal, tmp_path: Path) -> None:
    journal.create("t", _table(), 0)
    other = WalJournal(tmp_path / "data")  # another worker process appending to the same log
    try:
        ids, grads = torch.tensor([1, 2]), torch.ones(2, DIM)
        journal.append(UpdateRecord("t", 1, ids, grads, 0.1))
        size = (tmp_path / "data" / "t" / LOG_FILE).stat().st_size
        with pytest.raises(CorruptionError, match="last record produces 1"):
            other.append(UpdateRecord("t", 1, ids, grads, 0.1))  # a repeat: what the killed worker caused
        with pytest.raises(CorruptionError, match="last record produces 1"):
            other.append(UpdateRecord("t", 3, ids, grads, 0.1))  # a gap
        assert (tmp_path / "data" / "t" / LOG_FILE).stat().st_size == size  # nothing written
        other.append(UpdateRecord("t", 2, ids, grads, 0.1))
        journal.append(UpdateRecord("t", 3, ids, grads, 0.1))  # follows the other worker's record
        with pytest.raises(CorruptionError):
            journal.append(UpdateRecord("t", 3, ids, grads, 0.1))
    finally:
        other.close()
    loaded = journal.load("t")
    assert loaded is not None and loaded[1] == 3


def test_append_refuses_to_follow_an_unfinished_record(journal: WalJournal) -> None:
    journal.create("t", _table(), 0)
    ids, grads = torch.tensor([1, 2]), torch.ones(2, DIM)
    journal.append(UpdateRecord("t", 1, ids, grads, 0.1))
    path = journal.data_dir / "t" / LOG_FILE
    with open(path, "ab") as handle:  # another worker died half-way through writing version 2
        handle.write(_record_bytes(2, ids, grads, 0.1)[:30])
    with pytest.raises(CorruptionError, match="unfinished record"):
        journal.append(UpdateRecord("t", 2, ids, grads, 0.1))


@pytest.mark.parametrize("written", ["whole", "torn", "none"])
def test_recover_rebuilds_the_version_and_cuts_the_unfinished_record(
    journal: WalJournal, written: str
) -> None:
    initial = _table()
    journal.create("t", initial, 0)
    server = _Server(journal, "t", _copy(initial))
    for _ in range(3):
        server.update()
    path = journal.data_dir / "t" / LOG_FILE
    good_size = path.stat().st_size
    ids, grads = torch.tensor([5, 6]), torch.ones(2, DIM)
    if written == "whole":
        journal.append(UpdateRecord("t", 4, ids, grads, 0.1))
    elif written == "torn":
        with open(path, "ab") as handle:
            handle.write(_record_bytes(4, ids, grads, 0.1)[:-3])
    recovered = journal.recover("t", 3)
    _assert_same(recovered, _oracle(initial, server.updates))
    assert path.stat().st_size == good_size
    journal.append(UpdateRecord("t", 4, ids + 1, grads, 0.2))  # the next writer goes on after version 3
    loaded = journal.load("t")
    assert loaded is not None and loaded[1] == 4
    _assert_same(loaded[0], _oracle(initial, [*server.updates, (ids + 1, grads, 0.2)]))
    with pytest.raises(CorruptionError, match="cannot recover 9"):
        journal.recover("t", 9)


def test_log_marks_name_what_was_logged_between_them_and_nothing_after_a_cut_or_a_snapshot(
    journal: WalJournal,
) -> None:
    """What a lock-free copy patches (store/live_copy.py): the ids of the records between two marks, read
    while later records are appended; None (unknown: copy under the lock) once an unfinished update was
    cut off the log, whose values a copy may hold though no record names them any more, or once the log
    was replaced."""
    initial = _table()
    journal.create("t", initial, 0)
    server = _Server(journal, "t", _copy(initial))
    server.update()
    first = journal.log_mark("t", 1)
    assert first is not None and first.version == 1
    assert journal.updated_ids("t", first, first) == []
    for _ in range(3):
        server.update()
    second = journal.log_mark("t", 4, first)
    assert second is not None and second.version == 4
    logged = [ids.tolist() for ids, _, _ in server.updates[1:]]
    assert [ids.tolist() for ids in journal.updated_ids("t", first, second) or []] == logged
    wrong = journal.log_mark("t", 5, second)  # the store says 5, the log ends at 4
    assert wrong is not None
    with pytest.raises(CorruptionError, match="the table is at 5"):
        journal.updated_ids("t", second, wrong)  # the store and the log disagree: never silent
    server.update()  # appended after the mark: not named by it
    assert [ids.tolist() for ids in journal.updated_ids("t", first, second) or []] == logged
    fifth = journal.log_mark("t", 5, second)
    assert fifth is not None
    journal.append(UpdateRecord("t", 6, torch.tensor([7]), torch.ones(1, DIM), 0.1))  # its worker dies
    journal.recover("t", 5)
    assert journal.log_mark("t", 5, fifth) is None
    fresh = journal.log_mark("t", 5)
    assert fresh is not None
    server.update()
    later = journal.log_mark("t", 6, fresh)
    assert later is not None and journal.updated_ids("t", fresh, later) is not None
    journal.snapshot("t", server.table, 6)
    assert journal.log_mark("t", 6, fresh) is None
    assert journal.updated_ids("t", fresh, later) is None  # the log the marks name is gone


def test_salvage_keeps_the_later_of_a_repeated_version(journal: WalJournal) -> None:
    """A log written by the bug: the dead worker's version 2, then the next writer's version 2 and on."""
    initial = _table()
    journal.create("t", initial, 0)
    generator = torch.Generator().manual_seed(5)
    updates = [_random_update(generator, 2) for _ in range(4)]
    path = journal.data_dir / "t" / LOG_FILE
    with open(path, "ab") as handle:
        for version, (ids, grads) in zip([1, 2, 2, 3], updates, strict=True):
            handle.write(_record_bytes(version, ids, grads, 0.1))
    with pytest.raises(CorruptionError, match="salvage can recover it"):
        journal.load("t")
    loaded = journal.load("t", salvage=True)
    assert loaded is not None and loaded[1] == 3
    kept = [updates[0], updates[2], updates[3]]  # the dead worker's record (the first version 2) dropped
    _assert_same(loaded[0], _oracle(initial, [(ids, grads, 0.1) for ids, grads in kept]))


def test_a_snapshot_the_old_journal_writer_made_still_loads(journal: WalJournal) -> None:
    """Snapshots written before the journal used Table.begin_write have their tensors in name order
    (tests/core/data, see test_table.py): the data folder still starts from one."""
    old = Path(__file__).parents[1] / "core" / "data" / "adam-by-name-order.safetensors"
    stored = Table.load(old)
    journal.create("t", _copy(stored), 4)
    snapshot = journal.snapshot_path("t")
    assert snapshot is not None and snapshot.read_bytes() != old.read_bytes()  # the new writer's order
    snapshot.write_bytes(old.read_bytes())
    meta_file = journal.table_dir("t") / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["snapshot_crc32"], meta["snapshot_bytes"] = zlib.crc32(old.read_bytes()), old.stat().st_size
    meta_file.write_text(json.dumps(meta))
    assert journal.stored_spec("t") == (stored.config, stored.optimizer)
    target = Table(stored.config, stored.optimizer, weight=torch.zeros(64))
    assert journal.load_into("t", target) == 4
    _assert_same(target, stored)


def test_the_replay_skips_a_record_that_fails_a_check_and_applies_the_rest_in_order(
    journal: WalJournal, caplog: pytest.LogCaptureFixture
) -> None:
    """A record of the log that fails a check at the replay (an lr over the table's max_lr, as a log
    written under another config could hold) is an empty version, with its warning; those around it, of
    the small-batch path and of the general one, are applied in order."""
    initial = _table()
    journal.create("t", initial, 0)
    generator = torch.Generator().manual_seed(8)
    updates = []
    for version in range(1, 41):
        ids = torch.randint(0, 50, (3 if version % 2 else 200,), generator=generator)
        grads = torch.randn(ids.shape[0], DIM, generator=generator)
        lr = initial.optimizer.max_lr * 2 if version == 17 else 0.05
        journal.append(UpdateRecord("t", version, ids, grads, lr))
        if version != 17:
            updates.append((ids, grads, lr))
    with caplog.at_level("WARNING"):
        loaded = journal.load("t")
    assert loaded is not None and loaded[1] == 40
    _assert_same(loaded[0], _oracle(initial, updates))
    assert [r.getMessage() for r in caplog.records if "empty version" in r.getMessage()] == [
        f"table 't': log entry 17 applied as an empty version (bad_lr): lr {initial.optimizer.max_lr * 2:g} "
        f"is over this table's max_lr={initial.optimizer.max_lr:g} (its optimizer config)"
    ]
