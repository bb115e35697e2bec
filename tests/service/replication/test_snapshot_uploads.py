"""Snapshot uploads of a table of 2**22 floats with Adam (48 MiB of state) on two replicas and a real
3-node JetStream: pushes keep being acknowledged while an upload runs (made slow by a per-chunk delay,
service/faults.py), one replica uploads at a time, the Object Store holds one snapshot's bytes after
uploads by both replicas, a late replica bootstraps from the streamed snapshot, both end bitwise equal to
a private replay, and dropping the table leaves no chunk.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from datetime import datetime
from pathlib import Path

import httpx
import nats
import pytest
import torch

from devtools.natscluster import NatsCluster
from robez_core.config import OptimizerConfig, TableConfig
from robez_core.table import Table
from service import faults
from service.client import OCTET_STREAM, SHAPE_HEADER, encode_update
from service.log.state_digest import digest_of_table

from .conftest import ADAM, ReplicaServer

pytestmark = pytest.mark.slow

CONFIG = {"num_embeddings": 1_000_000, "embedding_dim": 64, "memory_size": 1 << 22, "chunk_size": 8}
EVERY = 20
PREFIX = "up"
SETTINGS = {
    "ROBEZ_REPLICA_SNAPSHOT_EVERY_UPDATES": EVERY,
    "ROBEZ_REPLICA_TRIM_KEEP": 0,
    faults.SNAPSHOT_CHUNK_DELAY_VARIABLE: 0.05,  # ~48 chunks: an upload lasts 2.4 s or more
}
_LINE = re.compile(r"^(\S+ \S+) INFO robez\.replication: table \w+: (.*)$", re.MULTILINE)


def grads_of(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CONFIG["num_embeddings"], (256,), generator=generator)
    return ids, torch.randn(256, CONFIG["embedding_dim"], generator=generator)


def push(server: ReplicaServer, table: str, seed: int) -> tuple[int, float, float]:
    """(version, seconds it took, unix time of the answer)."""
    body, shape = encode_update(*grads_of(seed))
    headers = {"Content-Type": OCTET_STREAM, SHAPE_HEADER: shape, "Idempotency-Key": uuid.uuid4().hex}
    start = time.monotonic()
    response = httpx.post(f"{server.url}/v1/tables/{table}/update", content=body, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    return int(response.json()["version"]), time.monotonic() - start, time.time()


def events(server: ReplicaServer, what: str) -> list[tuple[float, int]]:
    """(unix time, version) of the applier's log lines ``<what> at version V``."""
    found = []
    for stamp, message in _LINE.findall(server.log_path.read_text()):
        matched = re.match(rf"{what} at version (\d+)", message)
        if matched:
            found.append((datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp(), int(matched[1])))
    return found


def obj_stream(cluster: NatsCluster) -> tuple[int, int, int]:
    """(bytes, chunk messages, size of the stored object) of the snapshot bucket's stream."""

    async def read() -> tuple[int, int, int]:
        nc = await nats.connect(servers=cluster.urls, **cluster.connect_options())
        try:
            js = nc.jetstream(timeout=10)
            info = await js.stream_info(
                f"OBJ_{PREFIX}_snapshots", subjects_filter=f"$O.{PREFIX}_snapshots.C.>"
            )
            chunks = sum((info.state.subjects or {}).values())
            store = await js.object_store(f"{PREFIX}_snapshots")
            try:
                objects = [o for o in await store.list() if not o.deleted]
            except nats.js.errors.NotFoundError:
                objects = []
            return int(info.state.bytes), chunks, sum(int(o.size or 0) for o in objects)
        finally:
            await nc.close()

    return asyncio.run(read())


def expected_checksum(seeds: list[int]) -> str:
    table = Table(TableConfig.from_dict(CONFIG), OptimizerConfig.from_dict(ADAM))
    for seed in seeds:
        table.apply_gradients(*grads_of(seed))
    return digest_of_table(table)


