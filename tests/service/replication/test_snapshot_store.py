"""The snapshot store on a real 1-node JetStream: one object per table, no chunk outliving its object.

- the upload lease: one holder at a time; a holder that stops renewing (frozen) loses it after its TTL,
  and its late upload is purged instead of replacing the snapshot stored meanwhile;
- chunks an upload killed half-way left behind are purged by the next upload that commits; a cancelled
  upload purges its own; dropping the table purges every chunk of it;
- after many uploads the bucket holds exactly one object's chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from typing import Any

import pytest

from devtools.natscluster import NatsCluster
from robez_core.errors import ConflictError
from service.faults import Faults
from service.replication.jetstream import JetStreamLog
from service.replication.log import CatalogEntry, Snapshot
from service.replication.objects import SNAPSHOT_CHUNK_BYTES

pytestmark = pytest.mark.slow


def _file(tmp_path: Path, name: str, chunks: float) -> Path:
    path = tmp_path / name
    path.write_bytes(os.urandom(int(chunks * SNAPSHOT_CHUNK_BYTES)))
    return path


async def _chunk_messages(log: JetStreamLog) -> dict[str, int]:
    """Chunk messages per subject in the snapshot bucket's stream (meta messages left out)."""
    stream = f"OBJ_{log.prefix}_snapshots"
    info = await log.js.stream_info(stream, subjects_filter=f"$O.{log.prefix}_snapshots.C.>")
    return dict(info.state.subjects or {})


@contextlib.asynccontextmanager
async def _connected(cluster: NatsCluster, prefix: str, **options: Any) -> Any:
    log = JetStreamLog(
        cluster.urls, replicas=1, prefix=prefix, timeout_s=5, **{"auth": cluster.auth(), **options}
    )
    await log.connect()
    try:
        yield log
    finally:
        await log.close()


def test_lease_is_exclusive_and_a_frozen_holder_loses_it(single_nats: NatsCluster, tmp_path: Path) -> None:
    """B cannot lease while A holds; A stops renewing (as a frozen process would): after the TTL B leases
    and stores snapshot 20; A's late upload of 30 is refused and leaves no chunk."""
    entry = CatalogEntry("leased", {}, {}, "inc1")

    async def scenario() -> None:
        async with (
            _connected(single_nats, "lease", lease_ttl_s=1.5) as a,
            _connected(single_nats, "lease", lease_ttl_s=1.5) as b,
        ):
            held = await a.lease_snapshot(entry, "a")
            assert held is not None and held.stored_position == 0
            assert await b.lease_snapshot(entry, "b") is None
            await held.release()
            again = await b.lease_snapshot(entry, "b")
            assert again is not None
            await again.release()

            frozen = await a.lease_snapshot(entry, "a")
            assert frozen is not None
            assert frozen._keeper is not None
            frozen._keeper.cancel()  # no renewal from here on
            deadline = asyncio.get_running_loop().time() + 15
            while (taken := await b.lease_snapshot(entry, "b")) is None:
                assert asyncio.get_running_loop().time() < deadline, "the lease never expired"
                await asyncio.sleep(0.25)
            assert await taken.put(Snapshot(20, _file(tmp_path, "s20", 2.5)))
            await taken.release()
            with pytest.raises(ConflictError):
                await frozen.put(Snapshot(30, _file(tmp_path, "s30", 3.5)))
            await frozen.release()
            chunks = await _chunk_messages(a)
            assert sum(chunks.values()) == 3, chunks  # snapshot 20's three chunks, nothing of 30
            assert await a.snapshot_position(entry) == 20

    asyncio.run(scenario())


def test_no_chunk_outlives_its_object(single_nats: NatsCluster, tmp_path: Path) -> None:
    """Chunks left by an upload killed half-way, the previous objects' chunks and a cancelled upload's
    chunks are all purged; after many uploads the bucket holds one object; a drop purges everything."""

    async def scenario() -> None:
        async with _connected(single_nats, "purge") as log:
            entry = await log.create_table("purged", {"n": 1}, {"name": "adam"})
            orphan = f"$O.purge_snapshots.C.purged.{entry.incarnation}.killed"
            for _ in range(3):  # what an uploader killed after 3 chunks leaves
                await log.js.publish(orphan, b"x" * 1000, stream="OBJ_purge_snapshots")
            for position in range(1, 6):
                assert await log.put_snapshot(entry, Snapshot(position, _file(tmp_path, f"s{position}", 2.2)))
                chunks = await _chunk_messages(log)
                assert list(chunks.values()) == [3], chunks  # this object's 3 chunks, nothing else
            # Not newer than the stored one: not uploaded at all.
            assert not await log.put_snapshot(entry, Snapshot(5, _file(tmp_path, "again", 1)))

            # A slow upload, cancelled once 2 of its chunks are in: 20 chunks, so that the cancel lands
            # before its end however late a loaded machine polls (6 ended before the cancel once, load 4.5).
            log.faults = Faults(snapshot_chunk_delay_s=0.5)
            upload = asyncio.create_task(log.put_snapshot(entry, Snapshot(9, _file(tmp_path, "slow", 20))))
            deadline = asyncio.get_running_loop().time() + 10
            while sum((await _chunk_messages(log)).values()) < 5:  # the slow upload sent 2 chunks
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.1)
            upload.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await upload
            log.faults = Faults()
            assert list((await _chunk_messages(log)).values()) == [3]
            assert await log.snapshot_position(entry) == 5
            # The lease went with the cancelled upload: the next one goes ahead.
            assert await log.put_snapshot(entry, Snapshot(10, _file(tmp_path, "s10", 1.5)))

            await log.drop_table("purged")
            assert sum((await _chunk_messages(log)).values()) == 0
            assert await log.snapshot_position(entry) == 0

    asyncio.run(scenario())
