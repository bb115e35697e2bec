"""The measurement plan: baselines, per-core-count server runs, open-loop load steps.

For each core count k the sweep starts ``robez serve --workers k`` pinned to cores ``0..k-1`` and
puts the client processes on the cores left over (or on all cores when none are left, which the
report flags). Against each server it runs the HTTP floor (/healthz), single-id JSON lookups and
binary lookups at every batch size; against the first it also runs the remaining scenarios, the
open-loop steps and the httpx cross-check (``--features-every-count``: the pooled, multi, update and mix
runs against every server too, so their scaling is measured). The framework floor
(``loadtest/floor.py``) runs beside each server on the same cores, idle while robez is measured: its
trivial route first, and at 1 worker its ``/rows`` route right before the binary lookups of
``ROWS_FLOOR_BATCHES`` ids. The in-process kernel baseline runs pinned to one core.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import shlex
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

import httpx

from robez_core import hostinfo
from robez_core.config import TableConfig

from .baseline import DEFAULT_MMAP_THRESHOLD_MB, KernelResult, measure_kernel
from .profile import Profiler, ProfileSummary
from .runner import ClientFleet, RunResult, RunSpec
from .scenarios import FLOOR_ROWS, PEER_UPDATE, SCENARIOS, ScenarioContext, redis_key
from .server import (
    MAIN_TABLE,
    MULTI_TABLES,
    TABLE_CONFIG,
    BaselineProcess,
    machine_busy_seconds,
    redis_server_path,
    rss_bytes,
    running_floor,
    running_redis,
    running_server,
    tree_cpu_seconds,
    tree_rss_bytes,
)
from .transport import GRPC, RESP, Target, resp_command

REFERENCE_BATCH = 4096  # the binary-lookup target batch
# Binary batches the framework floor also answers with the lookup's bytes (1 worker, next to the lookup).
ROWS_FLOOR_BATCHES: tuple[int, ...] = (512, REFERENCE_BATCH)
FEATURE_SCENARIOS: tuple[str, ...] = ("pooled", "multi", "update", "mix", "step")
SMALL_UPDATE_BATCH = 8  # a gradient push of one user's handful of rows
PEER_MAX_BATCH = 4096  # MGET batches measured against Redis (its replies grow 256 bytes per row)
_PEER_FILL_CHUNK = 16384  # rows per MSET while filling Redis


@dataclass(frozen=True)
class PeerMemory:
    """What each server needed to hold the table: robez's array vs Redis holding one row per id."""

    rows: int
    row_bytes: int
    redis_dataset_bytes: int  # INFO used_memory after filling minus before
    redis_rss_bytes: int
    robez_table_bytes: int  # the table's array and optimizer state (GET /v1/tables/{t}: memory_bytes)
    robez_rss_bytes: int  # the robez server's process tree (torch and numba included)


@dataclass(frozen=True)
class SweepConfig:
    """Everything one ``python -m loadtest`` invocation measures (see ``__main__`` for the options)."""

    url: str | None = None
    table: str | None = None
    multi_tables: tuple[str, ...] | None = None
    cpus: tuple[int, ...] = (1,)
    scenarios: tuple[str, ...] = SCENARIOS
    batch_sizes: tuple[int, ...] = (1, 64, 512, 4096, 32768)
    feature_batch: int = 512
    duration_s: float = 3.0
    max_requests: int = 200_000
    concurrency_per_worker: int = 8
    clients: int | None = None
    transport: str = "raw"
    distribution: str = "uniform"
    zipf_exponent: float = 1.05
    num_ids: int = 1_000_000
    bag_size: int = 32
    open_loop_fractions: tuple[float, ...] = (0.25, 0.5, 0.75, 0.9, 1.1)
    kernel_seconds: float = 1.0
    api_key: str | None = None
    server_pid: int | None = None
    server_env: dict[str, str] = field(default_factory=dict)
    seed: int = 0
    quick: bool = False
    profile: bool = False
    notes: tuple[str, ...] = ()  # free text for the report's machine section (--note)
    features_every_count: bool = False  # pooled / multi / update / mix at every core count too
    machine_name: str | None = None  # the report's host name (--machine-name); None: socket.gethostname()


