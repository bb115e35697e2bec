"""``WalJournal``: the store's ``Journal`` over per-table snapshots and update logs.

Its parts, one concept a module: ``layout`` (files, meta.json, clean-up, open handles, disk-full
accounting), ``appender`` (append and group commit), ``generations`` (whole snapshots and their policy),
``live_snapshots`` (a snapshot while updates go on), ``recovery`` (replay, salvage, recover).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from robez_core.errors import ConfigError

from ..faults import NO_FAULTS, Faults
from .appender import WalAppender
from .generations import WalGenerations
from .live_snapshots import WalLiveSnapshots
from .recovery import WalRecovery

if TYPE_CHECKING:
    from ..config import Settings


class WalJournal(WalAppender, WalGenerations, WalLiveSnapshots, WalRecovery):
    """Snapshots plus a write-ahead log per table under ``data_dir`` (see the module docstring).

    Every method that changes files must be called under the table's cross-worker update lock (the store
    does so), which is what keeps one ordered log per table across worker processes: each process opens
    the log ``O_APPEND`` and notices, by inode, when another process has replaced it.

    Args:
        data_dir: root folder; created if missing.
        fsync: ``"always"`` — ``append`` returns after the record is written and fdatasync'ed;
            ``"interval"`` — group commit: ``append`` returns after ``write`` with a ticket, and
            ``wait_durable(ticket)`` returns once a background thread's fdatasync has covered the record
            (it flushes at most every ``fsync_interval_ms``, as soon as the interval has passed when a
            record is waiting, so one fdatasync serves every update written meanwhile);
            ``"never"`` — the OS writes back when it likes. Every policy survives ``kill -9``.
        fsync_interval_ms: the least time between two flushes for ``"interval"``.
        snapshot_every_updates: take a snapshot once the log holds this many records (0: never).
        snapshot_every_seconds: take one when the last is older than this and the log is not empty (0: never).
        snapshot_log_ratio: take one when the log's bytes exceed this many times the snapshot's bytes
            (0: never) ...
        snapshot_log_min_bytes: ... and at least this many (the floor, so a small table is not snapshotted
            after every few big pushes).
        exclusive: lock the data directory for this journal alone (offline tools); servers share it. Either
            way a conflicting holder makes the constructor raise ``ConflictError``.
    """

    @classmethod
    def from_settings(cls, settings: Settings, faults: Faults = NO_FAULTS) -> WalJournal:
        """The journal a server with ``settings.data_dir`` uses (fsync and snapshot policy from settings;
        ``faults``: testing only, the process's fault hooks)."""
        if settings.data_dir is None:
            raise ConfigError("WalJournal needs settings.data_dir")
        journal = cls(
            settings.data_dir,
            fsync=settings.wal_fsync,
            fsync_interval_ms=settings.wal_fsync_interval_ms,
            snapshot_every_updates=settings.snapshot_every_updates,
            snapshot_every_seconds=settings.snapshot_every_seconds,
            snapshot_log_ratio=settings.snapshot_log_ratio,
            snapshot_log_min_bytes=settings.snapshot_log_min_bytes,
        )
        journal.faults = faults
        return journal
