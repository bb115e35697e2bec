"""``SnapshotScheduler``: the periodic snapshot policy (count, time, log size) and the one at shutdown."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial
from typing import TYPE_CHECKING, Protocol

from robez_core.errors import NotFoundError

from ..errors import StorageFullError

if TYPE_CHECKING:
    from robez_core.table import Table


from .journal import WalJournal

logger = logging.getLogger("robez.wal")


class _SnapshotSource(Protocol):
    """What the scheduler needs from ``TableStore``."""

    def names(self) -> list[str]: ...

    def version(self, name: str) -> int: ...

    def exclusive(self, name: str) -> AbstractContextManager[tuple[Table, int]]: ...


class SnapshotScheduler:
    """Takes the periodic snapshots (``snapshot_every_updates`` / ``_seconds``) and the one at shutdown.

    Every worker runs one; they need no coordination because each decision is re-checked under the
    table's update lock against meta.json, which the first worker to snapshot has already moved on, and a
    worker skips a table another is snapshotting. The snapshot is written on this thread with
    ``WalJournal.snapshot_live``: updates of that table wait only while the rows updated during its
    lock-free copy are patched, and for its commit (milliseconds); lookups never.

    Args:
        store: the worker's ``TableStore``.
        journal: the store's journal.
        check_seconds: how often the policy is checked (a cheap read of meta.json per table).
    """

    def __init__(self, store: _SnapshotSource, journal: WalJournal, check_seconds: float = 1.0) -> None:
        self.store = store
        self.journal = journal
        self.check_seconds = check_seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing: dict[str, str] = {}  # table -> the failure last logged
        self._storage_full_logged = -float("inf")

    # A full disk fails the snapshot at every check: one warning per this many seconds, not per check.
    STORAGE_FULL_LOG_SECONDS = 60.0

    @property
    def periodic(self) -> bool:
        """Whether any periodic policy is configured (otherwise no thread is started)."""
        journal = self.journal
        return bool(
            journal.snapshot_every_updates or journal.snapshot_every_seconds or journal.snapshot_log_ratio
        )

    def start(self) -> None:
        if self.periodic and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="robez-snapshots", daemon=True)
            self._thread.start()

    # At a graceful stop only tables whose snapshot is at most this big are snapshotted, and none is
    # started after SHUTDOWN_SECONDS: a bigger table's log is replayed at the next start instead (the
    # periodic policies bound it), so a stop fits an orchestrator's grace period (docs/durability.md).
    SHUTDOWN_SNAPSHOT_MAX_BYTES = 64 * 1024 * 1024
    SHUTDOWN_SECONDS = 10.0

    def stop(self, *, final_snapshot: bool) -> list[str]:
        """Stop the thread; with ``final_snapshot`` snapshot the tables that have updates since their
        last snapshot and are small enough to snapshot quickly (see ``SHUTDOWN_SNAPSHOT_MAX_BYTES``).
        Returns the tables snapshotted now."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60.0)
            self._thread = None
        if not final_snapshot:
            return []
        deadline = time.monotonic() + self.SHUTDOWN_SECONDS
        skipped: list[str] = []

        def due(name: str, version: int) -> bool:
            if not self.journal.has_pending(name, version):
                return False
            if (
                self.journal.snapshot_bytes(name) > self.SHUTDOWN_SNAPSHOT_MAX_BYTES
                or time.monotonic() > deadline
            ):
                if name not in skipped:
                    skipped.append(name)
                return False
            return True

        taken = self.run_once(due)
        if skipped:
            logger.info(
                "no snapshot at shutdown for %s (big, or past %g s of snapshots): their logs are replayed "
                "at the next start",
                ", ".join(skipped),
                self.SHUTDOWN_SECONDS,
            )
        return taken

    def run_once(self, due: Callable[[str, int], bool] | None = None) -> list[str]:
        """Snapshot every table for which ``due(name, version)`` holds (default: the periodic policy)."""
        due = due if due is not None else self.journal.snapshot_due
        taken: list[str] = []
        for name in self.store.names():
            stage = "checking whether a snapshot is due (reading meta.json)"
            try:
                if not due(name, self.store.version(name)):
                    self._succeeded(name)
                    continue
                stage = "writing the snapshot"
                started = time.monotonic()
                version = self.journal.snapshot_live(name, partial(self.store.exclusive, name), due)
                if version is not None:
                    taken.append(name)
                    logger.info(
                        "snapshot of table %r at version %d (%.1f s)",
                        name,
                        version,
                        time.monotonic() - started,
                    )
                self._succeeded(name)
            except NotFoundError:
                continue  # deleted meanwhile
            except StorageFullError as error:  # an operator's problem, not a bug: no traceback
                now = time.monotonic()
                if now - self._storage_full_logged >= self.STORAGE_FULL_LOG_SECONDS:  # retried each check
                    self._storage_full_logged = now
                    logger.warning("snapshot of table %r failed (retried every check): %s", name, error)
            except Exception as error:
                # A failed snapshot loses nothing (the log still holds every update); try again later.
                self._failed(name, stage, error)
        return taken

    def _failed(self, name: str, stage: str, error: Exception) -> None:
        """Log what failed, once per distinct failure (the check runs every ``check_seconds``); the
        traceback only for errors other than the operating system's (descriptors, space, permissions)."""
        message = f"{type(error).__name__}: {error}"
        if self._failing.get(name) == message:
            return
        self._failing[name] = message
        logger.error(
            "snapshot policy, table %r: failed %s: %s (the log keeps every update; retrying every %g s, "
            "logged again only if the error changes)",
            name,
            stage,
            message,
            self.check_seconds,
            exc_info=None if isinstance(error, OSError) else error,
        )

    def _succeeded(self, name: str) -> None:
        if self._failing.pop(name, None) is not None:
            logger.info("snapshot policy, table %r: working again", name)

    def _loop(self) -> None:
        while not self._stop.wait(self.check_seconds):
            self.run_once()
