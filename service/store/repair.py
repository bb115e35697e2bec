"""Repairing what a worker killed while it held a table's update lock left behind.

Whoever takes a table's lock next and finds its ``pending`` mark set calls ``repair`` first
(``TableRegistry.acquire``), so every update acknowledged afterwards goes to a table whose array, counter,
log and data directory agree.

A worker killed while it holds a table's update lock (kill -9, OOM) releases the lock with its update
perhaps appended to the log, perhaps half-applied to the array, and the version counter not bumped. So an
update marks ``pending`` before it appends and clears it after the counter is bumped; whoever takes the
lock next and finds ``pending`` set repairs the table first (``repair``): the journal rebuilds the table
at the counter's version and cuts the unfinished record off the log (``Journal.recover``), and the
rebuilt array and optimizer state are copied over the shared ones. The dead update was never
acknowledged; after the repair the array, the counter and the log agree again. A lookup running during
the repair may see values of the dead update or not (only the values it touched differ), as it could
while that update ran. Without a data directory there is nothing to rebuild from: the repair logs a
warning and the table keeps whatever part of the update was applied.

A worker killed in the middle of a load or a delete leaves the data directory and the shared memory
disagreeing with what the workers serve. So a load marks ``pending = LOADING`` on the old counters (and
on the new ones, from their creation until the old array is released) and a delete ``DELETING``; the
next holder of the lock repairs (``_repair_load_or_delete``) by the registry, which says what every
worker serves: if it still publishes the marked entry, that table (intact: neither writes the array
lookups read) is written to the data directory again at its version; if not, the load or delete took
effect, the data directory already agrees, and the entry is marked replaced or deleted. Shared files no
published table uses are then removed. A load or delete is acknowledged only after it returns, so
either outcome is right; what matters is that updates acknowledged afterwards go to the table served.
Each kill point (``service/faults.py``; tests/service/store/test_admin_crash.py), what it leaves, and the
repair:

- ``load:filled`` (new array filled, nothing durable): an orphaned array; old table everywhere. The next
  holder rewrites the old table (a snapshot) and removes the array. Whole-server kill: the old table.
- ``snapshot:committed`` (the load's meta.json committed, the old log not yet replaced): the data
  directory holds the new table, with the old log still in place and open in other workers, whose next
  appends went into a log the next start discards as stale (acknowledged updates lost, before this
  repair). The next holder writes the old table back (a new snapshot; every older one is removed then).
  Whole-server kill: the loaded table (at 0).
- ``load:durable`` (snapshot and empty log of the new table, registry not switched): the workers serve
  the old table at version v while the log starts at the load's version, so the next update was refused
  (a version gap) or, when both were 0, logged onto the wrong table. Repair and restart as above.
- ``load:published`` / ``load:switched`` (registry switched; the old counters not yet marked replaced,
  or the old array not yet released): the new table everywhere and on disk, the old array left in
  shared memory; (``load:published``) an update holding the old entry found it live and went on (a
  version gap refused it, or at equal versions it was applied to the old array, logged onto the new
  table). The next holder, through the old entry or the new one, marks the old counters replaced and
  removes the old array. Whole-server kill: the new table.
- ``drop:renamed`` / ``delete:dropped`` (the table's folder renamed aside or gone, registry unchanged):
  served, but updates failed (no log) and a restart would lose it. The next holder writes it back (a new
  folder); the folder renamed aside (``.dropped-*``) goes then too, or at the next start. Whole-server
  kill: gone.
- ``delete:published`` (registry without the table, counters not marked deleted): gone everywhere; a
  request holding the old entry finds the mark and answers 404; its files go at the next repair, load
  or delete. Whole-server kill: gone.

A restore in place (``inplace.py``) marks ``pending = OVERWRITING``; its kill points and repair
(``repair_overwrite``) are in that module's docstring.

Until that next holder comes, a whole-server kill restarts from the data directory alone: the loaded
table, or no table, from ``snapshot:committed`` / ``drop:renamed`` on, though the workers were still
serving the old one. Nothing acknowledged is lost that way: no update was acknowledged since the kill,
since every update takes the lock and repairs first.
"""

from __future__ import annotations

import logging

import torch

from robez_core.errors import CorruptionError
from robez_core.table import Table

from ..log.journal import Journal, NullJournal
from ..shm import (
    DELETED,
    DELETING,
    LIVE,
    LOADING,
    NUM_COUNTERS,
    OVERWRITES,
    OVERWRITING,
    REPLACED,
    STATE,
    TARGET,
    Registry,
    SharedDirectory,
    TableEntry,
)
from .registry import TableRegistry

logger = logging.getLogger("robez.store")


