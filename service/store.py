"""Tables in shared memory, shared by every worker process of one server.

The files, their layout and the per-table counters are in ``shm.py``; this module is what workers do
with them.

Consistency: updates of an array are serialised by its lock; lookups never take it. A lookup running
while an update is applied may read a row with some values from before and some from after that update
(values are float32 stores, never torn); every lookup that starts after an update's response was sent
sees the whole update, since the update finished writing before it responded. A lookup reports the table
version read before it gathered: its rows include at least that many updates.

A worker killed while it holds a table's update lock (kill -9, OOM) releases the lock with its update
perhaps appended to the log, perhaps half-applied to the array, and the version counter not bumped. So an
update marks ``pending`` before it appends and clears it after the counter is bumped; whoever takes the
lock next and finds ``pending`` set repairs the table first (``_repair``): the journal rebuilds the table
at the counter's version and cuts the unfinished record off the log (``Journal.recover``), and the
rebuilt array and optimizer state are copied over the shared ones. The dead update was never
acknowledged; after the repair the array, the counter and the log agree again. A lookup running during
the repair may see values of the dead update or not (only the values it touched differ), as it could
while that update ran. Without a data directory there is nothing to rebuild from: the repair logs a
warning and the table keeps whatever part of the update was applied.

A load (``restore``) never writes the array lookups read: it fills a new array, makes it durable, then
switches the registry to it (new uid and counters, generation bumped) under the table's update lock.
A lookup that resolved the table before the switch finishes on the old array (its files are unlinked
but stay mapped until the lookup drops them) and reports the old version; one that starts after the
load's response sees only the new array. An update that was waiting for the lock finds its entry marked
replaced and starts again on the new array.

A worker killed in the middle of a load or a delete leaves the data directory and the shared memory
disagreeing with what the workers serve. So a load marks ``pending = LOADING`` on the old counters (and
on the new ones, from their creation until the old array is released) and a delete ``DELETING``; the
next holder of the lock repairs (``_repair_load_or_delete``) by the registry, which says what every
worker serves: if it still publishes the marked entry, that table (intact: neither writes the array
lookups read) is written to the data directory again at its version; if not, the load or delete took
effect, the data directory already agrees, and the entry is marked replaced or deleted. Shared files no
published table uses are then removed. A load or delete is acknowledged only after it returns, so
either outcome is right; what matters is that updates acknowledged afterwards go to the table served.
Each kill point (``service/faults.py``; tests/service/test_admin_crash.py), what it leaves, and the repair:

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

Until that next holder comes, a whole-server kill restarts from the data directory alone: the loaded
table, or no table, from ``snapshot:committed`` / ``drop:renamed`` on, though the workers were still
serving the old one. Nothing acknowledged is lost that way: no update was acknowledged since the kill,
since every update takes the lock and repairs first.

Lock order, everywhere: a table's update lock, then ``registry.lock``, then a store's ``_sync_lock``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from robez_core.config import OptimizerConfig, TableConfig
from robez_core.errors import (
    BusyError,
    ConfigError,
    ConflictError,
    CorruptionError,
    InvalidInputError,
    LimitExceededError,
    NotFoundError,
)
from robez_core.table import Table

from . import faults
from .config import Settings, TableSpec, demo_table_spec, load_tables_file
from .journal import Journal, NullJournal, StorageFullError, UpdateRecord, is_storage_full
from .shm import (
    DELETED,
    DELETING,
    EXCLUSIVE,
    LIVE,
    LOADING,
    NUM_COUNTERS,
    PENDING,
    REPLACED,
    STATE,
    VERSION,
    FileLock,
    Registry,
    SharedArray,
    SharedDirectory,
    TableEntry,
    array_layout,
    dtype_from_name,
    dtype_name,
    layout_bytes,
    shape_numel,
)

logger = logging.getLogger("robez.store")

TABLE_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
Pooling = Literal["none", "sum", "mean"]
POOLINGS: tuple[str, ...] = ("none", "sum", "mean")
# An update or snapshot that finds its table replaced by a load starts again; this many loads in a row
# while it waits means something is wrong.
_MAX_SWITCHES = 16


def validate_table_name(name: str) -> str:
    """Table names become registry keys and WAL file names: letters, digits, '_' and '-', at most 64."""
    if not isinstance(name, str) or not TABLE_NAME_PATTERN.fullmatch(name):
        raise InvalidInputError(
            f"invalid table name {name!r}: use 1-64 letters, digits, '_' or '-', "
            "starting with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class Limits:
    """Request and capacity limits (see ``Settings``); exceeding one raises ``LimitExceededError``."""

    max_ids_per_request: int
    max_values_per_request: int
    max_tables: int
    max_embedding_dim: int
    max_memory_size: int
    max_total_memory_bytes: int

    @classmethod
    def from_settings(cls, settings: Settings) -> Limits:
        return cls(
            max_ids_per_request=settings.max_ids_per_request,
            max_values_per_request=settings.max_values_per_request,
            max_tables=settings.max_tables,
            max_embedding_dim=settings.max_embedding_dim,
            max_memory_size=settings.max_memory_size,
            max_total_memory_bytes=settings.max_total_memory_bytes,
        )

    def check_request(self, num_ids: int, embedding_dim: int) -> None:
        """A lookup or update of ``num_ids`` rows of ``embedding_dim`` values."""
        if num_ids > self.max_ids_per_request:
            raise LimitExceededError(
                f"{num_ids} ids in one request; the limit is max_ids_per_request={self.max_ids_per_request}"
            )
        if num_ids * embedding_dim > self.max_values_per_request:
            raise LimitExceededError(
                f"{num_ids} rows x {embedding_dim} values = {num_ids * embedding_dim} values in one request; "
                f"the limit is max_values_per_request={self.max_values_per_request}"
            )


@dataclass(frozen=True)
class TableInfo:
    """What ``GET /v1/tables/{name}`` reports about a table."""

    name: str
    config: TableConfig
    optimizer: OptimizerConfig
    version: int
    array: str
    array_tables: tuple[str, ...]  # every table reading this array (itself included)
    memory_bytes: int  # the array and its optimizer state


@dataclass(frozen=True)
class LookupResult:
    """Rows (n, d) float32 (or pooled bags (B, d)), the version read before gathering, stage times (s)."""

    rows: Tensor
    version: int
    hash_seconds: float
    lookup_seconds: float


@dataclass(frozen=True)
class LookupRequestItem:
    """One table's part of a multi-table lookup (arguments as ``TableStore.lookup``)."""

    table: str
    ids: Tensor
    offsets: Tensor | None = None
    pooling: Pooling = "none"
    per_sample_weights: Tensor | None = None


