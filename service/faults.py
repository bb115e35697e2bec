"""Testing only: SIGKILL this process at a named point, to test what a crash there leaves behind (and
``snapshot_chunk_delay_s``: a slow snapshot upload).

Off unless the environment variable ``ROBEZ_FAULT_DIE_AFTER_APPEND`` names a file (``fault_file``); never
set it in production. It is read here, not in ``Settings``: no user sets it, and the tests that start
server processes set it in their environment. The file's text names the point ("" or ``update:appended``:
the update fault of ``TableStore._fault_point``); a process that reaches that point removes the file and,
if it was the one to remove it, dies. So one file kills one process, once, whichever worker gets there
first.

The points (``TableStore.restore`` / ``delete``, ``WalJournal.create`` / ``snapshot`` / ``drop``):

- ``create:staged``: a new table's snapshot and log are written in its ``.creating-*`` folder, not yet
  renamed into place (the next server start on a free data directory removes the folder);
- ``load:filled``: the load's new array is filled, nothing is durable yet;
- ``snapshot:committed``: a snapshot's ``meta.json`` is committed, the fresh log not swapped in yet;
- ``load:durable``: the loaded table is durable (snapshot + empty log), the registry not switched;
- ``load:published``: the registry is switched, the old counters not yet marked replaced;
- ``load:switched``: the old counters are marked replaced, the old array not yet released;
- ``drop:renamed``: the table's folder is renamed aside (``.dropped-*``), not yet removed;
- ``delete:dropped``: the table's folder is gone from the data directory, the registry still has it;
- ``delete:published``: the registry no longer has the table, its counters are not marked deleted.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

UPDATE_APPENDED = "update:appended"
# A multi-table push: its first part appended to its table's log, the other parts not yet.
GROUP_APPENDED = "update:group-appended"
FAULT_FILE_VARIABLE = "ROBEZ_FAULT_DIE_AFTER_APPEND"
# Testing only: seconds a replica waits after each snapshot chunk it uploads, so a test can keep an
# upload running for a while without a table of gigabytes.
SNAPSHOT_CHUNK_DELAY_VARIABLE = "ROBEZ_FAULT_SNAPSHOT_CHUNK_DELAY_S"


def snapshot_chunk_delay_s() -> float:
    """Testing only: the delay after each uploaded snapshot chunk (``ROBEZ_FAULT_SNAPSHOT_CHUNK_DELAY_S``,
    default 0)."""
    try:
        return max(0.0, float(os.environ.get(SNAPSHOT_CHUNK_DELAY_VARIABLE) or 0.0))
    except ValueError:
        return 0.0


def fault_file() -> Path | None:
    """Testing only: the fault file ``ROBEZ_FAULT_DIE_AFTER_APPEND`` names in this process's environment,
    or None (no fault point can fire)."""
    value = os.environ.get(FAULT_FILE_VARIABLE)
    return Path(value) if value else None


def armed(fault_file: Path | None, point: str) -> bool:
    """Whether this process must die at ``point`` now: the fault file names it and this process removed
    it (so no other process will)."""
    if fault_file is None:
        return False
    try:
        named = fault_file.read_text().strip() or UPDATE_APPENDED
    except FileNotFoundError:
        return False
    if named != point:
        return False
    try:
        fault_file.unlink()
    except FileNotFoundError:
        return False  # another process got there first
    return True


def die_at(fault_file: Path | None, point: str) -> None:
    """SIGKILL this process if the fault file names ``point`` (see ``armed``)."""
    if armed(fault_file, point):
        os.kill(os.getpid(), signal.SIGKILL)


SLOW_VARIABLE = "ROBEZ_FAULT_SLOW_SECONDS"


def slow_seconds() -> float:
    """Testing only: seconds to pause after each piece of a whole-table pass made outside the table's
    update lock (a snapshot's hashing, a checksum's, a table's load at start), so a test sees a slow one
    without a big table; ``ROBEZ_FAULT_SLOW_SECONDS`` (unset: 0)."""
    value = os.environ.get(SLOW_VARIABLE)
    return float(value) if value else 0.0


def slow_down() -> None:
    """Testing only: pause ``slow_seconds()`` (after each piece of a pass made outside the update lock)."""
    pause = slow_seconds()
    if pause:
        time.sleep(pause)
