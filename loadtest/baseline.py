"""The ceiling: the in-process kernel doing a binary lookup's work without HTTP.

Per batch size it times what a binary lookup must do at the very least: decode the request's int64
bytes, hash + gather the rows with ``robez_core``'s fused ``Table.lookup``, and encode the float32
rows to bytes, with the allocator set up as a server worker's
(``robez_core.allocator.keep_freed_buffers``). It also times ``Table.hash`` and ``Table.gather``
apart, for the report's time split. Rounds alternate over the batch sizes and each figure is the
median of its rounds. It runs in its own spawned process pinned to the given cores with the given
kernel thread count, so it gets the same CPU a server worker would.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from service.config import Settings

from .stats import make_sampler, percentile, rate

DEFAULT_MMAP_THRESHOLD_MB: int = Settings.model_fields["malloc_mmap_threshold_mb"].default


@dataclass(frozen=True)
class KernelResult:
    """Timing of one batch size: whole calls (decode + fused lookup + encode), and each part alone (ms).

    ``hash`` + ``gather`` is the unfused path the server's Server-Timing reports; ``lookup`` is the
    fused kernel the call uses; ``encode`` is float32 rows -> bytes.
    """

    batch_size: int
    threads: int
    cores: tuple[int, ...] | None
    calls: int
    seconds: float
    call_ms_p50: float
    hash_ms_p50: float
    gather_ms_p50: float
    lookup_ms_p50: float
    encode_ms_p50: float
    # ids/s of each round (rounds alternate over the batch sizes); their median is the figure used
    round_ids_per_s: tuple[float, ...] = ()

    @property
    def calls_per_s(self) -> float:
        return self.ids_per_s / self.batch_size

    @property
    def ids_per_s(self) -> float:
        """The median over rounds (all calls over all time when there were no rounds)."""
        if self.round_ids_per_s:
            return float(statistics.median(self.round_ids_per_s))
        return rate(self.calls * self.batch_size, self.seconds)


def _measure(
    batch_sizes: tuple[int, ...],
    table_config: dict[str, object],
    cores: tuple[int, ...] | None,
    threads: int,
    seconds_per_size: float,
    max_calls: int,
    distribution: str,
    num_ids: int,
    zipf_exponent: float,
    seed: int,
    rounds: int,
    mmap_threshold_mb: int,
) -> list[KernelResult]:
    if cores:
        os.sched_setaffinity(0, cores)
    import torch

    from robez_core.allocator import keep_freed_buffers
    from robez_core.config import TableConfig
    from robez_core.table import Table

    # the allocator behaviour a server worker gets (service/app.py): without it, whether 1 MiB of rows
    # is page-faulted in afresh on every call depends on what this process freed before
    keep_freed_buffers(mmap_threshold_mb)
    torch.set_num_threads(threads)
    table = Table(TableConfig(**table_config))  # type: ignore[arg-type]
    sampler = make_sampler(distribution, num_ids, zipf_exponent, seed)
    bodies = {size: [sampler.sample(size).astype("<i8").tobytes() for _ in range(8)] for size in batch_sizes}

    def decode(body: bytes) -> torch.Tensor:
        # a writable copy, as a server must make before handing the ids to torch
        return torch.from_numpy(np.frombuffer(body, dtype="<i8").copy())

    def call(body: bytes) -> bytes:
        return table.lookup(decode(body)).numpy().tobytes()

    for size in batch_sizes:
        for body in bodies[size][:3]:  # warm-up: numba dispatch, first-touch of the array
            call(body)
    call_times: dict[int, list[float]] = {size: [] for size in batch_sizes}
    round_rates: dict[int, list[float]] = {size: [] for size in batch_sizes}
    elapsed = dict.fromkeys(batch_sizes, 0.0)
    # rounds alternate over the batch sizes, so a slow spell of the machine hits all of them alike
    for _ in range(rounds):
        for size in batch_sizes:
            times = call_times[size]
            calls_before = len(times)
            budget = max(1, max_calls // rounds)
            started = time.perf_counter()
            deadline = started + seconds_per_size / rounds
            while len(times) - calls_before < budget and time.perf_counter() < deadline:
                before = time.perf_counter()
                call(bodies[size][len(times) % 8])
                times.append(time.perf_counter() - before)
            spent = time.perf_counter() - started
            elapsed[size] += spent
            round_rates[size].append(rate((len(times) - calls_before) * size, spent))
    results = []
    for size in batch_sizes:
        parts: dict[str, list[float]] = {"hash": [], "gather": [], "lookup": [], "encode": []}
        for index in range(min(len(call_times[size]), 200)):
            ids = decode(bodies[size][index % 8])
            moments = [time.perf_counter()]
            offsets = table.hash(ids)
            moments.append(time.perf_counter())
            table.gather(offsets)
            moments.append(time.perf_counter())
            rows = table.lookup(ids)
            moments.append(time.perf_counter())
            rows.numpy().tobytes()
            moments.append(time.perf_counter())
            for name, begin, end in zip(parts, moments, moments[1:], strict=False):
                parts[name].append(end - begin)
        results.append(
            KernelResult(
                batch_size=size,
                threads=threads,
                cores=cores,
                calls=len(call_times[size]),
                seconds=elapsed[size],
                call_ms_p50=percentile(call_times[size], 50.0) * 1e3,
                hash_ms_p50=percentile(parts["hash"], 50.0) * 1e3,
                gather_ms_p50=percentile(parts["gather"], 50.0) * 1e3,
                lookup_ms_p50=percentile(parts["lookup"], 50.0) * 1e3,
                encode_ms_p50=percentile(parts["encode"], 50.0) * 1e3,
                round_ids_per_s=tuple(round_rates[size]),
            )
        )
    return results


def measure_kernel(
    batch_sizes: tuple[int, ...],
    table_config: dict[str, object],
    *,
    cores: tuple[int, ...] | None = None,
    threads: int = 1,
    seconds_per_size: float = 1.0,
    max_calls: int = 200_000,
    distribution: str = "uniform",
    num_ids: int = 1_000_000,
    zipf_exponent: float = 1.05,
    seed: int = 0,
    rounds: int = 5,
    mmap_threshold_mb: int = DEFAULT_MMAP_THRESHOLD_MB,
) -> list[KernelResult]:
    """Time decode + ``Table.lookup`` + encode per batch size in a fresh process pinned to ``cores``:
    ``rounds`` rounds over the batch sizes, ``seconds_per_size / rounds`` each, with glibc's malloc
    thresholds set as a server worker sets them (``robez_core.allocator.keep_freed_buffers``; 0: glibc's
    defaults)."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        future = pool.submit(
            _measure,
            batch_sizes,
            table_config,
            cores,
            threads,
            seconds_per_size,
            max_calls,
            distribution,
            num_ids,
            zipf_exponent,
            seed,
            max(1, rounds),
            mmap_threshold_mb,
        )
        return future.result(timeout=600)
