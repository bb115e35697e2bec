"""What replication costs, over HTTP on loopback: replicated vs single-server updates, lag, lookups.

    python -m benchmarks.replication.replicas [--pushes 300] [--rounds 5] [--rows 256] [--rate 200]
        [--seconds 10]

Starts, on loopback: a 3-node NATS JetStream cluster (file storage, ``sync_interval: always``) with two
robez replicas A and B, and a single robez server with ``--data-dir`` and ``wal_fsync=always`` (the local
log). Every server runs 1 worker with 1 kernel thread and serves the ``demo`` table (d = 64). Measures:

1. update latency p50/p99 and throughput, ``--rows`` ids x 64 per push, binary, with 1 and 8 concurrent
   writers: replicated (pushes to A) vs local, in ``--rounds`` alternating rounds (the ratio is the
   median of the rounds' p50 ratios); beside it, the log engine's own floor: the same payload appended
   straight to a scratch table's log (``JetStreamLog.append``, no robez server), one at a time;
2. replication lag at ``--rate`` pushes/s to A for ``--seconds``, from paced writer threads in a process
   of their own: right after A acknowledges version V, a lookup of one id at B with
   ``X-Robez-Min-Version: V``; lag = from A's acknowledgement to B's answer (an upper bound: it includes
   one loopback round trip to B);
3. lookup throughput of B: B and a client process keeping 4 lookups of ``--rows`` ids in flight share
   the first half of the CPUs (the NATS nodes, A and the pushing process get the other half), for
   ``--seconds`` without updates and with ``--rate`` pushes/s streaming into A; and B's CPU use for
   applying the stream alone;
4. after all of it, whether A and B hold the same bytes (their checksums at the same version).

Prints a Markdown report (machine, CPU, load average before and after, date, command) for
docs/benchmarks/replication-<date>.md, with each goal's reading computed from the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
import multiprocessing
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

from devtools.natscluster import NatsCluster
from loadtest.launch import RobezProcess
from loadtest.profile import Profiler
from loadtest.server import tree_cpu_seconds, tree_pids
from robez_core import hostinfo

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from service.natsauth import NatsAuth

DIM = 64
# Paced pushing threads of the lag run: enough that a slow push (p99 ~ 40 ms) does not hold the rate down.
_LAG_THREADS = 16


class BenchServer(RobezProcess):
    """``robez serve ARGS`` (1 kernel thread) spawned at once; ``wait_ready`` / ``stop`` as every tool."""

    def __init__(self, name: str, workdir: Path, args: list[str], env: dict[str, str]) -> None:
        (workdir / name).mkdir(parents=True)
        super().__init__(
            args,
            {"ROBEZ_SHM_DIR": str(workdir / name / "shm"), "ROBEZ_THREADS_PER_WORKER": "1", **env},
            log_path=workdir / name / "server.log",
        )
        self.spawn()

    def wait_ready(self, timeout_s: float = 120.0, **_: object) -> BenchServer:
        super().wait_ready(timeout_s, interval_s=0.2)
        return self

    def stop(self, timeout_s: float = 20.0) -> None:
        super().stop(timeout_s)


@contextlib.contextmanager
def replicated_pair(
    workdir: Path, rows: int, warm_pushes: int, secure: bool = True
) -> Iterator[tuple[NatsCluster, list[BenchServer]]]:
    """A 3-node NATS cluster (TLS and logins unless not ``secure``) and replicas A and B on it, ready, A's
    kernels loaded and connections open by ``warm_pushes`` pushes of ``rows`` ids; all stopped after."""
    cluster = NatsCluster(workdir / "nats", size=3, secure=secure)
    servers: list[BenchServer] = []
    try:
        cluster.start()
        cluster.wait_for_jetstream()
        nats_args = ["--nats", ",".join(cluster.urls)]
        servers = [
            BenchServer(name, workdir, [*nats_args, "--replica-name", name], cluster.robez_env())
            for name in "ab"
        ]
        for server in servers:
            server.wait_ready()
        timed_updates(servers[0].url, 1, warm_pushes, rows)
        yield cluster, servers
    finally:
        for server in servers:
            server.stop()
        cluster.stop()


def push_body(rng: np.random.Generator, rows: int) -> tuple[bytes, dict[str, str]]:
    ids = rng.integers(0, 10_000_000, rows, dtype="<i8")
    grads = rng.standard_normal((rows, DIM), dtype=np.float32).astype("<f4")
    headers = {"Content-Type": "application/octet-stream", "X-Robez-Shape": f"{rows},{DIM}"}
    return ids.tobytes() + grads.tobytes(), headers


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def timed_updates(
    url: str, writers: int, pushes: int, rows: int, stages: dict[str, list[float]] | None = None
) -> list[float]:
    """``pushes`` updates split over ``writers`` threads; returns each push's latency (s) and, last,
    the elapsed wall time of the whole run. ``stages``: the server's Server-Timing stages (ms) are
    appended there, by stage name."""
    from service.servertiming import parse_server_timing

    latencies: list[float] = []
    lock = threading.Lock()

    def writer(index: int) -> None:
        rng = np.random.default_rng(index)
        mine: list[float] = []
        with httpx.Client(base_url=url, timeout=30) as client:
            for _ in range(pushes // writers):
                body, headers = push_body(rng, rows)
                start = time.perf_counter()
                response = client.post("/v1/tables/demo/update", content=body, headers=headers)
                mine.append(time.perf_counter() - start)
                response.raise_for_status()
                if stages is not None:
                    with lock:
                        for stage, ms in parse_server_timing(response.headers.get("server-timing")).items():
                            stages.setdefault(stage, []).append(ms)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(writers)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [*latencies, time.perf_counter() - start]


class _Rounds:
    """Latencies of one kind of push gathered over several rounds: per-round p50 and pooled figures."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.round_p50: list[float] = []
        self.count = 0
        self.elapsed = 0.0

    def add(self, measured: list[float]) -> None:
        *latencies, elapsed = measured
        self.latencies += latencies
        self.round_p50.append(percentile(latencies, 50))
        self.count += len(latencies)
        self.elapsed += elapsed

    def figures(self) -> dict[str, float]:
        return {
            "p50_ms": percentile(self.latencies, 50) * 1e3,
            "p99_ms": percentile(self.latencies, 99) * 1e3,
            "per_s": self.count / self.elapsed if self.elapsed else float("nan"),
        }


