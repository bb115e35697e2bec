"""``TableStore``: the tables of one server as one worker sees them.

The files, their layout and the per-table counters are in ``shm.py``; this package is what workers do
with them. This module holds the data path (lookups, updates, the replicated apply); the registry view
and the table's update lock that every change takes are ``registry.py``, creating, loading and deleting
tables is ``admin.py``, and repairing what a worker killed under a table's lock left is ``repair.py``.

Consistency: updates of an array are serialised by its lock; lookups never take it. A lookup running
while an update is applied may read a row with some values from before and some from after that update
(values are float32 stores, never torn); every lookup that starts after an update's response was sent
sees the whole update, since the update finished writing before it responded. A lookup reports the table
version read before it gathered: its rows include at least that many updates. A restore in place
(``restore_from_file``, ``inplace.py``) is never seen half done: a lookup it overlaps answers 503.

An update marks ``pending`` before it appends to the journal and clears it after the version counter is
bumped; whoever takes the lock next and finds the mark set repairs the table first (``repair.py``).

Lock order, everywhere: a table's update lock, then the registry lock (``registry.py``).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from robez_core.checkpoint import CheckpointFile, CheckpointWriter
from robez_core.collection import prepare_shared_step
from robez_core.config import TableConfig
from robez_core.errors import (
    CorruptionError,
    InvalidInputError,
    LimitExceededError,
)
from robez_core.optim import PreparedStep
from robez_core.small import SMALL_BATCH_MAX_IDS
from robez_core.table import Table

from .. import tracing
from ..config import Settings, TableSpec, demo_table_spec, load_tables_file
from ..errors import RefusedUpdateError
from ..faults import GROUP_APPENDED, NO_FAULTS, UPDATE_APPENDED, Faults
from ..log.entry import (
    EntryGroup,
    Proposed,
    SkippedRecord,
    UpdatePart,
    UpdateRecord,
    apply_logged_record,
    apply_record,
    as_tensor,
    check_lr,
    check_step,
    prepare,
)
from ..log.granules import GranuleMarks
from ..log.journal import Journal, NullJournal
from ..log.live_copy import FileTarget, consistent_copy
from ..log.state_digest import StateDigest
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
from .inplace import lookup_ends, lookup_starts, restore_in_place
from .registry import TableRegistry
from .repair import repair

logger = logging.getLogger("robez.store")


class TableStore:
    """The tables of one server as one worker sees them; every method is safe to call from many threads.

    Args:
        directory: the prepared shared directory (``TableStore.prepare`` or ``SharedDirectory.create``).
        settings: limits and journal settings.
        journal: where updates and table lifecycle events are made durable (``NullJournal``: nowhere).
        faults: testing only, the process's fault hooks (service/faults.py; default: none).
    """

    def __init__(
        self, directory: SharedDirectory, settings: Settings, journal: Journal, faults: Faults = NO_FAULTS
    ) -> None:
        self.directory = directory
        self.limits = Limits.from_settings(settings)
        self.journal = journal
        # Testing only (service/faults.py): die half-way through an update (_fault_point), pause in passes.
        self.faults = faults
        self._may_die = faults.can_die  # read on every push: one attribute
        # The null journal itself (not a subclass that observes appends): an update appends nothing, so a
        # small one can skip the append and be checked and applied in one compiled call (_propose_small).
        self._small_unjournalled = type(journal) is NullJournal and not faults.can_die
        # The registry view and the tables' update locks (registry.py); whoever takes a lock its last
        # holder left in the middle of a change repairs the table first (repair.py).
        self.registry = TableRegistry(directory, lambda entry: repair(self.registry, journal, entry))
        self._admin = TableAdmin(
            self.registry, journal, self.limits, faults
        )  # create, load, delete: admin.py

    # -- start-up ---------------------------------------------------------------------------------

    @classmethod
    def prepare(cls, settings: Settings, journal: Journal, faults: Faults = NO_FAULTS) -> SharedDirectory:
        """Create the shared directory and fill it: tables from the data directory, then the tables file,
        then (if neither named any and ``default_table``) the ``demo`` table. Called once, by the process
        that starts the workers; the workers attach with ``TableStore(directory, ...)``."""
        directory = SharedDirectory.create(settings.shm_dir)
        try:
            cls.fill(directory, settings, journal, faults)
        except BaseException:
            directory.remove()
            raise
        return directory

    @classmethod
    def fill(
        cls, directory: SharedDirectory, settings: Settings, journal: Journal, faults: Faults = NO_FAULTS
    ) -> None:
        """``prepare``'s second half, into a directory already created (``SharedDirectory.create``): the
        server's workers may start meanwhile (they attach once this returns). The caller removes the
        directory if this raises."""
        store = cls(directory, settings, journal, faults)
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
        """Overwrite the table with the checkpoint file at ``path`` at ``version``, in its own array piece
        by piece (``inplace.py``: no second array; lookups answer 503 meanwhile, never a mix)."""
        restore_in_place(self.registry, self.journal, name, CheckpointFile.open(path), version, self.faults)

    def torn(self, name: str) -> bool:
        """Whether an in-place restore of the table was cut short and it waits for the next one."""
        return bool(self.registry.entry(name).overwrites & 1)

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
            overwrites, version = lookup_starts(entry), entry.version
            if isinstance(ids, np.ndarray):
                rows, hash_seconds, lookup_seconds = table.lookup_timed(ids)  # checks ids
            else:
                tensor_rows, hash_seconds, lookup_seconds = table.lookup_timed(ids)
                rows = tensor_rows.numpy()
            lookup_ends(entry, overwrites)
            if tracing.TRACER is not None:
                _trace_lookup(name, _count(ids), version, hash_seconds, lookup_seconds)
            return LookupResult(rows, version, hash_seconds, lookup_seconds)
        if isinstance(ids, np.ndarray):
            ids = torch.from_numpy(ids)
        table.validate_ids(ids)
        bag_offsets, weights = _validate_pooling(ids, offsets, pooling, per_sample_weights)
        overwrites, version = lookup_starts(entry), entry.version
        bag_rows, hash_seconds, lookup_seconds = table.lookup_timed(ids)
        lookup_ends(entry, overwrites)
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

    def lookup_many(self, items: list[LookupRequestItem], *, check_only: bool = False) -> list[LookupResult]:
        """Several lookups in one request; the request limits apply to their sum. All tables are
        resolved and the limits checked before any lookup runs. ``check_only``: those checks and each
        item's bags, no lookup (a push's lookup part, checked before the push is applied)."""
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
        if check_only:
            for item in items:
                _validate_pooling(as_tensor(item.ids), item.offsets, item.pooling, item.per_sample_weights)
            return []
        return [
            self.lookup(item.table, item.ids, item.offsets, item.pooling, item.per_sample_weights)
            for item in items
        ]

    def update(self, name: str, ids: Tensor, grads: Tensor, lr: float | None = None) -> UpdateResult:
        """Apply the table's optimizer to the gradients ``grads`` (float32 (n, d)) of the rows of ``ids``
        (int64 (n,)); duplicates are summed. ``update_many`` of one part: journalled before it is
        applied; nothing changes on error. Returns once the update is as durable as the journal's fsync
        policy promises."""
        return self.update_many([UpdatePart(name, ids, grads, lr)])[0]

    def update_many(
        self, parts: Sequence[UpdatePart], *, idempotency_key: str | None = None
    ) -> list[UpdateResult]:
        """Apply one push of one or more tables (a training step's gradients of every table), all or
        nothing: every part is validated (request limits on their sum, lr, ids, gradients, a step that
        would leave a non-finite value) before anything is logged, and the parts are logged as one entry
        (``EntryGroup``: a restart after a kill -9 in the middle keeps all of them or none). Returns each
        part's result (its table's new version), in the order of ``parts``, once the entry is as durable
        as the fsync policy promises.

        Args:
            parts: ``UpdatePart(table, ids int64 (N,), grads float32 (N, d), lr or None)``, one per table
                (a table named twice is refused).
            idempotency_key: the request's ``Idempotency-Key``. A single server applies each request it
                acknowledges once and keeps no key; the replicated write path
                (``service/replication/replica.py``) uses it to append a retried push once.
        """
        del idempotency_key  # see above: meaningful to a replicated log only
        done = self.propose(parts)
        assert done is not None  # blocking
        results, ticket = done
        self.journal.wait_durable(ticket)
        return results

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
        """``propose`` of one table's push: (its result, the journal ticket), or None (nothing changed)
        with ``blocking=False`` when the table's lock is held elsewhere."""
        done = self.propose([UpdatePart(name, ids, grads, lr)], blocking=blocking)
        return None if done is None else (done[0][0], done[1])

    def propose(
        self, parts: Sequence[UpdatePart], *, blocking: bool = True
    ) -> tuple[list[UpdateResult], int] | None:
        """``update_many`` without the final wait: validate the push (once), propose its records to the
        journal under the tables' locks, apply them (``_commit``: the one version bump); returns the
        results and the journal ticket to pass to ``journal.wait_durable`` before acknowledging. The HTTP
        route waits outside its compute slot, so pushes waiting for one group-commit flush do not hold
        back others from joining it. ``ids`` and ``grads`` may be numpy arrays (the route's decoded
        body): a small push without a journal then makes no tensor.

        ``blocking=False``: returns None, having changed nothing, when a table's update lock is held
        elsewhere (the caller, on the event loop, then retries from a worker thread)."""
        if len(parts) == 1:  # the common push: no list of names to check
            part = parts[0]
            entry = self.registry.entry(part.table)
            count = _count(part.ids)
            self.limits.check_request(count, entry.table.config.embedding_dim)
            lr = _resolve_lr(entry, part.lr)
            if self._small_unjournalled and count <= SMALL_BATCH_MAX_IDS:
                # Nothing to journal: a small batch is hashed, checked and applied in two compiled calls.
                return self._propose_small(part, lr, blocking)
            names, entries, lrs = [part.table], [entry], [lr]
        else:
            names = [part.table for part in parts]
            if not parts:
                raise InvalidInputError("an update needs at least one table")
            if len(set(names)) != len(names):
                twice = next(name for name in names if names.count(name) > 1)
                raise InvalidInputError(f"table {twice!r} is named more than once in one update")
            entries = [self.registry.entry(name) for name in names]
            lrs = self._check_request(entries, parts)
        tensors = [(as_tensor(part.ids), as_tensor(part.grads)) for part in parts]
        start = time.perf_counter()
        # Validation, before anything changes: the table's config is all it reads, so it runs outside
        # the lock (so does coalescing the step).
        # Tables over one array (share_array_with: only without a journal, so no log replays this) get
        # one coalesced step of all their parts in order: a local RobezEmbeddingBagCollection's step.
        shared = _shared_groups(entries) if len(parts) > 1 and self.journal_is_memory_only() else []
        prepared: list[tuple[PreparedStep | None, float]] = []
        for index, (entry, (ids, grads), lr) in enumerate(zip(entries, tensors, lrs, strict=True)):
            in_shared = any(index in each for each in shared)
            with _naming(names, [index]):
                prepared.append((None, 0.0) if in_shared else prepare(entry.table, ids, grads, lr))
        for parts_of_array in shared:
            with _naming(names, parts_of_array):
                shared_step = _prepare_shared(
                    [entries[i].table for i in parts_of_array], parts_of_array, tensors, lrs
                )
            prepared[parts_of_array[0]] = (shared_step, 0.0)
        prepare_seconds = time.perf_counter() - start - sum(seconds for _, seconds in prepared)
        locked = self.registry.acquire_many(names, blocking)
        if locked is None:
            return None
        try:
            steps = [step for step, _ in prepared]
            # No log to append to first: a push of one step is checked in the pass that applies it.
            fused = self.journal_is_memory_only() and sum(step is not None for step in steps) == 1
            for index, held in enumerate(locked):
                if held is not entries[index]:  # a load switched the table meanwhile (same config)
                    ids, grads = tensors[index]
                    mine = [g for g in shared if index in g]
                    if not mine:
                        steps[index], _ = prepare(held.table, ids, grads, lrs[index])
                    elif index == mine[0][0]:
                        steps[index] = _prepare_shared(
                            [locked[i].table for i in mine[0]], mine[0], tensors, lrs
                        )
                step = steps[index]
                if step is not None and not fused:  # None: a shared group's later part (in the first's)
                    # Before the log: a step that would leave a non-finite value is refused.
                    with _naming(names, next((g for g in shared if g[0] == index), [index])):
                        check_step(held.table, step)
            versions = [held.version + 1 for held in locked]
            group = EntryGroup.new(list(zip(names, versions, strict=True))) if len(parts) > 1 else None
            records = [
                UpdateRecord(name, version, ids, grads, lr, group)
                for name, version, (ids, grads), lr in zip(names, versions, tensors, lrs, strict=True)
            ]
            ticket = self._propose_records(locked, records)
            if self._may_die:
                self._fault_point(locked[0].table, *tensors[0], lrs[0])
            try:
                first = next(index for index, step in enumerate(steps) if step is not None)
                with _naming(names, next((g for g in shared if g[0] == first), [first])):
                    applied = [
                        apply_record(
                            held.table, r.ids, r.grads, r.lr, step=step, check_in_step=fused, marks=held.marks
                        )
                        if step is not None
                        else (0.0, 0.0)
                        for held, r, step in zip(locked, records, steps, strict=True)
                    ]  # if one raises, the marks stay: the next holder of the lock repairs
            except RefusedUpdateError:  # the one-pass check refused: nothing changed, nothing to repair
                for held in locked:
                    held.set_pending(0)
                raise
            self._commit(locked, versions)
        finally:
            self.registry.release_many(locked)
        # The caller waits for durability outside the lock (group commit): the next updates append
        # while this one waits for its flush.
        results = []
        for index, timings in enumerate(applied):
            assert isinstance(timings, tuple)  # a live push is refused, never skipped
            hash_seconds = prepared[index][1]
            share = prepare_seconds / len(parts)
            results.append(UpdateResult(versions[index], hash_seconds, share + timings[1]))
            if tracing.TRACER is not None:
                _trace_update(names[index], int(tensors[index][0].numel()), results[-1])
        return results, ticket

    def _propose_records(self, locked: list[TableEntry], records: list[UpdateRecord]) -> int:
        """Mark every table pending, then append the entry's records to the journal (the proposal);
        returns the ticket of the last. A failed append takes back the records appended before it
        (``repair``: the journal cuts them), so a refused entry leaves no part in any log."""
        # Marked before the append, cleared after the bump: a worker that dies in between leaves the
        # marks for the next holder of each lock to repair (repair.py), which cuts the record off.
        for held, record in zip(locked, records, strict=True):
            held.set_pending(record.version)
        ticket = 0
        appended = 0
        try:
            for record in records:
                if tracing.TRACER is None:
                    ticket = max(ticket, self.journal.append(record))
                else:
                    with tracing.span("log-append", record.table, int(record.ids.numel()), record.version):
                        ticket = max(ticket, self.journal.append(record))
                appended += 1
                if record.group is not None and appended < len(records) and self._may_die:
                    self.faults.die_at(GROUP_APPENDED)
        except BaseException:
            for held in locked[:appended]:
                repair(self.registry, self.journal, held)  # cuts the appended record, clears the mark
            for held in locked[appended:]:
                held.set_pending(0)  # a failed append leaves the log as it was
            raise
        return ticket

    @staticmethod
    def _commit(locked: list[TableEntry], versions: list[int]) -> None:
        """The one version bump: every table of an entry, once its records are applied (live, small,
        replicated alike), then the marks cleared. ``versions``: one per entry of ``locked`` (indexed, not
        zipped: ``zip(..., strict=...)`` costs a quarter of a microsecond, on every push)."""
        for index, held in enumerate(locked):
            held.set_version(versions[index])
        for held in locked:
            held.set_pending(0)

    def _propose_small(
        self, part: UpdatePart, lr: float, blocking: bool
    ) -> tuple[list[UpdateResult], int] | None:
        """One small push with nothing to journal: the whole update under the lock, checked and applied
        in two compiled calls (``apply_record`` without a prepared step)."""
        locked = self.registry.acquire(part.table, blocking)
        if locked is None:
            return None
        try:
            version = locked.version + 1
            locked.set_pending(version)  # as propose: a worker that dies mid-step leaves the mark
            try:
                timings = apply_record(locked.table, part.ids, part.grads, lr, marks=locked.marks)
            except InvalidInputError:  # refused before anything changed
                locked.set_pending(0)
                raise
            assert isinstance(timings, tuple)  # a live push is refused, never skipped
            self._commit([locked], [version])
        finally:
            locked.lock.release()
        result = UpdateResult(version, *timings)
        if tracing.TRACER is not None:
            _trace_update(part.table, _count(part.ids), result)
        return [result], 0

    def _check_request(self, entries: list[TableEntry], parts: Sequence[UpdatePart]) -> list[float]:
        """The checks of a push that read neither its ids nor its gradients: the request limits (on the
        sum of its parts) and each part's lr (``check_lr``); returns the lrs to apply (the request's,
        else the table's). The rest of the validation is ``prepare``'s, and ``check_step``'s under the
        lock."""
        if len(parts) == 1:
            self.limits.check_request(_count(parts[0].ids), entries[0].table.config.embedding_dim)
        else:
            counts = [_count(part.ids) for part in parts]
            self.limits.check_request(sum(counts), 0)
            values = sum(
                count * entry.table.config.embedding_dim for count, entry in zip(counts, entries, strict=True)
            )
            if values > self.limits.max_values_per_request:
                raise LimitExceededError(
                    f"{values} gradient values in one request; the limit is "
                    f"max_values_per_request={self.limits.max_values_per_request}"
                )
        return [_resolve_lr(entry, part.lr) for entry, part in zip(entries, parts, strict=True)]

    # -- replicated mode: the log decides the order and the versions (service/replication/) ----------

    def validate_update(self, name: str, ids: Tensor, grads: Tensor, lr: float | None = None) -> float:
        """``validate_many`` of one part; returns the lr to apply."""
        return self.validate_many([UpdatePart(name, ids, grads, lr)])[0][0]

    def validate_many(self, parts: Sequence[UpdatePart]) -> list[tuple[float, Proposed]]:
        """Every check ``propose`` makes before it changes anything; returns the lr to apply and the
        prepared step of each part. A replica runs it before publishing, so a bad push is a 4xx and
        never reaches the log (its applier checks again, at the entry's version: a log entry may have
        been written by anyone; the step saves this process's applier preparing the same bytes again)."""
        names = [part.table for part in parts]
        if not parts or len(set(names)) != len(names):
            raise InvalidInputError("an update names each of its tables once, and at least one")
        entries = [self.registry.entry(name) for name in names]
        lrs = self._check_request(entries, parts)
        validated = []
        for entry, part, lr in zip(entries, parts, lrs, strict=True):
            step, _ = prepare(entry.table, as_tensor(part.ids), as_tensor(part.grads), lr)
            # A step that would leave a non-finite value on the table as this replica has it now is
            # refused before it is published (``apply`` checks again, at its version).
            check_step(entry.table, step)
            validated.append((lr, Proposed(entry.table, step)))
        return validated

    def apply(
        self, record: UpdateRecord | SkippedRecord, proposed: Proposed | None = None
    ) -> UpdateResult | SkippedRecord | None:
        """Apply the entry at log position ``record.version`` (the replicated log's commit): the table
        goes from ``version - 1`` to ``version``. None if the table already has it (a replay). An entry
        that fails a check (decoding it, or ``apply_record``'s) is an empty version: the
        ``SkippedRecord`` is returned. A gap is a ``CorruptionError``: the caller reads the log from the
        wrong place. The journal is not called: the log is the journal. The request limits are not
        applied: they are this server's settings, and a log must be applied alike everywhere.
        ``proposed``: the step this process prepared from the entry's very bytes (``validate_many``),
        see ``apply_logged_record``."""
        with self.registry.locked(record.table) as locked:
            if locked.version >= record.version:
                return None
            if locked.version != record.version - 1:
                raise CorruptionError(
                    f"table {record.table!r} is at version {locked.version}; "
                    f"log position {record.version} cannot follow it"
                )
            outcome = apply_logged_record(locked.table, record, proposed, locked.marks)
            # A skipped entry too moves the version: versions stay equal on every replica.
            self._commit([locked], [record.version])
        if isinstance(outcome, SkippedRecord):
            return outcome
        return UpdateResult(record.version, *outcome)

    def checksum(self, name: str) -> tuple[int, str]:
        """(version, digest hex) of the array and optimizer state at one version (``state_digest.py``:
        sha256 over 64-bit hashes of 256-byte granules). Replicas at the same version have the same
        digest. No copy of the state is made: the granules are hashed from the live table without the
        update lock (``consistent_copy`` into a ``StateDigest``: the lock held only to read the granules
        the last few updates touched), and the digest holds 1/32 of the state's bytes. Where the journal
        keeps no log (no data directory, a replica), the granules the updates change meanwhile are taken
        from the array's record of them in shared memory (``marks_of``, ``log/granules.py``) instead."""
        digest = StateDigest(self.registry.entry(name).table)
        version = consistent_copy(
            name,
            self.journal,
            partial(self.exclusive, name),
            digest,
            lambda _table, at, _mark: at,
            self.faults,
            partial(self.marks_of, name),
        )
        return version, digest.hexdigest()

    def copy_to_file(self, name: str, fd: int) -> tuple[CheckpointWriter, int]:
        """The table's state at one version written into the empty file ``fd`` as a robez checkpoint,
        its checksums blank (``finish`` on the writer returned completes it), while its updates go on:
        ``consistent_copy`` into the file (``FileTarget``: written, not mapped), as ``checksum``.
        Returns the writer and the version. (With a data directory: the journal's ``snapshot``.)"""
        table = self.registry.entry(name).table
        tensors = table.tensors()
        writer = CheckpointWriter.begin(fd, tensors, table.metadata())  # header; space allocated
        version = consistent_copy(
            name,
            self.journal,
            partial(self.exclusive, name),
            FileTarget(fd, writer, tensors),
            lambda _table, at, _mark: at,
            self.faults,
            partial(self.marks_of, name),
        )
        return writer, version

    def marks_of(self, name: str, table: Table) -> GranuleMarks | None:
        """The record of the granules changed while copies run (``granules.py``) of the array of the
        table ``name`` served as ``table``; None if ``table`` is no longer it. Called with its lock held
        (``consistent_copy``'s ``granules``)."""
        entry = self.registry.entry(name)
        return entry.marks if entry.table is table else None

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
        if not self.faults.armed(UPDATE_APPENDED):
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