@dataclass
class SweepResult:
    """All figures of one invocation, in the order they were measured."""

    config: SweepConfig
    command: str
    machine: dict[str, str]
    started: float
    finished: float = 0.0
    runs: list[RunResult] = field(default_factory=list)
    kernel: list[KernelResult] = field(default_factory=list)
    profiles: list[ProfileSummary] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    table_config: dict[str, Any] = field(default_factory=lambda: dict(TABLE_CONFIG))
    peer_memory: PeerMemory | None = None

    @property
    def failed_runs(self) -> list[RunResult]:
        return [run for run in self.runs if run.failed]


def machine_info() -> dict[str, str]:
    """What the report says about the machine the figures come from."""
    memory_gib = hostinfo.memory_gib()
    try:
        import torch

        torch_version = str(torch.__version__)
    except ImportError:
        torch_version = "not installed"
    return {
        "host": socket.gethostname(),
        "cpu": hostinfo.cpu_model(),
        "cores": str(hostinfo.usable_cpus()),
        "memory": "unknown" if math.isnan(memory_gib) else f"{memory_gib:.1f} GiB",
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch_version,
        "load average (1, 5, 15 min) at start": _load_average(),
    }


LOAD_AT_END = "load average (1, 5, 15 min) at end"


def _load_average() -> str:
    return ", ".join(f"{v:.2f}" for v in hostinfo.load_average())


def _embedding_dim(target: Target, table: str, api_key: str | None) -> int:
    """d of ``table``, read from the X-Robez-Shape of a one-id binary lookup (the wire the test uses)."""
    headers = {"Content-Type": "application/octet-stream", "Accept": "application/octet-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    reply = httpx.post(
        f"{target.base_url}/v1/tables/{table}/lookup",
        content=(0).to_bytes(8, "little"),
        headers=headers,
        timeout=30,
    )
    if reply.status_code != 200:
        raise RuntimeError(
            f"probe lookup on table {table!r} answered {reply.status_code}: {reply.text[:300]}"
        )
    return int(reply.headers["x-robez-shape"].split(",")[1])


def _warm_up(target: Target, table: str, batch_sizes: tuple[int, ...], api_key: str | None) -> None:
    """One lookup per batch size and one JSON lookup, so no run pays for first-call kernel loading.

    Failures are left to the measured runs to count and report.
    """
    headers = {"Content-Type": "application/octet-stream", "Accept": "application/octet-stream"}
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = f"{target.base_url}/v1/tables/{table}/lookup"
    with httpx.Client(timeout=60) as client:
        for batch in batch_sizes:
            client.post(url, content=bytes(8 * batch), headers={**headers, **auth})
        client.post(url, json={"ids": [1]}, headers=auth)


