"""A restore from a checkpoint file written into the table's own array (``service/store/inplace.py``):
no second array, lookups never see a mix (503 instead), a damaged file refused before anything is
written, a restore cut short never served, sharers and running copies kept right. The kill -9 points
are in test_admin_crash.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from robez_core.checkpoint import CheckpointFile
from robez_core.config import OptimizerConfig, TableConfig
from robez_core.errors import BusyError, ConflictError, CorruptionError
from robez_core.table import Table
from service.config import Settings, TableSpec
from service.faults import Faults
from service.log.journal import NullJournal
from service.log.state_digest import digest_of_table
from service.shm import SharedDirectory
from service.store import TableStore
from service.store.inplace import RESTORE_OVERWRITING
from service.wal import WalJournal

from ..conftest import make_settings, store_of

CONFIG = TableConfig(num_embeddings=100_000, embedding_dim=8, memory_size=1 << 20, chunk_size=4)
ADAM = OptimizerConfig("adam", lr=0.1)
IDS = torch.arange(0, 100_000, 7)


def _filled(seed: int) -> Table:
    table = Table(CONFIG, ADAM)
    generator = torch.Generator().manual_seed(seed)
    for tensor in table.tensors().values():
        tensor.copy_(torch.rand(tensor.shape, generator=generator) + seed)
    return table


def _same(left: Table, right: Table) -> bool:
    a, b = left.tensors(), right.tensors()
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


@dataclass
class Hooked(Faults):
    """Faults whose kill point runs ``at_point`` instead of killing: the test looks in half way."""

    at_point: Any = None
    at_pause: Any = None

    def die_at(self, point: str) -> None:
        if self.at_point is not None:
            self.at_point(point)

    def slow_down(self) -> None:
        if self.at_pause is not None:
            self.at_pause()


@pytest.fixture
def store(settings: Settings, directory: SharedDirectory) -> Iterator[TableStore]:
    opened = TableStore(directory, settings, NullJournal(), Hooked())
    opened.create("t", TableSpec(CONFIG, ADAM))
    yield opened
    opened.close()


def _save(table: Table, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.safetensors"
    table.save(path)
    return path


def test_a_restore_writes_the_tables_own_array_and_allocates_no_second_one(
    store: TableStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No shared memory is allocated (before: a whole new array, 1x the table), the array id stays, and
    the table holds the file's bytes at its version."""
    source = _filled(3)
    path = _save(source, tmp_path, "source")
    array = store.info("t").array
    allocated: list[int] = []
    original = SharedDirectory.allocate

    def allocate(self: SharedDirectory, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        tensor = original(self, name, numel, dtype)
        allocated.append(tensor.numel() * tensor.element_size())
        return tensor

    monkeypatch.setattr(SharedDirectory, "allocate", allocate)
    store.restore_from_file("t", path, 5)
    table_bytes = sum(t.numel() * t.element_size() for t in source.tensors().values())
    assert sum(allocated) <= 0.25 * table_bytes, f"{sum(allocated)} bytes allocated for {table_bytes}"
    assert store.info("t").array == array
    assert store.version("t") == 5 and _same(store.table("t"), source) and not store.torn("t")
    assert store.checksum("t") == (5, digest_of_table(source))


def test_a_damaged_or_mismatched_file_is_refused_before_anything_is_written(
    store: TableStore, tmp_path: Path
) -> None:
    store.update("t", torch.tensor([1, 2]), torch.ones(2, 8))
    before = Table(CONFIG, ADAM)
    for key, tensor in store.table("t").tensors().items():
        before.tensors()[key].copy_(tensor)
    path = _save(_filled(3), tmp_path, "source")
    data = bytearray(path.read_bytes())
    data[-5] ^= 1  # the last tensor's last bytes: found only after the others would have been written
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(bytes(data))
    with pytest.raises(CorruptionError, match="checksum"):
        store.restore_from_file("t", damaged, 5)
    other = Table(TableConfig(100_000, 8, memory_size=1 << 20, chunk_size=4), OptimizerConfig("adagrad"))
    with pytest.raises(ConflictError):
        store.restore_from_file("t", _save(other, tmp_path, "other"), 5)
    assert store.version("t") == 1 and _same(store.table("t"), before) and not store.torn("t")
    store.lookup("t", IDS)
    assert store.update("t", torch.tensor([1]), torch.ones(1, 8)).version == 2


def test_lookups_during_an_overwrite_answer_busy_and_a_cut_short_restore_is_never_served(
    store: TableStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Half way through the overwrite a lookup is refused (503), so is one that began before it; a
    file that changed after its check fails the read half way and leaves the table torn: lookups,
    updates and checksums refuse until a restore writes the whole array again."""
    faults = store.faults
    assert isinstance(faults, Hooked)
    seen: list[str] = []
    began = store.registry.entry("t").overwrites

    def half_way(point: str) -> None:
        if point != RESTORE_OVERWRITING:
            return
        with pytest.raises(BusyError, match="restored from a snapshot in place"):
            store.lookup("t", IDS)
        assert store.registry.entry("t").overwrites != began
        seen.append(point)

    faults.at_point = half_way
    source = _filled(3)
    store.restore_from_file("t", _save(source, tmp_path, "source"), 4)
    assert seen == [RESTORE_OVERWRITING]
    faults.at_point = None
    assert torch.equal(torch.from_numpy(store.lookup("t", IDS).rows), source.lookup(IDS))

    # A file that changes after ``verify``: the read finds the mismatch half way.
    path = _save(_filled(4), tmp_path, "next")
    data = bytearray(path.read_bytes())
    data[-5] ^= 1
    path.write_bytes(bytes(data))
    monkeypatch.setattr(CheckpointFile, "verify", lambda self: None)
    with pytest.raises(CorruptionError, match="checksum"):
        store.restore_from_file("t", path, 6)
    monkeypatch.undo()
    assert store.torn("t")
    with pytest.raises(BusyError):
        store.lookup("t", IDS)
    with pytest.raises(BusyError):
        store.update("t", torch.tensor([1]), torch.ones(1, 8))
    with pytest.raises(BusyError):
        store.checksum("t")
    mended = _filled(5)
    store.restore_from_file("t", _save(mended, tmp_path, "mended"), 6)
    assert not store.torn("t") and store.version("t") == 6 and _same(store.table("t"), mended)
    assert store.update("t", torch.tensor([1]), torch.ones(1, 8)).version == 7


def test_lookups_during_repeated_restores_see_one_table_or_the_other_never_a_mix(
    settings: Settings, directory: SharedDirectory, store: TableStore, tmp_path: Path
) -> None:
    reader = TableStore(directory, settings, NullJournal())
    sources = [_filled(seed) for seed in (5, 6)]
    paths = [_save(source, tmp_path, f"s{index}") for index, source in enumerate(sources)]
    expected = [source.lookup(IDS) for source in sources]
    store.restore_from_file("t", paths[0], 2)
    done = threading.Event()
    seen: list[int] = []
    refused: list[int] = []
    failures: list[str] = []

    def look() -> None:
        for _ in range(20_000):  # bounded; stops once the restores are done
            try:
                result = reader.lookup("t", IDS)
            except BusyError:
                refused.append(1)
                continue
            rows = torch.from_numpy(result.rows)
            matches = [index for index, want in enumerate(expected) if torch.equal(rows, want)]
            if len(matches) != 1 or result.version % 2 != matches[0]:
                failures.append(f"version {result.version}: rows of {matches or 'neither table'}")
                return
            seen.append(matches[0])
            if done.is_set():
                return

    thread = threading.Thread(target=look)
    thread.start()
    try:
        for restore in range(3, 200):  # until the reader looked often enough while restores ran
            store.restore_from_file("t", paths[restore % 2], restore)
            if (len(seen) >= 50 and len(refused) >= 5 and restore >= 10) or failures:
                break
    finally:
        done.set()
        thread.join(timeout=60)
    assert not thread.is_alive() and not failures and seen and refused
    reader.close()


def test_tables_sharing_the_array_are_overwritten_with_it_each_at_its_version(
    store: TableStore, tmp_path: Path
) -> None:
    store.create("u", TableSpec(CONFIG, ADAM, share_array_with="t"))
    store.update("u", torch.tensor([1]), torch.ones(1, 8))
    faults = store.faults
    assert isinstance(faults, Hooked)

    def half_way(point: str) -> None:
        if point == RESTORE_OVERWRITING:
            for name in ("t", "u"):
                with pytest.raises(BusyError):
                    store.lookup(name, IDS)

    faults.at_point = half_way
    source = _filled(3)
    store.restore_from_file("t", _save(source, tmp_path, "source"), 9)
    faults.at_point = None
    assert (store.version("t"), store.version("u")) == (9, 1)
    assert _same(store.table("u"), source) and not store.torn("u")
    assert store.update("u", torch.tensor([1]), torch.ones(1, 8)).version == 2


def test_a_checksum_copying_while_a_restore_overwrites_is_of_one_version(
    store: TableStore, tmp_path: Path
) -> None:
    """A copy of the array running without the lock (``consistent_copy``) while a restore overwrites it
    recopies every granule the restore marked: its digest is the old table's at the old version or the
    new one's at the new version."""
    store.update("t", torch.tensor([1]), torch.ones(1, 8))
    old = Table(CONFIG, ADAM)
    for key, tensor in store.table("t").tensors().items():
        old.tensors()[key].copy_(tensor)
    source = _filled(3)
    path = _save(source, tmp_path, "source")
    faults = store.faults
    assert isinstance(faults, Hooked)
    copying, restored = threading.Event(), threading.Event()

    def pause() -> None:  # the copy's first piece is done: the restore runs now, then the copy goes on
        copying.set()
        assert restored.wait(timeout=60)

    faults.at_pause = pause
    results: list[tuple[int, str]] = []
    thread = threading.Thread(target=lambda: results.append(store.checksum("t")))
    thread.start()
    try:
        assert copying.wait(timeout=60)
        store.restore_from_file("t", path, 8)
    finally:
        restored.set()
        thread.join(timeout=60)
        faults.at_pause = None
    assert results == [(8, digest_of_table(source))]


def test_with_a_data_directory_a_restart_serves_the_restored_table_and_the_updates_after_it(
    tmp_path: Path,
) -> None:
    """With a data directory the journal holds the restored table (written from the file, not from the
    array) and the updates after it: a restart from it serves what the workers served."""
    settings = make_settings(tmp_path, default_table=False, data_dir=tmp_path / "data")
    journal = WalJournal(tmp_path / "data")
    directory = TableStore.prepare(settings, journal)
    store = TableStore(directory, settings, journal)
    try:
        store.create("t", TableSpec(CONFIG, ADAM))
        store.update("t", torch.tensor([1]), torch.ones(1, 8))
        source = _filled(3)
        store.restore_from_file("t", _save(source, tmp_path, "source"), 5)
        assert store.version("t") == 5 and _same(store.table("t"), source)
        store.update("t", torch.tensor([2]), torch.ones(1, 8))
        source.apply_gradients(torch.tensor([2]), torch.ones(1, 8))
        assert _same(store.table("t"), source)
    finally:
        store.close()
        journal.close()
        directory.remove()
    reopened = WalJournal(tmp_path / "data")
    try:
        loaded = reopened.load("t")
    finally:
        reopened.close()
    assert loaded is not None and loaded[1] == 6 and _same(loaded[0], source)


def test_a_torn_table_answers_503_with_retry_after_over_http(
    client: TestClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = store_of(client)
    table = store.table("demo")
    path = tmp_path / "demo.safetensors"
    table.save(path)
    data = bytearray(path.read_bytes())
    data[-5] ^= 1
    path.write_bytes(bytes(data))
    monkeypatch.setattr(CheckpointFile, "verify", lambda self: None)  # as if changed after its check
    with pytest.raises(CorruptionError):
        store.restore_from_file("demo", path, 3)
    lookup = client.post("/v1/tables/demo/lookup", json={"ids": [1, 2]})
    assert lookup.status_code == 503 and "Retry-After" in lookup.headers
    assert "restored from a snapshot in place" in lookup.text
    grads = [[0.0] * table.config.embedding_dim]
    assert client.post("/v1/tables/demo/update", json={"ids": [1], "grads": grads}).status_code == 503
