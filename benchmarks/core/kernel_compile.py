"""What the forward kernels cost to compile, and to call, in one checkout: for an A/B of two checkouts
(each with its own virtual environment) run alternately, as docs/benchmarks/suite-2026-11-27.md does.

``python -m benchmarks.core.kernel_compile`` prints one JSON object:

- ``compile_s``: CPU seconds of the first call of the lookup (d = 64, Z = 32, the demo table's kind), the
  chunk offsets and the bag lookup, serial (1 thread) then parallel (2 threads), in a fresh subprocess
  with an empty ``NUMBA_CACHE_DIR`` (what a fresh clone or a new image pays once);
- ``call_us``: the median over ``--repeats`` rounds of the mean CPU microseconds (1 thread) or wall
  microseconds (2 threads) of a call, on a 262,144-float table, from numba's cache (warm): through
  ``robez_core.kernels`` (checks and set-up included), and the serial lookup compilation called directly.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

_COMPILE_PROBE = """
import json, time, torch
from robez_core import kernels, paper_random_numbers
from robez_core.kernels import _jit
_jit._PARALLEL_MIN_WORK = 0  # the parallel copies at 2 threads, whatever the batch
weight, ids, constants = torch.randn(262_144), torch.arange(3000), paper_random_numbers()
bags = torch.tensor([0, 100])
calls = {
    "lookup": lambda: kernels.lookup(weight, ids, 64, 32, constants),
    "chunk_offsets": lambda: kernels.chunk_offsets(ids, 2, 32, 262_144, constants),
    "lookup_bag": lambda: kernels.lookup_bag(weight, ids, bags, None, "sum", 64, 32, constants),
}
seconds = {}
for threads, copy in ((1, "serial"), (2, "parallel")):
    torch.set_num_threads(threads)
    kernels.set_kernel_threads()
    for name, call in calls.items():
        start = time.process_time()
        call()
        seconds[f"{name} {copy}"] = round(time.process_time() - start, 2)
print(json.dumps(seconds))
"""


def compile_seconds() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as cache:
        completed = subprocess.run(
            [sys.executable, "-c", _COMPILE_PROBE],
            env={**os.environ, "NUMBA_CACHE_DIR": cache},
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
    return dict(json.loads(completed.stdout.strip().splitlines()[-1]))


def call_microseconds(repeats: int) -> dict[str, float]:
    import numpy as np
    import torch

    from robez_core import kernels, paper_random_numbers
    from robez_core.kernels import runtime, serial

    generator = torch.Generator().manual_seed(0)
    weight, constants = torch.randn(262_144, generator=generator), paper_random_numbers()
    one, small, large = (torch.randint(0, 1 << 40, (n,), generator=generator) for n in (1, 4096, 1 << 16))
    bags = torch.arange(0, 1 << 16, 16)
    cases: list[tuple[str, int, int, Callable[[], object]]] = [  # name, threads, calls per round
        ("lookup 1 id", 1, 2000, lambda: kernels.lookup(weight, one, 64, 32, constants)),
        ("lookup 4096 ids", 1, 50, lambda: kernels.lookup(weight, small, 64, 32, constants)),
        (
            "bag of 1 id",
            1,
            2000,
            lambda: kernels.lookup_bag(weight, one, bags[:1], None, "sum", 64, 32, constants),
        ),
        ("chunk_offsets 4096 ids", 1, 50, lambda: kernels.chunk_offsets(small, 2, 32, 262_144, constants)),
        ("lookup 65536 ids", 2, 10, lambda: kernels.lookup(weight, large, 64, 32, constants)),
        ("chunk_offsets 65536 ids", 2, 10, lambda: kernels.chunk_offsets(large, 2, 32, 262_144, constants)),
        (
            "4096 bags of 16",
            2,
            10,
            lambda: kernels.lookup_bag(weight, large, bags, None, "sum", 64, 32, constants),
        ),
    ]
    # the serial compilation of the lookup called directly (no checks, no set-up): what a 1-thread worker runs
    mode, hash_constants, _ = runtime.hash_setup("paper", constants, 262_144, 32)
    weight_np = weight.numpy()
    for n in (1, 8, 4096):
        ids_np = one.numpy() if n == 1 else small.numpy()[:n]
        out = np.empty((n, 64), np.float32)
        kernel = serial.lookup_for(32)
        args = (weight_np, ids_np, np.int64(0), 64, 32, mode, hash_constants, False, False, out)
        cases.append(
            (f"serial lookup kernel {n} ids", 1, 20_000 if n < 100 else 200, functools.partial(kernel, *args))
        )
    results = {}
    for name, threads, calls, call in cases:
        torch.set_num_threads(threads)
        kernels.set_kernel_threads()
        clock = time.process_time if threads == 1 else time.perf_counter
        call()  # compiled or loaded
        rounds = []
        for _ in range(repeats):
            start = clock()
            for _ in range(calls):
                call()
            rounds.append((clock() - start) / calls * 1e6)
        results[f"{name}, {threads} thread{'s' if threads > 1 else ''}"] = round(statistics.median(rounds), 2)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9, help="rounds; the median is reported")
    parser.add_argument("--no-compile", action="store_true", help="only the calls")
    args = parser.parse_args(argv)
    report: dict[str, object] = {}
    if not args.no_compile:
        report["compile_s"] = compile_seconds()
    report["call_us"] = call_microseconds(args.repeats)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
