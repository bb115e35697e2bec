"""The ceiling: the in-process kernel doing a binary lookup's work without HTTP.

Per batch size it times what a binary lookup must do at the very least: decode the request's int64
bytes, hash + gather the rows with ``robez_core``'s fused ``Table.lookup``, and encode the float32
rows to bytes. It also times ``Table.hash`` and ``Table.gather`` apart, for the report's time split.
It runs in its own spawned process pinned to the given cores with the given kernel thread count, so
it gets the same CPU a server worker would.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from .stats import make_sampler, percentile, rate


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

    @property
    def calls_per_s(self) -> float:
        return rate(self.calls, self.seconds)

    @property
    def ids_per_s(self) -> float:
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
) -> list[KernelResult]:
    if cores:
        os.sched_setaffinity(0, cores)
    import torch

    from robez_core.config import TableConfig
    from robez_core.table import Table

    torch.set_num_threads(threads)
    table = Table(TableConfig(**table_config))  # type: ignore[arg-type]
    sampler = make_sampler(distribution, num_ids, zipf_exponent, seed)
    results = []
    for batch_size in batch_sizes:
        bodies = [sampler.sample(batch_size).astype("<i8").tobytes() for _ in range(8)]

        def decode(body: bytes) -> torch.Tensor:
            # a writable copy, as a server must make before handing the ids to torch
            return torch.from_numpy(np.frombuffer(body, dtype="<i8").copy())

        def call(body: bytes) -> bytes:
            return table.lookup(decode(body)).numpy().tobytes()

        for body in bodies[:3]:  # warm-up: numba dispatch, first-touch of the array
            call(body)
        call_times: list[float] = []
        started = time.perf_counter()
        deadline = started + seconds_per_size
        while len(call_times) < max_calls and time.perf_counter() < deadline:
            before = time.perf_counter()
            call(bodies[len(call_times) % len(bodies)])
            call_times.append(time.perf_counter() - before)
        elapsed = time.perf_counter() - started
        parts: dict[str, list[float]] = {"hash": [], "gather": [], "lookup": [], "encode": []}
        for index in range(min(len(call_times), 200)):
            ids = decode(bodies[index % len(bodies)])
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
                batch_size=batch_size,
                threads=threads,
                cores=cores,
                calls=len(call_times),
                seconds=elapsed,
                call_ms_p50=percentile(call_times, 50.0) * 1e3,
                hash_ms_p50=percentile(parts["hash"], 50.0) * 1e3,
                gather_ms_p50=percentile(parts["gather"], 50.0) * 1e3,
                lookup_ms_p50=percentile(parts["lookup"], 50.0) * 1e3,
                encode_ms_p50=percentile(parts["encode"], 50.0) * 1e3,
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
) -> list[KernelResult]:
    """Time decode + ``Table.lookup`` + encode per batch size in a fresh process pinned to ``cores``."""
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
        )
        return future.result(timeout=600)
