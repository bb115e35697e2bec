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

Reports p50 per append (per batch or packed message), pushes/s and the CPU each push cost the three NATS
nodes and this process (from /proc: what group commit through atomic batches could save, issue 41 step 1).

Before that, what an atomic batch does with what robez relies on (each answer is the server's reply,
printed as it came): a batch's sequences and its one ack; a batch holding a ``Nats-Msg-Id`` already
stored (a resent push) or twice; a stream created without ``allow_atomic``, and updated to it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from typing import Any

import nats
import nats.js.errors
import numpy as np
from nats.js.api import StorageType, StreamConfig

from devtools.natscluster import NatsCluster
from loadtest.server import tree_cpu_seconds
from robez_core import hostinfo

from .replicas import DIM

_GROUP = 8


async def _batch(
    nc: Any, subject: str, payloads: list[bytes], headers: list[dict[str, str]]
) -> dict[str, Any]:
    """One atomic batch (ADR-50): plain publishes, the last one a request that commits; the server's
    answer to the commit (a PubAck with ``batch`` and ``count``, or an ``error``)."""
    batch = secrets.token_hex(8)
    for index, (payload, extra) in enumerate(zip(payloads, headers, strict=True), start=1):
        marks = {"Nats-Batch-Id": batch, "Nats-Batch-Sequence": str(index)}
        if index < len(payloads):
            await nc.publish(subject, payload, headers={**extra, **marks})
        else:
            answer = await nc.request(
                subject, payload, timeout=10, headers={**extra, **marks, "Nats-Batch-Commit": "1"}
            )
            return dict(json.loads(answer.data))
    raise ValueError("an empty batch")


def _stream_config(stream: str, subject: str, allow_atomic: bool) -> StreamConfig:
    return StreamConfig(
        name=stream,
        subjects=[subject],
        num_replicas=3,
        storage=StorageType.FILE,
        duplicate_window=600.0,
        allow_atomic=allow_atomic or None,
    )


async def _semantics(cluster: NatsCluster) -> list[tuple[str, str]]:
    """What the server answers to the batches robez would send, on scratch R3 streams."""
    nc = await nats.connect(servers=cluster.urls, **cluster.connect_options())
    js = nc.jetstream(timeout=10)
    stream, subject = "robezbenchbatch_probe", "robezbenchbatch.u.probe"
    plain, plain_subject = "robezbenchbatch_plain", "robezbenchbatch.u.plain"
    found: list[tuple[str, str]] = []

    async def last() -> int:
        return int((await js.stream_info(stream)).state.last_seq or 0)

    def ids(*names: str) -> list[dict[str, str]]:
        return [{"Nats-Msg-Id": name, "Nats-Expected-Stream": stream} for name in names]

    try:
        for attempt in range(40):  # a fresh cluster may not see every peer yet (10005: peer offline)
            try:
                await js.add_stream(_stream_config(stream, subject, allow_atomic=True))
                break
            except nats.js.errors.BadRequestError:
                if attempt == 39:
                    raise
                await asyncio.sleep(0.25)
        await js.publish(subject, b"k0", headers={"Nats-Msg-Id": "k0"})
        names = [f"k{index}" for index in range(1, 9)]
        answer = await _batch(nc, subject, [name.encode() for name in names], ids(*names))
        stored = [bytes((await js.get_msg(stream, seq)).data or b"").decode() for seq in range(2, 10)]
        found.append(
            (
                "batch of 8 (ids k1..k8) after one message",
                f"answer {answer}; sequences 2-9 hold {' '.join(stored)}",
            )
        )
        before = await last()
        answer = await _batch(nc, subject, [b"n1", b"again", b"n3"], ids("n1", "k3", "n3"))
        found.append(
            (
                "batch of 3 whose 2nd id (k3) is stored",
                f"answer {answer}; last sequence {before} -> {await last()}",
            )
        )
        answer = await _batch(nc, subject, [b"again"], ids("k5"))
        found.append(("batch of 1 whose id (k5) is stored", f"answer {answer}"))
        answer = await _batch(nc, subject, [b"s1", b"s2"], ids("same", "same"))
        found.append(("batch of 2 with one id twice", f"answer {answer}"))
        ack = await js.publish(subject, b"again", headers={"Nats-Msg-Id": "k3"})
        found.append(
            ("plain publish of the stored id k3 (today's retry)", f"seq {ack.seq}, duplicate {ack.duplicate}")
        )
        await js.add_stream(_stream_config(plain, plain_subject, allow_atomic=False))
        answer = await _batch(nc, plain_subject, [b"a", b"b"], [{"Nats-Msg-Id": "a"}, {"Nats-Msg-Id": "b"}])
        kept = int((await js.stream_info(plain)).state.messages or 0)
        found.append(("batch to a stream without allow_atomic", f"answer {answer}; messages stored {kept}"))
        config = (await js.stream_info(plain)).config
        config.allow_atomic = True
        updated = await js.update_stream(config)
        answer = await _batch(nc, plain_subject, [b"a", b"b"], [{"Nats-Msg-Id": "a"}, {"Nats-Msg-Id": "b"}])
        found.append(
            (
                "the same stream updated to allow_atomic",
                f"update: allow_atomic {updated.config.allow_atomic}; batch answer {answer}",
            )
        )
    finally:
        for name in (stream, plain):
            with contextlib.suppress(Exception):
                await js.delete_stream(name)
        await nc.close()
    return found


