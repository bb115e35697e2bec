"""Replicas at production size: pushes during a snapshot upload, upload and bootstrap cost, disk per node.

    python -m benchmarks.replication.scale [--memory-log2 26] [--pushes 1000] [--every 300]

Starts, on loopback: a 3-node NATS JetStream cluster (devtools.natscluster: file storage, R3,
``sync_interval: always``) and two replicas A and B (1 worker, 1 kernel thread each), with two tables:
``big`` (memory_size 2**``--memory-log2``, d = 64, Adam: 12 bytes of state per float, 768 MiB at 2**26)
and ``wide`` (memory_size 2**20, d = 128, Adam). Uploads every ``--every`` updates of a table
(``ROBEZ_REPLICA_SNAPSHOT_EVERY_UPDATES``), log trimmed to 0 entries below the snapshot. Measures:

1. push latency, one push at a time alternating between A and B: 256 x 64 to ``big`` and 4096 x 128 to
   ``wide`` (a 2 MiB body), while no upload runs, then while ``big``'s first upload runs (from the start
   of its copy, lock-free but for its last round, to the upload's end, per the replicas' logs);
2. that upload: the copy's longest update-lock hold (the robez.store log line), upload time, and the
   uploading replica's peak extra PSS (sum of ``/proc/<pid>/smaps_rollup`` Pss minus Pss_Shmem over its
   process tree, sampled every 0.1 s: the shared-memory tables are the table itself, and PSS counts their
   pages only where a mapping touched them), minus its peak during the same pushes before any upload;
3. after ``--pushes`` pushes of 256 x 64 to ``big`` in all (and every upload done): the bytes on disk of
   the snapshot bucket's stream and of ``big``'s log stream on each NATS node;
4. bootstrap: a third replica C started then loads ``big`` from the Object Store snapshot (the log is
   trimmed below it): time from its applier starting to the table loaded, and its peak extra PSS
   meanwhile (as in 2, minus its PSS once loaded); C's checksum equals A's and B's.

Prints a Markdown report (machine, CPU, load, date, command) for docs/benchmarks/replication-scale-
<date>.md. Everything it starts is stopped by pid; its working directory (NATS stores, logs) and shared
memory (under ``/dev/shm/robez-bench-scale-<pid>``) are removed at the end.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import numpy as np

from devtools.natscluster import NatsCluster
from loadtest.launch import RobezProcess
from loadtest.server import tree_pids
from robez_core import hostinfo

_ADAM = {"name": "adam", "lr": 0.01}
_LINE = re.compile(r"^(\S+ \S+) INFO robez\.replication: table (\w+): (.*)$", re.MULTILINE)
_MIB = 1 << 20
# The replicas' shared memory: on tmpfs (the default /dev/shm), in a folder of this run, removed at the end.
_SHM_ROOT = Path("/dev/shm") / f"robez-bench-scale-{os.getpid()}"


class _Server(RobezProcess):
    log_path: Path  # always given

    def __init__(self, name: str, workdir: Path, nats_urls: list[str], env: dict[str, str]) -> None:
        self.name = name
        (workdir / name).mkdir(parents=True)
        (_SHM_ROOT / name).mkdir(parents=True)
        super().__init__(
            ["--nats", ",".join(nats_urls), "--replica-name", name],
            {
                "ROBEZ_SHM_DIR": str(_SHM_ROOT / name),  # tmpfs, as in production
                "ROBEZ_THREADS_PER_WORKER": "1",
                "ROBEZ_DEFAULT_TABLE": "false",
                "ROBEZ_MAX_TOTAL_MEMORY_BYTES": str(16 << 30),
                "TMPDIR": str(workdir / name),  # upload and download scratch files, on disk
                **env,
            },
            log_path=workdir / name / "server.log",
        )
        self.spawn()

    def wait_ready(self, timeout_s: float = 600.0, **_: object) -> _Server:
        super().wait_ready(timeout_s, interval_s=0.2)
        return self

    def events(self, table: str, what: str) -> list[tuple[float, int, str]]:
        """(unix time, version, message) of the applier's lines ``<what> ... at version V`` for ``table``."""
        found = []
        for stamp, name, message in _LINE.findall(self.log_path.read_text(errors="replace")):
            matched = re.match(rf"{what}.* at version (\d+)", message)
            if name == table and matched:
                when = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
                found.append((when, int(matched[1]), message))
        return found

    def holds(self, table: str) -> dict[int, float]:
        """version -> the longest update-lock hold (s) of the copy of ``table`` at that version, as the
        robez.store log says (``live_copy.consistent_copy``)."""
        found = re.findall(
            rf"table '{table}': state copied at version (\d+) in .*the update lock held at most ([\d.]+) ms",
            self.log_path.read_text(errors="replace"),
        )
        return {int(version): float(ms) / 1e3 for version, ms in found}

    def pss_bytes(self) -> int:
        """PSS of the process tree without its shared-memory (tmpfs) pages: the tables' arrays, whose
        bytes are the table itself, not extra, and which PSS counts only where a mapping has touched them
        (a table just loaded through one mapping and served through another shows few)."""
        total = 0
        for pid in tree_pids(self.pid):
            try:
                text = Path(f"/proc/{pid}/smaps_rollup").read_text()
            except OSError:
                continue
            pss = re.search(r"^Pss:\s+(\d+) kB", text, re.MULTILINE)
            shmem = re.search(r"^Pss_Shmem:\s+(\d+) kB", text, re.MULTILINE)
            total += (int(pss[1]) - (int(shmem[1]) if shmem else 0)) * 1024 if pss else 0
        return total

    def checksum(self, table: str) -> tuple[int, str]:
        answer = httpx.get(f"{self.url}/v1/tables/{table}/checksum", timeout=120).json()
        return int(answer["version"]), str(answer["sha256"])

    def version(self, table: str) -> int:
        return int(httpx.get(f"{self.url}/v1/tables/{table}", timeout=30).json()["version"])


