"""A replica's own snapshots in its data directory (``robez serve --nats ... --data-dir D``).

The applier writes, per table incarnation, a robez checkpoint of the table every
``replica_local_snapshot_every_updates`` updates and on a clean shutdown; at start it loads whichever of
this file and the Object Store snapshot is newer (and still reaches the log), so a restarted replica
replays only the tail of the log instead of downloading a snapshot and replaying everything after it.

Layout: ``D/robez-replica`` marks the directory as a replica's (a single server refuses it, a replica
refuses a directory with a single server's tables in it); ``D/replica-snapshots/<table>.<incarnation>.
<position>.safetensors`` holds the snapshots. The position is in the file name, bound to the bytes by the
atomic rename (temp file, fsync, rename, fsync the folder); only the newest per incarnation is kept. The
checkpoint carries its own checksums, so a torn or corrupted file is detected on load.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from robez_core.errors import ConfigError
from robez_core.hostinfo import process_alive
from robez_core.table import Table

from ..wal.files import write_file_durably

logger = logging.getLogger("robez.replication")

MARKER_FILE = "robez-replica"
# Scratch files of snapshot uploads and downloads (``SCRATCH_PREFIX<pid>-...``), and temp files of
# checkpoints being written (``.<name>.<pid>.<32 hex>.tmp``, ``Table.begin_save``): removed at start when
# the process that wrote them is gone (killed mid-upload, say).
SCRATCH_PREFIX = "robez-snapshot-"
_STALE = (
    re.compile(r"^\.?" + SCRATCH_PREFIX + r"(?P<pid>\d+)-"),
    re.compile(r"^\..+\.(?P<pid>\d+)\.[0-9a-f]{32}\.tmp$"),
)
SNAPSHOT_DIR = "replica-snapshots"
_NAME = re.compile(
    r"^(?P<table>[A-Za-z0-9][A-Za-z0-9_-]*)\.(?P<incarnation>[A-Za-z0-9_-]+)\.(?P<position>\d+)\.safetensors$"
)


def is_replica_dir(data_dir: Path) -> bool:
    return (data_dir / MARKER_FILE).exists()


def check_replica_dir(data_dir: Path) -> None:
    """``ConfigError`` if ``data_dir`` holds a single server's tables (anything but hidden entries, a
    file system's lost+found and this module's own files): the two layouts must never be mixed."""
    if not data_dir.exists():
        return
    foreign = sorted(
        entry.name
        for entry in data_dir.iterdir()
        # lost+found: a dedicated volume's; not a table.
        if not entry.name.startswith(".") and entry.name not in (MARKER_FILE, SNAPSHOT_DIR, "lost+found")
    )
    if foreign:
        raise ConfigError(
            f"the data directory {data_dir} holds a single server's tables ({', '.join(foreign[:5])}); "
            "a replica (--nats) needs its own data directory"
        )


@dataclass(frozen=True)
class LocalSnapshot:
    table: str
    incarnation: str
    position: int
    path: Path


class LocalSnapshots:
    """The newest local snapshot per table incarnation under ``data_dir`` (see the module doc)."""

    def __init__(self, data_dir: Path) -> None:
        check_replica_dir(data_dir)
        self.directory = data_dir / SNAPSHOT_DIR
        self.directory.mkdir(parents=True, exist_ok=True)
        marker = data_dir / MARKER_FILE
        if not marker.exists():
            write_file_durably(marker, b"robez replica data directory\n")

    def _all(self) -> list[LocalSnapshot]:
        found = []
        for path in self.directory.iterdir():
            match = _NAME.match(path.name)
            if match is not None:
                found.append(
                    LocalSnapshot(match["table"], match["incarnation"], int(match["position"]), path)
                )
        return found

    def newest(self, table: str, incarnation: str) -> LocalSnapshot | None:
        mine = [s for s in self._all() if (s.table, s.incarnation) == (table, incarnation)]
        return max(mine, key=lambda s: s.position, default=None)

    def path_for(self, table: str, incarnation: str, position: int) -> Path:
        """Where the snapshot at ``position`` goes: written there atomically (``Table.begin_save`` then
        ``finish``: temp file, fsync, rename, fsync the folder), then ``written`` is called."""
        return self.directory / f"{table}.{incarnation}.{position:012d}.safetensors"

    def written(self, table: str, incarnation: str, position: int) -> None:
        """The snapshot at ``position`` is in place: remove the older ones of the incarnation."""
        for old in self._all():
            if (old.table, old.incarnation) == (table, incarnation) and old.position < position:
                old.path.unlink(missing_ok=True)

    def write(self, table: str, incarnation: str, position: int, source: Table) -> LocalSnapshot:
        """Store ``source`` (the table at ``position``) atomically, then remove older ones."""
        path = source.begin_save(self.path_for(table, incarnation, position)).finish()
        self.written(table, incarnation, position)
        return LocalSnapshot(table, incarnation, position, path)

    def prune(self, keep: set[tuple[str, str]]) -> None:
        """Remove the files of incarnations not in ``keep`` (dropped or recreated tables), and leftover
        temporary files."""
        for snapshot in self._all():
            if (snapshot.table, snapshot.incarnation) not in keep:
                snapshot.path.unlink(missing_ok=True)
                logger.info("removed the local snapshot %s (table no longer in the catalog)", snapshot.path)
        for path in self.directory.glob("*.tmp-*"):
            if path.name.rsplit("-", 1)[-1] != str(os.getpid()):
                path.unlink(missing_ok=True)
        remove_stale_files(self.directory)


def remove_stale_files(directory: Path, temp_files: bool = True) -> None:
    """Remove the snapshot scratch files in ``directory`` whose writer process is gone, and (``temp_files``:
    a folder of robez's own, not the system's temp folder) checkpoint temp files too."""
    try:
        paths = list(directory.iterdir())
    except OSError:
        return
    for path in paths:
        for pattern in _STALE if temp_files else _STALE[:1]:
            match = pattern.match(path.name)
            if match is not None and not process_alive(int(match["pid"])):
                path.unlink(missing_ok=True)
                logger.info("removed %s (left by process %s, which is gone)", path, match["pid"])
                break
