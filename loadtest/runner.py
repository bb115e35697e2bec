"""Drive one load-test run: client processes, closed and open loops, the merged result.

A run is bounded twice: by ``max_requests`` and by ``duration_s`` (after which requests still in
flight get ``drain_s`` to finish and are then counted as ``timeout`` errors). Every non-2xx answer,
transport error or malformed body counts as an error; statuses listed in ``expected_statuses`` are
counted apart and do not fail the run.

Closed loop: ``concurrency`` requests in flight at all times; latency is send -> response.
Open loop: requests are scheduled at a constant ``rate`` whatever the server does, and latency is
measured from the *scheduled* send time, so time spent waiting for a free connection or for the
server's queue shows up in the latency instead of slowing the offered load (no coordinated omission).
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import os
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from typing import Any

import numpy as np

from service.servertiming import parse_server_timing

from .scenarios import RequestTemplate, ScenarioContext, build_requests, check_response
from .stats import Summary, rate
from .transport import (
    GRPC,
    RESP,
    TRANSPORTS,
    GrpcConnection,
    HttpxConnection,
    PreparedRequest,
    RawConnection,
    RespConnection,
    Response,
    TransportError,
)

LOAD_SHAPES: tuple[str, ...] = ("closed", "open")
# A client process using at least this share of one core was the bottleneck (or close to it).
CLIENT_SATURATED_CPU = 0.85
_ERROR_SAMPLES = 3


@dataclass(frozen=True)
class RunSpec:
    """One run: a scenario at one batch size under one load shape.

    ``concurrency`` is the number of connections across all client processes (closed loop: requests
    in flight); ``rate`` is the open loop's total requests/s. ``processes`` splits both evenly.
    """

    label: str
    scenario: str
    batch_size: int = 1
    mode: str = "closed"
    concurrency: int = 8
    rate: float = 0.0
    max_requests: int = 100_000
    duration_s: float = 3.0
    processes: int = 1
    transport: str = "raw"
    expected_statuses: tuple[int, ...] = ()
    drain_s: float = 10.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in LOAD_SHAPES:
            raise ValueError(f"mode must be one of {LOAD_SHAPES}, got {self.mode!r}")
        if self.transport not in (*TRANSPORTS, RESP, GRPC):
            raise ValueError(f"transport must be one of {(*TRANSPORTS, RESP, GRPC)}, got {self.transport!r}")
        if self.processes < 1 or self.concurrency < self.processes:
            raise ValueError("need processes >= 1 and concurrency >= processes (one connection each)")
        if self.mode == "open" and not self.rate > 0:
            raise ValueError("an open-loop run needs rate > 0")
        if self.max_requests < 1 or not self.duration_s > 0:
            raise ValueError("a run needs max_requests >= 1 and duration_s > 0")


@dataclass
class ClientResult:
    """What one client process measured (latencies in ms; times from ``time.time()``)."""

    latency_ms: list[float] = field(default_factory=list)
    hash_ms: list[float] = field(default_factory=list)
    lookup_ms: list[float] = field(default_factory=list)
    server_total_ms: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    error_samples: list[str] = field(default_factory=list)
    expected: Counter[int] = field(default_factory=Counter)
    scheduled: int = 0
    sent: int = 0
    completed: int = 0
    ok: int = 0
    ids: int = 0
    rows: int = 0
    response_bytes: int = 0
    start: float = 0.0
    end: float = 0.0
    cpu_s: float = 0.0
    max_send_lag_ms: float = 0.0
    failure: str | None = None


@dataclass(frozen=True)
class _ClientJob:
    spec: RunSpec
    context: ScenarioContext
    index: int


@dataclass
class RunResult:
    """A run's merged figures. Rates use the window from the first start to the last completion."""

    spec: RunSpec
    embedding_dim: int
    window_s: float
    scheduled: int
    sent: int
    completed: int
    ok: int
    errors: dict[str, int]
    error_samples: list[str]
    expected: dict[int, int]
    statuses: dict[int, int]
    ids: int
    rows: int
    response_bytes: int
    latency_ms: Summary
    hash_ms: Summary
    lookup_ms: Summary
    server_total_ms: Summary
    client_cpu: list[float]
    max_send_lag_ms: float
    failures: list[str]
    server_cores: int | None = None
    server_cpu_cores: float | None = None
    server_cpu_s: float | None = None  # the server tree's CPU seconds over the run
    # busy CPU of everything else on the machine during the run (other users of a shared machine)
    other_cpu_cores: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def requests_per_s(self) -> float:
        return rate(self.ok, self.window_s)

    @property
    def ids_per_s(self) -> float:
        return rate(self.ids, self.window_s)

    @property
    def embedding_bytes_per_s(self) -> float:
        """Float32 embedding payload delivered per second (rows x d x 4), whatever the wire format."""
        return rate(self.rows * self.embedding_dim * 4, self.window_s)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def failed(self) -> bool:
        """Any unexpected error, a crashed client, or a run that completed nothing."""
        return bool(self.errors) or bool(self.failures) or self.ok + sum(self.expected.values()) == 0

    @property
    def client_saturated(self) -> bool:
        return any(cpu >= CLIENT_SATURATED_CPU for cpu in self.client_cpu)


