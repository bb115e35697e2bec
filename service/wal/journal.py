"""``WalJournal``: the store's ``Journal`` over per-table snapshots and update logs."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import mmap
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

from robez_core.errors import ConfigError, ConflictError, CorruptionError, InvalidInputError, NotFoundError
from robez_core.table import CheckpointFile, CheckpointWriter, fsync_dir

from ..errors import StorageFullError
from ..faults import die_at, fault_file, slow_down
from ..log.entry import EntryGroup, UpdateRecord, apply_record
from ..log.journal import LogMark, is_storage_full
from ..log.live_copy import consistent_copy

if TYPE_CHECKING:
    from torch import Tensor

    from robez_core.config import OptimizerConfig, TableConfig
    from robez_core.table import Table

    from ..config import Settings

from .files import (
    CREATING_PREFIX,
    file_crc,
    lock_data_dir,
    open_private,
    remove_creation_leftovers,
    sync_data,
    table_bytes,
    validate_table_name,
    write_all,
    write_file_durably,
    write_temp_file,
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
    RecordSpan,
    crc32,
    decode_group,
    decode_record,
    encode_log_header,
    encode_record,
    find_record,
    follow_records,
    read_log_header,
    read_record_ids,
    scan_log,
    span_in,
    stream_records,
)

logger = logging.getLogger("robez.wal")

# The whole-table snapshot of one table at a time (across workers): ``<data_dir>/.snapshotting-<name>.lock``.
_SNAPSHOTTING = ".snapshotting-"
# A dropped table's folder is renamed ".dropped-<name>-<8 hex>" (the drop's commit), then removed.
_DROPPED = ".dropped-"
_DAMAGED = ".damaged-"
# In a table's folder: how many times ``recover`` cut an unfinished update off its log (see _count_cut).
_CUTS_FILE = "log-cuts"


def _not_a_table(entry_name: str) -> bool:
    """Hidden entries (locks, staging, dropped and damaged folders) and a file system's lost+found."""
    return entry_name.startswith(".") or entry_name == "lost+found"


@dataclass
class _Meta:
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
class _OpenLog:
    """This process's append handle on a table's log; reopened when another process replaced the file."""

    fd: int
    inode: int
    generation: int
    base_version: int
    embedding_dim: int
    end: int  # byte offset just after the last record this process knows of
    last_version: int  # the version that record produces (base_version when the log has none)
    dirty: bool = False


