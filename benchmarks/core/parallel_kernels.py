"""What the parallel kernels cost a call at 2 threads, through ``robez_core.kernels`` (checks, set-up and
the serial/parallel choice of ``_PARALLEL_MIN_WORK`` included), for an A/B of two checkouts run
alternately (docs/benchmarks/kernel-compile-2026-11-28.md).

``python benchmarks/core/parallel_kernels.py`` with ``PYTHONPATH`` set to the checkout to measure (run as
a script, so that another checkout's ``robez_core`` is the one imported) prints one JSON object: for each
case the median and the minimum over ``--repeats`` rounds of the mean wall microseconds of a call, on a
2**22-float table (16 MiB, bigger than the caches, as a served table), numba's cache warm (one call
before the rounds). On a shared 2-core machine a round whose second thread waited for a core takes
milliseconds more: the minimum is the figure to compare.

- ``lookup``, ``gather``, ``chunk_offsets`` of 2,048 to 131,072 ids; ``lookup_bag`` of as many ids in
  bags of 16; d = 64 and 16, Z = 32 and 8;
- the sparse optimizer steps (``sgd_step``, ``adagrad_step``, ``adam_step``, ``checked_step``, adam's dry
  run) on 2**16 to 2**20 sorted unique locations.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial


def cases() -> list[tuple[str, Callable[[], object]]]:
    import torch

    from robez_core import kernels, paper_random_numbers

    generator = torch.Generator().manual_seed(0)
    memory_size = 1 << 22
    weight, constants = torch.randn(memory_size, generator=generator), paper_random_numbers()
    found: list[tuple[str, Callable[[], object]]] = []
    for dim, chunk in ((64, 32), (64, 8), (16, 8)):
        for n in (2048, 8192, 32768, 131072):
            ids = torch.randint(0, 1 << 40, (n,), generator=generator)
            offsets = kernels.chunk_offsets(ids, dim // chunk, chunk, memory_size, constants)
            bags = torch.arange(0, n, 16)
            tag = f"d={dim} Z={chunk} {n} ids"
            found += [
                (f"lookup {tag}", partial(kernels.lookup, weight, ids, dim, chunk, constants)),
                (
                    f"lookup_bag {tag}",
                    partial(kernels.lookup_bag, weight, ids, bags, None, "sum", dim, chunk, constants),
                ),
                (f"gather {tag}", partial(kernels.gather, weight, offsets, dim, chunk)),
                (
                    f"chunk_offsets {tag}",
                    partial(kernels.chunk_offsets, ids, dim // chunk, chunk, memory_size, constants),
                ),
            ]
    first, second = torch.zeros(memory_size), torch.zeros(memory_size)
    adam = (1e-3, 0.9, 0.999, 1e-8)
    for k in (1 << 16, 1 << 18, 1 << 20):
        locations = torch.randperm(memory_size, generator=generator)[:k].sort().values
        values = torch.randn(k, generator=generator) * 1e-3
        tag = f"{k} locations"
        found += [
            (f"sgd_step {tag}", partial(kernels.sgd_step, weight, locations, values, 1e-3)),
            (
                f"adagrad_step {tag}",
                partial(kernels.adagrad_step, weight, first, locations, values, 1e-3, 1e-8),
            ),
            (
                f"adam_step {tag}",
                partial(kernels.adam_step, weight, first, second, locations, values, *adam, 1),
            ),
            (
                f"adam_nonfinite {tag}",
                partial(kernels.adam_nonfinite, weight, first, second, locations, values, *adam, 1),
            ),
            (
                f"checked_step adam {tag}",
                partial(kernels.checked_step, "adam", weight, (first, second), locations, values, (*adam, 1)),
            ),
        ]
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9, help="rounds; the median is reported")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--round-ms", type=float, default=20.0, help="about how long a round calls")
    parser.add_argument("--only", default="", help="comma-separated substrings: the cases naming one")
    args = parser.parse_args(argv)
    import torch

    from robez_core import kernels

    torch.set_num_threads(args.threads)
    kernels.set_kernel_threads()
    medians, minima = {}, {}
    only = [part for part in args.only.split(",") if part]
    for name, call in cases():
        if only and not any(part in name for part in only):
            continue
        call()  # compiled or loaded
        start = time.perf_counter()
        call()
        calls = max(1, int(args.round_ms / 1e3 / max(time.perf_counter() - start, 1e-7)))
        rounds = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for _ in range(calls):
                call()
            rounds.append((time.perf_counter() - start) / calls * 1e6)
        medians[name], minima[name] = round(statistics.median(rounds), 2), round(min(rounds), 2)
    print(json.dumps({"median_us": medians, "min_us": minima}))


if __name__ == "__main__":
    main()
