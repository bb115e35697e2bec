"""The update log's bytes: the log header, records (checksummed), scanning and following a log."""

from __future__ import annotations

import logging
import mmap
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from robez_core.checkpoint import read_ahead
from robez_core.errors import CorruptionError, InvalidInputError

from ..log.entry import EntryGroup

if TYPE_CHECKING:
    pass

logger = logging.getLogger("robez.wal")

FsyncPolicy = Literal["always", "interval", "never"]
FSYNC_POLICIES: tuple[str, ...] = ("always", "interval", "never")

META_FILE = "meta.json"
LOG_FILE = "updates.wal"
META_FORMAT = "robez-table-dir"
META_FORMAT_VERSION = 1

# Log file header: magic, format version, embedding_dim, generation, base_version; then its CRC32.
LOG_MAGIC = b"ROBEZWAL"
LOG_FORMAT_VERSION = 1
LOG_HEADER = struct.Struct("<8sIIQQ")
LOG_HEADER_SIZE = LOG_HEADER.size + 4

# Record header: magic, format version, reserved (0), embedding_dim, n ids, version produced, lr; then
# the CRC32 of those 36 bytes, so a flipped length field is caught before it is trusted. The payload is
# n int64 ids then n * dim float32 gradients (little-endian), then the CRC32 of header + payload.
RECORD_MAGIC = b"RZUP"
RECORD_FORMAT_VERSION = 1
# A part of a multi-table entry: the same header with format 2, its reserved field the length of a group
# section (``encode_group``) placed between the header and the ids. Logs written before it (format 1
# only) read as before; a server older than it refuses a log holding one (an unknown record format).
RECORD_FORMAT_GROUP = 2
_GROUP_HEAD = struct.Struct("<16sH")
_GROUP_PART = struct.Struct("<HQ")
_RECORD_HEADER = struct.Struct("<4sHHIQQd")
RECORD_HEADER_SIZE = _RECORD_HEADER.size + 4
CRC = struct.Struct("<I")


def crc32(data: Any, value: int = 0) -> int:
    return zlib.crc32(data, value) & 0xFFFFFFFF


def encode_log_header(embedding_dim: int, generation: int, base_version: int) -> bytes:
    """The 36-byte header that starts every log file."""
    head = LOG_HEADER.pack(LOG_MAGIC, LOG_FORMAT_VERSION, embedding_dim, generation, base_version)
    return head + CRC.pack(crc32(head))


def encode_record(
    version: int, ids: torch.Tensor, grads: torch.Tensor, lr: float, group: EntryGroup | None = None
) -> list[Any]:
    """One log record as buffers for ``os.writev``: header, (group section,) ids, grads, trailing CRC32.

    Args:
        version: the table version this update produces.
        ids: int64 (N,).
        grads: float32 (N, d).
        lr: the learning rate applied.
        group: the multi-table entry this record is a part of (a format-2 record), or None.
    """
    ids_array = np.ascontiguousarray(ids.detach().cpu().numpy(), dtype="<i8")
    grads_array = np.ascontiguousarray(grads.detach().cpu().numpy(), dtype="<f4")
    if grads_array.ndim != 2 or ids_array.ndim != 1 or grads_array.shape[0] != ids_array.shape[0]:
        raise InvalidInputError(
            f"record needs ids (N,) and grads (N, d); got {ids_array.shape}, {grads_array.shape}"
        )
    num_ids, embedding_dim = grads_array.shape
    section = b"" if group is None else encode_group(group)
    fmt = RECORD_FORMAT_VERSION if group is None else RECORD_FORMAT_GROUP
    head = _RECORD_HEADER.pack(RECORD_MAGIC, fmt, len(section), embedding_dim, num_ids, version, lr)
    head += CRC.pack(crc32(head))
    crc = crc32(grads_array, crc32(ids_array, crc32(section, crc32(head))))
    # Flat byte views: writev and the CRC see the same bytes, with no copy (empty updates included).
    buffers: list[Any] = [head]
    if section:
        buffers.append(section)
    buffers += [ids_array.reshape(-1).view(np.uint8), grads_array.reshape(-1).view(np.uint8), CRC.pack(crc)]
    return buffers


