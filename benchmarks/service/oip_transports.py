"""Server CPU per request of one inference on each transport: ``/v1`` binary, the Open Inference Protocol
over HTTP (binary tensor data) and over gRPC (raw contents), at 1 and 4096 ids; also single-id latency
percentiles over a long run with and without ``gc.freeze`` at start-up, and the first lookup, infer and
push after fresh starts.

    python -m benchmarks.service.oip_transports [--rounds 7] [--requests 400] [--tail-seconds 60]
        [--fresh-starts 3] [--before-dir <checkout of the code before>]

One ``robez serve`` (one worker, one kernel thread, the demo table, ``--grpc-port``) per variant and one
caller with a synchronous client (httpx keep-alive; a gRPC channel sending the serialized message).
Scenarios and servers (this checkout, ``--before-dir``'s) run in alternating rounds; per round, the
server's CPU (every thread of its process tree, /proc schedstat) over ``--requests`` calls, divided by
their number; figures are medians over rounds, ratios taken per round then medianed. The "no freeze"
variant is this checkout's HEAD with ``gc.freeze`` taken out (``without_freeze``). The report goes to
``docs/benchmarks/oip-transports-<date>.md`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
import numpy as np
import orjson
from tritonclient.grpc import service_pb2 as pb

from loadtest.server import tree_pids
from robez_core import hostinfo

ROOT = Path(__file__).resolve().parents[2]
REPORT_DIR = ROOT / "docs" / "benchmarks"
OCTET = "application/octet-stream"
INFER = "/inference.GRPCInferenceService/ModelInfer"
SIZES = (1, 4096)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Server:
    """``robez serve`` in its own process group on free ports, with a fresh shm dir."""

    def __init__(self, env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="robez-oip-bench-"))
        self.port, self.grpc_port = _free_port(), _free_port()
        environment = {k: v for k, v in os.environ.items() if not k.startswith("ROBEZ_")}
        environment.update({"ROBEZ_SHM_DIR": str(self.tmp / "shm"), "ROBEZ_THREADS_PER_WORKER": "1"})
        environment.update(env or {})
        self.log = open(self.tmp / "server.log", "wb")  # noqa: SIM115 (closed in stop)
        self.started = time.perf_counter()
        self.process = subprocess.Popen(
            [
                *(sys.executable, "-m", "service", "serve", "--host", "127.0.0.1", "--port", str(self.port)),
                *("--grpc-port", str(self.grpc_port), "--data-dir", str(self.tmp / "data")),
            ],
            env=environment,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=cwd,  # ``python -m service`` imports the code of its working directory first
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        else:
            raise RuntimeError("server not ready")
        self.ready_s = time.perf_counter() - self.started

    def cpu_s(self) -> float:
        """CPU time of every thread of the server's process tree (/proc/<pid>/task/*/schedstat: ns), s."""
        total = 0
        for pid in tree_pids(self.process.pid):
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread that ended
                    total += int((task / "schedstat").read_text().split()[0])
        return total / 1e9

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def oip_senders(server: Server, size: int) -> dict[str, Callable[[], None]]:
    ids = np.random.default_rng(size).integers(0, 2**40, size, dtype=np.int64)
    http = httpx.Client(base_url=server.url, timeout=30)
    v1_body = ids.astype("<i8").tobytes()
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "ids",
                    "shape": [size],
                    "datatype": "INT64",
                    "parameters": {"binary_data_size": size * 8},
                }
            ],
            "outputs": [{"name": "embeddings", "parameters": {"binary_data": True}}],
        }
    )
    oip_headers = {"Content-Type": OCTET, "Inference-Header-Content-Length": str(len(header))}
    request = pb.ModelInferRequest(model_name="demo")
    request.inputs.add(name="ids", datatype="INT64", shape=[size])
    request.raw_input_contents.append(v1_body)
    message = request.SerializeToString()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    call = channel.unary_unary(INFER)

    def v1() -> None:
        reply = http.post(
            "/v1/tables/demo/lookup", content=v1_body, headers={"Content-Type": OCTET, "Accept": OCTET}
        )
        assert reply.status_code == 200 and len(reply.content) == size * 64 * 4

    def oip_http() -> None:
        reply = http.post("/v2/models/demo/infer", content=header + v1_body, headers=oip_headers)
        assert reply.status_code == 200 and len(reply.content) > size * 64 * 4

    def oip_grpc() -> None:
        answer = call(message, timeout=30)
        assert len(answer) > size * 64 * 4

    return {"v1 binary": v1, "OIP HTTP": oip_http, "OIP gRPC": oip_grpc}


