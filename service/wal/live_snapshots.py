"""``WalLiveSnapshots``: committing a snapshot of a table served while its updates go on, with the update
lock held only to note where the log stands and for the commit."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np

from robez_core.checkpoint import CheckpointWriter, fsync_dir
from robez_core.errors import ConflictError, CorruptionError

from ..log.journal import Journal, LogMark, is_storage_full
from ..log.live_copy import consistent_copy
from .files import (
    table_bytes,
    validate_table_name,
    write_temp_file,
)
from .generations import finish_snapshot
from .layout import SNAPSHOTTING_PREFIX, TableMeta, WalLayout
from .records import (
    LOG_FILE,
    LOG_HEADER_SIZE,
    META_FILE,
    encode_log_header,
    follow_records,
    read_log_header,
    read_record_ids,
)

if TYPE_CHECKING:
    from torch import Tensor

    from robez_core.table import Table

logger = logging.getLogger("robez.wal")


class WalLiveSnapshots(WalLayout):
    """``snapshot_live`` (a snapshot while updates go on) and the log marks a lock-free copy checks itself
    against (``log_mark``, ``updated_ids``)."""

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
                    # consistent_copy reads only log_mark and updated_ids (below) of the journal: this
                    # part of WalJournal, which implements the whole Journal.
                    journal = cast("Journal", self)
                    version, log_end, log_inode = consistent_copy(
                        name, journal, exclusive, targets, noted, self.faults
                    )
                crc, size = finish_snapshot(fd, staged, writer, self.faults)  # hashing and fsync: no lock
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
                    snapshot = TableMeta(
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

    @contextlib.contextmanager
    def _snapshot_turn(self, name: str, *, wait: bool) -> Iterator[bool]:
        """This table's snapshot turn across workers (a flock): True once held; False at once when
        another holds it and ``wait`` is False. Taken before the update lock, never under it."""
        validate_table_name(name)
        fd = os.open(self.data_dir / f"{SNAPSHOTTING_PREFIX}{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)

    def _log_end(self, name: str, meta: TableMeta, version: int) -> int:
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

    def _carry_log(
        self,
        name: str,
        exclusive: Callable[[], AbstractContextManager[tuple[Table, int]]],
        meta: TableMeta,
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
        snapshot: TableMeta,
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
        self.faults.die_at("snapshot:committed")  # testing only: a crash between the two renames
        os.replace(new_log, path)
        fsync_dir(directory)
        self._remove_stale_files(directory, snapshot, keep=replaced)
        self._forget_log(name)


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
