"""What durability costs: update throughput with fsync always / interval / never, and without a log.

Runs the server's update path without HTTP: per update, ``WalJournal.append`` (encode, CRC32, write,
and fdatasync as the policy says) then the fused optimizer step on the table, one update at a time in
order, as the store does under a table's update lock. A run with no journal at all is the baseline.

    python -m service.bench_durability [--updates 2000] [--ids 256] [--dim 64] [--data-dir DIR]

Prints a Markdown table (updates/s, latency percentiles, log bytes per update) plus the machine and
command, ready for docs/benchmarks/durability-<date>.md. The data directory must be on the disk whose
cost you want to know (the default is a temporary folder under the current directory, not /tmp, which
may be tmpfs).
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

from robez_core.config import OptimizerConfig, TableConfig
from robez_core.table import Table

from .journal import UpdateRecord
from .wal import LOG_FILE, WalJournal


# A setup is "none" (no journal), "never", "always", or "interval:<ms>".
def _setups(intervals_ms: list[float]) -> list[str]:
    return ["none", "never", *(f"interval:{ms:g}" for ms in intervals_ms), "always"]


def _run(
    policy: str,
    table: Table,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    data_dir: Path,
) -> dict[str, float]:
    """Apply every batch once under ``policy``; returns throughput and latency figures."""
    journal = None
    folder = data_dir / policy.replace(":", "-")
    if policy != "none":
        fsync, _, interval = policy.partition(":")
        journal = WalJournal(folder, fsync=fsync, fsync_interval_ms=float(interval or 10))  # type: ignore[arg-type]
        journal.create("bench", table, 0)
    lr = table.optimizer.lr
    latencies: list[float] = []
    start = time.perf_counter()
    for version, (ids, grads) in enumerate(batches, start=1):
        begin = time.perf_counter()
        offsets = table.hash(ids)
        if journal is not None:
            journal.append(UpdateRecord("bench", version, ids, grads, lr))
        table.apply_gradients_at(offsets, grads, lr)
        latencies.append(time.perf_counter() - begin)
    elapsed = time.perf_counter() - start
    log_bytes = 0
    if journal is not None:
        log_bytes = (folder / "bench" / LOG_FILE).stat().st_size
        journal.close()
    latencies.sort()
    return {
        "updates_per_s": len(batches) / elapsed,
        "p50_ms": 1e3 * statistics.median(latencies),
        "p99_ms": 1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "log_bytes_per_update": log_bytes / len(batches),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m service.bench_durability", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--updates", type=int, default=2000, help="updates per policy")
    parser.add_argument("--ids", type=int, default=256, help="ids per update (N)")
    parser.add_argument("--dim", type=int, default=64, help="embedding_dim d")
    parser.add_argument("--memory-size", type=int, default=262_144, help="m (the demo table's)")
    parser.add_argument(
        "--intervals-ms", default="10,100", help="comma-separated fsync intervals to run 'interval' with"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per policy; the median is reported")
    parser.add_argument(
        "--data-dir", type=Path, default=None, help="where the logs go (default: ./.bench-wal-*)"
    )
    parser.add_argument("--threads", type=int, default=1, help="kernel threads (torch.set_num_threads)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    config = TableConfig(num_embeddings=10_000_000, embedding_dim=args.dim, memory_size=args.memory_size)
    generator = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randint(0, config.num_embeddings, (args.ids,), generator=generator),
            torch.randn(args.ids, args.dim, generator=generator),
        )
        for _ in range(args.updates)
    ]
    root = (
        args.data_dir if args.data_dir is not None else Path(tempfile.mkdtemp(prefix=".bench-wal-", dir="."))
    )
    setups = _setups([float(ms) for ms in args.intervals_ms.split(",") if ms])
    results: dict[str, list[dict[str, float]]] = {setup: [] for setup in setups}
    try:
        _run("none", Table(config, OptimizerConfig("sgd")), batches[:50], root / "warmup")
        for repeat in range(args.repeats):
            for policy in setups:  # interleaved, so drift on a shared machine hits every policy alike
                run_dir = root / f"run{repeat}"
                results[policy].append(_run(policy, Table(config, OptimizerConfig("sgd")), batches, run_dir))
                shutil.rmtree(run_dir, ignore_errors=True)
    finally:
        if args.data_dir is None:
            shutil.rmtree(root, ignore_errors=True)

    command = "python -m service.bench_durability " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")
    print(f"- command: `{command.strip()}`")
    print(f"- machine: {platform.machine()}, {os.cpu_count()} CPUs ({_cpu_model()}), {platform.platform()}")
    print(f"- log directory on: {_filesystem(root)}")
    print(
        f"- workload: {args.updates} updates x {args.repeats} runs per policy, N={args.ids} ids, "
        f"d={args.dim}, m={args.memory_size}, sgd, {args.threads} kernel thread(s)"
    )
    print()
    print("| fsync policy | updates/s | p50 ms | p99 ms | log bytes/update | vs no log |")
    print("|---|---:|---:|---:|---:|---:|")
    baseline = statistics.median(r["updates_per_s"] for r in results["none"])
    for policy in setups:
        runs = results[policy]
        rate = statistics.median(r["updates_per_s"] for r in runs)
        p50 = statistics.median(r["p50_ms"] for r in runs)
        p99 = statistics.median(r["p99_ms"] for r in runs)
        size = runs[0]["log_bytes_per_update"]
        label = (
            "no data dir" if policy == "none" else policy.replace(":", " ") + (" ms" if ":" in policy else "")
        )
        print(f"| {label} | {rate:,.0f} | {p50:.3f} | {p99:.3f} | {size:,.0f} | {rate / baseline:.2f}x |")
    return 0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _filesystem(path: Path) -> str:
    """The mount (device and type) holding ``path``, from /proc/mounts (Linux)."""
    try:
        target = os.path.realpath(path)
        best = ("?", "?", "")
        for line in Path("/proc/mounts").read_text().splitlines():
            device, mount_point, fs_type, *_ = line.split()
            if target.startswith(mount_point) and len(mount_point) > len(best[2]):
                best = (device, fs_type, mount_point)
        return f"{best[1]} ({best[0]} mounted on {best[2]})"
    except OSError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
