"""``WalAppender``: a ``WalJournal``'s appends, one ordered log per table across worker processes, and group
commit (one background fdatasync serving every record written meanwhile)."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING

from robez_core.errors import ConflictError, CorruptionError, InvalidInputError

from ..log.entry import UpdateRecord
from ..log.journal import is_storage_full
from .files import (
    sync_data,
    write_all,
)
from .layout import OpenLog, WalLayout
from .records import (
    CRC,
    LOG_FILE,
    LOG_HEADER,
    LOG_HEADER_SIZE,
    LOG_MAGIC,
    crc32,
    encode_record,
    follow_records,
)

if TYPE_CHECKING:
    pass

logger = logging.getLogger("robez.wal")


class WalAppender(WalLayout):
    """Appending records to a table's log, with the group-commit flusher of the ``"interval"`` policy
    (``WalJournal``'s docstring has the policies)."""

    # How long ``wait_durable`` waits for the flusher before giving up (a healthy flush takes ms).
    WAIT_LIMIT_SECONDS = 60.0

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

    def _log_for_append(self, name: str) -> OpenLog:
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
        new_log = OpenLog(fd, os.fstat(fd).st_ino, generation, base_version, dim, end, last_version)
        with self._lock:
            old = self._logs.pop(name, None)
            self._logs[name] = new_log
            if old is not None:
                self._close_log(old)
        return new_log

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
