"""kill -9 a worker in the middle of a load or a delete, at each point where it has changed something.

The dying worker is a real process (a script run in a fork of a process that imported robez once,
``tests/service/forked.py``) attached to the test's shared directory and data directory, with the fault
file naming the point (service/faults.py): it SIGKILLs itself there, holding the table's update lock and
the registry lock, which the kernel releases. The test process is the surviving worker. Checked at each
point:

- what a restart of the whole server right after the kill serves (``WalJournal.load`` on a copy of the
  data directory, as ``robez serve`` does at start-up): the load or delete happened or not (it was never
  acknowledged, either is right), and nothing acknowledged before it is lost;
- what the surviving worker serves: the table as the dead worker left it published (old before the
  registry switch, new after), and its next updates are acknowledged on that table;
- that the data directory then recovers to exactly what the workers serve (bitwise, same version), and
  the shared-memory files the dead worker left behind are gone;
- that the data directory holds nothing stale after the repair, nor after a start-up: no older snapshot,
  no table folder a drop renamed aside.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import httpx
import pytest
import torch

from robez_core.config import OptimizerConfig, TableConfig
from robez_core.errors import BusyError, ConflictError, NotFoundError
from robez_core.table import Table
from service.config import Settings, TableSpec
from service.log.journal import NullJournal
from service.log.state_digest import digest_of_table
from service.shm import REPLACED, STATE, SharedDirectory
from service.store import TableStore
from service.wal import LOG_FILE, META_FILE, WalJournal
from service.wal.files import lock_data_dir

from ..conftest import make_settings
from ..forked import ForkedPython
from ..subprocess_server import RobezServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CONFIG = TableConfig(num_embeddings=1000, embedding_dim=8, memory_size=1024, chunk_size=4)
OPTIMIZER = OptimizerConfig("adam", lr=0.1)
CHILD_SECONDS = 120.0

# The dying worker: attach, then load ``argv[4]`` into table t (or delete t when it is "-"; restore it
# in place at version 7 from the file after "in-place:"); ``argv[2]`` "-": no data directory.
_WORKER = """
import sys
from pathlib import Path
from robez_core.table import Table
from service.config import Settings
from service.faults import Faults
from service.log.journal import NullJournal
from service.shm import SharedDirectory
from service.store import TableStore
from service.wal import WalJournal

shm_path, data_dir, fault, checkpoint = sys.argv[1:]
settings = Settings(
    _env_file=None, shm_dir=Path(shm_path).parent, data_dir=None if data_dir == "-" else data_dir,
    default_table=False, threads_per_worker=1,
)
faults = Faults(die_file=Path(fault))  # the test hook of service/faults.py
journal = NullJournal() if data_dir == "-" else WalJournal.from_settings(settings, faults)
store = TableStore(SharedDirectory(Path(shm_path)), settings, journal, faults)
if checkpoint == "-":
    store.delete("t")
elif checkpoint.startswith("in-place:"):
    store.restore_from_file("t", Path(checkpoint.removeprefix("in-place:")), 7)
else:
    store.restore("t", Table.load(checkpoint), 0)
