"""A replica's snapshot copy (for an upload, or a local snapshot) runs in the background: its applier
keeps applying pushes while the copy runs (lock-free, ``TableStore.copy_to_file``), and the snapshot is
bitwise the table's state at the version it copied at. In memory: the real apply loop (``_follow``) over
an in-memory log, no NATS, no server process; the copy slowed by ``Faults.slow_seconds``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path

import pytest
import torch

from robez_core.config import OptimizerConfig, TableConfig
from robez_core.table import Table
from service.config import Settings, TableSpec
from service.faults import Faults
from service.log.journal import NullJournal
from service.metrics import Metrics
from service.replication.applier import Applier
from service.replication.log import CatalogEntry, LogEntry, Snapshot
from service.replication.records import encode_update
from service.shm import SharedDirectory
from service.store import TableStore

from ..conftest import make_settings
from .conftest import ADAM, SMALL, push_grads

ENTRY = CatalogEntry("t", SMALL, ADAM, "inc")
SPEC = TableSpec(TableConfig(**SMALL), OptimizerConfig(**ADAM))  # type: ignore[arg-type]
# A pause after each piece of the copy's lock-free pass (one piece per tensor here: adam's four make the
# copy last >= 1.6 s); a push must still be acknowledged well within it.
SLOW_SECONDS = 0.4
ACK_LIMIT_S = 1.0
EVERY = 4  # the snapshot (upload or local) comes due at the 4th push
MAX_PUSHES = 400


class _Lease:
    """An upload lease that keeps what was put: (position, the checkpoint's tensors)."""

    stored_position = 0

    def __init__(self, log: _MemoryLog) -> None:
        self.log = log

    async def put(self, snapshot: Snapshot) -> bool:
        self.log.uploaded.append((snapshot.position, Table.load(snapshot.path).tensors()))
        return True

    async def release(self) -> None:
        self.log.released += 1


class _MemoryLog:
    """What the apply loop and the uploads ask of a ``ReplicatedLog``, in memory: one table's entries."""

    def __init__(self) -> None:
        self.entries: list[LogEntry] = []
        self.arrived = asyncio.Event()
        self.uploaded: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.leases = 0
        self.released = 0

    def append(self, seed: int) -> int:
        ids, grads = push_grads(seed)
        payload, headers = encode_update(ids, grads, ADAM["lr"])  # type: ignore[arg-type]
        position = len(self.entries) + 1
        self.entries.append(LogEntry(position, payload, headers, time.time(), 0))
        self.arrived.set()
        return position

    async def read_batches(self, entry: CatalogEntry, after: int) -> AsyncGenerator[list[LogEntry], None]:
        while True:
            if len(self.entries) > after:
                batch = self.entries[after:]
                after = batch[-1].position
                yield batch
            else:
                self.arrived.clear()
                await self.arrived.wait()

    async def bounds(self, entry: CatalogEntry) -> tuple[int, int]:
        return 1, len(self.entries)

    async def get_snapshot(self, entry: CatalogEntry, directory: Path) -> Snapshot | None:
        return None

    async def snapshot_position(self, entry: CatalogEntry) -> int:
        return 0

    async def lease_snapshot(self, entry: CatalogEntry, holder: str) -> _Lease:
        self.leases += 1
        return _Lease(self)

    async def trim(self, entry: CatalogEntry, below: int) -> None:
        pass


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TableStore]:
    directory = SharedDirectory.create(tmp_path / "shm")
    made = TableStore(directory, make_settings(tmp_path, default_table=False), NullJournal(), Faults())
    yield made
    made.close()
    directory.remove()


def _state_after(pushes: int) -> dict[str, torch.Tensor]:
    """The table's tensors after pushes 1..``pushes``, from a private table (what any replica computes)."""
    table = Table(TableConfig.from_dict(SMALL), OptimizerConfig.from_dict(ADAM))
    for seed in range(1, pushes + 1):
        table.apply_gradients(*push_grads(seed))
    return table.tensors()


def _version_of_snapshot(applier: Applier, log: _MemoryLog) -> int:
    """The version of the snapshot taken (uploaded, or the local one), 0 before there is one."""
    if log.uploaded:
        return log.uploaded[0][0]
    newest = applier.local.newest(ENTRY.name, ENTRY.incarnation) if applier.local is not None else None
    return newest.position if newest is not None else 0


def _assert_bitwise(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key].view(torch.int32), expected[key].view(torch.int32)), key