class _Pusher:
    """Pushes one at a time, alternating replicas; records (start unix time, seconds, kind)."""

    def __init__(self, servers: list[_Server]) -> None:
        self.clients = [httpx.Client(base_url=server.url, timeout=60) for server in servers]
        self.rng = np.random.default_rng(7)
        self.count = 0
        self.records: list[tuple[float, float, str]] = []
        self.big_pushes = 0

    def push(self, table: str, rows: int, dim: int) -> None:
        ids = self.rng.integers(0, 10_000_000, rows, dtype="<i8")
        grads = self.rng.standard_normal((rows, dim), dtype=np.float32)
        body = ids.tobytes() + grads.astype("<f4").tobytes()
        headers = {"Content-Type": "application/octet-stream", "X-Robez-Shape": f"{rows},{dim}"}
        client = self.clients[self.count % len(self.clients)]
        self.count += 1
        began, start = time.time(), time.perf_counter()
        response = client.post(f"/v1/tables/{table}/update", content=body, headers=headers)
        seconds = time.perf_counter() - start
        response.raise_for_status()
        self.records.append((began, seconds, f"{rows}x{dim}"))
        if table == "big":
            self.big_pushes += 1

    def round(self) -> None:
        """Three 256 x 64 pushes to ``big`` and one 4096 x 128 to ``wide``."""
        for _ in range(3):
            self.push("big", 256, 64)
        self.push("wide", 4096, 128)

    def close(self) -> None:
        for client in self.clients:
            client.close()


class _Sampler:
    """PSS of a server's process tree every 0.1 s in a thread."""

    def __init__(self, server: _Server) -> None:
        self.server = server
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self.server.pss_bytes()))
            self._stop.wait(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, start: float, end: float) -> list[int]:
        return [value for when, value in self.samples if start <= when <= end]


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) * 1e3 if values else float("nan")


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def _node_bytes(cluster: NatsCluster, prefix: str) -> list[tuple[str, int]]:
    """Bytes on disk per node of the streams whose names start with ``prefix``."""
    out = []
    for node in cluster.nodes:
        streams = [p for p in node.store_dir.rglob("streams/*") if p.is_dir() and p.name.startswith(prefix)]
        out.append((node.name, sum(_du(p) for p in streams)))
    return out


