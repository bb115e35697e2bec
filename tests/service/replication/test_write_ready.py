"""``/readyz?writes=true`` right after start: a replica is not write-ready until a write check through it
is acknowledged, and takes no writes before that either, so no start-up window says read-only while
writes get through (issue 39: the second replica of ``make cluster`` took pushes for a few seconds while
its write check, on a health stream just created and without a leader yet, answered "no response from
stream"). A stand-in for the log (its write check refused three times, like that stream's) shows the order;
``benchmarks/replication/write_ready.py`` measures it on a fresh NATS cluster."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from robez_core.errors import BusyError
from service.config import Settings
from service.replication.replica import Replica


class _Log:
    """Connects at once; its first ``refusals`` write checks fail as a leaderless stream's do."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.checks = 0
        self.acked_at: float | None = None

    async def connect(self) -> None:
        return None

    async def check_writable(self, timeout_s: float) -> None:
        self.checks += 1
        if self.checks <= self.refusals:
            raise BusyError("the replicated log is unavailable (write check: NoStreamResponseError)")
        if self.acked_at is None:
            self.acked_at = time.monotonic()

    async def close(self) -> None:
        return None

    def connected_to(self) -> str:
        return "127.0.0.1:4222"

    def __getattr__(self, name: str) -> Any:  # the applier's calls: never answered here
        async def never(*_: Any, **__: Any) -> None:
            await asyncio.Event().wait()

        return never


def test_writes_wait_for_the_first_acknowledged_write_check(tmp_path: Path) -> None:
    async def run() -> None:
        log = _Log(refusals=3)
        store: Any = SimpleNamespace(directory=SimpleNamespace(path=tmp_path))
        settings = Settings(nats_write_check_interval_s=0.05, apply_wait_s=5.0, replica_name="a")
        replica = Replica(store, settings, None, log)  # type: ignore[arg-type]
        await replica.start()
        try:
            # What a push through this replica waits for before it goes to the log.
            await replica._wait_connected()
            admitted = time.monotonic()
            assert log.acked_at is not None and log.acked_at <= admitted, (
                f"a write was let through before any write check was acknowledged ({log.checks} tried)"
            )
            assert replica.write_problem() is None  # write-ready from then on
        finally:
            await replica.stop()

    asyncio.run(run())