class Sweep:
    """Runs a ``SweepConfig``; ``progress`` receives one line per step as it happens."""

    def __init__(self, config: SweepConfig, command: str, progress: Callable[[str], None]) -> None:
        self.config = config
        self.progress = progress
        self.result = SweepResult(config, command, machine_info(), time.time())
        if config.machine_name:
            self.result.machine["host"] = config.machine_name

    def run(self) -> SweepResult:
        config = self.config
        kernel_cores = None if config.url else (0,)
        kernel_batches = tuple(sorted(set(config.batch_sizes) | {1}))
        table_config = self._external_table_config() if config.url else TABLE_CONFIG
        self.result.table_config = table_config
        self.progress(f"kernel baseline: batch sizes {list(kernel_batches)}, 1 thread, cores {kernel_cores}")
        self.result.kernel = measure_kernel(
            kernel_batches,
            table_config,
            cores=kernel_cores,
            threads=1,
            seconds_per_size=config.kernel_seconds,
            distribution=config.distribution,
            num_ids=config.num_ids,
            zipf_exponent=config.zipf_exponent,
            seed=config.seed,
            mmap_threshold_mb=int(
                config.server_env.get("ROBEZ_MALLOC_MMAP_THRESHOLD_MB", DEFAULT_MMAP_THRESHOLD_MB)
            ),
        )
        for kernel in self.result.kernel:
            self.progress(
                f"  kernel batch {kernel.batch_size:>6}: {kernel.ids_per_s:>14,.0f} ids/s "
                f"({kernel.call_ms_p50:.3f} ms/call p50)"
            )
        if config.url:
            from .transport import loopback_target

            target = loopback_target(config.url)
            self._against(target, None, server_cores=None, server_pid=config.server_pid, first=True)
        else:
            total_cores = sorted(os.sched_getaffinity(0))
            for number, workers in enumerate(config.cpus):
                if workers > len(total_cores):
                    self.result.notes.append(f"skipped {workers} workers: only {len(total_cores)} cores here")
                    continue
                server_cores = tuple(total_cores[:workers])
                self.progress(f"starting robez serve --workers {workers} on cores {list(server_cores)}")
                grpc = "grpc" in config.scenarios
                with running_server(workers, server_cores, env=config.server_env, grpc=grpc) as server:
                    self._against(
                        server.target,
                        server.grpc_target,
                        server_cores=server_cores,
                        server_pid=server.process.pid,
                        first=number == 0,
                    )
        self.result.finished = time.time()
        self.result.machine[LOAD_AT_END] = _load_average()
        return self.result

    def _external_table_config(self) -> dict[str, Any]:
        """The --url server's table config (GET /v1/tables/{name}), so the kernel baseline matches it."""
        from .transport import loopback_target

        table = self.config.table or "demo"
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        url = f"{loopback_target(self.config.url or '').base_url}/v1/tables/{table}"
        try:
            reply = httpx.get(url, headers=headers, timeout=30)
            described = reply.json().get("config") if reply.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            described = None
        if not isinstance(described, dict):
            self.result.notes.append(
                f"could not read table {table!r}'s config from the server: the kernel baseline used d=64,"
                " Z=32, m=262144"
            )
            return TABLE_CONFIG
        known = {f.name for f in fields(TableConfig)}
        config = {key: value for key, value in described.items() if key in known and value is not None}
        if isinstance(config.get("random_numbers"), list):
            config["random_numbers"] = tuple(config["random_numbers"])
        return config

    def _client_layout(
        self, server_cores: tuple[int, ...] | None
    ) -> tuple[tuple[int, ...] | None, int, bool]:
        """(client cores or None for unpinned, client processes, whether clients share the server's cores)."""
        all_cores = tuple(sorted(os.sched_getaffinity(0)))
        if server_cores is None:
            return None, self.config.clients or 1, False
        spare = tuple(core for core in all_cores if core not in server_cores)
        shared = not spare
        cores = spare or all_cores
        return cores, self.config.clients or len(cores), shared

    def _against(
        self,
        target: Target,
        grpc_target: Target | None,
        *,
        server_cores: tuple[int, ...] | None,
        server_pid: int | None,
        first: bool,
    ) -> None:
        config = self.config
        table = config.table or ("demo" if config.url else MAIN_TABLE)
        multi_tables = config.multi_tables or (MULTI_TABLES if not config.url else (table,))
        dim = _embedding_dim(target, table, config.api_key)
        _warm_up(target, table, config.batch_sizes, config.api_key)
        context = ScenarioContext(
            target=target,
            table=table,
            tables=multi_tables,
            embedding_dim=dim,
            distribution=config.distribution,
            num_ids=config.num_ids,
            zipf_exponent=config.zipf_exponent,
            bag_size=config.bag_size,
            api_key=config.api_key,
            grpc_target=grpc_target,
        )
        client_cores, processes, shared = self._client_layout(server_cores)
        workers = len(server_cores) if server_cores else 1
        concurrency = max(processes, config.concurrency_per_worker * workers)
        self.progress(
            f"  clients: {processes} process(es) on cores {list(client_cores) if client_cores else 'any'}"
            + (" (sharing the server's cores: no spare core)" if shared else "")
        )
        base = RunSpec(
            label="",
            scenario="healthz",
            concurrency=concurrency,
            max_requests=config.max_requests,
            duration_s=config.duration_s,
            transport=config.transport,
            seed=config.seed,
        )
        with ClientFleet(processes, client_cores) as fleet, contextlib.ExitStack() as floor_running:

            def measure(spec: RunSpec) -> RunResult:
                return self._measure(fleet, spec, context, server_cores, server_pid, shared)

            wanted = set(config.scenarios)
            floor = self._start_floor(floor_running, server_cores) if "floor" in wanted else None
            if floor is not None:
                spec = replace(base, label="framework floor (bare Starlette, same uvicorn)", scenario="floor")
                self._measure_floor(fleet, spec, context, floor, server_cores, shared)
                if not first:  # the /rows floor runs at 1 worker only
                    floor_running.close()
                    floor = None
            if "healthz" in wanted:
                measure(replace(base, label="HTTP floor", scenario="healthz"))
            if "json" in wanted:
                measure(replace(base, label="JSON lookup", scenario="json", batch_size=1))
            reference: RunResult | None = None
            if "binary" in wanted:
                for batch in config.batch_sizes:
                    if floor is not None and first and batch in ROWS_FLOOR_BATCHES:
                        # the same request answered with the same bytes by the bare app, right before
                        label = "framework floor sending the lookup's bytes"
                        spec = replace(base, label=label, scenario=FLOOR_ROWS, batch_size=batch)
                        self._measure_floor(fleet, spec, context, floor, server_cores, shared)
                    run = measure(replace(base, label="binary lookup", scenario="binary", batch_size=batch))
                    if batch == _open_loop_batch(config.batch_sizes):
                        reference = run
            floor_running.close()  # idle from here on: stop it before the feature and peer runs

            def small_update() -> None:
                if "update" in wanted:
                    label = f"gradient push (binary), {SMALL_UPDATE_BATCH} ids"
                    measure(replace(base, label=label, scenario="update", batch_size=SMALL_UPDATE_BATCH))

            labels = {
                "pooled": f"pooled lookup, sum over bags of {config.bag_size}",
                "multi": f"multi-table lookup over {len(multi_tables)} table(s)",
                "update": "gradient push (binary)",
                "mix": "mix: 95% lookups / 5% updates",
                "step": f"training step: push + next lookup over {len(multi_tables)} table(s)",
            }

            def feature_runs() -> None:
                for scenario in FEATURE_SCENARIOS:
                    if scenario in wanted:
                        spec = replace(
                            base, label=labels[scenario], scenario=scenario, batch_size=config.feature_batch
                        )
                        measure(spec)

            if not first:
                if config.features_every_count:  # their scaling too (the update lock is shared by workers)
                    small_update()
                    feature_runs()
                return
            small_update()
            if "oip" in wanted:
                for batch in sorted({1, REFERENCE_BATCH} & set(config.batch_sizes)) or [1]:
                    label = "OIP v2 infer (binary tensors)"
                    measure(replace(base, label=label, scenario="oip", batch_size=batch))
            if "grpc" in wanted and grpc_target is None:
                self.result.notes.append("the gRPC runs were skipped: with --url the gRPC port is unknown")
            elif "grpc" in wanted:
                for batch in sorted({1, REFERENCE_BATCH} & set(config.batch_sizes)) or [1]:
                    label = "OIP v2 infer over gRPC (raw tensors)"
                    spec = replace(base, label=label, scenario="grpc", batch_size=batch, transport=GRPC)
                    measure(spec)
            feature_runs()
            if reference is not None and reference.requests_per_s > 0:
                capacity = reference.requests_per_s
                for fraction in config.open_loop_fractions:
                    measure(
                        replace(
                            base,
                            label=f"open loop {fraction:.0%} of closed-loop max",
                            scenario="binary",
                            batch_size=reference.spec.batch_size,
                            mode="open",
                            rate=capacity * fraction,
                            concurrency=max(processes, 4 * concurrency),
                            # over capacity the server may shed load with 503 + Retry-After, as designed
                            expected_statuses=(503,) if fraction > 1.0 else (),
                        )
                    )
            if "healthz" in wanted and config.transport != "httpx":
                measure(
                    replace(base, label="HTTP floor, httpx client", scenario="healthz", transport="httpx")
                )
            if "redis" in wanted:
                self._redis_peer(fleet, base, context, server_cores, server_pid, shared)
            if config.profile and server_pid is not None:
                profiled = [
                    ("json", 1, "single-id JSON lookups"),
                    ("binary", REFERENCE_BATCH, "binary lookups"),
                ]
                for scenario, batch, what in profiled:
                    if scenario in wanted:
                        spec = replace(base, label=f"{what}, 1 worker", scenario=scenario, batch_size=batch)
                        self._profile(fleet, spec, context, server_pid, client_cores)

    def _start_floor(
        self, stack: contextlib.ExitStack, server_cores: tuple[int, ...] | None
    ) -> BaselineProcess | None:
        """The bare Starlette app on the same uvicorn, workers and cores as the server, kept running
        (idle while robez is measured) until ``stack`` closes."""
        if server_cores is None:
            self.result.notes.append(
                "framework floor not measured: it needs a server the load test starts itself (not --url)"
            )
            return None
        workers = len(server_cores)
        self.progress(f"  starting the framework floor (bare Starlette) with {workers} worker(s)")
        return stack.enter_context(running_floor(workers, server_cores))

    def _measure_floor(
        self,
        fleet: ClientFleet,
        spec: RunSpec,
        context: ScenarioContext,
        floor: BaselineProcess,
        server_cores: tuple[int, ...] | None,
        shared: bool,
    ) -> RunResult:
        floor_context = replace(context, target=floor.target)
        return self._measure(fleet, spec, floor_context, server_cores, floor.process.pid, shared)

    def _redis_peer(
        self,
        fleet: ClientFleet,
        base: RunSpec,
        context: ScenarioContext,
        server_cores: tuple[int, ...] | None,
        server_pid: int | None,
        shared: bool,
    ) -> None:
        """Redis holding one full row per id, pinned like the robez server, read and written by the same
        clients: GET / MGET for the lookups, SET / MSET for the updates."""
        executable = redis_server_path()
        if executable is None:
            self.result.notes.append(
                "the Redis peer was skipped: no redis-server (or valkey-server) on PATH. Install Debian's"
                " redis-server (or Valkey) to include it; the load test installs nothing itself."
            )
            return
        if server_cores is None:
            self.result.notes.append("the Redis peer was skipped: with --url the server's cores are unknown")
            return
        config = self.config
        self.progress(
            f"  starting {executable} on cores {list(server_cores)}; filling {config.num_ids:,} rows"
        )
        with running_redis(executable, server_cores) as redis:
            before = _redis_used_memory(redis.target)
            _fill_redis(redis.target, self.result.table_config, config.num_ids)
            memory = PeerMemory(
                rows=config.num_ids,
                row_bytes=context.embedding_dim * 4,
                redis_dataset_bytes=_redis_used_memory(redis.target) - before,
                redis_rss_bytes=rss_bytes(redis.process.pid),
                robez_table_bytes=_table_memory_bytes(context),
                robez_rss_bytes=tree_rss_bytes(server_pid) if server_pid is not None else 0,
            )
            self.result.peer_memory = memory
            peer = replace(context, target=redis.target)
            peer_base = replace(base, transport=RESP)
            for batch in sorted({b for b in config.batch_sizes if b <= PEER_MAX_BATCH} | {1}):
                label = "Redis GET" if batch == 1 else "Redis MGET"
                spec = replace(peer_base, label=label, scenario="redis", batch_size=batch)
                self._measure(fleet, spec, peer, server_cores, redis.process.pid, shared)
            for batch in sorted({SMALL_UPDATE_BATCH, config.feature_batch}):
                spec = replace(peer_base, label="Redis MSET (update)", scenario=PEER_UPDATE, batch_size=batch)
                self._measure(fleet, spec, peer, server_cores, redis.process.pid, shared)

    def _profile(
        self,
        fleet: ClientFleet,
        spec: RunSpec,
        context: ScenarioContext,
        server_pid: int,
        client_cores: tuple[int, ...] | None,
    ) -> None:
        """An extra run under py-spy; only its profile is kept (sampling slows the server down)."""
        self.progress(f"  profiling the server with py-spy: {spec.label} (batch {spec.batch_size}) ...")
        profiler = Profiler(server_pid, spec.label, spec.duration_s, client_cores)
        time.sleep(0.3)  # let py-spy attach before the load starts
        run = fleet.run(spec, context)
        summary = replace(profiler.finish(), requests=run.ok)
        self.result.profiles.append(summary)
        problems = [
            text for text in (summary.error, f"run errors {run.errors}" if run.errors else None) if text
        ]
        self.progress(f"      {summary.samples} samples" + (f" ({'; '.join(problems)})" if problems else ""))

    def _measure(
        self,
        fleet: ClientFleet,
        spec: RunSpec,
        context: ScenarioContext,
        server_cores: tuple[int, ...] | None,
        server_pid: int | None,
        shared: bool,
    ) -> RunResult:
        load = f"rate {spec.rate:,.0f}/s" if spec.mode == "open" else f"concurrency {spec.concurrency}"
        workers = f"{len(server_cores)}w" if server_cores else "ext"
        self.progress(f"  [{workers}] {spec.label} ({spec.scenario}, batch {spec.batch_size}, {load}) ...")
        before: dict[str, float] = {}

        def on_start() -> None:
            before["time"] = time.monotonic()
            before["machine"] = machine_busy_seconds()
            if server_pid is not None:
                before["server"] = tree_cpu_seconds(server_pid)

        result = fleet.run(spec, context, on_start=on_start)
        # CPU over the interval this process watched (release of the clients -> their results are in)
        watched_s = time.monotonic() - before["time"]
        machine_cores = (machine_busy_seconds() - before["machine"]) / watched_s
        client_cores = (
            sum(cpu * result.window_s for cpu in result.client_cpu if math.isfinite(cpu)) / watched_s
        )
        if server_pid is not None and "server" in before:
            result.server_cpu_s = tree_cpu_seconds(server_pid) - before["server"]
            result.server_cpu_cores = result.server_cpu_s / watched_s
            result.other_cpu_cores = max(0.0, machine_cores - result.server_cpu_cores - client_cores)
        result.server_cores = len(server_cores) if server_cores else None
        if shared:
            result.notes.append("clients shared the server's cores")
        if result.client_saturated:
            result.notes.append("client saturated")
        self.result.runs.append(result)
        self.progress("      " + describe(result))
        return result