def _wait(condition: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out: {what}")
        time.sleep(0.1)


def _uploads(servers: list[_Server], table: str) -> list[tuple[str, float, float, int, float, float]]:
    """Finished uploads: (replica, copy start, end time, version, longest lock hold s, upload seconds)."""
    out = []
    for server in servers:
        copies = {v: (t, m) for t, v, m in server.events(table, "state")}
        holds = server.holds(table)
        for end, version, message in server.events(table, "snapshot"):
            if "uploaded in" not in message or version not in copies:
                continue
            copied, copy_message = copies[version]
            held = holds.get(version, float("nan"))  # the copy is lock-free but for its last round
            seconds = float(re.search(r"copied to a file in ([\d.]+) s", copy_message)[1])  # type: ignore[index]
            start = copied - seconds  # the line is logged once the copy is done
            took = float(re.search(r"uploaded in ([\d.]+) s", message)[1])  # type: ignore[index]
            out.append((server.name, start, end, version, held, took))
    return sorted(out, key=lambda upload: upload[3])


def _latency_table(records: list[tuple[float, float, str]]) -> dict[str, tuple[int, float, float, float]]:
    kinds: dict[str, list[float]] = {}
    for _, seconds, kind in records:
        kinds.setdefault(kind, []).append(seconds)
    return {
        kind: (len(v), _percentile(v, 50), _percentile(v, 99), max(v) * 1e3)
        for kind, v in sorted(kinds.items())
    }


def _load() -> str:
    return ", ".join(f"{value:.2f}" for value in os.getloadavg())


def _verdict(met: bool, text: str) -> str:
    return f"met ({text})" if met else f"**missed** ({text})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.replication.scale", description=__doc__)
    parser.add_argument("--memory-log2", type=int, default=26, help="big table: memory_size 2**this")
    parser.add_argument("--pushes", type=int, default=1000, help="256 x 64 pushes to big in all")
    parser.add_argument("--every", type=int, default=300, help="upload every this many updates of a table")
    parser.add_argument("--baseline-rounds", type=int, default=40, help="push rounds with no upload running")
    parser.add_argument("--dir", type=Path, default=Path.cwd(), help="parent of the working directory")
    args = parser.parse_args(argv)
    if args.baseline_rounds * 3 >= args.every:
        parser.error("--baseline-rounds x 3 must stay under --every (no upload during the baseline)")

    load_before = _load()
    began = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix=".robez-bench-scale-", dir=args.dir))
    cluster = NatsCluster(workdir / "nats", size=3)
    servers: list[_Server] = []
    pusher: _Pusher | None = None
    sampler: _Sampler | None = None
    env = {
        "ROBEZ_REPLICA_SNAPSHOT_EVERY_UPDATES": str(args.every),
        "ROBEZ_REPLICA_SNAPSHOT_INTERVAL_S": "3600",
        "ROBEZ_REPLICA_TRIM_KEEP": "0",
        **cluster.robez_env(),  # the cluster's login and TLS, as every robez replica needs
    }
    big = {
        "num_embeddings": 10_000_000,
        "embedding_dim": 64,
        "memory_size": 1 << args.memory_log2,
        "chunk_size": 8,
    }
    wide = {"num_embeddings": 10_000_000, "embedding_dim": 128, "memory_size": 1 << 20, "chunk_size": 8}
    state_bytes = 12 * big["memory_size"] + 8
    try:
        cluster.start()
        cluster.wait_for_jetstream()
        a = _Server("A", workdir, cluster.urls, env)
        b = _Server("B", workdir, cluster.urls, env)
        servers += [a, b]
        a.wait_ready()
        b.wait_ready()
        for name, config in (("big", big), ("wide", wide)):
            answer = httpx.post(
                f"{a.url}/v1/tables", json={"name": name, "config": config, "optimizer": _ADAM}, timeout=600
            )
            if answer.status_code != 503:  # 503: in the catalog, still being allocated here
                answer.raise_for_status()
            for server in (a, b):
                _wait(
                    lambda s=server, n=name: (
                        httpx.get(f"{s.url}/v1/tables/{n}", timeout=30).status_code == 200
                    ),
                    600,
                    f"{name} on {server.name}",
                )
        pusher = _Pusher([a, b])
        samplers = {server.name: _Sampler(server) for server in (a, b)}

        # 1. No upload running.
        baseline_start = time.time()
        for _ in range(args.baseline_rounds):
            pusher.round()
        baseline = list(pusher.records)
        baseline_end = time.time()
        # 2. Up to the first upload of big, then pushing on while it runs.
        while pusher.big_pushes < args.every:
            pusher.push("big", 256, 64)
        upload_rounds_start = len(pusher.records)
        while not _uploads([a, b], "big"):
            pusher.round()
            if len(pusher.records) - upload_rounds_start > 20_000:
                raise RuntimeError("the upload never finished")
        (uploader, copy_at, upload_end, upload_version, lock_held, upload_s) = _uploads([a, b], "big")[0]
        during = [
            r for r in pusher.records[upload_rounds_start:] if copy_at <= r[0] and r[0] + r[1] <= upload_end
        ]
        sampler_of = samplers[uploader]
        # Against the peak while the same pushes ran without an upload (a push's own buffers count in both).
        before_pss = max(sampler_of.between(baseline_start, baseline_end) or [0])
        peak_pss = max(sampler_of.between(copy_at, upload_end + 0.5) or [0])
        for each in samplers.values():
            each.stop()
        # 3. The rest of the pushes, then every upload done.
        while pusher.big_pushes < args.pushes:
            pusher.push("big", 256, 64)
        target = a.version("big")
        last_due = (target // args.every) * args.every
        _wait(
            lambda: any(v >= last_due for *_, v, _, _ in _uploads([a, b], "big")),
            900,
            f"the upload at version {last_due}",
        )
        time.sleep(2.0)  # the last upload's purge of the previous object's chunks
        obj_bytes = _node_bytes(cluster, "OBJ_robez_snapshots")
        log_bytes = _node_bytes(cluster, "robez_big_")
        uploads = _uploads([a, b], "big")
        wide_stored = 12 * wide["memory_size"] + 8 if _uploads([a, b], "wide") else 0
        # 4. Bootstrap of a third replica.
        c = _Server("C", workdir, cluster.urls, env)
        servers.append(c)
        sampler = _Sampler(c)
        c.wait_ready()
        time.sleep(1.0)
        sampler.stop()
        loaded = c.events("big", "bootstrapped")
        text = c.log_path.read_text(errors="replace")
        start_line = re.search(
            r"^(\S+ \S+) INFO robez\.replication: worker \d+ applies the log", text, re.MULTILINE
        )
        applier_start = datetime.datetime.strptime(start_line[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()  # type: ignore[index]
        boot_end = loaded[0][0] if loaded else float("nan")
        boot_peak = max(sampler.between(applier_start, boot_end + 0.5) or [0])
        boot_after = statistics.median([v for t, v in sampler.samples if t > boot_end + 0.5] or [0])
        for server in (a, b, c):
            _wait(lambda s=server: s.version("big") >= target, 300, f"{server.name} at {target}")
        sums = {server.name: server.checksum("big") for server in (a, b, c)}
        load_after = _load()
        elapsed = time.perf_counter() - began
    finally:
        if pusher is not None:
            pusher.close()
        for server in servers:
            server.stop()
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(_SHM_ROOT, ignore_errors=True)

    base_table = _latency_table(baseline)
    during_table = _latency_table(during)
    snapshot_mib = state_bytes / _MIB
    upload_extra = (peak_pss - before_pss) / _MIB
    boot_extra = (boot_peak - boot_after) / _MIB
    lines = [
        f"# Replicas at scale: snapshot uploads, bootstrap, disk — {datetime.date.today().isoformat()}",
        "",
        f"Command: `python -m benchmarks.replication.scale {shlex.join(argv or sys.argv[1:])}`  ",
        f"Machine: {platform.node()}, {hostinfo.cpu_model()}, {hostinfo.logical_cpus()} logical CPUs, "
        f"{hostinfo.memory_gib():.0f} GiB; Python {platform.python_version()}  ",
        f"Date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}; load average before "
        f"{load_before}, after {load_after}; {elapsed:.0f} s in all  ",
        "Setup: 3 NATS nodes (R3, file storage, `sync_interval: always`), replicas A and B (1 worker, "
        f"1 kernel thread each); `big`: memory_size 2**{args.memory_log2}, d 64, Adam = {snapshot_mib:.0f} "
        f"MiB of state; `wide`: 2**20, d 128, Adam. Upload every {args.every} updates, trim keep 0. "
        "Pushes one at a time alternating A/B: 256 x 64 to `big`, 4096 x 128 to `wide`.",
        "",
        "## Push latency (ms), without and during an upload of `big`",
        "",
        "| push | no upload: n | p50 | p99 | max | during the upload: n | p50 | p99 | max |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in sorted(set(base_table) | set(during_table)):
        n0, p50_0, p99_0, max0 = base_table.get(kind, (0, float("nan"), float("nan"), float("nan")))
        n1, p50_1, p99_1, max1 = during_table.get(kind, (0, float("nan"), float("nan"), float("nan")))
        lines.append(
            f"| {kind} | {n0} | {p50_0:.1f} | {p99_0:.1f} | {max0:.1f} "
            f"| {n1} | {p50_1:.1f} | {p99_1:.1f} | {max1:.1f} |"
        )
    lines += [
        "",
        f"## The upload (replica {uploader}, version {upload_version})",
        "",
        f"- the copy's longest update-lock hold: {lock_held:.3f} s; upload (finish the file, stream it, "
        f"trim): {upload_s:.1f} s; copy start to upload end {upload_end - copy_at:.1f} s",
        f"- PSS of {uploader}'s process tree (shared-memory tables left out): peak "
        f"{before_pss / _MIB:.0f} MiB during the pushes without an upload, "
        f"peak {peak_pss / _MIB:.0f} MiB during: extra {upload_extra:.0f} MiB = "
        f"{upload_extra / snapshot_mib:.3f} x the snapshot",
        "- all uploads of `big` (replica, version, longest lock hold s, upload s): "
        + ", ".join(f"{u[0]} {u[3]} {u[4]:.3f} {u[5]:.1f}" for u in uploads),
        "",
        f"## Disk per NATS node after {args.pushes} pushes of 256 x 64 to `big` (all uploads done)",
        "",
        "| node | Object Store stream (MiB) | / the snapshots stored | `big`'s log stream (MiB) |",
        "|---|---|---|---|",
    ]
    for (node, obj), (_, log) in zip(obj_bytes, log_bytes, strict=True):
        lines.append(
            f"| {node} | {obj / _MIB:.0f} | {obj / (state_bytes + wide_stored):.2f} | {log / _MIB:.1f} |"
        )
    obj_ratio = max(obj for _, obj in obj_bytes) / (state_bytes + wide_stored)
    lines += [
        "",
        "(Ratio: bytes on disk over the bytes of the snapshots stored: `big`'s"
        + (f" and `wide`'s ({wide_stored / _MIB:.0f} MiB)" if wide_stored else "")
        + ".)",
        "",
        "## Bootstrap of a third replica C from the Object Store snapshot",
        "",
        f"- applier start to `big` loaded: {boot_end - applier_start:.1f} s",
        f"- PSS of C's tree (shared-memory tables left out): peak {boot_peak / _MIB:.0f} MiB during, "
        f"{boot_after / _MIB:.0f} MiB once loaded: extra {boot_extra:.0f} MiB = "
        f"{boot_extra / snapshot_mib:.3f} x the snapshot",
        "- checksums at version "
        + ", ".join(f"{name} {v}: {s[:12]}" for name, (v, s) in sums.items())
        + (" — bitwise equal" if len({s for _, s in sums.values()}) == 1 else " — **differ**"),
        "",
        "## Goals",
        "",
    ]
    p99_ratio = max(
        during_table[k][2] / base_table[k][2]
        for k in during_table
        if k in base_table and base_table[k][2] > 0
    )
    lines += [
        "- push p99 during an upload within 2x of without: "
        + _verdict(p99_ratio <= 2.0, f"worst ratio {p99_ratio:.2f}"),
        "- extra PSS during an upload < 0.25x the snapshot: "
        + _verdict(upload_extra < 0.25 * snapshot_mib, f"{upload_extra / snapshot_mib:.3f}x"),
        "- extra PSS during a bootstrap < 0.25x the snapshot: "
        + _verdict(boot_extra < 0.25 * snapshot_mib, f"{boot_extra / snapshot_mib:.3f}x"),
        "- Object Store within 1.2x of one snapshot per table: "
        + _verdict(obj_ratio <= 1.2, f"{obj_ratio:.2f}x"),
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
