"""Where a replicated push's CPU goes in replica A (which takes it) and replica B (which follows).

    python -m benchmarks.replication.push_profile [--pushes 1600] [--single 600] [--py-spy PATH]

Starts a 3-node NATS cluster (TLS and logins as shipped, ``sync_interval: always``) and replicas A and B
(1 worker, 1 kernel thread each), pushes 256 ids x 64 to A with 8 writers (``--pushes``) and then with 1
(``--single``), and reads, for each run: each replica's CPU per push and context switches per push, per
thread, from /proc; and, when py-spy is there (the dev extra installs it; ``--py-spy`` picks another),
its samples of the thread holding the GIL in each replica (``record --gil --nonblocking``, 250 Hz),
sorted into the stages of a push. py-spy samples the GIL holder whether or not the CPU runs it, so the
shares are of Python's time holding the GIL (a thread preempted while holding it counts), and kernel
work done without the GIL is not in them: read them next to the /proc figures.

Prints a Markdown report (machine, load average before and after, date, command).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from loadtest.profile import py_spy_path
from loadtest.server import tree_cpu_seconds
from robez_core import hostinfo

from .replicas import BenchServer, percentile, replicated_pair, timed_updates

ROWS = 256
_RATE_HZ = 250
# A sample goes to the first stage any of whose frames (``function (file)``) it holds, in this order.
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("apply: the step (TableStore.apply, worker thread)", ("TableStore.apply (",)),
    ("apply: pass in the worker thread (hop, bookkeeping)", ("apply_all (",)),
    (
        "apply: pass on the loop (hop, metrics, wake)",
        ("_apply_updates (", "_apply_taken (", "_own_pass (", "Applier._applied (", "Applier._wake ("),
    ),
    ("log read: decode_entry", ("decode_entry (",)),
    (
        "log read: read_batches, next_msg, metadata",
        ("read_batches (", "next_msg", "take_queued", "Msg.metadata"),
    ),
    ("nats-py: read loop (parse, headers, dispatch)", ("Client._read_loop (",)),
    ("validate: hash, coalesce, checks (worker thread)", ("update.<locals>.validate (",)),
    ("validate: the hop to the worker thread (loop side)", ("compute (service/routes/deps.py)",)),
    ("publish: encode_update, kept step, size check", ("Replica._publish (",)),
    ("publish: nats-py publish and ack (js.publish)", ("JetStreamContext.publish (",)),
    ("publish: nats-py flusher (TLS encrypt, socket write)", ("Client._flusher (",)),
    ("push: wait for the apply, answer", ("Replica.update (", "ReplicatedWrites.update (")),
    ("HTTP: response write (send to loopback)", ("RequestResponseCycle.send (",)),
    (
        "HTTP: request parse, body, middleware, route",
        ("data_received (", "respond (", "Middleware", "run_asgi"),
    ),
    ("TLS read (SSLObject.read)", ("SSLObject.read",)),
    ("worker-thread pool machinery", ("WorkerThread.run (",)),
    ("event loop in C (uvloop callbacks, epoll)", ("Runner.run (",)),
)
_LINE = re.compile(r":\d+\)$")


def stage_of(frames: list[str]) -> str:
    for name, patterns in STAGES:
        if any(pattern in frame for frame in frames for pattern in patterns):
            return name
    return "other"


def stage_shares(raw: Path) -> tuple[dict[str, float], int]:
    """(stage -> share of samples, samples) of a py-spy ``--format raw`` file."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        if not line.strip():
            continue
        stack, count = line.rsplit(" ", 1)
        counts[stage_of([_LINE.sub(")", frame) for frame in stack.split(";")])] += int(count)
    total = sum(counts.values())
    return {name: count / total for name, count in counts.items()} if total else {}, total


