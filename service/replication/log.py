"""The seam between a replica and the replicated log it follows.

A replica is a state machine (``TableStore``) that applies, in order, the entries a totally ordered,
durable, replicated log hands it; it never decides order itself. ``ReplicatedLog`` is everything the
replica needs from such a log, so JetStream (``jetstream.py``) is one implementation and a Kafka one
(a topic partition per table, offset = position, a compacted topic for the catalog) could be another.

Positions: each table has its own log; the n-th entry of it has position n (1-based, gap-free), and the
table's version after applying it is n. Positions survive trimming (the log forgets entries below a
snapshot but never renumbers). A table dropped and created again is a new *incarnation* with a new log.
"""

from __future__ import annotations

import io
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from robez_core.errors import RobezError


class LogTrimmedError(RobezError):
    """The entries after the reader's position were trimmed away (below a snapshot): the reader must
    restore a snapshot at ``first - 1`` or later before reading on."""

    def __init__(self, table: str, position: int, first: int) -> None:
        super().__init__(f"table {table!r}: the log now starts at {first}, after position {position}")
        self.first = first


@dataclass(frozen=True)
class CatalogEntry:
    """One table of the catalog: its spec (as ``TableConfig`` / ``OptimizerConfig`` dicts) and the
    incarnation whose log holds its updates."""

    name: str
    config: dict[str, Any]
    optimizer: dict[str, Any]
    incarnation: str


@dataclass(frozen=True)
class CatalogEvent:
    """A table created (``entry`` set) or dropped (``entry`` None); ``initial`` ends the replay of the
    catalog as it was when the watch started (then ``name`` is empty)."""

    name: str
    entry: CatalogEntry | None
    initial_done: bool = False


@dataclass(frozen=True)
class Appended:
    """Where the log put an entry; ``duplicate``: the idempotency key was seen before and ``position``
    is that first entry's."""

    position: int
    duplicate: bool


@dataclass(frozen=True)
class LogEntry:
    """An entry read back: its position, payload and headers, and when the log stored it (unix s)."""

    position: int
    payload: bytes
    headers: dict[str, str]
    timestamp: float
    pending: int  # entries after this one the log had when it was delivered


@dataclass(frozen=True)
class Snapshot:
    """A table's state at ``position``: a robez checkpoint file (``Table.save``'s format) at ``path``."""

    position: int
    path: Path


class SnapshotLease(Protocol):
    """The right to upload one table's snapshot, held by one replica at a time (``lease_snapshot``)."""

    stored_position: int  # the stored snapshot's position when the lease was taken (0: none)

    async def put(self, snapshot: Snapshot) -> bool:
        """Upload the file as the table's snapshot, streamed; False (nothing kept) if a snapshot at least
        as new is stored, or one was stored or the table dropped meanwhile."""
        ...

    async def release(self) -> None: ...


@dataclass(frozen=True)
class StoredLoad:
    """A checkpoint stored for a load: its name, the position of the (last) load entry naming it as
    recorded by the replicas that applied it (0: none yet), and its age (s)."""

    name: str
    position: int
    age_s: float


