"""The replicated log applied to a private table (``replay_log``: a rebuild, ``Replica.table_at``),
and the checkpoint a load entry names (``load_checkpoint``), decided alike on every replica."""

from __future__ import annotations

import contextlib
import hashlib
import tempfile
from collections.abc import Callable
from pathlib import Path

import anyio.to_thread

from robez_core.config import OptimizerConfig, TableConfig
from robez_core.table import Table

from ..log.entry import SkippedRecord, apply_logged_record, skipped
from .log import CatalogEntry, LogTrimmedError, ReplicatedLog
from .records import LoadRecord, decode_entry


async def load_checkpoint(
    log: ReplicatedLog, entry: CatalogEntry, record: LoadRecord
) -> Table | SkippedRecord:
    """The table a load entry names, or why it cannot be loaded: the checkpoint is not in the store
    (``load_missing``), or its bytes, format or config do not match (``load_corrupt``). Decided by
    the entry and the object alone, so every replica decides alike; the log being unreachable is a
    ``BusyError`` (retried), never a skip."""
    # Recorded before it is read: the checkpoint is deleted only once the log no longer holds this
    # entry (``_forget_loads``).
    await log.set_load_position(entry, record.object_name, record.version)
    with tempfile.TemporaryDirectory(prefix="robez-load-") as tmp:
        path = Path(tmp) / "checkpoint.safetensors"
        with path.open("wb") as handle:
            found = await log.get_load(entry, record.object_name, handle)
        if not found:
            first, _ = await log.bounds(entry)
            if first > record.version:
                # Deleted because a snapshot is past this entry (this replica got it just before the
                # trim): the snapshot, not a skip, is what the other replicas have.
                raise LogTrimmedError(entry.name, record.version - 1, first)
            return SkippedRecord(
                entry.name,
                record.version,
                "load_missing",
                f"no checkpoint {record.object_name!r} in the store",
            )
        digest = await anyio.to_thread.run_sync(file_sha256, path)
        if digest != record.sha256:
            return SkippedRecord(
                entry.name,
                record.version,
                "load_corrupt",
                f"checkpoint {record.object_name!r} has SHA-256 {digest}, the entry names {record.sha256}",
            )
        try:
            table = await anyio.to_thread.run_sync(Table.load, path)
        except OSError:
            raise  # this machine's trouble (retried), not the checkpoint's
        except Exception as exc:  # any reader's error: the same bytes fail alike everywhere
            reason = str(exc).replace(str(path), "(the checkpoint)")
            return SkippedRecord(
                entry.name, record.version, "load_corrupt", f"checkpoint {record.object_name!r}: {reason}"
            )
    wanted = (TableConfig.from_dict(entry.config), OptimizerConfig.from_dict(entry.optimizer))
    if (table.config, table.optimizer) != wanted:
        return SkippedRecord(
            entry.name,
            record.version,
            "load_corrupt",
            f"checkpoint {record.object_name!r} has another config or optimizer than the table",
        )
    return table


async def replay_log(
    log: ReplicatedLog,
    entry: CatalogEntry,
    table: Table,
    position: int,
    until: int,
    on_skip: Callable[[SkippedRecord], None] | None = None,
) -> tuple[Table, int]:
    """Apply the log's entries after ``position`` up to ``until`` to the private ``table`` (at
    ``position``), as the applier applies them to the served one; returns the table (a load replaces
    it) and the position reached. ``LogTrimmedError`` if the log no longer goes on from ``position``."""
    first, _ = await log.bounds(entry)
    if first > position + 1:
        raise LogTrimmedError(entry.name, position, first)
    if until <= position:
        return table, position
    async with contextlib.aclosing(log.read(entry, position)) as entries:
        async for item in entries:
            if item.position != position + 1:
                # Trimmed past ``position`` since the bounds were read (another replica uploaded a newer
                # snapshot): applying this entry would skip updates.
                raise LogTrimmedError(entry.name, position, item.position)
            record = decode_entry(entry.name, item.position, item.payload, item.headers)
            outcome: tuple[float, float] | SkippedRecord | None
            if isinstance(record, LoadRecord):
                loaded = await load_checkpoint(log, entry, record)
                outcome = skipped(loaded) if isinstance(loaded, SkippedRecord) else None
                table = loaded if isinstance(loaded, Table) else table
            else:
                outcome = await anyio.to_thread.run_sync(apply_logged_record, table, record)
            if isinstance(outcome, SkippedRecord) and on_skip is not None:
                on_skip(outcome)
            position = item.position
            if position >= until:
                break
    return table, position


def file_sha256(path: Path) -> str:
    """The SHA-256 (hex) of a file, read 1 MiB at a time."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