def threads(pid: int) -> dict[str, tuple[int, float]]:
    """tid -> (context switches, CPU seconds) of every thread of ``pid``."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            switches = sum(
                int(line.split()[1])
                for line in (task / "status").read_text().splitlines()
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"))
            )
            stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
            out[task.name] = (switches, (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK"))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _run(servers: list[BenchServer], writers: int, pushes: int, py_spy: str | None, out: Path) -> dict:
    spies = []
    if py_spy is not None:
        for label, server in zip("AB", servers, strict=True):
            raw = out / f"{label}-{writers}.txt"
            record = [
                "record",
                "-p",
                str(server.pid),
                "-f",
                "raw",
                "-r",
                str(_RATE_HZ),
                "--gil",
                "--nonblocking",
            ]
            spies.append(
                subprocess.Popen(
                    [py_spy, *record, "-o", str(raw)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        time.sleep(1.0)
    before = [(tree_cpu_seconds(server.pid), threads(server.pid)) for server in servers]
    *latencies, elapsed = timed_updates(servers[0].url, writers, pushes, ROWS)
    after = [(tree_cpu_seconds(server.pid), threads(server.pid)) for server in servers]
    for spy in spies:
        spy.send_signal(signal.SIGINT)
    for spy in spies:
        try:
            spy.wait(30)
        except subprocess.TimeoutExpired:
            spy.kill()
    count = len(latencies)
    figures: dict = {"p50_ms": percentile(latencies, 50) * 1e3, "per_s": count / elapsed, "replicas": {}}
    for label, (cpu0, threads0), (cpu1, threads1) in zip("AB", before, after, strict=True):
        per_thread = []
        for tid, (switches, cpu) in sorted(threads1.items()):
            switches0, cpu0_thread = threads0.get(tid, (0, 0.0))
            if switches > switches0:
                per_thread.append(((switches - switches0) / count, (cpu - cpu0_thread) / count * 1e3))
        raw = out / f"{label}-{writers}.txt"
        shares, samples = stage_shares(raw) if raw.exists() else ({}, 0)
        figures["replicas"][label] = {
            "cpu_ms": (cpu1 - cpu0) / count * 1e3,
            "switches": sum(each[0] for each in per_thread),
            "threads": sorted(per_thread, key=lambda each: -each[1]),
            "shares": shares,
            "samples": samples,
        }
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.replication.push_profile", description=__doc__
    )
    parser.add_argument("--pushes", type=int, default=1600, help="pushes with 8 writers")
    parser.add_argument("--single", type=int, default=600, help="pushes with 1 writer")
    parser.add_argument("--py-spy", default=None, help="py-spy executable (default: beside python, PATH)")
    parser.add_argument("--dir", type=Path, default=Path.cwd(), help="parent of the working directory")
    args = parser.parse_args(argv)
    py_spy = args.py_spy or py_spy_path()

    load_before = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    began = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix=".robez-bench-profile-", dir=args.dir))
    runs = {}
    try:
        with replicated_pair(workdir, ROWS, warm_pushes=40) as (_, servers):
            for writers, pushes in ((8, args.pushes), (1, args.single)):
                print(f"{writers} writers ...", file=sys.stderr)
                runs[writers] = _run(servers, writers, pushes, py_spy, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    load_after = ", ".join(f"{value:.2f}" for value in os.getloadavg())

    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = "python -m benchmarks.replication.push_profile " + shlex.join(list(argv or sys.argv[1:]))
    print(f"# Where a replicated push's CPU goes — {date}\n")
    print(f"Command: `{command.strip()}` (took {time.perf_counter() - began:.0f} s)  ")
    print(
        f"Machine: {platform.node()}, {os.cpu_count()} CPUs, {hostinfo.cpu_model()}, "
        f"Linux {platform.release()}  "
    )
    print(f"Load average (1, 5, 15 min): {load_before} before, {load_after} after  ")
    print("A and B: 1 worker, 1 kernel thread; NATS: 3 nodes, TLS and logins, R3, sync_interval always; ")
    print(f"pushes of {ROWS} ids x 64 to A. py-spy: {py_spy or 'not installed (no stage shares)'}.\n")
    print(
        "| writers | p50 ms | updates/s | A CPU ms/push | A context switches/push | B CPU ms/push "
        "| B switches/push |"
    )
    print("|---|---|---|---|---|---|---|")
    for writers, run in runs.items():
        a, b = run["replicas"]["A"], run["replicas"]["B"]
        print(
            f"| {writers} | {run['p50_ms']:.2f} | {run['per_s']:.0f} | {a['cpu_ms']:.2f} "
            f"| {a['switches']:.1f} | {b['cpu_ms']:.2f} | {b['switches']:.1f} |"
        )
    print("\nPer thread (context switches per push, CPU ms per push), busiest first:\n")
    for writers, run in runs.items():
        for label, replica in run["replicas"].items():
            listed = ", ".join(f"{switches:.1f} / {cpu:.2f}" for switches, cpu in replica["threads"])
            print(f"- {writers} writers, {label}: {listed}")
    columns = [(writers, label) for writers in runs for label in ("A", "B")]
    if any(runs[writers]["replicas"][label]["samples"] for writers, label in columns):
        print("\nShares of the GIL holder's samples (py-spy), by stage of a push:\n")
        print("| stage | " + " | ".join(f"{label}, {writers} writers" for writers, label in columns) + " |")
        print("|---" * (len(columns) + 1) + "|")
        for name in [stage for stage, _ in STAGES] + ["other"]:
            cells = [runs[writers]["replicas"][label]["shares"].get(name, 0.0) for writers, label in columns]
            print(f"| {name} | " + " | ".join(f"{share:.0%}" for share in cells) + " |")
        samples = [str(runs[writers]["replicas"][label]["samples"]) for writers, label in columns]
        print("| samples | " + " | ".join(samples) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