def _redis_call(sock: socket.socket, command: bytes) -> bytes:
    """Send one RESP command on a blocking socket; the first line of the reply (enough for our uses)."""
    sock.sendall(command)
    reply = b""
    while not reply.endswith(b"\r\n"):
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise RuntimeError("redis-server closed the connection")
        reply += chunk
    if reply.startswith(b"-"):
        raise RuntimeError(f"redis-server answered {reply[:200]!r}")
    return reply


def _fill_redis(target: Target, table_config: dict[str, Any], num_ids: int) -> None:
    """Store the robez table's row of every id in [0, num_ids) as float32 bytes under its own key."""
    import numpy as np
    import torch

    from robez_core.table import Table

    table = Table(TableConfig(**{"seed": 1024, **table_config}))  # the load test's main table
    with socket.create_connection((target.host, target.port), timeout=60) as sock:
        for start in range(0, num_ids, _PEER_FILL_CHUNK):
            ids = torch.arange(start, min(num_ids, start + _PEER_FILL_CHUNK), dtype=torch.int64)
            rows = np.ascontiguousarray(table.lookup(ids).numpy(), dtype="<f4")
            parts: list[bytes] = []
            for row_id, row in zip(ids.tolist(), rows, strict=True):
                parts += [redis_key(row_id), row.tobytes()]
            _redis_call(sock, resp_command(b"MSET", *parts))