def encode_group(group: EntryGroup) -> bytes:
    """A format-2 record's group section: the entry's 16-byte key, its number of parts, then each part's
    table name (u16 length + UTF-8) and version (u64), little-endian."""
    section = bytearray(_GROUP_HEAD.pack(group.key, len(group.parts)))
    for table, version in group.parts:
        name = table.encode()
        section += _GROUP_PART.pack(len(name), version) + name
    if len(section) > 0xFFFF:
        raise InvalidInputError(
            f"a multi-table update of {len(group.parts)} tables is too many for one log entry"
        )
    return bytes(section)


def decode_group(data: Any, span: RecordSpan) -> EntryGroup | None:
    """The group section of a verified record (None for a format-1 record), read from ``data`` (the
    buffer ``span`` points into)."""
    if span.extra == 0:
        return None
    start = span.offset + RECORD_HEADER_SIZE
    section = bytes(data[start : start + span.extra])
    key, count = _GROUP_HEAD.unpack_from(section)
    parts = []
    offset = _GROUP_HEAD.size
    for _ in range(count):
        length, version = _GROUP_PART.unpack_from(section, offset)
        offset += _GROUP_PART.size
        parts.append((section[offset : offset + length].decode(), version))
        offset += length
    return EntryGroup(key, tuple(parts))


def record_length(fmt: int, extra: int, num_ids: int, embedding_dim: int) -> int:
    """Bytes of a record from its header's fields (``extra``: the reserved field, a format-2 record's
    group section; format 1 has none, whatever the field holds)."""
    extra = extra if fmt == RECORD_FORMAT_GROUP else 0
    return RECORD_HEADER_SIZE + extra + num_ids * 8 + num_ids * embedding_dim * 4 + 4


def record_extra(fmt: int, reserved: int) -> int:
    """The group section's bytes of a record with these header fields (0 for format 1)."""
    return reserved if fmt == RECORD_FORMAT_GROUP else 0


@dataclass(frozen=True)
class RecordSpan:
    """Where one verified record lies in a log buffer (byte offsets)."""

    offset: int
    length: int
    version: int
    num_ids: int
    embedding_dim: int
    lr: float
    extra: int = 0  # bytes of the group section after the header (a part of a multi-table entry)


@dataclass(frozen=True)
class LogScan:
    """The result of checking a whole log: its header, verified records, and any dropped tail."""

    generation: int
    base_version: int
    embedding_dim: int
    records: list[RecordSpan]
    good_length: int  # bytes up to the end of the last good record; the file is cut here
    file_length: int
    tail_problem: str | None  # why the bytes after good_length were dropped; None when there are none


def _parse_record(buf: Any, offset: int) -> RecordSpan | str:
    """The verified record at ``offset``, or why there is none (the caller decides what that means)."""
    size = len(buf)
    if size - offset < RECORD_HEADER_SIZE:
        return f"{size - offset} bytes, less than a record header"
    head = bytes(buf[offset : offset + _RECORD_HEADER.size])
    magic, fmt, reserved, dim, num_ids, version, lr = _RECORD_HEADER.unpack(head)
    if magic != RECORD_MAGIC:
        return "bad record magic"
    (head_crc,) = CRC.unpack_from(buf, offset + _RECORD_HEADER.size)
    if head_crc != crc32(head):
        return "record header checksum mismatch"
    if fmt not in (RECORD_FORMAT_VERSION, RECORD_FORMAT_GROUP):
        return f"unknown record format {fmt}"
    length = record_length(fmt, reserved, num_ids, dim)
    if offset + length > size:
        return f"record of {length} bytes cut short at {size - offset}"
    (crc,) = CRC.unpack_from(buf, offset + length - 4)
    if crc != crc32(buf[offset : offset + length - 4]):
        return "record checksum mismatch"
    return RecordSpan(offset, length, version, num_ids, dim, lr, record_extra(fmt, reserved))


def _valid_record_after(buf: Any, start: int) -> int | None:
    """Offset of the first fully valid record at or after ``start``, searching byte by byte for the magic."""
    position = buf.find(RECORD_MAGIC, start)
    while position != -1:
        if isinstance(_parse_record(buf, position), RecordSpan):
            return int(position)
        position = buf.find(RECORD_MAGIC, position + 1)
    return None


