"""TableStore across "workers" (several stores attached to one shared directory) and its journal hook."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from robez_core.config import OptimizerConfig, TableConfig
from robez_core.errors import ConflictError, CorruptionError, InvalidInputError, NotFoundError
from robez_core.small import SmallPath
from robez_core.table import Table
from service.config import Settings, TableSpec
from service.shm import SharedDirectory, remove_stale_directories
from service.store import LookupResult, TableStore
from service.store.journal import NullJournal, SkippedRecord, UpdateRecord
from service.wal import LOG_FILE, META_FILE, WalJournal

from ..conftest import make_settings

CONFIG = TableConfig(num_embeddings=100, embedding_dim=8, memory_size=1024, chunk_size=4)


def test_workers_see_each_others_tables_and_updates(settings: Settings, directory: SharedDirectory) -> None:
    first = TableStore(directory, settings, NullJournal())
    second = TableStore(directory, settings, NullJournal())
    first.create("t", TableSpec(CONFIG, OptimizerConfig("adagrad")))
    assert second.names() == ["t"]
    ids, grads = torch.tensor([1, 2, 2]), torch.randn(3, 8)
    assert second.update("t", ids, grads).version == 1
    assert first.version("t") == 1
    looked_up = first.lookup("t", torch.tensor([1, 2]))
    assert looked_up.version == 1
    assert torch.equal(torch.from_numpy(looked_up.rows), second.table("t").lookup(torch.tensor([1, 2])))
    # One copy: both workers' tables are views of the same mapped file.
    assert first.table("t").weight.data_ptr() != second.table("t").weight.data_ptr()  # two mappings...
    first.table("t").weight[0] = 123.0
    assert float(second.table("t").weight[0]) == 123.0  # ...of one memory
    second.delete("t")
    with pytest.raises(NotFoundError):
        first.lookup("t", ids)
    first.create("t", TableSpec(CONFIG, OptimizerConfig()))  # same name, new table
    assert second.version("t") == 0 and second.table("t").optimizer.name == "sgd"
    assert float(second.table("t").weight[0]) != 123.0
    first.close()
    second.close()


def test_update_waiting_for_a_deleted_table_answers_not_found(
    settings: Settings, directory: SharedDirectory
) -> None:
    store = TableStore(directory, settings, NullJournal())
    store.create("t", TableSpec(CONFIG, OptimizerConfig()))
    entry = store.registry.entries["t"]
    entry.counters[1] = 1  # what delete() sets under the lock before unregistering (state: deleted)
    with pytest.raises(NotFoundError):
        store.update("t", torch.tensor([1]), torch.zeros(1, 8))
    store.close()


class RecordingJournal(NullJournal):
    """Checks the hook order: append sees the table *before* the update is applied."""

    def __init__(self, fail_append: bool = False) -> None:
        self.records: list[UpdateRecord] = []
        self.events: list[tuple[str, str, int]] = []
        self.weights_at_append: list[torch.Tensor] = []
        self.fail_append = fail_append
        self.store: TableStore | None = None

    def create(self, name: str, table: Table, version: int) -> None:
        self.events.append(("create", name, version))

    def append(self, record: UpdateRecord) -> int:
        assert self.store is not None
        self.weights_at_append.append(self.store.table(record.table).weight.clone())
        if self.fail_append:
            raise OSError("disk full")
        self.records.append(record)
        return 0

    def snapshot(self, name: str, table: Table, version: int) -> None:
        self.events.append(("snapshot", name, version))

    def drop(self, name: str) -> None:
        self.events.append(("drop", name, -1))


def test_journal_hook_order_and_records(settings: Settings, directory: SharedDirectory) -> None:
    journal = RecordingJournal()
    store = TableStore(directory, settings, journal)
    journal.store = store
    store.create("t", TableSpec(CONFIG, OptimizerConfig()))
    before = store.table("t").weight.clone()
    ids, grads = torch.tensor([3, 3]), torch.ones(2, 8)
    store.update("t", ids, grads, lr=0.5)
    (record,) = journal.records
    assert (record.table, record.version, record.lr) == ("t", 1, 0.5)
    assert torch.equal(record.ids, ids) and torch.equal(record.grads, grads)
    assert torch.equal(journal.weights_at_append[0], before)  # appended before applying
    assert not torch.equal(store.table("t").weight, before)
    store.update("t", ids, grads)
    assert journal.records[-1].lr == CONFIG_LR and journal.records[-1].version == 2
    assert store.snapshot("t") == 2
    store.delete("t")
    assert journal.events == [("create", "t", 0), ("snapshot", "t", 2), ("drop", "t", -1)]
    store.close()


CONFIG_LR = OptimizerConfig().lr


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_small_updates_without_a_journal_match_the_journalled_path(
    settings: Settings, directory: SharedDirectory, optimizer: str
) -> None:
    # NullJournal: small updates are checked and applied in one compiled call (_apply_unjournalled);
    # RecordingJournal (a subclass that sees every append) keeps the general path.
    fast = TableStore(directory, settings, NullJournal())
    journal = RecordingJournal()
    general = journal.store = TableStore(directory, settings, journal)
    spec = TableSpec(CONFIG, OptimizerConfig(optimizer))  # type: ignore[arg-type]
    fast.create("fast", spec)
    general.create("general", spec)
    generator = torch.Generator().manual_seed(5)
    for version, size in enumerate([1, 3, 8, 64, 65], start=1):  # 65 ids: the general path in both
        ids = torch.randint(0, 100, (size,), generator=generator)
        grads = torch.randn(size, 8, generator=generator)
        lr = 0.02 if version % 2 else None
        if version % 2:  # the route's numpy arrays, or tensors
            assert fast.update("fast", ids.numpy(), grads.numpy(), lr).version == version
        else:
            assert fast.update("fast", ids, grads, lr).version == version
        assert general.update("general", ids, grads, lr).version == version
        for key, tensor in general.table("general").tensors().items():
            assert torch.equal(fast.table("fast").tensors()[key], tensor), key
    before = {key: tensor.clone() for key, tensor in fast.table("fast").tensors().items()}
    nan_grads = torch.ones(2, 8)
    nan_grads[0, 3] = float("nan")
    refused = [
        (nan_grads, None, "NaN or Inf"),
        (torch.full((2, 8), 3e38), 1000.0, "non-finite"),
        (torch.ones(2, 8), 1e6, "max_lr"),
        (torch.ones(2, 7), None, "shape"),
    ]
    for grads, lr, message in refused:
        with pytest.raises(InvalidInputError, match=message):
            fast.update("fast", torch.tensor([1, 2]), grads, lr)
    assert fast.version("fast") == 5
    for key, tensor in fast.table("fast").tensors().items():
        assert torch.equal(tensor, before[key]), key
    fast.close()
    general.close()


def test_failed_append_changes_nothing(settings: Settings, directory: SharedDirectory) -> None:
    journal = RecordingJournal(fail_append=True)
    store = TableStore(directory, settings, journal)
    journal.store = store
    store.create("t", TableSpec(CONFIG, OptimizerConfig("adam")))
    before = {k: t.clone() for k, t in store.table("t").tensors().items()}
    with pytest.raises(OSError):
        store.update("t", torch.tensor([1]), torch.ones(1, 8))
    assert store.version("t") == 0
    for key, tensor in store.table("t").tensors().items():
        assert torch.equal(tensor, before[key])
    # The lock was released: the next update goes through.
    journal.fail_append = False
    assert store.update("t", torch.tensor([1]), torch.ones(1, 8)).version == 1
    store.close()


class LoadingJournal(NullJournal):
    def __init__(self, tables: dict[str, tuple[Table, int]]) -> None:
        self.tables = tables

    def names(self) -> list[str]:
        return sorted(self.tables)

    def load(self, name: str) -> tuple[Table, int] | None:
        return self.tables.get(name)

    def stored_spec(self, name: str) -> tuple[TableConfig, OptimizerConfig] | None:
        found = self.tables.get(name)
        return None if found is None else (found[0].config, found[0].optimizer)


def test_prepare_loads_journal_tables_then_the_tables_file(tmp_path: Path) -> None:
    saved = Table(CONFIG, OptimizerConfig("adagrad"))
    saved.apply_gradients(torch.tensor([1, 2]), torch.ones(2, 8))
    tables_file = tmp_path / "tables.toml"
    tables_file.write_text(
        "[tables.users]\nnum_embeddings = 100\nembedding_dim = 8\nmemory_size = 1024\nchunk_size = 4\n"
        '[tables.users.optimizer]\nname = "adagrad"\n'
        "[tables.items]\nnum_embeddings = 50\nembedding_dim = 16\nmemory_size = 2048\n"
    )
    settings = make_settings(tmp_path, config=tables_file)
    directory = TableStore.prepare(settings, LoadingJournal({"users": (saved, 7)}))
    try:
        store = TableStore(directory, settings, NullJournal())
        assert store.names() == ["items", "users"]  # no demo: a tables file was given
        assert store.version("users") == 7
        for key, tensor in saved.tensors().items():
            assert torch.equal(store.table("users").tensors()[key], tensor)
        assert store.table("items").config.chunk_size == 32
        store.close()
    finally:
        directory.remove()
    conflicting = make_settings(tmp_path, config=tables_file)
    other = Table(TableConfig(num_embeddings=100, embedding_dim=8, memory_size=1024, chunk_size=8))
    with pytest.raises(ValueError, match="different config"):
        TableStore.prepare(conflicting, LoadingJournal({"users": (other, 1)}))
    assert not list((tmp_path / "shm").glob("robez-*"))  # a failed prepare leaves nothing behind


def test_shared_arrays_refused_with_a_durable_journal(settings: Settings, directory: SharedDirectory) -> None:
    class DurableJournal:  # any journal that is not the in-memory NullJournal
        def create(self, name: str, table: Table, version: int) -> None:
            pass

        def close(self) -> None:
            pass

    store = TableStore(directory, settings, DurableJournal())  # type: ignore[arg-type]
    store.create("a", TableSpec(CONFIG, OptimizerConfig()))
    with pytest.raises(ValueError, match="share_array_with"):
        store.create("b", TableSpec(CONFIG, OptimizerConfig(), share_array_with="a"))
    with pytest.raises(ConflictError):
        store.create("a", TableSpec(CONFIG, OptimizerConfig()))
    with pytest.raises(InvalidInputError):
        store.create("../a", TableSpec(CONFIG, OptimizerConfig()))
    store.close()


def test_stale_directories_of_dead_servers_are_removed(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    stale, alive = tmp_path / f"robez-{dead_pid}-aaaa", tmp_path / f"robez-{os.getpid()}-bbbb"
    for path, pid in ((stale, dead_pid), (alive, os.getpid())):
        path.mkdir()
        (path / "owner.pid").write_text(str(pid))
    assert remove_stale_directories(tmp_path) == [stale]
    assert alive.exists() and not stale.exists()


def test_concurrent_updates_through_two_workers_are_serialised(
    settings: Settings, directory: SharedDirectory
) -> None:
    import threading

    workers = [TableStore(directory, settings, NullJournal()) for _ in range(2)]
    workers[0].create("t", TableSpec(CONFIG, OptimizerConfig("sgd", lr=1.0)))
    start = workers[0].table("t").weight.clone()
    ids = torch.arange(64) % 5  # few ids: every update touches the same locations
    grads = torch.full((64, 8), 0.25)  # exact in float32, so the order of updates cannot matter
    updates_per_thread, threads = 10, []
    for store in workers:
        for _ in range(2):
            thread = threading.Thread(
                target=lambda s=store: [s.update("t", ids, grads) for _ in range(updates_per_thread)]
            )
            threads.append(thread)
            thread.start()
    for thread in threads:
        thread.join(timeout=120)
        assert not thread.is_alive()
    total = updates_per_thread * len(threads)
    assert workers[1].version("t") == total
    reference = Table(CONFIG, OptimizerConfig("sgd", lr=1.0), weight=start)
    for _ in range(total):
        reference.apply_gradients(ids, grads)
    assert torch.equal(workers[0].table("t").weight, reference.weight)
    for store in workers:
        store.close()


def test_a_create_failing_after_the_journal_leaves_nothing_on_disk(
    settings: Settings, directory: SharedDirectory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = WalJournal(tmp_path / "data")
    store = TableStore(directory, settings, journal)

    def full_tmpfs(registry: object) -> None:
        raise OSError("no space left on device")

    monkeypatch.setattr(store.directory, "write_registry", full_tmpfs)
    with pytest.raises(OSError, match="no space"):
        store.create("t", TableSpec(CONFIG, OptimizerConfig()))
    monkeypatch.undo()
    assert journal.names() == [] and store.names() == []
    assert not list(store.directory.arrays_dir.iterdir())
    # The name is free again, in memory and on disk.
    store.create("t", TableSpec(CONFIG, OptimizerConfig()))
    assert journal.names() == ["t"]
    store.close()
    journal.close()


def _loaded(config: TableConfig, optimizer: OptimizerConfig, seed: int) -> Table:
    """A private table of the same kind as the served one, with other values: what a load brings."""
    table = Table(config, optimizer)
    generator = torch.Generator().manual_seed(seed)
    for tensor in table.tensors().values():
        if tensor.is_floating_point():
            tensor.copy_(torch.rand(tensor.shape, generator=generator) + 10.0)  # far from the old rows
    return table


def test_a_lookup_in_flight_during_a_load_finishes_on_the_old_array(
    settings: Settings, directory: SharedDirectory, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    loader, reader = (TableStore(directory, settings, NullJournal()) for _ in range(2))
    loader.create("t", TableSpec(CONFIG, OptimizerConfig("adagrad")))
    ids = torch.arange(40)
    loader.update("t", ids[:5], torch.ones(5, 8))
    old_rows = torch.from_numpy(reader.lookup("t", ids).rows)
    old_array = reader.info("t").array
    hashed, go = threading.Event(), threading.Event()
    real_gather = SmallPath.gather  # 40 ids: Table.lookup_timed takes the small-batch path

    def gather_after_the_load(small: SmallPath, offsets: np.ndarray) -> np.ndarray:
        if not hashed.is_set():  # the first lookup stops between hash and gather, as if descheduled
            hashed.set()
            assert go.wait(timeout=30)
        return real_gather(small, offsets)

    monkeypatch.setattr(SmallPath, "gather", gather_after_the_load)
    in_flight: list[object] = []
    thread = threading.Thread(target=lambda: in_flight.append(reader.lookup("t", ids)))
    thread.start()
    assert hashed.wait(timeout=30)
    new_table = _loaded(CONFIG, OptimizerConfig("adagrad"), seed=1)
    loader.restore("t", new_table, 0)
    # After the load: only the new table, through either worker.
    after = reader.lookup("t", ids)
    assert after.version == 0 and torch.equal(torch.from_numpy(after.rows), new_table.lookup(ids))
    assert torch.equal(loader.table("t").state["sum"], new_table.state["sum"])
    go.set()
    thread.join(timeout=30)
    assert not thread.is_alive()
    (result,) = in_flight
    assert isinstance(result, LookupResult)
    assert result.version == 1 and torch.equal(
        torch.from_numpy(result.rows), old_rows
    )  # the old array, whole
    # The old array's files are gone (its mapping lived only as long as the lookup's reference).
    assert reader.info("t").array != old_array
    assert not list(directory.arrays_dir.glob(f"{old_array}.*"))
    assert old_array not in reader.registry.arrays and old_array not in loader.registry.arrays
    loader.close()
    reader.close()


def test_an_update_waiting_for_a_load_is_applied_to_the_loaded_table(
    settings: Settings, directory: SharedDirectory
) -> None:
    import threading

    class SlowSnapshot(NullJournal):
        def __init__(self) -> None:
            self.entered, self.go = threading.Event(), threading.Event()

        def snapshot(self, name: str, table: Table, version: int) -> None:
            self.entered.set()
            assert self.go.wait(timeout=30)

    journal = SlowSnapshot()
    loader, writer = TableStore(directory, settings, journal), TableStore(directory, settings, NullJournal())
    loader.create("t", TableSpec(CONFIG, OptimizerConfig("sgd", lr=0.5)))
    writer.refresh()
    stale = writer.registry.entries["t"]
    new_table = _loaded(CONFIG, OptimizerConfig("sgd", lr=0.5), seed=2)
    expected = _loaded(CONFIG, OptimizerConfig("sgd", lr=0.5), seed=2)
    ids, grads = torch.tensor([1, 2, 3]), torch.ones(3, 8)
    expected.apply_gradients(ids, grads)
    load = threading.Thread(target=lambda: loader.restore("t", new_table, 0))
    load.start()
    assert journal.entered.wait(timeout=30)  # the load holds the update lock now
    versions: list[int] = []
    update = threading.Thread(target=lambda: versions.append(writer.update("t", ids, grads).version))
    update.start()
    for _ in range(3000):  # until the update waits for the lock (its thread lock taken, flock pending)
        if stale.lock._thread_lock.locked():
            break
        time.sleep(0.01)
    assert stale.lock._thread_lock.locked()
    journal.go.set()
    for thread in (load, update):
        thread.join(timeout=30)
        assert not thread.is_alive()
    assert versions == [1]
    assert int(stale.counters[1]) == 2  # replaced: an update holding it starts again
    assert torch.equal(writer.table("t").weight, expected.weight)
    assert writer.version("t") == 1
    loader.close()
    writer.close()


def test_a_load_that_cannot_be_made_durable_changes_nothing(
    settings: Settings, directory: SharedDirectory
) -> None:
    class FullDisk(NullJournal):
        def snapshot(self, name: str, table: Table, version: int) -> None:
            raise OSError(28, "No space left on device")

    store = TableStore(directory, settings, FullDisk())
    store.create("t", TableSpec(CONFIG, OptimizerConfig("adam")))
    store.update("t", torch.tensor([4]), torch.ones(1, 8))
    before = {key: t.clone() for key, t in store.table("t").tensors().items()}
    arrays = sorted(path.name for path in directory.arrays_dir.iterdir())
    with pytest.raises(OSError):
        store.restore("t", _loaded(CONFIG, OptimizerConfig("adam"), seed=3), 0)
    assert store.version("t") == 1
    for key, tensor in store.table("t").tensors().items():
        assert torch.equal(tensor, before[key])
    assert sorted(path.name for path in directory.arrays_dir.iterdir()) == arrays
    assert store.update("t", torch.tensor([4]), torch.ones(1, 8)).version == 2  # the lock was released
    store.close()


def test_a_load_switches_every_table_sharing_the_array(
    settings: Settings, directory: SharedDirectory
) -> None:
    store = TableStore(directory, settings, NullJournal())
    store.create("a", TableSpec(CONFIG, OptimizerConfig()))
    store.create("b", TableSpec(CONFIG, OptimizerConfig(), share_array_with="a"))
    store.update("b", torch.tensor([1]), torch.ones(1, 8))
    new_table = _loaded(CONFIG, OptimizerConfig(), seed=4)
    store.restore("a", new_table, 0)
    assert store.info("a").array == store.info("b").array
    assert store.info("a").array_tables == ("a", "b")
    assert (store.version("a"), store.version("b")) == (0, 1)
    assert torch.equal(store.table("b").weight, new_table.weight)
    # Still one update lock for the shared array: updates through both names go to the new array.
    store.update("b", torch.tensor([2]), torch.ones(1, 8))
    store.update("a", torch.tensor([2]), torch.ones(1, 8))
    assert torch.equal(store.table("a").weight, store.table("b").weight)
    store.delete("a")
    assert store.names() == ["b"] and len(list(directory.locks_dir.iterdir())) == 1
    store.delete("b")
    assert not list(directory.locks_dir.iterdir()) and not list(directory.arrays_dir.iterdir())
    store.close()


def test_an_interval_update_waits_for_its_flush_without_holding_the_lock(
    settings: Settings, directory: SharedDirectory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    import service.wal.appender

    entered, released = threading.Event(), threading.Event()

    def held_sync(fd: int) -> None:
        entered.set()
        assert released.wait(timeout=30)

    journal = WalJournal(tmp_path / "data", fsync="interval", fsync_interval_ms=5.0)
    store = TableStore(directory, settings, journal)
    store.create("t", TableSpec(CONFIG, OptimizerConfig()))
    monkeypatch.setattr(service.wal.appender, "sync_data", held_sync)
    versions: list[int] = []
    writer = threading.Thread(
        target=lambda: versions.append(store.update("t", torch.tensor([1]), torch.ones(1, 8)).version)
    )
    writer.start()
    try:
        assert entered.wait(timeout=30)
        # The writer is waiting for its flush, and the table's lock is free meanwhile: the next writers
        # (here a snapshot's exclusive hold) get in and would share the next flush.
        with store.exclusive("t") as (_, version):
            assert version == 1
        assert not versions and writer.is_alive()  # no response before the record is on disk
    finally:
        released.set()
        writer.join(timeout=30)
    assert versions == [1]
    store.close()
    journal.close()


def test_lookups_during_repeated_loads_see_one_table_or_the_other_never_a_mix(
    settings: Settings, directory: SharedDirectory
) -> None:
    import threading

    loader, reader = (TableStore(directory, settings, NullJournal()) for _ in range(2))
    big = TableConfig(num_embeddings=100_000, embedding_dim=8, memory_size=1 << 20, chunk_size=4)
    loader.create("t", TableSpec(big, OptimizerConfig()))
    checkpoints = [_loaded(big, OptimizerConfig(), seed) for seed in (5, 6)]
    ids = torch.arange(0, 100_000, 11)
    expected = [checkpoint.lookup(ids) for checkpoint in checkpoints]
    loader.restore("t", checkpoints[0], 0)
    done = threading.Event()
    seen: list[int] = []
    failures: list[str] = []

    def look() -> None:
        for _ in range(5000):  # bounded; stops once the loads are done
            rows = torch.from_numpy(reader.lookup("t", ids).rows)
            matches = [index for index, want in enumerate(expected) if torch.equal(rows, want)]
            if len(matches) != 1:
                failures.append("a lookup returned rows of neither checkpoint")
                return
            seen.append(matches[0])
            if done.is_set():
                return

    thread = threading.Thread(target=look)
    thread.start()
    try:
        for load in range(1, 400):  # until the reader has looked up often enough while loads ran
            loader.restore("t", checkpoints[load % 2], 0)
            if (len(seen) >= 100 and load >= 20) or failures:
                break
    finally:
        done.set()
        thread.join(timeout=60)
    assert not thread.is_alive() and not failures and seen
    assert not list(directory.arrays_dir.glob("*.weight"))[1:]  # one array left: the others were freed
    loader.close()
    reader.close()


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_writer_that_died_mid_update_is_repaired_by_the_next_one(tmp_path: Path, optimizer: str) -> None:
    """Worker A dies holding the update lock: record 3 appended, half of it applied, counter still 2. The
    next writer (worker B) must put the table back at version 2 and cut record 3 before it appends its
    own version 3; the data directory then replays to exactly the acknowledged updates."""

    settings = make_settings(tmp_path, default_table=False, data_dir=tmp_path / "data")
    journal_a, journal_b = WalJournal(settings.data_dir), WalJournal(settings.data_dir)
    directory = TableStore.prepare(settings, journal_a)
    worker_a = TableStore(directory, settings, journal_a)
    worker_b = TableStore(directory, settings, journal_b)
    try:
        worker_a.create("t", TableSpec(CONFIG, OptimizerConfig(optimizer, lr=0.1)))  # type: ignore[arg-type]
        oracle = Table(CONFIG, OptimizerConfig(optimizer, lr=0.1))  # type: ignore[arg-type]
        generator = torch.Generator().manual_seed(1)
        acknowledged = []
        for worker in (worker_a, worker_b):
            ids = torch.randint(0, 100, (6,), generator=generator)
            grads = torch.randn(6, 8, generator=generator)
            assert worker.update("t", ids, grads).version == len(acknowledged) + 1
            acknowledged.append((ids, grads))

        entry = worker_a.registry.entry("t")
        dead_ids, dead_grads = torch.arange(10, 16), torch.full((6, 8), 100.0)
        with entry.lock.hold():  # what worker A did before it was killed; the kernel then drops the flock
            entry.set_pending(3)
            journal_a.append(UpdateRecord("t", 3, dead_ids, dead_grads, 0.1))
            entry.table.apply_gradients(dead_ids[:3], dead_grads[:3])
        assert worker_b.version("t") == 2

        ids = torch.randint(0, 100, (6,), generator=generator)
        grads = torch.randn(6, 8, generator=generator)
        assert worker_b.update("t", ids, grads).version == 3
        acknowledged.append((ids, grads))
        for ids, grads in acknowledged:
            oracle.apply_gradients(ids, grads)
        for key, tensor in oracle.tensors().items():
            assert torch.equal(worker_a.table("t").tensors()[key], tensor), key
        loaded = WalJournal(settings.data_dir).load("t")
        assert loaded is not None and loaded[1] == 3
        for key, tensor in oracle.tensors().items():
            assert torch.equal(loaded[0].tensors()[key], tensor), key
    finally:
        worker_a.close()
        worker_b.close()
        journal_a.close()
        journal_b.close()
        directory.remove()


def test_a_worker_that_died_in_the_middle_of_a_snapshot_loses_no_later_update(tmp_path: Path) -> None:
    """Worker B dies after committing a snapshot's meta.json and before swapping the fresh log in. Worker A
    still holds the old log open: its next update must go to the committed generation's log, or the
    restart would discard it with the stale log."""
    from service.shm import EXCLUSIVE as _EXCLUSIVE

    settings = make_settings(tmp_path, default_table=False, data_dir=tmp_path / "data")
    journal_a, journal_b = WalJournal(settings.data_dir), WalJournal(settings.data_dir)
    directory = TableStore.prepare(settings, journal_a)
    worker_a = TableStore(directory, settings, journal_a)
    worker_b = TableStore(directory, settings, journal_b)
    try:
        worker_a.create("t", TableSpec(CONFIG, OptimizerConfig("adagrad", lr=0.1)))
        oracle = Table(CONFIG, OptimizerConfig("adagrad", lr=0.1))
        for worker in (worker_a, worker_b, worker_a):  # worker A keeps the log open
            ids, grads = torch.tensor([1, 2, 3]), torch.randn(3, 8)
            worker.update("t", ids, grads)
            oracle.apply_gradients(ids, grads)

        entry = worker_b.registry.entry("t")
        meta = journal_b._require_meta("t")
        with entry.lock.hold():  # worker B's snapshot, up to its commit; then it is killed
            entry.set_pending(_EXCLUSIVE)
            journal_b._write_generation(tmp_path / "data" / "t", entry.table, 3, meta.generation + 1)

        ids, grads = torch.tensor([4, 5]), torch.randn(2, 8)
        assert worker_a.update("t", ids, grads).version == 4
        oracle.apply_gradients(ids, grads)
        # The repair swapped the committed generation's log in; the snapshot it replaced is not needed.
        committed = journal_a._require_meta("t").snapshot
        files = sorted(path.name for path in (tmp_path / "data" / "t").iterdir())
        assert files == sorted([META_FILE, committed, LOG_FILE])
        loaded = WalJournal(settings.data_dir).load("t")
        assert loaded is not None and loaded[1] == 4
        for key, tensor in oracle.tensors().items():
            assert torch.equal(loaded[0].tensors()[key], tensor), key
    finally:
        worker_a.close()
        worker_b.close()
        journal_a.close()
        journal_b.close()
        directory.remove()


def test_a_load_that_failed_after_its_commit_is_written_back_by_the_next_holder(tmp_path: Path) -> None:
    """The load's snapshot committed (meta.json) and then failed (EIO on the log's rename, say): the
    workers still serve the old table, the data directory holds the new one. The load keeps its mark,
    so the next update first writes the old table back; before, that update was refused (version gap)."""
    import errno

    class FailsAfterCommit(WalJournal):
        fail = True

        def snapshot(self, name: str, table: Table, version: int) -> None:
            super().snapshot(name, table, version)
            if self.fail:
                self.fail = False
                raise OSError(errno.EIO, "Input/output error")

    settings = make_settings(tmp_path, default_table=False, data_dir=tmp_path / "data")
    journal = FailsAfterCommit(tmp_path / "data")
    directory = TableStore.prepare(settings, journal)
    store = TableStore(directory, settings, journal)
    try:
        store.create("t", TableSpec(CONFIG, OptimizerConfig("adagrad", lr=0.1)))
        oracle = Table(CONFIG, OptimizerConfig("adagrad", lr=0.1))
        for ids in (torch.tensor([1, 2]), torch.tensor([3])):
            grads = torch.ones(int(ids.shape[0]), 8)
            store.update("t", ids, grads)
            oracle.apply_gradients(ids, grads)
        new_table = _loaded(CONFIG, OptimizerConfig("adagrad", lr=0.1), seed=4)
        with pytest.raises(OSError, match="Input/output"):
            store.restore("t", new_table, 0)
        assert store.version("t") == 2 and torch.equal(store.table("t").weight, oracle.weight)  # served: old
        on_disk = WalJournal(tmp_path / "data").load("t")
        assert on_disk is not None and torch.equal(on_disk[0].weight, new_table.weight)  # on disk: new
        ids, grads = torch.tensor([4, 5]), torch.ones(2, 8)
        assert store.update("t", ids, grads).version == 3
        oracle.apply_gradients(ids, grads)
        loaded = WalJournal(tmp_path / "data").load("t")
        assert loaded is not None and loaded[1] == 3
        for key, tensor in oracle.tensors().items():
            assert torch.equal(loaded[0].tensors()[key], tensor), key
    finally:
        store.close()
        journal.close()
        directory.remove()


@pytest.mark.parametrize(
    "ids, grads, lr, reason",
    [
        ([1, 2], torch.ones(2, 8), -5.0, "bad_lr"),
        ([1, 2], torch.ones(2, 8), float("nan"), "bad_lr"),
        ([1, 2], torch.ones(2, 8), float("inf"), "bad_lr"),
        ([1, 2], torch.ones(2, 8), 1e9, "bad_lr"),  # over max_lr
        ([1, 2], torch.ones(2, 7), 0.1, "bad_grads"),
        ([1, 2], torch.tensor([[float("inf")] * 8, [0.0] * 8]), 0.1, "bad_grads"),
        (list(range(300)), torch.full((300, 8), float("nan")), 0.1, "bad_grads"),  # the general path
        ([1, 2], torch.full((2, 8), 3e38), 1000.0, "non_finite_step"),
    ],
)
def test_a_logged_update_that_fails_a_check_is_an_empty_version(
    settings: Settings,
    directory: SharedDirectory,
    ids: list[int],
    grads: torch.Tensor,
    lr: float,
    reason: str,
) -> None:
    """The replicated apply never raises for an entry's content: it advances the version and changes
    nothing, with the check that failed as the reason; the same push live is refused (422)."""
    store = TableStore(directory, settings, NullJournal())
    store.create("t", TableSpec(CONFIG, OptimizerConfig("sgd")))
    store.update("t", torch.tensor([3]), torch.ones(1, 8))
    before = store.checksum("t")[1]
    id_tensor = torch.tensor(ids, dtype=torch.int64)
    with pytest.raises(InvalidInputError):
        store.validate_update("t", id_tensor, grads, lr)
    result = store.apply(UpdateRecord("t", 2, id_tensor, grads, lr))
    assert isinstance(result, SkippedRecord) and result.reason == reason, result
    assert store.checksum("t") == (2, before)
    applied = store.apply(UpdateRecord("t", 3, torch.tensor([4]), torch.ones(1, 8), 0.1))
    assert applied is not None and not isinstance(applied, SkippedRecord)
    assert store.checksum("t")[0] == 3 and store.checksum("t")[1] != before


def test_create_and_restore_from_a_checkpoint_file(
    settings: Settings, directory: SharedDirectory, tmp_path: Path
) -> None:
    """A checkpoint file read straight into shared memory (a replica's bootstrap): the same bytes at the
    given version; a damaged file creates nothing and leaves no array behind; a restore switches to it."""
    store = TableStore(directory, settings, NullJournal())
    source = Table(CONFIG, OptimizerConfig("adam"))
    source.apply_gradients(torch.tensor([1, 2, 2]), torch.randn(3, 8))
    path = tmp_path / "t.safetensors"
    source.save(path)
    store.create_from_file("t", path, 7)
    assert store.version("t") == 7
    assert all(torch.equal(store.table("t").tensors()[k], v) for k, v in source.tensors().items())

    arrays = sorted(directory.arrays_dir.iterdir())
    damaged = tmp_path / "damaged.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 1
    damaged.write_bytes(bytes(data))
    with pytest.raises(CorruptionError, match="checksum"):
        store.create_from_file("u", damaged, 1)
    assert "u" not in store.names() and sorted(directory.arrays_dir.iterdir()) == arrays

    source.apply_gradients(torch.tensor([3]), torch.randn(1, 8))
    source.save(path)
    store.restore_from_file("t", path, 9)
    assert store.version("t") == 9
    assert all(torch.equal(store.table("t").tensors()[k], v) for k, v in source.tensors().items())
    store.close()
