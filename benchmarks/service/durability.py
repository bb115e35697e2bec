"""What durability costs: update throughput with fsync always / interval / never, and without a log.

Runs the server's update path without HTTP, as ``TableStore.update`` does: under a table lock,
``WalJournal.append`` (encode, CRC32, write, and fdatasync for ``always``) then the fused optimizer
step; then, with the lock released, ``wait_durable`` (the group-commit wait of ``interval``). ``--writers``
runs that many threads pushing updates at once (as concurrent requests would), so ``interval``'s shared
flushes show. A run with no journal at all is the baseline.

    python -m benchmarks.service.durability [--updates 2000] [--ids 256] [--writers 1,8] [--data-dir DIR]

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
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from robez_core.config import OptimizerConfig, TableConfig
from robez_core.hostinfo import cpu_model
from robez_core.table import Table
from service.store.journal import UpdateRecord
from service.wal import LOG_FILE, WalJournal


# A setup is "none" (no journal), "never", "always", or "interval:<ms>".
def _setups(intervals_ms: list[float]) -> list[str]:
    return ["none", "never", *(f"interval:{ms:g}" for ms in intervals_ms), "always"]


def _run(
    policy: str,
    table: Table,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    data_dir: Path,
    writers: int = 1,
) -> dict[str, float]:
    """Apply every batch once under ``policy`` from ``writers`` threads; returns throughput and latency
    figures (latency: from hashing to the end of the durability wait, lock waits included)."""
    journal = None
    folder = data_dir / policy.replace(":", "-")
    if policy != "none":
        fsync, _, interval = policy.partition(":")
        journal = WalJournal(folder, fsync=fsync, fsync_interval_ms=float(interval or 10))  # type: ignore[arg-type]
        journal.create("bench", table, 0)
    lr = table.optimizer.lr
    table_lock = threading.Lock()
    state = {"next": 0, "version": 0}
    latencies: list[float] = []

    def push() -> None:
        while True:
            with table_lock:  # hands out batches too: each is pushed once, in order of taking
                index = state["next"]
                state["next"] += 1
            if index >= len(batches):
                return
            ids, grads = batches[index]
            begin = time.perf_counter()
            offsets = table.hash(ids)
            ticket = 0
            with table_lock:
                state["version"] += 1
                if journal is not None:
                    ticket = journal.append(UpdateRecord("bench", state["version"], ids, grads, lr))
                table.apply_gradients_at(offsets, grads, lr)
            if journal is not None:
                journal.wait_durable(ticket)
            latencies.append(time.perf_counter() - begin)

    threads = [threading.Thread(target=push) for _ in range(writers)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
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
        prog="python -m benchmarks.service.durability", description=__doc__.split("\n")[0]
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
    parser.add_argument(
        "--writers",
        default="1",
        help="comma-separated counts of concurrent writer threads to run each policy with",
    )
    args = parser.parse_args(argv)
    writer_counts = [int(count) for count in args.writers.split(",") if count]
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
    policies = _setups([float(ms) for ms in args.intervals_ms.split(",") if ms])
    setups = [(writers, policy) for writers in writer_counts for policy in policies]
    results: dict[tuple[int, str], list[dict[str, float]]] = {setup: [] for setup in setups}
    try:
        _run("none", Table(config, OptimizerConfig("sgd")), batches[:50], root / "warmup")
        for repeat in range(args.repeats):
            for writers, policy in setups:  # interleaved, so drift on a shared machine hits all alike
                run_dir = root / f"run{repeat}"
                table = Table(config, OptimizerConfig("sgd"))
                results[(writers, policy)].append(_run(policy, table, batches, run_dir, writers))
                shutil.rmtree(run_dir, ignore_errors=True)
    finally:
        if args.data_dir is None:
            shutil.rmtree(root, ignore_errors=True)

    command = "python -m benchmarks.service.durability " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    print(f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")
    print(f"- command: `{command.strip()}`")
    print(f"- machine: {platform.machine()}, {os.cpu_count()} CPUs ({cpu_model()}), {platform.platform()}")
    print(f"- log directory on: {_filesystem(root)}")
    print(
        f"- workload: {args.updates} updates x {args.repeats} runs per policy, N={args.ids} ids, "
        f"d={args.dim}, m={args.memory_size}, sgd, {args.threads} kernel thread(s), "
        f"writer threads: {', '.join(map(str, writer_counts))}"
    )
    print()
    print("| writers | fsync policy | updates/s | p50 ms | p99 ms | log bytes/update | vs no log |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for writers, policy in setups:
        baseline = statistics.median(r["updates_per_s"] for r in results[(writers, "none")])
        runs = results[(writers, policy)]
        rate = statistics.median(r["updates_per_s"] for r in runs)
        p50 = statistics.median(r["p50_ms"] for r in runs)
        p99 = statistics.median(r["p99_ms"] for r in runs)
        size = runs[0]["log_bytes_per_update"]
        label = (
            "no data dir" if policy == "none" else policy.replace(":", " ") + (" ms" if ":" in policy else "")
        )
        print(
            f"| {writers} | {label} | {rate:,.0f} | {p50:.3f} | {p99:.3f} | {size:,.0f} | "
            f"{rate / baseline:.2f}x |"
        )
    return 0


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