def scan_log(buf: Any, where: str = "log", *, salvage: bool = False) -> LogScan:
    """Verify a whole log held in ``buf`` (bytes or mmap).

    A bad record with no valid record anywhere after it is a torn tail: reported in ``tail_problem`` and
    left out of ``records``. Raises ``CorruptionError`` for a bad header, a bad record followed by a valid
    one (damage in the middle of the log), a record of another dim, or versions that do not follow on.
    With ``salvage`` damage in the middle is treated as a tail too: everything from the first bad record
    on is given up (an operator's explicit choice, ``robez snapshot --salvage``); and a record that
    repeats the previous record's version replaces it: the earlier one was written by a worker that died
    before it finished the update (never acknowledged), the later one by the next writer (versions before
    robez 0.1.1 could write such a pair; see docs/durability.md).
    """
    size = len(buf)
    if size < LOG_HEADER_SIZE:
        raise CorruptionError(f"{where}: {size} bytes, too short for the log header")
    head = bytes(buf[: LOG_HEADER.size])
    magic, fmt, dim, generation, base_version = LOG_HEADER.unpack(head)
    (head_crc,) = CRC.unpack_from(buf, LOG_HEADER.size)
    if magic != LOG_MAGIC or head_crc != crc32(head):
        raise CorruptionError(f"{where}: bad log header (magic or checksum)")
    if fmt != LOG_FORMAT_VERSION:
        raise CorruptionError(f"{where}: unknown log format version {fmt}")
    records: list[RecordSpan] = []
    offset = LOG_HEADER_SIZE
    expected_version = base_version + 1
    tail_problem: str | None = None
    while offset < size:
        parsed = _parse_record(buf, offset)
        if isinstance(parsed, str):
            later = _valid_record_after(buf, offset + 1)
            if later is not None and not salvage:
                raise CorruptionError(
                    f"{where}: record at byte {offset} is bad ({parsed}) but a valid record follows at byte "
                    f"{later}: the log is damaged in the middle, not torn at its end"
                )
            tail_problem = f"{parsed} at byte {offset}"
            if later is not None:
                tail_problem += f"; salvaged: valid records after it, from byte {later}, are given up too"
            break
        if parsed.embedding_dim != dim:
            raise CorruptionError(
                f"{where}: record at byte {offset} has dim {parsed.embedding_dim}, log has {dim}"
            )
        if salvage and records and parsed.version == expected_version - 1:
            logger.warning(
                "%s: record at byte %d repeats version %d; salvage keeps it instead of the earlier one at "
                "byte %d (an update whose worker died before finishing it)",
                where,
                offset,
                parsed.version,
                records[-1].offset,
            )
            records[-1] = parsed
            offset += parsed.length
            continue
        if parsed.version != expected_version:
            repeated = parsed.version == expected_version - 1
            hint = " (robez snapshot --salvage can recover it)" if repeated else ""
            raise CorruptionError(
                f"{where}: record at byte {offset} produces version {parsed.version}, "
                f"expected {expected_version}{hint}"
            )
        records.append(parsed)
        expected_version += 1
        offset += parsed.length
    return LogScan(generation, base_version, dim, records, offset, size, tail_problem)


def follow_records(fd: int, offset: int, size: int, last_version: int, where: str) -> tuple[int, int]:
    """Walk the record headers of an open log from byte ``offset`` (just after the record that produced
    ``last_version``) to ``size``; returns (end, last version) of the last record.

    Reads only the headers (each checked by its CRC, the payload is not), so it costs a few microseconds a
    record. Raises ``CorruptionError`` for a record that does not follow on (a repeated or skipped
    version) or that is cut short (a writer died in the middle of its append).
    """
    while offset < size:
        head = os.pread(fd, RECORD_HEADER_SIZE, offset)
        if len(head) < RECORD_HEADER_SIZE:
            raise CorruptionError(f"{where}: an unfinished record at byte {offset} ({size - offset} bytes)")
        magic, fmt, reserved, dim, num_ids, version, _lr = _RECORD_HEADER.unpack_from(head)
        (head_crc,) = CRC.unpack_from(head, _RECORD_HEADER.size)
        if magic != RECORD_MAGIC or head_crc != crc32(head[: _RECORD_HEADER.size]):
            raise CorruptionError(f"{where}: a bad record header at byte {offset}")
        length = record_length(fmt, reserved, num_ids, dim)
        if offset + length > size:
            raise CorruptionError(
                f"{where}: an unfinished record at byte {offset} ({size - offset} of {length} bytes)"
            )
        if version != last_version + 1:
            raise CorruptionError(
                f"{where}: record at byte {offset} produces version {version}, expected {last_version + 1}"
            )
        offset += length
        last_version = version
    return offset, last_version


