"""JetStreamLog against interleavings that timing makes rare, forced here on a real 1-node JetStream.

- A replacing snapshot upload publishes the new object's chunks, then its meta, then purges the old
  chunks. A reader that read the old meta just before subscribes to chunks that are gone: it must notice
  the replacement and read the new object, not wait forever (nats-py's ``ObjectStore.get`` has no timeout).
- nats-py's catalog watcher may announce the end of the initial values (its ``None`` update) before the
  existing entries arrive. ``watch_tables`` must still replay every table before its ``initial_done``:
  a replica that believed the catalog empty was ready with no tables, and dropped its tables when the
  watch restarted. ``table_names`` ends at the same place.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from devtools.natscluster import NatsCluster
from service.replication.jetstream import JetStreamLog
from service.replication.log import CatalogEntry, CatalogEvent, Snapshot

pytestmark = pytest.mark.slow

ENTRY = CatalogEntry("race", {}, {}, "inc1")


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def _file(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_snapshot_replaced_between_meta_and_chunks_is_read_again(
    single_nats: NatsCluster, tmp_path: Path
) -> None:
    """The upload of snapshot 20 lands after the reader read the meta of snapshot 10 and before it
    subscribed to its chunks: the reader returns snapshot 20, byte for byte, within a bounded time."""
    old, new = b"old" * 700_000, b"new" * 800_000  # several 1 MiB chunks each

    async def scenario() -> tuple[Snapshot | None, int]:
        reader = JetStreamLog(
            single_nats.urls, replicas=1, prefix="race1", timeout_s=5, auth=single_nats.auth()
        )
        writer = JetStreamLog(
            single_nats.urls, replicas=1, prefix="race1", timeout_s=5, auth=single_nats.auth()
        )
        await reader.connect()
        await writer.connect()
        try:
            assert await writer.put_snapshot(ENTRY, Snapshot(10, _file(tmp_path, "old", old)))
            original = reader.obs.get_info
            replaced: list[int] = []

            async def get_info_then_replace(*args: Any, **kwargs: Any) -> Any:
                info = await original(*args, **kwargs)
                if not replaced:  # the first meta read: the old object; now it is replaced
                    replaced.append(1)
                    assert await writer.put_snapshot(ENTRY, Snapshot(20, _file(tmp_path, "new", new)))
                return info

            reader.obs.get_info = get_info_then_replace  # type: ignore[method-assign]
            got = await asyncio.wait_for(reader.get_snapshot(ENTRY, tmp_path), 30)
            return got, len(replaced)
        finally:
            await reader.close()
            await writer.close()

    got, replacements = _run(scenario())
    assert replacements == 1
    assert got is not None and got.position == 20 and got.path.read_bytes() == new
    assert {path.name for path in tmp_path.iterdir()} == {"new", "old", got.path.name}  # the first removed


def test_snapshot_read_without_replacement(single_nats: NatsCluster, tmp_path: Path) -> None:
    """No concurrent upload: the stored snapshot, its position, and None where there is none."""

    data = bytes(range(256)) * 1000

    async def scenario() -> tuple[Snapshot | None, Snapshot | None]:
        log = JetStreamLog(single_nats.urls, replicas=1, prefix="race2", timeout_s=5, auth=single_nats.auth())
        await log.connect()
        try:
            missing = await log.get_snapshot(ENTRY, tmp_path)
            assert await log.put_snapshot(ENTRY, Snapshot(7, _file(tmp_path, "source", data)))
            return missing, await log.get_snapshot(ENTRY, tmp_path)
        finally:
            await log.close()

    missing, got = _run(scenario())
    assert missing is None
    assert got is not None and got.position == 7 and got.path.read_bytes() == data


class _MarkerFirst:
    """A catalog watcher whose first update is nats-py's end-of-replay marker, ahead of the entries."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.marker_sent = False

    async def updates(self, timeout: float) -> Any:
        if not self.marker_sent:
            self.marker_sent = True
            return None
        return await self.inner.updates(timeout=timeout)

    async def stop(self) -> None:
        await self.inner.stop()


async def _replay(log: JetStreamLog) -> list[CatalogEvent]:
    """The events of one watch up to and including its ``initial_done``."""
    events: list[CatalogEvent] = []
    watch = log.watch_tables()
    try:
        async for event in watch:
            events.append(event)
            if event.initial_done:
                return events
    finally:
        await watch.aclose()
    raise AssertionError("the watch ended")


def test_catalog_replay_ends_after_the_existing_tables_even_if_the_marker_comes_first(
    single_nats: NatsCluster,
) -> None:
    async def scenario() -> tuple[list[CatalogEvent], list[CatalogEvent], list[CatalogEvent]]:
        log = JetStreamLog(single_nats.urls, replicas=1, prefix="race3", timeout_s=5, auth=single_nats.auth())
        await log.connect()
        try:
            empty = await asyncio.wait_for(_replay(log), 10)
            assert await asyncio.wait_for(log.table_names(), 10) == []
            for name in ("t1", "t2", "t3"):
                await log.create_table(name, {"n": 1}, {"name": "adam"})
            await log.drop_table("t2")
            plain = await asyncio.wait_for(_replay(log), 10)
            watchall = log.kv.watchall

            async def marker_first(*args: Any, **kwargs: Any) -> Any:
                return _MarkerFirst(await watchall(*args, **kwargs))

            log.kv.watchall = marker_first  # type: ignore[method-assign]
            early = await asyncio.wait_for(_replay(log), 10)
            # table_names ends where the replay ends (kv.keys() stops at the marker: [] here).
            assert await asyncio.wait_for(log.table_names(), 10) == ["t1", "t3"]
            return empty, plain, early
        finally:
            await log.close()

    empty, plain, early = _run(scenario())
    assert [event.initial_done for event in empty] == [True]
    for events in (plain, early):
        assert events[-1].initial_done
        live = {event.name for event in events[:-1] if event.entry is not None}
        dropped = {event.name for event in events[:-1] if event.entry is None}
        assert (live, dropped) == ({"t1", "t3"}, {"t2"})
