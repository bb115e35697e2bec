"""Lookups waiting for a version (``X-Robez-Min-Version``) cannot take the worker (issue 28): 200 of them
waiting at once beside normal lookups, on a real server; the normal lookups are answered (>= 99% 200),
waiters past ``max_version_waiters`` get 503 at once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from service.client import OCTET_STREAM, encode_ids

from ..subprocess_server import serve

pytestmark = pytest.mark.slow

WAITERS = 200
NORMAL = 200
WAIT_MS = 10_000


async def _run(url: str) -> tuple[list[int], list[int], int]:
    body, _ = encode_ids([1, 2, 3])
    headers = {"Content-Type": OCTET_STREAM}
    limits = httpx.Limits(max_connections=WAITERS + 16, max_keepalive_connections=WAITERS + 16)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def waiter() -> int:
            wait = {**headers, "X-Robez-Min-Version": str(10**9)}  # never reached: each waits it all out
            return (await client.post("/v1/tables/demo/lookup", content=body, headers=wait)).status_code

        waiting = [asyncio.create_task(waiter()) for _ in range(WAITERS)]
        await asyncio.sleep(0.5)  # let them arrive; the normal lookups below run while they wait
        normal = []
        for _ in range(NORMAL // 4):
            batch = [client.post("/v1/tables/demo/lookup", content=body, headers=headers) for _ in range(4)]
            normal += [response.status_code for response in await asyncio.gather(*batch)]
        still_waiting = sum(not task.done() for task in waiting)
        return [await task for task in waiting], normal, still_waiting


def test_waiting_lookups_leave_the_slots_to_the_others(tmp_path: Path) -> None:
    with serve(
        tmp_path, min_version_wait_ms=str(WAIT_MS), max_in_flight="64", max_version_waiters="32"
    ) as server:
        waited, normal, still_waiting = asyncio.run(_run(server.url))
    assert still_waiting > 0, "the normal lookups must have run while lookups waited"
    assert normal.count(200) >= 0.99 * len(normal), sorted(set(normal))
    assert waited == [503] * WAITERS  # each either waited its 10 s out or was refused at once