def cpu_per_request(
    servers: dict[str, Server], rounds: int, requests: int
) -> dict[tuple[str, str, int], list[tuple[float, float]]]:
    """(server label, scenario, ids) -> per round (server CPU µs per request, requests per second); the
    servers and scenarios alternate inside every round."""
    results: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
    senders = {
        (label, size): oip_senders(server, size) for label, server in servers.items() for size in SIZES
    }
    for scenario in senders.values():  # warm every path
        for send in scenario.values():
            for _ in range(50):
                send()
    for _ in range(rounds):
        for (label, size), scenario in senders.items():
            server = servers[label]
            for name, send in scenario.items():
                cpu, wall = server.cpu_s(), time.perf_counter()
                for _ in range(requests):
                    send()
                cpu, wall = server.cpu_s() - cpu, time.perf_counter() - wall
                results.setdefault((label, name, size), []).append((cpu / requests * 1e6, requests / wall))
    return results


def tail_latency(servers: dict[str, Server], seconds: float, slices: int = 3) -> dict[str, dict[str, float]]:
    """Client-side latency of single-id /v1 binary lookups, back to back: ``seconds`` per server, in
    ``slices`` alternating slices; per server its percentiles, max and the count over 20 ms."""
    sends = {label: oip_senders(server, 1)["v1 binary"] for label, server in servers.items()}
    latencies: dict[str, list[float]] = {label: [] for label in servers}
    for _ in range(slices):
        for label, send in sends.items():
            end = time.perf_counter() + seconds / slices
            while time.perf_counter() < end:
                start = time.perf_counter()
                send()
                latencies[label].append(time.perf_counter() - start)
    out = {}
    for label, values in latencies.items():
        array = np.array(values) * 1e3
        out[label] = {
            "requests": float(array.size),
            **{f"p{q:g}": float(np.percentile(array, q)) for q in (50, 99, 99.9)},
            "max": float(array.max()),
            "over_20ms": float(np.count_nonzero(array > 20)),
        }
    return out


_IDLE_ROUNDS = 5
_IDLE_S = 2.0


def _server_total_ms(reply: httpx.Response) -> float:
    part = next(part for part in reply.headers["Server-Timing"].split(",") if "total" in part)
    return float(part.split("dur=")[1])


