"""Entries no replica can apply, and loads through the log, on a real 3-node NATS cluster.

Forged entries are published straight to a table's subject with nats-py (as anyone who can reach NATS
could): each is applied as an empty version on every replica alike (same version, same bytes, the skip
counted with its reason and logged once), a restarted replica skips them the same way, and later pushes
are applied. A checkpoint loaded through one replica is seen bitwise on the other; its object is deleted
once a snapshot past it exists.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import pytest
import torch

from devtools.natscluster import NatsCluster
from robez_core.config import OptimizerConfig, TableConfig
from robez_core.table import Table
from service.client import OCTET_STREAM, SHAPE_HEADER, encode_update
from service.log.state_digest import digest_of_table
from service.replication.records import KIND, LR, OBJECT, SHA256, SHAPE
from service.wal import read_checkpoint

from .conftest import (
    SMALL,
    ReplicaServer,
    create_table,
    push_grads,
    replay_checksum,
    running_replicas,
    stream_bounds,
)

pytestmark = pytest.mark.slow

PREFIX = "sk"
SGD = {"name": "sgd", "lr": 0.01}
SNAPSHOT_EVERY = 12


@pytest.fixture(scope="module")
def pair(
    nats_cluster: NatsCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[ReplicaServer]]:
    """Two replicas that upload a snapshot every few updates and keep one entry below it, so a loaded
    checkpoint's entry is trimmed away soon after."""
    workdir = tmp_path_factory.mktemp("skips")
    env = {"ROBEZ_REPLICA_SNAPSHOT_EVERY_UPDATES": SNAPSHOT_EVERY, "ROBEZ_REPLICA_TRIM_KEEP": 1}
    with running_replicas(
        [ReplicaServer(name, nats_cluster, workdir, PREFIX, **env) for name in ("a", "b")]
    ) as servers:
        yield servers


