"""What a push of several tables costs on a replica, against a push of one (issue 41: pipelined publishes).

    python -m benchmarks.replication.parts [--tables 4] [--pushes 100] [--rows 256]

Starts a 3-node NATS cluster (logins and TLS as shipped, ``sync_interval: always``) and one replica A
(1 worker, 1 kernel thread) from the current directory's code, creates ``--tables`` tables like
``demo`` (d = 64), then pushes from one writer, alternating: a push of ``--rows`` ids to one table, and
one push of ``--rows`` ids to each of the tables (``POST /v1/update``, binary). Reports the p50 of each,
their ratio and the server's ``publish`` stage (publish -> quorum ack; for a multi-table push the
longest part's, or on code that publishes the parts one after another, their sum). Run it in two
checkouts to compare them.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import numpy as np

from devtools.natscluster import NatsCluster
from robez_core import hostinfo

from .replicas import DIM, BenchServer, percentile, push_body


def main(argv: Sequence[str] | None = None) -> int:
    from service.servertiming import parse_server_timing

    parser = argparse.ArgumentParser(prog="python -m benchmarks.replication.parts", description=__doc__)
    parser.add_argument("--tables", type=int, default=4, help="tables in a multi-table push")
    parser.add_argument("--pushes", type=int, default=100, help="pushes of each kind")
    parser.add_argument("--rows", type=int, default=256, help="ids per table and push")
    parser.add_argument("--dir", type=Path, default=Path.cwd(), help="parent of the working directory")
    args = parser.parse_args(argv)

    load_before = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    began = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix=".robez-bench-parts-", dir=args.dir))
    cluster = NatsCluster(workdir / "nats", size=3)
    server: BenchServer | None = None
    names = [f"part{index}" for index in range(args.tables)]
    latency: dict[str, list[float]] = {"one": [], "many": []}
    publish: dict[str, list[float]] = {"one": [], "many": []}
    try:
        cluster.start()
        cluster.wait_for_jetstream()
        server = BenchServer(
            "a", workdir, ["--nats", ",".join(cluster.urls), "--replica-name", "a"], cluster.robez_env()
        )
        server.wait_ready()
        rng = np.random.default_rng(3)
        with httpx.Client(base_url=server.url, timeout=30) as client:
            demo = client.get("/v1/tables/demo").json()
            for name in names:
                created = client.post(
                    "/v1/tables",
                    json={"name": name, "config": demo["config"], "optimizer": demo["optimizer"]},
                )
                created.raise_for_status()

            def one() -> httpx.Response:
                body, headers = push_body(rng, args.rows)
                return client.post(f"/v1/tables/{names[0]}/update", content=body, headers=headers)

            def many() -> httpx.Response:
                bodies = [push_body(rng, args.rows)[0] for _ in names]
                headers = {
                    "Content-Type": "application/octet-stream",
                    "X-Robez-Tables": ",".join(f"{name}={args.rows}" for name in names),
                    "X-Robez-Shapes": ";".join(f"{args.rows},{DIM}" for _ in names),
                }
                return client.post("/v1/update", content=b"".join(bodies), headers=headers)

            for _ in range(5):  # kernels loaded, connection open
                one().raise_for_status()
                many().raise_for_status()
            for _ in range(args.pushes):
                for kind, send in (("one", one), ("many", many)):
                    start = time.perf_counter()
                    response = send()
                    latency[kind].append(time.perf_counter() - start)
                    response.raise_for_status()
                    publish[kind].append(
                        parse_server_timing(response.headers.get("server-timing"))["publish"]
                    )
    finally:
        if server is not None:
            server.stop()
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    load_after = ", ".join(f"{value:.2f}" for value in os.getloadavg())

    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = "python -m benchmarks.replication.parts " + shlex.join(list(argv or sys.argv[1:]))
    one_p50, many_p50 = (percentile(latency[kind], 50) * 1e3 for kind in ("one", "many"))
    print(f"# Multi-table pushes on a replica — {date}\n")
    print(f"Command: `{command.strip()}` in {Path.cwd()} (took {time.perf_counter() - began:.0f} s)  ")
    print(
        f"Machine: {platform.node()}, {os.cpu_count()} CPUs, {hostinfo.cpu_model()}, "
        f"Linux {platform.release()}  "
    )
    print(f"Load average (1, 5, 15 min): {load_before} before, {load_after} after\n")
    print("| push | p50 ms | p99 ms | publish -> ack (server, median ms) |")
    print("|---|---|---|---|")
    for kind, label in (("one", "1 table"), ("many", f"{args.tables} tables")):
        print(
            f"| {label}, {args.rows} ids each | {percentile(latency[kind], 50) * 1e3:.2f} | "
            f"{percentile(latency[kind], 99) * 1e3:.2f} | {statistics.median(publish[kind]):.2f} |"
        )
    print(f"\n{args.tables}-table push p50 / 1-table push p50: {many_p50 / one_p50:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
