"""Replicas at production sizes and under faults: pushes over NATS's default 1 MiB message, the 413 of a
push over one log entry and the client's split, a stalled applier seen in the lag metrics, a hung (SIGSTOP)
NATS node that writes get past, and ``/readyz?writes=true`` without a quorum.

Real ``nats-server`` and ``robez serve --nats`` processes on loopback, stopped by pid; a frozen node is
always thawed. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator

import httpx
import nats
import pytest
import torch

from devtools.natscluster import NatsCluster, NatsNode
from robez_core.config import OptimizerConfig, TableConfig
from robez_core.table import Table
from service.client import OCTET_STREAM, SHAPE_HEADER, RobezClient, encode_update
from service.log.state_digest import digest_of_table

from .conftest import ADAM, ReplicaServer, push_grads, running_cluster, stream_bounds, stream_leader

pytestmark = pytest.mark.slow

WIDE = {"num_embeddings": 100_000, "embedding_dim": 128, "memory_size": 1 << 16, "chunk_size": 8}
SMALL_MAX_PAYLOAD = 64 * 1024


def create(server: ReplicaServer, table: str, config: dict[str, int]) -> None:
    payload = {"name": table, "config": config, "optimizer": ADAM}
    response = httpx.post(f"{server.url}/v1/tables", json=payload, timeout=30)
    assert response.status_code == 201, response.text


def wide_push(seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, WIDE["num_embeddings"], (rows,), generator=generator)
    return ids, torch.randn(rows, WIDE["embedding_dim"], generator=generator)


def push(
    server: ReplicaServer, table: str, seed: int, key: str | None = None, timeout: float = 30
) -> httpx.Response:
    ids, grads = push_grads(seed)
    body, shape = encode_update(ids, grads)
    headers = {"Content-Type": OCTET_STREAM, SHAPE_HEADER: shape, "Idempotency-Key": key or uuid.uuid4().hex}
    return httpx.post(
        f"{server.url}/v1/tables/{table}/update", content=body, headers=headers, timeout=timeout
    )


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll until ``condition()``; returns the seconds it took."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"not within {timeout_s} s: {what}"
        time.sleep(0.1)
    return time.monotonic() - start


def gauge(server: ReplicaServer, name: str, table: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    found = re.search(rf'^{name}{{table="{table}"}} (\S+)$', text, re.MULTILINE)
    return float(found[1]) if found else -1.0


def write_ready(server: ReplicaServer) -> httpx.Response:
    return httpx.get(f"{server.url}/readyz", params={"writes": "true"}, timeout=10)


def lead_elsewhere(cluster: NatsCluster, table: str, node: NatsNode) -> None:
    """Make another node lead the table's stream (the leader's own failure is a Raft election, tested
    with kill -9 in test_replicas.py; here the node a replica is connected to hangs)."""

    async def step_down() -> None:
        nc = await nats.connect(servers=cluster.urls, **cluster.connect_options())
        try:
            js = nc.jetstream(timeout=5)
            for info in await js.streams_info():
                if (info.config.name or "").startswith(f"t_{table}_"):
                    await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{info.config.name}", b"", timeout=5)
        finally:
            await nc.close()

    for _ in range(5):
        if stream_leader(cluster, "t", table) != node.name:
            return
        asyncio.run(step_down())
        wait_for(lambda: stream_leader(cluster, "t", table) not in ("", "None"), 15, "a new stream leader")
    raise AssertionError(f"{node.name} stays the leader of {table}")


def node_of(cluster: NatsCluster, server: ReplicaServer) -> NatsNode:
    """The NATS node the replica's worker is connected to now (its /readyz names it)."""
    address = write_ready(server).json()["log_server"]
    (node,) = [node for node in cluster.nodes if address == f"127.0.0.1:{node.client_port}"]
    return node


@contextlib.contextmanager
def frozen(cluster: NatsCluster, *nodes: NatsNode) -> Iterator[None]:
    try:
        for node in nodes:
            cluster.freeze(node)
        yield
    finally:
        for node in nodes:
            cluster.thaw(node)