def merge_results(spec: RunSpec, embedding_dim: int, parts: list[ClientResult]) -> RunResult:
    """Combine the client processes' results of one run into one ``RunResult``."""
    started = [p.start for p in parts if p.start > 0]
    ended = [p.end for p in parts if p.end > 0]
    window = max(ended) - min(started) if started and ended else 0.0
    errors: Counter[str] = Counter()
    expected: Counter[int] = Counter()
    statuses: Counter[int] = Counter()
    samples: list[str] = []
    for part in parts:
        errors.update(part.errors)
        expected.update(part.expected)
        statuses.update(part.statuses)
        samples.extend(part.error_samples)

    def joined(name: str) -> np.ndarray:
        return np.concatenate(
            [np.asarray(getattr(p, name), dtype=np.float64) for p in parts] or [np.empty(0)]
        )

    return RunResult(
        spec=spec,
        embedding_dim=embedding_dim,
        window_s=window,
        scheduled=sum(p.scheduled for p in parts),
        sent=sum(p.sent for p in parts),
        completed=sum(p.completed for p in parts),
        ok=sum(p.ok for p in parts),
        errors=dict(errors),
        error_samples=samples[:_ERROR_SAMPLES],
        expected=dict(expected),
        statuses=dict(statuses),
        ids=sum(p.ids for p in parts),
        rows=sum(p.rows for p in parts),
        response_bytes=sum(p.response_bytes for p in parts),
        latency_ms=Summary.of(joined("latency_ms")),
        hash_ms=Summary.of(joined("hash_ms")),
        lookup_ms=Summary.of(joined("lookup_ms")),
        server_total_ms=Summary.of(joined("server_total_ms")),
        client_cpu=[p.cpu_s / (p.end - p.start) if p.end > p.start else math.nan for p in parts],
        max_send_lag_ms=max((p.max_send_lag_ms for p in parts), default=0.0),
        failures=[p.failure for p in parts if p.failure],
    )


_AnyConnection = RawConnection | HttpxConnection | RespConnection | GrpcConnection


class _ConnectionPool:
    """``size`` connections handed out one request at a time; waiting for one counts as latency."""

    def __init__(self, context: ScenarioContext, transport: str, size: int, timeout_s: float) -> None:
        self._idle: asyncio.Queue[_AnyConnection] = asyncio.Queue()
        self._all: list[_AnyConnection] = []
        if transport == "httpx":
            shared = HttpxConnection(context.target, size, timeout_s)
            self._all.append(shared)
            for _ in range(size):
                self._idle.put_nowait(shared)
        else:
            for _ in range(size):
                connection: _AnyConnection
                if transport == GRPC:
                    if context.grpc_target is None:
                        raise ValueError("the grpc transport needs the server's gRPC port (grpc_target)")
                    connection = GrpcConnection(context.grpc_target)
                elif transport == RESP:
                    connection = RespConnection(context.target)
                else:
                    connection = RawConnection(context.target)
                self._all.append(connection)
                self._idle.put_nowait(connection)

    async def send(self, request: PreparedRequest) -> Response:
        connection = await self._idle.get()
        try:
            return await connection.send(request)
        finally:
            self._idle.put_nowait(connection)

    async def close(self) -> None:
        for connection in self._all:
            await connection.close()


