"""``python -m benchmarks.core.compress``: times ``least_squares_array`` on a random full table.

Prints the median and minimum wall time over ``--repeat`` runs, the values per second and the CPU time,
then the machine (CPU model and its AVX flags, CPUs, torch threads, load average).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from collections.abc import Sequence

import torch

from robez_core import hostinfo
from robez_core.compress import least_squares_array

_AVX_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512vl")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.core.compress", description=__doc__)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--compression", type=float, default=16.0)
    parser.add_argument("--chunk-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="default: torch's")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    full = torch.empty(args.rows, args.dim).uniform_(-1, 1)
    memory_size = int(args.rows * args.dim / args.compression)
    least_squares_array([full[:1000]], memory_size, chunk_size=args.chunk_size)  # load the kernels
    seconds, cpu_seconds = [], []
    for _ in range(args.repeat):
        started, started_cpu = time.perf_counter(), time.process_time()
        least_squares_array([full], memory_size, chunk_size=args.chunk_size)
        seconds.append(time.perf_counter() - started)
        cpu_seconds.append(time.process_time() - started_cpu)
    flags = " ".join(hostinfo.listed_flags(_AVX_FLAGS) or ())
    seconds.sort()
    cpu_seconds.sort()
    print(
        f"least_squares_array: {args.rows:,} x {args.dim} full table -> m = {memory_size:,} "
        f"({args.compression:g}x, Z = {args.chunk_size}): median {seconds[len(seconds) // 2]:.2f} s, "
        f"min {seconds[0]:.2f} s of {args.repeat} "
        f"({args.rows * args.dim / seconds[0] / 1e9:.2f} G values/s); "
        f"CPU time (user + system) median {cpu_seconds[len(cpu_seconds) // 2]:.2f} s\n"
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
        f"{hostinfo.cpu_model()} ({flags}), {hostinfo.logical_cpus()} CPUs, "
        f"torch threads {torch.get_num_threads()}, load average "
        f"{', '.join(f'{v:.1f}' for v in hostinfo.load_average())}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
