"""``ReplicatedWrites``: the write path (``service/store/writes.py``) of a replica.

A push is validated here once (``TableStore.validate_many``: the request limits, lr, ids, gradients and
the step's finiteness, against this replica's copy), then each part is appended to its table's stream
and this replica waits for its own applier to reach it. The applier checks every entry again (an entry
can be written by anyone) and skips a bad one alike on every replica; when it runs in this worker, an
entry with exactly the bytes this worker published is applied with the step prepared here (not hashed
nor coalesced twice: ``proposed.ProposedSteps``), its finiteness still checked at its version.

A multi-table push is one stream entry per table (a stream per table: docs/replication.md). What holds:
all of it is validated, and every part's entry size checked against the log's limit, before any part
is published, so a bad part or one too large (413) publishes nothing; then every part
is published at once, each with the request's Idempotency-Key and its table (``key/table``), and their
acks are awaited together (pipelined: a push of k tables costs about one ack round trip, not k); the
answer comes once every part is in the log and applied here. If a part fails (or the replica dies), the
parts already stored stay and the client's retry with the same key stores the rest once (the stored
parts are deduplicated by the log); which parts were stored is not a prefix any more, as the parts go
to different streams. A replica that applies the log never sees a part half-applied, but a lookup may
see one table's part before another's.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from robez_core.errors import ConflictError, NotFoundError
from robez_core.table import Table

from ..config import TableSpec
from ..log.entry import Proposed
from ..store import TableInfo, TableStore, UpdateResult
from ..store.journal import UpdatePart
from ..store.writes import Offload, Readiness, Written
from ..wal.checkpoints import align_checkpoint
from .replica import Replica, ReplicatedUpdate


class ReplicatedWrites:
    """The write path of a replica (see the module's docstring).

    Args:
        store: this worker's table store (its journal is NullJournal: the log is the journal).
        replica: this worker's part of the replica (the log, the version waits, the applier).
    """

    def __init__(self, store: TableStore, replica: Replica) -> None:
        self.store = store
        self.replica = replica

    async def update(
        self, decode: Callable[[], list[UpdatePart]], key: str | None, offload: Offload[Any], *, small: bool
    ) -> Written:
        def validate() -> list[tuple[UpdatePart, Proposed]]:
            parts = [
                UpdatePart(part.table, torch.as_tensor(part.ids), torch.as_tensor(part.grads), part.lr)
                for part in decode()
            ]
            validated = self.store.validate_many(parts)
            return [
                (UpdatePart(part.table, part.ids, part.grads, lr), proposed)
                for part, (lr, proposed) in zip(parts, validated, strict=True)
            ]

        validated = await offload(validate)

        def key_of(part: UpdatePart) -> str | None:
            return key if key is None or len(validated) == 1 else f"{key}/{part.table}"

        async def append(part: UpdatePart, proposed: Proposed) -> ReplicatedUpdate:
            assert isinstance(part.ids, torch.Tensor) and isinstance(part.grads, torch.Tensor)
            assert part.lr is not None
            # The step prepared here is kept for this worker's applier: one validation per push.
            return await self.replica.update(
                part.table, part.ids, part.grads, part.lr, key_of(part), proposed
            )

        if len(validated) == 1:
            logged = [await append(*validated[0])]
        else:
            for part, _ in validated:  # a part over the log's entry limit: 413 before any is published
                assert isinstance(part.ids, torch.Tensor) and isinstance(part.grads, torch.Tensor)
                assert part.lr is not None
                await self.replica.check_size(part.table, part.ids, part.grads, part.lr, key_of(part))
            # Every part in flight at once; all of them settle (stored and applied, or failed) before the
            # answer, so no part is still being published after a failure was answered.
            settled = await asyncio.gather(*(append(*each) for each in validated), return_exceptions=True)
            for outcome in settled:
                if isinstance(outcome, BaseException):
                    raise outcome
            logged = [outcome for outcome in settled if isinstance(outcome, ReplicatedUpdate)]
        # The applier hashes and applies (and records those times); here: the log's ack, then the wait.
        # The parts overlap, so a stage is the longest part's, not their sum.
        results = [UpdateResult(each.version, 0.0, each.apply_wait_seconds) for each in logged]
        stages = {
            "publish": max(each.publish_seconds for each in logged),
            "apply_wait": max(each.apply_wait_seconds for each in logged),
        }
        return Written(results, stages, self.replica.name)

    async def wait_version(self, name: str, version: int, timeout_s: float) -> bool:
        return await self.replica.wait_version(name, version, timeout_s)

    async def create_table(self, name: str, spec: TableSpec, offload: Offload[Any]) -> TableInfo:
        return await self.replica.create_table(name, spec)  # through the log: every replica creates it

    async def drop_table(self, name: str, offload: Offload[Any]) -> None:
        await self.replica.drop_table(name)  # through the log: every replica drops it

    def readiness(self) -> Readiness:
        if not self.replica.ready():
            # Not ready until it has applied the log as it stood when the replica started.
            status = self.replica.status()
            return Readiness(catching_up=status.tables if status is not None else {})
        return Readiness(
            write_problem=self.replica.write_problem(), extra={"log_server": self.replica.log_server()}
        )

    async def load(
        self, name: str, read: Callable[[], tuple[Table, str]], key: str | None, offload: Offload[Any]
    ) -> None:
        """Checked here like on a single server (a bad checkpoint is a 4xx and nothing is published),
        then the checkpoint as the table will hold it goes through the log (``Replica.load``): every
        replica switches to it at the same version. A new table is created through the log first, with
        the checkpoint's config and optimizer."""
        imported, kind = await offload(read)
        try:
            self.store.table(name)
        except NotFoundError:
            with contextlib.suppress(ConflictError):  # created by another request meanwhile: load into it
                await self.replica.create_table(name, TableSpec(imported.config, imported.optimizer))
            await self.replica.wait_serving(name)
        with tempfile.TemporaryDirectory(prefix="robez-load-") as tmp:
            path = Path(tmp) / "checkpoint.safetensors"

            def checkpoint() -> Table:
                aligned = align_checkpoint(
                    imported, self.store.table(name), keep_optimizer_state=kind != "paper"
                )
                aligned.save(path)
                return aligned

            aligned = await offload(checkpoint)
            await self.replica.load(name, aligned, path, key)

    async def table_at(self, name: str, version: int) -> Table:
        return await self.replica.table_at(name, version)