def read_record_ids(
    fd: int, offset: int, size: int, last_version: int, where: str
) -> tuple[list[np.ndarray], int, int]:
    """``follow_records`` that also reads each record whole, checks its CRC and keeps its ids: (the ids
    of each record, int64 arrays in version order; end; last version). Raises ``CorruptionError`` as
    ``follow_records`` does, and for a record whose checksum fails."""
    ids: list[np.ndarray] = []
    while offset < size:
        head = os.pread(fd, RECORD_HEADER_SIZE, offset)
        extra = 0
        if len(head) == RECORD_HEADER_SIZE:
            _magic, fmt, reserved, dim, num_ids, _version, _lr = _RECORD_HEADER.unpack_from(head)
            extra = record_extra(fmt, reserved)
            length = min(record_length(fmt, reserved, num_ids, dim), size - offset)
        else:
            length = size - offset
        end, last_version = follow_records(fd, offset, offset + length, last_version, where)
        record = os.pread(fd, end - offset, offset)
        if len(record) != end - offset or CRC.unpack_from(record, len(record) - 4)[0] != crc32(
            memoryview(record)[:-4]
        ):
            raise CorruptionError(f"{where}: record at byte {offset} fails its checksum")
        ids.append(
            np.frombuffer(record, dtype="<i8", count=num_ids, offset=RECORD_HEADER_SIZE + extra).astype(
                np.int64
            )
        )
        offset = end
    return ids, offset, last_version


def decode_record(buf: Any, span: RecordSpan) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids int64 (N,) and grads float32 (N, d) of a verified record, copied out of ``buf``."""
    start = span.offset + RECORD_HEADER_SIZE + span.extra
    ids = np.frombuffer(buf, dtype="<i8", count=span.num_ids, offset=start).astype(np.int64)
    grads = np.frombuffer(
        buf, dtype="<f4", count=span.num_ids * span.embedding_dim, offset=start + span.num_ids * 8
    ).astype(np.float32)
    return torch.from_numpy(ids), torch.from_numpy(grads.reshape(span.num_ids, span.embedding_dim))


def read_log_header(fd: int, where: str) -> tuple[int, int, int, int]:
    """(generation, base_version, embedding_dim, file size) of an open log, its header checked."""
    size = os.fstat(fd).st_size
    if size < LOG_HEADER_SIZE:
        raise CorruptionError(f"{where}: {size} bytes, too short for the log header")
    head = os.pread(fd, LOG_HEADER_SIZE, 0)
    magic, fmt, dim, generation, base_version = LOG_HEADER.unpack_from(head)
    (head_crc,) = CRC.unpack_from(head, LOG_HEADER.size)
    if magic != LOG_MAGIC or head_crc != crc32(head[: LOG_HEADER.size]):
        raise CorruptionError(f"{where}: bad log header (magic or checksum)")
    if fmt != LOG_FORMAT_VERSION:
        raise CorruptionError(f"{where}: unknown log format version {fmt}")
    return generation, base_version, dim, size


def stream_records(
    fd: int,
    size: int,
    where: str,
    base_version: int,
    embedding_dim: int,
    apply: Callable[[RecordSpan, bytes], None],
    stop_after: int | None = None,
) -> tuple[int, int, str | None]:
    """Read a log's records one at a time (never the whole file in memory), verify each and hand it to
    ``apply(span, record_bytes)`` (the span's offset is the record's place in the file; ``decode_record``
    takes the bytes with ``span_in(span)``), in version order; stop after version ``stop_after`` if given.

    Returns (end of the last good record, last version, tail problem or None). A bad record with no valid
    record after it is a torn tail (the caller cuts it); a bad record followed by a valid one raises
    ``CorruptionError`` (found by searching the rest of the file, on that path only), as ``scan_log``
    does; so do a record of another dim and versions that do not follow on. Records before the damage
    have been applied by then: the caller discards what it applied them to.
    """
    offset, version = LOG_HEADER_SIZE, base_version
    ahead = 0
    while offset < size and (stop_after is None or version < stop_after):
        ahead = read_ahead(fd, offset, ahead)  # the disk streams the log while records are applied
        head = os.pread(fd, RECORD_HEADER_SIZE, offset)
        problem: str | None = None
        record = b""
        length = 0
        if len(head) < RECORD_HEADER_SIZE:
            problem = f"{size - offset} bytes, less than a record header"
        else:
            magic, fmt, reserved, dim, num_ids, record_version, lr = _RECORD_HEADER.unpack_from(head)
            if magic != RECORD_MAGIC:
                problem = "bad record magic"
            elif CRC.unpack_from(head, _RECORD_HEADER.size)[0] != crc32(head[: _RECORD_HEADER.size]):
                problem = "record header checksum mismatch"
            elif fmt not in (RECORD_FORMAT_VERSION, RECORD_FORMAT_GROUP):
                problem = f"unknown record format {fmt}"
            else:
                length = record_length(fmt, reserved, num_ids, dim)
                if offset + length > size:
                    problem = f"record of {length} bytes cut short at {size - offset}"
                else:
                    record = os.pread(fd, length, offset)
                    if len(record) != length or CRC.unpack_from(record, length - 4)[0] != crc32(
                        memoryview(record)[: length - 4]
                    ):
                        problem = "record checksum mismatch"
        if problem is not None:
            later = _valid_record_in_file(fd, offset + 1)
            if later is not None:
                raise CorruptionError(
                    f"{where}: record at byte {offset} is bad ({problem}) but a valid record follows at byte "
                    f"{later}: the log is damaged in the middle, not torn at its end"
                )
            return offset, version, f"{problem} at byte {offset}"
        if dim != embedding_dim:
            raise CorruptionError(f"{where}: record at byte {offset} has dim {dim}, log has {embedding_dim}")
        if record_version != version + 1:
            hint = " (robez snapshot --salvage can recover it)" if record_version == version else ""
            raise CorruptionError(
                f"{where}: record at byte {offset} produces version {record_version}, "
                f"expected {version + 1}{hint}"
            )
        apply(
            RecordSpan(offset, length, record_version, num_ids, dim, lr, record_extra(fmt, reserved)), record
        )
        offset += length
        version = record_version
    return offset, version, None


def span_in(span: RecordSpan) -> RecordSpan:
    """``span`` placed at offset 0: for ``decode_record`` on the record's own bytes."""
    return RecordSpan(0, span.length, span.version, span.num_ids, span.embedding_dim, span.lr, span.extra)


