"""The sparse optimizer step on a big table, with and without prefetching the locations ahead.

``python -m benchmarks.core.sparse_step [--memory-size 268435456] [--updates 400]`` builds an adam table
of ``--memory-size`` floats (d 128, Z 32) whose three arrays live in files under /dev/shm (as the
service's shared tables do: 4 KiB pages), prepares ``--updates`` pushes of 256 random ids (hash and
coalesce, as the service does before it steps), then times the adam step of each (the serial kernel, as
a worker with one kernel thread runs it, and as a replay runs it) in alternating rounds: the kernel as
built (prefetching ``_STEP_PREFETCH_AHEAD`` locations ahead) and the same source compiled with
``_STEP_PREFETCH_AHEAD = 0``. It checks that the two leave bitwise the same arrays, then reports the
median time per update of each and their ratio (docs/benchmarks/kernel-constants.md#_step_prefetch_ahead).
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from numba import njit

from benchmarks.common import DEFAULT_OUTPUT_DIR
from robez_core import hostinfo
from robez_core.config import OptimizerConfig, TableConfig
from robez_core.kernels import _jit
from robez_core.table import Table

IDS_PER_UPDATE = 256
ROUNDS = 5
BETA1, BETA2, EPS, STEP_SIZE = np.float32(0.9), np.float32(0.999), np.float32(1e-8), np.float32(1e-3)

Step = Callable[..., None]


def _shared_array(directory: Path, name: str, size: int, value: float) -> np.ndarray:
    """A float32 array over a file in ``directory`` (tmpfs: the service's shared memory), filled."""
    path = directory / name
    array = np.memmap(path, dtype=np.float32, mode="w+", shape=(size,))
    path.unlink()  # the mapping keeps it
    array[:] = value
    return array


def _steps(table: Table, updates: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``updates`` pushes of random ids, hashed and coalesced: (locations, summed gradients) each."""
    generator = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(updates):
        ids = torch.randint(0, table.config.num_embeddings, (IDS_PER_UPDATE,), generator=generator)
        grads = torch.randn(IDS_PER_UPDATE, table.config.embedding_dim, generator=generator)
        step = table.prepare_step(table.hash(ids), grads, offsets_from_hash=True)
        steps.append((step.locations.numpy(), step.values.numpy()))
    return steps


def _time(kernel: Step, arrays: tuple[np.ndarray, ...], steps: list[tuple[np.ndarray, np.ndarray]]) -> float:
    """Seconds per update of ``kernel`` over ``steps``."""
    start = time.perf_counter()
    for locations, values in steps:
        kernel(*arrays, locations, values, BETA1, BETA2, EPS, STEP_SIZE)
    return (time.perf_counter() - start) / len(steps)


def _same_result(prefetching: Step, plain: Step, steps: list[tuple[np.ndarray, np.ndarray]]) -> bool:
    """Both kernels on copies of a small table: bitwise the same arrays after the same steps."""
    size = 1 << 22
    starts = [np.random.default_rng(seed).standard_normal(size).astype(np.float32) for seed in (1, 2, 3)]
    starts[2] = np.abs(starts[2])  # exp_avg_sq is never negative
    left = tuple(array.copy() for array in starts)
    right = tuple(array.copy() for array in starts)
    for locations, values in steps[:50]:
        kept = locations < size
        prefetching(*left, locations[kept], values[kept], BETA1, BETA2, EPS, STEP_SIZE)
        plain(*right, locations[kept], values[kept], BETA1, BETA2, EPS, STEP_SIZE)
    return all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(left, right, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memory-size", type=int, default=1 << 28)
    parser.add_argument("--updates", type=int, default=400)
    default_output = DEFAULT_OUTPUT_DIR / f"sparse-step-{dt.date.today()}.md"
    parser.add_argument("--output", type=Path, default=default_output, help="report (appended)")
    args = parser.parse_args()

    prefetching = _jit._adam_kernel.serial
    source = _jit._renamed(_jit._adam_kernel._py_func, "_no_step_prefetch", {"_STEP_PREFETCH_AHEAD": 0})
    plain = njit(nogil=True, error_model="numpy")(source)
    config = TableConfig(10_000_000, 128, memory_size=args.memory_size, chunk_size=32)
    with tempfile.TemporaryDirectory(prefix="robez-bench-step-", dir="/dev/shm") as tmp:
        directory = Path(tmp)
        weight = _shared_array(directory, "weight", args.memory_size, 0.001)
        exp_avg = _shared_array(directory, "exp_avg", args.memory_size, 0.0)
        exp_avg_sq = _shared_array(directory, "exp_avg_sq", args.memory_size, 1e-4)
        table = Table(config, OptimizerConfig(name="adam"), weight=torch.from_numpy(weight))
        steps = _steps(table, args.updates, seed=0)
        same = _same_result(prefetching, plain, steps)
        arrays = (weight, exp_avg, exp_avg_sq)
        _time(prefetching, arrays, steps[:5])  # compiled or loaded before the rounds
        _time(plain, arrays, steps[:5])
        timings: dict[str, list[float]] = {"prefetch": [], "no prefetch": []}
        for round_ in range(ROUNDS):
            print(f"round {round_ + 1}/{ROUNDS}", flush=True)
            timings["no prefetch"].append(_time(plain, arrays, steps))
            timings["prefetch"].append(_time(prefetching, arrays, steps))
    medians = {name: statistics.median(values) for name, values in timings.items()}
    facts = hostinfo.machine_facts()
    lines = [
        f"# Sparse adam step on a big table ({dt.date.today()})",
        "",
        f"- command: `python -m benchmarks.core.sparse_step --memory-size {args.memory_size} "
        f"--updates {args.updates}`",
        f"- machine: {facts['cpu']} ({facts['cpu vector extensions']}), {facts['logical cpus']} CPUs, "
        f"{facts['memory']}, {facts['platform']}; kernels compiled for "
        f"{facts['fused kernels compiled for']}; "
        "1 thread (the serial kernel); load average at the end "
        + " / ".join(f"{value:.1f}" for value in hostinfo.load_average()),
        f"- table: m = {args.memory_size:,} (2^{args.memory_size.bit_length() - 1}), d = 128, Z = 32, adam "
        f"({3 * 4 * args.memory_size / 2**20:,.0f} MiB in /dev/shm files); {args.updates} updates of "
        f"{IDS_PER_UPDATE} random ids, timed {ROUNDS} times each way, alternating",
        f"- the two kernels leave bitwise the same arrays: {same}",
        "",
        "| kernel | per update, median of rounds | rounds |",
        "|---|---|---|",
    ]
    for name, values in timings.items():
        rounds = ", ".join(f"{1000 * value:.3f}" for value in values)
        lines.append(f"| {name} | {1000 * medians[name]:.3f} ms | {rounds} |")
    lines += ["", f"no prefetch / prefetch: {medians['no prefetch'] / medians['prefetch']:.2f}x", ""]
    report = "\n".join(lines)
    print(report)
    if not same:
        raise SystemExit("the two kernels differ: not written")
    with open(args.output, "a") as handle:
        handle.write(report + "\n")
    print(f"appended to {args.output}")


if __name__ == "__main__":
    main()
