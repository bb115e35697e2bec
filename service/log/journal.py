"""The durability hook between the table store and a write-ahead log.

``TableStore`` (``tables.py``) calls a ``Journal`` at fixed points, per docs/architecture.md
"Journal hook": ``append`` under the table's cross-worker update lock, before the update is applied;
``wait_durable`` with the ticket ``append`` returned, after the lock is released and before the response
is sent (group commit: the writers that come next append meanwhile and share one flush); ``create`` /
``snapshot`` / ``drop`` when tables come and go; ``load`` and ``names`` at start-up; ``recover`` when a
worker died holding a table's update lock in the middle of an update (the store's repair). ``NullJournal`` (no
data directory) keeps nothing: tables live in memory only. ``service/wal/`` provides the durable
implementation, ``WalJournal``.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from .entry import UpdateRecord

if TYPE_CHECKING:
    import numpy as np

    from robez_core.config import OptimizerConfig, TableConfig
    from robez_core.table import Table


_NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_storage_full(error: BaseException) -> bool:
    """Whether ``error`` (or the error it was raised from) says the file system is full (or over quota)."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _NO_SPACE_ERRNOS:
            return True
        seen = seen.__cause__
    return False


@dataclass(frozen=True)
class LogMark:
    """Where a journal's log stood at one version of a table (``Journal.log_mark``).

    Attributes:
        version: the table's version then.
        where: the journal's own note of the place (opaque to the caller).
    """

    version: int
    where: tuple[int, ...]


@runtime_checkable
class Journal(Protocol):
    """Where the store makes tables and their updates durable; every method may raise ``RobezError``."""

    def load(self, name: str) -> tuple[Table, int] | None:
        """The table's last snapshot with its log replayed, and its version; None if unknown."""
        ...

    def names(self) -> list[str]:
        """Names of the tables present in the data directory."""
        ...

    def load_into(self, name: str, table: Table) -> int | None:
        """``load`` into ``table`` (allocated by the caller with the config ``stored_spec`` gives, in
        shared memory): no private copy of the table. Returns the version reached; None if unknown."""
        ...

    def stored_spec(self, name: str) -> tuple[TableConfig, OptimizerConfig] | None:
        """The config and optimizer of a table in the data directory, without loading it (None if absent):
        start-up checks a tables file against the limits with them before anything is created."""
        ...

    def create(self, name: str, table: Table, version: int) -> None:
        """Write the first snapshot of a new table."""
        ...

    def append(self, record: UpdateRecord) -> int:
        """Log one update (written, so it survives a crash of the process, when this returns); returns a
        ticket for ``wait_durable``; a ticket <= 0 means already as durable as promised (nothing to wait
        for, and callers may skip the wait). Called under the table's update lock."""
        ...

    def wait_durable(self, ticket: int) -> None:
        """Return once the update ``append`` gave ``ticket`` for is as durable as the fsync policy
        promises (at once where ``append`` already made it so). Called without the table's lock."""
        ...

    def snapshot(self, name: str, table: Table, version: int) -> None:
        """Write a snapshot atomically, then truncate the table's log."""
        ...

    def snapshot_live(
        self,
        name: str,
        exclusive: Callable[[], AbstractContextManager[tuple[Table, int]]],
        due: Callable[[str, int], bool] | None = None,
    ) -> int | None:
        """Snapshot the table served, holding its update lock (``exclusive()``) only for what must see
        it unchanged; returns the version snapshotted, None when skipped (``due`` is the scheduler's
        policy, checked under the lock; with it a snapshot already running elsewhere is not waited
        for)."""
        ...

    def log_mark(self, name: str, version: int, since: LogMark | None = None) -> LogMark | None:
        """Where the table's log stands at ``version`` (a lock-free copy patches what was logged between
        two marks, ``store/live_copy.py``). Called under the table's update lock, the table at
        ``version``; cheap (no record is read: the lock is held for it). None when the journal cannot
        say: it keeps no log, or the log was replaced or had an unfinished update cut off since
        ``since``."""
        ...

    def updated_ids(self, name: str, since: LogMark, until: LogMark) -> list[np.ndarray] | None:
        """The ids (int64 arrays, one per update, as logged) of every update after ``since`` up to
        ``until`` (two marks of ``log_mark``, ``until`` the later). No lock needed: what is logged up to
        a mark never changes. None when they can no longer be read (the log was replaced since
        ``until``); ``CorruptionError`` when the log between the marks does not hold exactly those
        versions."""
        ...

    def recover(self, name: str, version: int) -> Table | None:
        """The table rebuilt at exactly ``version`` from what is durable, with anything logged after
        that version removed; None if the journal keeps nothing to rebuild from. Called under the
        table's update lock when its last holder died in the middle of an update."""
        ...

    def drop(self, name: str) -> None:
        """Forget a table: remove its snapshot and log."""
        ...

    def write_problem(self) -> str | None:
        """Why this process cannot take writes now (the data directory's file system is full), or None."""
        ...

    def close(self) -> None:
        """Flush and release files."""
        ...


class NullJournal:
    """The journal of a server without a data directory: nothing is persisted, nothing is loaded."""

    def load(self, name: str) -> tuple[Table, int] | None:
        return None

    def names(self) -> list[str]:
        return []

    def stored_spec(self, name: str) -> tuple[TableConfig, OptimizerConfig] | None:
        return None

    def load_into(self, name: str, table: Table) -> int | None:
        loaded = self.load(name)
        if loaded is None:
            return None
        targets = table.tensors()
        for key, tensor in loaded[0].tensors().items():
            targets[key].copy_(tensor.reshape(targets[key].shape))
        return loaded[1]

    def create(self, name: str, table: Table, version: int) -> None:
        pass

    def append(self, record: UpdateRecord) -> int:
        return 0

    def wait_durable(self, ticket: int) -> None:
        pass

    def snapshot(self, name: str, table: Table, version: int) -> None:
        pass

    def snapshot_live(
        self,
        name: str,
        exclusive: Callable[[], AbstractContextManager[tuple[Table, int]]],
        due: Callable[[str, int], bool] | None = None,
    ) -> int | None:
        return snapshot_under_lock(self, name, exclusive, due)

    def log_mark(self, name: str, version: int, since: LogMark | None = None) -> LogMark | None:
        return None  # no log: unknown

    def updated_ids(self, name: str, since: LogMark, until: LogMark) -> list[np.ndarray] | None:
        return None

    def recover(self, name: str, version: int) -> Table | None:
        return None

    def drop(self, name: str) -> None:
        pass

    def write_problem(self) -> str | None:
        return None

    def close(self) -> None:
        pass


def snapshot_under_lock(
    journal: Journal,
    name: str,
    exclusive: Callable[[], AbstractContextManager[tuple[Table, int]]],
    due: Callable[[str, int], bool] | None = None,
) -> int | None:
    """``snapshot_live`` of a journal that keeps no log to patch a copy from: the snapshot is taken whole
    under the update lock (``exclusive``); returns its version, or None where ``due`` says not now."""
    with exclusive() as (table, version):
        if due is not None and not due(name, version):
            return None
        journal.snapshot(name, table, version)
        return version
