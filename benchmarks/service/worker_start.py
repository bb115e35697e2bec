"""What a ``robez serve --workers N`` costs to start and to heal: memory of its process tree, and how long a
killed worker leaves its slot empty.

For each worker count: the server is started on its demo table (1 kernel thread per worker) and timed from
exec until ``/readyz`` answers 200; the proportional set size (PSS, /proc/<pid>/smaps_rollup) of every
process of its tree is summed; then ``--kills`` times, one worker is killed (-9) and timed until a new
worker has said its kernels are warm (its log line: the last step before it serves); each kill waits until
the workers are older than the supervisor's back-off age (10 s: a worker killed young twice in a row is
replaced after a back-off, which is not what is measured).

    python -m benchmarks.service.worker_start [--workers 2,4] [--kills 4] [--source DIR]

``--source DIR`` starts the servers from another checkout (its ``python -m service``, run in DIR), to
compare a change with the code before it on the same machine in one run; the default is this checkout.
Prints a Markdown report, ready for docs/benchmarks/.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from loadtest.launch import RobezProcess
from loadtest.server import tree_pids, worker_pids
from robez_core.hostinfo import cpu_model

_WARM_LINE = "robez.warmup: kernels warm"
_YOUNG_DEATH_S = 10.0  # service.supervisor's


def _pss_mib(pid: int) -> float:
    """PSS of ``pid`` and its descendants, MiB (pages shared between them counted once in all)."""
    total_kib = 0
    for each in tree_pids(pid):
        try:
            text = Path(f"/proc/{each}/smaps_rollup").read_text()
        except OSError:
            continue
        total_kib += sum(int(line.split()[1]) for line in text.splitlines() if line.startswith("Pss:"))
    return total_kib / 1024


def _one_count(workers: int, kills: int, source: Path | None, work: Path) -> dict[str, float]:
    log = work / f"server-{workers}.log"
    server = RobezProcess(
        ["--workers", str(workers)],
        {"ROBEZ_SHM_DIR": str(work / "shm"), "ROBEZ_LOG_LEVEL": "info", "ROBEZ_THREADS_PER_WORKER": "1"},
        log_path=log,
        cwd=source,
    )
    started = time.monotonic()
    server.start(300.0)
    ready_s = time.monotonic() - started
    assert server.process is not None
    pid = server.process.pid
    deadline = time.monotonic() + 60
    while len(worker_pids(pid)) < workers or log.read_text().count(_WARM_LINE) < workers:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{workers} workers never ran:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    time.sleep(1.0)  # the last worker's first requests and the supervisor's pings settle
    pss = _pss_mib(pid)
    heal_s = []
    try:
        for kill in range(kills):
            if kill:
                # Older than the supervisor's "died young" age: a worker killed young twice in a row is
                # replaced after a back-off (a crash loop must not spin), which is not measured here.
                time.sleep(_YOUNG_DEATH_S + 1.0)
            warm_lines = log.read_text().count(_WARM_LINE)
            victim = worker_pids(pid)[0]
            killed = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            while log.read_text().count(_WARM_LINE) <= warm_lines:
                if time.monotonic() - killed > 60:
                    raise RuntimeError(f"no replacement of {victim}:\n{log.read_text()[-3000:]}")
                time.sleep(0.005)
            heal_s.append(time.monotonic() - killed)
    finally:
        server.stop()
    return {
        "ready_s": ready_s,
        "pss_mib": pss,
        "pss_per_worker_mib": pss / workers,
        "heal_median_s": statistics.median(heal_s),
        "heal_max_s": max(heal_s),
    }


def _revision(source: Path) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(source), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="2,4", help="worker counts, comma-separated")
    parser.add_argument("--kills", type=int, default=4, help="workers killed one after the other, per count")
    parser.add_argument("--source", type=Path, default=None, help="a checkout to start the servers from")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.workers.split(",")]
    source = args.source.resolve() if args.source else Path(__file__).resolve().parents[2]
    load_before = os.getloadavg()
    rows = []
    for workers in counts:
        print(f"{workers} workers ...", file=sys.stderr)
        with tempfile.TemporaryDirectory(prefix="robez-bench-workers-") as work:
            rows.append((workers, _one_count(workers, args.kills, args.source, Path(work))))
    load_after = os.getloadavg()
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"### Worker start and replacement, {source} at {_revision(source)} ({now})\n")
    print(f"Command: `python -m benchmarks.service.worker_start {' '.join(argv or sys.argv[1:])}`  ")
    print(
        f"Machine: {platform.node()}, {cpu_model()}, {os.cpu_count()} CPUs, 1 kernel thread per worker; "
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after\n"
    )
    print(
        "| workers | start to ready s | PSS of the process tree MiB | per worker MiB | "
        f"kill -9 -> replacement warm s (median / max of {args.kills}) |"
    )
    print("|---|---|---|---|---|")
    for workers, row in rows:
        print(
            f"| {workers} | {row['ready_s']:.2f} | {row['pss_mib']:.0f} | {row['pss_per_worker_mib']:.0f} | "
            f"{row['heal_median_s']:.2f} / {row['heal_max_s']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
