"""Per-request server CPU of the small hot requests, through uvicorn's own HTTP protocol, without sockets.

``python -m loadtest.hotpath`` feeds whole HTTP/1.1 requests to uvicorn's httptools protocol object (the
class ``robez serve`` runs, ``service.http.protocol.RobezHttpProtocol``; the floor gets uvicorn's plain
one, as ``robez serve`` and ``python -m loadtest.floor`` run them) over an in-memory transport, one
keep-alive connection per scenario, one request at a time, and measures this process's CPU time per
request. Scenarios run in alternating rounds in one process pinned to one core, so machine load hits
them alike; the figures are medians over rounds.

It is the socket load test (``python -m loadtest``) minus the kernel's work: no accept, no epoll, no
send/recv syscalls, no client. Those cost both the floor and robez the same few microseconds per
request, so the ratios here are lower (stricter) than the socket test's, and far steadier on a busy
machine: use it to see what a change to the request path buys, then confirm with the load test.

Scenarios (robez's demo table, d = 64, Z = 32): the bare Starlette floor (``loadtest.floor``),
``/healthz``, a 1-id binary and JSON lookup, an 8-id binary gradient push without a data directory.
``--profile`` adds each robez scenario's heaviest functions (cProfile, which inflates small functions).
With tracing configured the standard way (e.g. ``OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318``),
every robez scenario also runs traced (a ``traceparent``, spans exported by the SDK's batch thread, whose
CPU this process time includes) in the same rounds: what tracing costs per request, on vs off.
The report goes to ``docs/loadtest/hotpath-<date>.md`` with the machine and the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import datetime as dt
import io
import os
import pstats
import statistics
import sys
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from .report import FLOOR_TARGETS

T = TypeVar("T")
DEFAULT_OUTPUT_DIR = Path(__file__).resolve().parents[1] / "docs" / "loadtest"
OCTET = "application/octet-stream"
# scenario -> the load test's name for the same request (its FLOOR_TARGETS key)
_TARGET_KEYS = {
    "healthz": ("healthz", 1),
    "binary1": ("binary", 1),
    "json1": ("json", 1),
    "push8": ("update", 8),
}


class MemoryTransport(asyncio.Transport):
    """A connection's transport in memory: what the protocol writes collects in ``written``; ``close``
    only marks it closed. Also the transport of tests/service/http/test_direct.py."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def write(self, data: Any) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


class _Transport(MemoryTransport):
    """Sets ``done`` once a whole response (by Content-Length) is in, kept in ``last``."""

    def __init__(self) -> None:
        super().__init__()
        self.done = asyncio.Event()
        self.last = b""

    def write(self, data: Any) -> None:
        self.written += data
        end = self.written.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.written[:end]).lower()
        start = head.find(b"content-length: ")
        stop = head.find(b"\r\n", start)
        length = int(head[start + 16 : stop if stop > 0 else None])
        if len(self.written) >= end + 4 + length:
            self.last = bytes(self.written)
            self.written.clear()
            self.done.set()


def http_request(method: str, path: str, body: bytes = b"", headers: Sequence[tuple[str, str]] = ()) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "host: 127.0.0.1:8000", *(f"{k}: {v}" for k, v in headers)]
    if method == "POST":
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def scenario_requests() -> dict[str, tuple[str, bytes]]:
    """name -> (which app: floor or robez, the request's bytes)."""
    ids8 = np.arange(8, dtype="<i8").tobytes()
    grads8 = np.full((8, 64), 1e-3, dtype="<f4").tobytes()
    binary = [("content-type", OCTET), ("accept", OCTET)]
    return {
        "floor": ("floor", http_request("GET", "/")),
        "healthz": ("robez", http_request("GET", "/healthz")),
        "binary1": (
            "robez",
            http_request("POST", "/v1/tables/demo/lookup", (12345).to_bytes(8, "little"), binary),
        ),
        "json1": (
            "robez",
            http_request(
                "POST", "/v1/tables/demo/lookup", b'{"ids":[12345]}', [("content-type", "application/json")]
            ),
        ),
        "push8": (
            "robez",
            http_request(
                "POST",
                "/v1/tables/demo/update",
                ids8 + grads8,
                [("content-type", OCTET), ("x-robez-shape", "8,64")],
            ),
        ),
    }


@dataclass(frozen=True)
class HotpathResult:
    scenario: str
    us_per_request: float  # median over rounds
    min_us: float
    max_us: float
    status_line: str
    profile: str


