"""The applier takes the entries that have arrived in one pass and answers each waiting push as soon as
its own entry is applied, not when the pass ends; the reader's batch is what is queued, bounded in count
and bytes (in memory: no NATS, no server process)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace

from service.config import Settings
from service.log.entry import SkippedRecord, UpdateRecord
from service.metrics import Metrics
from service.replication.applier import Applier
from service.replication.jetstream import READ_BATCH, READ_BATCH_BYTES, take_queued
from service.replication.log import CatalogEntry, LogEntry
from service.replication.records import decode_entry, encode_update
from service.store import UpdateResult

from .conftest import ADAM, SMALL, push_grads

ENTRY = CatalogEntry("t", SMALL, ADAM, "inc")
_WAIT_S = 10.0


class _Store:
    """Records the versions applied and the thread each was applied on; the entry at ``hold`` waits
    until ``release`` is set."""

    def __init__(self, hold: int) -> None:
        self.applied = 0
        self.threads: list[int] = []
        self.hold = hold
        self.release = threading.Event()

    def apply(self, record: UpdateRecord | SkippedRecord) -> UpdateResult:
        if record.version == self.hold:
            assert self.release.wait(_WAIT_S)
        assert record.version == self.applied + 1
        self.applied = record.version
        self.threads.append(threading.get_ident())
        return UpdateResult(record.version, 0.0, 0.0)

    def version(self, name: str) -> int:
        return self.applied

    def names(self) -> list[str]:
        return [ENTRY.name]


def _entries(count: int) -> list[tuple[LogEntry, UpdateRecord | SkippedRecord]]:
    taken: list[tuple[LogEntry, UpdateRecord | SkippedRecord]] = []
    for position in range(1, count + 1):
        payload, headers = encode_update(*push_grads(position), lr=0.01)
        record = decode_entry(ENTRY.name, position, payload, headers)
        assert isinstance(record, UpdateRecord)
        taken.append((LogEntry(position, payload, headers, 0.0, count - position), record))
    return taken


def test_a_pass_answers_each_push_when_its_entry_is_applied(tmp_path: Path) -> None:
    store = _Store(hold=4)
    settings = Settings(_env_file=None, data_dir=tmp_path / "data")  # type: ignore[call-arg]
    applier = Applier(store, settings, Metrics(), None, tmp_path / "replication.json")  # type: ignore[arg-type]

    async def run() -> None:
        waiting = {
            version: asyncio.create_task(applier.wait_applied(ENTRY.name, version, _WAIT_S))
            for version in (1, 3, 4)
        }
        await asyncio.sleep(0)  # every wait is registered
        passing = asyncio.create_task(applier._apply_updates(ENTRY, _entries(4)))
        # Entries 1..3 are applied while the pass holds entry 4: their pushes are answered meanwhile.
        await asyncio.wait_for(asyncio.gather(waiting[1], waiting[3]), _WAIT_S)
        assert store.applied == 3 and not waiting[4].done() and not passing.done()
        store.release.set()
        await asyncio.wait_for(asyncio.gather(passing, waiting[4]), _WAIT_S)

    asyncio.run(run())
    assert store.applied == 4
    assert len(set(store.threads)) == 1  # one trip to a worker thread for the whole pass


def test_a_wait_for_an_applied_version_returns_at_once_and_a_timed_out_one_is_forgotten(
    tmp_path: Path,
) -> None:
    store = _Store(hold=0)
    store.applied = 2
    settings = Settings(_env_file=None, data_dir=tmp_path / "data")  # type: ignore[call-arg]
    applier = Applier(store, settings, Metrics(), None, tmp_path / "replication.json")  # type: ignore[arg-type]

    async def run() -> None:
        await asyncio.wait_for(applier.wait_applied(ENTRY.name, 2, _WAIT_S), 1.0)
        await applier.wait_applied(ENTRY.name, 3, 0.01)  # not applied: returns after its timeout
        assert store.version(ENTRY.name) == 2
        assert not any(applier._waiters.values())

    asyncio.run(run())


class _Queued:
    """A subscription with ``sizes`` messages queued (payload bytes each), as nats-py's holds them."""

    def __init__(self, sizes: list[int]) -> None:
        self.queue = [SimpleNamespace(data=bytes(size)) for size in sizes]

    @property
    def pending_msgs(self) -> int:
        return len(self.queue)

    async def next_msg(self, timeout: float) -> SimpleNamespace:
        return self.queue.pop(0)


def test_a_batch_takes_what_is_queued_up_to_its_count_and_bytes() -> None:
    async def take(sizes: list[int]) -> tuple[int, int]:
        sub = _Queued(sizes)
        first = await sub.next_msg(0.0)
        return len(await take_queued(sub, first)), sub.pending_msgs

    assert asyncio.run(take([100] * 10)) == (10, 0)  # everything queued, in one batch
    assert asyncio.run(take([100] * 100)) == (READ_BATCH, 100 - READ_BATCH)
    big = 6 << 20  # three of them reach the byte bound; the rest waits for the next batch
    assert READ_BATCH_BYTES <= 3 * big < READ_BATCH_BYTES + big
    assert asyncio.run(take([big] * 5)) == (3, 2)
