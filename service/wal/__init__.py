"""Durable tables on one machine: per-table snapshots plus a checksummed, append-only log of gradient
pushes.

``WalJournal`` implements the store's ``Journal`` hook (``service/store/journal.py``). Layout under the data
directory, one folder per table (formats and guarantees in docs/durability.md)::

    <data_dir>/<name>/meta.json                     the commit point: generation, version, snapshot file
    <data_dir>/<name>/snapshot-<generation>.safetensors   Table.save of the table at ``version``
    <data_dir>/<name>/updates.wal                   header (generation, base version) + update records

A snapshot bumps the generation: the new snapshot and a fresh log are written and fsynced first, then
``meta.json`` is replaced atomically (the commit), then the fresh log is renamed over the old one. A log
whose generation is older than ``meta.json``'s was left by a crash between those two renames; its records
are all in the snapshot already, so it is discarded.

Recovery (``load``) verifies the snapshot's CRC32, loads it, and replays the log's records in order. A
bad record at the very end (a torn write) is dropped with a warning and the file truncated to the last
good record; a bad record followed by a valid one, a bad snapshot or inconsistent metadata raises
``CorruptionError``.
The package, by concept: ``records`` (the log's bytes), ``files`` (durable file steps, locks),
``journal`` (``WalJournal``, put together from ``layout`` (folders, meta.json, clean-up, open logs,
disk-full state), ``appender`` (append and group commit), ``generations`` (whole snapshots, the snapshot
policy), ``live_snapshots`` (a snapshot while updates go on) and ``recovery`` (replay, salvage, recover);
its snapshot files are robez_core's checkpoints, written from and read into the table's own memory:
``CheckpointWriter.begin`` and ``log/live_copy.py`` for a live snapshot, ``Table.begin_write``,
``CheckpointFile``), ``snapshots`` (the scheduler that runs the snapshot policy),
``checkpoints`` (import, export and the offline tools).
"""

from __future__ import annotations

from .checkpoints import (
    CHECKPOINT_FORMATS,
    CheckpointFormat,
    align_checkpoint,
    checkpoint_format,
    import_offline,
    read_checkpoint,
    snapshot_offline,
)
from .files import SERVER_LOCK_FILE, ServerLock
from .journal import WalJournal
from .records import (
    FSYNC_POLICIES,
    LOG_FILE,
    LOG_HEADER_SIZE,
    META_FILE,
    RECORD_HEADER_SIZE,
    FsyncPolicy,
    LogScan,
    RecordSpan,
    decode_record,
    encode_log_header,
    encode_record,
    follow_records,
    scan_log,
)
from .snapshots import SnapshotScheduler

__all__ = [
    "CHECKPOINT_FORMATS",
    "FSYNC_POLICIES",
    "LOG_FILE",
    "LOG_HEADER_SIZE",
    "META_FILE",
    "RECORD_HEADER_SIZE",
    "SERVER_LOCK_FILE",
    "CheckpointFormat",
    "FsyncPolicy",
    "LogScan",
    "RecordSpan",
    "ServerLock",
    "SnapshotScheduler",
    "WalJournal",
    "align_checkpoint",
    "checkpoint_format",
    "decode_record",
    "encode_log_header",
    "encode_record",
    "follow_records",
    "import_offline",
    "read_checkpoint",
    "scan_log",
    "snapshot_offline",
]
