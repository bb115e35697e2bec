"""Micro-benchmark of the small requests a server sees online: ``Table.lookup`` of 1 id and
``Table.apply_gradients`` of 8 ids, next to the compiled kernels they run, called directly.

``python -m benchmarks.core.small_batches`` (or ``python -m benchmarks.core.paper_tables --small``) times,
at 1 thread, on the service's demo table (d = 64, Z = 32, m = 262,144) for each optimizer:

- ``Table.lookup`` of 1 id and ``Table.apply_gradients`` of 8 ids x 64 (what a request pays in the core);
- the same work as bare kernel calls on prepared numpy arrays (hash + gather; hash + coalesce + step):
  the arithmetic, plus numba's own dispatch, with no checks and no set-up;

in CPU time of the process (``time.process_time``), and checks the targets (lookup of 1 id <= 5 us,
apply_gradients of 8 ids <= 25 us). Each figure is the median over ``repeats`` rounds of the mean of
``calls`` calls. It writes ``docs/benchmarks/small-batches-<date>.md`` with the machine (CPU model and
vector extensions), thread count and date.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import DEFAULT_OUTPUT_DIR
from robez_core import hostinfo, kernels
from robez_core.config import OptimizerConfig, OptimizerName, TableConfig
from robez_core.kernels import serial
from robez_core.table import Table

LOOKUP_TARGET_US = 5.0
UPDATE_TARGET_US = 25.0
UPDATE_IDS = 8
DEMO_CONFIG = TableConfig(10_000_000, 64, memory_size=262_144, chunk_size=32)
_VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "neon", "asimd")


@dataclass(frozen=True)
class SmallResult:
    """Microseconds per call for one optimizer: the Table methods and the bare kernels."""

    optimizer: str
    lookup_us: float
    lookup_kernels_us: float
    update_us: float
    update_kernels_us: float


def _time_us(call: Callable[[], object], calls: int, repeats: int) -> float:
    """Median over rounds of this process's CPU time per call (us): on a machine shared with other
    work, wall time would also count the time the process waited for a core."""
    rounds = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(calls):
            call()
        rounds.append((time.process_time() - start) / calls * 1e6)
    return statistics.median(rounds)


def measure(optimizer: OptimizerName, calls: int, repeats: int, seed: int = 0) -> SmallResult:
    """Time one optimizer's table (1 thread: set by the caller)."""
    table = Table(DEMO_CONFIG, OptimizerConfig(optimizer, lr=1e-3))
    generator = torch.Generator().manual_seed(seed)
    one_id = torch.randint(0, DEMO_CONFIG.num_embeddings, (1,), generator=generator)
    ids = torch.randint(0, DEMO_CONFIG.num_embeddings, (UPDATE_IDS,), generator=generator)
    grads = torch.randn(UPDATE_IDS, DEMO_CONFIG.embedding_dim, generator=generator) * 1e-4
    # the arithmetic alone: the same serial kernels on prepared arrays, no checks, no set-up
    c = DEMO_CONFIG
    weight = table.weight.numpy()
    mode, constants, range_size = serial.hash_setup(
        c.hash, table.random_numbers, c.memory_size, c.chunk_size, c.embedding_dim
    )
    val_offset = np.int64(c.val_offset)
    one_np, ids_np, grads_np = one_id.numpy(), ids.numpy(), grads.numpy()
    offsets_one = np.empty((1, c.num_chunks), dtype=np.int64)
    offsets = np.empty((UPDATE_IDS, c.num_chunks), dtype=np.int64)
    rows = np.empty((1, c.embedding_dim), dtype=np.float32)
    state = {name: tensor.numpy() for name, tensor in table.state.items()}
    lr = np.float32(1e-3)

    gather = serial.gather_for(c.chunk_size)

    def lookup_kernels() -> None:
        serial.chunk_offsets(one_np, val_offset, c.num_chunks, mode, constants, range_size, offsets_one)
        gather(weight, offsets_one, c.embedding_dim, c.chunk_size, False, False, rows)

    def update_kernels() -> None:
        serial.chunk_offsets(ids_np, val_offset, c.num_chunks, mode, constants, range_size, offsets)
        locations, values = serial.coalesce_sorted(grads_np, offsets, c.embedding_dim, c.chunk_size)
        if optimizer == "sgd":
            serial.sgd(weight, locations, values, lr)
        elif optimizer == "adagrad":
            serial.adagrad(weight, state["sum"], locations, values, lr, np.float32(1e-8))
        else:
            serial.adam(
                weight, state["exp_avg"], state["exp_avg_sq"], locations, values,
                np.float32(0.9), np.float32(0.999), np.float32(1e-8), lr,
            )  # fmt: skip

    calls_to_warm = (lambda: table.lookup(one_id), lambda: table.apply_gradients(ids, grads))
    for warm in (*calls_to_warm, lookup_kernels, update_kernels):
        warm()
    return SmallResult(
        optimizer=optimizer,
        lookup_us=_time_us(lambda: table.lookup(one_id), calls, repeats),
        lookup_kernels_us=_time_us(lookup_kernels, calls, repeats),
        update_us=_time_us(lambda: table.apply_gradients(ids, grads), calls, repeats),
        update_kernels_us=_time_us(update_kernels, calls, repeats),
    )


