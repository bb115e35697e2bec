"""Issue 39: ``/readyz?writes=true`` of replicas started at once on a NATS cluster that has just started
(what ``make cluster`` does): when each replica first takes a push, and when it first says write-ready.

Starts a fresh 3-node cluster, then ``--replicas`` replicas (the demo table) without waiting between
them, and polls each every ~50 ms for ``--seconds``: a push (``POST /v1/tables/demo/update``, one row of
zeros), then ``GET /readyz?writes=true``. Counted per replica: the polls whose push was acknowledged
while the readiness asked right after it said read-only (503 with a write problem), and the seconds from
its first acknowledged push to its first write-ready answer (negative: ready first).

    python -m benchmarks.replication.write_ready [--tree DIR] [--replicas 2] [--seconds 30] [--rounds 5]

Each round starts a new cluster (the window depends on when the nodes elect the write-check stream's
leader).

``--tree``: the source tree whose ``python -m service`` runs (default: this checkout). Prints Markdown.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from devtools.natscluster import NatsCluster, free_ports
from loadtest.launch import RobezProcess


def _replica(tree: Path, cluster: NatsCluster, workdir: Path, name: str) -> RobezProcess:
    (workdir / name / "shm").mkdir(parents=True)
    env = {
        "ROBEZ_SHM_DIR": str(workdir / name / "shm"),
        "ROBEZ_THREADS_PER_WORKER": "1",
        "PYTHONPATH": str(tree),
        **cluster.robez_env(),
    }
    args = ["--nats", ",".join(cluster.urls), "--replica-name", name]
    program = [sys.executable, "-m", "service"]
    return RobezProcess(
        args, env, log_path=workdir / name / "server.log", program=program, cwd=tree, port=free_ports(1)[0]
    )


def timeline(tree: Path, replicas: int, seconds: float) -> list[str]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="robez-bench-ready-") as directory:
        workdir = Path(directory)
        cluster = NatsCluster(workdir / "nats", size=3)
        servers: list[RobezProcess] = []
        try:
            cluster.start()
            cluster.wait_for_jetstream(60.0)
            servers = [_replica(tree, cluster, workdir, f"replica{i + 1}").spawn() for i in range(replicas)]
            began = time.monotonic()
            first_push: dict[int, float] = {}
            first_ready: dict[int, float] = {}
            lies = dict.fromkeys(range(replicas), 0)
            problems: dict[int, set[str]] = {i: set() for i in range(replicas)}
            with httpx.Client(timeout=15) as client:
                while time.monotonic() - began < seconds:
                    for index, server in enumerate(servers):
                        try:
                            push = client.post(
                                f"{server.url}/v1/tables/demo/update",
                                json={"ids": [1], "grads": [[0.0] * 64]},
                            )
                            ready = client.get(f"{server.url}/readyz", params={"writes": "true"})
                        except httpx.HTTPError:
                            continue  # not listening yet
                        now = time.monotonic() - began
                        if push.status_code == 200:
                            first_push.setdefault(index, now)
                        if ready.status_code == 200:
                            first_ready.setdefault(index, now)
                        elif push.status_code == 200:
                            lies[index] += 1
                            problems[index].add(str(ready.json().get("write_problem", ready.json()))[:90])
                    time.sleep(0.05)
        finally:
            for server in servers:
                server.stop(20.0)
            cluster.stop()
    for index in range(replicas):
        push_at, ready_at = first_push.get(index), first_ready.get(index)
        gap = f"{ready_at - push_at:+.2f}" if push_at is not None and ready_at is not None else "never"
        times = " | ".join(f"{at:.2f}" if at is not None else "-" for at in (push_at, ready_at))
        said = "; ".join(sorted(problems[index])) or "-"
        rows.append(f"| replica{index + 1} | {times} | {gap} | {lies[index]} | {said} |")
    return [
        "| replica | first push acked (s) | first writes=true 200 (s) | gap (s) | acked pushes answered "
        "read-only | the write problem it gave |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows,
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.replication.write_ready", description=__doc__)
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[2])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"tree: {args.tree}; load average before: {os.getloadavg()}\n")
    for round in range(args.rounds):
        print(f"\nround {round + 1}:\n")
        print("\n".join(timeline(args.tree, args.replicas, args.seconds)), flush=True)
    print(f"\nload average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