async def _push_through_a_snapshot(applier: Applier, log: _MemoryLog) -> tuple[list[tuple[float, bool]], int]:
    """Push (each waiting for its apply, as a push's answer does) until the snapshot that comes due at
    the ``EVERY``-th push is done: (seconds to apply and whether a snapshot ran, for each), the last
    position."""
    acks: list[tuple[float, bool]] = []
    position = 0
    task: asyncio.Task[object] | None = None
    while len(acks) < MAX_PUSHES:
        start = time.perf_counter()
        position = log.append(len(acks) + 1)
        await applier.wait_applied(ENTRY.name, position, 10.0)
        assert applier.store.version(ENTRY.name) >= position, "not applied within 10 s"
        acks.append((time.perf_counter() - start, applier._snapshot_running(ENTRY.name)))
        task = applier._snapshot_tasks.get(ENTRY.name) if task is None else task
        if task is not None and task.done():
            break
        await asyncio.sleep(0.02)  # a client's pace
    assert task is not None and task.done(), f"the snapshot did not end within {MAX_PUSHES} pushes"
    task.result()
    return acks, position


@pytest.mark.parametrize("kind", ["upload", "local"])
def test_pushes_are_applied_while_the_snapshot_copy_runs(
    tmp_path: Path, store: TableStore, kind: str
) -> None:
    settings: Settings = make_settings(
        tmp_path,
        default_table=False,
        replica_snapshot_interval_s=0,
        replica_snapshot_every_updates=EVERY if kind == "upload" else 0,
        replica_local_snapshot_every_updates=EVERY if kind == "local" else 0,
        data_dir=tmp_path / "data" if kind == "local" else None,
    )
    log = _MemoryLog()
    applier = Applier(store, settings, Metrics(), log, tmp_path / "replication.json")  # type: ignore[arg-type]
    store.faults.slow_seconds = SLOW_SECONDS

    counters = applier._since_upload if kind == "upload" else applier._since_local

    async def scenario() -> tuple[list[tuple[float, bool]], int]:
        follow = asyncio.create_task(applier._follow(ENTRY))
        try:
            async with asyncio.timeout(60):  # created and its kernels loaded (numba's cache: seconds)
                while not applier._caught_up.get(ENTRY.name):
                    await asyncio.sleep(0.01)
            acks, last = await _push_through_a_snapshot(applier, log)
            # A push is answered from the apply thread; the loop counts it just after.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2):
                    while sum(counters.values()) + _version_of_snapshot(applier, log) < last:
                        await asyncio.sleep(0.01)
            return acks, last
        finally:
            follow.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follow

    acks, last = asyncio.run(scenario())
    store.faults.slow_seconds = 0.0
    slowest = max(seconds for seconds, _ in acks)
    assert slowest < ACK_LIMIT_S, f"a push waited {slowest:.2f} s for its apply (the copy?)"
    during = [seconds for seconds, running in acks if running]
    assert len(during) >= 3, f"only {len(during)} pushes answered while the snapshot ran"
    if kind == "upload":
        assert log.leases == log.released == 1
        ((version, tensors),) = log.uploaded
    else:
        assert applier.local is not None
        snapshot = applier.local.newest(ENTRY.name, ENTRY.incarnation)
        assert snapshot is not None
        version, tensors = snapshot.position, Table.load(snapshot.path).tensors()
    # The copy's version is the one it copied at: past the push that made it due (applied meanwhile).
    assert EVERY < version <= last
    _assert_bitwise(tensors, _state_after(version))
    # The updates in the snapshot (those applied while it was copied too) no longer count toward the
    # next one; one more when the copy's last round took an entry the loop had not counted yet.
    assert last - version <= counters[ENTRY.name] <= last - version + 1


def test_an_upload_cancelled_before_it_starts_releases_its_lease(tmp_path: Path, store: TableStore) -> None:
    """A table dropped (or the replica stopped) right after its upload was started: the task is cancelled
    before its first step, so its own ``finally`` never runs; the lease is released all the same (else
    it would be renewed for as long as the process lives)."""
    store.create(ENTRY.name, SPEC)
    log = _MemoryLog()
    settings = make_settings(tmp_path, default_table=False)
    applier = Applier(store, settings, Metrics(), log, tmp_path / "replication.json")  # type: ignore[arg-type]

    async def scenario() -> None:
        lease = await log.lease_snapshot(ENTRY, "holder")
        await applier._start_upload(ENTRY, lease, 0, also_local=False)
        task = applier._snapshot_tasks[ENTRY.name]
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        async with asyncio.timeout(5):
            while not log.released:
                await asyncio.sleep(0.01)

    asyncio.run(scenario())
    assert log.released == 1
    assert not log.uploaded
