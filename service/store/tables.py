"""``TableStore``: the tables of one server as one worker sees them.

The files, their layout and the per-table counters are in ``shm.py``; this package is what workers do
with them. This module holds the data path (lookups, updates, the replicated apply); the registry view
and the table's update lock that every change takes are ``registry.py``, creating, loading and deleting
tables is ``admin.py``, and repairing what a worker killed under a table's lock left is ``repair.py``.

Consistency: updates of an array are serialised by its lock; lookups never take it. A lookup running
while an update is applied may read a row with some values from before and some from after that update
(values are float32 stores, never torn); every lookup that starts after an update's response was sent
sees the whole update, since the update finished writing before it responded. A lookup reports the table
version read before it gathered: its rows include at least that many updates.

An update marks ``pending`` before it appends to the journal and clears it after the version counter is
bumped; whoever takes the lock next and finds the mark set repairs the table first (``repair.py``).

Lock order, everywhere: a table's update lock, then the registry lock (``registry.py``).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from robez_core.config import TableConfig
from robez_core.errors import (
    CorruptionError,
    InvalidInputError,
    LimitExceededError,
)
from robez_core.optim import PreparedStep
from robez_core.small import SMALL_BATCH_MAX_IDS
from robez_core.table import CheckpointFile, Table

from .. import faults, tracing
from ..config import Settings, TableSpec, demo_table_spec, load_tables_file
from ..errors import RefusedUpdateError
from ..shm import (
    SharedDirectory,
    TableEntry,
)
from .admin import TableAdmin
from .api import (
    POOLINGS,
    Limits,
    LookupRequestItem,
    LookupResult,
    Pooling,
    TableInfo,
    UpdateResult,
    validate_table_name,
)
from .journal import Journal, NullJournal, SkippedRecord, UpdateRecord
from .live_copy import consistent_copy
from .registry import TableRegistry
from .repair import repair

logger = logging.getLogger("robez.store")


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
        # Testing only (service/faults.py): die half-way through an update; see _fault_point.
        self._fault_file = faults.fault_file()
        # The null journal itself (not a subclass that observes appends): an update appends nothing, so a
        # small one can skip the append and be checked and applied in one compiled call (_apply_unjournalled).
        self._small_unjournalled = type(journal) is NullJournal and self._fault_file is None
        # The registry view and the tables' update locks (registry.py); whoever takes a lock its last
        # holder left in the middle of a change repairs the table first (repair.py).
        self.registry = TableRegistry(directory, lambda entry: repair(self.registry, journal, entry))
        self._admin = TableAdmin(self.registry, journal, self.limits)  # create, load, delete: admin.py

    # -- start-up ---------------------------------------------------------------------------------

    @classmethod
    def prepare(cls, settings: Settings, journal: Journal) -> SharedDirectory:
        """Create the shared directory and fill it: tables from the data directory, then the tables file,
        then (if neither named any and ``default_table``) the ``demo`` table. Called once, by the process
        that starts the workers; the workers attach with ``TableStore(directory, ...)``."""
        directory = SharedDirectory.create(settings.shm_dir)
        try:
            cls.fill(directory, settings, journal)
        except BaseException:
            directory.remove()
            raise
        return directory

    @classmethod
    def fill(cls, directory: SharedDirectory, settings: Settings, journal: Journal) -> None:
        """``prepare``'s second half, into a directory already created (``SharedDirectory.create``): the
        server's workers may start meanwhile (they attach once this returns). The caller removes the
        directory if this raises."""
        store = cls(directory, settings, journal)
        try:
            store._load_initial_tables(settings)
        finally:
            store.close()

    def _load_initial_tables(self, settings: Settings) -> None:
        specs = load_tables_file(settings.config) if settings.config is not None else {}
        stored: dict[str, TableSpec] = {}
        for name in self.journal.names():
            found = self.journal.stored_spec(validate_table_name(name))
            if found is not None:
                stored[name] = TableSpec(*found)
        where = f"tables file {settings.config}" if settings.config is not None else "no tables file"
        self._admin.check_start(stored, specs, where)  # the whole file, before anything is created
        for name, spec in stored.items():
            # Read straight into the table's shared memory: no private copy (docs/durability.md, memory).
            self._admin.install(
                name,
                spec,
                source=None,
                version=0,
                journal_create=False,
                load=partial(self.journal.load_into, name),
            )
            logger.info("loaded table %s at version %d from the data directory", name, self.version(name))
        for name, spec in specs.items():
            if name not in self.registry.published.tables:
                self.create(name, spec)
        if not self.registry.published.tables and settings.config is None and settings.default_table:
            self.create("demo", demo_table_spec())

    # -- tables -----------------------------------------------------------------------------------

    def refresh(self) -> None:
        """Map tables created and drop tables deleted by any worker since this worker last looked."""
        self.registry.refresh()

    def names(self) -> list[str]:
        self.registry.refresh()
        return sorted(self.registry.entries)

    def table(self, name: str) -> Table:
        """The core Table (over shared memory) named ``name``."""
        return self.registry.entry(name).table

    def version(self, name: str) -> int:
        return self.registry.entry(name).version

    def info(self, name: str) -> TableInfo:
        entry = self.registry.entry(name)
        registry = self.registry.published
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

    # -- administration (admin.py) ----------------------------------------------------------------

    def create(self, name: str, spec: TableSpec) -> TableInfo:
        """Create a table (new zero-version array, or sharing ``spec.share_array_with``'s array)."""
        self._admin.create(name, spec)
        return self.info(name)

    def create_from(self, name: str, table: Table, version: int = 0) -> TableInfo:
        """Create table ``name`` holding a copy of ``table``'s array and optimizer state (an import) at
        ``version``; journalled like ``create``."""
        self._admin.create_from(name, table, version)
        return self.info(name)

    def create_from_file(self, name: str, path: Path, version: int = 0) -> TableInfo:
        """Create table ``name`` from the robez checkpoint file at ``path`` at ``version``: the shared
        arrays are allocated and read into from the file piece by piece, with no private copy of the table
        (a replica's bootstrap). ``CorruptionError`` (nothing created) if the file is damaged."""
        self._admin.create_from_file(name, CheckpointFile.open(path), version)
        return self.info(name)

    def restore_from_file(self, name: str, path: Path, version: int) -> None:
        """``restore`` from the checkpoint file at ``path``, read straight into the new shared array."""
        self._admin.restore(name, CheckpointFile.open(path), version)

    def delete(self, name: str) -> None:
        """Remove a table; its array goes when no other table reads it (``TableAdmin.delete``)."""
        self._admin.delete(name)

    def snapshot(self, name: str) -> int:
        """Journal a snapshot of the table at its current version (no update in between); returns it."""
        return self._admin.snapshot(name)

    def restore(self, name: str, source: Table, version: int, *, after: int | None = None) -> bool:
        """Replace the table's array and optimizer state by a copy of ``source`` (same config and
        optimizer) at ``version``, atomically for lookups (``TableAdmin.restore``); ``after``: only if
        the table is at that version (False if past it, a gap is a ``CorruptionError``)."""
        return self._admin.restore(name, source, version, after=after)

    # -- data path --------------------------------------------------------------------------------

    def lookup(
        self,
        name: str,
        ids: Tensor | np.ndarray,
        offsets: Tensor | None = None,
        pooling: Pooling = "none",
        per_sample_weights: Tensor | None = None,
    ) -> LookupResult:
        """Rows of ``ids`` (int64 (n,), a tensor or a numpy array) -> float32 (n, d) as a numpy array; with
        ``pooling`` sum/mean, bags delimited by ``offsets`` (int64 (B,), nn.EmbeddingBag style; None = one
        bag) -> (B, d). Never takes a lock."""
        entry = self.registry.entry(name)
        table = entry.table
        self.limits.check_request(_count(ids), table.config.embedding_dim)
        if pooling == "none" and offsets is None and per_sample_weights is None:
            version = entry.version
            if isinstance(ids, np.ndarray):
                rows, hash_seconds, lookup_seconds = table.lookup_timed(ids)  # checks ids
            else:
                tensor_rows, hash_seconds, lookup_seconds = table.lookup_timed(ids)
                rows = tensor_rows.numpy()
            if tracing.TRACER is not None:
                _trace_lookup(name, _count(ids), version, hash_seconds, lookup_seconds)
            return LookupResult(rows, version, hash_seconds, lookup_seconds)
        if isinstance(ids, np.ndarray):
            ids = torch.from_numpy(ids)
        table.validate_ids(ids)
        bag_offsets, weights = _validate_pooling(ids, offsets, pooling, per_sample_weights)
        version = entry.version
        bag_rows, hash_seconds, lookup_seconds = table.lookup_timed(ids)
        if pooling != "none":
            assert bag_offsets is not None
            start = time.perf_counter()
            positions = torch.arange(bag_rows.shape[0], dtype=torch.int64)
            bag_rows = F.embedding_bag(
                positions, bag_rows, bag_offsets, mode=pooling, per_sample_weights=weights
            )
            lookup_seconds += time.perf_counter() - start
        if tracing.TRACER is not None:
            _trace_lookup(name, _count(ids), version, hash_seconds, lookup_seconds)
        return LookupResult(bag_rows.numpy(), version, hash_seconds, lookup_seconds)

    def lookup_many(self, items: list[LookupRequestItem]) -> list[LookupResult]:
        """Several lookups in one request; the request limits apply to their sum. All tables are
        resolved and the limits checked before any lookup runs."""
        total_ids = total_values = 0
        for item in items:
            num_ids = max(1, _count(item.ids))  # an empty lookup still costs a table resolution
            total_ids += num_ids
            total_values += num_ids * self.registry.entry(item.table).table.config.embedding_dim
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
        self,
        name: str,
        ids: Tensor | np.ndarray,
        grads: Tensor | np.ndarray,
        lr: float | None = None,
        *,
        blocking: bool = True,
    ) -> tuple[UpdateResult, int] | None:
        """``update`` without the final wait: returns the journal ticket to pass to
        ``journal.wait_durable`` before acknowledging. The HTTP route waits outside its compute slot, so
        updates waiting for one group-commit flush do not hold back others from joining it. ``ids`` and
        ``grads`` may be numpy arrays (the route's decoded body): a small update without a journal then
        makes no tensor.

        ``blocking=False``: returns None, having changed nothing, when the table's update lock is held
        elsewhere (the caller, on the event loop, then retries from a worker thread)."""
        entry = self.registry.entry(name)
        table = entry.table
        applied_lr = self._check_request(table, _count(ids), lr)
        if self._small_unjournalled and _count(ids) <= SMALL_BATCH_MAX_IDS:
            # Nothing to journal: a small batch is hashed, checked and applied in two compiled calls.
            locked = self.registry.acquire(name, blocking)
            if locked is None:
                return None
            try:
                result = self._apply_unjournalled(locked, ids, grads, applied_lr)
            finally:
                locked.lock.release()
            if tracing.TRACER is not None:
                _trace_update(name, _count(ids), result)
            return result, 0
        ids, grads = _tensor(ids), _tensor(grads)
        start = time.perf_counter()
        # Checked before anything changes; the table's config is all they read, so they run outside the
        # lock (so does coalescing the step).
        step, hash_seconds = _prepare(table, ids, grads, applied_lr)
        prepare_seconds = time.perf_counter() - start - hash_seconds
        with self.registry.try_locked(name, blocking) as locked:
            if locked is None:
                return None
            if locked is not entry:  # a load switched the table meanwhile (same config: checked again)
                table = locked.table
                step, _ = _prepare(table, ids, grads, applied_lr)
            version = locked.version + 1
            # Before the log: a step that would leave a non-finite value is refused, nothing changed.
            _check_step(table, step)
            # Marked before the append, cleared after the bump: a worker that dies in between leaves the
            # mark for the next holder of the lock to repair (see repair.py).
            locked.set_pending(version)
            try:
                if tracing.TRACER is None:
                    ticket = self.journal.append(UpdateRecord(name, version, ids, grads, applied_lr))
                else:
                    with tracing.span("log-append", name, int(ids.numel()), version):
                        ticket = self.journal.append(UpdateRecord(name, version, ids, grads, applied_lr))
            except BaseException:
                locked.set_pending(0)  # a failed append leaves the log as it was
                raise
            if self._fault_file is not None:
                self._fault_point(table, ids, grads, applied_lr)
            timings = apply_record(table, ids, grads, applied_lr, step=step)  # if it raises, the mark stays
            locked.set_version(version)
            locked.set_pending(0)
        # The caller waits for durability outside the lock (group commit): the next updates append
        # while this one waits for its flush.
        assert isinstance(timings, tuple)  # a live push is refused, never skipped
        result = UpdateResult(version, hash_seconds, prepare_seconds + timings[1])
        if tracing.TRACER is not None:
            _trace_update(name, int(ids.numel()), result)
        return result, ticket

    def _apply_unjournalled(
        self, entry: TableEntry, ids: Tensor | np.ndarray, grads: Tensor | np.ndarray, lr: float
    ) -> UpdateResult:
        """The next version of ``entry`` (its lock held) with nothing to journal: the whole update under
        the lock, a small batch in two compiled calls."""
        version = entry.version + 1
        entry.set_pending(version)  # as apply_update: a worker that dies mid-step leaves the mark
        try:
            timings = apply_record(entry.table, ids, grads, lr)
        except InvalidInputError:  # refused before anything changed
            entry.set_pending(0)
            raise
        assert isinstance(timings, tuple)  # a live push is refused, never skipped
        entry.set_version(version)
        entry.set_pending(0)
        return UpdateResult(version, *timings)

    def _check_request(self, table: Table, num_ids: int, lr: float | None) -> float:
        """The checks of an update that read neither its ids nor its gradients: the request limits and the
        lr (``_check_lr``); returns the lr to apply (the request's, else the table's). The rest of the
        validation is ``_prepare``'s, and ``_check_step``'s under the lock."""
        self.limits.check_request(num_ids, table.config.embedding_dim)
        applied_lr = table.optimizer.lr if lr is None else float(lr)
        _check_lr(table, applied_lr)
        return applied_lr

    # -- replicated mode: the log decides the order and the versions (service/replication/) ----------

    def validate_update(self, name: str, ids: Tensor, grads: Tensor, lr: float | None = None) -> float:
        """Every check ``apply_update`` makes before it changes anything; returns the lr to apply. A
        replica runs it before publishing, so a bad push is a 4xx and never reaches the log."""
        table = self.registry.entry(name).table
        applied_lr = self._check_request(table, int(ids.numel()), lr)
        step, _ = _prepare(table, ids, grads, applied_lr)
        # A step that would leave a non-finite value on the table as this replica has it now is refused
        # before it is published (apply_logged checks again, at its version).
        _check_step(table, step)
        return applied_lr

    def apply_logged(self, record: UpdateRecord | SkippedRecord) -> UpdateResult | SkippedRecord | None:
        """Apply the entry at log position ``record.version``: the table goes from ``version - 1`` to
        ``version``. None if the table already has it (a replay). An entry that fails a check (decoding
        it, or ``apply_record``'s) is an empty version: the ``SkippedRecord`` is returned. A gap is a
        ``CorruptionError``: the caller reads the log from the wrong place. The journal is not called:
        the log is the journal. The request limits are not applied: they are this server's settings,
        and a log must be applied alike everywhere."""
        with self.registry.locked(record.table) as locked:
            if locked.version >= record.version:
                return None
            if locked.version != record.version - 1:
                raise CorruptionError(
                    f"table {record.table!r} is at version {locked.version}; "
                    f"log position {record.version} cannot follow it"
                )
            outcome = apply_logged_record(locked.table, record)
            locked.set_version(record.version)  # a skipped entry too: versions stay equal on every replica
        if isinstance(outcome, SkippedRecord):
            return outcome
        return UpdateResult(record.version, *outcome)

    def checksum(self, name: str) -> tuple[int, str]:
        """(version, sha256 hex) over the array and optimizer state at one version. Replicas at the same
        version have the same digest. The state is copied into private memory (allocated and filled
        without the update lock: ``consistent_copy``, which holds the lock only to patch the rows updated
        during the copy; the whole copy under the lock where the journal cannot say which: no data
        directory), and hashed without the lock; the copy costs the table's state bytes of private
        memory for the length of the hash."""
        layout = self.registry.entry(name).table.tensors()
        copies = {
            key: np.empty(tuple(t.shape), dtype=t.detach()[:0].numpy().dtype) for key, t in layout.items()
        }
        del layout
        version = consistent_copy(
            name, self.journal, partial(self.exclusive, name), copies, lambda _table, at, _mark: at
        )
        digest = hashlib.sha256()
        for key, copy in sorted(copies.items()):
            digest.update(key.encode())
            view = copy.reshape(-1).view(np.uint8).data
            for start in range(0, len(view), _HASH_PIECE_BYTES):
                digest.update(view[start : start + _HASH_PIECE_BYTES])
                faults.slow_down()
            del view
        return version, digest.hexdigest()

    def warm_up(self) -> None:
        """Load the compiled kernels now (numba's on-disk cache), so a worker's first lookup or update is
        not the one that pays for it. Lookups read the real tables; updates run on a tiny private table
        of the same kind (same hash, chunk size and optimizer), so nothing shared changes."""
        probe = torch.zeros(1, dtype=torch.int64)
        kinds = set()
        for entry in list(self.registry.entries.values()):
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
            grads = torch.zeros(1, embedding_dim)
            private.apply_gradients(probe, grads)  # the small-batch step of the three-part path
            apply_record(private, probe, grads, optimizer.lr)  # and the checked step in one call

    def _fault_point(self, table: Table, ids: Tensor, grads: Tensor, lr: float) -> None:
        """Testing only: once for each time the fault file is created (empty, or naming
        ``update:appended``), apply the first half of the update's rows (a half-applied update) and
        SIGKILL this process before the counter bump."""
        if not faults.armed(self._fault_file, faults.UPDATE_APPENDED):
            return
        half = max(1, int(grads.shape[0]) // 2)
        apply_record(table, ids[:half], grads[:half], lr)
        os.kill(os.getpid(), signal.SIGKILL)

    @contextmanager
    def exclusive(self, name: str) -> Iterator[tuple[Table, int]]:
        """Hold the table's update lock: yields (table, version) with no update running or starting
        (``TableRegistry.exclusive``: marked pending meanwhile, like an update)."""
        with self.registry.exclusive(name) as held:
            yield held

    def close(self) -> None:
        """Release this worker's locks and mappings (the shared directory stays; its owner removes it)."""
        self.registry.close()


# The checksum hashes its copy in pieces of this many bytes (so the test hook can slow it down).
_HASH_PIECE_BYTES = 1 << 24


def _count(values: Tensor | np.ndarray) -> int:
    """How many values (ids) ``values`` holds, a tensor or a numpy array."""
    return int(values.size if isinstance(values, np.ndarray) else values.numel())


def _tensor(values: Tensor | np.ndarray) -> Tensor:
    return torch.from_numpy(values) if isinstance(values, np.ndarray) else values


def _trace_lookup(name: str, ids: int, version: int, hash_seconds: float, gather_seconds: float) -> None:
    """A lookup's ``hash`` and ``gather`` spans, from its own stage timers (it just ended)."""
    gather_start = tracing.stage("gather", name, ids, version, gather_seconds)
    tracing.stage("hash", name, ids, version, hash_seconds, ended_ns=gather_start)


def _trace_update(name: str, ids: int, result: UpdateResult) -> None:
    """An update's ``hash`` and ``apply`` spans, from its own stage timers (it just ended)."""
    apply_start = tracing.stage("apply", name, ids, result.version, result.apply_seconds)
    tracing.stage("hash", name, ids, result.version, result.hash_seconds, ended_ns=apply_start)


def apply_record(
    table: Table,
    ids: Tensor | np.ndarray,
    grads: Tensor | np.ndarray,
    lr: float,
    *,
    step: PreparedStep | None = None,
    logged_as: tuple[str, int] | None = None,
    checked_when_logged: bool = False,
) -> tuple[float, float] | SkippedRecord:
    """Apply one update to ``table``: the one place an update reaches a table's array. Live pushes
    (``TableStore.apply_update``), records replayed from the write-ahead log (``WalJournal.load`` and
    ``recover``), entries of the replicated log (``TableStore.apply_logged``) and the applier's private
    rebuild all come here; ``TableStore`` holds the table's update lock and moves its version around it.
    The table need not be served (a replay at start-up, a rebuild): nothing here reads the registry.

    Args:
        table: the table to change.
        ids: int64 (N,) ids, as sent (duplicates not yet summed); a tensor or a numpy array.
        grads: float32 (N, d) gradients of their rows; a tensor or a numpy array.
        lr: the learning rate to apply, resolved (the request's or the table's).
        step: ``table.prepare_step`` of this very update, already checked (``_check_step``) under the
            lock: only applied. The live path with a journal checks before it appends, so a refused
            update never reaches the log.
        logged_as: (table name, version) of the log record this update is. Every check is then made
            here (the lr too) and an update that fails one (``RefusedUpdateError``: bad lr, ids or
            gradients, or a step that would leave a non-finite value) is skipped with one warning and a
            ``SkippedRecord`` returned: the log holds it, so every replica and every replay skips it
            alike, and the version still advances. Without (a live push, not logged yet, its lr checked
            by the caller) it is refused with the error.
        checked_when_logged: the record is from this server's own write-ahead log, whose records all
            passed ``check_step`` before they were appended: the replay applies the same step to the
            same bytes, so the check (a third of a replay's time) is not made again. The inputs' own
            checks still are.

    Returns (seconds hashing, seconds coalescing, checking and stepping), or the ``SkippedRecord``.
    """
    if step is not None:
        start = time.perf_counter()
        table.apply_step(step)
        return 0.0, time.perf_counter() - start
    try:
        if logged_as is not None:
            _check_lr(table, lr)
        # A small batch is hashed, checked and applied in two compiled calls; None: the general path.
        timings = table.try_checked_update(ids, grads, lr)
        if timings is not None:
            return timings
        start = time.perf_counter()
        step, hash_seconds = _prepare(table, _tensor(ids), _tensor(grads), lr)
        if not checked_when_logged:
            _check_step(table, step)
    except RefusedUpdateError as error:
        if logged_as is None:
            raise
        return skipped(SkippedRecord(*logged_as, error.reason, str(error)))
    table.apply_step(step)
    return hash_seconds, time.perf_counter() - start


def apply_logged_record(
    table: Table, record: UpdateRecord | SkippedRecord
) -> tuple[float, float] | SkippedRecord:
    """One entry of the replicated log applied to ``table`` (served, under its lock, or a private
    rebuild): ``apply_record``, or nothing for an entry that could not even be decoded."""
    if isinstance(record, SkippedRecord):
        return skipped(record)
    return apply_record(table, record.ids, record.grads, record.lr, logged_as=(record.table, record.version))


def skipped(record: SkippedRecord) -> SkippedRecord:
    """Log the one warning a skipped entry gets wherever it is applied; returns it."""
    logger.warning(
        "table %r: log entry %d applied as an empty version (%s): %s",
        record.table,
        record.version,
        record.reason,
        record.detail,
    )
    return record


def _check_lr(table: Table, lr: float) -> None:
    """The lr of an update, resolved: positive, finite and at most the table's ``max_lr``."""
    if not (isinstance(lr, float | int) and lr > 0 and math.isfinite(lr)):
        raise RefusedUpdateError(f"lr must be a positive finite number, got {lr}", "bad_lr")
    if lr > table.optimizer.max_lr:
        raise RefusedUpdateError(
            f"lr {lr:g} is over this table's max_lr={table.optimizer.max_lr:g} (its optimizer config)",
            "bad_lr",
        )


def _prepare(table: Table, ids: Tensor, grads: Tensor, lr: float) -> tuple[PreparedStep, float]:
    """``hash`` (it checks the ids) and ``prepare_step`` (the gradients: finite, one row of d per id; lr
    <= the table's max_lr) of an update: the checks that read only the table's config, so they need no
    lock. Returns the coalesced step and the seconds hashing took. ``RefusedUpdateError`` names the
    check that failed."""
    start = time.perf_counter()
    try:
        chunk_offsets = table.hash(ids)
    except InvalidInputError as error:
        raise RefusedUpdateError(str(error), "bad_ids") from error
    hash_seconds = time.perf_counter() - start
    try:
        step = table.prepare_step(chunk_offsets, grads, lr, offsets_from_hash=True)
    except InvalidInputError as error:
        raise RefusedUpdateError(str(error), "bad_grads") from error
    return step, hash_seconds


def _check_step(table: Table, step: PreparedStep) -> None:
    """``table.check_step`` (under the update lock): the step leaves every value it touches finite."""
    try:
        table.check_step(step)
    except InvalidInputError as error:
        raise RefusedUpdateError(str(error), "non_finite_step") from error


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
