"""Issue 39: what a call a user waits on costs when a NATS node hangs (SIGSTOP), and NATS's own election.

On a fresh 3-node cluster with one replica (``robez serve --nats``), ``--rounds`` times each:

- ``connected node``: the node the replica is connected to is frozen (it leads neither the catalog nor the
  table's stream); timed: ``DELETE /v1/tables/<t>`` through the replica, which starts by reading the
  catalog (a KV get).
- ``connected node, create``: as ``connected node``; timed: ``POST /v1/tables`` of a new table through the
  replica (its stream, then its catalog entry).
- ``catalog leader``: the catalog stream's leader is frozen (the replica is connected elsewhere); timed:
  the same drop, whose catalog read waits for a new leader.
A drop also deletes the table's stream, a request to JetStream's meta leader: where the frozen node led
the meta group too (marked), the drop waits for the meta election as well.

- ``election``: a table stream's leader is frozen; timed: until another node reports a new leader
  (``STREAM.INFO`` asked every 0.1 s through the other nodes), i.e. NATS's own failover, the floor of
  every call that needs that stream.

The node is thawed after each round and every stream has a leader again before the next.

    python -m benchmarks.replication.hung_node [--tree DIR] [--rounds 3]

``--tree``: the source tree whose ``python -m service`` runs (default: this checkout). Prints Markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import nats

from devtools.natscluster import NatsCluster, NatsNode, free_ports
from loadtest.launch import RobezProcess

_SMALL = {"num_embeddings": 1000, "embedding_dim": 8, "memory_size": 256, "chunk_size": 4}


def _log_server(http: httpx.Client) -> str:
    """The NATS server the replica is connected to (once its /readyz names it)."""
    deadline = time.monotonic() + 60
    while True:
        named = http.get("/readyz", params={"writes": "true"}).json().get("log_server")
        if named or time.monotonic() > deadline:
            return str(named)
        time.sleep(0.2)


def _settle(cluster: NatsCluster, avoid: NatsNode | None, streams: list[str]) -> None:
    """Wait until each of ``streams`` has a leader, not ``avoid`` (stepping it down when it is)."""

    async def step_down(stream: str) -> None:
        nc = await nats.connect(servers=cluster.urls, **cluster.connect_options())
        try:
            await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", b"", timeout=5)
        finally:
            await nc.close()

    deadline = time.monotonic() + 120
    while True:
        leaders = cluster.stream_leaders()
        bad = [
            s
            for s in streams
            if leaders.get(s) in (None, "", "None") or leaders.get(s) == getattr(avoid, "name", None)
        ]
        if not bad:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"streams without a good leader: {bad} ({leaders})")
        for stream in bad:
            if avoid is not None and leaders.get(stream) == avoid.name:
                asyncio.run(step_down(stream))
        time.sleep(0.5)


def _election_s(cluster: NatsCluster, stream: str, leader: NatsNode) -> float:
    others = [node.url for node in cluster.nodes if node is not leader]

    async def wait() -> float:
        nc = await nats.connect(servers=others, **cluster.connect_options())
        try:
            js = nc.jetstream(timeout=1)
            cluster.freeze(leader)
            began = time.monotonic()
            while time.monotonic() - began < 60:
                try:
                    info = await js.stream_info(stream)
                    if info.cluster is not None and info.cluster.leader not in (None, "", leader.name):
                        return time.monotonic() - began
                except (TimeoutError, nats.errors.Error):
                    pass
                await asyncio.sleep(0.1)
            return float("nan")
        finally:
            await nc.close()

    try:
        return asyncio.run(wait())
    finally:
        cluster.thaw(leader)


def run(tree: Path, rounds: int) -> list[str]:
    times: dict[str, list[str]] = {"connected node": [], "connected node, create": [], "catalog leader": []}
    times["election"] = []
    with tempfile.TemporaryDirectory(prefix="robez-bench-hung-") as directory:
        workdir = Path(directory)
        cluster = NatsCluster(workdir / "nats", size=3)
        server = None
        try:
            cluster.start()
            cluster.wait_for_jetstream(60.0)
            (workdir / "shm").mkdir()
            env = {
                "ROBEZ_SHM_DIR": str(workdir / "shm"),
                "ROBEZ_THREADS_PER_WORKER": "1",
                "ROBEZ_DEFAULT_TABLE": "false",
                "PYTHONPATH": str(tree),
                **cluster.robez_env(),
            }
            args = ["--nats", ",".join(cluster.urls), "--replica-name", "a"]
            server = RobezProcess(
                args, env, log_path=workdir / "server.log", program=[sys.executable, "-m", "service"],
                cwd=tree, port=free_ports(1)[0],
            ).start(300.0, interval_s=0.2)  # fmt: skip
            http = httpx.Client(base_url=server.url, timeout=60)
            for index in range(rounds):
                for case in ("connected node", "connected node, create", "catalog leader"):
                    table = f"hung{index}{case[:3]}{len(case)}"
                    created = http.post("/v1/tables", json={"name": table, "config": _SMALL})
                    assert created.status_code == 201, created.text
                    address = _log_server(http)
                    (connected,) = [n for n in cluster.nodes if address == f"127.0.0.1:{n.client_port}"]
                    streams = [
                        "KV_robez_tables",
                        *[s for s in cluster.stream_leaders() if s.startswith(f"robez_{table}_")],
                    ]
                    if case.startswith("connected node"):
                        _settle(cluster, connected, streams)
                        victim = connected
                    else:
                        _settle(cluster, None, streams)
                        name = cluster.stream_leaders()["KV_robez_tables"]
                        if name == connected.name:
                            _settle(cluster, connected, streams)
                            name = cluster.stream_leaders()["KV_robez_tables"]
                        (victim,) = [n for n in cluster.nodes if n.name == name]
                    meta = "*" if cluster.meta_leader() == victim.name else ""
                    cluster.freeze(victim)
                    try:
                        began = time.monotonic()
                        if case.endswith("create"):
                            response = http.post("/v1/tables", json={"name": f"{table}new", "config": _SMALL})
                        else:
                            response = http.delete(f"/v1/tables/{table}")
                        took = time.monotonic() - began
                    finally:
                        cluster.thaw(victim)
                    times[case].append(f"{took:.1f} s ({response.status_code}{meta})")
                    print(f"round {index + 1}, {case}: {times[case][-1]}", flush=True)
                    _settle(cluster, None, ["KV_robez_tables"])
                table = f"elect{index}"
                assert http.post("/v1/tables", json={"name": table, "config": _SMALL}).status_code == 201
                (stream,) = [s for s in cluster.stream_leaders() if s.startswith(f"robez_{table}_")]
                _settle(cluster, None, [stream])
                (leader,) = [n for n in cluster.nodes if n.name == cluster.stream_leaders()[stream]]
                times["election"].append(f"{_election_s(cluster, stream, leader):.1f} s")
                print(f"round {index + 1}, election: {times['election'][-1]}", flush=True)
                _settle(cluster, None, [stream, "KV_robez_tables"])
        finally:
            if server is not None:
                server.stop(20.0)
            cluster.stop()
    rows = []
    for case, measured in times.items():
        seconds = [float(m.split()[0]) for m in measured]
        rows.append(f"| {case} | {', '.join(measured)} | {statistics.median(seconds):.1f} s |")
    return [
        "| frozen | each round (answer; *: the node also led JetStream's meta group) | median |",
        "| --- | --- | --- |",
        *rows,
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.replication.hung_node", description=__doc__)
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[2])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"tree: {args.tree}; load average before: {os.getloadavg()}\n")
    print("\n".join(run(args.tree, args.rounds)))
    print(f"\nload average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
