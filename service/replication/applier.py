"""The applier: the one process per replica that applies the replicated log to the shared tables.

It follows the catalog (tables created and dropped through the log), creates each table from its newest
snapshot in the log's snapshot store (or fresh, deterministically seeded), then reads the table's log
from there on and applies every entry in order with ``TableStore.apply`` (``apply_record``, as
a private rebuild does too). It uploads a snapshot every ``replica_snapshot_every_updates`` updates, and
``replica_snapshot_interval_s`` after the last upload when updates came since (a timer, so a burst
followed by silence is uploaded too), and then trims the log below it, keeping ``replica_trim_keep``
entries (the scheduling and the uploads: ``uploads.py``); a replica whose position was trimmed away
restores the snapshot. A worker
that takes over from a dead applier rebuilds every table privately and switches it in (``restore``).

An entry that fails a check (``records.decode_entry``, ``apply_record``, a load's checkpoint) is applied
as an empty version, alike on every replica, and counted in ``robez_replication_skipped_total``. A load
entry names a checkpoint in the log's store: the table is switched to it at that position (``restore``),
and the checkpoint is deleted once the log no longer holds the entry (``_forget_loads``).

With a data directory it also keeps local snapshots (``localsnap.py``) and starts from whichever of the
local and the Object Store snapshot is newer and still reaches the log.

Readiness and lag go to ``replication.json`` in the shared directory (``ReplicaStatus``), so every worker
of the replica can answer ``/readyz``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import itertools
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio.to_thread

from robez_core.checkpoint import CheckpointFile
from robez_core.config import OptimizerConfig, TableConfig
from robez_core.errors import BusyError, ConflictError, CorruptionError, NotFoundError, RobezError
from robez_core.table import Table

from .. import tracing
from ..config import Settings, TableSpec, demo_table_spec, load_tables_file
from ..log.entry import SkippedRecord, UpdateRecord
from ..metrics import Metrics
from ..store import TableStore, UpdateResult
from ..warmup import warm_kind
from .localsnap import LocalSnapshots, remove_stale_files
from .log import CatalogEntry, CatalogEvent, LogEntry, LogTrimmedError, ReplicatedLog
from .proposed import ProposedSteps
from .records import LoadRecord, decode_entry
from .replay import load_checkpoint, replay_log
from .uploads import SnapshotUploads

logger = logging.getLogger("robez.replication")

STATUS_FILE = "replication.json"
_CONNECT_RETRY_S = 0.5
_STATUS_EVERY_S = 0.5
# The lag figures cost one stream info per table per period; a log that does not answer within the
# timeout keeps the previous figures (``/readyz?writes=true`` tells that the log is unreachable).
_LAG_EVERY_S = 1.0
_LAG_TIMEOUT_S = 2.0
# Loaded checkpoints are looked for this often (tables with one, or just started) and deleted once the log
# no longer holds the entry naming them (a snapshot is past it); one no entry names (its append failed)
# once it is older than this and the dedup window.
_LOAD_CLEANUP_EVERY_S = 2.0
_ORPHAN_LOAD_AGE_S = 3600.0


@dataclass(frozen=True)
class ReplicaStatus:
    """What the applier last wrote to ``replication.json``."""

    ready: bool
    applier_pid: int
    tables: dict[str, dict[str, Any]]  # name -> {incarnation, version, lag, last_apply}

    @classmethod
    def read(cls, path: Path) -> ReplicaStatus | None:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return cls(bool(data["ready"]), int(data["applier_pid"]), dict(data["tables"]))

    def write(self, path: Path) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(
            json.dumps({"ready": self.ready, "applier_pid": self.applier_pid, "tables": self.tables})
        )
        os.replace(tmp, path)


class Applier(SnapshotUploads):
    """Applies the replicated log to this replica's shared tables (one per replica; see module doc)."""

    def __init__(
        self, store: TableStore, settings: Settings, metrics: Metrics, log: ReplicatedLog, status_path: Path
    ) -> None:
        self.store = store
        self.settings = settings
        self.metrics = metrics
        self.log = log
        self.status_path = status_path
        self._tasks: dict[str, tuple[CatalogEntry, asyncio.Task[None]]] = {}
        self._caught_up: dict[str, bool] = {}
        self._catalog_loaded = False
        # Pushes waiting for a version of a table: a heap of (version, arrival, future) per table, each
        # future resolved as soon as the entry at its version is applied (``_wake``).
        self._waiters: dict[str, list[tuple[int, int, asyncio.Future[None]]]] = {}
        self._arrivals = itertools.count()
        # The steps this worker prepared for the pushes it published: applied as they are (one
        # validation per push) when the entry read back has exactly their bytes.
        self.proposed = ProposedSteps()
        # Lag: the log's last position minus the version applied here (entries), and an upper bound on
        # the age of the oldest entry not applied yet (s), from the log time of the last entry applied
        # (``_applied_log_time``) and when the table was last seen caught up (``_caught_up_at``).
        self._lag: dict[str, int] = {}
        self._lag_seconds: dict[str, float] = {}
        self._applied_log_time: dict[str, float] = {}
        self._caught_up_at: dict[str, float] = {}
        self._last_apply: dict[str, float] = {}
        previous = ReplicaStatus.read(status_path)
        self._incarnations: dict[str, str] = (
            {name: info["incarnation"] for name, info in previous.tables.items()} if previous else {}
        )
        # A worker taking over from an applier that died (kill -9, crash) cannot trust the tables: the
        # dead one may have stopped half-way through an update. Each is rebuilt privately from the
        # snapshot and the log, then switched in atomically (lookups go on meanwhile).
        self._rebuild: set[str] = set(self._incarnations) if previous is not None else set()
        if previous is not None and self._rebuild:
            logger.warning("taking over from applier %d: rebuilding %s", previous.applier_pid, self._rebuild)
        self._status_task: asyncio.Task[None] | None = None
        self._lag_task: asyncio.Task[None] | None = None
        self._upload_task: asyncio.Task[None] | None = None
        # Updates applied since the last snapshot upload, when that upload was (monotonic), and one lock
        # per table so the count trigger and the timer never upload the same table at once.
        self._since_upload: dict[str, int] = {}
        self._last_upload: dict[str, float] = {}
        # The background part of a snapshot (finish the file, upload, trim), one per table at a time.
        self._snapshot_tasks: dict[str, asyncio.Task[Any]] = {}
        # Tables whose snapshot is being started: the apply loop and the timer must not both start one.
        self._snapshot_starting: set[str] = set()
        # Who holds an upload lease (shown in the lease's value).
        self._holder = f"{settings.replica_name or os.uname().nodename}:{os.getpid()}"
        # With a data directory: the replica's own snapshots (localsnap.py), updates since the last one,
        # and where each table was loaded from (``source`` in replication.json).
        self.local = LocalSnapshots(settings.data_dir) if settings.data_dir is not None else None
        # Where snapshot files are written for an upload and downloaded for a bootstrap: the data
        # directory's snapshot folder, else the temp folder (TMPDIR; it should be on disk, not tmpfs).
        self._scratch = self.local.directory if self.local is not None else Path(tempfile.gettempdir())
        remove_stale_files(self._scratch, temp_files=self.local is not None)
        self._since_local: dict[str, int] = {}
        self._sources: dict[str, str] = {}
        # Tables that may have loaded checkpoints in the log's store (``_forget_loads``).
        self._loads_seen: set[str] = set()
        self._load_cleanup_task: asyncio.Task[None] | None = None

    async def wait_applied(self, name: str, version: int, timeout_s: float) -> None:
        """Returns once table ``name`` is at ``version`` here, or after ``timeout_s`` (the caller
        checks which)."""
        if self._version(name) >= version:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = (version, next(self._arrivals), future)
        heap = self._waiters.setdefault(name, [])
        heapq.heappush(heap, waiter)
        try:
            await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            with contextlib.suppress(ValueError):
                heap.remove(waiter)
                heapq.heapify(heap)

    def _wake(self, name: str) -> None:
        """Answer every push waiting for a version of ``name`` that is applied now (on the event loop)."""
        heap = self._waiters.get(name)
        if not heap:
            return
        applied = self._version(name)
        while heap and heap[0][0] <= applied:
            future = heapq.heappop(heap)[2]
            if not future.done():
                future.set_result(None)

    def _version(self, name: str) -> int:
        try:
            return self.store.version(name)
        except NotFoundError:
            return -1

    def incarnation(self, name: str) -> str | None:
        """The incarnation of table ``name`` this replica serves now (None: none), as ``replication.json``
        will say, without reading it."""
        incarnation = self._incarnations.get(name)
        return incarnation if incarnation is not None and name in self.store.names() else None

    async def stop(self) -> None:
        for _, task in self._tasks.values():
            task.cancel()
        for _, task in self._tasks.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for snapshot_task in self._snapshot_tasks.values():  # an upload stops: its chunks are purged
            snapshot_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await snapshot_task
        self._snapshot_tasks.clear()
        for entry, _ in self._tasks.values():
            if self._since_local.get(entry.name, 0) > 0:
                await self._local_snapshot(entry, wait=True)
        for background in (self._status_task, self._lag_task, self._upload_task, self._load_cleanup_task):
            if background is not None:
                background.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await background

    # -- catalog ------------------------------------------------------------------------------------

    async def run(self) -> None:
        self._write_status()
        self._status_task = asyncio.create_task(self._status_loop())
        self._lag_task = asyncio.create_task(self._lag_loop(), name="robez-replication-lag")
        self._load_cleanup_task = asyncio.create_task(self._forget_loads(), name="robez-load-cleanup")
        if self.settings.replica_snapshot_interval_s > 0 or self.settings.replica_snapshot_every_updates:
            self._upload_task = asyncio.create_task(self._upload_timer(), name="robez-snapshot-timer")
        await self._create_configured_tables()
        seen: set[str] = set()
        async for event in self.log.watch_tables():
            await self._on_catalog(event, seen)

    async def _on_catalog(self, event: CatalogEvent, seen: set[str]) -> None:
        if event.initial_done:
            for name in set(self.store.names()) - seen:
                await self._drop_local(name)
            seen.clear()
            self._catalog_loaded = True
            self._write_status()
            self._prune_local()
            return
        if event.entry is None:
            seen.discard(event.name)
            await self._drop_local(event.name)
            self._prune_local()
            return
        seen.add(event.name)
        current = self._tasks.get(event.name)
        if current is not None and current[0] == event.entry and not current[1].done():
            return
        if current is not None:
            current[1].cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await current[1]
        self._caught_up[event.name] = False
        task = asyncio.create_task(self._follow(event.entry), name=f"robez-apply-{event.name}")
        self._tasks[event.name] = (event.entry, task)
        self._prune_local()

    def _prune_local(self) -> None:
        if self.local is not None and self._catalog_loaded:
            keep = {(entry.name, entry.incarnation) for entry, _ in self._tasks.values()}
            try:
                self.local.prune(keep)
            except OSError as exc:
                logger.warning("could not prune the local snapshots: %s", exc)

    async def _create_configured_tables(self) -> None:
        """Tables of the tables file (or ``demo`` when none is configured and the catalog is empty) are
        created in the catalog by whichever replica comes first; a different spec there is an error."""
        settings = self.settings
        specs = load_tables_file(settings.config) if settings.config is not None else {}
        for name, spec in specs.items():
            await self._ensure_table(name, spec)
        wants_demo = not specs and settings.config is None and settings.default_table
        if wants_demo and not self.store.names() and await self._catalog_empty():
            await self._ensure_table("demo", demo_table_spec())

    async def _catalog_empty(self) -> bool:
        while True:
            try:
                return not await self.log.table_names()
            except BusyError as exc:
                logger.info("cannot read the catalog yet: %s", exc)
                await asyncio.sleep(_CONNECT_RETRY_S)

    async def _ensure_table(self, name: str, spec: TableSpec) -> None:
        while True:
            try:
                existing = await self.log.get_table(name)
                if existing is None:
                    await self.log.create_table(name, spec.config.to_dict(), spec.optimizer.to_dict())
                    logger.info("created table %s in the catalog", name)
                    return
                if not _same_spec(existing, spec.config, spec.optimizer):
                    logger.error(
                        "table %r in the catalog differs from the tables file; serving the catalog's", name
                    )
                return
            except ConflictError:
                continue  # another replica created it meanwhile: compare with theirs
            except BusyError as exc:
                logger.info("cannot create table %s yet: %s", name, exc)
                await asyncio.sleep(_CONNECT_RETRY_S)

    async def _drop_local(self, name: str) -> None:
        current = self._tasks.pop(name, None)
        if current is not None:
            current[1].cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await current[1]
        snapshot_task = self._snapshot_tasks.pop(name, None)
        if snapshot_task is not None:
            snapshot_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await snapshot_task
        self._caught_up.pop(name, None)
        self._incarnations.pop(name, None)
        for figures in (self._lag, self._lag_seconds, self._applied_log_time, self._caught_up_at):
            figures.pop(name, None)
        self._since_upload.pop(name, None)
        self._last_upload.pop(name, None)
        self._since_local.pop(name, None)
        self._sources.pop(name, None)
        self._loads_seen.discard(name)
        with contextlib.suppress(NotFoundError):
            await anyio.to_thread.run_sync(self.store.delete, name)
            logger.info("dropped table %s", name)
        self._write_status()

    # -- one table ----------------------------------------------------------------------------------

    async def _follow(self, entry: CatalogEntry) -> None:
        """Bring the local table to the log's current position, then apply every new entry, forever."""
        last_trimmed = -math.inf
        while True:
            try:
                await self._follow_once(entry)
                return
            except asyncio.CancelledError:
                raise
            except NotFoundError:
                return  # dropped: the catalog watch removes it
            except LogTrimmedError as exc:
                logger.info("%s; restoring the snapshot", exc)
                now = time.monotonic()
                again, last_trimmed = now - last_trimmed <= _CONNECT_RETRY_S, now
                if not again:
                    # _follow_once sees the log start past its version and restores the snapshot at once;
                    # a second trim right after (the snapshots still behind the log) waits like any failure
                    continue
            except RobezError:
                logger.exception(
                    "table %s: applying the log failed; restarting from the local version", entry.name
                )
            except Exception:
                logger.exception(
                    "table %s: reading the log failed; restarting from the local version", entry.name
                )
            await asyncio.sleep(_CONNECT_RETRY_S)

    async def _follow_once(self, entry: CatalogEntry) -> None:
        name = entry.name
        position = await self._bootstrap(entry)
        first, last = await self.log.bounds(entry)
        if first > position + 1:
            position = await self._restore_snapshot(entry, need=first - 1)
        target = last
        self._caught_up[name] = position >= target
        self._write_status()
        self._since_upload[name] = 0
        self._since_local[name] = 0
        self._last_upload[name] = time.monotonic()
        self._loads_seen.add(name)  # unknown after a start: looked for once
        async with contextlib.aclosing(self.log.read_batches(entry, position)) as batches:
            async for batch in batches:
                updates: list[tuple[LogEntry, UpdateRecord | SkippedRecord]] = []
                for item in batch:
                    if item.position != position + 1:
                        await self._apply_updates(entry, updates)
                        position = await self._restore_snapshot(entry, need=item.position - 1)
                        self._wake(name)
                        if item.position != position + 1:
                            raise CorruptionError(
                                f"table {name!r}: log jumps from {position} to {item.position}"
                            )
                    record = decode_entry(name, item.position, item.payload, item.headers)
                    if isinstance(record, LoadRecord):
                        await self._apply_updates(entry, updates)
                        self._applied(entry, item, await self._apply_load(entry, record))
                    else:
                        updates.append((item, record))
                    position = item.position
                await self._apply_updates(entry, updates)
                if not self._caught_up.get(name) and (position >= target or batch[-1].pending == 0):
                    self._caught_up[name] = True
                    self._write_status()
                every = self.settings.replica_snapshot_every_updates
                local_every = self.settings.replica_local_snapshot_every_updates
                upload_due = bool(every) and self._since_upload.get(name, 0) >= every
                local_due = (
                    self.local is not None
                    and bool(local_every)
                    and self._since_local.get(name, 0) >= local_every
                )
                if upload_due:  # one copy of the table serves both when both are due
                    await self._snapshot(entry, also_local=local_due)
                elif local_due:
                    await self._local_snapshot(entry)

    async def _apply_updates(
        self, entry: CatalogEntry, updates: list[tuple[LogEntry, UpdateRecord | SkippedRecord]]
    ) -> None:
        """Apply the update entries taken in one pass, in order, in one trip to a worker thread; each
        push waiting for one of them is answered as soon as its entry is applied (``_wake``, called
        from the thread), not when the pass ends. Empties ``updates``."""
        if not updates:
            return
        taken = list(updates)
        updates.clear()
        loop = asyncio.get_running_loop()
        name = entry.name

        def apply_one(
            item: LogEntry, record: UpdateRecord | SkippedRecord
        ) -> UpdateResult | SkippedRecord | None:
            proposed = (
                self.proposed.take(name, item.payload, item.headers)
                if isinstance(record, UpdateRecord)
                else None
            )
            if proposed is None:
                return self.store.apply(record)
            return self.store.apply(record, proposed)

        def apply_all() -> list[UpdateResult | SkippedRecord | None]:
            results = []
            for item, record in taken:
                if tracing.TRACER is None:
                    results.append(apply_one(item, record))
                else:  # a span of the trace the push's headers carry, on every replica
                    parent = tracing.from_headers(item.headers)
                    count = int(record.ids.numel()) if isinstance(record, UpdateRecord) else 0
                    with tracing.span("apply", name, count, item.position, parent=parent):
                        results.append(apply_one(item, record))
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (stopping)
                    loop.call_soon_threadsafe(self._wake, name)
            return results

        results = await anyio.to_thread.run_sync(apply_all)
        for (item, _), result in zip(taken, results, strict=True):
            self._applied(entry, item, result)

    def _applied(
        self, entry: CatalogEntry, item: LogEntry, result: UpdateResult | SkippedRecord | None
    ) -> None:
        """The figures and counters of one entry applied (``result``: what ``TableStore.apply`` or
        ``_apply_load`` returned)."""
        name = entry.name
        now = time.time()
        if isinstance(result, SkippedRecord):
            self._count_skip(result)
        elif result is not None:
            self.metrics.update_apply_seconds.labels(name).observe(result.apply_seconds)
        if result is not None:
            self._since_upload[name] = self._since_upload.get(name, 0) + 1
            self._since_local[name] = self._since_local.get(name, 0) + 1
        if item.timestamp:
            self.metrics.replication_apply_delay_seconds.labels(name).observe(max(0.0, now - item.timestamp))
            self._applied_log_time[name] = item.timestamp
        self._last_apply[name] = now
        self._wake(name)

    async def _bootstrap(self, entry: CatalogEntry) -> int:
        """The local table of this incarnation at some version (kept, or created from the newest
        snapshot, or created fresh at version 0); returns that version."""
        name = entry.name
        if name in self.store.names():
            if self._incarnations.get(name) == entry.incarnation:
                if name in self._rebuild:
                    await self._rebuild_table(entry)
                    self._rebuild.discard(name)
                if self.store.torn(name):  # a restore in place cut short: lookups answer 503 until
                    logger.warning("table %s: restoring the snapshot again over a torn table", name)
                    return await self._restore_snapshot(entry, need=self.store.version(name))
                return self.store.version(name)
            await anyio.to_thread.run_sync(self.store.delete, name)
        spec = TableSpec(TableConfig.from_dict(entry.config), OptimizerConfig.from_dict(entry.optimizer))

        def create(path: Path, position: int) -> None:
            _check_spec(entry, path)
            self.store.create_from_file(name, path, position)

        loaded = await self._load_snapshot(entry, 0, create)
        if loaded is not None:
            position, source = loaded
            logger.info("table %s: bootstrapped from the %s at version %d", name, source, position)
            self._sources[name] = source
        else:
            await anyio.to_thread.run_sync(self.store.create, name, spec)
            self._sources[name] = "fresh"
        self._incarnations[name] = entry.incarnation
        # Load the compiled kernels for this kind of table now, not in the first apply (every path:
        # a logged push takes the prepared, checked step, which the one-id warm-up does not).
        await anyio.to_thread.run_sync(self.store.warm_up)
        await anyio.to_thread.run_sync(warm_kind, self.store.table(name))
        self._write_status()
        return self.store.version(name)

    async def _rebuild_table(self, entry: CatalogEntry) -> None:
        """Rebuild the table from the snapshot (or fresh) and the log up to its current end, in private,
        then switch the shared table to the result (``TableStore.restore``)."""
        private: list[Table] = []

        def load(path: Path, position: int) -> None:
            _check_spec(entry, path)
            private.append(Table.load(path))

        loaded = await self._load_snapshot(entry, 0, load)
        if loaded is not None:
            position, self._sources[entry.name] = loaded
            table = private[0]
        else:
            config = TableConfig.from_dict(entry.config)
            table = Table(config, OptimizerConfig.from_dict(entry.optimizer))
            position = 0
        _, last = await self.log.bounds(entry)
        table, position = await replay_log(self.log, entry, table, position, last, self._count_skip)
        await anyio.to_thread.run_sync(self.store.restore, entry.name, table, position)
        logger.warning("table %s: rebuilt from the log at version %d", entry.name, position)

    # -- loads ----------------------------------------------------------------------------------------

    async def _apply_load(
        self, entry: CatalogEntry, record: LoadRecord
    ) -> UpdateResult | SkippedRecord | None:
        """Switch the table to the checkpoint a load entry names, at its position (``restore``); an entry
        whose checkpoint is missing or does not check out is an empty version (``TableStore.apply``)."""
        loaded = await load_checkpoint(self.log, entry, record)
        if isinstance(loaded, SkippedRecord):
            return await anyio.to_thread.run_sync(self.store.apply, loaded)
        start = time.perf_counter()
        restore = functools.partial(self.store.restore, after=record.version - 1)
        if not await anyio.to_thread.run_sync(restore, entry.name, loaded, record.version):
            return None
        self._loads_seen.add(entry.name)
        logger.info(
            "table %s: loaded the checkpoint %s at version %d", entry.name, record.object_name, record.version
        )
        return UpdateResult(record.version, 0.0, time.perf_counter() - start)

    def _count_skip(self, record: SkippedRecord) -> None:
        self.metrics.replication_skipped_total.labels(record.table, record.reason).inc()

    async def _forget_loads(self) -> None:
        """Delete the loaded checkpoints nothing needs any more, every ``_LOAD_CLEANUP_EVERY_S``."""
        while True:
            await asyncio.sleep(_LOAD_CLEANUP_EVERY_S)
            for name in list(self._loads_seen):
                current = self._tasks.get(name)
                if current is None:
                    self._loads_seen.discard(name)
                    continue
                try:
                    await self._forget_loads_of(current[0])
                except (RobezError, OSError) as exc:
                    logger.info("table %s: cleaning up loaded checkpoints failed (%s); later", name, exc)

    async def _forget_loads_of(self, entry: CatalogEntry) -> None:
        """A checkpoint goes once the log starts past the entry naming it: every replica that still has
        to apply that entry restores a snapshot at or past it instead. One no entry names (recorded
        by each replica before it applies the entry) goes once this replica applied the whole log as it
        was before the listing, and it is older than any append of it could be."""
        first, last = await self.log.bounds(entry)
        applied_all = self.store.version(entry.name) >= last
        stored = await self.log.loads(entry)
        if not stored:
            self._loads_seen.discard(entry.name)
            return
        orphan_age = max(self.settings.nats_dedup_window_s, _ORPHAN_LOAD_AGE_S)
        for load in stored:
            trimmed = 0 < load.position < first
            orphan = load.position == 0 and applied_all and load.age_s > orphan_age
            if trimmed or orphan:
                await self.log.delete_load(entry, load.name)
                logger.info(
                    "table %s: deleted the loaded checkpoint %s (%s)",
                    entry.name,
                    load.name,
                    "a snapshot is past it" if trimmed else "no log entry names it",
                )

    async def _restore_snapshot(self, entry: CatalogEntry, need: int) -> int:
        """The log was trimmed past this replica's position: write the snapshot (at >= ``need``) over the
        table's own shared array (``TableStore.restore_from_file``, in place: lookups of the table answer
        503 meanwhile; a restore cut short leaves it refused, and ``_bootstrap`` restores it again)."""

        def restore(path: Path, position: int) -> None:
            self.store.restore_from_file(entry.name, path, position)

        loaded = await self._load_snapshot(entry, need, restore)
        if loaded is None:
            raise CorruptionError(
                f"table {entry.name!r}: the log was trimmed to {need + 1} and no snapshot reaches it"
            )
        position, source = loaded
        self._sources[entry.name] = source
        logger.info("table %s: re-bootstrapped from the %s at version %d", entry.name, source, position)
        return position

    async def _load_snapshot(
        self, entry: CatalogEntry, need: int, use: Callable[[Path, int], None]
    ) -> tuple[int, str] | None:
        """Hand the newer of the local snapshot and the Object Store one to ``use(path, position)`` (run
        in a thread; it reads the file); returns (position, source), or None when neither exists.

        The local one if it is at least as new, reaches ``need`` and the log still goes on from it (first
        position <= its position + 1), and ``use`` takes it (a damaged file fails its checksums there);
        else the Object Store's, downloaded chunk by chunk into a scratch file that is removed after.
        One at ``need`` or later, or ``CorruptionError``."""
        local = self.local.newest(entry.name, entry.incarnation) if self.local is not None else None
        if local is not None:
            stored = await self.log.snapshot_position(entry)
            first, _ = await self.log.bounds(entry)
            if local.position >= max(stored, need) and first <= local.position + 1:
                try:
                    await anyio.to_thread.run_sync(use, local.path, local.position)
                    return local.position, "local snapshot"
                except (RobezError, OSError) as exc:
                    logger.warning(
                        "table %s: the local snapshot %s is unusable (%s); using the Object Store "
                        "snapshot and the log",
                        entry.name,
                        local.path,
                        exc,
                    )
        snapshot = await self.log.get_snapshot(entry, self._scratch)
        if snapshot is None:
            return None
        try:
            if snapshot.position < need:
                raise CorruptionError(
                    f"table {entry.name!r}: the log was trimmed to {need + 1} and the snapshot is at "
                    f"{snapshot.position}"
                )
            await anyio.to_thread.run_sync(use, snapshot.path, snapshot.position)
        finally:
            snapshot.path.unlink(missing_ok=True)
        return snapshot.position, "Object Store snapshot"

    # -- status -------------------------------------------------------------------------------------

    def _write_status(self) -> None:
        names = self.store.names()
        ready = self._catalog_loaded and all(self._caught_up.get(name, False) for name in self._tasks)
        tables = {
            name: {
                "incarnation": self._incarnations.get(name, ""),
                "version": self.store.version(name),
                "lag": self._lag.get(name, 0),
                "lag_seconds": round(self._lag_seconds.get(name, 0.0), 3),
                "last_apply": self._last_apply.get(name, 0.0),
                "source": self._sources.get(name, "kept"),
            }
            for name in names
        }
        ReplicaStatus(ready, os.getpid(), tables).write(self.status_path)

    async def _status_loop(self) -> None:
        while True:
            await asyncio.sleep(_STATUS_EVERY_S)
            for name, when in self._last_apply.items():
                self.metrics.replication_last_apply_timestamp.labels(name).set(when)
            try:
                self._write_status()
            except (OSError, RobezError):
                logger.debug("could not write the replication status", exc_info=True)

    async def _lag_loop(self) -> None:
        """``robez_replication_lag_versions`` and ``_seconds`` of every table, every ``_LAG_EVERY_S``.

        Measured against the log's last position, not the reader's view of it: an applier stalled in an
        apply, an upload or a dead consumer shows its lag growing (the consumer's own pending count stays
        at what it was when the last entry was delivered)."""
        while True:
            await asyncio.sleep(_LAG_EVERY_S)
            tables = [(name, entry) for name, (entry, task) in self._tasks.items() if not task.done()]
            lasts = await asyncio.gather(*(self._log_last(entry) for _, entry in tables))
            now = time.time()
            for (name, _), last in zip(tables, lasts, strict=True):
                try:
                    version = self.store.version(name)
                except NotFoundError:
                    continue  # being created or dropped
                if last is None:
                    continue
                lag = max(0, last - version)
                if lag == 0:
                    self._caught_up_at[name] = now
                    seconds = 0.0
                else:
                    # The oldest entry not applied was stored after the last one applied, and after the
                    # last time none was pending: its age is at most the time since the later of the two.
                    since = max(
                        self._applied_log_time.get(name, 0.0), self._caught_up_at.setdefault(name, now)
                    )
                    seconds = max(0.0, now - since)
                self._lag[name], self._lag_seconds[name] = lag, seconds
                self.metrics.replication_lag_versions.labels(name).set(lag)
                self.metrics.replication_lag_seconds.labels(name).set(seconds)

    async def _log_last(self, entry: CatalogEntry) -> int | None:
        """The log's last position of the table, None when the log does not tell within the timeout."""
        try:
            async with asyncio.timeout(_LAG_TIMEOUT_S):
                _, last = await self.log.bounds(entry)
        except (TimeoutError, RobezError):
            return None
        return last


def _same_spec(entry: CatalogEntry, config: TableConfig, optimizer: OptimizerConfig) -> bool:
    return (TableConfig.from_dict(entry.config), OptimizerConfig.from_dict(entry.optimizer)) == (
        config,
        optimizer,
    )


def _check_spec(entry: CatalogEntry, path: Path) -> None:
    """``CorruptionError`` unless the checkpoint at ``path`` is of the catalog entry's config and
    optimizer (a snapshot of another table, or of another spec, must never be served under this name)."""
    checkpoint = CheckpointFile.open(path)
    expected = (TableConfig.from_dict(entry.config), OptimizerConfig.from_dict(entry.optimizer))
    if (checkpoint.config, checkpoint.optimizer) != expected:
        raise CorruptionError(f"table {entry.name!r}: the snapshot {path} is of another config or optimizer")
