"""Server CPU per request of one inference on each transport: ``/v1`` binary, the Open Inference Protocol
over HTTP (binary tensor data) and over gRPC (raw contents), at 1 and 4096 ids; also single-id latency
percentiles over a long run (the collector's stalls) and the first lookup and push after a fresh start.

    python -m benchmarks.service.oip_transports [--rounds 7] [--requests 400] [--tail-seconds 60]

One ``robez serve`` (one worker, one kernel thread, the demo table, ``--grpc-port``) and one caller with
a synchronous client (httpx keep-alive; a gRPC channel sending the serialized message). Scenarios run in
alternating rounds; per round, the server's CPU (utime + stime of its process tree, /proc) over
``--requests`` calls, divided by their number; figures are medians over rounds, ratios taken per round
then medianed. The report goes to ``docs/benchmarks/oip-transports-<date>.md``.
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

REPORT_DIR = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"
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
        pids = [self.process.pid]
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        if children.exists():
            pids += [int(pid) for pid in children.read_text().split()]
        for pid in pids:
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread that ended
                    total += int((task / "schedstat").read_text().split()[0])
        return total / 1e9

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _senders(server: Server, size: int) -> dict[str, Callable[[], None]]:
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
    server: Server, rounds: int, requests: int
) -> dict[tuple[str, int], list[tuple[float, float]]]:
    """(scenario, ids) -> per round (server CPU µs per request, requests per second)."""
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    senders = {size: _senders(server, size) for size in SIZES}
    for scenario in senders.values():  # warm every path
        for send in scenario.values():
            for _ in range(50):
                send()
    for _ in range(rounds):
        for size, scenario in senders.items():
            for name, send in scenario.items():
                cpu, wall = server.cpu_s(), time.perf_counter()
                for _ in range(requests):
                    send()
                cpu, wall = server.cpu_s() - cpu, time.perf_counter() - wall
                results.setdefault((name, size), []).append((cpu / requests * 1e6, requests / wall))
    return results


def tail_latency(server: Server, seconds: float) -> dict[str, float]:
    """Client-side latency of single-id /v1 binary lookups, back to back for ``seconds``."""
    send = _senders(server, 1)["v1 binary"]
    latencies = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        send()
        latencies.append(time.perf_counter() - start)
    array = np.array(latencies) * 1e3
    return {
        "requests": float(array.size),
        **{f"p{q:g}": float(np.percentile(array, q)) for q in (50, 99, 99.9)},
        "max": float(array.max()),
    }


def first_requests() -> dict[str, float]:
    """A start with an empty numba cache (a fresh clone): seconds to ready, then the server-side time of
    the first and the tenth 1-id lookup and 8-id push (Server-Timing total / the push's timing)."""
    cache = Path(tempfile.mkdtemp(prefix="robez-numba-"))
    server = Server({"NUMBA_CACHE_DIR": str(cache)})
    try:
        http = httpx.Client(base_url=server.url, timeout=120)
        out = {"ready_s": server.ready_s}
        lookups, pushes = [], []
        for _ in range(10):
            reply = http.post(
                "/v1/tables/demo/lookup",
                content=np.array([7], "<i8").tobytes(),
                headers={"Content-Type": OCTET, "Accept": OCTET},
            )
            total = next(part for part in reply.headers["Server-Timing"].split(",") if "total" in part)
            lookups.append(float(total.split("dur=")[1]))
            reply = http.post(
                "/v1/tables/demo/update", json={"ids": list(range(8)), "grads": [[1e-3] * 64] * 8}
            )
            pushes.append(float(reply.json()["timing"]["total_ms"]))
        out.update(
            {
                "lookup_first_ms": lookups[0],
                "lookup_tenth_ms": lookups[9],
                "push_first_ms": pushes[0],
                "push_tenth_ms": pushes[9],
            }
        )
        return out
    finally:
        server.stop()
        shutil.rmtree(cache, ignore_errors=True)


def _machine() -> str:
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        platform.processor(),
    )
    load = os.getloadavg()
    return (
        f"{model}, {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, "
        f"server: 1 worker, 1 kernel thread; Python {platform.python_version()}; "
        f"{dt.datetime.now():%Y-%m-%d %H:%M}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--tail-seconds", type=float, default=60.0)
    parser.add_argument("--skip-first", action="store_true", help="no fresh-cache start")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--tail-server-dir",
        type=Path,
        default=None,
        help="also measure the tail with the server's code from this checkout (e.g. before a change)",
    )
    args = parser.parse_args()
    lines = [
        f"# OIP transports: server CPU per request ({dt.date.today()})",
        "",
        f"Machine: {_machine()}.",
        "",
    ]
    lines += [
        f"Command: `python -m benchmarks.service.oip_transports --rounds {args.rounds} "
        f"--requests {args.requests} --tail-seconds {args.tail_seconds:g}`",
        "",
    ]
    server = Server()
    try:
        results = cpu_per_request(server, args.rounds, args.requests)
        lines += [
            "| ids | scenario | server CPU µs/request (median) | x /v1 binary (median of rounds) "
            "| requests/s |",
            "|---:|---|---:|---:|---:|",
        ]
        for size in SIZES:
            base = [cpu for cpu, _ in results[("v1 binary", size)]]
            for name in ("v1 binary", "OIP HTTP", "OIP gRPC"):
                runs = results[(name, size)]
                ratio = statistics.median(cpu / b for (cpu, _), b in zip(runs, base, strict=True))
                lines.append(
                    f"| {size} | {name} | {statistics.median(c for c, _ in runs):.0f} | {ratio:.2f} | "
                    f"{statistics.median(r for _, r in runs):.0f} |"
                )
        if args.tail_seconds > 0:
            tail = tail_latency(server, args.tail_seconds)
            lines += [
                "",
                f"Single-id /v1 binary lookups back to back for {args.tail_seconds:g} s (client ms): "
                + ", ".join(f"{key} {value:.3f}" for key, value in tail.items()),
            ]
    finally:
        server.stop()
    if args.tail_seconds > 0 and args.tail_server_dir is not None:
        other = Server(cwd=args.tail_server_dir)
        try:
            tail = tail_latency(other, args.tail_seconds)
        finally:
            other.stop()
        lines += [
            f"The same with the server's code from `{args.tail_server_dir}` (client ms): "
            + ", ".join(f"{key} {value:.3f}" for key, value in tail.items())
        ]
    if not args.skip_first:
        first = first_requests()
        lines += [
            "",
            "Fresh start (empty numba cache): " + ", ".join(f"{k} {v:.3f}" for k, v in first.items()),
        ]
    text = "\n".join(lines) + "\n"
    print(text)
    out = args.out or REPORT_DIR / f"oip-transports-{dt.date.today()}.md"
    out.write_text(text)


if __name__ == "__main__":
    main()
