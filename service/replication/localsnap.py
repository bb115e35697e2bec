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
from robez_core.table import Table

from ..wal.files import _write_file_durably

logger = logging.getLogger("robez.replication")

MARKER_FILE = "robez-replica"
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
            _write_file_durably(marker, b"robez replica data directory\n")

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

    def write(self, table: str, incarnation: str, position: int, data: bytes) -> LocalSnapshot:
        """Store ``data`` (a robez checkpoint at ``position``) atomically, then remove older ones."""
        path = self.directory / f"{table}.{incarnation}.{position:012d}.safetensors"
        _write_file_durably(path, data)
        for old in self._all():
            if (old.table, old.incarnation) == (table, incarnation) and old.position < position:
                old.path.unlink(missing_ok=True)
        return LocalSnapshot(table, incarnation, position, path)

    def load(self, snapshot: LocalSnapshot) -> Table:
        """The table in the file; ``RobezError`` (or ``OSError``) if it is torn or corrupted."""
        from ..wal import read_checkpoint

        table, _ = read_checkpoint(snapshot.path.read_bytes(), format="robez")
        return table

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
