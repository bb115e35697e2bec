"""Table administration: create, import, delete, load (``restore``) and snapshot a table.

Tables come and go here: arrays are allocated, filled and released, and the registry is switched, under
the registry lock (and, for a table that exists, its update lock first). ``TableStore`` keeps one
``TableAdmin`` over its ``TableRegistry`` (``registry.py``), journal and limits, and hands its public
``create`` / ``create_from`` / ``delete`` / ``restore`` / ``snapshot`` to it.

A load (``restore``) never writes the array lookups read: it fills a new array, makes it durable, then
switches the registry to it (new uid and counters, generation bumped) under the table's update lock.
A lookup that resolved the table before the switch finishes on the old array (its files are unlinked
but stay mapped until the lookup drops them) and reports the old version; one that starts after the
load's response sees only the new array. An update that was waiting for the lock finds its entry marked
replaced and starts again on the new array.

A restore from a file into an existing table (``TableStore.restore_from_file``, a replica) writes the
array in place instead, with no second copy: ``inplace.py``. A table such a restore left torn can still be
loaded over or deleted here (both replace its whole array).

A load or a delete marks the table's counters (``LOADING`` / ``DELETING``) while it runs; what a worker
killed at each step leaves and how the next holder of the lock repairs it is in ``repair.py``.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor

from robez_core.checkpoint import CheckpointFile
from robez_core.config import OptimizerConfig, TableConfig
from robez_core.errors import (
    ConfigError,
    ConflictError,
    CorruptionError,
    LimitExceededError,
    NotFoundError,
)
from robez_core.init import init_weight
from robez_core.optim import init_state
from robez_core.table import Table

from ..config import TableSpec
from ..errors import StorageFullError
from ..faults import NO_FAULTS, Faults
from ..log.journal import Journal, NullJournal, is_storage_full
from ..shm import (
    DELETED,
    DELETING,
    LOADING,
    NUM_COUNTERS,
    PENDING,
    REPLACED,
    STATE,
    VERSION,
    Registry,
    array_layout,
    dtype_name,
    layout_bytes,
    shape_numel,
)
from .api import Limits, validate_table_name
from .registry import TableRegistry
from .repair import remove_orphans, write_journal

logger = logging.getLogger("robez.store")


class TableAdmin:
    """Creates, loads and deletes the tables of ``registry``; ``journal`` makes them durable."""

    def __init__(
        self, registry: TableRegistry, journal: Journal, limits: Limits, faults: Faults = NO_FAULTS
    ) -> None:
        self._registry = registry
        self._journal = journal
        self._limits = limits
        self._faults = faults  # testing only: kill points (service/faults.py)

    def create(self, name: str, spec: TableSpec) -> None:
        """Create a table (new zero-version array, or sharing ``spec.share_array_with``'s array)."""
        validate_table_name(name)
        self._check_config_limits(spec.config)
        with self._registry.lock.hold():
            registry = self._registry.directory.read_registry()
            self._check_room(registry, name)
            if spec.share_array_with is not None:
                source = self._shared_array_source(registry, spec)
                self._register(
                    registry, name, spec.config, spec.optimizer, source["array"], source["lock"], version=0
                )
        if spec.share_array_with is None:
            self.install(name, spec, source=None, version=0, journal_create=True)

    def create_from(self, name: str, table: Table, version: int = 0) -> None:
        """Create table ``name`` holding a copy of ``table``'s array and optimizer state (an import) at
        ``version``; journalled like ``create``."""
        validate_table_name(name)
        self._check_config_limits(table.config)
        spec = TableSpec(table.config, table.optimizer)
        self.install(name, spec, source=table, version=version, journal_create=True)

    def create_from_file(self, name: str, checkpoint: CheckpointFile, version: int) -> None:
        """``create_from`` with the table read from a checkpoint file straight into the new shared array,
        piece by piece (no private copy); ``CorruptionError`` (nothing created) if the file is damaged."""
        validate_table_name(name)
        self._check_config_limits(checkpoint.config)
        spec = TableSpec(checkpoint.config, checkpoint.optimizer)
        self.install(name, spec, source=checkpoint, version=version, journal_create=True)

    def check_start(self, stored: dict[str, TableSpec], requested: dict[str, TableSpec], where: str) -> None:
        """Check the tables a server starts with against every limit before any is loaded or created:
        ``stored`` (in the data directory) plus those of ``requested`` (the tables file ``where``) not
        stored yet, each against the per-table limits, all together against ``max_tables`` and
        ``max_total_memory_bytes``. Raises naming the table and the file; nothing has changed then."""
        registry = self._registry.directory.read_registry()
        count = len(registry.tables)
        total = registry.total_bytes()
        new_tables = [(name, spec, "the data directory") for name, spec in stored.items()]
        new_tables += [(name, spec, where) for name, spec in requested.items() if name not in stored]
        for name, spec, source in new_tables:
            try:
                validate_table_name(name)
                self._check_config_limits(spec.config)
                if name in stored and name in requested:
                    wanted = requested[name]
                    if (wanted.config, wanted.optimizer) != (spec.config, spec.optimizer):
                        raise ConfigError(
                            "the table in the data directory has a different config than the tables file; "
                            f"delete the table (DELETE /v1/tables/{name}) or change the file"
                        )
                if spec.share_array_with is not None and not isinstance(self._journal, NullJournal):
                    raise ConfigError(
                        "share_array_with is not available with a data directory: the write-ahead log is "
                        "per table"
                    )
                count += 1
                if count > self._limits.max_tables:
                    raise LimitExceededError(
                        f"it would be table number {count}, over max_tables={self._limits.max_tables} "
                        f"({len(stored)} tables in the data directory, {len(requested)} in the tables file)"
                    )
                if spec.share_array_with is None:
                    nbytes = layout_bytes(array_layout(spec.config, spec.optimizer))
                    total += nbytes
                    if total > self._limits.max_total_memory_bytes:
                        raise LimitExceededError(
                            f"its {nbytes} bytes bring the tables to {total} bytes, over "
                            f"max_total_memory_bytes={self._limits.max_total_memory_bytes}"
                        )
            except (ConfigError, LimitExceededError) as error:
                raise type(error)(f"table {name!r} ({source}): {error}; nothing was created") from None

    def _check_room(self, registry: Registry, name: str) -> None:
        """A new table ``name`` fits the registry: not taken, under ``max_tables``. Caller holds the
        registry lock."""
        if name in registry.tables:
            raise ConflictError(f"table {name!r} already exists")
        if len(registry.tables) >= self._limits.max_tables:
            raise LimitExceededError(f"there are already max_tables={self._limits.max_tables} tables")

    def _check_config_limits(self, config: TableConfig) -> None:
        if config.embedding_dim > self._limits.max_embedding_dim:
            raise LimitExceededError(
                f"embedding_dim {config.embedding_dim} is over the limit "
                f"max_embedding_dim={self._limits.max_embedding_dim}"
            )
        if config.memory_size > self._limits.max_memory_size:
            raise LimitExceededError(
                f"memory_size {config.memory_size} is over the limit "
                f"max_memory_size={self._limits.max_memory_size}"
            )

    def _check_memory(self, registry: Registry, nbytes: int, what: str) -> None:
        total = registry.total_bytes() + nbytes
        if total > self._limits.max_total_memory_bytes:
            raise LimitExceededError(
                f"{what} needs {nbytes} bytes; with the {registry.total_bytes()} bytes in use "
                f"that is over the limit max_total_memory_bytes={self._limits.max_total_memory_bytes}"
            )

    def _shared_array_source(self, registry: Registry, spec: TableSpec) -> dict[str, Any]:
        """The registry record of the table whose array (and update lock) ``spec`` asks to share."""
        source_name = spec.share_array_with
        source = registry.tables.get(source_name or "")
        if source is None:
            raise NotFoundError(f"share_array_with: no table named {source_name!r}")
        if not isinstance(self._journal, NullJournal):
            raise ConfigError(
                "share_array_with is not available with a data directory: the write-ahead log is per table"
            )
        source_config = TableConfig.from_dict(source["config"])
        if spec.config.memory_size != source_config.memory_size:
            raise ConfigError(
                f"share_array_with={source_name!r}: memory_size must be the shared array's "
                f"{source_config.memory_size}, got {spec.config.memory_size}"
            )
        if spec.config.chunk_size != source_config.chunk_size:
            # one Z an array: a shared push is coalesced into chunks of one length (as the local
            # collection's one chunk_size); another Z would refuse every push that spans the two tables
            raise ConfigError(
                f"share_array_with={source_name!r}: chunk_size must be the shared array's "
                f"{source_config.chunk_size}, got {spec.config.chunk_size}"
            )
        if spec.optimizer != OptimizerConfig.from_dict(source["optimizer"]):
            raise ConfigError(
                f"share_array_with={source_name!r}: the optimizer must be the shared array's "
                f"({source['optimizer']}); its state is shared too"
            )
        return source

    def _new_array(
        self,
        registry: Registry,
        config: TableConfig,
        optimizer: OptimizerConfig,
        source: Table | CheckpointFile | None,
        *,
        fill: bool = True,
    ) -> tuple[str, Table]:
        """Allocate an array in shared memory, fill it from ``source`` (a table, a checkpoint file read
        straight into it, or a new table initialised in place; ``fill=False``: left zero, for the caller
        to fill) and add it to ``registry`` (not yet published); returns its id and a Table over it.
        Caller holds the registry lock and removes the array with ``_remove_array`` if what follows fails."""
        layout = array_layout(config, optimizer)
        nbytes = layout_bytes(layout)
        array_id = secrets.token_hex(8)
        tensors: dict[str, Tensor] = {}
        try:
            for key, (shape, dtype) in layout.items():
                tensors[key] = self._registry.directory.allocate(
                    f"arrays/{array_id}.{key}", shape_numel(shape), dtype
                ).view(shape)
            self._registry.directory.allocate_marks(array_id, config.memory_size)
            if not fill:
                pass
            elif isinstance(source, CheckpointFile):
                source.read_into(tensors)  # piece by piece from the file, checksums checked
            elif source is None:  # initialised in place: no private copy of a new table
                init_weight(config.memory_size, config.init_scale, config.seed, out=tensors["weight"])
                state = {key.removeprefix("state."): t for key, t in tensors.items() if key != "weight"}
                init_state(optimizer, config.memory_size, out=state)
            else:
                for key, tensor in source.tensors().items():
                    tensors[key].copy_(tensor.reshape(tensors[key].shape))
        except BaseException:
            self._remove_array(array_id, layout)
            raise
        registry.arrays[array_id] = {
            "layout": {key: [list(shape), dtype_name(dtype)] for key, (shape, dtype) in layout.items()},
            "nbytes": nbytes,
        }
        state = {key.removeprefix("state."): t for key, t in tensors.items() if key != "weight"}
        return array_id, Table(config, optimizer, weight=tensors["weight"], state=state)

    def _remove_array(self, array_id: str, layout: dict[str, Any]) -> None:
        for key in [*layout, "granules"]:
            (self._registry.directory.arrays_dir / f"{array_id}.{key}").unlink(missing_ok=True)

    def install(
        self,
        name: str,
        spec: TableSpec,
        *,
        source: Table | CheckpointFile | None,
        version: int,
        journal_create: bool,
        load: Callable[[Table], int | None] | None = None,
    ) -> None:
        """Allocate a new array for ``name``, fill it from ``source`` (or a freshly initialised Table),
        ``journal.create`` it if asked (not for tables loaded from the journal), then publish it.
        ``load``: fills the array itself (the journal reading a table straight into shared memory) and
        returns the version it reached, which replaces ``version``."""
        if spec.share_array_with is not None:
            raise ConfigError("a table with its own array cannot also share one")
        nbytes = layout_bytes(array_layout(spec.config, spec.optimizer))
        with self._registry.lock.hold():
            registry = self._registry.directory.read_registry()
            self._check_room(registry, name)
            self._check_memory(registry, nbytes, "the table")
            array_id, shared = self._new_array(
                registry, spec.config, spec.optimizer, source, fill=load is None
            )
            journaled = False
            try:
                if load is not None:
                    loaded = load(shared)
                    if loaded is None:
                        raise NotFoundError(f"table {name!r} is no longer in the data directory")
                    version = loaded
                if journal_create:
                    self._journal.create(name, shared, version)
                    journaled = True
                config, optimizer, lock_id = spec.config, spec.optimizer, secrets.token_hex(8)
                self._register(registry, name, config, optimizer, array_id, lock_id, version=version)
            except BaseException:
                self._remove_array(array_id, registry.arrays.pop(array_id)["layout"])
                if journaled:
                    # Otherwise the table, never served, would come back from the data directory at the
                    # next start: a failed create must change nothing.
                    self._drop_quietly(name)
                raise

    def _drop_quietly(self, name: str) -> None:
        """Roll back a ``journal.create``; a failure here is logged, the caller's error is what counts."""
        try:
            self._journal.drop(name)
        except Exception:
            logger.exception("could not remove table %r from the journal after a failed create", name)

    def _register(
        self,
        registry: Registry,
        name: str,
        config: TableConfig,
        optimizer: OptimizerConfig,
        array_id: str,
        lock_id: str,
        *,
        version: int,
    ) -> None:
        """Add (or switch) ``name`` to ``array_id`` with new counters at ``version``, and publish."""
        uid = secrets.token_hex(8)
        counters = self._registry.directory.allocate(f"tables/{uid}.counters", NUM_COUNTERS, torch.int64)
        counters[VERSION] = version
        registry.tables[name] = {
            "uid": uid,
            "array": array_id,
            "lock": lock_id,
            "config": config.to_dict(),
            "optimizer": optimizer.to_dict(),
        }
        try:
            self._registry.publish(registry)
        except BaseException:
            (self._registry.directory.tables_dir / f"{uid}.counters").unlink(missing_ok=True)
            raise

    def delete(self, name: str) -> None:
        """Remove a table; its array goes when no other table reads it. In-flight lookups in other
        workers keep their mapping until they finish (unlinked files live while mapped).

        Marked ``DELETING`` first: a worker killed before the registry is published leaves the table
        served but perhaps gone from the data directory; the next holder of the lock writes it back
        (``repair.py``). On an error the mark stays for the same reason."""
        with self._registry.locked(name, torn_ok=True) as entry, self._registry.lock.hold():
            registry = self._registry.directory.read_registry()
            record = registry.tables.get(name)
            if record is None or record["uid"] != entry.uid:  # changes of a table hold its lock
                raise CorruptionError(f"the registry changed table {name!r} behind its update lock")
            remove_orphans(self._registry.directory, registry)
            entry.set_pending(DELETING)
            self._journal.drop(name)
            self._die_at("delete:dropped")
            del registry.tables[name]
            if not registry.array_tables(record["array"]):
                del registry.arrays[record["array"]]
            self._registry.publish(registry)
            self._die_at("delete:published")
            entry.counters[STATE] = DELETED  # updates waiting on the lock see this and answer 404
            entry.set_pending(0)
            self._release(registry, [(record["uid"], record["array"], record["lock"])])

    def _release(self, registry: Registry, records: list[tuple[str, str, str]]) -> None:
        """Unlink the counters of replaced or deleted table records (uid, array, lock), and their arrays
        and locks once no table of the published ``registry`` uses them. Mappings held by in-flight
        requests stay valid: an unlinked file lives until its last mapping goes."""
        for uid, array_id, lock_id in records:
            (self._registry.directory.tables_dir / f"{uid}.counters").unlink(missing_ok=True)
            if array_id not in registry.arrays:
                for path in self._registry.directory.arrays_dir.glob(f"{array_id}.*"):
                    path.unlink(missing_ok=True)
            if not registry.lock_in_use(lock_id):
                (self._registry.directory.locks_dir / f"{lock_id}.lock").unlink(missing_ok=True)

    def _die_at(self, point: str) -> None:
        """Testing only: SIGKILL this process here if the fault file names ``point`` (service/faults.py)."""
        self._faults.die_at(point)

    def snapshot(self, name: str) -> int:
        """Journal a snapshot of the table at its current version; returns it. Updates go on while it is
        written (``Journal.snapshot_live``); the version returned is the one the snapshot holds."""
        version = self._journal.snapshot_live(name, partial(self._registry.exclusive, name))
        assert version is not None  # not skipped: no policy was given
        return version

    def restore(
        self, name: str, source: Table | CheckpointFile, version: int, *, after: int | None = None
    ) -> bool:
        """Replace the table's array and optimizer state by a copy of ``source`` (same config and
        optimizer; a checkpoint file is read straight into the new array) at ``version``, atomically for
        lookups (see the module docstring). ``after``: only if the table is at that version (a load at a
        log position follows the one before it): False, nothing changed, if it is past it already (a
        replay), a ``CorruptionError`` on a gap. Returns True once switched.

        Under the table's update lock: a new array is filled from ``source`` and made durable first
        (``journal.snapshot``: snapshot + empty log), then the registry is switched to it. If any step
        fails the table is left as it was, in memory and on disk. Every table sharing the array switches
        with it. While both arrays exist they count against ``max_total_memory_bytes`` together.

        The old and the new counters are marked ``LOADING`` until the old array is released: if this
        worker dies meanwhile, the next holder of the lock puts the data directory and the shared
        memory back in line with whichever table the registry publishes (``repair.py``).
        """
        with self._registry.locked(name, torn_ok=True) as entry, self._registry.lock.hold():
            table = entry.table
            if after is not None and entry.version != after:
                if entry.version > after:
                    return False
                raise CorruptionError(
                    f"table {name!r} is at version {entry.version}; a load at {version} cannot follow it"
                )
            if (source.config, source.optimizer) != (table.config, table.optimizer):
                raise ConflictError(f"the checkpoint's config or optimizer differs from table {name!r}'s")
            registry = self._registry.directory.read_registry()
            record = registry.tables.get(name)
            if record is None or record["uid"] != entry.uid:  # changes of a table hold its lock
                raise CorruptionError(f"the registry changed table {name!r} behind its update lock")
            old_array = record["array"]
            remove_orphans(self._registry.directory, registry)
            self._check_memory(registry, int(registry.arrays[old_array]["nbytes"]), "loading the table")
            sharers = [  # mapped here: this worker may not have synced a sharer created meanwhile
                self._registry.directory.map(
                    f"tables/{registry.tables[sharer]['uid']}.counters", NUM_COUNTERS, torch.int64
                )
                for sharer in registry.array_tables(old_array)
            ]
            for counters in sharers:
                counters[PENDING] = LOADING
            entry.marks.mark_all()  # copies of the old array running: what they copy is replaced
            try:
                array_id, shared = self._new_array(registry, table.config, table.optimizer, source)
            except BaseException:  # nothing was written: no array, nothing on disk
                for counters in sharers:
                    counters[PENDING] = 0
                raise
            self._die_at("load:filled")
            try:
                self._journal.snapshot(name, shared, version)
            except BaseException as error:
                self._remove_array(array_id, registry.arrays.pop(array_id)["layout"])
                # No space: nothing was committed. Any other failure may have come after the commit
                # (meta.json), so the mark stays and the next holder writes the old table back.
                if isinstance(error, StorageFullError) or is_storage_full(error):
                    for counters in sharers:
                        counters[PENDING] = 0
                raise
            self._die_at("load:durable")
            try:
                replaced = self._switch(registry, old_array, array_id, name, version)
            except BaseException:
                self._remove_array(array_id, registry.arrays.pop(array_id)["layout"])
                if self._restore_journal(name, table, entry.version):
                    for counters in sharers:
                        counters[PENDING] = 0
                raise
            self._die_at("load:switched")
            self._release(registry, replaced)
            for sharer_name in registry.array_tables(array_id):
                self._registry.entries[sharer_name].set_pending(0)
        return True

    def _switch(
        self, registry: Registry, old_array: str, array_id: str, name: str, version: int
    ) -> list[tuple[str, str, str]]:
        """Point every table reading ``old_array`` at ``array_id`` (``name`` at ``version``, the others at
        their own versions), publish, and mark their old counters replaced; returns the old records."""
        sharers = registry.array_tables(old_array)
        old_records = {table_name: dict(registry.tables[table_name]) for table_name in sharers}
        old_counters = {
            table_name: self._registry.directory.map(
                f"tables/{record['uid']}.counters", NUM_COUNTERS, torch.int64
            )
            for table_name, record in old_records.items()
        }
        old_array_record = registry.arrays[old_array]
        new_uids: dict[str, str] = {}
        try:
            for table_name in sharers:
                uid = new_uids[table_name] = secrets.token_hex(8)
                counters = self._registry.directory.allocate(
                    f"tables/{uid}.counters", NUM_COUNTERS, torch.int64
                )
                counters[VERSION] = version if table_name == name else old_counters[table_name][VERSION]
                counters[PENDING] = LOADING  # until the old array is released (restore clears it)
                registry.tables[table_name] = {**old_records[table_name], "uid": uid, "array": array_id}
            del registry.arrays[old_array]
            self._registry.publish(registry)
            self._die_at("load:published")
        except BaseException:
            registry.tables.update(old_records)
            registry.arrays[old_array] = old_array_record
            for uid in new_uids.values():
                (self._registry.directory.tables_dir / f"{uid}.counters").unlink(missing_ok=True)
            raise
        # Published: updates still holding the old entries start again on the new ones.
        for counters in old_counters.values():
            counters[STATE] = REPLACED
        return [(old["uid"], old["array"], old["lock"]) for old in old_records.values()]

    def _restore_journal(self, name: str, table: Table, version: int) -> bool:
        """After a load was made durable but could not be switched to: put the old table back on disk.
        Returns whether it did; if not, the caller leaves the table marked for the next holder to."""
        try:
            write_journal(self._journal, name, table, version)
        except Exception:
            logger.exception(
                "table %r: a load was written to the data directory but could not be served, and the old "
                "table could not be written back yet; the next holder of its lock tries again",
                name,
            )
            return False
        return True