class ReplicatedLog(Protocol):
    """A totally ordered, durable, replicated log per table, plus a catalog of tables and a snapshot
    store. Every method may raise ``RobezError`` (``ConflictError``, ``NotFoundError``, ``BusyError``
    when the log is unavailable)."""

    async def connect(self) -> None: ...

    async def close(self) -> None: ...

    # -- catalog --
    async def create_table(
        self, name: str, config: dict[str, Any], optimizer: dict[str, Any]
    ) -> CatalogEntry:
        """Add a table with a new, empty log; ``ConflictError`` if one of that name exists."""
        ...

    async def get_table(self, name: str) -> CatalogEntry | None: ...

    async def table_names(self) -> list[str]: ...

    async def drop_table(self, name: str) -> None:
        """Remove a table and its log; ``NotFoundError`` if there is none."""
        ...

    def watch_tables(self) -> AsyncIterator[CatalogEvent]:
        """The catalog as it is now (ending with an ``initial_done`` event), then every change."""
        ...

    # -- updates --
    def max_entry_bytes(self) -> int:
        """The largest entry (payload and headers, bytes) the log takes now; 0 when not known."""
        ...

    def entry_bytes(self, entry: CatalogEntry, payload_bytes: int, headers: dict[str, str], key: str) -> int:
        """What an append of a payload of ``payload_bytes`` with ``headers`` and ``key`` counts against
        ``max_entry_bytes``."""
        ...

    async def append(
        self, entry: CatalogEntry, payload: bytes, headers: dict[str, str], key: str
    ) -> Appended:
        """Returns once the entry is durable in the log (a quorum has it). ``key``: an append with the
        key of an earlier one (within the dedup window) is not added again. An entry over
        ``max_entry_bytes`` raises ``UpdateTooLargeError``."""
        ...

    def read(self, entry: CatalogEntry, after: int) -> AsyncGenerator[LogEntry, None]:
        """Entries from position ``after + 1`` on, in order, forever. If the log was trimmed past the
        reader's position, either the next entry's position shows the gap or ``LogTrimmedError`` is
        raised (when no entry follows the trimmed ones yet)."""
        ...

    def read_batches(self, entry: CatalogEntry, after: int) -> AsyncGenerator[list[LogEntry], None]:
        """``read``'s entries in batches: each batch holds every entry that has arrived (up to a bound),
        so the applier takes them in one pass; never empty."""
        ...

    async def bounds(self, entry: CatalogEntry) -> tuple[int, int]:
        """(first, last) position the log holds now; first = last + 1 when it holds none."""
        ...

    async def trim(self, entry: CatalogEntry, below: int) -> None:
        """Forget entries at positions below ``below``."""
        ...

    # -- health --
    async def check_writable(self, timeout_s: float) -> None:
        """Returns once the log acknowledged a tiny write through this replica's connection (a quorum is
        reachable); ``BusyError`` after ``timeout_s`` or when not connected."""
        ...

    def connected_to(self) -> str | None:
        """The log server this replica talks to now (host:port), None while disconnected."""
        ...

    # -- loads: checkpoints a ``POST .../load`` put beside the log, named by a load entry --
    async def put_load(self, entry: CatalogEntry, data: io.BufferedIOBase) -> str:
        """Store a checkpoint (robez safetensors, read from ``data`` chunk by chunk) under a new name;
        returns the name."""
        ...

    async def get_load(self, entry: CatalogEntry, name: str, into: BinaryIO) -> bool:
        """Write the checkpoint's bytes to ``into`` (chunk by chunk: a large table is never whole in
        memory); False if there is none (never stored, or deleted)."""
        ...

    async def set_load_position(self, entry: CatalogEntry, name: str, position: int) -> None:
        """Record that the load entry at ``position`` names the checkpoint (kept: the highest)."""
        ...

    async def loads(self, entry: CatalogEntry) -> list[StoredLoad]:
        """The checkpoints stored for this incarnation of the table."""
        ...

    async def delete_load(self, entry: CatalogEntry, name: str) -> None: ...

    # -- snapshots: one stored object per table; no stored byte outlives the object it belongs to --
    async def lease_snapshot(self, entry: CatalogEntry, holder: str) -> SnapshotLease | None:
        """The upload lease of the table (renewed until released), or None while another replica
        holds it."""
        ...

    async def get_snapshot(self, entry: CatalogEntry, directory: Path) -> Snapshot | None:
        """The stored snapshot, downloaded (streamed, checked) into a new file in ``directory`` that the
        caller removes; None if there is none."""
        ...

    async def snapshot_position(self, entry: CatalogEntry) -> int:
        """Position of the stored snapshot (0: none), without downloading it."""
        ...
