"""Snapshot uploads of the applier (``applier.py``): when a table's state is copied (lock-free:
``TableStore.copy_to_file`` takes the update lock only for its brief rounds), written to the data
directory (``localsnap.py``) and uploaded to the log's snapshot store under a lease, and the log trimmed
below it; all of it, the copy included, in background tasks, one per table at a time, while the
applier applies on (only the lease is taken in the apply loop). ``SnapshotUploads`` is the part of
``Applier`` that schedules them (the count trigger of the apply loop, ``_upload_timer``); the state it
reads is the applier's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

import anyio.to_thread

from robez_core.checkpoint import PendingCheckpoint
from robez_core.errors import RobezError

from ..config import Settings
from ..store import TableStore
from .localsnap import SCRATCH_PREFIX, LocalSnapshots
from .log import CatalogEntry, ReplicatedLog, Snapshot, SnapshotLease

logger = logging.getLogger("robez.replication")


class SnapshotUploads:
    """The snapshot scheduling of ``Applier`` (its base class; see the module's docstring)."""

    # Set by ``Applier.__init__``.
    store: TableStore
    settings: Settings
    log: ReplicatedLog
    local: LocalSnapshots | None
    _scratch: Path
    _holder: str
    _tasks: dict[str, tuple[CatalogEntry, asyncio.Task[None]]]
    _snapshot_tasks: dict[str, asyncio.Task[Any]]
    _snapshot_starting: set[str]
    _since_upload: dict[str, int]
    _last_upload: dict[str, float]
    _since_local: dict[str, int]

    # -- snapshots: the lease here, the copy and everything else in the background ------------------

    def _snapshot_running(self, name: str) -> bool:
        """A snapshot of the table is being started (lease) or runs in the background (copy, upload)."""
        task = self._snapshot_tasks.get(name)
        return name in self._snapshot_starting or (task is not None and not task.done())

    async def _copy(self, name: str, path: Path) -> tuple[PendingCheckpoint, int]:
        """The table's state at one version written to a temp file beside ``path`` while updates go on
        (``_write_copy``)."""
        pending, version, seconds = await anyio.to_thread.run_sync(_write_copy, self.store, name, path)
        logger.info(
            "table %s: state at version %d copied to a file in %.3f s (the update lock held as the "
            "robez.store log says)",
            name,
            version,
            seconds,
        )
        return pending, version

    async def _local_snapshot(self, entry: CatalogEntry, wait: bool = False) -> None:
        """Write the table's state to the data directory (localsnap.py) in the background: the copy, the
        checksums, fsync and rename (``wait``: before returning). Failures are logged only."""
        name = entry.name
        if self.local is None or name not in self.store.names() or self._snapshot_running(name):
            return
        counts = (self._since_local.get(name, 0), self.store.version(name))
        task = asyncio.create_task(self._write_local(entry, counts), name=f"robez-localsnap-{name}")
        self._snapshot_tasks[name] = task
        if wait:
            await task

    async def _write_local(self, entry: CatalogEntry, counts: tuple[int, int]) -> None:
        """The background local snapshot: the copy, then ``_finish_local``. ``counts``: the updates
        counted toward it and the version when it was started (``_in_copy``)."""
        assert self.local is not None
        name = entry.name
        try:
            pending, version = await self._copy(name, self.local.path_for(name, entry.incarnation, 0))
        except (RobezError, OSError) as exc:
            logger.warning("table %s: local snapshot failed: %s", name, exc)
            return
        self._count_local(name, _in_copy(counts, version))
        await self._finish_local(entry, pending, version)

    async def _finish_local(
        self, entry: CatalogEntry, pending: PendingCheckpoint, version: int
    ) -> Path | None:
        """Complete a local snapshot's file (checksums, fsync, rename into place, older ones removed)."""
        assert self.local is not None
        pending.path = self.local.path_for(entry.name, entry.incarnation, version)
        try:
            path = await anyio.to_thread.run_sync(pending.finish)
            await anyio.to_thread.run_sync(self.local.written, entry.name, entry.incarnation, version)
        except (RobezError, OSError) as exc:
            logger.warning("table %s: local snapshot failed: %s", entry.name, exc)
            return None
        finally:
            pending.discard()
        logger.info("table %s: local snapshot at version %d written to %s", entry.name, version, path)
        return path

    def _count_local(self, name: str, applied: int) -> None:
        if name in self._since_local:
            self._since_local[name] = max(0, self._since_local[name] - applied)

    def _count_uploaded(self, name: str, pending_updates: int) -> None:
        """Updates since the last upload: ``pending_updates`` fewer (they are in a stored snapshot)."""
        if name in self._since_upload:
            self._since_upload[name] = max(0, self._since_upload[name] - pending_updates)
            self._last_upload[name] = time.monotonic()

    async def _snapshot(self, entry: CatalogEntry, also_local: bool = False) -> None:
        """Start uploading the table's state, unless another replica holds the table's upload lease or
        stored a recent snapshot. Only the lease is taken here; the copy (``_copy``), the upload, the
        trim and the local snapshot (``also_local``: the same file serves both) run in a background task,
        one per table at a time, while the applier applies on."""
        name = entry.name
        if self._snapshot_running(name):
            return  # due again once it finished (the counters keep counting)
        self._snapshot_starting.add(name)
        try:
            await self._start_snapshot(entry, also_local)
        finally:
            self._snapshot_starting.discard(name)

    async def _start_snapshot(self, entry: CatalogEntry, also_local: bool) -> None:
        name = entry.name
        applied = self._since_upload.get(name, 0)
        try:
            lease = await self.log.lease_snapshot(entry, self._holder)
        except RobezError as exc:
            logger.warning("table %s: snapshot not uploaded: %s", name, exc)
            self._count_uploaded(name, applied)  # retried after the next period, not after every update
            return
        if lease is None:
            logger.info("table %s: another replica is uploading its snapshot", name)
            self._count_uploaded(name, applied)
        else:
            version = self.store.version(name)
            every = self.settings.replica_snapshot_every_updates
            recent = max(1, every // 2) if every else 1
            if version - lease.stored_position < recent:
                # Another replica stored one at about this version: it serves (and trimmed the log).
                await lease.release()
                self._since_upload[name] = max(0, version - lease.stored_position)
                self._last_upload[name] = time.monotonic()
            else:
                await self._start_upload(entry, lease, applied, also_local)
                return
        if also_local:
            self._snapshot_starting.discard(name)
            await self._local_snapshot(entry)

    async def _start_upload(
        self, entry: CatalogEntry, lease: SnapshotLease, applied: int, also_local: bool
    ) -> None:
        """Start the background task that copies the table's state and uploads it (``_copy_upload``);
        the lease is released whatever happens to it, even if it is cancelled before it starts."""
        name = entry.name
        local = self.local if also_local else None
        if local is not None:
            path = local.path_for(name, entry.incarnation, 0)
        else:
            path = self._scratch / f"{SCRATCH_PREFIX}{os.getpid()}-{name}.safetensors"
        counts = (applied, self._since_local.get(name, 0), self.store.version(name))
        task = asyncio.create_task(
            self._copy_upload(entry, lease, path, local is not None, counts), name=f"robez-upload-{name}"
        )
        task.add_done_callback(lambda done: _release_if_cancelled(done, lease))
        self._snapshot_tasks[name] = task

    async def _copy_upload(
        self, entry: CatalogEntry, lease: SnapshotLease, path: Path, local: bool, counts: tuple[int, int, int]
    ) -> None:
        """The copy of an upload (``_copy``), then the upload (``_upload``). ``counts``: the updates
        counted toward the upload and toward the local snapshot, and the version, when it was started."""
        name = entry.name
        applied, applied_local, started = counts
        try:
            pending, version = await self._copy(name, path)
        except BaseException as exc:
            await lease.release()
            if not isinstance(exc, RobezError | OSError):
                raise
            logger.warning("table %s: snapshot failed: %s", name, exc)
            self._count_uploaded(name, applied)
            return
        # Counted at the copy (with the updates applied while it ran, up to its version): those applied
        # while it uploads count toward the next one.
        self._count_uploaded(name, _in_copy((applied, started), version))
        if local:
            self._count_local(name, _in_copy((applied_local, started), version))
        await self._upload(entry, lease, pending, version, local)

    async def _upload(
        self, entry: CatalogEntry, lease: SnapshotLease, pending: PendingCheckpoint, version: int, local: bool
    ) -> None:
        """The background part of an upload: finish the file, stream it to the snapshot store under the
        lease, trim the log below it; then release the lease and remove the file (kept when it is the
        local snapshot too)."""
        name = entry.name
        path: Path | None = None
        start = time.monotonic()
        try:
            if local:
                path = await self._finish_local(entry, pending, version)
            else:
                path = await anyio.to_thread.run_sync(pending.finish, False)
            if path is None:
                return
            if await lease.put(Snapshot(version, path)):
                await self.log.trim(entry, version + 1 - self.settings.replica_trim_keep)
                logger.info(
                    "table %s: snapshot at version %d uploaded in %.1f s, log trimmed",
                    name,
                    version,
                    time.monotonic() - start,
                )
            else:
                logger.info("table %s: a snapshot at least as new is stored; this one was not kept", name)
        except (RobezError, OSError) as exc:
            # Retried after the next period (count or time), not after every update.
            logger.warning("table %s: snapshot failed: %s", name, exc)
        finally:
            pending.discard()
            if path is not None and not local:
                path.unlink(missing_ok=True)
            await lease.release()

    async def _upload_timer(self) -> None:
        """Upload every table with updates since its last upload once that upload is
        ``replica_snapshot_interval_s`` old; runs on its own, so a burst followed by silence is uploaded.
        Also a table whose count came due while its previous upload still ran (no apply triggers it
        after that upload if the pushes stopped)."""
        interval = self.settings.replica_snapshot_interval_s
        every = self.settings.replica_snapshot_every_updates
        while True:
            await asyncio.sleep(min(interval, 1.0) if interval > 0 else 1.0)
            now = time.monotonic()
            for name, (entry, task) in list(self._tasks.items()):
                since = self._since_upload.get(name, 0)
                timed = interval > 0 and now - self._last_upload.get(name, now) >= interval and since > 0
                counted = bool(every) and since >= every
                if (timed or counted) and not task.done() and not self._snapshot_running(name):
                    await self._snapshot(entry)


def _in_copy(counts: tuple[int, int], version: int) -> int:
    """The updates a copy at ``version`` holds of those counted since the last one: ``counts`` (the count
    and the version when the copy was started) plus those applied while it ran."""
    applied, started = counts
    return applied + max(0, version - started)


def _release_if_cancelled(task: asyncio.Task[None], lease: SnapshotLease) -> None:
    """A done callback: release the lease of an upload task that was cancelled (before it started, its
    own ``finally`` never ran; ``release`` again is a no-op)."""
    if task.cancelled():
        _releasing.add(released := asyncio.ensure_future(lease.release()))
        released.add_done_callback(_releasing.discard)


# The lease releases ``_release_if_cancelled`` started (a reference until they end).
_releasing: set[asyncio.Future[None]] = set()


def _write_copy(store: TableStore, name: str, path: Path) -> tuple[PendingCheckpoint, int, float]:
    """The table's tensors at one version written from shared memory to a temp file beside ``path``
    while the applier applies on (``TableStore.copy_to_file``: the update lock held only for the
    granules changed during the last round): (the pending checkpoint, the version, seconds it took)."""
    start = time.perf_counter()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        writer, version = store.copy_to_file(name, fd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return PendingCheckpoint(path, tmp, writer), version, time.perf_counter() - start
