"""What replication costs, over HTTP on loopback: replicated vs single-server updates, lag, lookups.

    python -m service.replication.bench [--pushes 300] [--rows 256] [--rate 200] [--seconds 10]

Starts, on loopback: a 3-node NATS JetStream cluster (file storage, ``sync_interval: always``) with two
robez replicas A and B, and a single robez server with ``--data-dir`` and ``wal_fsync=always`` (the local
log). Every server runs 1 worker with 1 kernel thread and serves the ``demo`` table (d = 64). Measures:

1. update latency p50/p99 and throughput, ``--rows`` ids x 64 per push, binary, with 1 and 8 concurrent
   writers: replicated (pushes to A) vs local;
2. replication lag at ``--rate`` pushes/s to A for ``--seconds``: right after A acknowledges version V,
   a lookup of one id at B with ``X-Robez-Min-Version: V``; lag = from A's acknowledgement to B's
   answer (an upper bound: it includes one loopback round trip to B);
3. lookup throughput at B (1 client, ``--rows`` ids, binary) for ``--seconds``, without updates and
   with ``--rate`` pushes/s streaming into A.

Prints a Markdown report (machine, CPU, date, command) for docs/benchmarks/replication-<date>.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import numpy as np

from .natscluster import NatsCluster, free_ports

_D = 64


class _Server:
    def __init__(self, name: str, workdir: Path, args: list[str], env: dict[str, str]) -> None:
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        base = {k: v for k, v in os.environ.items() if not k.startswith("ROBEZ_")}
        base.update({"ROBEZ_SHM_DIR": str(workdir / name / "shm"), "ROBEZ_THREADS_PER_WORKER": "1", **env})
        (workdir / name).mkdir(parents=True)
        command = [sys.executable, "-m", "service", "serve", "--port", str(self.port), *args]
        self.log = (workdir / name / "server.log").open("wb")
        self.process = subprocess.Popen(command, env=base, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server {self.url} not ready")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def _push_body(rng: np.random.Generator, rows: int) -> tuple[bytes, dict[str, str]]:
    ids = rng.integers(0, 10_000_000, rows, dtype="<i8")
    grads = rng.standard_normal((rows, _D), dtype=np.float32).astype("<f4")
    headers = {"Content-Type": "application/octet-stream", "X-Robez-Shape": f"{rows},{_D}"}
    return ids.tobytes() + grads.tobytes(), headers


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def _updates(url: str, writers: int, pushes: int, rows: int) -> dict[str, float]:
    """``pushes`` updates split over ``writers`` threads; latency per push and overall throughput."""
    latencies: list[float] = []
    lock = threading.Lock()

    def writer(index: int) -> None:
        rng = np.random.default_rng(index)
        mine: list[float] = []
        with httpx.Client(base_url=url, timeout=30) as client:
            for _ in range(pushes // writers):
                body, headers = _push_body(rng, rows)
                start = time.perf_counter()
                response = client.post("/v1/tables/demo/update", content=body, headers=headers)
                mine.append(time.perf_counter() - start)
                response.raise_for_status()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(writers)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    return {
        "p50_ms": _percentile(latencies, 50) * 1e3,
        "p99_ms": _percentile(latencies, 99) * 1e3,
        "per_s": len(latencies) / elapsed,
    }


class _Streamer:
    """Pushes to ``url`` at ``rate``/s in total from ``threads`` threads, each pacing its share; after
    each acknowledgement a thread asks ``follower`` for that version (the lag probe)."""

    def __init__(
        self, url: str, rate: float, rows: int, follower: str | None = None, threads: int = 8
    ) -> None:
        self.url, self.rate, self.rows, self.follower = url, rate, rows, follower
        self.lags: list[float] = []
        self.sent = 0
        self.failed: dict[int, int] = {}
        self.elapsed = 0.0
        self._lock = threading.Lock()
        self.stop = threading.Event()
        self._began = time.perf_counter()
        self.threads = [
            threading.Thread(target=self._run, args=(index, threads), daemon=True) for index in range(threads)
        ]
        for thread in self.threads:
            thread.start()

    def _run(self, index: int, count: int) -> None:
        rng = np.random.default_rng(99 + index)
        one_id = np.zeros(1, dtype="<i8").tobytes()
        period = count / self.rate
        probe_headers = {"Content-Type": "application/octet-stream"}
        with httpx.Client(base_url=self.url, timeout=30) as writer, httpx.Client(timeout=30) as reader:
            next_at = time.perf_counter() + index * period / count
            while not self.stop.is_set():
                time.sleep(max(0.0, next_at - time.perf_counter()))
                next_at += period
                body, headers = _push_body(rng, self.rows)
                response = writer.post("/v1/tables/demo/update", content=body, headers=headers)
                acked = time.perf_counter()
                if response.status_code != 200:
                    with self._lock:
                        self.failed[response.status_code] = self.failed.get(response.status_code, 0) + 1
                    continue
                version = response.json()["version"]
                lag = None
                if self.follower is not None:
                    answer = reader.post(
                        f"{self.follower}/v1/tables/demo/lookup",
                        content=one_id,
                        headers={**probe_headers, "X-Robez-Min-Version": str(version)},
                    )
                    if answer.status_code == 200:
                        lag = time.perf_counter() - acked
                with self._lock:
                    self.sent += 1
                    if lag is not None:
                        self.lags.append(lag)

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)
        self.elapsed = time.perf_counter() - self._began


def _lookups(url: str, rows: int, seconds: float) -> float:
    ids = np.arange(rows, dtype="<i8").tobytes()
    headers = {"Content-Type": "application/octet-stream"}
    count = 0
    with httpx.Client(base_url=url, timeout=30) as client:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            client.post("/v1/tables/demo/lookup", content=ids, headers=headers).raise_for_status()
            count += 1
    return count / seconds


def _means(url: str) -> dict[str, float]:
    """Mean seconds of the replication histograms of the server at ``url`` (demo table)."""
    sums: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        for name in ("robez_replication_publish_ack_seconds", "robez_update_apply_seconds"):
            for part in ("_sum", "_count"):
                if line.startswith(f'{name}{part}{{table="demo"}}'):
                    sums[name + part] = float(line.rsplit(" ", 1)[1])
    return {
        "publish -> quorum ack": sums["robez_replication_publish_ack_seconds_sum"]
        / max(1.0, sums["robez_replication_publish_ack_seconds_count"]),
        "optimizer step under the table lock": sums["robez_update_apply_seconds_sum"]
        / max(1.0, sums["robez_update_apply_seconds_count"]),
    }


def _cpu() -> str:
    model, flags = platform.processor() or "unknown", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                have = set(line.split(":", 1)[1].split())
                flags = " ".join(f for f in ("sse4_2", "avx", "avx2", "fma", "avx512f") if f in have)
    except OSError:
        pass
    return f"{model} ({flags})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.replication.bench", description=__doc__)
    parser.add_argument("--pushes", type=int, default=300, help="updates per latency run")
    parser.add_argument("--rows", type=int, default=256, help="ids per push and per lookup")
    parser.add_argument("--rate", type=float, default=200.0, help="pushes/s for the lag and lookup runs")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the lag and lookup runs")
    parser.add_argument("--dir", type=Path, default=Path.cwd(), help="parent of the working directory")
    args = parser.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix=".robez-bench-replication-", dir=args.dir))
    cluster = NatsCluster(workdir / "nats", size=3)
    servers: list[_Server] = []
    try:
        cluster.start()
        cluster.wait_for_jetstream()
        nats_args = ["--nats", ",".join(cluster.urls)]
        a = _Server("a", workdir, [*nats_args, "--replica-name", "a"], {})
        b = _Server("b", workdir, [*nats_args, "--replica-name", "b"], {})
        local = _Server(
            "local", workdir, ["--data-dir", str(workdir / "local-data")], {"ROBEZ_WAL_FSYNC": "always"}
        )
        servers = [a, b, local]
        for server in servers:
            server.wait_ready()
        for server in (a, local):  # first pushes load kernels and open connections
            _updates(server.url, 1, 10, args.rows)

        rows_out = []
        for writers in (1, 8):
            pushes = max(args.pushes, writers * 10)
            replicated = _updates(a.url, writers, pushes, args.rows)
            baseline = _updates(local.url, writers, pushes, args.rows)
            rows_out.append((writers, replicated, baseline))

        breakdown = _means(a.url)
        quiet = _lookups(b.url, args.rows, args.seconds)
        streamer = _Streamer(a.url, args.rate, args.rows, follower=b.url)
        busy = _lookups(b.url, args.rows, args.seconds)
        streamer.finish()
        lags = streamer.lags

        date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        command = "python -m service.replication.bench " + shlex.join(list(argv or sys.argv[1:]))
        print(f"# Replication cost — {date}\n")
        print(f"Command: `{command.strip()}`  ")
        print(f"Machine: {platform.node()}, {os.cpu_count()} CPUs, {_cpu()}, Linux {platform.release()}  ")
        print(f"Data on: {workdir} (NATS stores and the local log)  ")
        print(
            "Every robez server: 1 worker, 1 kernel thread; NATS: 3 nodes, R3 streams, sync_interval always."
        )
        print("Other developers were loading this 2-core machine: compare only figures of one run.\n")
        print(f"## Update latency, {args.rows} ids x {_D} per push (binary, HTTP on loopback)\n")
        print(
            "| writers | replicated p50 ms | p99 ms | updates/s | local `always` p50 ms | p99 ms | updates/s "
            "| p50 ratio (goal <= 2) |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for writers, replicated, baseline in rows_out:
            ratio = replicated["p50_ms"] / baseline["p50_ms"]
            cells = [writers, replicated["p50_ms"], replicated["p99_ms"], replicated["per_s"]]
            cells += [baseline["p50_ms"], baseline["p99_ms"], baseline["per_s"], ratio]
            print("| " + " | ".join(f"{c:.2f}" if isinstance(c, float) else str(c) for c in cells) + " |")
        achieved = streamer.sent / streamer.elapsed if streamer.elapsed else 0.0
        print(
            f"\n## Replication lag, aiming at {args.rate:g} pushes/s to A "
            f"(achieved {achieved:.0f}/s), seen at B\n"
        )
        print(
            f"{len(lags)} pushes from 8 paced threads, each push followed by the lag probe at B; "
            f"refused pushes by status: {streamer.failed or 'none'}.\n"
        )
        print("| p50 ms | p99 ms | max ms | goal p99 |")
        print("|---|---|---|---|")
        print(
            f"| {_percentile(lags, 50) * 1e3:.2f} | {_percentile(lags, 99) * 1e3:.2f} "
            f"| {max(lags) * 1e3 if lags else float('nan'):.2f} | < 50 ms |"
        )
        print(f"\n## Lookups at B ({args.rows} ids, binary, 1 client, {args.seconds:g} s each)\n")
        print("| without updates /s | with updates streaming /s | ratio (goal >= 0.9) |")
        print("|---|---|---|")
        print(f"| {quiet:.0f} | {busy:.0f} | {busy / quiet:.2f} |")
        print("\nWhere a replicated push's time goes at A (means over every push above, from /metrics): ")
        print(", ".join(f"{name} {value * 1e3:.2f} ms" for name, value in breakdown.items()) + ".")
        print(f"\nLag run median: {statistics.median(lags) * 1e3:.2f} ms" if lags else "")
        return 0
    finally:
        for server in servers:
            server.stop()
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
