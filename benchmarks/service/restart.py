"""Restart-to-ready time as the update log grows: what the snapshot policies bound (issue 11.5).

For each log length: a data directory with the ``demo`` table (m = 262,144, sgd) and that many logged
pushes of ``--ids`` ids (written straight through ``WalJournal``), then ``robez serve --data-dir`` is
started ``--repeats`` times (``kill -9`` of its process group between starts, so the log stays as it
is) and timed from exec until ``/readyz`` answers 200. The replay alone (``WalJournal.load`` in this
process) is timed too.

    python -m benchmarks.service.restart [--records 0,993,10000] [--ids 256] [--repeats 3] [--data-dir DIR]

993 records of 256 ids are the default size policy's floor (64 MiB) for the demo table; 10,000 records
the count policy's bound, which is all that bounded the log before the size policy.
Prints a Markdown table plus the machine and command, ready for docs/benchmarks/.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from loadtest.launch import RobezProcess
from robez_core.hostinfo import cpu_model
from robez_core.table import Table
from service.config import DEMO_OPTIMIZER, DEMO_TABLE_CONFIG, DEMO_TABLE_NAME
from service.store.journal import UpdateRecord
from service.wal import LOG_FILE, WalJournal


def _write_log(data_dir: Path, records: int, num_ids: int) -> int:
    """The demo table at version 0 plus ``records`` logged pushes; returns the log's bytes."""
    journal = WalJournal(data_dir, fsync="never")
    try:
        journal.create(DEMO_TABLE_NAME, Table(DEMO_TABLE_CONFIG, DEMO_OPTIMIZER), 0)
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 1 << 40, (num_ids,), generator=generator)
        grads = torch.randn(num_ids, DEMO_TABLE_CONFIG.embedding_dim, generator=generator) * 1e-3
        for version in range(1, records + 1):
            journal.append(UpdateRecord(DEMO_TABLE_NAME, version, ids, grads, DEMO_OPTIMIZER.lr))
    finally:
        journal.close()
    os.sync()
    return (data_dir / DEMO_TABLE_NAME / LOG_FILE).stat().st_size


def _replay_seconds(data_dir: Path) -> float:
    # The first optimizer step of a process loads its compiled kernel from numba's cache (a second or
    # more on a busy machine): paid here, so that only the replay is timed.
    Table(DEMO_TABLE_CONFIG, DEMO_OPTIMIZER).apply_gradients(
        torch.zeros(1, dtype=torch.int64), torch.zeros(1, DEMO_TABLE_CONFIG.embedding_dim)
    )
    journal = WalJournal(data_dir)
    try:
        start = time.perf_counter()
        loaded = journal.load(DEMO_TABLE_NAME)
        elapsed = time.perf_counter() - start
        assert loaded is not None
        return elapsed
    finally:
        journal.close()


def _start_to_ready(data_dir: Path, shm_dir: Path, timeout_s: float = 300.0) -> float:
    """Seconds from exec of ``robez serve --data-dir`` until /readyz answers 200; then kill -9."""
    server = RobezProcess(
        ["--data-dir", str(data_dir)],
        {"ROBEZ_SHM_DIR": str(shm_dir), "ROBEZ_LOG_LEVEL": "warning"},
        log_path=data_dir.parent / "server.log",
    )
    try:
        server.spawn().wait_ready(timeout_s, interval_s=0.02)
        return time.monotonic() - server.started_at
    finally:
        server.kill()  # a crash: the log stays as it was for the next start


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.service.restart", description=__doc__)
    parser.add_argument("--records", default="0,993,10000", help="log lengths, comma-separated")
    parser.add_argument("--ids", type=int, default=256, help="ids per logged push (d = 64)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data-dir", type=Path, default=None, help="default: a temporary folder in .")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="robez-bench-restart-", dir=args.data_dir or Path.cwd()))
    print(f"# Restart to ready against the log's length ({datetime.date.today().isoformat()})\n")
    print(f"- command: `python -m benchmarks.service.restart {' '.join(argv or sys.argv[1:])}`")
    print(f"- machine: {platform.machine()}, {os.cpu_count()} CPUs ({cpu_model()}), {platform.platform()}")
    print(
        f"- table: demo (m={DEMO_TABLE_CONFIG.memory_size}, d={DEMO_TABLE_CONFIG.embedding_dim}, sgd); "
        f"pushes of {args.ids} ids; one worker; medians of {args.repeats} starts (kill -9 between)\n"
    )
    print("| logged pushes | log bytes | replay alone (s) | exec to /readyz 200 (s) | all starts (s) |")
    print("|---:|---:|---:|---:|---:|")
    try:
        for records in (int(r) for r in args.records.split(",")):
            data_dir, shm_dir = root / f"data-{records}", root / "shm"
            log_bytes = _write_log(data_dir, records, args.ids)
            replay = _replay_seconds(data_dir)
            starts = [_start_to_ready(data_dir, shm_dir) for _ in range(args.repeats)]
            print(
                f"| {records} | {log_bytes:,} | {replay:.2f} | {statistics.median(starts):.2f} | "
                f"{', '.join(f'{s:.2f}' for s in starts)} |",
                flush=True,
            )
            shutil.rmtree(data_dir, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