@contextlib.contextmanager
def table_lock_held(server: ReplicaServer, table: str) -> Iterator[None]:
    """Hold the table's update lock (the flock its applier takes for every apply, a snapshot copy for
    the whole copy) from this process: the replica's applier blocks in its next apply, as it does behind
    a long copy, while the rest of the replica keeps answering."""
    (registry,) = (server.workdir / "shm").glob("robez-*/registry.json")
    lock_id = json.loads(registry.read_text())["tables"][table]["lock"]
    fd = os.open(registry.parent / "locks" / f"{lock_id}.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


# -- sizes ------------------------------------------------------------------------------------------


def test_push_of_4096_x_128_is_applied_on_both_replicas(replicas: list[ReplicaServer]) -> None:
    """2,129,920 bytes: twice NATS's default max_payload, inside the 8 MiB robez ships."""
    table = "wide"
    create(replicas[0], table, WIDE)
    ids, grads = wide_push(1, 4096)
    with RobezClient(replicas[1].url) as client:
        assert client.update(table, ids, grads) == 1
    replicas[0].wait_version(table, 1)
    assert replicas[0].checksum(table)["sha256"] == replicas[1].checksum(table)["sha256"]


@pytest.fixture(scope="module")
def small_limit_replica(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[NatsCluster, ReplicaServer]]:
    """One NATS node taking messages of at most 64 KiB, and one replica on it: the limit is cheap to hit."""
    directory = tmp_path_factory.mktemp("small-limit")
    with running_cluster(directory / "nats", 1, max_payload=SMALL_MAX_PAYLOAD) as cluster:
        server = ReplicaServer("s", cluster, directory, "small", ROBEZ_NATS_REPLICAS=1)
        try:
            server.start().wait_ready()
            yield cluster, server
        finally:
            server.stop()


def test_push_over_one_log_entry_is_refused_before_publishing(
    small_limit_replica: tuple[NatsCluster, ReplicaServer],
) -> None:
    cluster, server = small_limit_replica
    table = "limit"
    create(server, table, WIDE)
    ids, grads = wide_push(2, 256)  # 133,120 bytes
    body, shape = encode_update(ids, grads)
    headers = {"Content-Type": OCTET_STREAM, SHAPE_HEADER: shape}
    response = httpx.post(f"{server.url}/v1/tables/{table}/update", content=body, headers=headers, timeout=30)
    assert response.status_code == 413, response.text
    assert "Retry-After" not in response.headers
    error = response.json()
    assert error["error_type"] == "UpdateTooLargeError"
    assert "65,536" in error["error"] and "max_payload" in error["error"]
    assert "256 ids x 128" in error["error"] and "133,120 bytes" not in error["error"]  # headers counted
    hint = int(response.headers["X-Robez-Max-Update-Bytes"])
    assert 60_000 < hint < SMALL_MAX_PAYLOAD
    assert f"at most {hint // (8 + 4 * 128)} ids fit" in error["error"]
    assert stream_bounds(cluster, "small", table)[1] == 0  # nothing reached the log
    assert server.version(table) == 0


def test_client_splits_a_push_over_the_limit_and_every_part_applies(
    small_limit_replica: tuple[NatsCluster, ReplicaServer],
) -> None:
    _, server = small_limit_replica
    table = "split"
    create(server, table, WIDE)
    ids, grads = wide_push(3, 300)
    with RobezClient(server.url) as client:
        version = client.update(table, ids, grads)
        assert client.max_update_bytes is not None
        per_part = client.max_update_bytes // (8 + 4 * 128)
    parts = -(-300 // per_part)
    assert parts >= 3 and version == parts
    expected = Table(TableConfig.from_dict(WIDE), OptimizerConfig.from_dict(ADAM))
    for start in range(0, 300, per_part):
        expected.apply_gradients(ids[start : start + per_part], grads[start : start + per_part])
    digest = digest_of_table(expected)
    checksum = server.checksum(table)
    assert (checksum["version"], checksum["sha256"]) == (parts, digest)


def test_a_multi_table_push_with_a_part_over_the_limit_stores_each_part_once(
    small_limit_replica: tuple[NatsCluster, ReplicaServer],
) -> None:
    """The 413 comes before any part is published: the client's split resends every part under new
    keys, so a part stored before the 413 would be applied twice."""
    _, server = small_limit_replica
    small, big = "many_small", "many_big"
    for table in (small, big):
        create(server, table, WIDE)
    with RobezClient(server.url) as client:
        versions = client.update_many({small: wide_push(4, 16), big: wide_push(5, 300)})
    assert server.version(small) == versions[small] == 1
    assert server.version(big) == versions[big] >= 3  # in parts of what fits


# -- health -----------------------------------------------------------------------------------------


def test_a_stalled_applier_shows_in_the_lag_metrics(replicas: list[ReplicaServer]) -> None:
    """Replica a's applier blocks on the table's lock while pushes go through b: a's lag in versions
    and in seconds grows at once, and returns to 0 when it applies again."""
    a, b = replicas
    table = "stall"
    create(b, table, WIDE | {"embedding_dim": 8})
    assert push(b, table, 1).status_code == 200
    a.wait_version(table, 1)
    wait_for(lambda: gauge(a, "robez_replication_lag_versions", table) == 0.0, 15, "lag 0 before the stall")
    with table_lock_held(a, table):
        for seed in (2, 3, 4):
            assert push(b, table, seed).status_code == 200
        wait_for(lambda: gauge(a, "robez_replication_lag_versions", table) == 3.0, 15, "a's lag of 3")
        wait_for(lambda: gauge(a, "robez_replication_lag_seconds", table) >= 1.0, 15, "a's lag in seconds")
        assert a.version(table) == 1  # it really is stalled, and still answers
        assert gauge(b, "robez_replication_lag_versions", table) == 0.0
    a.wait_version(table, 4)
    wait_for(lambda: gauge(a, "robez_replication_lag_versions", table) == 0.0, 15, "a caught up")
    wait_for(lambda: gauge(a, "robez_replication_lag_seconds", table) == 0.0, 15, "a caught up (s)")
    assert a.checksum(table) == b.checksum(table)


def test_writes_get_past_a_hung_nats_node_and_readyz_tells_a_lost_quorum(
    replicas_nats: NatsCluster, replicas: list[ReplicaServer]
) -> None:
    """SIGSTOP of the node replica a is connected to (not the stream's leader): a push through a
    succeeds within 10 s (pings notice the hung server, the publish is resent on the new connection).
    Then two of three nodes hung: a's /readyz?writes=true turns 503 (no quorum acknowledges its write
    check) while /readyz stays 200, and turns back once they run again."""
    nats_cluster = replicas_nats  # the replicas' own cluster: nodes are frozen
    a, _ = replicas
    table = "hung"
    create(a, table, WIDE | {"embedding_dim": 8})
    assert push(a, table, 1).status_code == 200
    victim = node_of(nats_cluster, a)
    lead_elsewhere(nats_cluster, table, victim)
    with frozen(nats_cluster, victim):
        frozen_at = time.monotonic()
        key, acked, tries = uuid.uuid4().hex, None, []
        while acked is None and time.monotonic() - frozen_at < 30:
            try:
                response = push(a, table, 2, key=key)
            except httpx.HTTPError as exc:
                tries.append((round(time.monotonic() - frozen_at, 2), repr(exc)))
                continue
            tries.append((round(time.monotonic() - frozen_at, 2), response.headers.get("Server-Timing")))
            if response.status_code == 200:
                acked = time.monotonic() - frozen_at
            else:
                assert response.status_code == 503, response.text
        assert acked is not None and acked <= 10.0, f"a push after the freeze: {tries}"
        assert node_of(nats_cluster, a) is not victim
    assert push(a, table, 3).json()["version"] == 3
    others = [node for node in nats_cluster.nodes if node is not node_of(nats_cluster, a)]
    with frozen(nats_cluster, *others):
        wait_for(lambda: write_ready(a).status_code == 503, 15, "writes=true 503 without a quorum")
        assert httpx.get(f"{a.url}/readyz", timeout=10).status_code == 200
    wait_for(lambda: write_ready(a).status_code == 200, 30, "writes=true 200 with the quorum back")
    assert push(a, table, 4, timeout=60).status_code == 200
