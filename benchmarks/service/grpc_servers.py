"""The floor of a gRPC server in Python: server CPU per call of an echo handler (no robez code), for
``grpc.aio`` and the synchronous server (thread pool), each with a stream-unary handler (how robez reads
a message itself, issue 40) and a unary-unary one.

    python -m benchmarks.service.grpc_servers [--rounds 5] [--calls 1000]

Each variant is a server process of its own on a free loopback port; one synchronous caller sends a
40-byte message per call; variants alternate inside every round; CPU of the server's every thread
(/proc schedstat) per call, median over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc

VARIANTS = ("aio stream-unary", "aio unary-unary", "sync stream-unary", "sync unary-unary")
_OPTIONS = [("grpc.so_reuseport", 1), ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 65536)]
_MESSAGE = b"x" * 40


def _handler(kind: str, shape: str) -> grpc.RpcMethodHandler:
    if kind == "aio":

        async def read_one(_: object, context: grpc.aio.ServicerContext) -> bytes:
            body: bytes = await context.read()
            return body

        async def echo(body: bytes, _: grpc.aio.ServicerContext) -> bytes:
            return body

        if shape == "stream-unary":
            return grpc.stream_unary_rpc_method_handler(read_one)
        return grpc.unary_unary_rpc_method_handler(echo)

    def next_one(messages: object, _: grpc.ServicerContext) -> bytes:
        return next(messages)  # type: ignore[call-overload]

    def echo_sync(body: bytes, _: grpc.ServicerContext) -> bytes:
        return body

    if shape == "stream-unary":
        return grpc.stream_unary_rpc_method_handler(next_one)
    return grpc.unary_unary_rpc_method_handler(echo_sync)


def serve(variant: str, port: int) -> None:
    kind, shape = variant.split(" ")
    handlers = (grpc.method_handlers_generic_handler("bench", {"Echo": _handler(kind, shape)}),)
    if kind == "aio":

        async def run() -> None:
            server = grpc.aio.server(options=_OPTIONS)
            server.add_generic_rpc_handlers(handlers)
            server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            await server.wait_for_termination()

        asyncio.run(run())
        return
    sync = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=_OPTIONS)
    sync.add_generic_rpc_handlers(handlers)
    sync.add_insecure_port(f"127.0.0.1:{port}")
    sync.start()
    sync.wait_for_termination()


def _cpu_s(pid: int) -> float:
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except FileNotFoundError:  # a thread that ended
            continue
    return total / 1e9


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return
    servers = {}
    for variant in VARIANTS:
        port = _free_port()
        command = [sys.executable, "-m", "benchmarks.service.grpc_servers", "--serve", variant, str(port)]
        servers[variant] = (subprocess.Popen(command), port)
    try:
        calls = {}
        for variant, (_, port) in servers.items():
            call = grpc.insecure_channel(f"127.0.0.1:{port}").unary_unary("/bench/Echo")
            deadline = time.monotonic() + 60
            while True:
                try:
                    call(_MESSAGE, timeout=5)
                    break
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            for _ in range(200):
                call(_MESSAGE, timeout=10)
            calls[variant] = call
        results: dict[str, list[tuple[float, float]]] = {variant: [] for variant in VARIANTS}
        for _ in range(args.rounds):
            for variant, call in calls.items():
                pid = servers[variant][0].pid
                cpu, wall = _cpu_s(pid), time.perf_counter()
                for _ in range(args.calls):
                    call(_MESSAGE, timeout=10)
                cpu, wall = _cpu_s(pid) - cpu, time.perf_counter() - wall
                results[variant].append((cpu / args.calls * 1e6, args.calls / wall))
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=30)
    load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    print(f"| server | CPU µs/call (median of {args.rounds}) | calls/s |\n|---|---:|---:|")
    for variant, runs in results.items():
        cpu = statistics.median(c for c, _ in runs)
        rate = statistics.median(r for _, r in runs)
        print(f"| {variant} | {cpu:.0f} | {rate:.0f} |")
    print(f"\nload average after: {load}; grpc {grpc.__version__}")


if __name__ == "__main__":
    main()
