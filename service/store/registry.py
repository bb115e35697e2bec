"""``TableRegistry``: the tables of one server as one worker has them mapped, and each table's update lock.

The registry file (``shm.py``) says which tables exist, over which arrays, counters and locks; a
generation counter in shared memory tells a worker that another one changed it. This worker's view (its
``entries``, their arrays and locks) follows the registry on ``refresh``; whoever changes the registry
holds ``lock`` and calls ``publish``. A table's update lock, taken by every change of the table, is
``locked`` / ``exclusive``: the next holder after a worker that died holding it repairs the table first
(``repair.py``, handed in by ``TableStore``). This is what ``admin.py`` and ``repair.py`` use of the store.

Lock order, everywhere: a table's update lock, then ``lock`` (the registry's), then ``_sync_lock``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from robez_core.config import OptimizerConfig, TableConfig
from robez_core.errors import BusyError, NotFoundError
from robez_core.table import Table

from ..shm import (
    DELETED,
    EXCLUSIVE,
    LIVE,
    NUM_COUNTERS,
    REPLACED,
    FileLock,
    Registry,
    SharedArray,
    SharedDirectory,
    TableEntry,
    dtype_from_name,
    shape_numel,
)

# An update or snapshot that finds its table replaced by a load starts again; this many loads in a row
# while it waits means something is wrong.
_MAX_SWITCHES = 16


class TableRegistry:
    """The registry view of one worker and the tables' update locks; safe to call from many threads.

    Args:
        directory: the prepared shared directory.
        repair: called with a table's entry, its lock held, when its last holder died in the middle of a
            change (the entry's ``pending`` mark is set); ``repair.repair`` bound to the store's journal.
    """

    def __init__(self, directory: SharedDirectory, repair: Callable[[TableEntry], None]) -> None:
        self.directory = directory
        self.lock = FileLock(directory.path / "registry.lock")
        self._repair = repair
        self._generation = directory.map("generation", 1, torch.int64)
        self._generation_np = self._generation.numpy()  # read on every request: numpy is cheaper
        self._sync_lock = threading.Lock()
        self._seen_generation = -1
        self.entries: dict[str, TableEntry] = {}
        self.arrays: dict[str, SharedArray] = {}
        self._locks: dict[str, FileLock] = {}
        self.published = Registry()  # the registry as of this view
        self.refresh()

    # -- the view ---------------------------------------------------------------------------------

    def refresh(self) -> None:
        """Map tables created and drop tables deleted by any worker since this worker last looked."""
        generation = int(self._generation_np[0])
        if generation == self._seen_generation:
            return
        with self.lock.hold(), self._sync_lock:
            self._sync(self.directory.read_registry(), int(self._generation[0]))

    def publish(self, registry: Registry) -> None:
        """Write the registry and bump the generation; caller holds ``lock``."""
        self.directory.write_registry(registry)
        generation = int(self._generation[0]) + 1
        self._generation[0] = generation
        with self._sync_lock:
            self._sync(registry, generation)

    def entry(self, name: str) -> TableEntry:
        """The current entry of table ``name`` (``NotFoundError`` if there is none)."""
        self.refresh()
        entry = self.entries.get(name)
        if entry is None:
            raise NotFoundError(f"no table named {name!r}")
        return entry

    def _sync(self, registry: Registry, generation: int) -> None:
        arrays = {aid: a for aid, a in self.arrays.items() if aid in registry.arrays}
        # Kept across a load's switch: the threads of this process must keep excluding each other.
        locks = {lid: lock for lid, lock in self._locks.items() if registry.lock_in_use(lid)}
        entries: dict[str, TableEntry] = {}
        for name, record in registry.tables.items():
            current = self.entries.get(name)
            if current is not None and current.uid == record["uid"]:
                entries[name] = current
                continue
            array_id = record["array"]
            if array_id not in arrays:
                arrays[array_id] = self._map_array(array_id, registry.arrays[array_id])
            array = arrays[array_id]
            config = TableConfig.from_dict(record["config"])
            optimizer = OptimizerConfig.from_dict(record["optimizer"])
            table = Table(config, optimizer, weight=array.weight, state=array.state)
            counters = self.directory.map(f"tables/{record['uid']}.counters", NUM_COUNTERS, torch.int64)
            lock_id = record["lock"]
            if lock_id not in locks:
                locks[lock_id] = FileLock(self.directory.locks_dir / f"{lock_id}.lock")
            entries[name] = TableEntry(name, record["uid"], table, array, locks[lock_id], counters)
        self.arrays, self.entries, self._locks, self.published = arrays, entries, locks, registry
        self._seen_generation = generation

    def _map_array(self, array_id: str, record: dict[str, Any]) -> SharedArray:
        tensors = {
            key: self.directory.map(
                f"arrays/{array_id}.{key}", shape_numel(tuple(shape)), dtype_from_name(dtype)
            ).view(tuple(shape))
            for key, (shape, dtype) in record["layout"].items()
        }
        return SharedArray(array_id, tensors, self.directory.map_marks(array_id, tensors["weight"].numel()))

    # -- a table's update lock, held by every change of a table -----------------------------------

    @contextmanager
    def locked(self, name: str, *, torn_ok: bool = False) -> Iterator[TableEntry]:
        """The table's current entry, its update lock held: no update, snapshot, load or delete of it runs
        meanwhile. An entry a load replaced while this waited for the lock is looked up again; one whose
        last holder died in the middle of an update is repaired first. A table an in-place restore left
        torn (``inplace.py``) is a ``BusyError``, unless ``torn_ok`` (the restore that mends it)."""
        with self.try_locked(name, blocking=True, torn_ok=torn_ok) as entry:
            assert entry is not None
            yield entry

    @contextmanager
    def try_locked(self, name: str, blocking: bool, *, torn_ok: bool = False) -> Iterator[TableEntry | None]:
        """As ``locked``; with ``blocking=False`` None at once when the lock is held elsewhere."""
        entry = self.acquire(name, blocking, torn_ok=torn_ok)
        if entry is None:
            yield None
            return
        try:
            yield entry
        finally:
            entry.lock.release()

    def acquire(self, name: str, blocking: bool, *, torn_ok: bool = False) -> TableEntry | None:
        """``try_locked`` without the context manager (the small-update path, where it costs ~2 us of
        a request): the current entry with its lock taken, which the caller releases
        (``entry.lock.release()``); None at once with ``blocking=False`` when the lock is held elsewhere."""
        for _ in range(_MAX_SWITCHES):
            entry = self.entry(name)
            if not entry.lock.acquire(blocking):
                return None
            try:
                if entry.pending and entry.state == LIVE:
                    self._repair(entry)  # may find the dead holder's load or delete published
                state = entry.state
                if state == DELETED:
                    raise NotFoundError(f"no table named {name!r}")
                if state == LIVE and not torn_ok:
                    refuse_torn(entry)
            except BaseException:
                entry.lock.release()
                raise
            if state != REPLACED:
                return entry
            entry.lock.release()
        raise BusyError(f"table {name!r} was replaced {_MAX_SWITCHES} times in a row; try again")

    def acquire_many(self, names: Sequence[str], blocking: bool) -> list[TableEntry] | None:
        """``acquire`` of several tables at once (a multi-table push): their current entries, in the
        order of ``names``, each lock taken once (tables sharing an array share one) and in one order
        everywhere (by array id), so two pushes over the same tables never wait for each other. The
        caller releases them with ``release_many``. None at once, holding nothing, with
        ``blocking=False`` when a lock is held elsewhere. A table a load replaced meanwhile makes it
        release everything and start again (never a lock taken out of order)."""
        if len(names) == 1:
            entry = self.acquire(names[0], blocking)
            return None if entry is None else [entry]
        for _ in range(_MAX_SWITCHES):
            entries = {name: self.entry(name) for name in names}
            held: list[FileLock] = []
            switched = False
            try:
                for name in sorted(names, key=lambda each: (entries[each].array.array_id, each)):
                    entry = entries[name]
                    if not any(entry.lock is lock for lock in held):
                        if not entry.lock.acquire(blocking):
                            _release(held)
                            return None
                        held.append(entry.lock)
                    if entry.pending and entry.state == LIVE:
                        self._repair(entry)
                    state = entry.state
                    if state == DELETED:
                        raise NotFoundError(f"no table named {name!r}")
                    if state == LIVE:
                        refuse_torn(entry)
                    if state == REPLACED:
                        switched = True
                        break
            except BaseException:
                _release(held)
                raise
            if not switched:
                return [entries[name] for name in names]
            _release(held)
        raise BusyError(f"tables {list(names)} were replaced {_MAX_SWITCHES} times in a row; try again")

    @staticmethod
    def release_many(entries: Sequence[TableEntry]) -> None:
        """Release the locks ``acquire_many`` took (each shared lock once)."""
        held: list[FileLock] = []
        for entry in entries:
            if not any(entry.lock is lock for lock in held):
                held.append(entry.lock)
        _release(held)

    @contextmanager
    def exclusive(self, name: str) -> Iterator[tuple[Table, int]]:
        """Hold the table's update lock: yields (table, version) with no update running or starting.

        Marked pending meanwhile, like an update: if this worker dies while it holds the lock (in the
        middle of a snapshot, say), the next holder repairs the table from the journal."""
        with self.locked(name) as entry:
            entry.set_pending(EXCLUSIVE)
            try:
                yield entry.table, entry.version
            finally:
                entry.set_pending(0)

    def close(self) -> None:
        """Release this worker's locks and mappings (the shared directory stays; its owner removes it)."""
        with self._sync_lock:
            for lock in self._locks.values():
                lock.close()
            self.arrays, self.entries, self._locks = {}, {}, {}
        self.lock.close()


def refuse_torn(entry: TableEntry) -> None:
    """``BusyError`` (503) if the table's array is being restored in place, or an in-place restore that
    died left it torn (``OVERWRITES`` odd, ``inplace.py``): its rows are not served until restored."""
    if entry.overwrites & 1:
        raise BusyError(
            f"table {entry.name!r} is being restored from a snapshot in place (or such a restore was cut "
            "short and it waits for the next); try again shortly, or another replica"
        )


def _release(locks: list[FileLock]) -> None:
    for lock in reversed(locks):
        lock.release()