def _resolve_lr(entry: TableEntry, lr: float | None) -> float:
    """The lr a push applies to the table of ``entry``: its own (``lr``), else the table's; checked."""
    applied_lr = entry.table.optimizer.lr if lr is None else float(lr)
    check_lr(entry.table, applied_lr)
    return applied_lr


@contextmanager
def _naming(names: list[str], indices: list[int]) -> Iterator[None]:
    """In a push of several tables, a refused part's error names its table(s)."""
    try:
        yield
    except RefusedUpdateError as error:
        if len(names) == 1:
            raise
        which = ", ".join(repr(names[i]) for i in indices)
        raise RefusedUpdateError(f"table {which}: {error}", error.reason) from error


def _shared_groups(entries: Sequence[TableEntry]) -> list[list[int]]:
    """The parts (indices, in order) of a push over one array, for each array more than one part reads."""
    groups: dict[str, list[int]] = {}
    for index, entry in enumerate(entries):
        groups.setdefault(entry.array.array_id, []).append(index)
    return [group for group in groups.values() if len(group) > 1]


def _prepare_shared(
    tables: list[Table], group: list[int], tensors: list[tuple[Tensor, Tensor]], lrs: list[float]
) -> PreparedStep:
    """One coalesced step of the parts ``group`` over one array (``prepare_shared_step``: their ids and
    gradients checked, hashed and coalesced in order); they must have one lr."""
    if len({lrs[i] for i in group}) > 1:
        raise RefusedUpdateError("the parts of a push over tables sharing one array need one lr", "bad_lr")
    try:
        return prepare_shared_step(
            tables, [tensors[i][0] for i in group], [tensors[i][1] for i in group], lrs[group[0]]
        )
    except InvalidInputError as error:
        raise RefusedUpdateError(str(error), "bad_grads") from error


def _count(values: Tensor | np.ndarray) -> int:
    """How many values (ids) ``values`` holds, a tensor or a numpy array."""
    return int(values.size if isinstance(values, np.ndarray) else values.numel())


def _trace_lookup(name: str, ids: int, version: int, hash_seconds: float, gather_seconds: float) -> None:
    """A lookup's ``hash`` and ``gather`` spans, from its own stage timers (it just ended)."""
    gather_start = tracing.stage("gather", name, ids, version, gather_seconds)
    tracing.stage("hash", name, ids, version, hash_seconds, ended_ns=gather_start)


def _trace_update(name: str, ids: int, result: UpdateResult) -> None:
    """An update's ``hash`` and ``apply`` spans, from its own stage timers (it just ended)."""
    apply_start = tracing.stage("apply", name, ids, result.version, result.apply_seconds)
    tracing.stage("hash", name, ids, result.version, result.hash_seconds, ended_ns=apply_start)


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
