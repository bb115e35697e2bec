"""Reading the Object Store snapshot while another replica replaces it (JetStreamLog.get_snapshot), on a
real 1-node JetStream: the interleaving is forced, not left to timing.

A replacing upload publishes the new object's chunks, then its meta, then purges the old chunks. A reader
that read the old meta just before subscribes to chunks that are gone: it must notice the replacement
and read the new object, not wait forever (nats-py's ``ObjectStore.get`` has no timeout)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.replication.jetstream import JetStreamLog
from service.replication.log import CatalogEntry, Snapshot
from service.replication.natscluster import NatsCluster

pytestmark = pytest.mark.slow

ENTRY = CatalogEntry("race", {}, {}, "inc1")


@pytest.fixture(scope="module")
def single_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    cluster = NatsCluster(tmp_path_factory.mktemp("nats1"), size=1)
    try:
        cluster.start()
        cluster.wait_for_jetstream()
        yield cluster
    finally:
        cluster.stop()


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_snapshot_replaced_between_meta_and_chunks_is_read_again(single_nats: NatsCluster) -> None:
    """The upload of snapshot 20 lands after the reader read the meta of snapshot 10 and before it
    subscribed to its chunks: the reader returns snapshot 20, byte for byte, within a bounded time."""

    async def scenario() -> tuple[Snapshot | None, int]:
        reader = JetStreamLog(single_nats.urls, replicas=1, prefix="race1", timeout_s=5)
        writer = JetStreamLog(single_nats.urls, replicas=1, prefix="race1", timeout_s=5)
        await reader.connect()
        await writer.connect()
        try:
            old, new = b"old" * 50_000, b"new" * 60_000  # several 128 KiB chunks each
            await writer.put_snapshot(ENTRY, Snapshot(10, old))
            original = reader.obs.get_info
            replaced: list[int] = []

            async def get_info_then_replace(*args: Any, **kwargs: Any) -> Any:
                info = await original(*args, **kwargs)
                if not replaced:  # the first meta read: the old object; now it is replaced
                    replaced.append(1)
                    await writer.put_snapshot(ENTRY, Snapshot(20, new))
                return info

            reader.obs.get_info = get_info_then_replace  # type: ignore[method-assign]
            got = await asyncio.wait_for(reader.get_snapshot(ENTRY), 30)
            assert got is not None and got.data == new
            return got, len(replaced)
        finally:
            await reader.close()
            await writer.close()

    got, replacements = _run(scenario())
    assert replacements == 1
    assert got is not None and got.position == 20


def test_snapshot_read_without_replacement(single_nats: NatsCluster, tmp_path: Path) -> None:
    """No concurrent upload: the stored snapshot, its position, and None where there is none."""

    async def scenario() -> tuple[Snapshot | None, Snapshot | None]:
        log = JetStreamLog(single_nats.urls, replicas=1, prefix="race2", timeout_s=5)
        await log.connect()
        try:
            missing = await log.get_snapshot(ENTRY)
            data = bytes(range(256)) * 1000
            await log.put_snapshot(ENTRY, Snapshot(7, data))
            return missing, await log.get_snapshot(ENTRY)
        finally:
            await log.close()

    missing, got = _run(scenario())
    assert missing is None
    assert got == Snapshot(7, bytes(range(256)) * 1000)