sys.exit(3)  # the fault did not fire
"""


@dataclass(frozen=True)
class Point:
    """A kill point, what the workers serve after it, and what a restart right after it serves."""

    name: str
    served: str  # "old", "new" or "none" (deleted)
    restarted: str


LOAD_POINTS = [
    Point("load:filled", served="old", restarted="old"),
    Point("snapshot:committed", served="old", restarted="new"),
    Point("load:durable", served="old", restarted="new"),
    Point("load:published", served="new", restarted="new"),
    Point("load:switched", served="new", restarted="new"),
]
DELETE_POINTS = [
    Point("drop:renamed", served="old", restarted="none"),
    Point("delete:dropped", served="old", restarted="none"),
    Point("delete:published", served="none", restarted="none"),
]


@dataclass
class Worker:
    settings: Settings
    journal: WalJournal
    directory: SharedDirectory
    store: TableStore
    forks: ForkedPython  # where the dying worker runs


@pytest.fixture
def worker(tmp_path: Path, forked_python: ForkedPython) -> Iterator[Worker]:
    """The surviving worker, over a data directory; snapshot policies off, so only the test snapshots."""
    settings = make_settings(
        tmp_path,
        default_table=False,
        data_dir=tmp_path / "data",
        snapshot_every_updates=0,
        snapshot_every_seconds=0,
        snapshot_log_ratio=0,
    )
    assert settings.data_dir is not None
    journal = WalJournal(settings.data_dir)
    directory = TableStore.prepare(settings, journal)
    store = TableStore(directory, settings, journal)
    try:
        yield Worker(settings, journal, directory, store, forked_python)
    finally:
        store.close()
        journal.close()
        directory.remove()


def _copy(table: Table) -> Table:
    state = {key: tensor.clone() for key, tensor in table.state.items()}
    return Table(table.config, table.optimizer, weight=table.weight.clone(), state=state)


def _same(left: Table, right: Table) -> bool:
    a, b = left.tensors(), right.tensors()
    return a.keys() == b.keys() and all(
        torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8)) for key in a
    )


def _updates(seed: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, 1000, (5,), generator=generator), torch.randn(5, 8, generator=generator))
        for _ in range(count)
    ]


def _restarted(data_dir: Path, tmp_path: Path) -> tuple[Table, int] | None:
    """Table t as a restart would serve it from ``data_dir``: loaded from a copy (loading cleans up) with
    the journal ``robez serve`` opens (shared); the copy is then left with nothing stale."""
    copy = tmp_path / f"restart-{len(list(tmp_path.glob('restart-*')))}"
    shutil.copytree(data_dir, copy, ignore=shutil.ignore_patterns(".robez*.lock"))
    journal = WalJournal(copy)
    try:
        restarted = journal.load("t") if "t" in journal.names() else None
    finally:
        journal.close()
    _holds_nothing_stale(copy)
    return restarted


def _holds_nothing_stale(data_dir: Path) -> None:
    """The data directory holds its locks and, per table, meta.json, the snapshot it names and the log:
    no older snapshot, no folder a drop renamed aside (``.dropped-*``), no temporary file."""
    for entry in data_dir.iterdir():
        if entry.name.startswith(".robez"):  # the data directory's locks
            continue
        assert not entry.name.startswith("."), f"{entry.name} was left in the data directory"
        snapshot = json.loads((entry / META_FILE).read_text())["snapshot"]
        files = sorted(path.name for path in entry.iterdir())
        assert files == sorted([META_FILE, snapshot, LOG_FILE]), f"{entry.name}: {files}"


def _kill_worker_at(point: str, worker: Worker, tmp_path: Path, checkpoint: str) -> None:
    fault = tmp_path / "fault"
    fault.write_text(point)
    data_dir = str(worker.settings.data_dir or "-")
    argv = [str(worker.directory.path), data_dir, str(fault), checkpoint]
    dead = worker.forks.run(_WORKER, argv, timeout_s=CHILD_SECONDS)
    assert dead.returncode == -signal.SIGKILL, dead.stderr[-3000:]
    assert not fault.exists()


def _shared_files_match_the_registry(directory: SharedDirectory) -> None:
    registry = directory.read_registry()
    arrays = {path.name.split(".", 1)[0] for path in directory.arrays_dir.iterdir()}
    counters = {path.name.split(".", 1)[0] for path in directory.tables_dir.iterdir()}
    locks = {path.name.split(".", 1)[0] for path in directory.locks_dir.iterdir()}
    assert arrays == set(registry.arrays), "a dead worker's arrays were left in shared memory"
    assert counters == {record["uid"] for record in registry.tables.values()}
    assert locks <= {record["lock"] for record in registry.tables.values()}


def _start(worker: Worker) -> tuple[Table, int]:
    """Table t with three acknowledged updates: the oracle and its version."""
    worker.store.create("t", TableSpec(CONFIG, OPTIMIZER))
    oracle = Table(CONFIG, OPTIMIZER)
    for ids, grads in _updates(1, 3):
        worker.store.update("t", ids, grads)
        oracle.apply_gradients(ids, grads)
    assert _same(worker.store.table("t"), oracle)
    return oracle, 3


@pytest.mark.parametrize("point", LOAD_POINTS, ids=lambda point: point.name)
def test_a_worker_killed_in_the_middle_of_a_load(point: Point, worker: Worker, tmp_path: Path) -> None:
    old, old_version = _start(worker)
    loaded, checkpoint = _loaded(tmp_path)
    stale = worker.store.registry.entry("t")  # what an update that resolved t before the kill holds

    _kill_worker_at(point.name, worker, tmp_path, str(checkpoint))

    tables = {"old": (old, old_version), "new": (loaded, 0)}
    _assert_a_restart_serves(tables[point.restarted], worker, tmp_path)

    expected, version = tables[point.served]
    assert worker.store.version("t") == version and _same(worker.store.table("t"), expected)
    expected = _copy(expected)
    for ids, grads in _updates(3, 2):  # the first one takes the lock and finds what the dead worker left
        assert worker.store.update("t", ids, grads).version == version + 1
        expected.apply_gradients(ids, grads)
        version += 1
    assert _same(worker.store.table("t"), expected)
    restarted = _restarted(worker.journal.data_dir, tmp_path)
    assert restarted is not None and restarted[1] == version, "the data directory lost acknowledged updates"
    assert _same(restarted[0], expected), "the data directory holds another table than the workers serve"
    _holds_nothing_stale(worker.journal.data_dir)
    if point.served == "new":
        assert int(stale.counters[STATE]) == REPLACED  # an update holding it would start again on the new
    _shared_files_match_the_registry(worker.directory)


@pytest.mark.parametrize("point", DELETE_POINTS, ids=lambda point: point.name)
def test_a_worker_killed_in_the_middle_of_a_delete(point: Point, worker: Worker, tmp_path: Path) -> None:
    old, version = _start(worker)

    _kill_worker_at(point.name, worker, tmp_path, "-")

    # Killed after the drop's rename, the folder renamed aside is left; a start-up removes it (_restarted).
    dropped = list(worker.journal.data_dir.glob(".dropped-*"))
    assert len(dropped) == (point.name == "drop:renamed"), dropped
    assert _restarted(worker.journal.data_dir, tmp_path) is None  # a restart serves no table t
    if point.served == "none":
        assert worker.store.names() == []
        with pytest.raises(NotFoundError):
            worker.store.update("t", torch.tensor([1]), torch.ones(1, 8))
        # The name is free again; the next delete also removes what the dead one left in shared memory.
        worker.store.create("t", TableSpec(CONFIG, OPTIMIZER))
        worker.store.delete("t")
        assert worker.journal.names() == [] and worker.store.names() == []
        _shared_files_match_the_registry(worker.directory)
        return

    assert worker.store.version("t") == version and _same(worker.store.table("t"), old)
    expected = _copy(old)
    for ids, grads in _updates(3, 2):
        assert worker.store.update("t", ids, grads).version == version + 1
        expected.apply_gradients(ids, grads)
        version += 1
    restarted = _restarted(worker.journal.data_dir, tmp_path)
    assert restarted is not None, "the table is served but a restart would lose it"
    assert restarted[1] == version and _same(restarted[0], expected)
    _holds_nothing_stale(worker.journal.data_dir)  # the repair removed what the drop renamed aside
    worker.store.delete("t")  # and it can still be deleted, for good
    assert _restarted(worker.journal.data_dir, tmp_path) is None and worker.store.names() == []
    _shared_files_match_the_registry(worker.directory)


IN_PLACE_POINTS = [
    Point("snapshot:committed", served="old", restarted="new"),
    Point("restore:durable", served="old", restarted="new"),
    Point("restore:overwriting", served="new", restarted="new"),
]


def _assert_a_restart_serves(table: tuple[Table, int], worker: Worker, tmp_path: Path) -> None:
    """A restart from the data directory alone now serves ``table`` at its version."""
    expected, version = table
    restarted = _restarted(worker.journal.data_dir, tmp_path)
    assert restarted is not None
    assert restarted[1] == version and _same(restarted[0], expected), "a restart now serves another table"


def _loaded(tmp_path: Path) -> tuple[Table, Path]:
    """A table of t's config whose every value differs from t's, saved as a checkpoint to load."""
    loaded = Table(CONFIG, OPTIMIZER)
    generator = torch.Generator().manual_seed(2)
    for tensor in loaded.tensors().values():
        tensor.copy_(torch.rand(tensor.shape, generator=generator) + 10.0)
    checkpoint = tmp_path / "loaded.safetensors"
    loaded.save(checkpoint)
    return loaded, checkpoint


@pytest.mark.parametrize("point", IN_PLACE_POINTS, ids=lambda point: point.name)
def test_a_worker_killed_in_the_middle_of_a_restore_in_place(
    point: Point, worker: Worker, tmp_path: Path
) -> None:
    """``restore_from_file`` (``inplace.py``) killed at each step: before the overwrite the old table
    is served and written back; half way through it the table is refused (never a torn row served)
    until the next holder of the lock rebuilds the new one from the data directory; nothing
    acknowledged is lost and the data directory ends as the workers serve."""
    old, old_version = _start(worker)
    loaded, checkpoint = _loaded(tmp_path)

    _kill_worker_at(point.name, worker, tmp_path, f"in-place:{checkpoint}")

    tables = {"old": (old, old_version), "new": (loaded, 7)}
    _assert_a_restart_serves(tables[point.restarted], worker, tmp_path)

    expected, version = tables[point.served]
    if point.served == "new":  # torn until the next holder of the lock rebuilds it
        assert worker.store.torn("t")
        with pytest.raises(BusyError):
            worker.store.lookup("t", torch.tensor([1, 2]))
    else:
        assert not worker.store.torn("t")
        assert worker.store.version("t") == version and _same(worker.store.table("t"), expected)
    expected = _copy(expected)
    for ids, grads in _updates(3, 2):  # the first one takes the lock and repairs
        assert worker.store.update("t", ids, grads).version == version + 1
        expected.apply_gradients(ids, grads)
        version += 1
    assert not worker.store.torn("t") and _same(worker.store.table("t"), expected)
    restarted = _restarted(worker.journal.data_dir, tmp_path)
    assert restarted is not None and restarted[1] == version, "the data directory lost acknowledged updates"
    assert _same(restarted[0], expected), "the data directory holds another table than the workers serve"
    _holds_nothing_stale(worker.journal.data_dir)
    _shared_files_match_the_registry(worker.directory)


def test_a_restore_in_place_killed_half_way_without_a_data_directory_is_refused_until_restored(
    tmp_path: Path, forked_python: ForkedPython
) -> None:
    """Without a data directory (a replica) nothing can rebuild a torn array: lookups, updates and
    checksums answer 503 (``BusyError``), never the torn rows, until a restore writes it whole again
    (the replica's applier restores its snapshot again, ``_bootstrap``)."""
    settings = make_settings(tmp_path, default_table=False)
    journal = NullJournal()
    directory = TableStore.prepare(settings, journal)
    store = TableStore(directory, settings, journal)
    try:
        worker = Worker(settings, cast(WalJournal, journal), directory, store, forked_python)
        _start(worker)
        loaded, checkpoint = _loaded(tmp_path)
        _kill_worker_at("restore:overwriting", worker, tmp_path, f"in-place:{checkpoint}")
        assert store.torn("t") and store.version("t") == 7
        with pytest.raises(BusyError):
            store.lookup("t", torch.tensor([1, 2]))
        with pytest.raises(BusyError):
            store.update("t", torch.tensor([1]), torch.ones(1, 8))
        with pytest.raises(BusyError):
            store.checksum("t")
        store.restore_from_file("t", checkpoint, 7)
        assert not store.torn("t") and store.version("t") == 7 and _same(store.table("t"), loaded)
        assert store.update("t", torch.tensor([1]), torch.ones(1, 8)).version == 8
        _shared_files_match_the_registry(directory)
    finally:
        store.close()
        directory.remove()


def _digest(table: Table) -> str:
    """What ``GET /v1/tables/{name}/checksum`` answers for a table holding these tensors."""
    return digest_of_table(table)


def _post_update(url: str, ids: torch.Tensor, grads: torch.Tensor) -> httpx.Response:
    body = ids.numpy().astype("<i8").tobytes() + grads.numpy().astype("<f4").tobytes()
    headers = {
        "Content-Type": "application/octet-stream",
        "X-Robez-Shape": f"{ids.shape[0]},{grads.shape[1]}",
        "Connection": "close",  # a fresh connection each: either worker may take it
    }
    return httpx.post(f"{url}/v1/tables/t/update", content=body, headers=headers, timeout=60.0)


@pytest.mark.parametrize("point", ["load:durable", "delete:dropped"])
def test_a_server_whose_worker_died_in_a_load_or_delete_serves_and_recovers_the_acknowledged_table(
    point: str, tmp_path: Path
) -> None:
    """The same through ``robez serve`` with two workers: the worker that takes the load (delete) dies at
    ``point``; the updates acknowledged after it are on the old table, live and after kill -9 of the
    whole server and a restart (equal checksums)."""
    fault = tmp_path / "fault"
    server = RobezServer(
        tmp_path / "server.log",
        ["--data-dir", str(tmp_path / "data"), "--workers", "2"],
        {
            "ROBEZ_SHM_DIR": str(tmp_path / "shm"),
            "ROBEZ_DEFAULT_TABLE": "false",
            "ROBEZ_SNAPSHOT_EVERY_UPDATES": "0",
            "ROBEZ_SNAPSHOT_EVERY_SECONDS": "0",
            "ROBEZ_SNAPSHOT_LOG_RATIO": "0",
            "ROBEZ_FAULT_DIE_AFTER_APPEND": str(fault),
            "ROBEZ_LOG_LEVEL": "warning",
        },
    )
    try:
        server.start()
        table = {"name": "t", "config": CONFIG.to_dict(), "optimizer": OPTIMIZER.to_dict()}
        response = httpx.post(f"{server.url}/v1/tables", json=table, timeout=60.0)
        assert response.status_code == 201, response.text
        expected = Table(CONFIG, OPTIMIZER)
        version = 0
        updates = _updates(4, 6)
        for ids, grads in updates[:3]:
            response = _post_update(server.url, ids, grads)
            assert response.status_code == 200 and response.json()["version"] == version + 1, response.text
            expected.apply_gradients(ids, grads)
            version += 1

        fault.write_text(point)
        loaded = Table(CONFIG, OPTIMIZER)
        loaded.weight.add_(5.0)
        checkpoint = tmp_path / "loaded.safetensors"
        loaded.save(checkpoint)
        try:
            if point.startswith("load"):
                response = httpx.post(
                    f"{server.url}/v1/tables/t/load", content=checkpoint.read_bytes(), timeout=60.0
                )
            else:
                response = httpx.delete(f"{server.url}/v1/tables/t", timeout=60.0)
            assert response.status_code >= 500, response.text
        except httpx.TransportError:
            pass  # the worker died with the connection
        assert not fault.exists(), server.log()[-3000:]

        for ids, grads in updates[3:]:  # the first one repairs: before, it was refused (500)
            response = _post_update(server.url, ids, grads)
            assert response.status_code == 200 and response.json()["version"] == version + 1, response.text
            expected.apply_gradients(ids, grads)
            version += 1
        live = httpx.get(f"{server.url}/v1/tables/t/checksum", timeout=60.0).json()
        assert (live["version"], live["sha256"]) == (version, _digest(expected))
        assert "is written to the data directory again" in server.log()

        server.kill()
        server.start()
        restarted = httpx.get(f"{server.url}/v1/tables/t/checksum", timeout=60.0)
        assert restarted.status_code == 200, "a restart lost the table the workers served"
        assert restarted.json() == live
        server.stop()
    finally:
        server.kill()


def _wait_until_free(data_dir: Path, timeout_s: float = 30.0) -> None:
    """Until no process holds the data directory's lock: the killed workers' descriptors are closed."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fd = lock_data_dir(data_dir, exclusive=True)
        except ConflictError:
            assert time.monotonic() < deadline, "the killed server's workers still hold the directory"
            time.sleep(0.05)
            continue
        if fd is not None:
            os.close(fd)
        return


def test_a_create_killed_half_way_leaves_nothing_after_a_restart(tmp_path: Path) -> None:
    """The worker taking a create dies with the table staged (``create:staged``): nothing was
    acknowledged, so after kill -9 of the server and a restart there is no table "t", its staging folder
    is gone from the data directory, and creating "t" works."""
    fault = tmp_path / "fault"
    data = tmp_path / "data"
    server = RobezServer(
        tmp_path / "server.log",
        ["--data-dir", str(data), "--workers", "2"],
        {
            "ROBEZ_SHM_DIR": str(tmp_path / "shm"),
            "ROBEZ_DEFAULT_TABLE": "false",
            "ROBEZ_FAULT_DIE_AFTER_APPEND": str(fault),
            "ROBEZ_LOG_LEVEL": "warning",
        },
    )
    table = {"name": "t", "config": CONFIG.to_dict(), "optimizer": OPTIMIZER.to_dict()}
    try:
        server.start()
        fault.write_text("create:staged")
        try:
            response = httpx.post(f"{server.url}/v1/tables", json=table, timeout=60.0)
            assert response.status_code >= 500, response.text
        except httpx.TransportError:
            pass  # the worker died with the connection
        assert not fault.exists(), server.log()[-3000:]
        assert [path.name.split("-")[1] for path in data.glob(".creating-*")] == ["t"]

        server.kill()
        _wait_until_free(data)
        server.start()
        assert not list(data.glob(".creating-*")), "the restart left the interrupted create's folder"
        assert httpx.get(f"{server.url}/v1/tables/t", timeout=60.0).status_code == 404
        response = httpx.post(f"{server.url}/v1/tables", json=table, timeout=60.0)
        assert response.status_code == 201, response.text
        server.stop()
    finally:
        server.kill()