class _Recorder:
    """Sends one request and books its outcome into a ``ClientResult``."""

    def __init__(
        self, result: ClientResult, spec: RunSpec, pool: _ConnectionPool, embedding_dim: int
    ) -> None:
        self.result = result
        self._expected = frozenset(spec.expected_statuses)
        self._pool = pool
        self._dim = embedding_dim

    def _error(self, kind: str, detail: str) -> None:
        self.result.errors[kind] += 1
        if len(self.result.error_samples) < _ERROR_SAMPLES:
            self.result.error_samples.append(f"{kind}: {detail[:300]}")

    async def exchange(self, template: RequestTemplate, started: float) -> None:
        """``started`` is ``perf_counter()`` at the send (closed) or scheduled send (open loop)."""
        result = self.result
        result.sent += 1
        try:
            response = await self._pool.send(template.request)
        except TransportError as exc:
            result.completed += 1
            self._error(f"transport {str(exc).split(':', 1)[0]}", str(exc))
            return
        finished = time.perf_counter()
        result.completed += 1
        result.statuses[response.status] += 1
        if not 200 <= response.status < 300:
            if response.status in self._expected:
                result.expected[response.status] += 1
            else:
                self._error(f"status {response.status}", response.body.decode("utf-8", "replace"))
            return
        problem = check_response(template, response, self._dim)
        if problem is not None:
            self._error("bad response", problem)
            return
        result.ok += 1
        result.ids += template.ids
        result.rows += template.rows
        result.response_bytes += len(response.body)
        result.latency_ms.append((finished - started) * 1e3)
        if template.kind not in ("healthz", "peer", "floor", "grpc"):
            timing = parse_server_timing(response.headers.get("server-timing"))
            result.hash_ms.append(timing.get("hash", math.nan))
            # a push's apply (a training step's too: its "lookup" is the lookup part's gather)
            stage = ("apply", "lookup") if template.kind == "update" else ("lookup", "apply")
            result.lookup_ms.append(timing.get(stage[0], timing.get(stage[1], math.nan)))
            result.server_total_ms.append(timing.get("total", math.nan))


async def _closed_loop(
    spec: RunSpec, templates: list[RequestTemplate], recorder: _Recorder, index: int
) -> None:
    share = _share(spec.concurrency, spec.processes, index)
    budget = _share(spec.max_requests, spec.processes, index)
    deadline = time.perf_counter() + spec.duration_s
    issued = 0

    async def worker(offset: int) -> None:
        nonlocal issued
        position = offset
        while issued < budget and time.perf_counter() < deadline:
            issued += 1
            template = templates[position % len(templates)]
            position += share
            await recorder.exchange(template, time.perf_counter())

    await _bounded(spec, [asyncio.ensure_future(worker(i)) for i in range(share)], recorder)
    recorder.result.scheduled = issued  # a closed loop schedules exactly what it sends


async def _open_loop(
    spec: RunSpec, templates: list[RequestTemplate], recorder: _Recorder, index: int
) -> None:
    process_rate = spec.rate / spec.processes
    interval = 1.0 / process_rate
    budget = _share(spec.max_requests, spec.processes, index)
    start = time.perf_counter()
    # processes interleave their schedules instead of all sending at the same instants
    phase = interval * index / spec.processes
    count = max(0, min(budget, math.ceil((spec.duration_s - phase) / interval)))
    recorder.result.scheduled = count
    tasks: list[asyncio.Future[None]] = []
    result = recorder.result
    for number in range(count):
        scheduled = start + phase + number * interval
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        result.max_send_lag_ms = max(result.max_send_lag_ms, (time.perf_counter() - scheduled) * 1e3)
        tasks.append(asyncio.ensure_future(recorder.exchange(templates[number % len(templates)], scheduled)))
    await _bounded(spec, tasks, recorder, already_waited=time.perf_counter() - start)


async def _bounded(
    spec: RunSpec, tasks: list[asyncio.Future[None]], recorder: _Recorder, already_waited: float = 0.0
) -> None:
    """Wait for the run's tasks; after duration + drain, cancel the rest and count them as timeouts."""
    if not tasks:
        return
    limit = max(0.0, spec.duration_s + spec.drain_s - already_waited)
    _, pending = await asyncio.wait(tasks, timeout=limit)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending, timeout=1.0)
    stuck = recorder.result.sent - recorder.result.completed
    if stuck:
        recorder.result.errors["timeout"] += stuck
        recorder.result.completed += stuck


