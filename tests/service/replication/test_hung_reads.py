"""Catalog reads on a hung (SIGSTOPped) NATS node: a call a user waits on fails over like a push does
(the connection's pings notice the hung server, the read is sent again on the new connection) instead of
waiting the whole 10 s request timeout and answering 503. ``benchmarks/replication/hung_node.py`` measures
the same with the stream leader frozen, and NATS's own election time."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import nats

from devtools.natscluster import NatsCluster, NatsNode

from .conftest import ReplicaServer, create_table, running_replicas

# The push's failover (pings every 2 s, 2 unanswered: the server is taken for hung after 4-6 s) and some
# room on a loaded machine; the read waited the whole 10 s before, and then answered 503.
FAILOVER_S = 8.0


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


def test_a_catalog_read_on_a_hung_node_fails_over_like_a_push(
    replicas_nats: NatsCluster, tmp_path: Path
) -> None:
    """SIGSTOP of the node a replica is connected to (leading neither JetStream's meta group, nor the
    catalog's stream, nor the table's: their elections are NATS's own, measured by the benchmark), then a
    drop through the replica, which starts by reading the catalog: answered (204) within the failover
    time, through another node. The replica is given that node's URL alone (it learns the others from
    it), so that it is connected there."""
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
        streams = ["KV_hung_tables", *[s for s in cluster.stream_leaders() if s.startswith(f"hung_{table}_")]]
        _lead_elsewhere(cluster, victim, streams)
        assert cluster.meta_leader() != victim.name
        cluster.freeze(victim)
        try:
            began = time.monotonic()
            response = httpx.delete(f"{server.url}/v1/tables/{table}", timeout=30)
            took = time.monotonic() - began
        finally:
            cluster.thaw(victim)
        assert response.status_code == 204, f"{response.status_code} after {took:.1f} s: {response.text}"
        assert took <= FAILOVER_S, f"the drop took {took:.1f} s on a hung node"
        assert httpx.get(f"{server.url}/v1/tables/{table}", timeout=10).status_code == 404