def _log_floor(urls: list[str], auth: NatsAuth, pushes: int, rows: int) -> dict[str, float]:
    """The log engine's own cost of one push: the same payload appended to a scratch table's log through
    ``JetStreamLog.append`` (R3, the dedup key, quorum ack), one at a time, no robez server involved."""
    import torch

    from service.replication.jetstream import JetStreamLog
    from service.replication.records import encode_update

    async def measure() -> list[float]:
        log = JetStreamLog(urls, replicas=3, prefix="robezbenchfloor", auth=auth)
        await log.connect()
        try:
            entry = await log.create_table("floor", {}, {})
            rng = np.random.default_rng(7)
            latencies = []
            try:
                for index in range(pushes):
                    ids = torch.from_numpy(rng.integers(0, 10_000_000, rows, dtype=np.int64))
                    grads = torch.from_numpy(rng.standard_normal((rows, DIM), dtype=np.float32))
                    payload, headers = encode_update(ids, grads, 0.01)
                    start = time.perf_counter()
                    await log.append(entry, payload, headers, key=f"floor-{index}")
                    latencies.append(time.perf_counter() - start)
            finally:
                await log.drop_table("floor")
            return latencies
        finally:
            await log.close()

    latencies = asyncio.run(measure())
    return {"p50_ms": percentile(latencies, 50) * 1e3, "p99_ms": percentile(latencies, 99) * 1e3}


