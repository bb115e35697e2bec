"""Does the memory an array lives in change robez's Adagrad step? (issue 37, the server's step)

The server's tables live in files under ``/dev/shm`` mapped shared (``torch.from_file(shared=True)``); a
local collection's array is private memory from torch's allocator, which asks for transparent huge pages
where the kernel gives them (``/sys/kernel/mm/transparent_hugepage/enabled`` = madvise or always), while
a tmpfs file gets huge pages only with its ``huge=`` mount option. This times the same coalesced steps
(26 tables x ``--batch`` Zipf ids, d = 16, Z = 32, as ``benchmarks/training/dlrm.py``) and their dry run
(the server's finite check) on three copies of one array: a ``/dev/shm`` file, torch's private memory and
numpy's private memory, in alternating order, and prints the medians and the huge pages the process got.

    flock /tmp/robez-bench.lock python -m benchmarks.training.array_memory
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from robez_core import kernels
from robez_core.kernels.collection import coalesce_chunk_rows

FEATURES, DIM, CHUNK = 26, 16, 32


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as error:
        return f"unreadable ({error.strerror})"


def step_arguments(doc: str) -> argparse.Namespace:
    """The options of the benchmarks that time DLRM-shaped coalesced steps on one array."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--floats", type=int, default=26_233_210, help="array size (the DLRM run's)")
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--passes", type=int, default=5)
    return parser.parse_args()


def dlrm_steps(
    m: int, batch: int, count: int, grad_scale: float = 1.0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` coalesced steps (locations, summed gradients) of 26 tables x ``batch`` Zipf ids, d = 16,
    Z = 32, on an array of ``m`` floats, as ``benchmarks/training/dlrm.py`` makes them."""
    rng = np.random.default_rng(0)
    steps = []
    for _ in range(count):
        offsets = [
            torch.from_numpy((rng.zipf(1.1, batch) * 7919 % (m - CHUNK)).astype(np.int64)).view(-1, 1)
            for _ in range(FEATURES)
        ]
        grads = [torch.randn(batch, DIM) * grad_scale for _ in range(FEATURES)]
        steps.append(coalesce_chunk_rows(offsets, grads, CHUNK, m))
    return steps


def main() -> None:
    args = step_arguments(__doc__ or "")
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    m = args.floats
    steps = dlrm_steps(m, args.batch, args.steps)
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="robez-array-memory-") as shm_dir:
        copies: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        files = [os.path.join(shm_dir, name) for name in ("weight", "sum")]
        for file in files:
            with open(file, "wb") as handle:
                handle.truncate(m * 4)
        copies["/dev/shm file"] = (
            torch.from_file(files[0], shared=True, size=m, dtype=torch.float32),
            torch.from_file(files[1], shared=True, size=m, dtype=torch.float32),
        )
        copies["torch private"] = (torch.empty(m), torch.empty(m))
        copies["numpy private"] = (
            torch.from_numpy(np.empty(m, np.float32)),
            torch.from_numpy(np.empty(m, np.float32)),
        )
        for weight, state in copies.values():
            weight.fill_(0.01)
            state.fill_(0.0)
        step_ms: dict[str, list[float]] = {name: [] for name in copies}
        check_ms: dict[str, list[float]] = {name: [] for name in copies}
        names = list(copies)
        for index in range(args.passes):
            for name in names if index % 2 == 0 else names[::-1]:
                weight, state = copies[name]
                for locations, values in steps:
                    start = time.perf_counter()
                    kernels.adagrad_nonfinite(weight, state, locations, values, 0.05, 1e-10)
                    checked = time.perf_counter()
                    kernels.adagrad_step(weight, state, locations, values, 0.05, 1e-10)
                    done = time.perf_counter()
                    if index:  # the first pass compiles and faults pages in
                        check_ms[name].append((checked - start) * 1e3)
                        step_ms[name].append((done - checked) * 1e3)
        rollup = _read("/proc/self/smaps_rollup").splitlines()
        huge = [line.strip() for line in rollup if "Huge" in line or "PmdMapped" in line]
    print(f"load average before / after: {load_before} / {os.getloadavg()}")
    print(f"array {m:,} floats; {steps[0][0].numel():,} locations a step; {args.passes - 1} timed passes")
    for name in names:
        step, check = statistics.median(step_ms[name]), statistics.median(check_ms[name])
        print(f"{name:>14}: Adagrad step {step:.2f} ms, finite check {check:.2f} ms (medians)")
    print("huge pages of this process:", "; ".join(huge))
    print("shmem_enabled:", _read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"))
    print("anon THP enabled:", _read("/sys/kernel/mm/transparent_hugepage/enabled"))
    mounts = [line for line in _read("/proc/mounts").splitlines() if " /dev/shm " in line]
    print("/dev/shm mount:", mounts[0] if mounts else "not found")


if __name__ == "__main__":
    main()