def push(server: ReplicaServer, table: str, seed: int) -> int:
    ids, grads = push_grads(seed)
    body, shape = encode_update(ids, grads)
    headers = {"Content-Type": OCTET_STREAM, SHAPE_HEADER: shape}
    response = httpx.post(f"{server.url}/v1/tables/{table}/update", content=body, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    return int(response.json()["version"])


def _with_nats(cluster: NatsCluster, work):  # type: ignore[no-untyped-def]
    async def run():  # type: ignore[no-untyped-def]
        nc = await nats.connect(servers=cluster.urls, **cluster.connect_options())
        try:
            return await work(nc.jetstream(timeout=10))
        finally:
            await nc.close()

    return asyncio.run(run())


def forge(cluster: NatsCluster, table: str, entries: list[tuple[bytes, dict[str, str]]]) -> None:
    """Publish ``entries`` (payload, headers) straight to the table's log subject."""

    async def work(js):  # type: ignore[no-untyped-def]
        kv = await js.key_value(f"{PREFIX}_tables")
        incarnation = json.loads((await kv.get(table)).value)["incarnation"]
        for payload, headers in entries:
            await js.publish(f"{PREFIX}.u.{table}.{incarnation}", payload, headers=headers or None)

    _with_nats(cluster, work)


def load_objects(cluster: NatsCluster, table: str) -> list[str]:
    async def work(js):  # type: ignore[no-untyped-def]
        store = await js.object_store(f"{PREFIX}_snapshots")
        try:
            listed = await store.list(ignore_deletes=True)
        except nats.js.errors.NotFoundError:
            return []
        return [info.name for info in listed if info.name.startswith(f"load.{table}.")]

    return list(_with_nats(cluster, work))


def skips(server: ReplicaServer, table: str) -> dict[str, float]:
    """reason -> robez_replication_skipped_total of ``table`` on ``server``."""
    found: dict[str, float] = {}
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("robez_replication_skipped_total{") and f'table="{table}"' in line:
            reason = re.search(r'reason="([a-z_]+)"', line)
            assert reason is not None, line
            found[reason.group(1)] = float(line.rsplit(" ", 1)[1])
    return found


def update_entry(ids: list[int], grads: torch.Tensor, lr: float) -> tuple[bytes, dict[str, str]]:
    payload = torch.tensor(ids, dtype=torch.int64).numpy().tobytes() + grads.numpy().tobytes()
    return payload, {SHAPE: f"{len(ids)},{grads.shape[1]}", LR: lr.hex()}


def checkpoint_of(seeds: list[int]) -> tuple[bytes, str]:
    """A robez checkpoint of a SMALL adam table after the pushes ``seeds``, and its checksum."""
    table = Table(TableConfig.from_dict(SMALL), OptimizerConfig.from_dict({"name": "adam", "lr": 0.01}))
    for seed in seeds:
        table.apply_gradients(*push_grads(seed))
    path = Path(f"/tmp/robez-test-load-{time.monotonic_ns()}.safetensors")
    try:
        table.save(path)
        return path.read_bytes(), replay_checksum(seeds)
    finally:
        path.unlink(missing_ok=True)


def checksum_of(checkpoint: bytes) -> str:
    """The /checksum digest of a table downloaded as a robez checkpoint."""
    table, _ = read_checkpoint(checkpoint, format="robez")
    return digest_of_table(table)


def converged(servers: list[ReplicaServer], table: str, version: int) -> str:
    """Both replicas at ``version`` with one checksum; returns it."""
    sums = set()
    for server in servers:
        server.wait_version(table, version)
        checksum = server.checksum(table)
        assert checksum["version"] == version, server.name
        sums.add(checksum["sha256"])
    assert len(sums) == 1, f"replicas diverged at version {version}"
    return sums.pop()


def test_forged_entries_are_empty_versions_on_every_replica(
    pair: list[ReplicaServer], nats_cluster: NatsCluster
) -> None:
    a, b = pair
    table = "forged"
    create_table(a, table, SGD)
    assert push(a, table, 1) == 1
    ones = torch.ones(2, SMALL["embedding_dim"])
    good_payload, good_headers = update_entry([1, 2], ones, 0.01)
    forged = [
        update_entry([1, 2], ones, -5.0),
        update_entry([1, 2], ones, float("nan")),
        (good_payload, {SHAPE: good_headers[SHAPE]}),  # no lr
        (good_payload[:-3], good_headers),  # truncated
        update_entry([1, 2], torch.tensor([[float("inf")] * 8, [0.0] * 8]), 0.01),
        update_entry([1, 2], torch.full((2, 8), 3e38), 1000.0),  # lr x gradient overflows float32
        (b"", {KIND: "load", OBJECT: f"load.{table}.nothing", SHA256: "0" * 64}),
    ]
    forge(nats_cluster, table, forged)
    expected = {
        "bad_lr": 2.0,
        "bad_headers": 1.0,
        "bad_payload": 1.0,
        "bad_grads": 1.0,
        "non_finite_step": 1.0,
        "load_missing": 1.0,
    }
    after_forged = 1 + len(forged)
    sha = converged(pair, table, after_forged)
    assert sha == replay_checksum([1], SGD)  # nothing of them reached the arrays
    for server in pair:
        assert skips(server, table) == expected, server.name
    # Later pushes go on, through either replica.
    assert push(b, table, 2) == after_forged + 1
    assert converged(pair, table, after_forged + 1) == replay_checksum([1, 2], SGD)
    logged = a.log_path.read_text().count(f"table '{table}': log entry")
    assert logged == len(forged), a.log()  # one warning per skipped entry
    # A replica started again replays the log (no snapshot yet): the same skips, the same bytes.
    b.stop()
    b.start().wait_ready()
    assert converged(pair, table, after_forged + 1) == replay_checksum([1, 2], SGD)
    assert skips(b, table) == expected


def test_a_load_through_one_replica_is_seen_bitwise_on_the_other(
    pair: list[ReplicaServer], nats_cluster: NatsCluster
) -> None:
    a, b = pair
    table = "loaded"
    create_table(a, table)
    for seed in range(3):
        push(a, table, seed)
    data, loaded_sha = checkpoint_of([100, 101, 102])
    # A bad checkpoint is a 4xx on a replica too, and nothing reaches the log.
    before = stream_bounds(nats_cluster, PREFIX, table)
    bad = httpx.post(f"{a.url}/v1/tables/{table}/load?format=robez", content=data[:-10], timeout=30)
    assert 400 <= bad.status_code < 500, bad.text
    assert stream_bounds(nats_cluster, PREFIX, table) == before

    response = httpx.post(f"{a.url}/v1/tables/{table}/load", content=data, timeout=60)
    assert response.status_code == 200, response.text
    version = int(response.json()["version"])
    assert version == 4  # the load entry's position, answered once replica a applied it
    assert converged(pair, table, version) == loaded_sha
    # The state before the load stays downloadable (snapshot + log) until a snapshot is past it.
    previous = httpx.get(f"{b.url}/v1/tables/{table}/checkpoint?version={version - 1}", timeout=60)
    assert previous.status_code == 200, previous.text
    assert previous.headers["X-Robez-Version"] == str(version - 1)
    assert checksum_of(previous.content) == replay_checksum([0, 1, 2])

    # Forged loads naming the real checkpoint with a wrong digest, or another table's name, are skipped.
    [stored] = load_objects(nats_cluster, table)
    forge(
        nats_cluster,
        table,
        [
            (b"", {KIND: "load", OBJECT: stored, SHA256: hashlib.sha256(b"other").hexdigest()}),
            (b"", {KIND: "load", OBJECT: stored.replace(table, "forged"), SHA256: "0" * 64}),
        ],
    )
    assert converged(pair, table, version + 2) == loaded_sha
    for server in pair:
        assert skips(server, table) == {"load_corrupt": 1.0, "load_missing": 1.0}

    # Pushes after the load apply on both, on top of the loaded state.
    assert push(b, table, 5) == version + 3
    assert converged(pair, table, version + 3) == replay_checksum([100, 101, 102, 5])

    # Once a snapshot is past the load entry (and the log trimmed below it), the checkpoint goes.
    for seed in range(10, 10 + SNAPSHOT_EVERY):
        push(a, table, seed)
    deadline = time.monotonic() + 60
    while load_objects(nats_cluster, table):
        assert time.monotonic() < deadline, f"the loaded checkpoint was never deleted:\n{a.log()}"
        time.sleep(0.5)
    assert stream_bounds(nats_cluster, PREFIX, table)[0] > version
    gone = httpx.get(f"{a.url}/v1/tables/{table}/checkpoint?version={version - 1}", timeout=60)
    assert gone.status_code == 409, gone.text


def test_a_load_into_a_new_table_creates_it_on_every_replica(
    pair: list[ReplicaServer], nats_cluster: NatsCluster
) -> None:
    """... and a retry with the same Idempotency-Key (through the other replica) loads once and leaves
    one stored checkpoint, which goes with the table."""
    data, loaded_sha = checkpoint_of([7])
    for server in reversed(pair):
        response = httpx.post(
            f"{server.url}/v1/tables/fromload/load",
            content=data,
            headers={"Idempotency-Key": "k1"},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        assert int(response.json()["version"]) == 1
    assert converged(pair, "fromload", 1) == loaded_sha
    assert len(load_objects(nats_cluster, "fromload")) == 1
    # Dropping the table deletes its loaded checkpoint too.
    assert httpx.delete(f"{pair[0].url}/v1/tables/fromload", timeout=30).status_code == 204
    assert load_objects(nats_cluster, "fromload") == []
