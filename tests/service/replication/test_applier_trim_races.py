"""The applier against a log trimmed under it, with a scripted in-memory log: the interleavings are
forced, not left to timing (no NATS, no server process)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncGenerator
from pathlib import Path

import pytest
import torch

from robez_core.checkpoint import CheckpointFile
from robez_core.config import OptimizerConfig, TableConfig
from robez_core.errors import BusyError, CorruptionError
from robez_core.table import Table
from service.config import Settings, TableSpec
from service.log.journal import NullJournal
from service.replication.applier import Applier
from service.replication.log import CatalogEntry, LogEntry, LogTrimmedError, Snapshot
from service.replication.records import encode_update
from service.store import TableStore

from ..conftest import make_settings
from .conftest import ADAM, SMALL, push_grads

ENTRY = CatalogEntry("t", SMALL, ADAM, "inc")


def _snapshot_at(position: int, tmp_path: Path) -> Snapshot:
    table = Table(TableConfig.from_dict(SMALL), OptimizerConfig.from_dict(ADAM))
    for seed in range(position):
        table.apply_gradients(*push_grads(seed))
    path = tmp_path / f"snap-{position}.safetensors"
    table.save(path)
    return Snapshot(position, path)


class _TrimmedWhileReading:
    """The stored snapshot is at 10 and the log starts at 11 when the applier looks; by the time its
    reader subscribes, another replica has uploaded the snapshot at 20 and trimmed the log below 21."""

    def __init__(self, tmp_path: Path) -> None:
        self.snapshots = [_snapshot_at(10, tmp_path), _snapshot_at(20, tmp_path)]
        self.reads: list[int] = []

    async def get_snapshot(self, entry: CatalogEntry, directory: Path) -> Snapshot:
        # A new file each time, as a download makes (the applier removes it after use).
        stored = self.snapshots[min(len(self.reads), 1)]
        path = directory / f"download-{len(self.reads)}-{stored.path.name}"
        shutil.copyfile(stored.path, path)
        return Snapshot(stored.position, path)

    async def bounds(self, entry: CatalogEntry) -> tuple[int, int]:
        return (11, 30) if not self.reads else (21, 30)

    async def read(self, entry: CatalogEntry, after: int) -> AsyncGenerator[LogEntry, None]:
        self.reads.append(after)
        for position in range(max(after + 1, 21), 31):  # 11..20 are gone
            payload, headers = encode_update(*push_grads(position - 1), lr=0.01)
            yield LogEntry(position, payload, headers, 0.0, 30 - position)


class _Store:
    def __init__(self) -> None:
        self.restored: list[tuple[Table, int]] = []

    def restore(self, name: str, table: Table, version: int) -> None:
        self.restored.append((table, version))


def test_rebuild_that_finds_the_log_trimmed_past_its_snapshot_starts_over(tmp_path: Path) -> None:
    """A worker taking over rebuilds from the snapshot at 10; the log it reads starts at 21. Applying 21
    onto version 10 would skip 11..20: it must refuse, and the next rebuild (from the snapshot at 20)
    must give the bytes of the 30 updates."""
    log = _TrimmedWhileReading(tmp_path)
    store = _Store()
    settings = Settings(_env_file=None, data_dir=tmp_path / "data")  # type: ignore[call-arg]
    applier = Applier(store, settings, None, log, tmp_path / "replication.json")  # type: ignore[arg-type]

    with pytest.raises(LogTrimmedError):
        asyncio.run(applier._rebuild_table(ENTRY))
    assert store.restored == [] and log.reads == [10]

    asyncio.run(applier._rebuild_table(ENTRY))
    assert log.reads == [10, 20]
    ((table, version),) = store.restored
    expected = Table(TableConfig.from_dict(SMALL), OptimizerConfig.from_dict(ADAM))
    for seed in range(30):
        expected.apply_gradients(*push_grads(seed))
    assert version == 30
    assert all(table.tensors()[key].equal(value) for key, value in expected.tensors().items())


class _OneSnapshot:
    """The Object Store holds a snapshot at 20; the log goes on from 21."""

    def __init__(self, tmp_path: Path) -> None:
        self.stored = _snapshot_at(20, tmp_path)
        self.gets = 0

    async def get_snapshot(self, entry: CatalogEntry, directory: Path) -> Snapshot:
        self.gets += 1
        path = directory / f"download-{self.gets}.safetensors"
        shutil.copyfile(self.stored.path, path)
        return Snapshot(self.stored.position, path)


def test_a_table_left_torn_by_a_restore_in_place_is_restored_again_before_it_is_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restore of the snapshot into the table's own array cut short half way (here a file that fails
    its checksums only once the overwrite began) leaves the table refused (503); the applier's next
    round (``_bootstrap``) finds it torn and restores the snapshot again, and the table serves its bytes."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    settings = make_settings(tmp_path, default_table=False)
    directory = TableStore.prepare(settings, NullJournal())
    store = TableStore(directory, settings, NullJournal())
    try:
        store.create("t", TableSpec(TableConfig.from_dict(SMALL), OptimizerConfig.from_dict(ADAM)))
        log = _OneSnapshot(tmp_path)
        damaged = tmp_path / "damaged.safetensors"
        data = bytearray(log.stored.path.read_bytes())
        data[-5] ^= 1
        damaged.write_bytes(bytes(data))
        with monkeypatch.context() as patched:
            patched.setattr(CheckpointFile, "verify", lambda self: None)
            with pytest.raises(CorruptionError):
                store.restore_from_file("t", damaged, 20)
        assert store.torn("t")
        with pytest.raises(BusyError):
            store.lookup("t", torch.tensor([1, 2]))

        applier = Applier(store, settings, None, log, tmp_path / "replication.json")  # type: ignore[arg-type]
        applier._incarnations["t"] = ENTRY.incarnation
        assert asyncio.run(applier._bootstrap(ENTRY)) == 20 and log.gets == 1
        assert not store.torn("t") and store.version("t") == 20
        expected = Table.load(log.stored.path)
        assert all(store.table("t").tensors()[k].equal(v) for k, v in expected.tensors().items())
        assert asyncio.run(applier._bootstrap(ENTRY)) == 20 and log.gets == 1  # kept from now on
    finally:
        store.close()
        directory.remove()
