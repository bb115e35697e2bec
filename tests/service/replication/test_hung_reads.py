"""Catalog reads on a hung (SIGSTOPped) NATS node: a call a user waits on fails over like a push does
(the connection's pings notice the hung server, the read is sent again on the new connection) instead of
waiting the whole 10 s request timeout and answering 503. ``benchmarks/replication/hung_node.py`` measures
the same with the stream leader frozen, and NATS's own election time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import nats
import nats.js.errors
import pytest

from devtools.natscluster import NatsCluster, NatsNode
from robez_core.errors import BusyError
from service.replication.jetstream import JetStreamLog

from .conftest import ADAM, SMALL, ReplicaServer, create_table, running_replicas

# The push's failover (pings every 2 s, 2 unanswered: the server is taken for hung after 4-6 s), then a
# new connection and the call sent again, with room for a loaded machine (a fresh clone's suite took 8.1
# s once, beside the kernels' compile); under the 10 s request timeout the read waited whole before
# (and then answered 503), so a call that waits it out still fails here.
FAILOVER_S = 9.5


def _step_down(cluster: NatsCluster, stream: str) -> None:
    async def request() -> None:
        nc = await nats.connect(servers=cluster.urls, **cluster.connect_options())
        try:
            await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", b"", timeout=5)
        finally:
            await nc.close()

    asyncio.run(request())


def _lead_elsewhere(cluster: NatsCluster, node: NatsNode, streams: list[str]) -> None:
    """Move the leadership of each of ``streams`` off ``node`` (its own failure is an election)."""
    deadline = time.monotonic() + 60
    while any(cluster.stream_leaders().get(stream) in (node.name, "", "None", None) for stream in streams):
        assert time.monotonic() < deadline, (
            f"{node.name} stays a leader of {streams}: {cluster.stream_leaders()}"
        )
        for stream in streams:
            if cluster.stream_leaders().get(stream) == node.name:
                _step_down(cluster, stream)
        time.sleep(0.5)


def _timed(call: Callable[[], httpx.Response]) -> tuple[httpx.Response, float]:
    began = time.monotonic()
    response = call()
    return response, time.monotonic() - began


def test_catalog_calls_on_a_hung_node_fail_over_like_a_push(
    replicas_nats: NatsCluster, tmp_path: Path
) -> None:
    """SIGSTOP of the node a replica is connected to (leading neither JetStream's meta group nor any
    stream of the replica's: their elections are NATS's own, measured by the benchmark), then two catalog
    calls at once through the replica, each answered within the failover time, through another node: a
    drop (which starts by reading the catalog) and a create (the new table's stream, then its catalog
    entry: requests sent again on the new connection, without making the table twice). The replica is
    given that node's URL alone (it learns the others from it), so that it is connected there."""
    cluster = replicas_nats
    meta = cluster.meta_leader()
    assert meta, "no node logged a meta leader"
    victim = next(node for node in cluster.nodes if node.name != meta)
    server = ReplicaServer("hung", cluster, tmp_path, "hung")
    server.args[server.args.index("--nats") + 1] = victim.url
    with running_replicas([server]):
        table = "hungread"
        create_table(server, table)
        ready = httpx.get(f"{server.url}/readyz", params={"writes": "true"}, timeout=10).json()
        assert ready["log_server"] == f"127.0.0.1:{victim.client_port}", ready
        _lead_elsewhere(cluster, victim, [stream for stream in cluster.stream_leaders() if "hung_" in stream])
        assert cluster.meta_leader() != victim.name
        payload = {"name": "hungmade", "config": SMALL, "optimizer": ADAM}
        cluster.freeze(victim)
        try:
            with ThreadPoolExecutor(2) as pool:
                dropping = pool.submit(
                    _timed, lambda: httpx.delete(f"{server.url}/v1/tables/{table}", timeout=30)
                )
                creating = pool.submit(
                    _timed, lambda: httpx.post(f"{server.url}/v1/tables", json=payload, timeout=30)
                )
                (dropped, drop_s), (created, create_s) = dropping.result(), creating.result()
        finally:
            cluster.thaw(victim)
        assert dropped.status_code == 204, f"{dropped.status_code} after {drop_s:.1f} s: {dropped.text}"
        assert drop_s <= FAILOVER_S, f"the drop took {drop_s:.1f} s on a hung node"
        assert created.status_code == 201, f"{created.status_code} after {create_s:.1f} s: {created.text}"
        assert create_s <= FAILOVER_S, f"the create took {create_s:.1f} s on a hung node"
        tables = httpx.get(f"{server.url}/v1/tables", timeout=10).json()["tables"]
        assert [entry["name"] for entry in tables] == ["hungmade"], tables


def test_a_catalog_write_sent_twice_is_stored_once(replicas_nats: NatsCluster) -> None:
    """What makes sending a catalog write again safe (its answer lost on a hung node, the first one
    stored): a second write with the same message id is acknowledged as the first one was, even though
    the revision it expects has moved on (JetStream checks duplicates first), and stores nothing."""

    async def scenario() -> None:
        log = JetStreamLog(
            replicas_nats.urls, replicas=3, prefix="twice", timeout_s=10, auth=replicas_nats.auth()
        )
        deadline = time.monotonic() + 60
        while True:  # as a replica does: JetStream answers 503 for a moment after an election
            try:
                await log.connect()
                break
            except BusyError:
                assert time.monotonic() < deadline, "the shared cluster's JetStream stayed unavailable"
                await asyncio.sleep(0.5)
        try:
            await log._catalog_write("t", b"first", 0, "create.a")
            stored = await log.kv.get("t")
            await log._catalog_write("t", b"first", 0, "create.a")  # the same write: acknowledged
            assert (await log.kv.get("t")).revision == stored.revision
            with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
                await log._catalog_write("t", b"other", 0, "create.b")  # another create: refused
            await log._catalog_write("t", b"", int(stored.revision or 0), "drop.a", delete=True)
            await log._catalog_write("t", b"", int(stored.revision or 0), "drop.a", delete=True)
            with pytest.raises(nats.js.errors.KeyNotFoundError):
                await log.kv.get("t")
            # Created again over the delete marker, as the catalog does for a table dropped before.
            entry = await log.create_table("t", {"n": 1}, {})
            assert (await log.get_table("t")) == entry
        finally:
            await log.close()

    asyncio.run(scenario())
