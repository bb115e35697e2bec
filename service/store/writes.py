"""The write path a route calls, the same for a single server and a replica: what differs between them
(where a push is applied, read-your-writes waits, how tables come and go, readiness) lives behind it.

``WritePath`` is the interface; ``LocalWrites`` (here) is one server's: the store proposes to its own
journal and applies at once. ``ReplicatedWrites`` (``service/replication/writes.py``) publishes to the
replicated log and waits for this replica's applier. ``create_app`` picks one (``app.state.writes``);
routes never ask which.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import anyio.to_thread

from robez_core.errors import ConflictError, NotFoundError
from robez_core.table import Table

from ..config import TableSpec
from ..wal.checkpoints import align_checkpoint
from .api import TableInfo, UpdateResult
from .journal import UpdatePart
from .tables import TableStore

T = TypeVar("T")

# Runs a blocking function in a compute slot off the event loop (``routes.deps.compute`` of a request).
Offload = Callable[[Callable[[], T]], Awaitable[T]]


@dataclass(frozen=True)
class Written:
    """What a push's write path answers.

    Attributes:
        results: each part's result (its table's new version), in the order of the parts.
        stages: Server-Timing stages in seconds, when they are not the results' hash and apply times
            (a replica: ``publish``, ``apply_wait``); None on a single server.
        replica: the replica that answered (the ``X-Robez-Replica`` header), None on a single server.
    """

    results: list[UpdateResult]
    stages: dict[str, float] | None = None
    replica: str | None = None


@dataclass(frozen=True)
class Readiness:
    """What ``/readyz`` reports of the write path.

    Attributes:
        catching_up: a replica that has not yet applied the log as it stood when it started: the
            replication status per table (the answer is 503); None when ready.
        write_problem: why writes are refused now (a full disk, no log quorum), or None.
        extra: more fields for the answer's body (a replica: ``log_server``).
    """

    catching_up: dict[str, Any] | None = None
    write_problem: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class WritePath(Protocol):
    """How a route changes tables (see the module's docstring)."""

    async def update(
        self, decode: Callable[[], list[UpdatePart]], key: str | None, offload: Offload[Any], *, small: bool
    ) -> Written:
        """Push the parts ``decode()`` gives (it decodes and may raise a 4xx; called off the event loop
        unless ``small``): validated once, then proposed as one entry, all or nothing; returns once this
        server applies it and it is as durable as promised. ``key``: the request's Idempotency-Key."""
        ...

    async def wait_version(self, name: str, version: int, timeout_s: float) -> bool:
        """Whether table ``name`` reaches ``version`` here within ``timeout_s`` (read-your-writes)."""
        ...

    async def create_table(self, name: str, spec: TableSpec, offload: Offload[Any]) -> TableInfo:
        """Create a table (every replica, through the log, on a replica)."""
        ...

    async def drop_table(self, name: str, offload: Offload[Any]) -> None:
        """Delete a table (every replica, through the log, on a replica)."""
        ...

    def readiness(self) -> Readiness:
        """What ``/readyz`` says of the write path now."""
        ...

    async def load(
        self, name: str, read: Callable[[], tuple[Table, str]], key: str | None, offload: Offload[Any]
    ) -> None:
        """Switch table ``name`` (created if new) to the checkpoint ``read()`` gives (the table and its
        format; it raises a 4xx for a bad one, before anything changes), at the next version on a replica
        (every replica at once), at version 0 on a single server."""
        ...

    async def table_at(self, name: str, version: int) -> Table:
        """A private copy of the table as it was at ``version`` (``ConflictError`` where it is not kept:
        a single server keeps only the current one)."""
        ...


class LocalWrites:
    """The write path of one server: its store proposes to its own journal and applies at once.

    Args:
        store: this worker's table store.
    """

    def __init__(self, store: TableStore) -> None:
        self.store = store

    async def update(
        self, decode: Callable[[], list[UpdatePart]], key: str | None, offload: Offload[Any], *, small: bool
    ) -> Written:
        store = self.store

        def work(blocking: bool) -> tuple[list[UpdateResult], int] | None:
            return store.propose(decode(), blocking=blocking)

        # A small push runs on the event loop when the table's lock is free at once and the journal
        # writes nothing (the hop to a worker thread and back costs more than its whole work); otherwise
        # it waits for the lock in a worker thread.
        done = work(False) if small and store.journal_is_memory_only() else None
        if done is None:
            done = await offload(lambda: work(True))
        assert done is not None
        results, ticket = done
        if ticket > 0:
            # Wait for the flush outside the compute slots, so concurrent pushes share one group commit.
            await anyio.to_thread.run_sync(store.journal.wait_durable, ticket)
        return Written(results)

    async def wait_version(self, name: str, version: int, timeout_s: float) -> bool:
        """Polls the table's version (the workers share it), backing off from 0.5 ms to 5 ms."""
        deadline = time.monotonic() + timeout_s
        delay = _POLL_S
        while self.store.version(name) < version:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            await asyncio.sleep(min(delay, remaining))
            delay = min(2 * delay, _MAX_POLL_S)
        return True

    async def create_table(self, name: str, spec: TableSpec, offload: Offload[Any]) -> TableInfo:
        # Initialising a large array takes a while, hence off the event loop.
        info: TableInfo = await offload(lambda: self.store.create(name, spec))
        return info

    async def drop_table(self, name: str, offload: Offload[Any]) -> None:
        await offload(lambda: self.store.delete(name))

    def readiness(self) -> Readiness:
        return Readiness(write_problem=self.store.journal.write_problem())

    async def load(
        self, name: str, read: Callable[[], tuple[Table, str]], key: str | None, offload: Offload[Any]
    ) -> None:
        def work() -> None:
            imported, kind = read()
            _install(self.store, name, imported, from_paper=kind == "paper")

        await offload(work)

    async def table_at(self, name: str, version: int) -> Table:
        raise ConflictError(
            f"table {name!r} is at version {self.store.version(name)}; only replicas keep older ones"
        )


def _install(store: TableStore, name: str, imported: Table, *, from_paper: bool) -> None:
    """Make ``imported`` table ``name`` at version 0: a new table is created from it; an existing one is
    switched atomically to a new array holding it, made durable first (snapshot + empty log)."""
    try:
        existing = store.table(name)
    except NotFoundError:
        try:
            store.create_from(name, imported)
            return
        except ConflictError:  # created by another request meanwhile: load into it
            existing = store.table(name)
    store.restore(name, align_checkpoint(imported, existing, keep_optimizer_state=not from_paper), 0)


_POLL_S = 0.0005
_MAX_POLL_S = 0.005
