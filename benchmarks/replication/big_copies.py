"""A replica with a big table (issue 39): what its second copies of the table cost while pushes go on.

Starts, on loopback, a NATS JetStream cluster of ``--nats-nodes`` nodes (streams of as many replicas)
and one robez replica (``robez serve --nats ... --workers W``, with a data directory unless
``--no-data-dir``; its shared memory in a folder of its own under /dev/shm), creates through it one table
of ``--memory-size`` floats (d 128, Z 32, adam: 3 x 4 x memory_size bytes of state), times ``--requests``
pushes of ``--push-ids`` ids at rest (binary bodies, one client), then, with that client pushing all
along:

1. ``GET .../checksum`` on the replica, after and before ``--window-pushes`` pushes (a replica keeps no
   log of its own: the granules changed during the lock-free pass come from the array's record of them,
   ``service/log/granules.py``);
2. the replica's snapshot, started by its own count (``ROBEZ_REPLICA_SNAPSHOT_EVERY_UPDATES`` =
   ``ROBEZ_REPLICA_LOCAL_SNAPSHOT_EVERY_UPDATES`` = ``--snapshot-every``: with a data directory one copy
   is both the local snapshot and the upload, as the applier does when both are due): the copy to a file
   in the background of the applier (``TableStore.copy_to_file``), the local snapshot's finish (checksums,
   fsync, rename), the upload to the Object Store and the log's trim; the benchmark waits for the
   replica's log to say the upload is over (or failed), at most ``--max-seconds``.

For each: its duration (the checksum's request; the snapshot's copy, finish and upload from the replica's
log lines and their timestamps), the longest update-lock hold its copy logged
(``live_copy.consistent_copy``), the peak extra memory (the PSS of the replica's processes with its
shared-memory files counted once, ``big_tables.server_memory_bytes``, sampled ten times a second, minus
the reading just before; beside it the growth of the replica's shared-memory folder and of the NATS
nodes' PSS), and the pushes' latency p50 / p99 / max during the copy, during the rest of the snapshot
(finish and upload) and outside both in the same run; and of each, those that overlapped no memory
reading (a reading walks the page tables of the 768 MiB mappings and can stall a push that overlaps it:
docs/benchmarks/copies-2026-11-27.md). Goals (issue 39): hold <= 100 ms, extra memory <= 0.25 x state.

    python -m benchmarks.replication.big_copies [--memory-size 67108864] [--workers 2] [--nats-nodes 1]
        [--snapshot-every 1000] [--no-data-dir] [--tree DIR]

``--tree``: the source tree whose ``python -m service`` the replica runs (default: the installed
``robez``), to compare a branch with main's tree. ``--snapshot-every`` must exceed the pushes before the
snapshot's part (at rest and around the checksum, a few hundred): the report says if a snapshot started
earlier. Prints a Markdown report (machine, CPU, load average before and after, date, command) for
docs/benchmarks/.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.service.big_tables import (
    CHUNK,
    DIM,
    BigServer,
    Pusher,
    apart,
    log_since,
    percentiles,
    server_memory_bytes,
)
from devtools.natscluster import NatsCluster
from robez_core.hostinfo import cpu_model

MiB = 1 << 20
TABLE = "big"
# A graceful stop longer than this (1-7 s measured) has the replica's log lines since SIGTERM reported.
_SLOW_STOP_S = 20.0
_SLOW_STOP_LINES = 40
# A replica log line's timestamp (the logging format's asctime).
_STAMP = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) "
_HOLD = re.compile(
    _STAMP + r".*table 'big': state copied at version (\d+) in ([\d.]+) s \((.*?)\); "
    r"the update lock held at most ([\d.]+) ms",
    re.MULTILINE,
)
_FILE_COPY = re.compile(
    _STAMP + r".*table big: state at version (\d+) copied to a file in ([\d.]+) s", re.MULTILINE
)
_LOCAL = re.compile(_STAMP + r".*table big: local snapshot at version (\d+) written", re.MULTILINE)
_UPLOADED = re.compile(
    _STAMP + r".*table big: snapshot at version (\d+) uploaded in ([\d.]+) s", re.MULTILINE
)
_FAILED = re.compile(_STAMP + r".*table big: (?:local )?snapshot (?:failed|not uploaded).*$", re.MULTILINE)


def _when(stamp: str, wall_to_monotonic: float) -> float:
    """A log line's timestamp (local time, ms) on this process's ``time.monotonic()`` clock."""
    wall = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return wall - wall_to_monotonic


@dataclass
class Reading:
    """One memory reading: its (start, end) on the monotonic clock and its figures in bytes."""

    start: float
    end: float
    replica: int  # PSS of the replica's processes, its shared-memory files once
    shm: int  # its shared-memory folder's files
    nats: int  # PSS of the NATS nodes


@dataclass
class Sampler:
    """Memory readings ten times a second on a thread while inside ``running``."""

    server: BigServer
    shm_dir: Path
    nats_pids: list[int]
    readings: list[Reading] = field(default_factory=list)

    def read(self) -> Reading:
        start = time.monotonic()
        replica = server_memory_bytes(self.server.pid, self.shm_dir)
        shm = sum(p.stat().st_blocks * 512 for p in self.shm_dir.rglob("*") if p.is_file())
        nats = sum(server_memory_bytes(pid, self.shm_dir) for pid in self.nats_pids)
        reading = Reading(start, time.monotonic(), replica, shm, nats)
        self.readings.append(reading)
        return reading

    @contextmanager
    def running(self) -> Iterator[None]:
        """Enter before the pusher (a reading can stall a push it overlaps; the first is taken alone)."""
        self.read()
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(0.1):
                self.read()

        thread = threading.Thread(target=loop)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=60)
            self.read()

    def extra(self, start: float, end: float, state_bytes: int) -> str:
        """Peak of the readings overlapping [start, end] minus the last reading ended before ``start``."""
        before = [r for r in self.readings if r.end <= start] or self.readings[:1]
        during = [r for r in self.readings if r.start < end and start < r.end]
        if not during:
            return "no reading overlapped it (too short to sample)"
        base = before[-1]
        replica = max(r.replica for r in during) - base.replica
        shm = max(r.shm for r in during) - base.shm
        nats = max(r.nats for r in during) - base.nats
        return (
            f"**{replica / MiB:,.0f} MiB = state x {replica / state_bytes:.2f}** (before: "
            f"{base.replica / MiB:,.0f} MiB; {len(during)} readings); its /dev/shm folder "
            f"{shm / MiB:+,.0f} MiB; NATS nodes {nats / MiB:+,.0f} MiB"
        )


def _overlapping(spans: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    return [(a, b) for a, b in spans if a < end and start < b]


def _latency_rows(
    row: Callable[[str, str], None],
    what: str,
    spans: list[tuple[float, float]],
    readings: list[tuple[float, float]],
) -> None:
    row(f"pushes {what} ({len(spans)}): p50 / p99 / max", percentiles([b - a for a, b in spans]))
    clear = apart(spans, readings)
    row(f"... of them, overlapping no memory reading ({len(clear)})", percentiles(clear))


def _wait_for(done: Callable[[], bool], max_seconds: float) -> bool:
    deadline = time.monotonic() + max_seconds
    while time.monotonic() < deadline:
        if done():
            return True
        time.sleep(0.2)
    return done()


def _load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.replication.big_copies", description=__doc__)
    parser.add_argument("--memory-size", type=int, default=1 << 26)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--nats-nodes", type=int, default=1, choices=(1, 3))
    parser.add_argument("--push-ids", type=int, default=256)
    parser.add_argument("--requests", type=int, default=200, help="pushes timed at rest")
    parser.add_argument("--window-pushes", type=int, default=100, help="pushes before and after the checksum")
    parser.add_argument("--snapshot-every", type=int, default=1000, help="the replica's snapshot count")
    parser.add_argument("--max-seconds", type=float, default=600.0, help="the snapshot's part, at most")
    parser.add_argument("--no-data-dir", action="store_true", help="a replica without a data directory")
    parser.add_argument(
        "--tree", type=Path, default=None, help="the source tree the replica runs from (default: this one)"
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="parent of the NATS stores (default: TMPDIR)"
    )
    args = parser.parse_args(argv)
    load_before = _load()
    began = time.monotonic()
    state_bytes = 3 * 4 * args.memory_size
    workdir = Path(tempfile.mkdtemp(prefix="robez-bench-bigcopies-", dir=args.workdir))
    shm_dir = Path(tempfile.mkdtemp(prefix="robez-bench-bigcopies-", dir="/dev/shm"))
    lines: list[str] = []
    notes: list[str] = []

    def row(what: str, figure: str) -> None:
        lines.append(f"| {what} | {figure} |")
        print(lines[-1], file=sys.stderr, flush=True)

    cluster = NatsCluster(workdir / "nats", size=args.nats_nodes)
    server: BigServer | None = None
    try:
        cluster.start()
        cluster.wait_for_jetstream()
        every = str(args.snapshot_every)
        server = BigServer(
            None if args.no_data_dir else workdir / "data",
            shm_dir,
            args.workers,
            workdir / "replica.log",
            args.tree,
            args=["--nats", ",".join(cluster.urls), "--replica-name", "a"],
            env={
                **cluster.robez_env(),
                "ROBEZ_NATS_REPLICAS": str(args.nats_nodes),
                "ROBEZ_REPLICA_SNAPSHOT_EVERY_UPDATES": every,
                "ROBEZ_REPLICA_LOCAL_SNAPSHOT_EVERY_UPDATES": every,
                "ROBEZ_REPLICA_SNAPSHOT_INTERVAL_S": "0",
            },
        )
        server.start(sample_memory=False)
        nats_pids = [node.process.pid for node in cluster.nodes if node.process is not None]
        sampler = Sampler(server, shm_dir, nats_pids)
        wall_to_monotonic = time.time() - time.monotonic()
        config = {"num_embeddings": 1 << 40, "embedding_dim": DIM, "memory_size": args.memory_size}
        config["chunk_size"] = CHUNK
        start = time.perf_counter()
        httpx.post(
            f"{server.url}/v1/tables",
            json={"name": TABLE, "config": config, "optimizer": {"name": "adam", "lr": 1e-3}},
            timeout=1200,
        ).raise_for_status()
        row(
            "`POST /v1/tables` on the replica",
            f"{time.perf_counter() - start:.1f} s; replica memory after "
            f"{sampler.read().replica / MiB:,.0f} MiB",
        )
        pusher = Pusher(server.url, args.push_ids, 1, TABLE)
        for _ in range(10):  # connections, kernels
            pusher.push()
        row(
            f"push of {args.push_ids} ids at rest ({args.requests}, no memory reading): p50 / p99 / max",
            percentiles([pusher.push() for _ in range(args.requests)]),
        )

        # 1. The checksum.
        assert server.log_path is not None
        logged = server.log_path.stat().st_size
        with sampler.running(), pusher.during() as during:
            _wait_for(lambda: len(during) >= args.window_pushes, args.max_seconds)
            start = time.monotonic()
            response = httpx.get(f"{server.url}/v1/tables/{TABLE}/checksum", timeout=1200)
            end = time.monotonic()
            response.raise_for_status()
            count = len(during)
            _wait_for(lambda: len(during) >= count + args.window_pushes, args.max_seconds)
        text = log_since(server.log_path, logged)
        readings = [(r.start, r.end) for r in sampler.readings]
        row("`GET .../checksum` on the replica: duration (one pusher running)", f"{end - start:.2f} s")
        holds = _HOLD.findall(text)
        row(
            "the checksum's longest update-lock hold (replica log)",
            f"**{float(holds[-1][4]):,.1f} ms** ({holds[-1][3]})" if holds else "not logged",
        )
        row("the checksum's peak extra memory", sampler.extra(start, end, state_bytes))
        spans = pusher.spans
        _latency_rows(row, "during the checksum", _overlapping(spans, start, end), readings)
        outside = [span for span in spans if span not in _overlapping(spans, start, end)]
        _latency_rows(row, "before and after it", outside, readings)
        if pusher.failures:
            notes.append(f"{len(pusher.failures)} pushes failed around the checksum: {pusher.failures[0]}")
        if _FILE_COPY.search(text):
            notes.append("a snapshot started during the checksum's run: raise --snapshot-every")

        # 2. The snapshot, started by the replica's own count.
        logged = server.log_path.stat().st_size
        sampler.readings.clear()

        def over() -> bool:
            text = log_since(server.log_path, logged)
            return bool(_UPLOADED.search(text) or _FAILED.search(text))

        with sampler.running(), pusher.during():
            finished = _wait_for(over, args.max_seconds)
            after = len(pusher.spans)
            _wait_for(lambda: len(pusher.spans) >= after + args.window_pushes, args.max_seconds)
        text = log_since(server.log_path, logged)
        readings = [(r.start, r.end) for r in sampler.readings]
        spans = pusher.spans
        copies, uploads = _FILE_COPY.findall(text), _UPLOADED.findall(text)
        if not finished or not copies:
            failed = _FAILED.findall(text)
            notes.append(
                f"no snapshot uploaded in {args.max_seconds:.0f} s: {failed[:1] or 'nothing logged'}"
            )
        else:
            stamp, version, seconds = copies[0]
            copy_end = _when(stamp, wall_to_monotonic)
            copy_start = copy_end - float(seconds)
            upload = next((u for u in uploads if u[1] == version), None)
            local = next((found for found in _LOCAL.findall(text) if found[1] == version), None)
            end = _when(upload[0], wall_to_monotonic) if upload else copy_end
            hold = next((found for found in _HOLD.findall(text) if found[1] == version), None)
            what = "upload and local snapshot (one copy)" if local else "upload"
            row(
                f"the snapshot ({what}), version {version}: the copy to a file (replica log)",
                f"{float(seconds):.2f} s",
            )
            if local:
                finish = _when(local[0], wall_to_monotonic) - copy_end
                row("... then the local snapshot's finish (checksums, fsync, rename)", f"{finish:.1f} s")
            if upload:
                row(
                    "... the upload to the Object Store (replica log; the finish included)",
                    f"{float(upload[2]):.1f} s",
                )
            row(
                "the snapshot copy's longest update-lock hold (replica log)",
                f"**{float(hold[4]):,.1f} ms** ({hold[3]})" if hold else "not logged",
            )
            row("the copy's peak extra memory", sampler.extra(copy_start, copy_end, state_bytes))
            row(
                "the whole snapshot's (copy, finish, upload) peak extra memory",
                sampler.extra(copy_start, end, state_bytes),
            )
            in_copy = _overlapping(spans, copy_start, copy_end)
            in_rest = [span for span in _overlapping(spans, copy_end, end) if span not in in_copy]
            _latency_rows(row, "during the copy", in_copy, readings)
            _latency_rows(row, "during the finish and upload", in_rest, readings)
            busy = set(in_copy) | set(in_rest)
            _latency_rows(
                row, "outside the snapshot (same run)", [s for s in spans if s not in busy], readings
            )
        if pusher.failures:
            notes.append(f"{len(pusher.failures)} pushes failed around the snapshot: {pusher.failures[0]}")
        logged = server.log_path.stat().st_size
        stop_seconds = server.terminate()
        row("graceful stop of the replica (SIGTERM to exit)", f"{stop_seconds:.1f} s")
        if stop_seconds > _SLOW_STOP_S:  # what the replica said meanwhile, for the report
            said = log_since(server.log_path, logged).splitlines()[-_SLOW_STOP_LINES:]
            notes.append(
                "a slow stop; the replica's log meanwhile:\n\n" + "\n".join(f"    {x}" for x in said)
            )
    finally:
        if server is not None:
            server.kill()
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
    took = time.monotonic() - began
    print(
        "# A replica with a big table: its copies "
        f"({datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC)\n"
    )
    command = "python -m benchmarks.replication.big_copies " + shlex.join(
        list(argv if argv is not None else sys.argv[1:])
    )
    print(f"- command: `{command.strip()}` (took {took:.0f} s)")
    print(f"- machine: {platform.machine()}, {os.cpu_count()} CPUs ({cpu_model()}), {platform.platform()}")
    print(f"- load average (1, 5, 15 min): {load_before} before, {_load()} after")
    print(
        f"- table: m = {args.memory_size:,} (2^{args.memory_size.bit_length() - 1}), d = {DIM}, "
        f"Z = {CHUNK}, adam: {state_bytes / MiB:,.0f} MiB of state; one replica, {args.workers} workers, "
        f"{'no data directory' if args.no_data_dir else 'a data directory'}; "
        f"NATS: {args.nats_nodes} node(s), "
        f"R{args.nats_nodes}, sync_interval always; kernel threads: the default"
    )
    print(
        f"- one client on the same machine pushing {args.push_ids} ids at a time; latencies measured by it\n"
    )
    print("| what | measured |\n|---|---|")
    print("\n".join(lines))
    for note in notes:
        print(f"\nNote: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
