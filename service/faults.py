"""Testing only: the fault hooks, in one ``Faults`` object that a process builds once at its start and
hands to what needs it (the store, the journal, the replicated log); nothing else reads them.

- ``die_file`` (``ROBEZ_FAULT_DIE_AFTER_APPEND``): SIGKILL this process at a named point, to test what a
  crash there leaves behind. The file's text names the point ("" or ``update:appended``: the update fault
  of ``TableStore._fault_point``); a process that reaches that point removes the file and, if it was the
  one to remove it, dies. So one file kills one process, once, whichever worker gets there first.
- ``slow_seconds`` (``ROBEZ_FAULT_SLOW_SECONDS``): pause after each piece of a whole-table pass made
  outside the table's update lock (a snapshot's copy and hashing, a checksum's, a table's load at start),
  so a test sees a slow one without a big table.
- ``snapshot_chunk_delay_s`` (``ROBEZ_FAULT_SNAPSHOT_CHUNK_DELAY_S``): seconds a replica waits after each
  snapshot chunk it uploads, so a test can keep an upload running without a table of gigabytes.

Off unless the environment names them, read by ``Faults.from_environment`` at the composition roots only
(``service.app.create_app_from_env``, ``robez serve``); never set them in production. They are not in
``Settings``: no user sets them. Everything else takes a ``Faults`` argument defaulting to ``NO_FAULTS``.

The kill points (``TableStore.restore`` / ``restore_from_file`` / ``delete``, ``WalJournal.create`` /
``snapshot`` / ``drop``):

- ``create:staged``: a new table's snapshot and log are written in its ``.creating-*`` folder, not yet
  renamed into place (the next server start on a free data directory removes the folder);
- ``load:filled``: the load's new array is filled, nothing is durable yet;
- ``snapshot:committed``: a snapshot's ``meta.json`` is committed, the fresh log not swapped in yet;
- ``load:durable``: the loaded table is durable (snapshot + empty log), the registry not switched;
- ``load:published``: the registry is switched, the old counters not yet marked replaced;
- ``load:switched``: the old counters are marked replaced, the old array not yet released;
- ``restore:durable``: a restore in place (service/store/inplace.py) made the new table durable, the
  array not yet written;
- ``restore:overwriting``: a restore in place wrote half of the array;
- ``drop:renamed``: the table's folder is renamed aside (``.dropped-*``), not yet removed;
- ``delete:dropped``: the table's folder is gone from the data directory, the registry still has it;
- ``delete:published``: the registry no longer has the table, its counters are not marked deleted.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

UPDATE_APPENDED = "update:appended"
# A multi-table push: its first part appended to its table's log, the other parts not yet.
GROUP_APPENDED = "update:group-appended"
FAULT_FILE_VARIABLE = "ROBEZ_FAULT_DIE_AFTER_APPEND"
SLOW_VARIABLE = "ROBEZ_FAULT_SLOW_SECONDS"
SNAPSHOT_CHUNK_DELAY_VARIABLE = "ROBEZ_FAULT_SNAPSHOT_CHUNK_DELAY_S"

# A whole-table pass pauses once per this many bytes (a snapshot's hashing, a load's reading).
SLOW_PIECE_BYTES = 1 << 24


@dataclass
class Faults:
    """The fault hooks of one process (module docstring); the default fires none. Mutable so an
    in-process test can slow a pass down and back (``slow_seconds``) on the object it handed out."""

    die_file: Path | None = None
    slow_seconds: float = 0.0
    snapshot_chunk_delay_s: float = 0.0

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Faults:
        """The hooks the ``ROBEZ_FAULT_*`` variables of ``environ`` (default: this process's) name; a
        malformed number is taken as 0 (off)."""
        environ = os.environ if environ is None else environ
        die_file = environ.get(FAULT_FILE_VARIABLE)
        return cls(
            die_file=Path(die_file) if die_file else None,
            slow_seconds=_seconds(environ.get(SLOW_VARIABLE)),
            snapshot_chunk_delay_s=_seconds(environ.get(SNAPSHOT_CHUNK_DELAY_VARIABLE)),
        )

    @property
    def can_die(self) -> bool:
        """Whether a kill point may fire (a fault file is named); callers test this before the work of
        reaching a point (``TableStore``'s half-applied update)."""
        return self.die_file is not None

    def armed(self, point: str) -> bool:
        """Whether this process must die at ``point`` now: the fault file names it and this process removed
        it (so no other process will)."""
        if self.die_file is None:
            return False
        try:
            named = self.die_file.read_text().strip() or UPDATE_APPENDED
        except FileNotFoundError:
            return False
        if named != point:
            return False
        try:
            self.die_file.unlink()
        except FileNotFoundError:
            return False  # another process got there first
        return True

    def die_at(self, point: str) -> None:
        """SIGKILL this process if the fault file names ``point`` (see ``armed``)."""
        if self.armed(point):
            os.kill(os.getpid(), signal.SIGKILL)

    def slow_down(self) -> None:
        """Pause ``slow_seconds`` (after each piece of a pass made outside the update lock)."""
        if self.slow_seconds:
            time.sleep(self.slow_seconds)

    def slow_down_per_piece(self, before: int, after: int) -> None:
        """``slow_down`` once when a pass crossed a ``SLOW_PIECE_BYTES`` boundary going from ``before``
        to ``after`` bytes."""
        if self.slow_seconds and after // SLOW_PIECE_BYTES > before // SLOW_PIECE_BYTES:
            time.sleep(self.slow_seconds)


# The hooks of a process that was given none: every point is a no-op.
NO_FAULTS = Faults()


def _seconds(value: str | None) -> float:
    try:
        return max(0.0, float(value or 0.0))
    except ValueError:
        return 0.0