def _stream(
    url: str, rate: float, rows: int, seconds: float, follower: str | None, threads: int, answer: Connection
) -> None:
    """A process of its own: pushes to ``url`` at ``rate``/s in total from ``threads`` paced threads for
    ``seconds``; after each acknowledgement a thread asks ``follower`` for that version (the lag probe).
    Sends back {"sent", "elapsed", "lags", "failed"}."""
    lags: list[float] = []
    failed: dict[int, int] = {}
    sent = [0]
    lock = threading.Lock()
    began = time.perf_counter()
    end = began + seconds

    def run(index: int) -> None:
        rng = np.random.default_rng(99 + index)
        one_id = np.zeros(1, dtype="<i8").tobytes()
        period = threads / rate
        with httpx.Client(base_url=url, timeout=30) as writer, httpx.Client(timeout=30) as reader:
            next_at = began + index * period / threads
            while next_at < end:
                time.sleep(max(0.0, next_at - time.perf_counter()))
                next_at += period
                body, headers = push_body(rng, rows)
                response = writer.post("/v1/tables/demo/update", content=body, headers=headers)
                acked = time.perf_counter()
                if response.status_code != 200:
                    with lock:
                        failed[response.status_code] = failed.get(response.status_code, 0) + 1
                    continue
                lag = None
                if follower is not None:
                    probe = reader.post(
                        f"{follower}/v1/tables/demo/lookup",
                        content=one_id,
                        headers={
                            "Content-Type": "application/octet-stream",
                            "X-Robez-Min-Version": str(response.json()["version"]),
                        },
                    )
                    if probe.status_code == 200:
                        lag = time.perf_counter() - acked
                with lock:
                    sent[0] += 1
                    if lag is not None:
                        lags.append(lag)

    workers = [threading.Thread(target=run, args=(index,)) for index in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    answer.send({"sent": sent[0], "elapsed": time.perf_counter() - began, "lags": lags, "failed": failed})


def _lookup_client(
    url: str, rows: int, seconds: float, in_flight: int, rate: float, server_pid: int, answer: Connection
) -> None:
    """A process of its own: ``in_flight`` keep-alive connections each sending binary lookups of
    ``rows`` ids for ``seconds``, back to back or (``rate`` > 0) paced at ``rate``/s in total; sends
    back the number of 200 answers, their latencies (s), the elapsed time and the CPU seconds the server
    (``server_pid`` and its children) used meanwhile."""
    from loadtest.transport import RawConnection, loopback_target, prepare_request

    target = loopback_target(url)
    request = prepare_request(
        target,
        "POST",
        "/v1/tables/demo/lookup",
        np.arange(rows, dtype="<i8").tobytes(),
        {"Content-Type": "application/octet-stream"},
    )

    latencies: list[float] = []

    async def one(index: int, end: float) -> int:
        connection, done = RawConnection(target), 0
        period = in_flight / rate if rate > 0 else 0.0
        next_at = time.perf_counter() + index * period / in_flight
        try:
            while time.perf_counter() < end:
                if period:
                    await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
                    next_at += period
                start = time.perf_counter()
                if (await connection.send(request)).status == 200:
                    latencies.append(time.perf_counter() - start)
                    done += 1
        finally:
            await connection.close()
        return done

    async def run() -> int:
        end = time.perf_counter() + seconds
        return sum(await asyncio.gather(*(one(index, end) for index in range(in_flight))))

    cpu_before, began = tree_cpu_seconds(server_pid), time.perf_counter()
    done = asyncio.run(run())
    elapsed, cpu = time.perf_counter() - began, tree_cpu_seconds(server_pid) - cpu_before
    answer.send({"done": done, "latencies": latencies, "elapsed": elapsed, "cpu_s": cpu})


def _in_process(target: Any, *args: Any, cpus: set[int] | None = None) -> tuple[Any, Connection]:
    """Start ``target(*args, pipe)`` in a fresh (spawned) process, pinned to ``cpus`` if given."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_pinned, args=(cpus, target, *args, send), daemon=True)
    process.start()
    send.close()
    return process, receive


def _pinned(cpus: set[int] | None, target: Any, *args: Any) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    target(*args)


def _pin(pid: int, cpus: set[int], *, descendants: bool = True) -> None:
    """Every thread of ``pid`` (and of its descendants) onto ``cpus``."""
    for each in tree_pids(pid) if descendants else [pid]:
        for task in Path(f"/proc/{each}/task").glob("*"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(task.name), cpus)


def _window(
    url: str,
    pid: int,
    rows: int,
    seconds: float,
    cpus: set[int] | None,
    client_cpus: set[int] | None,
    streaming: tuple[str, float] | None,
    lookup_rate: float | None,
) -> dict[str, float]:
    """One window of ``seconds`` at replica ``url`` (server ``pid``): lookups from a client process (4
    connections; at ``lookup_rate``/s, 0 = back to back, None = no lookups), and pushes streaming into
    another replica if ``streaming`` = (url, rate). Returns lookups, pushes/s, and the server's CPU
    seconds and wall seconds of the window."""
    streamer = None
    if streaming is not None:
        streamer = _in_process(_stream, streaming[0], streaming[1], rows, seconds + 4.0, None, 16, cpus=cpus)
        time.sleep(1.0)  # the stream is flowing before the window opens
    done, latencies, wall = 0, [], seconds
    if lookup_rate is not None:
        client, answer = _in_process(
            _lookup_client, url, rows, seconds, 4, lookup_rate, pid, cpus=client_cpus
        )
        result = answer.recv()
        done, latencies, wall, cpu = result["done"], result["latencies"], result["elapsed"], result["cpu_s"]
        client.join(30)
    else:
        cpu_before = tree_cpu_seconds(pid)
        time.sleep(seconds)
        cpu = tree_cpu_seconds(pid) - cpu_before
    pushes = 0.0
    if streamer is not None:
        result = streamer[1].recv()
        streamer[0].join(30)
        pushes = result["sent"] / result["elapsed"]
    return {
        "lookups": done,
        "per_s": done / wall,
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "cpu_s": cpu,
        "wall_s": wall,
        "pushes_per_s": pushes,
    }


def _means(url: str) -> dict[str, float]:
    """Sums and counts of the replication histograms of the server at ``url`` (demo table)."""
    sums: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        for name in ("robez_replication_publish_ack_seconds", "robez_update_apply_seconds"):
            for part in ("_sum", "_count"):
                if line.startswith(f'{name}{part}{{table="demo"}}'):
                    sums[name + part] = float(line.rsplit(" ", 1)[1])
    return sums


def _mean_ms(before: dict[str, float], after: dict[str, float], name: str) -> float:
    count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
    total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
    return total / count * 1e3 if count else float("nan")


def _same_bytes(urls: list[str], timeout_s: float = 60.0) -> str:
    """Whether the replicas at ``urls`` hold the same bytes once every one has applied the log: their
    checksums of ``demo`` at A's version (the pushes have stopped), waiting up to ``timeout_s`` for each."""
    version = httpx.get(f"{urls[0]}/v1/tables/demo/checksum", timeout=60).json()["version"]
    digests = []
    for url in urls:
        deadline = time.monotonic() + timeout_s
        while True:
            answer = httpx.get(f"{url}/v1/tables/demo/checksum", timeout=60).json()
            if answer["version"] >= version or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        digests.append((answer["version"], answer["sha256"]))
    same = len(set(digests)) == 1
    return f"A and B at version {version}, equal checksums: {'yes' if same else '**no**'}" + (
        "" if same else f" ({digests})"
    )


def _cpu() -> str:
    flags = hostinfo.listed_flags(("sse4_2", "avx", "avx2", "fma", "avx512f")) or ()
    return f"{hostinfo.cpu_model()} ({' '.join(flags)})"


def _cpu_list(cpus: set[int] | None) -> str:
    return ",".join(str(cpu) for cpu in sorted(cpus or ()))


def _load() -> str:
    return ", ".join(f"{value:.2f}" for value in os.getloadavg())


def _verdict(met: bool, text: str) -> str:
    return f"met ({text})" if met else f"**missed** ({text})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.replication.replicas", description=__doc__)
    parser.add_argument("--pushes", type=int, default=300, help="updates per latency measurement and kind")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds the pushes are split into")
    parser.add_argument("--rows", type=int, default=256, help="ids per push and per lookup")
    parser.add_argument("--rate", type=float, default=200.0, help="pushes/s for the lag and lookup runs")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the lag and lookup runs")
    parser.add_argument("--dir", type=Path, default=Path.cwd(), help="parent of the working directory")
    args = parser.parse_args(argv)

    load_before = _load()
    began = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix=".robez-bench-replication-", dir=args.dir))
    cluster = NatsCluster(workdir / "nats", size=3)
    servers: list[BenchServer] = []
    try:
        cluster.start()
        cluster.wait_for_jetstream()
        nats_args = ["--nats", ",".join(cluster.urls)]
        a = BenchServer("a", workdir, [*nats_args, "--replica-name", "a"], cluster.robez_env())
        b = BenchServer("b", workdir, [*nats_args, "--replica-name", "b"], cluster.robez_env())
        local = BenchServer(
            "local", workdir, ["--data-dir", str(workdir / "local-data")], {"ROBEZ_WAL_FSYNC": "always"}
        )
        servers = [a, b, local]
        for server in servers:
            server.wait_ready()
        for server in (a, local):  # first pushes load kernels and open connections
            timed_updates(server.url, 1, 10, args.rows)
        print(f"servers ready; update latency, {args.rounds} rounds ...", file=sys.stderr)

        rows_out = []
        for writers in (1, 8):
            per_round = max(args.pushes // args.rounds, writers * 5)
            replicated, baseline = _Rounds(), _Rounds()
            stages: dict[str, list[float]] = {}
            before = _means(a.url)
            for _ in range(args.rounds):
                replicated.add(timed_updates(a.url, writers, per_round, args.rows, stages))
                baseline.add(timed_updates(local.url, writers, per_round, args.rows))
            after = _means(a.url)
            ratios = [r / b_ for r, b_ in zip(replicated.round_p50, baseline.round_p50, strict=True)]
            split = {
                "ack": _mean_ms(before, after, "robez_replication_publish_ack_seconds"),
                "step": _mean_ms(before, after, "robez_update_apply_seconds"),
                **{stage: statistics.median(values) for stage, values in stages.items()},
            }
            rows_out.append((writers, replicated.figures(), baseline.figures(), ratios, split))
        print("log floor ...", file=sys.stderr)
        floor = _log_floor(cluster.urls, cluster.auth(), max(50, args.pushes // 2), args.rows)

        print(f"lag at {args.rate:g} pushes/s ...", file=sys.stderr)
        process, answer = _in_process(_stream, a.url, args.rate, args.rows, args.seconds, b.url, _LAG_THREADS)
        streamed = answer.recv()
        process.join(30)
        lags: list[float] = streamed["lags"]
        achieved = streamed["sent"] / streamed["elapsed"] if streamed["elapsed"] else 0.0

        cpus = sorted(os.sched_getaffinity(0))
        b_cpus = others = None
        if len(cpus) >= 2:
            half = max(1, len(cpus) // 2)
            b_cpus, others = set(cpus[:half]), set(cpus[half:])
            _pin(b.pid, b_cpus)
            _pin(os.getpid(), others, descendants=False)  # its children: the servers, pinned apart
            for pid in [a.pid, local.pid]:
                _pin(pid, others)
            for node in cluster.nodes:
                if node.process is not None:
                    _pin(node.process.pid, others)
        print("lookup capacity of B ...", file=sys.stderr)
        window = functools.partial(_window, b.url, b.pid, args.rows, args.seconds, others, b_cpus)
        stream = (a.url, args.rate)
        quiet = window(None, 0.0)
        applying = window(stream, None)
        busy = window(stream, 0.0)
        # An extra window (sampling costs CPU, so its figures are not used): where B's applying goes.
        profiler = Profiler(b.pid, "B applying", args.seconds, tuple(sorted(others or ())) or None)
        window(stream, None)
        profile = profiler.finish()
        bitwise = _same_bytes([a.url, b.url])
        load_after = _load()
        took = time.perf_counter() - began

        date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        command = "python -m benchmarks.replication.replicas " + shlex.join(list(argv or sys.argv[1:]))
        print(f"# Replication cost — {date}\n")
        print(f"Command: `{command.strip()}` (took {took:.0f} s)  ")
        print(f"Machine: {platform.node()}, {os.cpu_count()} CPUs, {_cpu()}, Linux {platform.release()}  ")
        print(f"Load average (1, 5, 15 min): {load_before} before, {load_after} after  ")
        print(f"Data on: {workdir} (NATS stores and the local log)  ")
        print(
            "Every robez server: 1 worker, 1 kernel thread; NATS: 3 nodes, R3 streams, sync_interval always. "
            "Compare figures of this run with each other, not with other runs.\n"
        )
        print(f"## Update latency, {args.rows} ids x {DIM} per push (binary, HTTP on loopback)\n")
        print(
            f"{args.rounds} alternating rounds of replicated (to A) and local pushes; p50/p99 pooled over "
            "the rounds; the ratio is the median of the rounds' p50 ratios (their range in brackets).\n"
        )
        print(
            "| writers | replicated p50 ms | p99 ms | updates/s | local `always` p50 ms | p99 ms | updates/s "
            "| p50 ratio | goal <= 2 |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for writers, replicated_f, baseline_f, ratios, _ in rows_out:
            ratio = statistics.median(ratios)
            cells = [str(writers)]
            cells += [f"{replicated_f[k]:.2f}" for k in ("p50_ms", "p99_ms", "per_s")]
            cells += [f"{baseline_f[k]:.2f}" for k in ("p50_ms", "p99_ms", "per_s")]
            cells.append(f"{ratio:.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
            cells.append(
                _verdict(ratio <= 2.0, f"{ratio:.2f}x" if ratio <= 2 else f"over by {ratio - 2:.2f}")
            )
            print("| " + " | ".join(cells) + " |")
        print(
            "\nWhere a replicated push's time goes at A: medians of the Server-Timing stages of that row's "
            "pushes (whole request in the server; publish -> quorum ack; ack -> applied here), and the "
            "mean optimizer step of the applier from /metrics:\n"
        )
        print(
            "| writers | in the server ms | publish -> quorum ack ms | ack -> applied here ms "
            "| the rest (decode, checks, encode) ms | optimizer step ms |"
        )
        print("|---|---|---|---|---|---|")
        for writers, _, _, _, split in rows_out:
            total, publish, wait = (split.get(k, float("nan")) for k in ("total", "publish", "apply_wait"))
            print(
                f"| {writers} | {total:.2f} | {publish:.2f} | {wait:.2f} | {total - publish - wait:.2f} "
                f"| {split['step']:.2f} |"
            )
        one_writer = rows_out[0]
        floor_share = floor["p50_ms"] / one_writer[1]["p50_ms"]
        print(
            f"\nThe log engine's own floor: the same payload appended straight to a scratch table's log "
            f"(`JetStreamLog.append`, 3 nodes, quorum ack, one at a time, no robez server): "
            f"p50 {floor['p50_ms']:.2f} ms, p99 {floor['p99_ms']:.2f} ms — {floor_share:.0%} of the "
            f"replicated p50 at 1 writer; the local log's whole push (HTTP, checks, fdatasync, step) "
            f"took {one_writer[2]['p50_ms']:.2f} ms, so JetStream's ack alone is "
            f"{floor['p50_ms'] / one_writer[2]['p50_ms']:.2f}x of it."
        )
        print(f"\nBitwise after the runs: {bitwise} (`GET /v1/tables/demo/checksum`).")
        print(
            f"\n## Replication lag, aiming at {args.rate:g} pushes/s to A (achieved {achieved:.0f}/s), "
            "seen at B\n"
        )
        print(
            f"{len(lags)} pushes from {_LAG_THREADS} paced threads in a process of their own, each push "
            f"followed by the lag probe at B; refused pushes by status: {streamed['failed'] or 'none'}.\n"
        )
        p99 = percentile(lags, 99) * 1e3
        rate_note = (
            "" if achieved >= 0.95 * args.rate else f", at {achieved:.0f}/s instead of {args.rate:g}/s"
        )
        print("| p50 ms | p99 ms | max ms | goal p99 < 50 ms |")
        print("|---|---|---|---|")
        print(
            f"| {percentile(lags, 50) * 1e3:.2f} | {p99:.2f} "
            f"| {max(lags) * 1e3 if lags else float('nan'):.2f} "
            f"| {_verdict(p99 < 50 and not rate_note, f'{p99:.1f} ms{rate_note}')} |"
        )
        pinned = (
            f"B and its lookup client pinned to CPU(s) {_cpu_list(b_cpus)} (sharing them in every window); "
            f"the NATS nodes, A, the local server and the pushing process on CPU(s) {_cpu_list(others)}"
            if b_cpus and others
            else "one CPU: nothing pinned"
        )
        print(
            f"\n## Lookups at B ({args.rows} ids, binary, one client process, 4 connections back to back)\n"
        )
        print(f"{pinned}; {args.seconds:g} s per window; B's CPU use from /proc.\n")
        print(
            "| window | lookups/s | latency p50 ms | p99 ms | B's CPU use (cores) "
            "| pushes/s streaming into A |"
        )
        print("|---|---|---|---|---|---|")
        windows = (
            ("lookups", quiet),
            ("updates streaming, no lookups", applying),
            ("lookups + updates streaming", busy),
        )
        for label, each in windows:
            print(
                f"| {label} | {each['per_s']:.0f} | {each['p50_ms']:.2f} | {each['p99_ms']:.2f} "
                f"| {each['cpu_s'] / each['wall_s']:.2f} | {each['pushes_per_s']:.0f} |"
            )
        ratio = busy["per_s"] / quiet["per_s"] if quiet["per_s"] else float("nan")
        share = applying["cpu_s"] / applying["wall_s"]
        per_push = share / applying["pushes_per_s"] * 1e3 if applying["pushes_per_s"] else float("nan")
        print(
            f"\nLookups/s with updates streaming / without: {ratio:.2f} — goal >= 0.9: "
            f"{_verdict(ratio >= 0.9, f'{ratio:.2f}')}. Applying the stream alone took {share:.2f} of B's "
            f"cores ({per_push:.2f} ms of CPU per push: receiving it from NATS, decoding, the checked "
            "optimizer step), which lookups can no longer use."
        )
        if profile.error:
            print(f"\nNo profile of B's applying: {profile.error}.")
        else:
            print(
                f"\nWhere B's applying goes (py-spy, {profile.samples} samples of the thread holding the GIL "
                "in an extra window of updates streaming, no lookups), innermost frames: "
                + ", ".join(f"`{frame}` {share:.0%}" for frame, share in profile.top_self[:8])
                + "."
            )
        return 0
    finally:
        for server in servers:
            server.stop()
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
