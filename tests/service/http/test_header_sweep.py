"""The per-worker header sweep (service/http/protocol.py): connections waiting for headers past the timeout
are closed, ones that started waiting later or are not waiting are left alone, and the sweep stops once
nothing waits."""

from __future__ import annotations

import asyncio

from service.http.protocol import HeaderSweep


class _Connection:
    def __init__(self, waiting_since: float | None, idle: bool = False) -> None:
        self.waiting_since = waiting_since
        self.idle = idle
        self.timed_out = False
        self.kept_alive_past = False

    def header_timeout(self) -> None:
        self.timed_out = True
        self.waiting_since = None

    def keep_alive_timeout(self) -> None:
        self.kept_alive_past = True
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


def test_sweep_closes_idle_connections_after_the_keep_alive_timeout() -> None:
    """Idle (no byte since its last response): closed at keep_alive_s; a connection that sent part of its
    next request's headers waits for the header timeout instead."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        idle, started = _Connection(now, idle=True), _Connection(now, idle=False)
        sweep = HeaderSweep(loop, {idle, started}, timeout_s=0.6, keep_alive_s=0.2)
        assert sweep.check_s == 0.05
        sweep.watch()
        await asyncio.sleep(0.35)
        assert idle.kept_alive_past and not idle.timed_out
        assert not started.kept_alive_past and not started.timed_out
        await asyncio.sleep(0.45)
        assert started.timed_out and not started.kept_alive_past

    asyncio.run(scenario())
