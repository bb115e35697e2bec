"""The floor of a gRPC server in Python: server CPU per call of an echo handler (no robez code), for
``grpc.aio`` (on asyncio's loop and on uvloop, robez's) and the synchronous server (thread pool), each
with a stream-unary handler (how robez reads a message itself, issue 40) and a unary-unary one; beside
them, ``robez serve --grpc-port`` answering a 1-id ``ModelInfer`` (raw contents, as Triton's client sends).

    python -m benchmarks.service.grpc_servers [--rounds 5] [--calls 1000] [--floor]
        [--robez] [--before-dir <checkout>] [--robez-env KEY=VALUE ...]

``--floor`` instead measures configurations of the uvloop stream-unary echo (robez's shape, robez's
server options): each a channel option or a ``GRPC_*`` environment setting of its own (``FLOOR``).

Each variant is a server process of its own on a free loopback port; one synchronous caller sends a
40-byte message per call (the 1-id request for robez); variants alternate inside every round; CPU of the
server's every thread (/proc schedstat) per call, median over rounds, and its split: the thread that
runs the handlers (the main thread: the event loop, or for the synchronous server the pool's threads
are counted apart) against gRPC's own threads (its poller, event engine).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc

VARIANTS = (
    "aio stream-unary",
    "aio unary-unary",
    "uvloop stream-unary",
    "sync stream-unary",
    "sync unary-unary",
    "robez ModelInfer",
)
_OPTIONS = [("grpc.so_reuseport", 1), ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 65536)]
# robez's own server options (service/grpc/server.py start_grpc), the base of every ``--floor`` variant.
_ROBEZ_OPTIONS = [
    *_OPTIONS,
    ("grpc.max_receive_message_length", 25 << 20),
    ("grpc.max_send_message_length", -1),
    ("grpc.max_concurrent_streams", 100),
]
# ``--floor``: name -> (kind, shape, options over _ROBEZ_OPTIONS, environment, protobuf messages)
FLOOR: dict[str, tuple[str, str, list[tuple[str, object]], dict[str, str], bool]] = {
    "base (robez's options)": ("uvloop", "stream-unary", [], {}, False),
    "unary-unary": ("uvloop", "unary-unary", [], {}, False),
    "unary-unary, protobuf messages": ("uvloop", "unary-unary", [], {}, True),
    "asyncio loop": ("aio", "stream-unary", [], {}, False),
    "grpc.enable_channelz=0": ("uvloop", "stream-unary", [("grpc.enable_channelz", 0)], {}, False),
    "grpc.minimal_stack=1": ("uvloop", "stream-unary", [("grpc.minimal_stack", 1)], {}, False),
    "optimization_target=latency": (
        "uvloop",
        "stream-unary",
        [("grpc.optimization_target", "latency")],
        {},
        False,
    ),
    "optimization_target=throughput": (
        "uvloop",
        "stream-unary",
        [("grpc.optimization_target", "throughput")],
        {},
        False,
    ),
    "no max_concurrent_streams, lookahead default": (
        "uvloop",
        "stream-unary",
        [("grpc.max_concurrent_streams", -1), ("grpc.http2.lookahead_bytes", 0)],
        {},
        False,
    ),
    "keepalive 10 s, pings without data 0": (
        "uvloop",
        "stream-unary",
        [("grpc.keepalive_time_ms", 10000), ("grpc.http2.max_pings_without_data", 0)],
        {},
        False,
    ),
    "write_buffer_size=1 MiB": (
        "uvloop",
        "stream-unary",
        [("grpc.http2.write_buffer_size", 1 << 20)],
        {},
        False,
    ),
    "compression off (identity)": (
        "uvloop",
        "stream-unary",
        [("grpc.default_compression_algorithm", 0)],
        {},
        False,
    ),
    "GRPC_POLL_STRATEGY=poll": ("uvloop", "stream-unary", [], {"GRPC_POLL_STRATEGY": "poll"}, False),
    "GRPC_EXPERIMENTS=event_engine_callback_cq": (
        "uvloop",
        "stream-unary",
        [],
        {"GRPC_EXPERIMENTS": "event_engine_callback_cq"},
        False,
    ),
    "GRPC_EXPERIMENTS=pollset_alternative": (
        "uvloop",
        "stream-unary",
        [],
        {"GRPC_EXPERIMENTS": "pollset_alternative"},
        False,
    ),
    "GRPC_EXPERIMENTS=-event_engine_listener,-event_engine_for_all_other_endpoints": (
        "uvloop",
        "stream-unary",
        [],
        {"GRPC_EXPERIMENTS": "-event_engine_listener,-event_engine_for_all_other_endpoints"},
        False,
    ),
    "GRPC_EXPERIMENTS=tcp_rcv_lowat,tcp_frame_size_tuning": (
        "uvloop",
        "stream-unary",
        [],
        {"GRPC_EXPERIMENTS": "tcp_rcv_lowat,tcp_frame_size_tuning"},
        False,
    ),
    "GRPC_EXPERIMENTS=ph2_server": ("uvloop", "stream-unary", [], {"GRPC_EXPERIMENTS": "ph2_server"}, False),
    "GRPC_ENABLE_FORK_SUPPORT=0": ("uvloop", "stream-unary", [], {"GRPC_ENABLE_FORK_SUPPORT": "0"}, False),
    # grpcio's synchronous server (thread pool) with robez's options (benchmarks/service/grpc_h2.py)
    "sync server (robez's options)": ("sync", "stream-unary", [], {}, False),
    "sync server, iomgr": (
        "sync",
        "stream-unary",
        [],
        {"GRPC_EXPERIMENTS": "-event_engine_listener,-event_engine_for_all_other_endpoints"},
        False,
    ),
}
_MESSAGE = b"x" * 40


def _handler(kind: str, shape: str, protobuf: bool = False) -> grpc.RpcMethodHandler:
    if protobuf:
        from tritonclient.grpc import service_pb2

        async def infer(request: object, _: grpc.aio.ServicerContext) -> object:
            return service_pb2.ModelInferResponse(model_name="demo")

        return grpc.unary_unary_rpc_method_handler(
            infer,
            request_deserializer=service_pb2.ModelInferRequest.FromString,
            response_serializer=service_pb2.ModelInferResponse.SerializeToString,
        )
    if kind in ("aio", "uvloop"):

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
    options = _OPTIONS
    protobuf = False
    if variant in FLOOR:
        kind, shape, extra, _, protobuf = FLOOR[variant]
        replaced = {key for key, _ in extra}
        options = [*(o for o in _ROBEZ_OPTIONS if o[0] not in replaced), *extra]  # type: ignore[list-item]
    else:
        kind, shape = variant.split(" ")
    handlers = (grpc.method_handlers_generic_handler("bench", {"Echo": _handler(kind, shape, protobuf)}),)
    if kind in ("aio", "uvloop"):

        async def run() -> None:
            server = grpc.aio.server(options=options)
            server.add_generic_rpc_handlers(handlers)
            add_port(server, port)
            await server.start()
            await server.wait_for_termination()

        if kind == "uvloop":
            import uvloop

            uvloop.run(run())
        else:
            asyncio.run(run())
        return
    sync = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=options)
    sync.add_generic_rpc_handlers(handlers)
    add_port(sync, port)
    sync.start()
    sync.wait_for_termination()


# A folder with ``server.pem`` (certificate chain) and ``server.key``: the server listens with TLS
# (``grpc_h2 --floor --tls``), else in plaintext.
TLS_DIR_VARIABLE = "BENCH_TLS_DIR"


def add_port(server: grpc.Server | grpc.aio.Server, port: int) -> None:
    """Listen on 127.0.0.1:``port``, with TLS when ``TLS_DIR_VARIABLE`` names a folder."""
    address, folder = f"127.0.0.1:{port}", os.environ.get(TLS_DIR_VARIABLE)
    if not folder:
        server.add_insecure_port(address)
        return
    key, chain = (Path(folder) / "server.key").read_bytes(), (Path(folder) / "server.pem").read_bytes()
    server.add_secure_port(address, grpc.ssl_server_credentials([(key, chain)]))


def cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds of process ``pid``: (its main thread, its other threads)."""
    main = others = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            ns = int((task / "schedstat").read_text().split()[0])
        except FileNotFoundError:  # a thread that ended
            continue
        if task.name == str(pid):
            main += ns
        else:
            others += ns
    return main / 1e9, others / 1e9


