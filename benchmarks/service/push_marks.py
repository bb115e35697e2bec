"""What the record of changed granules costs a push (issue 39): with no copy running, and with one.

Every push of a served table now reads, under the table's lock, whether a copy of its array runs
(``service/log/granules.py``: one shared read); while one does, it marks the granules it changes (from
its prepared step's positions, or its ids hashed again on the compiled small-batch path). This times the
push path in process (``TableStore.update`` without a data directory, as a worker runs it: small batches
of 64 ids on the compiled path, 256 ids on the prepared one; adam, m = 2^22, d 64, Z 32) in a child
process per source tree, the trees alternated (A B, B A, ...), and reports each run's medians. "a copy
running" holds a copy's bit of the record (``GranuleMarks.begin``) with no copy behind it: the marking
alone, not a copy's competition for the CPU and memory (the big-tables benchmark measures that).

    python -m benchmarks.service.push_marks --tree /tmp/main-tree --tree . [--rounds 3] [--pushes 2000]
        [--no-copy-only]

Prints a Markdown table plus the machine and command, ready for docs/benchmarks/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

SIZES = (64, 256)


def child(pushes: int, copy_mode: bool = True) -> dict[str, float]:
    """In a child process whose ``service`` is the tree's: median seconds per push, by (ids, mode)."""
    import shutil

    import torch

    from robez_core.config import OptimizerConfig, TableConfig
    from service.config import Settings, TableSpec
    from service.log.journal import NullJournal
    from service.store import TableStore

    shm = Path(tempfile.mkdtemp(prefix="robez-bench-marks-", dir="/dev/shm"))
    try:
        settings = Settings(_env_file=None, shm_dir=shm, default_table=False)  # type: ignore[call-arg]
        directory = TableStore.prepare(settings, NullJournal())
        copier = TableStore(directory, settings, NullJournal())
        pusher = TableStore(directory, settings, NullJournal())
        config = TableConfig(num_embeddings=1 << 40, embedding_dim=64, memory_size=1 << 22, chunk_size=32)
        copier.create("t", TableSpec(config, OptimizerConfig.from_dict({"name": "adam", "lr": 1e-3})))
        generator = torch.Generator().manual_seed(1)
        batches = {
            size: [
                (torch.randint(0, 1 << 40, (size,), generator=generator), torch.randn(size, 64) * 1e-3)
                for _ in range(16)
            ]
            for size in SIZES
        }
        record = getattr(copier.registry.entry("t"), "marks", None)  # None: a tree before the record
        modes = ["no copy"] + (["a copy running"] if record is not None and copy_mode else [])
        samples: dict[str, list[float]] = {f"{size} {mode}": [] for size in SIZES for mode in modes}
        block = 100
        for index in range(pushes // block + 1):  # the first block warms up
            for mode in modes:
                slot = None
                if mode == "a copy running":
                    assert record is not None
                    with copier.exclusive("t"):
                        slot = record.begin()
                for size in SIZES:
                    for count in range(block):
                        ids, grads = batches[size][count % 16]
                        start = time.perf_counter()
                        pusher.update("t", ids, grads)
                        if index:
                            samples[f"{size} {mode}"].append(time.perf_counter() - start)
                if slot is not None:
                    assert record is not None
                    with copier.exclusive("t"):
                        record.end(slot)
        copier.close()
        pusher.close()
        directory.remove()
        return {key: statistics.median(values) for key, values in samples.items()}
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.service.push_marks", description=__doc__)
    parser.add_argument(
        "--tree", type=Path, action="append", required=True, help="a source tree (twice: A/B)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pushes", type=int, default=2000, help="timed pushes per size and mode, per run")
    parser.add_argument(
        "--no-copy-only",
        action="store_true",
        help="time the pushes with no copy running alone (same work per tree)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.pushes, copy_mode=not args.no_copy_only)))
        return 0
    script = Path(__file__).resolve()
    results: dict[str, list[dict[str, float]]] = {str(tree): [] for tree in args.tree}
    loads = [os.getloadavg()]
    for round_ in range(args.rounds):
        for tree in args.tree if round_ % 2 == 0 else args.tree[::-1]:  # A B, B A, ...
            env = {key: value for key, value in os.environ.items() if not key.startswith("ROBEZ_")}
            env["PYTHONPATH"] = str(tree.resolve())
            done = subprocess.run(
                [
                    *(
                        sys.executable,
                        str(script),
                        "--child",
                        "--pushes",
                        str(args.pushes),
                        "--tree",
                        str(tree),
                    ),
                    *(["--no-copy-only"] if args.no_copy_only else []),
                ],
                capture_output=True,
                text=True,
                check=True,
                timeout=900,
                env=env,
                cwd=tree,
            )
            results[str(tree)].append(json.loads(done.stdout.splitlines()[-1]))
    loads.append(os.getloadavg())
    from robez_core.hostinfo import cpu_model

    print(f"Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; {platform.node()}")
    print(f"CPU: {cpu_model()}, {os.cpu_count()} CPUs; torch threads: the default")
    print(f"Load average (1 min) at the start {loads[0][0]:.2f}, at the end {loads[1][0]:.2f}")
    print(f"Command: python -m benchmarks.service.push_marks {' '.join(argv or sys.argv[1:])}")
    print()
    print("| tree | push | median of each run (us) |")
    print("| --- | --- | --- |")
    for tree, runs in results.items():
        for key in runs[0]:
            figures = " / ".join(f"{1e6 * run[key]:.1f}" for run in runs)
            size, mode = key.split(" ", 1)
            print(f"| {tree} | {size} ids, {mode} | {figures} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