class _Connection:
    def __init__(self, protocol: Any, request: bytes) -> None:
        self.protocol = protocol
        self.transport = _Transport()
        self.request = request
        protocol.connection_made(self.transport)

    async def one(self) -> None:
        self.transport.done.clear()
        self.protocol.data_received(self.request)
        await self.transport.done.wait()


async def _serve_apps() -> tuple[dict[str, tuple[Any, Any, Any]], list[Any]]:
    from uvicorn.config import Config
    from uvicorn.lifespan.on import LifespanOn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from service.app import create_app
    from service.config import Settings
    from service.http.protocol import uvicorn_options

    from .floor import app as floor_app

    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    apps = {
        "floor": (floor_app, HttpToolsProtocol),
        "robez": (create_app(settings), uvicorn_options(settings)["http"]),
    }
    served: dict[str, tuple[Any, Any, Any]] = {}
    lifespans = []
    for name, (app, protocol_class) in apps.items():
        config = Config(app=app, lifespan="on", log_level="warning", access_log=False, http="httptools")
        config.load()
        lifespan = LifespanOn(config)
        await lifespan.startup()
        lifespans.append(lifespan)
        served[name] = (config, lifespan, protocol_class)
    return served, lifespans


TRACED = " traced"  # the suffix of a robez scenario run with tracing on (when OTEL_* configure it)


def _traced_scenarios(scenarios: dict[str, tuple[str, bytes]]) -> dict[str, tuple[str, bytes]]:
    """Each robez scenario again, to run with tracing on: the same request with a W3C traceparent."""
    traced = {}
    for name, (app_name, request) in scenarios.items():
        if app_name == "robez":
            head, _, body = request.partition(b"\r\n\r\n")
            parent = b"traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
            traced[name + TRACED] = (app_name, head + b"\r\n" + parent + b"\r\n\r\n" + body)
    return traced


async def measure(rounds: int, requests: int, profile: bool) -> list[HotpathResult]:
    """Per-request CPU of every scenario. With tracing configured (``OTEL_*``), every robez scenario also
    runs traced (``<name> traced``), in the same alternating rounds: the untraced ones run with the
    tracer set aside (``service.tracing.TRACER`` None, as in a server without ``OTEL_*``)."""
    from uvicorn.server import ServerState

    from service import tracing

    served, lifespans = await _serve_apps()
    tracer = tracing.TRACER
    scenarios = scenario_requests()
    if tracer is not None:
        scenarios.update(_traced_scenarios(scenarios))

    def tracing_for(name: str) -> None:
        tracing.TRACER = tracer if name.endswith(TRACED) else None

    loop = asyncio.get_running_loop()
    connections: dict[str, _Connection] = {}
    for name, (app_name, request) in scenarios.items():
        config, lifespan, protocol_class = served[app_name]
        protocol = protocol_class(
            config=config, server_state=ServerState(), app_state=lifespan.state, _loop=loop
        )
        connection = connections[name] = _Connection(protocol, request)
        tracing_for(name)
        for _ in range(min(requests, 500)):  # warm: kernels, caches, the first-call paths
            await connection.one()
        status = connection.transport.last.split(b"\r\n", 1)[0].decode()
        if not status.endswith("200 OK"):
            raise RuntimeError(f"{name}: {status}: {connection.transport.last[:300]!r}")
    times: dict[str, list[float]] = {name: [] for name in connections}
    for _ in range(rounds):
        for name, connection in connections.items():
            tracing_for(name)
            start = time.process_time()
            for _ in range(requests):
                await connection.one()
            times[name].append((time.process_time() - start) / requests * 1e6)
    profiles = dict.fromkeys(connections, "")
    if profile:
        for name, connection in connections.items():
            if name == "floor":
                continue
            tracing_for(name)
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(requests):
                await connection.one()
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(12)
            profiles[name] = _trim_profile(text.getvalue())
    tracing.TRACER = tracer  # the lifespan's shutdown flushes and stops it
    for lifespan in lifespans:
        await lifespan.shutdown()
    return [
        HotpathResult(
            name,
            statistics.median(values),
            min(values),
            max(values),
            connections[name].transport.last.split(b"\r\n", 1)[0].decode(),
            profiles[name],
        )
        for name, values in times.items()
    ]