def wait_uploaded(servers: list[ReplicaServer], version: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(v >= version for server in servers for _, v in events(server, "snapshot")):
        assert time.monotonic() < deadline, f"no upload at version >= {version}:\n{servers[-1].log()}"
        time.sleep(0.2)


def upload_running(server: ReplicaServer) -> bool:
    """A state the server copied for an upload is not uploaded yet (nor logged as not kept / failed)."""
    log = server.log_path.read_text()
    ended = len(events(server, "snapshot")) + log.count("this one was not kept")
    ended += log.count("snapshot failed")
    return len(events(server, "state")) > ended


def wait_no_upload_running(servers: list[ReplicaServer], timeout_s: float = 60) -> None:
    """Until every state a server copied for an upload was uploaded (or logged as not kept / failed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = [server.name for server in servers if upload_running(server)]
        if not running:
            return
        assert time.monotonic() < deadline, f"uploads still running on {running}"
        time.sleep(0.2)


def test_uploads_run_beside_pushes_and_leave_one_snapshot(nats_cluster: NatsCluster, tmp_path: Path) -> None:
    table = "big"
    a = ReplicaServer("ua", nats_cluster, tmp_path, PREFIX, **SETTINGS).start()
    b = ReplicaServer("ub", nats_cluster, tmp_path, PREFIX, **SETTINGS)
    acked: list[tuple[int, float, float]] = []
    try:
        a.wait_ready()
        payload = {"name": table, "config": CONFIG, "optimizer": ADAM}
        response = httpx.post(f"{a.url}/v1/tables", json=payload, timeout=60)
        assert response.status_code == 201, response.text
        seed = 0
        # 1. A alone: it uploads at EVERY and trims the log below it.
        while seed < EVERY + 5:
            acked.append(push(a, table, seed))
            seed += 1
        wait_uploaded([a], EVERY)
        # 2. B starts after the trim: it can only come from the snapshot (streamed to a file, read into
        #    shared memory), then both take pushes, both triggering uploads at the same versions.
        b.start().wait_ready()
        assert "bootstrapped from the Object Store snapshot" in b.log(), b.log()
        while seed < 4 * EVERY + 5:
            acked.append(push((a, b)[seed % 2], table, seed))
            seed += 1
        # An upload came due in these 3 x EVERY pushes. Which versions are uploaded depends on how long
        # each upload takes: one running when the count comes due again takes the later version, and the
        # other replica, finding the lease taken, leaves that one to it (a loaded machine: 20, 40, 71).
        wait_uploaded([a, b], 2 * EVERY)
        wait_no_upload_running([a, b])
        a.wait_version(table, seed)
        b.wait_version(table, seed)
        assert a.checksum(table)["sha256"] == b.checksum(table)["sha256"]
        # 3. A stops: B alone uploads the next ones (each due within EVERY pushes of B's count, or half
        #    of that past the stored one). Pushed until B copied a newer state and four versions were
        #    uploaded or copied in all (a loaded machine may have uploaded only 20 and 40 so far), at
        #    most 4 x EVERY pushes, none while an upload of B's runs (how many pushes fit in an upload
        #    depends on the machine's speed); then until those uploads ended.
        a.stop()
        uploaded = {v for server in (a, b) for _, v in events(server, "snapshot")}
        stored = max(uploaded)

        def copied_by_b() -> set[int]:
            return {v for _, v in events(b, "state") if v > stored}

        limit = seed + 4 * EVERY
        while not copied_by_b() or len(uploaded | copied_by_b()) < 4:
            assert seed < limit, f"B copied {sorted(copied_by_b())} after {4 * EVERY} pushes:\n{b.log()}"
            if upload_running(b):
                wait_no_upload_running([b])
                continue
            acked.append(push(b, table, seed))
            seed += 1
        wait_uploaded([b], max(copied_by_b()))
        wait_no_upload_running([b])
        # The last upload's purge of the previous object's chunks: one object's chunks left (bounded wait).
        deadline = time.monotonic() + 30
        while True:
            stream_bytes, chunks, object_bytes = obj_stream(nats_cluster)
            if chunks == -(-object_bytes // (1 << 20)) or time.monotonic() > deadline:
                break
            time.sleep(0.1)

        # Pushes were acknowledged while uploads ran, none slower than 3 s.
        slowest = max(seconds for _, seconds, _ in acked)
        assert slowest < 3.0, f"a push took {slowest:.2f} s"
        uploads = {server.name: events(server, "snapshot") for server in (a, b)}
        copies = {server.name: dict((v, t) for t, v in events(server, "state")) for server in (a, b)}
        during = [
            version
            for name, done in uploads.items()
            for end, uploaded in done
            for version, _, when in acked
            if version > uploaded + 1 and copies[name][uploaded] < when < end
        ]
        assert during, f"no push acknowledged during an upload: {uploads} {copies}"
        # One replica per upload: no version uploaded twice, and both replicas uploaded.
        versions = [v for done in uploads.values() for _, v in done]
        assert len(versions) == len(set(versions)) >= 4, uploads
        assert uploads["ua"] and uploads["ub"], uploads
        # One snapshot's bytes in the Object Store, after uploads by both replicas.
        assert object_bytes > 3 * CONFIG["memory_size"] * 4
        assert stream_bytes <= 1.2 * object_bytes, (stream_bytes, object_bytes)
        assert chunks == -(-object_bytes // (1 << 20))
        # Bitwise what a private replay of the acknowledged pushes gives.
        assert b.checksum(table)["sha256"] == expected_checksum(list(range(seed)))

        response = httpx.delete(f"{b.url}/v1/tables/{table}", timeout=30)
        assert response.status_code in (200, 204), response.text
        assert obj_stream(nats_cluster)[1:] == (0, 0)
    finally:
        a.stop()
        b.stop()