def first_requests(cwd: Path | None = None) -> dict[str, float]:
    """A start with an empty numba cache (a fresh clone): seconds to ready, then the server-side time
    (Server-Timing total; a push's timing) of ten rounds of a 1-id ``/v1`` binary lookup, a 1-id OIP
    infer (binary) and an 8-id push: the first, the tenth and the median of the second to tenth; then the
    median of ``_IDLE_ROUNDS`` more, each after ``_IDLE_S`` s idle (the first request too comes after an
    idle wait: for ``/readyz``), to tell what start-up costs from what any request after a pause costs."""
    cache = Path(tempfile.mkdtemp(prefix="robez-numba-"))
    server = Server({"NUMBA_CACHE_DIR": str(cache)}, cwd=cwd)
    try:
        http = httpx.Client(base_url=server.url, timeout=120)
        ids = np.array([7], "<i8").tobytes()
        header = orjson.dumps(
            {
                "inputs": [
                    {"name": "ids", "shape": [1], "datatype": "INT64", "parameters": {"binary_data_size": 8}}
                ]
            }
        )
        infer_headers = {"Content-Type": OCTET, "Inference-Header-Content-Length": str(len(header))}
        times: dict[str, list[float]] = {"lookup": [], "infer": [], "push": []}
        idle: dict[str, list[float]] = {"lookup": [], "infer": [], "push": []}
        for round_ in range(10 + _IDLE_ROUNDS):
            if round_ >= 10:  # later: one request of each after an idle wait, as the first came after one
                time.sleep(_IDLE_S)
            reply = http.post(
                "/v1/tables/demo/lookup", content=ids, headers={"Content-Type": OCTET, "Accept": OCTET}
            )
            into = times if round_ < 10 else idle
            into["lookup"].append(_server_total_ms(reply))
            reply = http.post("/v2/models/demo/infer", content=header + ids, headers=infer_headers)
            into["infer"].append(_server_total_ms(reply))
            reply = http.post(
                "/v1/tables/demo/update", json={"ids": list(range(8)), "grads": [[1e-3] * 64] * 8}
            )
            into["push"].append(float(reply.json()["timing"]["total_ms"]))
        out = {"ready_s": server.ready_s}
        for kind, values in times.items():
            out[f"{kind}_first_ms"] = values[0]
            out[f"{kind}_tenth_ms"] = values[9]
            out[f"{kind}_median_ms"] = statistics.median(values[1:])
            out[f"{kind}_after_idle_ms"] = statistics.median(idle[kind])
        return out
    finally:
        server.stop()
        shutil.rmtree(cache, ignore_errors=True)


def without_freeze(root: Path) -> Path:
    """A copy of ``root``'s committed tree (HEAD) whose workers skip ``gc.freeze`` at start-up: the "before"
    of the collector's tuning, all else equal."""
    copy = Path(tempfile.mkdtemp(prefix="robez-nofreeze-"))
    archive = subprocess.run(["git", "-C", str(root), "archive", "HEAD"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(copy)], input=archive.stdout, check=True)
    warmup = copy / "service" / "warmup.py"
    text = warmup.read_text()
    frozen = "    gc.collect()\n    gc.freeze()\n"
    if frozen not in text:
        raise RuntimeError("service/warmup.py no longer freezes as this benchmark expects")
    warmup.write_text(text.replace(frozen, "    return\n"))
    return copy


_COLLECTION_PROBE = """
import gc, time
import service.app, service.grpc.server  # the modules a serving worker imports
def full_ms():
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter(); gc.collect(); best = min(best, time.perf_counter() - start)
    return best * 1e3
objects = len(gc.get_objects())
before = full_ms()
gc.freeze()
print(objects, before, full_ms())
"""


def full_collection() -> tuple[int, float, float]:
    """(objects tracked after a worker's imports, a full collection's ms, the same after gc.freeze)."""
    out = subprocess.run(
        [sys.executable, "-c", _COLLECTION_PROBE], check=True, capture_output=True, text=True, cwd=ROOT
    ).stdout.split()
    return int(out[0]), float(out[1]), float(out[2])


def _machine() -> str:
    return (
        f"{hostinfo.cpu_model()}, {os.cpu_count()} CPUs; "
        "server: 1 worker, 1 kernel thread, one synchronous caller; "
        f"Python {platform.python_version()}; {dt.datetime.now():%Y-%m-%d %H:%M}"
    )


def _load() -> str:
    return " ".join(f"{value:.2f}" for value in hostinfo.load_average())


