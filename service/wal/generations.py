"""``WalGenerations``: a table's generations (snapshot-<generation> with a fresh log, committed by meta.json)
written whole: the first one (``create``) and an offline ``snapshot``; the snapshot policy; and
``finish_snapshot``, the hashing and fsync of a snapshot file that live snapshots share."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from robez_core.checkpoint import CheckpointWriter, fsync_dir
from robez_core.errors import ConflictError, CorruptionError

from ..faults import Faults
from ..log.journal import is_storage_full
from .files import (
    CREATING_PREFIX,
    file_crc,
    open_private,
    table_bytes,
    write_temp_file,
)
from .layout import TableMeta, WalLayout
from .records import (
    LOG_FILE,
    META_FILE,
    encode_log_header,
)

if TYPE_CHECKING:
    from robez_core.table import Table


class WalGenerations(WalLayout):
    """Whole snapshots of a table taken from a table no one updates meanwhile (``create``, ``snapshot``),
    and the snapshot policy (``snapshot_due``)."""

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
            self.faults.die_at("create:staged")  # testing only: a kill with the table staged, not in place
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
        self.faults.die_at("snapshot:committed")  # testing only: a crash between the two renames
        os.replace(directory / f"{LOG_FILE}.new", directory / LOG_FILE)
        fsync_dir(directory)
        # Every older snapshot goes, not only the one this replaced: one an interrupted snapshot left
        # (the repair after ``snapshot:committed`` in a load is a snapshot of the table served).
        self._remove_stale_files(directory, self._require_meta(name))
        self._forget_log(name)

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
                crc, size = finish_snapshot(fd, staged, table.begin_write(fd), self.faults)
            finally:
                os.close(fd)
            os.replace(staged, snapshot_file)
            with open_private(new_log) as handle:
                handle.write(encode_log_header(embedding_dim, generation, version))
                handle.flush()
                os.fsync(handle.fileno())
            fsync_dir(directory)
            meta = TableMeta(generation, version, snapshot_name, crc, size, embedding_dim, time.time())
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

    def has_pending(self, name: str, version: int) -> bool:
        """Whether the table at ``version`` holds updates its committed snapshot does not (so its log has
        records); a graceful shutdown snapshots exactly these tables."""
        meta = self._read_meta(name)
        return meta is not None and (version != meta.version or not self._log_is_empty(name))


def finish_snapshot(fd: int, path: Path, writer: CheckpointWriter, faults: Faults) -> tuple[int, int]:
    """Complete the snapshot ``begin_write`` left in ``fd`` (checksums, header, fsync; no lock needed,
    pausing after each 16 MiB hashed when a test asks: ``faults``); its (crc32, size) for
    meta.json."""
    hashed = 0

    def pause(piece: memoryview) -> None:
        nonlocal hashed
        before, hashed = hashed, hashed + len(piece)
        faults.slow_down_per_piece(before, hashed)

    writer.finish(fd, each_piece=pause)
    return file_crc(path)