async def _measure(cluster: NatsCluster, pushes: int, rows: int, rounds: int) -> dict[str, list[float]]:
    from service.replication.jetstream import JetStreamLog

    log = JetStreamLog(cluster.urls, replicas=3, prefix="robezbenchbatch", auth=cluster.auth())
    await log.connect()
    nc = log._nc
    assert nc is not None
    stream, subject = "robezbenchbatch_atomic", "robezbenchbatch.u.atomic"
    await log.js.add_stream(_stream_config(stream, subject, allow_atomic=True))
    nodes = [node.process.pid for node in cluster.nodes if node.process is not None]
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
        # The headers a robez append sends (its own, the key, the expected stream), per message.
        each = [{**headers, "Nats-Msg-Id": key(), "Nats-Expected-Stream": stream} for _ in range(_GROUP)]
        acked = await _batch(nc, subject, [payload] * _GROUP, each)
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
                nodes_before = sum(tree_cpu_seconds(pid) for pid in nodes)
                client_before = time.process_time()
                *latencies, elapsed = await timed(call, count, concurrency)
                client = time.process_time() - client_before
                nats_cpu = sum(tree_cpu_seconds(pid) for pid in nodes) - nodes_before
                done = len(latencies) * per_call
                out.setdefault(f"{name} p50", []).append(statistics.median(latencies) * 1e3)
                out.setdefault(f"{name} per_s", []).append(done / elapsed)
                out.setdefault(f"{name} nats_cpu", []).append(nats_cpu * 1e3 / done)
                out.setdefault(f"{name} client_cpu", []).append(client * 1e3 / done)
    finally:
        await log.drop_table("batches")
        await log.js.delete_stream(stream)
        await log.close()
    return out


async def _run(
    cluster: NatsCluster, pushes: int, rows: int, rounds: int
) -> tuple[list[tuple[str, str]], dict[str, list[float]]]:
    return await _semantics(cluster), await _measure(cluster, pushes, rows, rounds)


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
        semantics, figures = asyncio.run(_run(cluster, args.pushes, args.rows, args.rounds))
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
    print("## What the server answers\n")
    print("| sent | answer |")
    print("|---|---|")
    for sent, answer in semantics:
        print(f"| {sent} | {answer} |")
    print(f"\n## Cost ({args.rounds} alternating rounds, each round's figure)\n")
    print(
        "| appends | p50 ms per append | pushes/s | NATS nodes' CPU ms per push | "
        "this process's CPU ms per push |"
    )
    print("|---|---|---|---|---|")
    ways = list(dict.fromkeys(key.rsplit(" ", 1)[0] for key in figures if key.endswith(" p50")))
    for name in ways:
        cells = [
            ", ".join(f"{value:{form}}" for value in figures[f"{name} {kind}"])
            for kind, form in (("p50", ".2f"), ("per_s", ".0f"), ("nats_cpu", ".2f"), ("client_cpu", ".2f"))
        ]
        print(f"| {name} | {' | '.join(cells)} |")
    batched, in_flight = f"atomic batches of {_GROUP}", f"{_GROUP} in flight"
    print(f"\nMedians over rounds, {batched} / {in_flight}:  ")

    def ratio(kind: str) -> float:
        return statistics.median(figures[f"{batched} {kind}"]) / statistics.median(
            figures[f"{in_flight} {kind}"]
        )

    print(
        f"p50 {ratio('p50'):.2f}x, pushes/s {ratio('per_s'):.2f}x, "
        f"NATS CPU per push {ratio('nats_cpu'):.2f}x, this process's CPU per push {ratio('client_cpu'):.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