def _figures(values: dict[str, float]) -> str:
    return ", ".join(f"{key} {value:.3f}" for key, value in values.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--tail-seconds", type=float, default=60.0, help="per variant (gc.freeze or not)")
    parser.add_argument("--fresh-starts", type=int, default=3, help="starts with an empty numba cache")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--before-dir",
        type=Path,
        default=None,
        help="a checkout of the code before (e.g. main): its server runs beside, rounds alternating",
    )
    parser.add_argument(
        "--grpc-engines",
        default=None,
        help="comma-separated ROBEZ_GRPC_ENGINE values (e.g. grpcio,frames): one server of this checkout "
        "per engine, rounds alternating, instead of after/before",
    )
    args = parser.parse_args()
    before = args.before_dir
    command = (
        f"python -m benchmarks.service.oip_transports --rounds {args.rounds} --requests {args.requests} "
        f"--tail-seconds {args.tail_seconds:g} --fresh-starts {args.fresh_starts}"
        + (f" --before-dir <checkout of {_head(before)}>" if before is not None else "")
        + (f" --grpc-engines {args.grpc_engines}" if args.grpc_engines else "")
    )
    lines = [f"# OIP transports: server CPU per request ({dt.date.today()})", ""]
    lines += [f"Machine: {_machine()}.", "", f"Command: `{command}` (under the bench lock)", ""]
    lines += [f"Load average at the start: {_load()}", ""]
    if args.grpc_engines:
        servers = {engine: Server({"ROBEZ_GRPC_ENGINE": engine}) for engine in args.grpc_engines.split(",")}
    else:
        servers = {"after": Server()}
    if before is not None:
        servers["before"] = Server(cwd=before)
    try:
        results = cpu_per_request(servers, args.rounds, args.requests)
    finally:
        for server in servers.values():
            server.stop()
    labels = list(servers)
    lines += [
        "| ids | scenario | "
        + " | ".join(f"{label}: CPU µs/request | {label}: x /v1 binary" for label in labels)
        + " | "
        + " | ".join(f"{label}: requests/s" for label in labels)
        + " |",
        "|---:|---|" + "---:|---:|" * len(labels) + "---:|" * len(labels),
    ]
    for size in SIZES:
        for name in ("v1 binary", "OIP HTTP", "OIP gRPC"):
            cells = []
            for label in labels:
                runs = results[(label, name, size)]
                base = [cpu for cpu, _ in results[(label, "v1 binary", size)]]
                ratio = statistics.median(cpu / b for (cpu, _), b in zip(runs, base, strict=True))
                cells.append(f"{statistics.median(c for c, _ in runs):.0f} | {ratio:.2f}")
            rates = [
                f"{statistics.median(r for _, r in results[(label, name, size)]):.0f}" for label in labels
            ]
            lines.append(f"| {size} | {name} | " + " | ".join(cells) + " | " + " | ".join(rates) + " |")
    lines += ["", "Medians over rounds; the ratio is taken per round (same server), then medianed.", ""]
    if args.tail_seconds > 0:
        objects, full_ms, frozen_ms = full_collection()
        lines += [
            f"Full collection in a process with a worker's imports ({objects} objects tracked): "
            f"{full_ms:.1f} ms; after gc.freeze: {frozen_ms:.1f} ms (best of 3 each).",
            "",
        ]
        nofreeze = without_freeze(ROOT)
        tail_servers = {"gc.freeze (after)": Server(), "no freeze (before)": Server(cwd=nofreeze)}
        try:
            tails = tail_latency(tail_servers, args.tail_seconds)
        finally:
            for server in tail_servers.values():
                server.stop()
            shutil.rmtree(nofreeze, ignore_errors=True)
        lines += [
            f"Single-id /v1 binary lookups back to back, {args.tail_seconds:g} s per variant in 3 "
            "alternating slices (client ms):",
            "",
        ]
        lines += [f"- {label}: {_figures(values)}" for label, values in tails.items()]
        lines.append("")
    if args.fresh_starts > 0:
        lines += ["Fresh starts (empty numba cache each), server-side ms:", ""]
        for index in range(args.fresh_starts):
            for label, cwd in (("after", None), ("before", before)):
                if label == "before" and before is None:
                    continue
                lines.append(f"- {label} #{index + 1}: {_figures(first_requests(cwd))}")
        lines.append("")
    lines += [f"Load average at the end: {_load()}"]
    text = "\n".join(lines) + "\n"
    print(text)
    out = args.out or REPORT_DIR / f"oip-transports-{dt.date.today()}.md"
    out.write_text(text)


def _head(checkout: Path) -> str:
    result = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return result.stdout.strip() or str(checkout)


if __name__ == "__main__":
    main()
