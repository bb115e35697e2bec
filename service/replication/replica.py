"""A robez server as a replica of tables kept identical through a replicated log (``ReplicatedLog``).

Every worker of a replica has a ``Replica``: it takes writes (validate -> append to the log -> wait until
this replica applied that position) and answers with the log position as the version. Exactly one
process per replica applies the log to the shared tables (``applier.Applier``): the worker holding
``applier.lock`` (an ``flock`` in the shared directory; if that worker dies the lock is free and another
takes over). The others wait for versions by polling the tables' shared version counters, which the
applier advances, and read readiness from the applier's ``replication.json``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from robez_core.config import OptimizerConfig, TableConfig
from robez_core.errors import BusyError, ConfigError, ConflictError, NotFoundError
from robez_core.table import Table

from .. import tracing
from ..config import Settings, TableSpec
from ..faults import NO_FAULTS, Faults
from ..log.entry import Proposed
from ..metrics import Metrics
from ..store import TableInfo, TableStore, validate_table_name
from .applier import STATUS_FILE, Applier, ReplicaStatus
from .log import Appended, CatalogEntry, LogTrimmedError, ReplicatedLog
from .records import (
    SHAPE,
    encode_load,
    encode_update,
    payload_bytes,
    update_headers,
    update_shape,
    update_too_large,
)
from .replay import file_sha256, replay_log

logger = logging.getLogger("robez.replication")

LOCK_FILE = "applier.lock"
_ELECTION_POLL_S = 0.5
_CONNECT_RETRY_S = 0.5
# Writes count as possible while the last write check was acknowledged within this many check intervals;
# each check waits at most two of them for its ack.
_WRITE_CHECK_FRESH = 4
# Until the first write check is acknowledged at start, it is tried again this often (a write-check stream
# just created has no leader for a second or so).
_FIRST_WRITE_CHECK_RETRY_S = 0.05


def local_settings(settings: Settings) -> Settings:
    """The settings ``TableStore.prepare`` gets in replicated mode: no tables of its own (the applier
    creates them from the log's catalog and snapshots) and no data directory (the log is the journal)."""
    return settings.model_copy(update={"config": None, "default_table": False, "data_dir": None})


def open_log(settings: Settings, faults: Faults = NO_FAULTS) -> ReplicatedLog:
    """The replicated log named by the settings (JetStream; a Kafka backend would be chosen here);
    ``faults``: testing only (a slow snapshot upload)."""
    from .jetstream import JetStreamLog

    assert settings.nats_url is not None
    return JetStreamLog(
        [url.strip() for url in settings.nats_url.split(",") if url.strip()],
        replicas=settings.nats_replicas,
        prefix=settings.nats_prefix,
        dedup_window_s=settings.nats_dedup_window_s,
        client_name=replica_name(settings),
        timeout_s=settings.nats_publish_timeout_s,
        ping_interval_s=settings.nats_ping_interval_s,
        max_outstanding_pings=settings.nats_max_outstanding_pings,
        auth=settings.nats_auth(),
        faults=faults,
    )


def replica_name(settings: Settings) -> str:
    return settings.replica_name or f"{os.uname().nodename}:{settings.port}"


@dataclass(frozen=True)
class ReplicatedUpdate:
    """A push as the log took it: its version (= position), seconds from publishing to the quorum's ack
    and from the ack to this replica having applied it, and whether its key had been seen before."""

    version: int
    publish_seconds: float
    apply_wait_seconds: float
    duplicate: bool


class Replica:
    """One worker's part of a replica: the write path, version waits, and (when elected) the applier.

    Args:
        store: this worker's ``TableStore`` (NullJournal; the log is the journal).
        settings: ``nats_*``, ``apply_wait_s``, ``min_version_wait_ms`` and the tables file.
        metrics: where publish, apply and lag figures go.
        log: the replicated log (default: ``open_log(settings)``).
    """

    def __init__(
        self, store: TableStore, settings: Settings, metrics: Metrics, log: ReplicatedLog | None = None
    ) -> None:
        self.store = store
        self.settings = settings
        self.metrics = metrics
        self.log = log if log is not None else open_log(settings, store.faults)
        self.name = replica_name(settings)
        self.status_path = store.directory.path / STATUS_FILE
        self._lock_path = store.directory.path / LOCK_FILE
        self._lock_fd: int | None = None
        self._connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._write_check_task: asyncio.Task[None] | None = None
        self._write_acked = -float("inf")  # monotonic time of the last acknowledged write check
        self._write_problem = "not connected to the replicated log yet"
        self.applier: Applier | None = None
        self._entries: dict[str, CatalogEntry] = {}

    # -- life cycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect (in the background, retrying) and take part in the applier election."""
        self._task = asyncio.create_task(self._run(), name="robez-replica")
        self._task.add_done_callback(_log_failure)

    async def stop(self) -> None:
        for task in (self._write_check_task, self._task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self.applier is not None:
            await self.applier.stop()
        await self.log.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock: another worker may take over
            self._lock_fd = None

    async def _run(self) -> None:
        while True:
            try:
                await self.log.connect()
                break
            except BusyError as exc:
                logger.info("waiting for NATS: %s", exc)
                await asyncio.sleep(_CONNECT_RETRY_S)
        await self._first_write_check()
        self._connected.set()
        logger.info("replica %s connected to the log", replica_name(self.settings))
        self._write_check_task = asyncio.create_task(self._check_writes(), name="robez-write-check")
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(_ELECTION_POLL_S)
        self._lock_fd = fd
        logger.info("worker %d applies the log", os.getpid())
        self.applier = Applier(self.store, self.settings, self.metrics, self.log, self.status_path)
        await self.applier.run()

    # -- readiness ----------------------------------------------------------------------------------

    def status(self) -> ReplicaStatus | None:
        return ReplicaStatus.read(self.status_path)

    def ready(self) -> bool:
        status = self.status()
        return status is not None and status.ready and self._connected.is_set()

    def write_problem(self) -> str | None:
        """Why this worker could not get a write acknowledged now (``/readyz?writes=true``), or None: its
        last write check (``_check_writes``) must be fresh."""
        interval = self.settings.nats_write_check_interval_s
        if time.monotonic() - self._write_acked <= _WRITE_CHECK_FRESH * interval:
            return None
        return self._write_problem

    def log_server(self) -> str | None:
        """The log server this worker's connection is on now (host:port)."""
        return self.log.connected_to()

    async def _first_write_check(self) -> None:
        """Return once a write check is acknowledged through the new connection. Until then the replica
        counts as not connected: writes through it wait (``_wait_connected``) and it is not ready. Right
        after a cluster starts, the write-check stream that ``connect`` made may have no leader for a second
        or more (NATS: "no response from stream") while the catalog and the update streams, made earlier,
        already take writes; a replica that counted as connected then took pushes while its
        ``/readyz?writes=true`` said read-only. A check is what says it can write, and it counts as write-
        ready from that moment on."""
        interval = self.settings.nats_write_check_interval_s
        while True:
            try:
                await self.log.check_writable(timeout_s=2 * interval)
                self._write_acked = time.monotonic()
                self._write_problem = "no write check was acknowledged recently"
                return
            except BusyError as exc:
                if self._write_problem != str(exc):
                    logger.info("waiting for a first write check: %s", exc)
                self._write_problem = str(exc)
            await asyncio.sleep(_FIRST_WRITE_CHECK_RETRY_S)

    async def _check_writes(self) -> None:
        """Publish a tiny message every ``nats_write_check_interval_s``: its ack (a quorum stored it)
        through this worker's own connection is what ``write_problem`` trusts, so a hung server, a lost
        quorum or a lost connection shows within a few intervals."""
        interval = self.settings.nats_write_check_interval_s
        while True:
            started = time.monotonic()
            try:
                await self.log.check_writable(timeout_s=2 * interval)
                self._write_acked = time.monotonic()
                self._write_problem = "no write check was acknowledged recently"
            except BusyError as exc:
                if self._write_problem != str(exc):  # once per change
                    logger.warning("write check failed: %s", exc)
                self._write_problem = str(exc)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    # -- writes -------------------------------------------------------------------------------------

    async def _catalog_entry(self, name: str, *, fresh: bool = False) -> CatalogEntry:
        entry = None if fresh else self._entries.get(name)
        if entry is None:
            await self._wait_connected()
            entry = await self.log.get_table(name)
            if entry is None:
                self._entries.pop(name, None)
                if self._local_incarnation(name) is not None:
                    # This replica still serves the table: a drop not applied here yet, or a catalog read
                    # that missed it (seen once right after a NATS node restarted). A 404 is final for
                    # a client; a 503 is retried with the same Idempotency-Key, and answers 404 once the
                    # drop has reached this replica.
                    raise BusyError(f"table {name!r} is not in the catalog read just now; try again")
                raise NotFoundError(f"no table named {name!r}")
            self._entries[name] = entry
        return entry

    async def _wait_connected(self) -> None:
        try:
            await asyncio.wait_for(self._connected.wait(), timeout=self.settings.apply_wait_s)
        except TimeoutError as exc:
            raise BusyError("this replica is not connected to the replicated log yet") from exc

    async def update(
        self,
        name: str,
        ids: Tensor,
        grads: Tensor,
        lr: float,
        key: str | None,
        proposed: Proposed | None = None,
    ) -> ReplicatedUpdate:
        """Append a validated push (``lr`` already resolved by ``TableStore.validate_many``) and wait
        until this replica applied it; the version is the log position. ``proposed``: the step the
        validation prepared, kept for this worker's applier if it is this worker (``ProposedSteps``).

        ``key`` (the request's Idempotency-Key): a second append with it, within the dedup window,
        is not added to the log; its answer is the first one's version."""
        if tracing.TRACER is None:
            appended, entry, start = await self._publish(name, ids, grads, lr, key, None, proposed)
        else:
            with tracing.span("publish", name, int(ids.numel())) as span:
                appended, entry, start = await self._publish(
                    name, ids, grads, lr, key, tracing.inject(), proposed
                )
                span.set_attribute(tracing.VERSION, appended.position)
        acked = time.perf_counter()
        self.metrics.replication_publish_ack_seconds.labels(name).observe(acked - start)
        if not await self.wait_version(name, appended.position, self.settings.apply_wait_s):
            raise BusyError(
                f"update stored in the log at version {appended.position} but not yet applied by this "
                "replica; retry with the same Idempotency-Key"
            )
        if self._local_incarnation(name) != entry.incarnation:
            raise BusyError(f"table {name!r} was dropped or re-created meanwhile; try again")
        return ReplicatedUpdate(
            appended.position, acked - start, time.perf_counter() - acked, appended.duplicate
        )

    async def check_size(self, name: str, ids: Tensor, grads: Tensor, lr: float, key: str | None) -> None:
        """The 413 ``update`` would raise for this push's entry, without encoding it: a multi-table push
        checks every part before it publishes any, so a part over the limit publishes nothing (the
        client then splits the push with new keys, which must not store a part a second time)."""
        entry = await self._wait_local(name, fresh=False)
        num_rows, dim = update_shape(ids, grads)
        trace = tracing.inject() if tracing.TRACER is not None else {}
        key = key or "0" * 32  # the length of a generated key
        self._check_entry_size(
            entry, payload_bytes(num_rows, dim), update_headers(num_rows, dim, lr, trace), key
        )

    async def load(self, name: str, table: Table, path: Path, key: str | None) -> ReplicatedUpdate:
        """Load a checkpoint on every replica: ``table`` aligned to the table, saved at ``path`` (robez
        safetensors). It goes to the log's store, then a load entry naming it and its SHA-256 is
        appended; returns once this replica switched to it (the version is the entry's position).
        ``key`` as in ``update``: a retry appends nothing and its own copy of the checkpoint is
        deleted."""
        entry = await self._wait_local(name, fresh=False)
        wanted = (TableConfig.from_dict(entry.config), OptimizerConfig.from_dict(entry.optimizer))
        if (table.config, table.optimizer) != wanted:  # what every applier checks: refused, not skipped
            raise ConflictError(f"the checkpoint's config or optimizer differs from table {name!r}'s")
        sha256 = await asyncio.to_thread(file_sha256, path)
        start = time.perf_counter()
        with path.open("rb") as handle:
            object_name = await self.log.put_load(entry, handle)
        payload, headers = encode_load(object_name, sha256)
        # A failed append may still have reached the log: the checkpoint stays (the applier deletes it
        # once no entry can name it, ``Applier._forget_loads``).
        appended = await self.log.append(entry, payload, headers, key or secrets.token_hex(16))
        if appended.duplicate:
            with contextlib.suppress(BusyError):
                await self.log.delete_load(entry, object_name)
        acked = time.perf_counter()
        if not await self.wait_version(name, appended.position, self.settings.apply_wait_s):
            raise BusyError(
                f"load stored in the log at version {appended.position} but not yet applied by this "
                "replica; retry with the same Idempotency-Key"
            )
        if self._local_incarnation(name) != entry.incarnation:
            raise BusyError(f"table {name!r} was dropped or re-created meanwhile; try again")
        return ReplicatedUpdate(
            appended.position, acked - start, time.perf_counter() - acked, appended.duplicate
        )

    async def wait_serving(self, name: str) -> None:
        """Returns once this replica serves the catalog's incarnation of the table (``BusyError``
        after ``apply_wait_s``, ``NotFoundError`` if there is none)."""
        await self._wait_local(name, fresh=False)

    async def table_at(self, name: str, version: int) -> Table:
        """A private copy of the table as it was at ``version`` (before a load, say): the stored
        snapshot, or a fresh table, and the log up to there. ``ConflictError`` once that state is no
        longer kept (the snapshot is past it and the log trimmed below it) or not reached yet."""
        entry = await self._wait_local(name, fresh=False)
        applied = self.store.version(name)
        if version > applied:
            raise ConflictError(f"table {name!r} is at version {applied} here, not yet at {version}")
        with tempfile.TemporaryDirectory(prefix="robez-table-at-") as scratch:
            snapshot = await self.log.get_snapshot(entry, Path(scratch))
            if snapshot is not None and snapshot.position <= version:
                table = await asyncio.to_thread(Table.load, snapshot.path)
                position = snapshot.position
        if snapshot is None or snapshot.position > version:
            config, optimizer = (
                TableConfig.from_dict(entry.config),
                OptimizerConfig.from_dict(entry.optimizer),
            )
            table, position = await asyncio.to_thread(Table, config, optimizer), 0
        gone = ConflictError(
            f"table {name!r}: version {version} is no longer kept (the snapshot is at "
            f"{snapshot.position if snapshot is not None else 0} and the log was trimmed below it)"
        )
        try:
            table, position = await replay_log(self.log, entry, table, position, version)
        except LogTrimmedError as exc:
            raise gone from exc
        if position != version:
            raise gone
        return table

    async def _publish(
        self,
        name: str,
        ids: Tensor,
        grads: Tensor,
        lr: float,
        key: str | None,
        trace: dict[str, str] | None,
        proposed: Proposed | None,
    ) -> tuple[Appended, CatalogEntry, float]:
        """Append the push to the table's log: (the append's answer, the catalog entry it went to, when
        the publish started)."""
        payload, headers = encode_update(ids, grads, lr, trace)
        key = key or secrets.token_hex(16)
        for attempt in range(2):
            # The cached catalog entry may be of an incarnation dropped since: then the append finds no
            # stream, and the second attempt reads the catalog again.
            entry = await self._wait_local(name, fresh=attempt > 0)
            self._check_entry_size(entry, len(payload), headers, key)
            # Kept before the append: this worker's applier may read the entry before the ack comes.
            applier = self.applier
            token = None
            if proposed is not None and applier is not None:
                token = applier.proposed.put(name, payload, headers, proposed)
            start = time.perf_counter()
            try:
                return await self.log.append(entry, payload, headers, key), entry, start
            except BaseException as exc:
                if token is not None:
                    assert applier is not None
                    applier.proposed.discard(token)
                if not isinstance(exc, NotFoundError) or attempt:
                    raise
                self._entries.pop(name, None)
        raise AssertionError("unreachable")  # the second attempt returned or raised

    def _check_entry_size(self, entry: CatalogEntry, payload: int, headers: dict[str, str], key: str) -> None:
        """413 before publishing when the entry (``payload`` bytes with ``headers``) is over the connected
        server's limit: NATS would refuse it (and a retry would never pass), so the client learns the
        limit and splits instead."""
        limit = self.log.max_entry_bytes()
        size = self.log.entry_bytes(entry, payload, headers, key)
        if limit and size > limit:
            num_rows, dim = (int(n) for n in headers[SHAPE].split(","))
            raise update_too_large(entry.name, num_rows, dim, size, limit, size - payload)

    def _local_incarnation(self, name: str) -> str | None:
        if self.applier is not None:  # this worker applies the log: no need to read what it wrote
            return self.applier.incarnation(name)
        status = self.status()
        return None if status is None else status.tables.get(name, {}).get("incarnation")

    async def _wait_local(self, name: str, *, fresh: bool) -> CatalogEntry:
        """The catalog's entry of the table, once this replica serves that incarnation (it may be
        creating it, or still have the one dropped before): versions of two incarnations must never be
        compared. The cached entry is checked against the catalog when they differ."""
        deadline = time.monotonic() + self.settings.apply_wait_s
        entry = await self._catalog_entry(name, fresh=fresh)
        while self._local_incarnation(name) != entry.incarnation:
            if time.monotonic() > deadline:
                raise BusyError(f"table {name!r} is being created on this replica; try again")
            await asyncio.sleep(0.01)
            entry = await self._catalog_entry(name, fresh=True)
        return entry

    async def wait_version(self, name: str, version: int, timeout_s: float) -> bool:
        """True once this replica's table ``name`` is at ``version`` or later; False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        delay = 0.0002
        while True:
            if self.store.version(name) >= version:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if self.applier is not None:
                await self.applier.wait_applied(name, version, min(remaining, 0.05))
            else:
                await asyncio.sleep(min(delay, remaining))
                delay = min(2 * delay, 0.002)

    async def create_table(self, name: str, spec: TableSpec) -> TableInfo:
        """Create a table on every replica (through the catalog); returns once this replica has it."""
        validate_table_name(name)
        if spec.share_array_with is not None:
            raise ConfigError("share_array_with is not available on replicas: each table has its own log")
        await self._wait_connected()
        entry = await self.log.create_table(name, spec.config.to_dict(), spec.optimizer.to_dict())
        self._entries[name] = entry
        deadline = time.monotonic() + self.settings.apply_wait_s
        while time.monotonic() < deadline:
            if name in self.store.names():
                return self.store.info(name)
            await asyncio.sleep(0.01)
        raise BusyError(f"table {name!r} was created in the log but not yet on this replica; it will appear")

    async def drop_table(self, name: str) -> None:
        """Drop a table on every replica; returns once this replica no longer serves it."""
        await self._wait_connected()
        await self.log.drop_table(name)
        self._entries.pop(name, None)
        deadline = time.monotonic() + self.settings.apply_wait_s
        while time.monotonic() < deadline:
            if name not in self.store.names():
                return
            await asyncio.sleep(0.01)
        raise BusyError(f"table {name!r} was dropped from the log but this replica still has it")


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("the replica stopped following the log", exc_info=task.exception())