def _trim_profile(text: str) -> str:
    """pstats' table from its header on, with the repository's path prefix dropped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
    root = str(Path(__file__).resolve().parents[1]) + "/"
    return "\n".join(line.replace(root, "") for line in lines[start:] if line.strip())


def _targets() -> dict[tuple[str, int], tuple[str, float]]:
    return {(scenario, batch): (what, threshold) for scenario, batch, what, threshold in FLOOR_TARGETS}


def render(results: list[HotpathResult], args: argparse.Namespace, load_before: str, load_after: str) -> str:
    from robez_core.hostinfo import machine_facts

    floor = next(r for r in results if r.scenario == "floor")
    targets = _targets()
    now = dt.datetime.now(dt.UTC)
    lines = [
        f"# Hot request path, per-request server CPU: {now:%Y-%m-%d %H:%M} UTC",
        "",
        f"Command: `python -m loadtest.hotpath --rounds {args.rounds} --requests {args.requests}"
        f"{' --profile' if args.profile else ''}`; one process pinned to one core; {args.rounds} alternating "
        f"rounds of {args.requests} requests per scenario, medians.",
        "What it measures: uvicorn's httptools protocol + the app, over an in-memory transport (no sockets, "
        "no syscalls, no client), so the ratios are lower than the socket load test's (`python -m "
        "loadtest`), where the same syscall cost is added to both sides; see the module docstring.",
        "",
        "| | |",
        "|---|---|",
        *(f"| {key} | {value} |" for key, value in machine_facts().items()),
        f"| load average (1, 5, 15 min) at start | {load_before} |",
        f"| load average (1, 5, 15 min) at end | {load_after} |",
        "",
        "| scenario | CPU us / request (median) | min / max over rounds | floor / scenario "
        "| goal (socket load test) | reading |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for result in results:
        ratio = floor.us_per_request / result.us_per_request
        goal, reading = "", ""
        key = None if result.scenario.endswith(TRACED) else _TARGET_KEYS.get(result.scenario)
        if key is not None and key in targets:
            what, threshold = targets[key]
            goal = f">= {threshold:.2f} ({what})"
            needed = floor.us_per_request / threshold
            reading = (
                f"within the goal here ({ratio:.2f})"
                if ratio >= threshold
                else f"{result.us_per_request - needed:.1f} us over the {needed:.1f} us the goal allows here"
            )
        lines.append(
            f"| {result.scenario} | {result.us_per_request:.1f} | {result.min_us:.1f} / "
            f"{result.max_us:.1f} | {ratio:.2f} | {goal} | {reading} |"
        )
    by_name = {result.scenario: result for result in results}
    traced = [r for r in results if r.scenario.endswith(TRACED) and r.scenario[: -len(TRACED)] in by_name]
    if traced:
        lines += [
            "",
            "## Tracing on vs off",
            "",
            "The same requests, with a W3C `traceparent`, in the same rounds with tracing configured "
            f"(`OTEL_EXPORTER_OTLP_ENDPOINT={os.environ.get('OTEL_EXPORTER_OTLP_ENDPOINT', '')}`): the "
            "request span, its stage spans and the batch exporter's thread (its CPU is this process's).",
            "",
            "| scenario | off: CPU us / request | on: CPU us / request | tracing adds (us) |",
            "|---|---:|---:|---:|",
        ]
        for result in traced:
            off = by_name[result.scenario[: -len(TRACED)]]
            lines.append(
                f"| {off.scenario} | {off.us_per_request:.1f} | {result.us_per_request:.1f} | "
                f"{result.us_per_request - off.us_per_request:+.1f} |"
            )
    profiled = [r for r in results if r.profile]
    if profiled:
        lines += ["", "## Profiles (cProfile, heaviest own time first; it inflates small functions)", ""]
        for result in profiled:
            lines += [f"### {result.scenario}", "", "```", result.profile, "```", ""]
    return "\n".join(lines) + "\n"


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """``main`` on the event loop uvicorn picks (uvloop when installed, as under ``robez serve``)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def _load_average() -> str:
    return ", ".join(f"{value:.2f}" for value in os.getloadavg())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.hotpath", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=2000, help="requests per scenario per round")
    parser.add_argument("--profile", action="store_true", help="add each robez scenario's cProfile")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUTPUT_DIR)
    parser.add_argument("--no-report", action="store_true", help="print only")
    parser.add_argument("--core", type=int, default=None, help="pin to this core (default: the last one)")
    args = parser.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {args.core if args.core is not None else cores[-1]})
    os.environ.setdefault("ROBEZ_LOG_LEVEL", "warning")
    load_before = _load_average()
    started = time.monotonic()
    results = run_event_loop(measure(args.rounds, args.requests, args.profile))
    text = render(results, args, load_before, _load_average())
    print(text)
    print(f"took {time.monotonic() - started:.0f} s", file=sys.stderr)
    if not args.no_report:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        path = args.out_dir / f"hotpath-{dt.datetime.now(dt.UTC):%Y-%m-%d}.md"
        path.write_text(text)
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
