"""Restoring a checkpoint file into a table's own shared array, piece by piece: no second copy.

``TableStore.restore_from_file`` (a replica whose log was trimmed past its position restores the newest
snapshot, ``replication/applier.py``) writes the file straight over the array lookups read, so the extra
memory of a restore is one 4 MiB read buffer, not a second array of the table's size (``admin.py``'s
``restore`` switches to a new array instead; the single server's ``POST /tables/{name}/load`` keeps
that one: see docs/durability.md). Under the table's update lock, in this order:

1. the file's config and optimizer are checked against the table's (``ConflictError``) and every
   tensor's checksum is checked by reading the whole file once (``CorruptionError``): a damaged file is
   refused before anything is written, and the replica goes on to the Object Store snapshot;
2. every table reading the array is marked ``pending = OVERWRITING`` (the target version kept in its
   counters' ``TARGET``);
3. with a data directory, the file's tensors (a copy-on-write mapping of it, page cache only) are
   written to the journal as the table's snapshot at the new version, with an empty log (kill point
   ``restore:durable`` after it);
4. the counters' ``OVERWRITES`` goes odd, the version becomes the new one, the array is overwritten
   (kill point ``restore:overwriting`` half way), running copies of it are marked all changed
   (``marks.mark_all``), then ``OVERWRITES`` goes even and the pending mark is cleared.

What a lookup sees: while ``OVERWRITES`` is odd, nothing. A lookup reads ``OVERWRITES`` before it
gathers and again after; odd before, or changed after, and it is refused with a ``BusyError`` (503,
"being restored in place") instead of answering rows that mix two tables. So a lookup answers rows
of the table before the restore (at its old version) or after it (at the new version), never a mix,
and for the length of the overwrite (about a second per GiB) lookups of that table answer 503; clients
retry, or read another replica. Updates wait on the lock as for any change of the table.

Crashes (``repair.py``, ``repair_overwrite``): the next holder of the lock finds ``OVERWRITING``. If
``OVERWRITES`` is still even, nothing of the array was written: the old table is written to the data
directory again (step 3 may have committed the new one), as after a load killed before its switch.
If it is odd, the array may be torn: with a data directory it is rebuilt from the journal at
``TARGET`` (committed in step 3 before any byte was overwritten). Without one nothing can rebuild it:
``OVERWRITES`` stays odd, so lookups answer 503 and updates, snapshots and checksums refuse with a
``BusyError`` until a restore overwrites the whole array again; the replica's applier does that when
it finds its table torn (``TableStore.torn``): damage is never served silently. A restore that fails
half way without dying (an unreadable file, a file changed after it was checked) leaves the same marks
and the same outcome. Nothing acknowledged is lost: no update of the table is acknowledged while its
lock is held, and the new table is durable (or, without a data directory, comes from the log's
snapshot) before any byte of the old one is overwritten.

Tables sharing the array (``share_array_with``, no data directory) are overwritten with it and marked
with it; each keeps its own version, as with ``admin.py``'s ``restore``.
"""

from __future__ import annotations

import logging

import torch

from robez_core.checkpoint import CheckpointFile
from robez_core.errors import BusyError, ConflictError, CorruptionError
from robez_core.table import Table

from ..errors import StorageFullError
from ..faults import NO_FAULTS, Faults
from ..log.journal import Journal, NullJournal, is_storage_full
from ..shm import NUM_COUNTERS, OVERWRITES, OVERWRITING, PENDING, TARGET, VERSION, TableEntry
from .registry import TableRegistry, refuse_torn

logger = logging.getLogger("robez.store")

RESTORE_DURABLE = "restore:durable"
RESTORE_OVERWRITING = "restore:overwriting"


def restore_in_place(
    registry: TableRegistry,
    journal: Journal,
    name: str,
    checkpoint: CheckpointFile,
    version: int,
    faults: Faults = NO_FAULTS,
) -> None:
    """Overwrite table ``name``'s array and optimizer state with ``checkpoint`` (same config and
    optimizer) at ``version``, in place (module docstring). A torn table (``OVERWRITES`` odd) may be
    restored: this is what mends it."""
    with registry.locked(name, torn_ok=True) as entry:
        table = entry.table
        if (checkpoint.config, checkpoint.optimizer) != (table.config, table.optimizer):
            raise ConflictError(f"the checkpoint's config or optimizer differs from table {name!r}'s")
        checkpoint.verify()  # a damaged file is refused before anything is written
        with registry.lock.hold():
            published = registry.directory.read_registry()
            record = published.tables.get(name)
            if record is None or record["uid"] != entry.uid:  # changes of a table hold its lock
                raise CorruptionError(f"the registry changed table {name!r} behind its update lock")
            sharers = [  # mapped here: this worker may not have synced a sharer created meanwhile
                registry.directory.map(
                    f"tables/{published.tables[sharer]['uid']}.counters", NUM_COUNTERS, torch.int64
                )
                for sharer in published.array_tables(record["array"])
            ]
        counters = entry.counters
        counters[TARGET] = version
        for each in sharers:
            each[PENDING] = OVERWRITING
        if not isinstance(journal, NullJournal):
            mapped = checkpoint.mapped()
            file_table = Table(
                table.config,
                table.optimizer,
                weight=mapped["weight"],
                state={key.removeprefix("state."): t for key, t in mapped.items() if key != "weight"},
            )
            try:
                journal.snapshot(name, file_table, version)
            except BaseException as error:
                # No space: nothing was committed. Any other failure may have come after the commit, so
                # the mark stays and the next holder writes the table served back (``repair.py``).
                if isinstance(error, StorageFullError) or is_storage_full(error):
                    for each in sharers:
                        each[PENDING] = 0
                raise
            del file_table, mapped
        faults.die_at(RESTORE_DURABLE)
        for each in sharers:  # odd: lookups refuse from here on (they read it before and after)
            each[OVERWRITES] |= 1
        counters[VERSION] = version
        entry.marks.mark_all()
        half = checkpoint.nbytes // 2
        done = 0

        def each_piece(piece: memoryview) -> None:
            nonlocal done
            before, done = done, done + len(piece)
            if before < half <= done:
                faults.die_at(RESTORE_OVERWRITING)

        # Checked again on the way: a file changed since ``verify`` fails here, the table left torn (the
        # marks stay; the next holder rebuilds it or leaves it refused, as after a crash).
        checkpoint.read_into(entry.array.tensors, each_piece=each_piece)
        entry.marks.mark_all()  # copies running recopy every granule under the lock
        for each in sharers:
            each[OVERWRITES] += 1
            each[PENDING] = 0


def lookup_starts(entry: TableEntry) -> int:
    """Before a lookup gathers: ``OVERWRITES``, read once; a ``BusyError`` if it is odd."""
    overwrites = entry.overwrites
    if overwrites & 1:
        refuse_torn(entry)
    return overwrites


def lookup_ends(entry: TableEntry, overwrites: int) -> None:
    """After a lookup gathered: a ``BusyError`` if a restore in place began meanwhile (``OVERWRITES``
    changed: odd now, or even again after a whole restore), since its rows may mix two tables."""
    if entry.overwrites != overwrites:
        refuse_torn(entry)
        raise BusyError(f"table {entry.name!r} was restored in place during the lookup; try again")
