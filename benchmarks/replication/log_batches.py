"""What JetStream itself gives for concurrent, batched and packed appends (issue 41: group commit).

    python -m benchmarks.replication.log_batches [--pushes 160] [--rounds 2] [--rows 256]

On a 3-node cluster with logins and TLS as shipped (R3 file streams, ``sync_interval: always``), no robez
server: one connection appends ``--pushes`` pushes' payloads (``--rows`` ids x 64) to one stream, each
with its own ``Nats-Msg-Id``, in four ways, ``--rounds`` times alternating:

- one at a time (``JetStreamLog.append``: publish, await the ack);
- 8 in flight (8 tasks each awaiting its own ack: what 8 concurrent pushes in one worker do);
- atomic batches of 8 (ADR-50: 7 plain publishes and a committing request, one ack; the stream has
  ``allow_atomic``);
- 8 pushes packed into one message (one append of 8 payloads: what a robez-level group commit would
  send; not what the log holds today).

Reports p50 per append (per batch or packed message) and pushes/s.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import secrets
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import numpy as np

from devtools.natscluster import NatsCluster
from robez_core import hostinfo

from .replicas import DIM

_GROUP = 8


async def _measure(cluster: NatsCluster, pushes: int, rows: int, rounds: int) -> dict[str, list[float]]:
    from service.replication.jetstream import JetStreamLog

    log = JetStreamLog(cluster.urls, replicas=3, prefix="robezbenchbatch", auth=cluster.auth())
    await log.connect()
    nc = log._nc
    assert nc is not None
    stream, subject = "robezbenchbatch_atomic", "robezbenchbatch.u.atomic"
    config = {
        "name": stream,
        "subjects": [subject],
        "num_replicas": 3,
        "storage": "file",
        "allow_atomic": True,  # nats-py's StreamConfig has no field for it: the API request by hand
        "duplicate_window": 600 * 10**9,
    }
    created = json.loads(
        (await nc.request(f"$JS.API.STREAM.CREATE.{stream}", json.dumps(config).encode())).data
    )
    assert "error" not in created, created
    entry = await log.create_table("batches", {}, {})
    payload = np.random.default_rng(5).bytes(rows * 8 + rows * DIM * 4)
    headers = {"Robez-Shape": f"{rows},{DIM}", "Robez-Lr": (0.01).hex()}
    counter = 0

    def key() -> str:
        nonlocal counter
        counter += 1
        return f"k{counter}"

    async def single() -> None:
        await log.append(entry, payload, headers, key())

    async def packed() -> None:
        await log.append(entry, payload * _GROUP, headers, key())

    async def atomic() -> None:
        batch = secrets.token_hex(8)
        for index in range(1, _GROUP):
            await nc.publish(
                subject,
                payload,
                headers={"Nats-Msg-Id": key(), "Nats-Batch-Id": batch, "Nats-Batch-Sequence": str(index)},
            )
        answer = await nc.request(
            subject,
            payload,
            timeout=10,
            headers={
                "Nats-Msg-Id": key(),
                "Nats-Batch-Id": batch,
                "Nats-Batch-Sequence": str(_GROUP),
                "Nats-Batch-Commit": "1",
            },
        )
        acked = json.loads(answer.data)
        assert acked.get("count") == _GROUP, acked

    async def timed(call: Callable[[], Awaitable[None]], count: int, concurrency: int) -> list[float]:
        latencies: list[float] = []

        async def worker() -> None:
            for _ in range(count // concurrency):
                start = time.perf_counter()
                await call()
                latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return [*latencies, time.perf_counter() - start]

    out: dict[str, list[float]] = {}
    try:
        for _ in range(10):
            await single()
        for _ in range(rounds):
            for name, call, count, concurrency, per_call in (
                ("one at a time", single, pushes, 1, 1),
                (f"{_GROUP} in flight", single, pushes, _GROUP, 1),
                (f"atomic batches of {_GROUP}", atomic, pushes // _GROUP, 1, _GROUP),
                (f"{_GROUP} packed in one message", packed, pushes // _GROUP, 1, _GROUP),
            ):
                *latencies, elapsed = await timed(call, count, concurrency)
                out.setdefault(f"{name} p50", []).append(statistics.median(latencies) * 1e3)
                out.setdefault(f"{name} per_s", []).append(len(latencies) * per_call / elapsed)
    finally:
        await log.drop_table("batches")
        await log.js.delete_stream(stream)
        await log.close()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.replication.log_batches", description=__doc__)
    parser.add_argument("--pushes", type=int, default=160, help="pushes per way and round")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds")
    parser.add_argument("--rows", type=int, default=256, help="ids per push")
    parser.add_argument("--dir", type=Path, default=Path.cwd(), help="parent of the working directory")
    args = parser.parse_args(argv)

    load_before = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    began = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix=".robez-bench-batches-", dir=args.dir))
    cluster = NatsCluster(workdir / "nats", size=3)
    try:
        cluster.start()
        cluster.wait_for_jetstream()
        figures = asyncio.run(_measure(cluster, args.pushes, args.rows, args.rounds))
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    load_after = ", ".join(f"{value:.2f}" for value in os.getloadavg())

    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = "python -m benchmarks.replication.log_batches " + shlex.join(list(argv or sys.argv[1:]))
    print(f"# JetStream appends: concurrent, atomic batches, packed — {date}\n")
    print(f"Command: `{command.strip()}` (took {time.perf_counter() - began:.0f} s)  ")
    print(
        f"Machine: {platform.node()}, {os.cpu_count()} CPUs, {hostinfo.cpu_model()}, "
        f"Linux {platform.release()}  "
    )
    print(f"Load average (1, 5, 15 min): {load_before} before, {load_after} after  ")
    print(
        "3 NATS nodes, TLS and logins, R3 file streams, sync_interval always; "
        f"{args.rows} ids x {DIM} per push\n"
    )
    print("| appends | p50 ms per append (each round) | pushes/s (each round) |")
    print("|---|---|---|")
    for name in dict.fromkeys(key.rsplit(" ", 1)[0] for key in figures):
        p50 = ", ".join(f"{value:.2f}" for value in figures[f"{name} p50"])
        rate = ", ".join(f"{value:.0f}" for value in figures[f"{name} per_s"])
        print(f"| {name} | {p50} | {rate} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
