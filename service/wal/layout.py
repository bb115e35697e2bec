"""The files of a ``WalJournal``'s data directory and the state every part of the journal shares.

``WalLayout`` (the base of ``WalJournal``): a table's folder, its meta.json (``TableMeta``, the commit
point) and the log header it must match, listing and setting aside tables, the repair of a snapshot
interrupted between its two renames, the removal of what a crash left, this process's open log handles
(``OpenLog``) and the disk-full accounting (``write_problem``). The layout itself is described in
``service/wal/__init__.py`` and docs/durability.md.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from robez_core.checkpoint import CheckpointFile, fsync_dir
from robez_core.errors import ConfigError, ConflictError, CorruptionError, NotFoundError

from ..errors import StorageFullError
from ..faults import NO_FAULTS, Faults
from .files import (
    lock_data_dir,
    open_private,
    remove_creation_leftovers,
    sync_data,
    validate_table_name,
    write_file_durably,
)
from .records import (
    CRC,
    FSYNC_POLICIES,
    LOG_FILE,
    LOG_HEADER,
    LOG_HEADER_SIZE,
    LOG_MAGIC,
    META_FILE,
    META_FORMAT,
    META_FORMAT_VERSION,
    FsyncPolicy,
    crc32,
    encode_log_header,
    follow_records,
)

if TYPE_CHECKING:
    from robez_core.config import OptimizerConfig, TableConfig

logger = logging.getLogger("robez.wal")


# The whole-table snapshot of one table at a time (across workers): ``<data_dir>/.snapshotting-<name>.lock``.
SNAPSHOTTING_PREFIX = ".snapshotting-"
# A dropped table's folder is renamed ".dropped-<name>-<8 hex>" (the drop's commit), then removed.
_DROPPED = ".dropped-"
_DAMAGED = ".damaged-"
# In a table's folder: how many times ``recover`` cut an unfinished update off its log (see _count_cut).
_CUTS_FILE = "log-cuts"


def _not_a_table(entry_name: str) -> bool:
    """Hidden entries (locks, staging, dropped and damaged folders) and a file system's lost+found."""
    return entry_name.startswith(".") or entry_name == "lost+found"


@dataclass
class TableMeta:
    """A table's meta.json, the commit point: the committed ``generation``, the ``version`` its snapshot
    holds, the snapshot's file name, crc32 and size in bytes, the table's embedding dim, and when the
    snapshot was committed (unix seconds)."""

    generation: int
    version: int
    snapshot: str
    snapshot_crc32: int
    snapshot_bytes: int
    embedding_dim: int
    created_unix: float

    def to_json(self) -> bytes:
        data = {"format": META_FORMAT, "format_version": META_FORMAT_VERSION, **self.__dict__}
        return json.dumps(data, indent=2, sort_keys=True).encode() + b"\n"


@dataclass
class OpenLog:
    """This process's append handle on a table's log; reopened when another process replaced the file."""

    fd: int
    inode: int
    generation: int
    base_version: int
    embedding_dim: int
    end: int  # byte offset just after the last record this process knows of
    last_version: int  # the version that record produces (base_version when the log has none)
    dirty: bool = False