@dataclass(frozen=True)
class UpdateResult:
    """The version the update produced and its stage times in seconds."""

    version: int
    hash_seconds: float
    apply_seconds: float


class TableStore:
    """The tables of one server as one worker sees them; every method is safe to call from many threads.

    Args:
        directory: the prepared shared directory (``TableStore.prepare`` or ``SharedDirectory.create``).
        settings: limits and journal settings.
        journal: where updates and table lifecycle events are made durable (``NullJournal``: nowhere).
    """

    def __init__(self, directory: SharedDirectory, settings: Settings, journal: Journal) -> None:
        self.directory = directory
        self.limits = Limits.from_settings(settings)
        self.journal = journal
        # Testing only (ROBEZ_FAULT_DIE_AFTER_APPEND): die half-way through an update; see _fault_point.
        self._fault_file = settings.fault_die_after_append
        self._generation = directory.map("generation", 1, torch.int64)
        self._generation_np = self._generation.numpy()  # read on every request: numpy is cheaper
        self._registry_lock = FileLock(directory.path / "registry.lock")
        self._sync_lock = threading.Lock()
        self._seen_generation = -1
        self._entries: dict[str, TableEntry] = {}
        self._arrays: dict[str, SharedArray] = {}
        self._locks: dict[str, FileLock] = {}
        self._registry = Registry()
        self.refresh()

    # -- start-up ---------------------------------------------------------------------------------

    @classmethod
    def prepare(cls, settings: Settings, journal: Journal) -> SharedDirectory:
        """Create the shared directory and fill it: tables from the data directory, then the tables file,
        then (if neither named any and ``default_table``) the ``demo`` table. Called once, by the process
        that starts the workers; the workers attach with ``TableStore(directory, ...)``."""
        directory = SharedDirectory.create(settings.shm_dir)
        try:
            store = cls(directory, settings, journal)
            try:
                store._load_initial_tables(settings)
            finally:
                store.close()
        except BaseException:
            directory.remove()
            raise
        return directory

    def _load_initial_tables(self, settings: Settings) -> None:
        specs = load_tables_file(settings.config) if settings.config is not None else {}
        for name in self.journal.names():
            loaded = self.journal.load(validate_table_name(name))
            if loaded is None:
                continue
            table, version = loaded
            spec = specs.get(name)
            if spec is not None and (spec.config, spec.optimizer) != (table.config, table.optimizer):
                raise ConfigError(
                    f"table {name!r} in the data directory has a different config than the tables file; "
                    "delete the table (DELETE /v1/tables/{name}) or change the file"
                )
            spec = TableSpec(table.config, table.optimizer)
            self._install(name, spec, source=table, version=version, journal_create=False)
            logger.info("loaded table %s at version %d from the data directory", name, version)
        for name, spec in specs.items():
            if name not in self._registry.tables:
                self.create(name, spec)
        if not self._registry.tables and settings.config is None and settings.default_table:
            self.create("demo", demo_table_spec())

    # -- registry ---------------------------------------------------------------------------------

    def refresh(self) -> None:
        """Map tables created and drop tables deleted by any worker since this worker last looked."""
        generation = int(self._generation_np[0])
        if generation == self._seen_generation:
            return
        with self._registry_lock.hold(), self._sync_lock:
            self._sync(self.directory.read_registry(), int(self._generation[0]))

    def _sync(self, registry: Registry, generation: int) -> None:
        arrays = {aid: a for aid, a in self._arrays.items() if aid in registry.arrays}
        # Kept across a load's switch: the threads of this process must keep excluding each other.
        locks = {lid: lock for lid, lock in self._locks.items() if registry.lock_in_use(lid)}
        entries: dict[str, TableEntry] = {}
        for name, record in registry.tables.items():
            current = self._entries.get(name)
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
        self._arrays, self._entries, self._locks, self._registry = arrays, entries, locks, registry
        self._seen_generation = generation

    def _map_array(self, array_id: str, record: dict[str, Any]) -> SharedArray:
        tensors = {
            key: self.directory.map(
                f"arrays/{array_id}.{key}", shape_numel(tuple(shape)), dtype_from_name(dtype)
            ).view(tuple(shape))
            for key, (shape, dtype) in record["layout"].items()
        }
        return SharedArray(array_id, tensors)

    def _publish(self, registry: Registry) -> None:
        """Write the registry and bump the generation; caller holds the registry lock."""
        self.directory.write_registry(registry)
        generation = int(self._generation[0]) + 1
        self._generation[0] = generation
        with self._sync_lock:
            self._sync(registry, generation)

    def _entry(self, name: str) -> TableEntry:
        self.refresh()
        entry = self._entries.get(name)
        if entry is None:
            raise NotFoundError(f"no table named {name!r}")
        return entry

    # -- tables -----------------------------------------------------------------------------------

    def names(self) -> list[str]:
        self.refresh()
        return sorted(self._entries)

    def table(self, name: str) -> Table:
        """The core Table (over shared memory) named ``name``."""
        return self._entry(name).table

    def version(self, name: str) -> int:
        return self._entry(name).version

    def info(self, name: str) -> TableInfo:
        entry = self._entry(name)
        registry = self._registry
        array_record = registry.arrays.get(entry.array.array_id, {})
        return TableInfo(
            name=name,
            config=entry.table.config,
            optimizer=entry.table.optimizer,
            version=entry.version,
            array=entry.array.array_id,
            array_tables=registry.array_tables(entry.array.array_id),
            memory_bytes=int(array_record.get("nbytes", 0)),
        )

    def create(self, name: str, spec: TableSpec) -> TableInfo:
        """Create a table (new zero-version array, or sharing ``spec.share_array_with``'s array)."""
        validate_table_name(name)
        self._check_config_limits(spec.config)
        with self._registry_lock.hold():
            registry = self.directory.read_registry()
            if name in registry.tables:
                raise ConflictError(f"table {name!r} already exists")
            if len(registry.tables) >= self.limits.max_tables:
                raise LimitExceededError(f"there are already max_tables={self.limits.max_tables} tables")
            if spec.share_array_with is not None:
                source = self._shared_array_source(registry, spec)
                self._register(
                    registry, name, spec.config, spec.optimizer, source["array"], source["lock"], version=0
                )
        if spec.share_array_with is not None:
            return self.info(name)
        return self._install(name, spec, source=None, version=0, journal_create=True)

    def create_from(self, name: str, table: Table, version: int = 0) -> TableInfo:
        """Create table ``name`` holding a copy of ``table``'s array and optimizer state (an import) at
        ``version``; journalled like ``create``."""
        validate_table_name(name)
        self._check_config_limits(table.config)
        spec = TableSpec(table.config, table.optimizer)
        return self._install(name, spec, source=table, version=version, journal_create=True)

    def _check_config_limits(self, config: TableConfig) -> None:
        if config.embedding_dim > self.limits.max_embedding_dim:
            raise LimitExceededError(
                f"embedding_dim {config.embedding_dim} is over the limit "
                f"max_embedding_dim={self.limits.max_embedding_dim}"
            )
        if config.memory_size > self.limits.max_memory_size:
            raise LimitExceededError(
                f"memory_size {config.memory_size} is over the limit "
                f"max_memory_size={self.limits.max_memory_size}"
            )

    def _check_memory(self, registry: Registry, nbytes: int, what: str) -> None:
        total = registry.total_bytes() + nbytes
        if total > self.limits.max_total_memory_bytes:
            raise LimitExceededError(
                f"{what} needs {nbytes} bytes; with the {registry.total_bytes()} bytes in use "
                f"that is over the limit max_total_memory_bytes={self.limits.max_total_memory_bytes}"
            )

    def _shared_array_source(self, registry: Registry, spec: TableSpec) -> dict[str, Any]:
        """The registry record of the table whose array (and update lock) ``spec`` asks to share."""
        source_name = spec.share_array_with
        source = registry.tables.get(source_name or "")
        if source is None:
            raise NotFoundError(f"share_array_with: no table named {source_name!r}")
        if not isinstance(self.journal, NullJournal):
            raise ConfigError(
                "share_array_with is not available with a data directory: the write-ahead log is per table"
            )
        source_config = TableConfig.from_dict(source["config"])
        if spec.config.memory_size != source_config.memory_size:
            raise ConfigError(
                f"share_array_with={source_name!r}: memory_size must be the shared array's "
                f"{source_config.memory_size}, got {spec.config.memory_size}"
            )
        if spec.optimizer != OptimizerConfig.from_dict(source["optimizer"]):
            raise ConfigError(
                f"share_array_with={source_name!r}: the optimizer must be the shared array's "
                f"({source['optimizer']}); its state is shared too"
            )
        return source

    def _new_array(
        self, registry: Registry, config: TableConfig, optimizer: OptimizerConfig, source: Table | None
    ) -> tuple[str, Table]:
        """Allocate an array in shared memory, fill it from ``source`` (or a freshly initialised Table) and
        add it to ``registry`` (not yet published); returns its id and a Table over it. Caller holds the
        registry lock and removes the array with ``_remove_array`` if what follows fails."""
        layout = array_layout(config, optimizer)
        nbytes = layout_bytes(layout)
        array_id = secrets.token_hex(8)
        tensors: dict[str, Tensor] = {}
        try:
            for key, (shape, dtype) in layout.items():
                tensors[key] = self.directory.allocate(
                    f"arrays/{array_id}.{key}", shape_numel(shape), dtype
                ).view(shape)
            # The core initialises a new array (seeded) or brings a loaded one; both are copied into shared
            # memory once, so the private copy lives only for this call.
            fresh = source if source is not None else Table(config, optimizer)
            for key, tensor in fresh.tensors().items():
                tensors[key].copy_(tensor.reshape(tensors[key].shape))
            del fresh
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
        for key in layout:
            (self.directory.arrays_dir / f"{array_id}.{key}").unlink(missing_ok=True)

    def _install(
        self, name: str, spec: TableSpec, *, source: Table | None, version: int, journal_create: bool
    ) -> TableInfo:
        """Allocate a new array for ``name``, fill it from ``source`` (or a freshly initialised Table),
        ``journal.create`` it if asked (not for tables loaded from the journal), then publish it."""
        if spec.share_array_with is not None:
            raise ConfigError("a table with its own array cannot also share one")
        nbytes = layout_bytes(array_layout(spec.config, spec.optimizer))
        with self._registry_lock.hold():
            registry = self.directory.read_registry()
            if name in registry.tables:
                raise ConflictError(f"table {name!r} already exists")
            if len(registry.tables) >= self.limits.max_tables:
                raise LimitExceededError(f"there are already max_tables={self.limits.max_tables} tables")
            self._check_memory(registry, nbytes, "the table")
            array_id, shared = self._new_array(registry, spec.config, spec.optimizer, source)
            journaled = False
            try:
                if journal_create:
                    self.journal.create(name, shared, version)
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
        return self.info(name)

    def _drop_quietly(self, name: str) -> None:
        """Roll back a ``journal.create``; a failure here is logged, the caller's error is what counts."""
        try:
            self.journal.drop(name)
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
        counters = self.directory.allocate(f"tables/{uid}.counters", NUM_COUNTERS, torch.int64)
        counters[VERSION] = version
        registry.tables[name] = {
            "uid": uid,
            "array": array_id,
            "lock": lock_id,
            "config": config.to_dict(),
            "optimizer": optimizer.to_dict(),
        }
        try:
            self._publish(registry)
        except BaseException:
            (self.directory.tables_dir / f"{uid}.counters").unlink(missing_ok=True)
            raise

    def delete(self, name: str) -> None:
        """Remove a table; its array goes when no other table reads it. In-flight lookups in other
        workers keep their mapping until they finish (unlinked files live while mapped).

        Marked ``DELETING`` first: a worker killed before the registry is published leaves the table
        served but perhaps gone from the data directory; the next holder of the lock writes it back
        (``_repair_load_or_delete``). On an error the mark stays for the same reason."""
        with self._locked(name) as entry, self._registry_lock.hold():
            registry = self.directory.read_registry()
            record = registry.tables.get(name)
            if record is None or record["uid"] != entry.uid:  # changes of a table hold its lock
                raise CorruptionError(f"the registry changed table {name!r} behind its update lock")
            self._remove_orphans(registry)
            entry.set_pending(DELETING)
            self.journal.drop(name)
            self._die_at("delete:dropped")
            del registry.tables[name]
            if not registry.array_tables(record["array"]):
                del registry.arrays[record["array"]]
            self._publish(registry)
            self._die_at("delete:published")
            entry.counters[STATE] = DELETED  # updates waiting on the lock see this and answer 404
            entry.set_pending(0)
            self._release(registry, [(record["uid"], record["array"], record["lock"])])

    def _release(self, registry: Registry, records: list[tuple[str, str, str]]) -> None:
        """Unlink the counters of replaced or deleted table records (uid, array, lock), and their arrays
        and locks once no table of the published ``registry`` uses them. Mappings held by in-flight
        requests stay valid: an unlinked file lives until its last mapping goes."""
        for uid, array_id, lock_id in records:
            (self.directory.tables_dir / f"{uid}.counters").unlink(missing_ok=True)
            if array_id not in registry.arrays:
                for path in self.directory.arrays_dir.glob(f"{array_id}.*"):
                    path.unlink(missing_ok=True)
            if not registry.lock_in_use(lock_id):
                (self.directory.locks_dir / f"{lock_id}.lock").unlink(missing_ok=True)

    # -- data path --------------------------------------------------------------------------------

    def lookup(
        self,
        name: str,
        ids: Tensor,
        offsets: Tensor | None = None,
        pooling: Pooling = "none",
        per_sample_weights: Tensor | None = None,
    ) -> LookupResult:
        """Rows of ``ids`` (int64 (n,)) -> float32 (n, d); with ``pooling`` sum/mean, bags delimited by
        ``offsets`` (int64 (B,), nn.EmbeddingBag style; None = one bag) -> (B, d). Never takes a lock."""
        entry = self._entry(name)
        table = entry.table
        self.limits.check_request(
            int(ids.shape[0]) if ids.dim() == 1 else int(ids.numel()), table.config.embedding_dim
        )
        bag_offsets = weights = None
        if pooling != "none" or offsets is not None or per_sample_weights is not None:
            table.validate_ids(ids)
            bag_offsets, weights = _validate_pooling(ids, offsets, pooling, per_sample_weights)
        version = entry.version
        rows, hash_seconds, lookup_seconds = table.lookup_timed(ids)  # checks ids
        if pooling != "none":
            assert bag_offsets is not None
            start = time.perf_counter()
            positions = torch.arange(rows.shape[0], dtype=torch.int64)
            rows = F.embedding_bag(positions, rows, bag_offsets, mode=pooling, per_sample_weights=weights)
            lookup_seconds += time.perf_counter() - start
        return LookupResult(rows, version, hash_seconds, lookup_seconds)

    def lookup_many(self, items: list[LookupRequestItem]) -> list[LookupResult]:
        """Several lookups in one request; the request limits apply to their sum. All tables are
        resolved and the limits checked before any lookup runs."""
        total_ids = total_values = 0
        for item in items:
            num_ids = max(1, int(item.ids.numel()))  # an empty lookup still costs a table resolution
            total_ids += num_ids
            total_values += num_ids * self._entry(item.table).table.config.embedding_dim
        self.limits.check_request(total_ids, 0)
        if total_values > self.limits.max_values_per_request:
            raise LimitExceededError(
                f"{total_values} values in one request; the limit is "
                f"max_values_per_request={self.limits.max_values_per_request}"
            )
        return [
            self.lookup(item.table, item.ids, item.offsets, item.pooling, item.per_sample_weights)
            for item in items
        ]

    def update(self, name: str, ids: Tensor, grads: Tensor, lr: float | None = None) -> UpdateResult:
        """Apply the table's optimizer to the gradients ``grads`` (float32 (n, d)) of the rows of ``ids``
        (int64 (n,)); duplicates are summed. Journalled before it is applied; nothing changes on error.
        Returns once the update is as durable as the journal's fsync policy promises."""
        done = self.apply_update(name, ids, grads, lr)
        assert done is not None  # blocking
        result, ticket = done
        self.journal.wait_durable(ticket)
        return result

    def journal_is_memory_only(self) -> bool:
        """True when updates are journalled nowhere (no data directory): applying one does no I/O."""
        return isinstance(self.journal, NullJournal)

    def apply_update(
        self, name: str, ids: Tensor, grads: Tensor, lr: float | None = None, *, blocking: bool = True
    ) -> tuple[UpdateResult, int] | None:
        """``update`` without the final wait: returns the journal ticket to pass to
        ``journal.wait_durable`` before acknowledging. The HTTP route waits outside its compute slot, so
        updates waiting for one group-commit flush do not hold back others from joining it.

        ``blocking=False``: returns None, having changed nothing, when the table's update lock is held
        elsewhere (the caller, on the event loop, then retries from a worker thread)."""
        entry = self._entry(name)
        table = entry.table
        self.limits.check_request(int(ids.numel()), table.config.embedding_dim)
        applied_lr = table.optimizer.lr if lr is None else float(lr)
        if not (applied_lr > 0 and applied_lr != float("inf")):
            raise InvalidInputError(f"lr must be a positive finite number, got {lr}")
        start = time.perf_counter()
        # ``hash`` checks the ids and ``prepare_step`` the gradients (finite, one row of d per id), both
        # before anything changes.
        # Hashing reads only the config, so it runs outside the lock; so does coalescing the step.
        chunk_offsets = table.hash(ids)
        hashed = time.perf_counter()
        # also: lr <= the table's max_lr
        step = table.prepare_step(chunk_offsets, grads, applied_lr, offsets_from_hash=True)
        prepared = time.perf_counter()
        with self._try_locked(name, blocking) as locked:
            if locked is None:
                return None
            if locked is not entry:  # a load switched the table meanwhile (same config: checked again)
                table = locked.table
                table.validate_grads(ids, grads)
                chunk_offsets = table.hash(ids)
                step = table.prepare_step(chunk_offsets, grads, applied_lr, offsets_from_hash=True)
            version = locked.version + 1
            # Before the log: a step that would leave a non-finite value is refused, nothing changed.
            table.check_step(step)
            # Marked before the append, cleared after the bump: a worker that dies in between leaves the
            # mark for the next holder of the lock to repair (see the module docstring).
            locked.set_pending(version)
            try:
                ticket = self.journal.append(UpdateRecord(name, version, ids, grads, applied_lr))
            except BaseException:
                locked.set_pending(0)  # a failed append leaves the log as it was
                raise
            if self._fault_file is not None:
                self._fault_point(table, chunk_offsets, grads, applied_lr)
            apply_start = time.perf_counter()
            table.apply_step(step)  # if it raises, the mark stays
            applied = time.perf_counter()
            locked.set_version(version)
            locked.set_pending(0)
        # The caller waits for durability outside the lock (group commit): the next updates append
        # while this one waits for its flush.
        apply_seconds = (prepared - hashed) + (applied - apply_start)
        return UpdateResult(version, hashed - start, apply_seconds), ticket

    # -- replicated mode: the log decides the order and the versions (service/replication/) ----------

    def validate_update(self, name: str, ids: Tensor, grads: Tensor, lr: float | None = None) -> float:
        """Every check ``apply_update`` makes before it changes anything; returns the lr to apply. A
        replica runs it before publishing, so a bad push is a 4xx and never reaches the log."""
        table = self._entry(name).table
        self.limits.check_request(int(ids.numel()), table.config.embedding_dim)
        table.validate_grads(ids, grads)
        applied_lr = table.optimizer.lr if lr is None else float(lr)
        if not (applied_lr > 0 and applied_lr != float("inf")):
            raise InvalidInputError(f"lr must be a positive finite number, got {lr}")
        # lr <= the table's max_lr, and a step that would leave a non-finite value on the table as this
        # replica has it now is refused before it is published (apply_logged checks again, at its version).
        table.check_step(table.prepare_step(table.hash(ids), grads, applied_lr))
        return applied_lr

    def apply_logged(self, record: UpdateRecord) -> UpdateResult | None:
        """Apply the update at log position ``record.version``: the table goes from ``version - 1`` to
        ``version``. None if the table already has it (a replay). A gap is a ``CorruptionError``: the
        caller reads the log from the wrong place. The journal is not called: the log is the journal."""
        entry = self._entry(record.table)
        start = time.perf_counter()
        chunk_offsets = entry.table.hash(record.ids)
        hashed = time.perf_counter()
        with self._locked(record.table) as locked:
            if locked.version >= record.version:
                return None
            if locked.version != record.version - 1:
                raise CorruptionError(
                    f"table {record.table!r} is at version {locked.version}; "
                    f"log position {record.version} cannot follow it"
                )
            if locked is not entry:
                chunk_offsets = locked.table.hash(record.ids)
            apply_start = time.perf_counter()
            step = locked.table.prepare_step(chunk_offsets, record.grads, record.lr)
            try:
                locked.table.check_step(step)
            except InvalidInputError as error:
                # Published after a check against an earlier version, but at this version the step would
                # leave a non-finite value: every replica is at these same bytes, so every replica skips
                # it alike; the version still advances (an empty update), keeping versions equal.
                logger.warning("table %r: log entry %d skipped: %s", record.table, record.version, error)
            else:
                locked.table.apply_step(step)
            applied = time.perf_counter()
            locked.set_version(record.version)
        return UpdateResult(record.version, hashed - start, applied - apply_start)

    def checksum(self, name: str) -> tuple[int, str]:
        """(version, sha256 hex) over the array and optimizer state, taken under the update lock, so the
        digest is of exactly that version. Replicas at the same version have the same digest."""
        with self.exclusive(name) as (table, version):
            digest = hashlib.sha256()
            for key, tensor in sorted(table.tensors().items()):
                digest.update(key.encode())
                digest.update(tensor.contiguous().view(torch.uint8).numpy().data)
            return version, digest.hexdigest()

    def warm_up(self) -> None:
        """Load the compiled kernels now (numba's on-disk cache), so a worker's first lookup or update is
        not the one that pays for it. Lookups read the real tables; updates run on a tiny private table
        of the same kind (same hash, chunk size and optimizer), so nothing shared changes."""
        probe = torch.zeros(1, dtype=torch.int64)
        kinds = set()
        for entry in list(self._entries.values()):
            table = entry.table
            table.gather(table.hash(probe))
            config = table.config
            kinds.add((config.embedding_dim, config.chunk_size, config.hash, table.optimizer))
        if not kinds:
            # No table yet (tables come later through the API or the log): load the kernels of the
            # default kind, so the first request after a table is created does not pay ~0.3 s for them.
            demo = demo_table_spec()
            kinds.add((demo.config.embedding_dim, demo.config.chunk_size, demo.config.hash, demo.optimizer))
        for embedding_dim, chunk_size, hash_name, optimizer in kinds:
            tiny = TableConfig(
                1, embedding_dim, memory_size=2 * chunk_size, chunk_size=chunk_size, hash=hash_name
            )
            private = Table(tiny, optimizer)
            private.gather(private.hash(probe))
            private.apply_gradients(probe, torch.zeros(1, embedding_dim))

    # -- durability hooks for the snapshot / load endpoints -----------------------------------------

    @contextmanager
    def _locked(self, name: str) -> Iterator[TableEntry]:
        """The table's current entry, its update lock held: no update, snapshot, load or delete of it runs
        meanwhile. An entry a load replaced while this waited for the lock is looked up again; one whose
        last holder died in the middle of an update is repaired first."""
        with self._try_locked(name, blocking=True) as entry:
            assert entry is not None
            yield entry

    @contextmanager
    def _try_locked(self, name: str, blocking: bool) -> Iterator[TableEntry | None]:
        """As ``_locked``; with ``blocking=False`` None at once when the lock is held elsewhere."""
        for _ in range(_MAX_SWITCHES):
            entry = self._entry(name)
            with entry.lock.hold(blocking) as held:
                if not held:
                    yield None
                    return
                if entry.pending and entry.state == LIVE:
                    self._repair(entry)  # may find the dead holder's load or delete published
                state = entry.state
                if state == REPLACED:
                    continue
                if state == DELETED:
                    raise NotFoundError(f"no table named {name!r}")
                yield entry
                return
        raise BusyError(f"table {name!r} was replaced {_MAX_SWITCHES} times in a row; try again")

    def _repair(self, entry: TableEntry) -> None:
        """Undo what a dead holder of the table's lock left unfinished; caller holds the lock."""
        version, pending = entry.version, entry.pending
        if pending in (LOADING, DELETING):
            self._repair_load_or_delete(entry)
            return
        what = f"while applying update {pending}" if pending > 0 else "while it held the table's lock"
        rebuilt = self.journal.recover(entry.name, version)
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

    def _repair_load_or_delete(self, entry: TableEntry) -> None:
        """A load or delete of this table died (or failed) under the lock: make the data directory and
        the shared memory agree with what the registry publishes. Caller holds the table's lock.

        Not published (the registry still has this entry): every worker serves this entry, intact (a
        load or delete never writes the array lookups read), so it is the truth; the data directory may
        hold the new table or none, so the table is written again from memory at its version. Published:
        the load or delete took effect and the data directory already agrees; this entry is marked
        replaced or deleted, so whoever holds it goes to the registry again. Either way the shared files
        no published table uses are removed (the dead worker's new or old array, counters, lock)."""
        name, what = entry.name, "loading" if entry.pending == LOADING else "deleting"
        with self._registry_lock.hold():
            registry = self.directory.read_registry()
            record = registry.tables.get(name)
            if record is not None and record["uid"] == entry.uid:
                self._write_journal(name, entry.table, entry.version)
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
            self._remove_orphans(registry)
            entry.set_pending(0)

    def _write_journal(self, name: str, table: Table, version: int) -> None:
        """Make the journal hold ``table`` at ``version`` as table ``name``, whatever it held before."""
        if name in self.journal.names():
            self.journal.snapshot(name, table, version)
        else:
            self.journal.create(name, table, version)

    def _remove_orphans(self, registry: Registry) -> None:
        """Remove the shared files no table of the published ``registry`` uses: what a worker killed in a
        load or delete left (every array, counter and lock is created and released under the registry
        lock, which the caller holds). Orphaned counters are marked replaced first, so a request holding
        them looks the table up again."""
        uids = {record["uid"] for record in registry.tables.values()}
        for path in self.directory.tables_dir.glob("*.counters"):
            if path.name.removesuffix(".counters") in uids:
                continue
            try:
                counters = self.directory.map(f"tables/{path.name}", NUM_COUNTERS, torch.int64)
                if int(counters[STATE]) == LIVE:
                    counters[STATE] = REPLACED
            except CorruptionError:
                pass  # cut short while it was allocated: no one maps it
            path.unlink(missing_ok=True)
        for path in self.directory.arrays_dir.iterdir():
            if path.name.split(".", 1)[0] not in registry.arrays:
                path.unlink(missing_ok=True)
        for path in self.directory.locks_dir.glob("*.lock"):
            if not registry.lock_in_use(path.name.removesuffix(".lock")):
                path.unlink(missing_ok=True)

    def _fault_point(self, table: Table, chunk_offsets: Tensor, grads: Tensor, lr: float) -> None:
        """Testing only: once for each time the fault file is created (empty, or naming
        ``update:appended``), apply the first half of the update's rows (a half-applied update) and
        SIGKILL this process before the counter bump."""
        if not faults.armed(self._fault_file, faults.UPDATE_APPENDED):
            return
        half = max(1, int(grads.shape[0]) // 2)
        table.apply_gradients_at(chunk_offsets[:half], grads[:half], lr)
        os.kill(os.getpid(), signal.SIGKILL)

    def _die_at(self, point: str) -> None:
        """Testing only: SIGKILL this process here if the fault file names ``point`` (service/faults.py)."""
        if self._fault_file is not None:
            faults.die_at(self._fault_file, point)

    @contextmanager
    def exclusive(self, name: str) -> Iterator[tuple[Table, int]]:
        """Hold the table's update lock: yields (table, version) with no update running or starting.

        Marked pending meanwhile, like an update: if this worker dies while it holds the lock (in the
        middle of a snapshot, say), the next holder repairs the table from the journal."""
        with self._locked(name) as entry:
            entry.set_pending(EXCLUSIVE)
            try:
                yield entry.table, entry.version
            finally:
                entry.set_pending(0)

    def snapshot(self, name: str) -> int:
        """Journal a snapshot of the table at its current version (no update in between); returns it."""
        with self.exclusive(name) as (table, version):
            self.journal.snapshot(name, table, version)
            return version

    def restore(self, name: str, source: Table, version: int) -> None:
        """Replace the table's array and optimizer state by a copy of ``source`` (same config and
        optimizer) at ``version``, atomically for lookups (see the module docstring).

        Under the table's update lock: a new array is filled from ``source`` and made durable first
        (``journal.snapshot``: snapshot + empty log), then the registry is switched to it. If any step
        fails the table is left as it was, in memory and on disk. Every table sharing the array switches
        with it. While both arrays exist they count against ``max_total_memory_bytes`` together.

        The old and the new counters are marked ``LOADING`` until the old array is released: if this
        worker dies meanwhile, the next holder of the lock puts the data directory and the shared
        memory back in line with whichever table the registry publishes (``_repair_load_or_delete``).
        """
        with self._locked(name) as entry, self._registry_lock.hold():
            table = entry.table
            if (source.config, source.optimizer) != (table.config, table.optimizer):
                raise ConflictError(f"the checkpoint's config or optimizer differs from table {name!r}'s")
            registry = self.directory.read_registry()
            record = registry.tables.get(name)
            if record is None or record["uid"] != entry.uid:  # changes of a table hold its lock
                raise CorruptionError(f"the registry changed table {name!r} behind its update lock")
            old_array = record["array"]
            self._remove_orphans(registry)
            self._check_memory(registry, int(registry.arrays[old_array]["nbytes"]), "loading the table")
            sharers = [  # mapped here: this worker may not have synced a sharer created meanwhile
                self.directory.map(
                    f"tables/{registry.tables[sharer]['uid']}.counters", NUM_COUNTERS, torch.int64
                )
                for sharer in registry.array_tables(old_array)
            ]
            for counters in sharers:
                counters[PENDING] = LOADING
            try:
                array_id, shared = self._new_array(registry, table.config, table.optimizer, source)
            except BaseException:  # nothing was written: no array, nothing on disk
                for counters in sharers:
                    counters[PENDING] = 0
                raise
            self._die_at("load:filled")
            try:
                self.journal.snapshot(name, shared, version)
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
                self._entries[sharer_name].set_pending(0)

    def _switch(
        self, registry: Registry, old_array: str, array_id: str, name: str, version: int
    ) -> list[tuple[str, str, str]]:
        """Point every table reading ``old_array`` at ``array_id`` (``name`` at ``version``, the others at
        their own versions), publish, and mark their old counters replaced; returns the old records."""
        sharers = registry.array_tables(old_array)
        old_records = {table_name: dict(registry.tables[table_name]) for table_name in sharers}
        old_counters = {
            table_name: self.directory.map(f"tables/{record['uid']}.counters", NUM_COUNTERS, torch.int64)
            for table_name, record in old_records.items()
        }
        old_array_record = registry.arrays[old_array]
        new_uids: dict[str, str] = {}
        try:
            for table_name in sharers:
                uid = new_uids[table_name] = secrets.token_hex(8)
                counters = self.directory.allocate(f"tables/{uid}.counters", NUM_COUNTERS, torch.int64)
                counters[VERSION] = version if table_name == name else old_counters[table_name][VERSION]
                counters[PENDING] = LOADING  # until the old array is released (restore clears it)
                registry.tables[table_name] = {**old_records[table_name], "uid": uid, "array": array_id}
            del registry.arrays[old_array]
            self._publish(registry)
            self._die_at("load:published")
        except BaseException:
            registry.tables.update(old_records)
            registry.arrays[old_array] = old_array_record
            for uid in new_uids.values():
                (self.directory.tables_dir / f"{uid}.counters").unlink(missing_ok=True)
            raise
        # Published: updates still holding the old entries start again on the new ones.
        for counters in old_counters.values():
            counters[STATE] = REPLACED
        return [(old["uid"], old["array"], old["lock"]) for old in old_records.values()]

    def _restore_journal(self, name: str, table: Table, version: int) -> bool:
        """After a load was made durable but could not be switched to: put the old table back on disk.
        Returns whether it did; if not, the caller leaves the table marked for the next holder to."""
        try:
            self._write_journal(name, table, version)
        except Exception:
            logger.exception(
                "table %r: a load was written to the data directory but could not be served, and the old "
                "table could not be written back yet; the next holder of its lock tries again",
                name,
            )
            return False
        return True

    def close(self) -> None:
        """Release this worker's locks and mappings (the shared directory stays; its owner removes it)."""
        with self._sync_lock:
            for lock in self._locks.values():
                lock.close()
            self._arrays, self._entries, self._locks = {}, {}, {}
        self._registry_lock.close()


def _validate_pooling(
    ids: Tensor, offsets: Tensor | None, pooling: str, per_sample_weights: Tensor | None
) -> tuple[Tensor | None, Tensor | None]:
    """Checks nn.EmbeddingBag-style bags; returns (offsets, per_sample_weights) ready for pooling."""
    if pooling not in POOLINGS:
        raise InvalidInputError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    num_ids = int(ids.shape[0])
    if pooling == "none":
        if offsets is not None or per_sample_weights is not None:
            raise InvalidInputError("offsets and per_sample_weights need pooling 'sum' or 'mean'")
        return None, None
    if offsets is None:
        offsets = torch.zeros(1, dtype=torch.int64)
    if offsets.dtype != torch.int64 or offsets.dim() != 1:
        raise InvalidInputError("offsets must be a 1-D list of int64 bag starts")
    if offsets.numel() > 0:
        if int(offsets[0]) != 0:
            raise InvalidInputError(f"offsets[0] must be 0, got {int(offsets[0])}")
        if bool((offsets[1:] < offsets[:-1]).any()) or int(offsets[-1]) > num_ids:
            raise InvalidInputError(f"offsets must be non-decreasing and at most len(ids) = {num_ids}")
    if per_sample_weights is not None:
        if pooling != "sum":
            raise InvalidInputError("per_sample_weights need pooling 'sum' (as in nn.EmbeddingBag)")
        if per_sample_weights.dim() != 1 or int(per_sample_weights.shape[0]) != num_ids:
            raise InvalidInputError(f"per_sample_weights must have one weight per id ({num_ids})")
        per_sample_weights = per_sample_weights.to(torch.float32)
        if not bool(torch.isfinite(per_sample_weights).all()):
            raise InvalidInputError("per_sample_weights must be finite (no NaN or Inf)")
    return offsets, per_sample_weights