def vector_extensions() -> str:
    """The SIMD extensions /proc/cpuinfo lists (those the kernels can use)."""
    present = hostinfo.listed_flags(_VECTOR_FLAGS)
    if present is None:
        return "unknown"
    return ", ".join(present) or "none listed"


def render(
    results: list[SmallResult], machine: dict[str, str], command: str, calls: int, repeats: int
) -> str:
    lines = [
        f"# Small-batch micro-benchmark: {machine['date']}",
        "",
        f"Command: `{command}`. Produced by `benchmarks/core/small_batches.py`; every figure comes from "
        "this run.",
        "",
        "| | |",
        "|---|---|",
        *(f"| {key} | {value} |" for key, value in machine.items()),
        "",
        f"Table: the service's demo table (d={DEMO_CONFIG.embedding_dim}, Z={DEMO_CONFIG.chunk_size},"
        f" m={DEMO_CONFIG.memory_size}, paper hash); 1 thread. Each figure: median over {repeats} rounds"
        f" of the mean CPU time (this process's, so time spent waiting for a core on a shared machine does"
        f" not count) of {calls} calls, in microseconds. 'kernels alone' calls the same compiled serial"
        " kernels directly on prepared numpy arrays: the arithmetic plus numba's dispatch, no checks.",
        "",
        "| optimizer | Table.lookup, 1 id | kernels alone | Table.apply_gradients, 8 ids | kernels alone |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.optimizer} | {r.lookup_us:.2f} | {r.lookup_kernels_us:.2f} | {r.update_us:.2f}"
            f" | {r.update_kernels_us:.2f} |"
        )
    lines += ["", "| target | worst measured | threshold | result |", "|---|---|---|---|"]
    for name, worst, target in targets(results):
        lines.append(
            f"| {name} | {worst:.2f} us | <= {target:.0f} us | {'met' if worst <= target else 'missed'} |"
        )
    return "\n".join(lines) + "\n"


def targets(results: list[SmallResult]) -> list[tuple[str, float, float]]:
    """(target, the worst optimizer's figure, threshold)."""
    return [
        ("Table.lookup of 1 id", max(r.lookup_us for r in results), LOOKUP_TARGET_US),
        (f"Table.apply_gradients of {UPDATE_IDS} ids", max(r.update_us for r in results), UPDATE_TARGET_US),
    ]


def machine_info() -> dict[str, str]:
    info = hostinfo.machine_facts()
    info["vector extensions"] = vector_extensions()
    info["kernel threads"] = str(torch.get_num_threads())
    info["load average (1, 5, 15 min)"] = ", ".join(f"{v:.2f}" for v in hostinfo.load_average())
    info["date"] = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return info


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.core.small_batches", description=__doc__)
    parser.add_argument("--calls", type=int, default=2000, help="calls per round")
    parser.add_argument("--repeats", type=int, default=9, help="rounds; the median is reported")
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR)
    parser.add_argument("--no-report", action="store_true", help="print only; write no file")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.repeats < 1:
        parser.error("--calls and --repeats must be >= 1")
    torch.set_num_threads(1)
    kernels.set_kernel_threads()
    names: tuple[OptimizerName, ...] = ("sgd", "adagrad", "adam")
    results = [measure(name, args.calls, args.repeats) for name in names]
    command = "python -m benchmarks.core.small_batches " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    text = render(results, machine_info(), command.strip(), args.calls, args.repeats)
    print(text)
    if not args.no_report:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        path = args.output_dir / f"small-batches-{dt.datetime.now(dt.UTC):%Y-%m-%d}.md"
        path.write_text(text)
        print(f"report: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