_SHM_DIRS: list[str] = []  # the robez servers' shared-memory folders, removed at the end


def _robez(
    port: int, cwd: Path | None = None, extra: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """``robez serve`` (1 worker, 1 kernel thread, the demo table) with its gRPC port on ``port``: this
    checkout's, or ``cwd``'s (``python -m service`` imports the code of its working directory first)."""
    shm = tempfile.mkdtemp(prefix="robez-grpc-floor-")
    _SHM_DIRS.append(shm)
    env = {**os.environ, "ROBEZ_SHM_DIR": shm, "ROBEZ_THREADS_PER_WORKER": "1", **(extra or {})}
    command = [sys.executable, "-m", "service", "serve", "--host", "127.0.0.1", "--port", str(free_port())]
    return subprocess.Popen(
        [*command, "--grpc-port", str(port), "--data-dir", f"{shm}/data"],
        env=env,
        stdout=subprocess.DEVNULL,
        cwd=cwd,
    )


def infer_message() -> bytes:
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name="demo")
    request.inputs.add(name="ids", datatype="INT64", shape=[1])
    request.raw_input_contents.append((7).to_bytes(8, "little"))
    return request.SerializeToString()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--floor", action="store_true", help="configurations of the echo (FLOOR)")
    parser.add_argument(
        "--robez",
        action="store_true",
        help="only the uvloop echo and robez's ModelInfer (with --before-dir and --robez-env variants)",
    )
    parser.add_argument("--before-dir", type=Path, help="also robez's ModelInfer from this checkout")
    parser.add_argument(
        "--robez-env", action="append", default=[], help="also robez's ModelInfer with KEY=VALUE set"
    )
    parser.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return
    variants = tuple(FLOOR) if args.floor else VARIANTS
    if args.robez:
        variants = ("uvloop stream-unary", "robez ModelInfer")
    if args.before_dir is not None:
        variants += ("robez ModelInfer (before)",)
    variants += tuple(f"robez ModelInfer ({setting})" for setting in args.robez_env)
    servers = {}
    for variant in variants:
        port = free_port()
        command = [sys.executable, "-m", "benchmarks.service.grpc_servers", "--serve", variant, str(port)]
        env = {**os.environ, **FLOOR[variant][3]} if variant in FLOOR else None
        if variant == "robez ModelInfer (before)":
            server = _robez(port, cwd=args.before_dir)
        elif variant.startswith("robez ModelInfer ("):
            key, _, value = variant[len("robez ModelInfer (") : -1].partition("=")
            server = _robez(port, extra={key: value})
        elif variant.startswith("robez"):
            server = _robez(port)
        else:
            server = subprocess.Popen(command, env=env)
        servers[variant] = (server, port)
    messages = {
        variant: infer_message()
        if variant.startswith("robez") or (variant in FLOOR and FLOOR[variant][4])
        else _MESSAGE
        for variant in variants
    }
    failed: dict[str, str] = {}
    try:
        calls = {}
        for variant, (_, port) in servers.items():
            channel = grpc.insecure_channel(f"127.0.0.1:{port}")
            method = (
                "/inference.GRPCInferenceService/ModelInfer" if variant.startswith("robez") else "/bench/Echo"
            )
            call = channel.unary_unary(method)
            message = messages[variant]
            deadline = time.monotonic() + (30 if args.floor else 120)
            while True:
                try:
                    call(message, timeout=5)
                    break
                except grpc.RpcError as exc:
                    if time.monotonic() > deadline or servers[variant][0].poll() is not None:
                        if not args.floor:
                            raise
                        failed[variant] = str(exc.code())  # a setting this build does not serve with
                        break
                    time.sleep(0.1)
            if variant in failed:
                continue
            for _ in range(200):
                call(message, timeout=10)
            calls[variant] = call
        results: dict[str, list[tuple[float, float, float]]] = {variant: [] for variant in variants}
        for _ in range(args.rounds):
            for variant, call in calls.items():
                pid, message = servers[variant][0].pid, messages[variant]
                (main_cpu, other_cpu), wall = cpu_s(pid), time.perf_counter()
                for _ in range(args.calls):
                    call(message, timeout=10)
                main_after, other_after = cpu_s(pid)
                wall = time.perf_counter() - wall
                per_call = 1e6 / args.calls
                results[variant].append(
                    (
                        (main_after - main_cpu) * per_call,
                        (other_after - other_cpu) * per_call,
                        args.calls / wall,
                    )
                )
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=30)
        for shm in _SHM_DIRS:
            shutil.rmtree(shm, ignore_errors=True)
    load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    print(
        f"| server | CPU µs/call (median of {args.rounds}) | main thread | other threads | calls/s |\n"
        "|---|---:|---:|---:|---:|"
    )
    for variant, runs in results.items():
        if variant in failed:
            print(f"| {variant} | did not answer ({failed[variant]}) | | | |")
            continue
        main_cpu = statistics.median(m for m, _, _ in runs)
        other_cpu = statistics.median(o for _, o, _ in runs)
        total = statistics.median(m + o for m, o, _ in runs)
        rate = statistics.median(r for _, _, r in runs)
        print(f"| {variant} | {total:.0f} | {main_cpu:.0f} | {other_cpu:.0f} | {rate:.0f} |")
    print(f"\nload average after: {load}; grpc {grpc.__version__}")


if __name__ == "__main__":
    main()