def _share(total: int, parts: int, index: int) -> int:
    """Process ``index``'s part of ``total`` split as evenly as possible over ``parts``."""
    return total // parts + (1 if index < total % parts else 0)


async def _run_client(job: _ClientJob, templates: list[RequestTemplate], result: ClientResult) -> None:
    spec = job.spec
    share = _share(spec.concurrency, spec.processes, job.index)
    timeout = spec.duration_s + spec.drain_s
    pool = _ConnectionPool(job.context, spec.transport, share, timeout)
    recorder = _Recorder(result, spec, pool, job.context.embedding_dim)
    cpu_start = time.process_time()
    result.start = time.time()
    try:
        if spec.mode == "closed":
            await _closed_loop(spec, templates, recorder, job.index)
        else:
            await _open_loop(spec, templates, recorder, job.index)
    finally:
        result.end = time.time()
        result.cpu_s = time.process_time() - cpu_start
        await pool.close()


def _event_loop_runner() -> Any:
    try:
        import uvloop  # a faster loop means less client CPU per request

        return uvloop.run
    except ImportError:
        return asyncio.run


def _client_main(
    index: int, cores: tuple[int, ...] | None, jobs: Queue[Any], results: Queue[Any], barrier: Barrier
) -> None:
    """Client process body: build the job's requests, wait for every client, run, report; repeat."""
    if cores:
        os.sched_setaffinity(0, cores)
    run = _event_loop_runner()
    while True:
        job: _ClientJob | None = jobs.get()
        if job is None:
            return
        result = ClientResult()
        templates: list[RequestTemplate] = []
        try:
            templates = build_requests(
                job.spec.scenario, job.spec.batch_size, job.context, job.spec.seed * 1009 + job.index
            )
        except Exception as exc:  # reported to the parent, which fails the run
            result.failure = f"client {index} could not build requests: {exc!r}"
        barrier.wait()
        if result.failure is None:
            try:
                run(_run_client(job, templates, result))
            except Exception as exc:
                result.failure = f"client {index} crashed: {exc!r}"
        results.put((index, result))


class ClientFleet:
    """``processes`` spawned client processes (optionally pinned to ``cores``), reused across runs.

    Spawned (not forked) so the clients carry none of the parent's threads or torch state.
    """

    def __init__(self, processes: int, cores: tuple[int, ...] | None = None, start_timeout_s: float = 120.0):
        context = multiprocessing.get_context("spawn")
        self.processes = processes
        self.cores = cores
        self._start_timeout = start_timeout_s
        self._jobs: list[Queue[Any]] = [context.Queue() for _ in range(processes)]
        self._results: Queue[Any] = context.Queue()
        self._barrier = context.Barrier(processes + 1)
        self._procs = [
            context.Process(
                target=_client_main,
                args=(i, cores, self._jobs[i], self._results, self._barrier),
                daemon=True,
                name=f"loadtest-client-{i}",
            )
            for i in range(processes)
        ]
        for proc in self._procs:
            proc.start()

    def run(self, spec: RunSpec, context: ScenarioContext, on_start: Any = None) -> RunResult:
        """Run ``spec`` on every process at once; ``on_start()`` is called as the clients are released."""
        spec = replace(spec, processes=self.processes, concurrency=max(spec.concurrency, self.processes))
        for index in range(self.processes):
            self._jobs[index].put(_ClientJob(spec, context, index))
        self._barrier.wait(timeout=self._start_timeout)
        if on_start is not None:
            on_start()
        collect_timeout = spec.duration_s + spec.drain_s + 60.0
        parts: list[ClientResult] = [ClientResult() for _ in range(self.processes)]
        for _ in range(self.processes):
            index, part = self._results.get(timeout=collect_timeout)
            parts[index] = part
        return merge_results(spec, context.embedding_dim, parts)

    def close(self) -> None:
        for queue in self._jobs:
            queue.put(None)
        for proc in self._procs:
            proc.join(timeout=5.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5.0)

    def __enter__(self) -> ClientFleet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
