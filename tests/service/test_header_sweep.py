"""The per-worker header sweep (service/connections.py): connections waiting for headers past the timeout
are closed, ones that started waiting later or are not waiting are left alone, and the sweep stops once
nothing waits."""

from __future__ import annotations

import asyncio

from service.connections import HeaderSweep


class _Connection:
    def __init__(self, waiting_since: float | None) -> None:
        self.waiting_since = waiting_since
        self.timed_out = False

    def header_timeout(self) -> None:
        self.timed_out = True
        self.waiting_since = None


def test_sweep_closes_only_connections_waiting_past_the_timeout() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        stale, fresh, busy = _Connection(now - 10.0), _Connection(now), _Connection(None)
        sweep = HeaderSweep(loop, {stale, fresh, busy}, timeout_s=0.2)
        assert sweep.check_s == 0.05
        sweep.watch()
        sweep.watch()  # one check pending, not two
        await asyncio.sleep(0.08)
        assert stale.timed_out and not fresh.timed_out and not busy.timed_out
        await asyncio.sleep(0.3)  # past fresh's deadline plus a check
        assert fresh.timed_out and not busy.timed_out
        await asyncio.sleep(0.1)
        assert sweep._check is None  # nothing waits: no check left scheduled

    asyncio.run(scenario())
