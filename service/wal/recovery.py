"""``WalRecovery``: replay, salvage and recover. A torn tail is cut off with a warning; a part of a
multi-table update whose other parts were never written is cut off (all or nothing); other damage raises
``CorruptionError``."""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, BinaryIO

from robez_core.checkpoint import CheckpointFile
from robez_core.errors import CorruptionError

from ..log.entry import EntryGroup, apply_record
from .files import (
    file_crc,
    sync_data,
    write_file_durably,
)
from .layout import TableMeta, WalLayout
from .records import (
    LOG_FILE,
    RecordSpan,
    crc32,
    decode_group,
    decode_record,
    encode_log_header,
    find_record,
    read_log_header,
    scan_log,
    span_in,
    stream_records,
)

if TYPE_CHECKING:
    from robez_core.table import Table

logger = logging.getLogger("robez.wal")


class WalRecovery(WalLayout):
    """Reading a table back: the committed snapshot with its log replayed (``load``, ``load_into``), cut
    at the first bad record on request (salvage), or up to a given version (``recover``)."""

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
            self.faults.slow_down_per_piece(before, size)  # testing only: a slow load without a big table

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

    def _load_snapshot(self, name: str, meta: TableMeta) -> Table:
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

    def _replay(
        self,
        name: str,
        meta: TableMeta,
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

    def _replay_salvaged(self, name: str, meta: TableMeta, table: Table, handle: BinaryIO, where: str) -> int:
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


def _applier(table: Table, name: str) -> Callable[[RecordSpan, bytes], None]:
    """What replaying one record does: ``apply_record`` of its ids and grads (decoded from its bytes);
    every record was checked before it was logged (``checked_when_logged``)."""

    def apply(span: RecordSpan, data: bytes) -> None:
        ids, grads = decode_record(data, span_in(span))
        apply_record(table, ids, grads, span.lr, logged_as=(name, span.version), checked_when_logged=True)

    return apply
