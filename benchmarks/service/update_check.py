"""What refusing a non-finite step costs on the update path (issue 15.3).

The server used to run ``Table.apply_gradients_at`` (coalesce + optimizer step) under the table's update
lock. It now coalesces before the lock (``Table.prepare_step``) and, under the lock, runs the dry-run
check (``Table.check_step``, the step's float32 arithmetic on the K touched locations, nothing written)
before the log append and the step (``Table.apply_step``). This times both paths side by side on one
table, interleaved, and reports medians: the whole update work, and the part held under the lock.

    python -m benchmarks.service.update_check [--repeats 300] [--ids 1,256,4096]

Prints a Markdown table plus the machine and command, ready for docs/benchmarks/.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence

import numba
import torch

from robez_core.config import OptimizerConfig, TableConfig
from robez_core.hostinfo import cpu_model
from robez_core.table import Table
from service.config import DEMO_TABLE_CONFIG


def _measure(optimizer: str, num_ids: int, repeats: int, config: TableConfig) -> dict[str, float]:
    table = Table(config, OptimizerConfig(name=optimizer, lr=0.01))  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(num_ids)
    batches = [
        (
            table.hash(torch.randint(0, 1 << 40, (num_ids,), generator=generator)),
            torch.randn(num_ids, config.embedding_dim, generator=generator) * 1e-3,
        )
        for _ in range(8)
    ]
    samples: dict[str, list[float]] = {"old": [], "new": [], "new_locked": [], "check": []}
    for repeat in range(repeats + 5):  # the first 5 warm the kernels and caches up
        offsets, grads = batches[repeat % len(batches)]
        start = time.perf_counter()
        table.apply_gradients_at(offsets, grads, 0.01)
        old = time.perf_counter() - start
        start = time.perf_counter()
        step = table.prepare_step(offsets, grads, 0.01)
        prepared = time.perf_counter()
        table.check_step(step)
        check = time.perf_counter() - prepared
        table.apply_step(step)
        done = time.perf_counter()
        if repeat >= 5:
            samples["old"].append(old)
            samples["new"].append(done - start)
            samples["new_locked"].append(done - prepared)
            samples["check"].append(check)
    return {key: statistics.median(values) * 1e6 for key, values in samples.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.service.update_check", description=__doc__)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--ids", default="1,256,4096", help="ids per update, comma-separated")
    parser.add_argument("--threads", type=int, default=1, help="kernel threads (a worker's share)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = DEMO_TABLE_CONFIG
    print(f"# The cost of refusing non-finite steps ({datetime.date.today().isoformat()})\n")
    print(f"- command: `python -m benchmarks.service.update_check {' '.join(argv or sys.argv[1:])}`")
    print(f"- machine: {platform.machine()}, {os.cpu_count()} CPUs ({cpu_model()}), {platform.platform()}")
    threads = f"torch {torch.get_num_threads()}, numba {numba.get_num_threads()}"
    print(f"- kernel threads: {args.threads} ({threads})")
    print(
        f"- table: the demo table (m={config.memory_size}, d={config.embedding_dim}, Z={config.chunk_size}), "
        f"{args.repeats} updates per row, medians, both paths interleaved\n"
    )
    print(
        "| optimizer | ids | before: coalesce + step, all under the lock (us) | now: whole (us) | "
        "now: under the lock, check + step (us) | the check alone (us) | whole now / before |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for optimizer in ("sgd", "adagrad", "adam"):
        for num_ids in (int(n) for n in args.ids.split(",")):
            r = _measure(optimizer, num_ids, args.repeats, config)
            print(
                f"| {optimizer} | {num_ids} | {r['old']:.1f} | {r['new']:.1f} | {r['new_locked']:.1f} | "
                f"{r['check']:.1f} | {r['new'] / r['old']:.2f} |"
            )
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