class WalJournal:
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

    # How long ``wait_durable`` waits for the flusher before giving up (a healthy flush takes ms).
    WAIT_LIMIT_SECONDS = 60.0

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
        self._logs: dict[str, _OpenLog] = {}
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
        # Testing only (service/faults.py): the file that, naming a point, kills this process there.
        self.fault_file: Path | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> WalJournal:
        """The journal a server with ``settings.data_dir`` uses (fsync and snapshot policy from settings)."""
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
        journal.fault_file = fault_file()
        return journal

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

    # -- Journal protocol --------------------------------------------------------------------------------

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

    def create(self, name: str, table: Table, version: int) -> None:
        """Write the first snapshot and an empty log, built in a hidden folder then renamed into place."""
        directory = self.table_dir(name)
        if (directory / META_FILE).exists():
            raise ConflictError(f"table {name!r} already exists in {self.data_dir}")
        staging = self.data_dir / f"{CREATING_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
        try:
            staging.mkdir()
            self._write_generation(staging, table, version, generation=1)
            os.replace(staging / f"{LOG_FILE}.new", staging / LOG_FILE)
            if self.fault_file is not None:  # testing only: a kill with the table staged, not in place
                die_at(self.fault_file, "create:staged")
            if directory.exists():
                # Never a crashed create's (those stay in .creating-*): a table damaged in place. Its files
                # are someone's data; nothing here removes them.
                raise CorruptionError(
                    f"table {name!r}: {directory} exists without {META_FILE}; it is left as it is. Restore "
                    f"{META_FILE}, or set it aside with: robez snapshot --data-dir {self.data_dir} --salvage"
                )
            os.replace(staging, directory)
            fsync_dir(self.data_dir)
        except Exception as error:
            if is_storage_full(error):
                raise self._storage_full(f"creating table {name!r}", table_bytes(table)) from error
            raise
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        self._forget_log(name)
        # The repair of a delete that died in ``drop`` writes the table back through here.
        self._remove_dropped(name)

    def append(self, record: UpdateRecord) -> int:
        """Write one record; returns a ticket for ``wait_durable``.

        ``always``: the record is fdatasync'ed before this returns (ticket 0: nothing to wait for).
        ``interval``: the record is written (it survives ``kill -9``); ``wait_durable(ticket)`` waits for
        the flush that covers it. ``never``: written, ticket 0. If the write fails the file is cut back
        to where it was and the error raised, so a failed append leaves no partial record for later
        appends to follow (which recovery would call corruption).
        """
        log = self._log_for_append(record.table)
        if record.version <= log.base_version:
            raise ConflictError(
                f"table {record.table!r}: update would produce version {record.version}, but the snapshot "
                f"is already at version {log.base_version}"
            )
        if record.grads.dim() != 2 or record.grads.shape[1] != log.embedding_dim:
            raise InvalidInputError(
                f"table {record.table!r}: grads of shape {tuple(record.grads.shape)}, the log has dim "
                f"{log.embedding_dim}"
            )
        size_before = os.fstat(log.fd).st_size
        if size_before != log.end:  # another worker appended (or a repair cut the log) since our last look
            where = f"table {record.table!r} log {self._log_paths[record.table]}"
            if size_before < log.end:
                log.end, log.last_version = LOG_HEADER_SIZE, log.base_version
            log.end, log.last_version = follow_records(log.fd, log.end, size_before, log.last_version, where)
        if record.version != log.last_version + 1:
            # The store's counter and the log disagree: appending would write a version twice (or skip
            # one) and make the log unrecoverable. Refuse; the store repairs before it appends.
            raise CorruptionError(
                f"table {record.table!r}: update would produce version {record.version}, but the log's last "
                f"record produces {log.last_version}"
            )
        buffers = encode_record(record.version, record.ids, record.grads, record.lr, record.group)
        try:
            write_all(log.fd, buffers)
            if self.fsync == "always":
                sync_data(log.fd)
        except BaseException as error:
            os.ftruncate(log.fd, size_before)
            if is_storage_full(error):
                needed = sum(memoryview(buffer).nbytes for buffer in buffers)
                what = f"update to version {record.version} of table {record.table!r}"
                raise self._storage_full(what, needed) from error
            raise
        log.end = size_before + sum(len(buffer) for buffer in buffers)
        log.last_version = record.version
        self._no_space_needed = None
        if self.fsync != "interval":
            return 0
        with self._tickets:
            self._ensure_flusher()  # under the lock: two first appends must not start two flushers
            log.dirty = True
            self._issued += 1
            self._work.notify()
            return self._issued

    def wait_durable(self, ticket: int) -> None:
        """Return once the record of ``ticket`` (from ``append``) is as durable as the policy promises:
        at once for ``always`` / ``never`` (ticket 0); for ``interval`` after a flush covering it.

        Called without the table's update lock, so the next writers can append meanwhile and share the
        flush. If a flush fails, this raises ``OSError`` for its records and for every later ticket of
        this journal (a failed fdatasync may have dropped the pages: a later one that succeeds proves
        nothing about them); the server must be restarted, which recovers from what is on disk.
        """
        if ticket <= 0:
            return
        deadline = time.monotonic() + self.WAIT_LIMIT_SECONDS
        with self._tickets:
            while self._durable_through < ticket:
                if self._flush_error is not None:
                    raise OSError(
                        self._flush_error.errno,
                        f"the update log could not be flushed to disk ({self._flush_error}); the update "
                        "was applied but may not survive a power loss: restart the server",
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise OSError(f"the update log was not flushed within {self.WAIT_LIMIT_SECONDS:g} s")
                self._flushed.wait(remaining)

    def snapshot(self, name: str, table: Table, version: int) -> None:
        """Commit a snapshot of ``table`` at ``version`` and start an empty log after it."""
        directory = self.table_dir(name)
        meta = self._read_meta(name)
        if meta is None:
            raise CorruptionError(f"table {name!r} has no committed snapshot in {directory}; cannot snapshot")
        try:
            self._write_generation(directory, table, version, generation=meta.generation + 1)
        except Exception as error:  # nothing committed: the old snapshot and log stand
            if is_storage_full(error):
                raise self._storage_full(f"snapshot of table {name!r}", table_bytes(table)) from error
            raise
        # meta.json now names the new generation; the old log is stale from here on.
        if self.fault_file is not None:  # testing only: a crash between the two renames
            die_at(self.fault_file, "snapshot:committed")
        os.replace(directory / f"{LOG_FILE}.new", directory / LOG_FILE)
        fsync_dir(directory)
        # Every older snapshot goes, not only the one this replaced: one an interrupted snapshot left
        # (the repair after ``snapshot:committed`` in a load is a snapshot of the table served).
        self._remove_stale_files(directory, self._require_meta(name))
        self._forget_log(name)

    def snapshot_live(
        self,
        name: str,
        exclusive: Callable[[], AbstractContextManager[tuple[Table, int]]],
        due: Callable[[str, int], bool] | None = None,
    ) -> int | None:
        """Commit a snapshot of the table served while its updates go on; returns the version it holds.

        ``exclusive()`` holds the table's update lock (the store's ``exclusive``). The new file's header
        is written and its space allocated; the state is copied into it through a mapping of the file by
        ``consistent_copy`` (store/live_copy.py: a lock-free copy, then, under the lock at the version V
        the snapshot holds, the rows the updates logged meanwhile touched, with V's log end noted); the
        file is hashed, its header completed and fsynced without the lock (pushes are appended to the
        current log meanwhile); under the lock again the records appended after V are copied into the
        next generation's log, then meta.json commits the snapshot and the log is swapped in, as
        ``snapshot`` does. A crash at any point leaves the old generation committed (stray files go at
        the next start) or the new one with its log complete.

        ``due``: the scheduler's policy, checked under the lock; None (an operator's snapshot) waits for
        a snapshot of this table already running in another worker, then takes its own. Returns None
        when not due, or when another worker is snapshotting the table (the scheduler tries again).
        Raises ``ConflictError`` if the table was loaded meanwhile (its snapshot then stands).
        """
        with self._snapshot_turn(name, wait=due is None) as turn:
            if not turn:
                return None
            directory = self.table_dir(name)
            fd: int | None = None
            staged: Path | None = None
            needed = 0
            try:
                with exclusive() as (table, version):
                    if due is not None and not due(name, version):
                        return None
                    meta = self._require_meta(name)
                    self._finish_interrupted_snapshot(name, meta)
                    if version == meta.version and self._log_is_empty(name):
                        return version  # the committed snapshot is this version already
                    needed = table_bytes(table)
                    tensors, metadata = table.tensors(), table.metadata()  # the layout: fixed
                    embedding_dim = table.config.embedding_dim
                generation = meta.generation + 1
                staged = directory / f"snapshot-{generation}.safetensors.tmp-{uuid.uuid4().hex[:8]}"
                fd = os.open(staged, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                writer = CheckpointWriter.begin(fd, tensors, metadata)

                def noted(_table: Table, current: int, mark: LogMark | None) -> tuple[int, int, int]:
                    """Under the lock, the copy at ``current`` complete: the log's end and inode there."""
                    now = self._read_meta(name)
                    if now is None or now.generation != meta.generation:
                        raise ConflictError(f"table {name!r} was loaded while it was being snapshotted")
                    log_end = mark.where[2] if mark is not None else self._log_end(name, meta, current)
                    return current, log_end, os.stat(directory / LOG_FILE).st_ino

                with _mapped(fd, writer, tensors) as targets:
                    version, log_end, log_inode = consistent_copy(name, self, exclusive, targets, noted)
                crc, size = _finish_snapshot(fd, staged, writer)  # hashing and fsync: no lock
                os.close(fd)
                fd = None
                header = encode_log_header(embedding_dim, generation, version)
                carried = self._carry_log(name, exclusive, meta, log_inode, log_end, version, header)
                with exclusive() as (_table, current):
                    held = time.perf_counter()
                    now = self._read_meta(name)
                    if (
                        now is None
                        or now.generation != meta.generation
                        or os.stat(directory / LOG_FILE).st_ino != log_inode  # deleted and created again
                    ):
                        raise ConflictError(
                            f"table {name!r} was loaded or replaced while it was being snapshotted"
                        )
                    snapshot = _Meta(
                        generation,
                        version,
                        f"snapshot-{generation}.safetensors",
                        crc,
                        size,
                        embedding_dim,
                        0.0,
                    )
                    self._commit_live(name, staged, snapshot, log_end, current, carried, now.snapshot)
                    staged = None
                    held = time.perf_counter() - held
                if now.snapshot != snapshot.snapshot:
                    (directory / now.snapshot).unlink(missing_ok=True)  # the replaced one, outside the lock
                logger.info(
                    "table %r: snapshot at version %d committed; the update lock held %.1f ms for the "
                    "commit (%d update(s) logged while it was hashed carried over, %d of them under it)",
                    name,
                    version,
                    1000 * held,
                    current - version,
                    current - carried[1],
                )
                return version
            except Exception as error:
                if is_storage_full(error):
                    raise self._storage_full(f"snapshot of table {name!r}", needed) from error
                raise
            finally:
                if fd is not None:
                    os.close(fd)
                if staged is not None:
                    staged.unlink(missing_ok=True)

    def log_mark(self, name: str, version: int, since: LogMark | None = None) -> LogMark | None:
        """Where the table's log stands at ``version`` (``Journal``); caller holds the update lock, so
        no append runs and the log ends with ``version``'s record. The mark is (log inode, generation,
        the log's end, cuts); None when the log was replaced (a snapshot, a load) or had an unfinished
        update cut off (``recover``) since ``since``, or does not match meta.json (an interrupted
        snapshot). Reads the header alone: the versions are checked by ``updated_ids``, which reads the
        records from a mark on (a mark at a wrong place fails there, never silently)."""
        meta = self._read_meta(name)
        if meta is None:
            return None
        path = self.table_dir(name) / LOG_FILE
        cuts = self._cuts(name)
        try:
            handle = open(path, "rb")  # noqa: SIM115 (closed below)
        except FileNotFoundError:
            return None
        with handle:
            fd = handle.fileno()
            stat = os.fstat(fd)
            if since is None:
                try:
                    self._check_header(fd, meta, f"table {name!r} log {path}")
                except CorruptionError:
                    return None  # an interrupted snapshot's: the caller's locked path deals with it
            elif (stat.st_ino, meta.generation, since.where[3]) != (since.where[0], since.where[1], cuts):
                return None
        return LogMark(version, (stat.st_ino, meta.generation, stat.st_size, cuts))

    def updated_ids(self, name: str, since: LogMark, until: LogMark) -> list[np.ndarray] | None:
        """The ids logged after ``since`` up to ``until`` (``Journal``), read from the table's log
        without the update lock: the records up to a mark never change (a cut removes only records
        after the table's version, a snapshot writes a new log). None when the log file is no longer the
        marks' (replaced since); ``CorruptionError`` when the records between the marks do not produce
        exactly the versions after ``since.version`` up to ``until.version``."""
        path = self.table_dir(name) / LOG_FILE
        where = f"table {name!r} log {path}"
        try:
            handle = open(path, "rb")  # noqa: SIM115 (closed below)
        except FileNotFoundError:
            return None
        inode, generation, end = until.where[:3]
        with handle:
            fd = handle.fileno()
            if os.fstat(fd).st_ino != inode or read_log_header(fd, where)[0] != generation:
                return None
            ids, reached_end, reached = read_record_ids(fd, since.where[2], end, since.version, where)
        if (reached_end, reached) != (end, until.version):
            raise CorruptionError(
                f"{where} holds versions up to {reached} by byte {reached_end}, the table is at "
                f"{until.version} (byte {end})"
            )
        return ids

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

    @contextlib.contextmanager
    def _snapshot_turn(self, name: str, *, wait: bool) -> Iterator[bool]:
        """This table's snapshot turn across workers (a flock): True once held; False at once when
        another holds it and ``wait`` is False. Taken before the update lock, never under it."""
        validate_table_name(name)
        fd = os.open(self.data_dir / f"{_SNAPSHOTTING}{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)

    def _log_end(self, name: str, meta: _Meta, version: int) -> int:
        """The byte just after the record producing ``version`` in the table's log: its end, checked to
        hold exactly the versions after the snapshot's up to ``version``. Caller holds the update lock."""
        path = self.table_dir(name) / LOG_FILE
        where = f"table {name!r} log {path}"
        with open(path, "rb") as handle:
            fd = handle.fileno()
            self._check_header(fd, meta, where)
            end, last = follow_records(fd, LOG_HEADER_SIZE, os.fstat(fd).st_size, meta.version, where)
        if last != version:
            raise CorruptionError(f"{where} holds versions up to {last}, the table is at {version}")
        return end

    @staticmethod
    def _check_header(fd: int, meta: _Meta, where: str) -> None:
        head = os.pread(fd, LOG_HEADER_SIZE, 0)
        if len(head) != LOG_HEADER_SIZE or CRC.unpack_from(head, LOG_HEADER.size)[0] != crc32(
            head[: LOG_HEADER.size]
        ):
            raise CorruptionError(f"{where} has a bad header")
        magic, _fmt, _dim, generation, base_version = LOG_HEADER.unpack(head[: LOG_HEADER.size])
        if magic != LOG_MAGIC or (generation, base_version) != (meta.generation, meta.version):
            raise CorruptionError(f"{where} (generation {generation}) does not match meta.json")

    def _carry_log(
        self,
        name: str,
        exclusive: Callable[[], AbstractContextManager[tuple[Table, int]]],
        meta: _Meta,
        log_inode: int,
        log_end: int,
        version: int,
        header: bytes,
    ) -> tuple[int, int]:
        """Most of the commit's carry-over without the lock: the log's end is noted under it, then the
        records from ``log_end`` (after ``version``, the snapshot's) to there are copied into the next
        generation's log (``updates.wal.new``, fsynced) without it: appended records never change, and
        a repair only cuts records after the table's version. Returns (that end, the version there), for
        ``_commit_live`` to carry over the rest under the lock."""
        directory = self.table_dir(name)
        path = directory / LOG_FILE
        new_log = directory / f"{LOG_FILE}.new"
        where = f"table {name!r} log {path}"
        with exclusive() as (_table, noted):
            now = self._read_meta(name)
            old = os.open(path, os.O_RDONLY)
            try:
                stat = os.fstat(old)
            except BaseException:
                os.close(old)
                raise
        try:
            if now is None or now.generation != meta.generation or stat.st_ino != log_inode:
                raise ConflictError(f"table {name!r} was loaded or replaced while it was being snapshotted")
            end, last = follow_records(old, log_end, stat.st_size, version, where)
            if last != noted:
                raise CorruptionError(f"{where} holds versions up to {last}, the table is at {noted}")
            with open(new_log, "wb") as out:
                out.write(header)
                out.flush()
                _copy_range(old, out.fileno(), log_end, end)
                os.fsync(out.fileno())
        except BaseException:
            new_log.unlink(missing_ok=True)
            raise
        finally:
            os.close(old)
        return end, last

    def _commit_live(
        self,
        name: str,
        staged: Path,
        snapshot: _Meta,
        log_end: int,
        current: int,
        carried: tuple[int, int] | None = None,
        replaced: str | None = None,
    ) -> None:
        """The last step of ``snapshot_live``, under the update lock: the log's records after
        ``log_end`` (versions snapshot.version + 1 .. ``current``, appended while the snapshot was
        hashed) start the next generation's log (``carried``: (end, version) up to which ``_carry_log``
        already copied them there); then the snapshot file is put in place, meta.json committed and the
        log swapped in. ``replaced``: the snapshot file this one replaces, left for the caller to remove
        after the lock."""
        directory = self.table_dir(name)
        path = directory / LOG_FILE
        new_log = directory / f"{LOG_FILE}.new"
        where = f"table {name!r} log {path}"
        begin, after = (log_end, snapshot.version) if carried is None else carried
        try:
            with open(path, "rb") as old, open(new_log, "wb" if carried is None else "r+b") as out:
                out.seek(0, os.SEEK_END)  # after what _carry_log copied (not O_APPEND: copy_file_range)
                size = os.fstat(old.fileno()).st_size
                _end, last = follow_records(old.fileno(), begin, size, after, where)
                if last != current:
                    raise CorruptionError(f"{where} holds versions up to {last}, the table is at {current}")
                if carried is None:
                    out.write(
                        encode_log_header(snapshot.embedding_dim, snapshot.generation, snapshot.version)
                    )
                    out.flush()
                _copy_range(old.fileno(), out.fileno(), begin, size)
                os.fsync(out.fileno())
            os.replace(staged, directory / snapshot.snapshot)
            fsync_dir(directory)
            snapshot.created_unix = time.time()
            meta_tmp = write_temp_file(directory / META_FILE, snapshot.to_json())
        except BaseException:
            new_log.unlink(missing_ok=True)  # nothing committed: the old generation stands
            raise
        os.replace(meta_tmp, directory / META_FILE)  # the commit
        fsync_dir(directory)
        if self.fault_file is not None:  # testing only: a crash between the two renames
            die_at(self.fault_file, "snapshot:committed")
        os.replace(new_log, path)
        fsync_dir(directory)
        self._remove_stale_files(directory, snapshot, keep=replaced)
        self._forget_log(name)

    def load(self, name: str, *, salvage: bool = False) -> tuple[Table, int] | None:
        """The committed snapshot with its log replayed, and the version reached; None if absent.

        Cleans up what a crash may have left (temporary files, a snapshot that was never committed, a stale
        log) and cuts a torn tail off the log, logging a warning. Raises ``CorruptionError`` for damage
        that cannot be told apart from lost updates (``salvage``: cut the log at the first bad record).
        """
        meta = self._read_meta(name)
        if meta is None:
            return None
        self._finish_interrupted_snapshot(name, meta)  # before the leftovers: it may need updates.wal.new
        self._remove_leftovers(self.table_dir(name), meta)
        table = self._load_snapshot(name, meta)
        version = self._replay(name, meta, table, salvage=salvage)
        self._forget_log(name)
        return table, version

    def load_into(self, name: str, table: Table) -> int | None:
        """``load`` into ``table`` (its tensors allocated by the caller, in shared memory, with the
        config and optimizer ``stored_spec`` gave): the snapshot is read straight into them, its crc32
        checked against meta.json as it is read, then the log replayed record by record. Memory: the
        table's own plus one record; no private copy. Returns the version reached; None if absent."""
        meta = self._read_meta(name)
        if meta is None:
            return None
        directory = self.table_dir(name)
        self._finish_interrupted_snapshot(name, meta)
        self._remove_leftovers(directory, meta)
        snapshot_file = directory / meta.snapshot
        if not snapshot_file.is_file():
            raise CorruptionError(f"table {name!r}: snapshot {snapshot_file} named by meta.json is missing")
        checkpoint = CheckpointFile.open(snapshot_file)
        if (checkpoint.config, checkpoint.optimizer) != (table.config, table.optimizer):
            raise CorruptionError(
                f"table {name!r}: snapshot {snapshot_file} does not hold the table it names"
            )
        # meta.json's crc32 covers every byte, so the per-tensor checksums would only read it twice.
        crc = crc32(checkpoint.header)
        size = len(checkpoint.header)

        def add(piece: memoryview) -> None:
            nonlocal crc, size
            crc = crc32(piece, crc)
            before, size = size, size + len(piece)
            _slow_down_per_piece(before, size)  # testing only: a slow load without a big table

        started = time.perf_counter()
        checkpoint.read_into(table.tensors(), verify=False, each_piece=add)
        if (crc, size) != (meta.snapshot_crc32, meta.snapshot_bytes):
            raise CorruptionError(
                f"table {name!r}: snapshot {snapshot_file} fails its checksum "
                f"(crc32 {crc:08x}, {size} bytes; meta.json says {meta.snapshot_crc32:08x}, "
                f"{meta.snapshot_bytes} bytes)"
            )
        read = time.perf_counter()
        log_bytes = os.stat(directory / LOG_FILE).st_size
        version = self._replay(name, meta, table, salvage=False)
        self._forget_log(name)
        logger.info(
            "table %r: snapshot of %.0f MiB read in %.1f s; %d update(s) in %.0f MiB of log replayed in "
            "%.1f s",
            name,
            size / (1 << 20),
            read - started,
            version - meta.version,
            log_bytes / (1 << 20),
            time.perf_counter() - read,
        )
        return version

    def recover(self, name: str, version: int) -> Table:
        """The table at exactly ``version`` (snapshot + the log's records up to it), with every record
        after that one cut off the log: the repair after a worker died holding the table's update lock
        with its update appended (or half-appended) but not finished, or in the middle of a snapshot
        (a log older than a committed snapshot is replaced by an empty one, as at start-up). Called under
        that lock; the cut is fdatasync'ed before this returns. Raises ``CorruptionError`` if the log
        does not reach ``version``."""
        meta = self._require_meta(name)
        self._finish_interrupted_snapshot(name, meta)
        if version < meta.version:
            raise CorruptionError(
                f"table {name!r}: cannot recover version {version}, the snapshot is at {meta.version}"
            )
        table = self._load_snapshot(name, meta)
        path = self.table_dir(name) / LOG_FILE
        where = f"table {name!r} log {path}"
        with open(path, "r+b") as handle:
            fd = handle.fileno()
            generation, base_version, dim, size = read_log_header(fd, where)
            self._check_log_matches(name, generation, base_version, dim, meta)
            cut, reached, _tail = stream_records(
                fd, size, where, base_version, dim, _applier(table, name), stop_after=version
            )
            if reached != version:
                raise CorruptionError(f"{where}: holds versions up to {reached}, cannot recover {version}")
            if cut != size:
                logger.warning(
                    "table %r: cutting %d bytes of an unfinished update off %s (its worker died)",
                    name,
                    size - cut,
                    path,
                )
                os.ftruncate(fd, cut)
                sync_data(fd)
                self._count_cut(name)
        return table

    def _load_snapshot(self, name: str, meta: _Meta) -> Table:
        """The committed snapshot, its checksum verified."""
        from robez_core.table import Table

        snapshot_file = self.table_dir(name) / meta.snapshot
        if not snapshot_file.is_file():
            raise CorruptionError(f"table {name!r}: snapshot {snapshot_file} named by meta.json is missing")
        crc, size = file_crc(snapshot_file)
        if (crc, size) != (meta.snapshot_crc32, meta.snapshot_bytes):
            raise CorruptionError(
                f"table {name!r}: snapshot {snapshot_file} fails its checksum "
                f"(crc32 {crc:08x}, {size} bytes; meta.json says {meta.snapshot_crc32:08x}, "
                f"{meta.snapshot_bytes} bytes)"
            )
        table = Table.load(snapshot_file)
        if table.config.embedding_dim != meta.embedding_dim:
            raise CorruptionError(f"table {name!r}: snapshot dim differs from meta.json")
        return table

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
        if self.fault_file is not None:  # testing only: a kill before the folder is removed
            die_at(self.fault_file, "drop:renamed")
        shutil.rmtree(doomed, ignore_errors=True)

    def close(self) -> None:
        """Stop the flusher, fdatasync every log written since its last flush (waking the writers waiting
        for it), close the files."""
        self._closed.set()
        with self._tickets:
            self._work.notify_all()
        if self._flusher is not None:
            self._flusher.join(timeout=10.0)
        with self._lock:
            try:
                self._flush_round()
            finally:
                for log in self._logs.values():
                    os.close(log.fd)
                self._logs.clear()
        if self._dir_lock is not None:
            os.close(self._dir_lock)
            self._dir_lock = None

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

    # -- periodic snapshots --------------------------------------------------------------------------------

    def log_limit_bytes(self, snapshot_bytes: int) -> int | None:
        """The log size past which the size policy takes a snapshot (None: the policy is off)."""
        if not self.snapshot_log_ratio:
            return None
        return max(self.snapshot_log_min_bytes, int(self.snapshot_log_ratio * snapshot_bytes))

    def snapshot_due(self, name: str, version: int) -> bool:
        """Whether the table, now at ``version``, is due a snapshot under the N updates / T seconds / log
        bytes policies.

        Reads meta.json and stats the log each time (tens of us), so a snapshot taken by another worker
        counts at once.
        """
        meta = self._read_meta(name)
        if meta is None:
            return False
        pending = version - meta.version
        if pending <= 0:
            return False
        if self.snapshot_every_updates and pending >= self.snapshot_every_updates:
            return True
        limit = self.log_limit_bytes(meta.snapshot_bytes)
        if limit is not None and self._log_bytes(name) > limit:
            return True
        age_seconds = time.time() - meta.created_unix
        return bool(self.snapshot_every_seconds) and age_seconds >= self.snapshot_every_seconds

    def snapshot_bytes(self, name: str) -> int:
        """The size of the table's committed snapshot file (0 if it has none)."""
        meta = self._read_meta(name)
        return 0 if meta is None else meta.snapshot_bytes

    def has_pending(self, name: str, version: int) -> bool:
        """Whether the table at ``version`` holds updates its committed snapshot does not (so its log has
        records); a graceful shutdown snapshots exactly these tables."""
        meta = self._read_meta(name)
        return meta is not None and (version != meta.version or not self._log_is_empty(name))

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

    # -- internals -------------------------------------------------------------------------------------------

    def _write_generation(self, directory: Path, table: Table, version: int, generation: int) -> None:
        """Write snapshot-<generation>, a fresh ``updates.wal.new``, then commit meta.json, in that order."""
        snapshot_name = f"snapshot-{generation}.safetensors"
        snapshot_file = directory / snapshot_name
        embedding_dim = table.config.embedding_dim
        new_log = directory / f"{LOG_FILE}.new"
        staged = directory / f"{snapshot_name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            # Straight from the table's memory (no private copy), hashed from the file, fsynced.
            fd = os.open(staged, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                crc, size = _finish_snapshot(fd, staged, table.begin_write(fd))
            finally:
                os.close(fd)
            os.replace(staged, snapshot_file)
            with open_private(new_log) as handle:
                handle.write(encode_log_header(embedding_dim, generation, version))
                handle.flush()
                os.fsync(handle.fileno())
            fsync_dir(directory)
            meta = _Meta(generation, version, snapshot_name, crc, size, embedding_dim, time.time())
            meta_tmp = write_temp_file(directory / META_FILE, meta.to_json())
        except BaseException:
            # Nothing is committed yet: leave the folder as it was (a full disk is the likely cause, and
            # the next start would remove these anyway).
            staged.unlink(missing_ok=True)
            snapshot_file.unlink(missing_ok=True)
            new_log.unlink(missing_ok=True)
            raise
        os.replace(meta_tmp, directory / META_FILE)  # the commit
        fsync_dir(directory)

    def _read_meta(self, name: str) -> _Meta | None:
        path = self.table_dir(name) / META_FILE
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            data = json.loads(raw)
            if data.pop("format") != META_FORMAT or data.pop("format_version") != META_FORMAT_VERSION:
                raise ValueError("unknown format")
            meta = _Meta(**data)
            if Path(meta.snapshot).name != meta.snapshot:
                raise ValueError("snapshot must be a file name")
            return meta
        except (ValueError, TypeError, KeyError) as error:
            raise CorruptionError(f"table {name!r}: {path} is not valid table metadata ({error})") from error

    def _require_meta(self, name: str) -> _Meta:
        meta = self._read_meta(name)
        if meta is None:
            raise CorruptionError(f"table {name!r}: meta.json is missing in {self.table_dir(name)}")
        return meta

    def _remove_leftovers(self, directory: Path, meta: _Meta) -> None:
        for entry in directory.iterdir():
            stray_snapshot = entry.name.startswith("snapshot-") and entry.name != meta.snapshot
            if ".tmp" in entry.name or entry.name == f"{LOG_FILE}.new" or stray_snapshot:
                logger.info("removing %s, left by an interrupted write", entry)
                entry.unlink(missing_ok=True)

    def _replay(
        self,
        name: str,
        meta: _Meta,
        table: Table,
        *,
        salvage: bool,
    ) -> int:
        """Check the committed log whole, then apply each record to ``table`` in order (``apply_record``).

        Returns the version reached. A stale log (older generation) is replaced by an empty one; a torn
        tail is cut off, after a warning.
        """
        path = self.table_dir(name) / LOG_FILE
        where = f"table {name!r} log {path}"
        if not path.is_file():
            raise CorruptionError(f"{where} is missing; acknowledged updates may be lost")
        version = meta.version
        with open(path, "r+b") as handle:
            fd = handle.fileno()
            if os.fstat(fd).st_size == 0:
                raise CorruptionError(f"{where} is empty (not even a header)")
            if salvage:  # the operator's explicit choice: the whole log scanned first (scan_log)
                return self._replay_salvaged(name, meta, table, handle, where)
            generation, base_version, dim, size = read_log_header(fd, where)
            stale = generation < meta.generation
            if not stale:
                self._check_log_matches(name, generation, base_version, dim, meta)
                apply_one = _applier(table, name)
                held: list[tuple[RecordSpan, bytes]] = []

                def apply(span: RecordSpan, data: bytes) -> None:
                    # A part of a multi-table entry waits for the record after it: only the last record
                    # can belong to an entry whose other parts were never written (see _incomplete_tail).
                    if held:
                        apply_one(*held.pop())
                    if span.extra:
                        held.append((span, data))
                    else:
                        apply_one(span, data)

                # Record by record: memory holds one record, never the log.
                good_length, version, tail_problem = stream_records(fd, size, where, base_version, dim, apply)
                if held:
                    span, data = held.pop()
                    if self._incomplete_tail(name, span, data):
                        version = span.version - 1
                        os.ftruncate(fd, span.offset)  # with any torn tail after it
                        os.fsync(fd)
                        self._count_cut(name)
                        tail_problem = None
                    else:
                        apply_one(span, data)
                if tail_problem is not None:
                    logger.warning(
                        "table %r: dropping a torn tail of %d bytes from %s (%s); every update before it "
                        "is kept",
                        name,
                        size - good_length,
                        path,
                        tail_problem,
                    )
                    os.ftruncate(fd, good_length)
                    os.fsync(fd)
        if stale:
            logger.warning(
                "table %r: log generation %d is older than the snapshot's %d (a crash while snapshotting); "
                "its updates are all in the snapshot, starting an empty log",
                name,
                generation,
                meta.generation,
            )
            write_file_durably(path, encode_log_header(meta.embedding_dim, meta.generation, meta.version))
        return version

    def _replay_salvaged(self, name: str, meta: _Meta, table: Table, handle: BinaryIO, where: str) -> int:
        """``_replay`` with ``salvage``: the log mapped and scanned whole (``scan_log``), cut at its first
        bad record; an offline tool's path."""
        fd = handle.fileno()
        size = os.fstat(fd).st_size
        version = meta.version
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as buf:
            scan = scan_log(buf, where=where, salvage=True)
            stale = scan.generation < meta.generation
            if not stale:
                self._check_log_matches(name, scan.generation, scan.base_version, scan.embedding_dim, meta)
                for span in scan.records:
                    ids, grads = decode_record(buf, span)
                    apply_record(table, ids, grads, span.lr, logged_as=(name, span.version))
                    version = span.version
        if stale:
            write_file_durably(
                self.table_dir(name) / LOG_FILE,
                encode_log_header(meta.embedding_dim, meta.generation, meta.version),
            )
        elif scan.tail_problem is not None:
            logger.warning(
                "table %r: dropping a torn tail of %d bytes from %s (%s); every update before it is kept",
                name,
                scan.file_length - scan.good_length,
                where,
                scan.tail_problem,
            )
            os.ftruncate(fd, scan.good_length)
            os.fsync(fd)
        return version

    def _incomplete_tail(self, name: str, span: RecordSpan, data: bytes) -> bool:
        """Whether the last record of table ``name``'s log is a part of a multi-table entry whose other
        parts are not all in their tables' data directories (in the snapshot, or a record with the
        entry's key at their version): a kill -9 in the middle of the push, never acknowledged. The
        caller cuts it off (all or nothing). A part's table deleted since counts as written."""
        group = decode_group(data, span_in(span))
        if group is None:
            return False
        for table, version in group.parts:
            if table != name and not self._holds_part(table, version, group):
                logger.warning(
                    "table %r: cutting version %d off its log: a part of a multi-table update whose part "
                    "for table %r (version %d) was never written (the server died in the middle of it, "
                    "before acknowledging it)",
                    name,
                    span.version,
                    table,
                    version,
                )
                return True
        return False

    def _holds_part(self, table: str, version: int, group: EntryGroup) -> bool:
        """Whether ``table``'s data directory holds the part of ``group`` producing ``version``."""
        meta = self._read_meta(table)
        if meta is None:
            return True  # deleted since: nothing to keep apart from
        if meta.version >= version:
            return True  # in its snapshot
        path = self.table_dir(table) / LOG_FILE
        try:
            with open(path, "rb") as handle:
                fd = handle.fileno()
                generation, base_version, _dim, size = read_log_header(fd, str(path))
                if generation < meta.generation:
                    return False  # a stale log: its records are in the snapshot, which is before version
                found = find_record(fd, size, base_version, version)
        except (OSError, CorruptionError):
            return False
        if found is None:
            return False
        other = decode_group(found[1], found[0])
        return other is not None and other.key == group.key

    @staticmethod
    def _check_log_matches(
        name: str, generation: int, base_version: int, embedding_dim: int, meta: _Meta
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

    def _log_for_append(self, name: str) -> _OpenLog:
        """This process's handle on the table's current log, reopened if another process replaced it."""
        path = self._log_paths.get(name)
        if path is None:  # pathlib costs ~15 us an append; the string is cached once the name is checked
            path = self._log_paths[name] = str(self.table_dir(name) / LOG_FILE)
        try:
            inode = os.stat(path).st_ino
        except FileNotFoundError as error:
            raise CorruptionError(f"table {name!r}: no log at {path} (was the table created?)") from error
        log = self._logs.get(name)
        if log is not None and log.inode == inode:
            return log
        meta = self._require_meta(name)
        if self._finish_interrupted_snapshot(name, meta):
            inode = os.stat(path).st_ino
        fd = os.open(path, os.O_RDWR | os.O_APPEND)
        try:
            head = os.pread(fd, LOG_HEADER_SIZE, 0)
            if len(head) != LOG_HEADER_SIZE or CRC.unpack_from(head, LOG_HEADER.size)[0] != crc32(
                head[: LOG_HEADER.size]
            ):
                raise CorruptionError(f"table {name!r}: log {path} has a bad header")
            magic, _fmt, dim, generation, base_version = LOG_HEADER.unpack(head[: LOG_HEADER.size])
            if magic != LOG_MAGIC or (generation, base_version) != (meta.generation, meta.version):
                raise CorruptionError(
                    f"table {name!r}: log {path} (generation {generation}) does not match meta.json "
                    f"(generation {meta.generation}); restart the server to recover the table"
                )
            end, last_version = follow_records(
                fd, LOG_HEADER_SIZE, os.fstat(fd).st_size, base_version, f"table {name!r} log {path}"
            )
        except BaseException:
            os.close(fd)
            raise
        new_log = _OpenLog(fd, os.fstat(fd).st_ino, generation, base_version, dim, end, last_version)
        with self._lock:
            old = self._logs.pop(name, None)
            self._logs[name] = new_log
            if old is not None:
                self._close_log(old)
        return new_log

    def _finish_interrupted_snapshot(self, name: str, meta: _Meta) -> bool:
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

    def _committed_fresh_log(self, name: str, meta: _Meta) -> Path | None:
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

    def _remove_stale_files(self, directory: Path, meta: _Meta, keep: str | None = None) -> None:
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

    def _forget_log(self, name: str) -> None:
        with self._lock:
            old = self._logs.pop(name, None)
            if old is not None:
                self._close_log(old)

    def _close_log(self, log: _OpenLog) -> None:
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

    def _ensure_flusher(self) -> None:
        if self._flusher is None or not self._flusher.is_alive():
            # Started lazily, so it lives in the worker process that appends (not a parent that forked).
            self._flusher = threading.Thread(target=self._flush_loop, name="robez-wal-flusher", daemon=True)
            self._flusher.start()

    def _flush_loop(self) -> None:
        """Group commit: sleep until a record is written, flush once the interval since the last flush
        has passed, wake the writers it covered. With several workers each flushes its own descriptors;
        fdatasync of any descriptor flushes the file's data whoever wrote it, so a worker's flush may
        also cover another's records, never less than its own."""
        period = self.fsync_interval_ms / 1000.0
        last_flush = -period
        while not self._closed.is_set():
            with self._tickets:
                if self._issued == self._flushed_through:
                    # Bounded wait: re-checks the closed flag even if a wake-up were missed.
                    self._work.wait(timeout=1.0)
                    continue
            if self._closed.wait(max(0.0, last_flush + period - time.monotonic())):
                return  # close() flushes what is left
            last_flush = time.monotonic()
            with self._lock:
                try:
                    self._flush_round()
                except OSError:
                    logger.exception("background fdatasync of a table log failed; updates now fail")

    def _flush_round(self) -> None:
        """fdatasync every log written since its last flush and mark the tickets issued before as
        durable; caller holds ``_lock`` (which keeps the descriptors open). Raises on a failed sync,
        after recording it for ``wait_durable``."""
        with self._tickets:
            # Every record of a ticket up to here was written and its log marked dirty before it got
            # the ticket, so the syncs below cover them all (a log closed meanwhile was synced then).
            target = self._issued
            dirty = [log for log in self._logs.values() if log.dirty]
            for log in dirty:
                log.dirty = False
        error: OSError | None = None
        for log in dirty:
            try:
                sync_data(log.fd)
            except OSError as exc:
                error = error or exc
        with self._tickets:
            self._flushed_through = max(self._flushed_through, target)
            if error is None:
                self._durable_through = max(self._durable_through, target)
            else:
                self._flush_error = self._flush_error or error
            self._flushed.notify_all()
        if error is not None:
            raise error


def _applier(table: Table, name: str) -> Callable[[RecordSpan, bytes], None]:
    """What replaying one record does: ``apply_record`` of its ids and grads (decoded from its bytes);
    every record was checked before it was logged (``checked_when_logged``)."""

    def apply(span: RecordSpan, data: bytes) -> None:
        ids, grads = decode_record(data, span_in(span))
        apply_record(table, ids, grads, span.lr, logged_as=(name, span.version), checked_when_logged=True)

    return apply


def _copy_range(source: int, target: int, begin: int, end: int) -> None:
    """Append bytes [begin, end) of file ``source`` to file ``target`` (in the kernel where it can)."""
    position = begin
    while position < end:
        try:
            copied = os.copy_file_range(source, target, end - position, position)
        except OSError:
            copied = os.write(target, os.pread(source, min(end - position, 1 << 24), position))
        if copied <= 0:
            raise CorruptionError(f"the log was cut short at byte {position} while it was copied")
        position += copied


@contextlib.contextmanager
def _mapped(fd: int, writer: CheckpointWriter, tensors: dict[str, Tensor]) -> Iterator[dict[str, np.ndarray]]:
    """Numpy views of each tensor's bytes in the checkpoint file ``fd`` (``CheckpointWriter.begin``:
    header written, space allocated), through a shared mapping of the file: what is written to them is
    the file's content."""
    mapped = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    views: dict[str, np.ndarray] = {}
    try:
        for key, (start, _nbytes) in writer.spans().items():
            tensor = tensors[key]
            dtype = tensor.detach().reshape(-1)[:0].numpy().dtype
            views[key] = np.frombuffer(mapped, dtype=dtype, count=tensor.numel(), offset=start).reshape(
                tuple(tensor.shape)
            )
        yield views
    finally:
        views.clear()
        with contextlib.suppress(BufferError):  # a view still held by a traceback: it goes with that
            mapped.close()


def _finish_snapshot(fd: int, path: Path, writer: CheckpointWriter) -> tuple[int, int]:
    """Complete the snapshot ``begin_write`` left in ``fd`` (checksums, header, fsync; no lock needed,
    pausing after each 16 MiB hashed when a test asks: ``faults.slow_down``); its (crc32, size) for
    meta.json."""
    hashed = 0

    def pause(piece: memoryview) -> None:
        nonlocal hashed
        before, hashed = hashed, hashed + len(piece)
        _slow_down_per_piece(before, hashed)

    writer.finish(fd, each_piece=pause)
    return file_crc(path)


_SLOW_PIECE_BYTES = 1 << 24  # a test's pause per this much hashed, as the store's checksum pauses


def _slow_down_per_piece(before: int, after: int) -> None:
    """``slow_down`` once when a pass crossed a ``_SLOW_PIECE_BYTES`` boundary going from ``before``
    to ``after`` bytes (testing only: nothing happens unless a test asks)."""
    if after // _SLOW_PIECE_BYTES > before // _SLOW_PIECE_BYTES:
        slow_down()