def repair(registry: TableRegistry, journal: Journal, entry: TableEntry) -> None:
    """Undo what a dead holder of the table's lock left unfinished; caller holds the lock."""
    version, pending = entry.version, entry.pending
    if pending in (LOADING, DELETING):
        _repair_load_or_delete(registry, journal, entry)
        return
    if pending == OVERWRITING:
        repair_overwrite(journal, entry)
        return
    what = f"while applying update {pending}" if pending > 0 else "while it held the table's lock"
    # Whatever the dead holder changed, every copy running marks it all changed (and the dead one's
    # copy, if it ran one, is over).
    entry.marks.reclaim()
    entry.marks.mark_all()
    rebuilt = journal.recover(entry.name, version)
    if rebuilt is None:
        logger.warning(
            "table %r: a worker died %s; with no data directory the table keeps whatever part of it "
            "was applied",
            entry.name,
            what,
        )
    else:
        for key, tensor in rebuilt.tensors().items():
            target = entry.array.tensors[key]
            target.copy_(tensor.reshape(target.shape))
        logger.warning(
            "table %r: a worker died %s; restored version %d from the data directory",
            entry.name,
            what,
            version,
        )
    entry.set_pending(0)


def _repair_load_or_delete(registry: TableRegistry, journal: Journal, entry: TableEntry) -> None:
    """A load or delete of this table died (or failed) under the lock: make the data directory and
    the shared memory agree with what the registry publishes. Caller holds the table's lock.

    Not published (the registry still has this entry): every worker serves this entry, intact (a
    load or delete never writes the array lookups read), so it is the truth; the data directory may
    hold the new table or none, so the table is written again from memory at its version. Published:
    the load or delete took effect and the data directory already agrees; this entry is marked
    replaced or deleted, so whoever holds it goes to the registry again. Either way the shared files
    no published table uses are removed (the dead worker's new or old array, counters, lock)."""
    name, what = entry.name, "loading" if entry.pending == LOADING else "deleting"
    with registry.lock.hold():
        published = registry.directory.read_registry()
        record = published.tables.get(name)
        if record is not None and record["uid"] == entry.uid:
            write_journal(journal, name, entry.table, entry.version)
            logger.warning(
                "table %r: a worker died (or failed) %s it; the table it left served, version %d, is "
                "written to the data directory again",
                name,
                what,
                entry.version,
            )
        else:
            entry.counters[STATE] = DELETED if entry.pending == DELETING else REPLACED
            logger.warning("table %r: a worker died %s it, after the registry published it", name, what)
        remove_orphans(registry.directory, published)
        entry.set_pending(0)


def repair_overwrite(journal: Journal, entry: TableEntry) -> None:
    """The holder of the lock died (or failed) in ``restore_in_place``; caller holds the lock
    (``inplace.py``'s docstring, crashes: the kill points ``restore:durable``, ``restore:overwriting``)."""
    name, target = entry.name, int(entry.counters[TARGET])
    if entry.overwrites % 2 == 0:  # nothing of the array written: the table served is the truth
        if not isinstance(journal, NullJournal):
            write_journal(journal, name, entry.table, entry.version)
        logger.warning(
            "table %r: a restore in place died before it wrote the array; version %d stays",
            name,
            entry.version,
        )
        entry.set_pending(0)
        return
    entry.marks.reclaim()
    entry.marks.mark_all()
    rebuilt = None if isinstance(journal, NullJournal) else journal.recover(name, target)
    if rebuilt is None:
        entry.set_pending(0)  # OVERWRITES stays odd: refused until a restore writes the whole array
        logger.error(
            "table %r: a restore in place died half way and there is no data directory to rebuild it "
            "from; the table answers 503 until it is restored again (a replica does that itself)",
            name,
        )
        return
    for key, tensor in rebuilt.tensors().items():
        target_tensor = entry.array.tensors[key]
        target_tensor.copy_(tensor.reshape(target_tensor.shape))
    entry.set_version(target)
    entry.marks.mark_all()
    entry.counters[OVERWRITES] += 1
    entry.set_pending(0)
    logger.warning(
        "table %r: a restore in place died half way; version %d rebuilt from the data directory",
        name,
        target,
    )


def write_journal(journal: Journal, name: str, table: Table, version: int) -> None:
    """Make the journal hold ``table`` at ``version`` as table ``name``, whatever it held before."""
    if name in journal.names():
        journal.snapshot(name, table, version)
    else:
        journal.create(name, table, version)


def remove_orphans(directory: SharedDirectory, registry: Registry) -> None:
    """Remove the shared files no table of the published ``registry`` uses: what a worker killed in a
    load or delete left (every array, counter and lock is created and released under the registry
    lock, which the caller holds). Orphaned counters are marked replaced first, so a request holding
    them looks the table up again."""
    uids = {record["uid"] for record in registry.tables.values()}
    for path in directory.tables_dir.glob("*.counters"):
        if path.name.removesuffix(".counters") in uids:
            continue
        try:
            counters = directory.map(f"tables/{path.name}", NUM_COUNTERS, torch.int64)
            if int(counters[STATE]) == LIVE:
                counters[STATE] = REPLACED
        except CorruptionError:
            pass  # cut short while it was allocated: no one maps it
        path.unlink(missing_ok=True)
    for path in directory.arrays_dir.iterdir():
        if path.name.split(".", 1)[0] not in registry.arrays:
            path.unlink(missing_ok=True)
    for path in directory.locks_dir.glob("*.lock"):
        if not registry.lock_in_use(path.name.removesuffix(".lock")):
            path.unlink(missing_ok=True)