def _valid_record_in_file(fd: int, start: int) -> int | None:
    """``_valid_record_after`` over an open file (mapped only on this path: a damaged log)."""
    size = os.fstat(fd).st_size
    if start >= size:
        return None
    with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as buf:
        return _valid_record_after(buf, start)


def find_record(fd: int, size: int, base_version: int, version: int) -> tuple[RecordSpan, bytes] | None:
    """The record producing ``version`` in an open log whose records start after ``base_version``, read
    whole and its checksum verified: (its span, placed at offset 0 of its bytes; its bytes). None if
    the log does not hold it whole (it ends before, a record on the way is damaged or cut short).
    Reads only the headers of the records before it."""
    offset, last_version = LOG_HEADER_SIZE, base_version
    while offset < size and last_version < version:
        head = os.pread(fd, RECORD_HEADER_SIZE, offset)
        if len(head) < RECORD_HEADER_SIZE:
            return None
        magic, fmt, reserved, dim, num_ids, record_version, lr = _RECORD_HEADER.unpack_from(head)
        if magic != RECORD_MAGIC or CRC.unpack_from(head, _RECORD_HEADER.size)[0] != crc32(
            head[: _RECORD_HEADER.size]
        ):
            return None
        if fmt not in (RECORD_FORMAT_VERSION, RECORD_FORMAT_GROUP) or record_version != last_version + 1:
            return None
        length = record_length(fmt, reserved, num_ids, dim)
        if record_version == version:
            record = os.pread(fd, length, offset)
            if len(record) != length or CRC.unpack_from(record, length - 4)[0] != crc32(
                memoryview(record)[: length - 4]
            ):
                return None
            return RecordSpan(0, length, version, num_ids, dim, lr, record_extra(fmt, reserved)), record
        offset += length
        last_version = record_version
    return None