class WalLayout:
    """The state of a ``WalJournal`` and the files of its data directory: paths, meta.json, listing,
    clean-up of what a crash left, this process's open log handles and the disk-full accounting. The
    constructor's arguments are ``WalJournal``'s (documented there); the other parts of the journal
    (``appender``, ``generations``, ``live_snapshots``, ``recovery``) build on this."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        fsync: FsyncPolicy = "always",
        fsync_interval_ms: float = 10.0,
        snapshot_every_updates: int = 0,
        snapshot_every_seconds: float = 0.0,
        snapshot_log_ratio: float = 0.0,
        snapshot_log_min_bytes: int = 0,
        exclusive: bool = False,
    ) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ConfigError(f"fsync must be one of {FSYNC_POLICIES}, got {fsync!r}")
        if not fsync_interval_ms > 0:
            raise ConfigError(f"fsync_interval_ms must be > 0, got {fsync_interval_ms}")
        if (
            min(snapshot_every_updates, snapshot_every_seconds, snapshot_log_ratio, snapshot_log_min_bytes)
            < 0
        ):
            raise ConfigError("the snapshot_* policies must be >= 0")
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._dir_lock = lock_data_dir(self.data_dir, exclusive)
        if exclusive:  # no server can be creating a table now: what a crashed create left can go
            remove_creation_leftovers(self.data_dir)
        self._remove_dropped()  # start-up of a server, a worker or a tool
        self.fsync = fsync
        self.fsync_interval_ms = float(fsync_interval_ms)
        self.snapshot_every_updates = snapshot_every_updates
        self.snapshot_every_seconds = snapshot_every_seconds
        self.snapshot_log_ratio = float(snapshot_log_ratio)
        self.snapshot_log_min_bytes = int(snapshot_log_min_bytes)
        self._logs: dict[str, OpenLog] = {}
        self._log_paths: dict[str, str] = {}
        # Guards self._logs and the life of its file descriptors against the flusher thread.
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._flusher: threading.Thread | None = None
        # Group commit ("interval"): tickets are numbered in append order within this process. The
        # condition's lock guards the numbers below and every log's ``dirty`` flag; never held across an
        # fdatasync. Lock order: ``_lock``, then this one.
        self._tickets = threading.Lock()
        self._work = threading.Condition(self._tickets)  # the flusher waits here for records
        self._flushed = threading.Condition(self._tickets)  # writers wait here for their ticket
        self._issued = 0  # the last ticket handed out
        self._flushed_through = 0  # the last ticket a finished flush round covered (or tried to)
        self._durable_through = 0  # the last ticket known durable
        self._flush_error: OSError | None = None  # sticky: see wait_durable
        # Bytes the last write refused for lack of space needed (None: no such refusal since the last
        # write that succeeded); ``write_problem`` reports it until that much space is free again.
        self._no_space_needed: int | None = None
        # Testing only (service/faults.py): the kill points and pauses; set by ``WalJournal.from_settings``.
        self.faults: Faults = NO_FAULTS

    # -- paths -------------------------------------------------------------------------------------------

    def table_dir(self, name: str) -> Path:
        """The folder of one table (its name validated first)."""
        validate_table_name(name)
        return self.data_dir / name

    def snapshot_path(self, name: str) -> Path | None:
        """The committed snapshot file of a table, or None if the table has none."""
        meta = self._read_meta(name)
        return None if meta is None else self.table_dir(name) / meta.snapshot

    def snapshot_version(self, name: str) -> int | None:
        """The version the committed snapshot holds, or None if the table has none."""
        meta = self._read_meta(name)
        return None if meta is None else meta.version

    def snapshot_bytes(self, name: str) -> int:
        """The size of the table's committed snapshot file (0 if it has none)."""
        meta = self._read_meta(name)
        return 0 if meta is None else meta.snapshot_bytes

    def open_snapshot(self, name: str) -> tuple[BinaryIO, int]:
        """The committed snapshot file, opened for reading, and the version it holds.

        The open file stays readable even if a later snapshot replaces (and unlinks) it meanwhile.
        """
        for _ in range(3):  # a concurrent snapshot may unlink the file between reading meta and opening it
            meta = self._read_meta(name)
            if meta is None:
                raise NotFoundError(f"table {name!r} has no snapshot in {self.data_dir}")
            try:
                return open(self.table_dir(name) / meta.snapshot, "rb"), meta.version
            except FileNotFoundError:
                continue
        raise ConflictError(f"table {name!r} is being snapshotted repeatedly; try again")

    # -- tables in the data directory --------------------------------------------------------------------

    def names(self) -> list[str]:
        """Tables with a committed snapshot in the data directory, sorted. Raises ``CorruptionError``
        naming any table folder without its meta.json: a table is never left out silently."""
        damaged = self.damaged()
        if damaged:
            folders = ", ".join(str(self.table_dir(name)) for name in damaged)
            raise CorruptionError(
                f"table folder(s) without {META_FILE}, which cannot be loaded: {folders}. Restore "
                f"{META_FILE} from a backup, or set the folder(s) aside (files kept) with: robez snapshot "
                f"--data-dir {self.data_dir} --salvage"
            )
        return sorted(
            entry.name
            for entry in self.data_dir.iterdir()
            if not _not_a_table(entry.name) and (entry / META_FILE).is_file()
        )

    def damaged(self) -> list[str]:
        """Table folders without meta.json, sorted: damage (a create builds its table in a hidden
        ``.creating-*`` folder and renames it into place whole, so none is ever left this way)."""
        return sorted(
            entry.name
            for entry in self.data_dir.iterdir()
            if not _not_a_table(entry.name) and entry.is_dir() and not (entry / META_FILE).exists()
        )

    def set_aside(self, name: str) -> Path:
        """Rename a damaged table folder to a hidden ``.damaged-<name>-<8 hex>`` beside it (files kept, for
        an operator to inspect); returns the new path."""
        aside = self.data_dir / f"{_DAMAGED}{name}-{uuid.uuid4().hex[:8]}"
        os.replace(self.table_dir(name), aside)
        fsync_dir(self.data_dir)
        return aside

    def stored_spec(self, name: str) -> tuple[TableConfig, OptimizerConfig] | None:
        """The config and optimizer of the table's committed snapshot, read from its header alone."""
        path = self.snapshot_path(name)
        if path is None:
            return None
        checkpoint = CheckpointFile.open(path)
        return checkpoint.config, checkpoint.optimizer

    def drop(self, name: str) -> None:
        """Remove a table's folder (renamed aside first, so a crash leaves either all or nothing). What a
        process killed after the rename leaves goes at the next ``create`` of the name (the store's
        repair writes the table back through it) or the next start (``_remove_dropped``)."""
        directory = self.table_dir(name)
        self._forget_log(name)
        if not directory.exists():
            return
        doomed = self.data_dir / f"{_DROPPED}{name}-{uuid.uuid4().hex[:8]}"
        os.replace(directory, doomed)  # the commit
        fsync_dir(self.data_dir)
        self.faults.die_at("drop:renamed")  # testing only: a kill before the folder is removed
        shutil.rmtree(doomed, ignore_errors=True)

    # -- meta.json and the log's header ------------------------------------------------------------------

    def _read_meta(self, name: str) -> TableMeta | None:
        path = self.table_dir(name) / META_FILE
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            data = json.loads(raw)
            if data.pop("format") != META_FORMAT or data.pop("format_version") != META_FORMAT_VERSION:
                raise ValueError("unknown format")
            meta = TableMeta(**data)
            if Path(meta.snapshot).name != meta.snapshot:
                raise ValueError("snapshot must be a file name")
            return meta
        except (ValueError, TypeError, KeyError) as error:
            raise CorruptionError(f"table {name!r}: {path} is not valid table metadata ({error})") from error

    def _require_meta(self, name: str) -> TableMeta:
        meta = self._read_meta(name)
        if meta is None:
            raise CorruptionError(f"table {name!r}: meta.json is missing in {self.table_dir(name)}")
        return meta

    @staticmethod
    def _check_header(fd: int, meta: TableMeta, where: str) -> None:
        head = os.pread(fd, LOG_HEADER_SIZE, 0)
        if len(head) != LOG_HEADER_SIZE or CRC.unpack_from(head, LOG_HEADER.size)[0] != crc32(
            head[: LOG_HEADER.size]
        ):
            raise CorruptionError(f"{where} has a bad header")
        magic, _fmt, _dim, generation, base_version = LOG_HEADER.unpack(head[: LOG_HEADER.size])
        if magic != LOG_MAGIC or (generation, base_version) != (meta.generation, meta.version):
            raise CorruptionError(f"{where} (generation {generation}) does not match meta.json")

    @staticmethod
    def _check_log_matches(
        name: str, generation: int, base_version: int, embedding_dim: int, meta: TableMeta
    ) -> None:
        if generation > meta.generation:
            raise CorruptionError(
                f"table {name!r}: log generation {generation} is newer than the committed snapshot's "
                f"{meta.generation}"
            )
        if base_version != meta.version or embedding_dim != meta.embedding_dim:
            raise CorruptionError(
                f"table {name!r}: log starts after version {base_version} (dim {embedding_dim}) "
                f"but the snapshot is version {meta.version} (dim {meta.embedding_dim})"
            )

    def _log_is_empty(self, name: str) -> bool:
        return self._log_bytes(name) <= LOG_HEADER_SIZE

    def _log_bytes(self, name: str) -> int:
        try:
            return (self.table_dir(name) / LOG_FILE).stat().st_size
        except FileNotFoundError:
            return 0

    def _cuts(self, name: str) -> int:
        """How many times ``recover`` cut an unfinished update off the table's log (``log_mark``)."""
        try:
            return int((self.table_dir(name) / _CUTS_FILE).read_text() or 0)
        except FileNotFoundError:
            return 0

    def _count_cut(self, name: str) -> None:
        """One more cut (under the update lock): a lock-free copy running since before it may hold values
        of the cut update, which the log no longer names; ``log_mark`` then says it cannot tell."""
        count = self._cuts(name) + 1
        with open_private(self.table_dir(name) / _CUTS_FILE) as handle:  # 0600, as every file here
            handle.write(str(count).encode())

    # -- what a crash left -------------------------------------------------------------------------------

    def _finish_interrupted_snapshot(self, name: str, meta: TableMeta) -> bool:
        """If the log is older than the committed snapshot (its writer died between committing meta.json
        and swapping the fresh log in), put the committed generation's log in its place: the fresh log
        (``updates.wal.new``, fsynced before the commit; a live snapshot's holds the updates appended
        while it was written) or, if there is none, an empty one. Caller holds the table's update lock
        (or the data directory alone, at start-up). Returns whether it did."""
        path = self.table_dir(name) / LOG_FILE
        try:
            with open(path, "rb") as handle:
                head = handle.read(LOG_HEADER.size)
        except FileNotFoundError:
            return False
        if len(head) < LOG_HEADER.size:
            return False
        magic, _fmt, _dim, generation, _base = LOG_HEADER.unpack(head)
        if magic != LOG_MAGIC or generation >= meta.generation:
            return False
        fresh = self._committed_fresh_log(name, meta)
        if fresh is not None:
            logger.warning(
                "table %r: log generation %d is older than the snapshot's %d (a worker died while "
                "snapshotting); the snapshot's log (%s) takes its place",
                name,
                generation,
                meta.generation,
                fresh,
            )
            os.replace(fresh, path)
            fsync_dir(path.parent)
        else:
            logger.warning(
                "table %r: log generation %d is older than the snapshot's %d (a worker died while "
                "snapshotting); its updates are all in the snapshot, starting an empty log",
                name,
                generation,
                meta.generation,
            )
            write_file_durably(path, encode_log_header(meta.embedding_dim, meta.generation, meta.version))
        self._remove_stale_files(path.parent, meta)
        self._forget_log(name)
        return True

    def _committed_fresh_log(self, name: str, meta: TableMeta) -> Path | None:
        """``updates.wal.new`` if it is the log of the committed generation (written and fsynced before
        meta.json was: it holds the updates a live snapshot carried over), else None."""
        fresh = self.table_dir(name) / f"{LOG_FILE}.new"
        try:
            with open(fresh, "rb") as handle:
                self._check_header(handle.fileno(), meta, str(fresh))
                size = os.fstat(handle.fileno()).st_size
                follow_records(handle.fileno(), LOG_HEADER_SIZE, size, meta.version, str(fresh))
        except (FileNotFoundError, CorruptionError):
            return None
        return fresh

    def _remove_leftovers(self, directory: Path, meta: TableMeta) -> None:
        for entry in directory.iterdir():
            stray_snapshot = entry.name.startswith("snapshot-") and entry.name != meta.snapshot
            if ".tmp" in entry.name or entry.name == f"{LOG_FILE}.new" or stray_snapshot:
                logger.info("removing %s, left by an interrupted write", entry)
                entry.unlink(missing_ok=True)

    def _remove_stale_files(self, directory: Path, meta: TableMeta, keep: str | None = None) -> None:
        """Remove every snapshot file of the table but the one ``meta`` (committed) names, and a fresh log
        an interrupted snapshot left (``updates.wal.new``). Only once the log of that generation is in
        place: from then on recovery reads that snapshot and that log alone, so no other file can be
        needed (a reader that opened an old snapshot keeps it while open). Caller holds the table's update
        lock, so no snapshot is being written meanwhile. ``keep``: a file name the caller removes itself,
        after the lock (the snapshot just replaced: unlinking gigabytes takes a while; no snapshot ever
        takes that name again, and a stray one goes at the next commit or start)."""
        (directory / f"{LOG_FILE}.new").unlink(missing_ok=True)
        for entry in directory.glob("snapshot-*.safetensors"):
            if entry.name not in (meta.snapshot, keep):
                logger.debug("removing %s, replaced by %s", entry, meta.snapshot)
                entry.unlink(missing_ok=True)

    def _remove_dropped(self, name: str | None = None) -> None:
        """Remove the folders of drops that were committed (renamed aside) but whose process was killed
        before it removed them; ``name``: only that table's. Nothing reads a dropped folder, so any
        process may remove one at any time (two removing the same one at once both ignore errors)."""
        for entry in self.data_dir.iterdir():
            # ".dropped-<name>-<8 hex>": the table name is what lies between the prefix and the last "-".
            dropped, _, _suffix = entry.name.rpartition("-")
            if not dropped.startswith(_DROPPED) or (name is not None and dropped != _DROPPED + name):
                continue
            if entry.is_dir():
                logger.info("removing %s, left by a delete that was killed", entry)
                shutil.rmtree(entry, ignore_errors=True)

    # -- this process's open logs ------------------------------------------------------------------------

    def _forget_log(self, name: str) -> None:
        with self._lock:
            old = self._logs.pop(name, None)
            if old is not None:
                self._close_log(old)

    def _close_log(self, log: OpenLog) -> None:
        """fdatasync a log this process wrote since the last flush, then close it; caller holds
        ``_lock``. The flusher no longer sees it, so a failure here fails the waiting writers too."""
        try:
            if log.dirty:
                sync_data(log.fd)
                log.dirty = False
        except OSError as error:
            with self._tickets:
                self._flush_error = self._flush_error or error
                self._flushed.notify_all()
            raise
        finally:
            os.close(log.fd)

    # -- disk-full accounting ----------------------------------------------------------------------------

    def write_problem(self) -> str | None:
        """Why writes are refused now: a write found no space and the data directory's file system still
        has less free than it needed; None otherwise (a check of free space, not a write)."""
        needed = self._no_space_needed
        if needed is None:
            return None
        try:
            stats = os.statvfs(self.data_dir)
            free = stats.f_bavail * stats.f_frsize
        except OSError:
            free = 0
        if free >= needed:
            self._no_space_needed = None
            return None
        return (
            f"the file system of the data directory {self.data_dir} is full: {free} bytes free, the last "
            f"refused write needed {needed}"
        )

    def _storage_full(self, what: str, needed: int) -> StorageFullError:
        """The error for a write refused for lack of space (the caller has undone any partial write)."""
        self._no_space_needed = max(needed, self._no_space_needed or 0)
        return StorageFullError(
            f"no space left on the file system of the data directory {self.data_dir}: {what} refused, "
            "nothing was applied; free space there, then retry"
        )