def _redis_used_memory(target: Target) -> int:
    with socket.create_connection((target.host, target.port), timeout=30) as sock:
        sock.sendall(resp_command(b"INFO", b"memory"))
        data = b""
        while b"\r\n" not in data:
            data += sock.recv(1 << 16)
        size = int(data[1 : data.index(b"\r\n")])
        header = data.index(b"\r\n") + 2
        while len(data) < header + size:
            data += sock.recv(1 << 16)
    for line in data[header : header + size].decode().splitlines():
        if line.startswith("used_memory:"):
            return int(line.split(":", 1)[1])
    return 0


def _table_memory_bytes(context: ScenarioContext) -> int:
    headers = {"Authorization": f"Bearer {context.api_key}"} if context.api_key else {}
    try:
        reply = httpx.get(f"{context.target.base_url}/v1/tables/{context.table}", headers=headers, timeout=30)
        return int(reply.json().get("memory_bytes", 0)) if reply.status_code == 200 else 0
    except (httpx.HTTPError, ValueError):
        return 0


def _open_loop_batch(batch_sizes: tuple[int, ...]) -> int:
    """The batch the open-loop steps use: the issue's 4096 when measured, else the closest one."""
    return min(batch_sizes, key=lambda batch: (abs(math.log2(batch) - math.log2(REFERENCE_BATCH)), batch))


def describe(run: RunResult) -> str:
    """One progress line for a finished run."""
    parts = [
        f"{run.requests_per_s:,.0f} req/s",
        f"{run.ids_per_s:,.0f} ids/s",
        f"p50 {run.latency_ms.p50:.2f} ms",
        f"p99 {run.latency_ms.p99:.2f} ms",
        f"ok {run.ok}",
    ]
    if run.errors:
        parts.append(f"ERRORS {run.errors}")
    if run.expected:
        parts.append(f"expected {run.expected}")
    if run.failures:
        parts.append(f"FAILED {run.failures}")
    if run.server_cpu_cores is not None:
        parts.append(f"server CPU {run.server_cpu_cores:.2f} cores")
    if run.other_cpu_cores is not None:
        parts.append(f"other load {run.other_cpu_cores:.2f} cores")
    parts.append("client CPU " + "/".join(f"{cpu:.0%}" for cpu in run.client_cpu))
    parts += run.notes
    return ", ".join(parts)


def python_command(argv: list[str]) -> str:
    """How this invocation was started, for the report (shell-quoted, so it can be pasted back)."""
    return shlex.join(["python", "-m", "loadtest", *argv])
