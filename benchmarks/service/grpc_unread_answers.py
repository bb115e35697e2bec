"""What a gRPC client that takes none of its answers costs a worker: one HTTP/2 connection, its stream
windows at 0 (no answer's data may come; HEADERS still do), ``--calls`` ModelInfer calls of ``--ids`` ids
each; the server's process tree (PSS and RSS, smaps_rollup) sampled every 0.25 s for ``--seconds``, and
how many calls the server ended without an answer. Then a normal grpcio call, to see the worker serve.

    flock /tmp/robez-bench.lock python -m benchmarks.service.grpc_unread_answers \\
        [--calls 40] [--ids 262144] [--seconds 20] [--engines frames,grpcio] [--source DIR ...] [--out FILE]

Each ``--source`` is a checkout whose ``robez serve`` is run (default: this one), so a change and its
base are measured in one run; one worker, one kernel thread, the demo table (d = 64: 262,144 ids answer
64 MiB), the defaults otherwise. The report goes to ``docs/benchmarks/grpc-unread-answers-<date>.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.events
import h2.settings
import numpy as np
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from benchmarks.common import append_report, checkout_revision
from benchmarks.service.grpc_frames_soak import TreeMemoryPeak
from benchmarks.service.oip_transports import INFER, REPORT_DIR, Server
from robez_core import hostinfo


def unread_answers(
    address: str,
    calls: int,
    ids: int,
    seconds: float,
    *,
    window: int,
    read: bool = True,
    ended: int = 0,
    sample: Callable[[], None] | None = None,
) -> dict[int, tuple[str, str]]:
    """``calls`` ModelInfer calls of ``ids`` ids each on one HTTP/2 connection whose peer takes no answer:
    its stream windows at ``window`` (0: no answer's data may come), reading only HEADERS (``read``), or
    reading nothing once its calls are sent (its windows as large as HTTP/2 allows). Returns each ended
    call's (grpc-status, grpc-message) after ``seconds``, or once ``ended`` calls (if > 0) have ended.
    ``sample`` is called between reads."""
    request = pb.ModelInferRequest(model_name="demo")
    request.inputs.add(name="ids", datatype="INT64", shape=[ids])
    request.raw_input_contents.append(np.arange(ids, dtype=np.int64).tobytes())
    message = request.SerializeToString()
    body = b"\x00" + struct.pack(">I", len(message)) + message
    host, port = address.split(":")
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(0.05)
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    connection.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
    if window > 65535:
        connection.increment_flow_control_window(window - 65535)
    sock.sendall(connection.data_to_send())
    time.sleep(0.2)  # the server's SETTINGS and connection window, read once
    connection.receive_data(sock.recv(1 << 16))
    sent: dict[int, int] = {}
    for _ in range(calls):
        stream = connection.get_next_available_stream_id()
        connection.send_headers(
            stream,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", INFER),
                (":authority", address),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
            ],
        )
        sent[stream] = 0
    # Every call's headers in one write before any message: the server starts them all at once, before
    # any answer is ready (else calls opened after the first answers are held wait for the peer to read).
    sock.sendall(connection.data_to_send())
    statuses: dict[int, tuple[str, str]] = {}
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline and len(statuses) < (ended or calls + 1):
            if sample is not None:
                sample()
            for stream in sent:
                while sent[stream] < len(body):
                    size = min(
                        connection.local_flow_control_window(stream),
                        connection.max_outbound_frame_size,
                        len(body) - sent[stream],
                    )
                    if size <= 0:
                        break
                    connection.send_data(stream, body[sent[stream] : sent[stream] + size])
                    sent[stream] += size
                    if sent[stream] == len(body):
                        connection.end_stream(stream)
            if outgoing := connection.data_to_send():
                sock.sendall(outgoing)
            if not read and all(done == len(body) for done in sent.values()):
                time.sleep(0.05)
                continue
            try:
                incoming = sock.recv(1 << 16)
            except TimeoutError:
                continue
            if not incoming:
                break
            for event in connection.receive_data(incoming):
                if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                    headers = {bytes(k).decode(): bytes(v).decode() for k, v in event.headers}
                    if "grpc-status" in headers:
                        statuses[event.stream_id] = (headers["grpc-status"], headers.get("grpc-message", ""))
    finally:
        sock.close()
    return statuses


@dataclass
class Row:
    source: str
    engine: str
    pss_before: float
    pss_peak: float
    rss_peak: float
    refused: int  # calls ended without an answer
    codes: str  # their grpc-status: count
    seconds: float
    serves_after: bool


def measure(source: Path, engine: str, calls: int, ids: int, seconds: float) -> Row:
    server = Server({"ROBEZ_GRPC_ENGINE": engine}, cwd=source)
    try:
        memory = TreeMemoryPeak(server.process.pid)
        last = [0.0]

        def sample() -> None:
            if time.monotonic() - last[0] >= 0.25:
                last[0] = time.monotonic()
                memory.sample()

        started = time.monotonic()
        address = f"127.0.0.1:{server.grpc_port}"
        statuses = unread_answers(address, calls, ids, seconds, window=0, sample=sample)
        took = time.monotonic() - started
        codes = [code for code, _ in statuses.values()]
        with grpc.insecure_channel(address) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            ready = stub.ModelReady(pb.ModelReadyRequest(name="demo"), timeout=60).ready
        return Row(
            checkout_revision(source),
            engine,
            memory.pss_before,
            memory.pss_peak,
            memory.rss_peak,
            sum(code != "0" for code in codes),
            ", ".join(f"{code}: {codes.count(code)}" for code in sorted(set(codes))) or "none",
            took,
            ready,
        )
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--ids", type=int, default=262_144)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--engines", default="frames,grpcio")
    parser.add_argument(
        "--source", type=Path, action="append", help="a checkout to serve (default: this one)"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sources = args.source or [Path.cwd()]
    load_before = hostinfo.load_average()
    rows = []
    for source in sources:
        for engine in args.engines.split(","):
            print(f"{source} on {engine}: {args.calls} calls of {args.ids} ids, windows at 0", flush=True)
            row = measure(source.resolve(), engine, args.calls, args.ids, args.seconds)
            print(f"  {row}", flush=True)
            rows.append(row)
    load_after = hostinfo.load_average()
    date = dt.date.today().isoformat()
    lines = [
        f"### gRPC answers a client does not take ({date})",
        "",
        f"`python -m benchmarks.service.grpc_unread_answers --calls {args.calls} --ids {args.ids} "
        f"--seconds {args.seconds:g} --engines {args.engines}"
        + "".join(f" --source {source}" for source in args.source or [])
        + "`",
        "",
        f"- Machine: {hostinfo.cpu_model()}, {os.cpu_count()} CPUs; server: 1 worker, 1 kernel thread, the "
        f"demo table (d = 64), defaults otherwise; Python {platform.python_version()}; "
        f"{dt.datetime.now():%Y-%m-%d %H:%M}; load {' '.join(f'{v:.2f}' for v in load_before)} before, "
        f"{' '.join(f'{v:.2f}' for v in load_after)} after.",
        f"- One connection, windows at 0, {args.calls} calls of {args.ids} ids "
        f"({args.ids * 64 * 4 / 2**20:.0f} MiB answers); memory of the server's process tree sampled every "
        "0.25 s while the client reads only HEADERS, for at most "
        f"{args.seconds:g} s (less once every call has ended).",
        "",
        "| checkout | engine | PSS before MiB | PSS peak MiB | growth MiB | RSS peak MiB | calls ended "
        "without an answer (grpc-status: count) | s | serves after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.source} | {row.engine} | {row.pss_before:.0f} | {row.pss_peak:.0f} | "
            f"**{row.pss_peak - row.pss_before:.0f}** | {row.rss_peak:.0f} | "
            f"{row.refused} ({row.codes}) | {row.seconds:.1f} | {row.serves_after} |"
        )
    append_report(
        args.out or REPORT_DIR / f"grpc-unread-answers-{date}.md",
        f"gRPC answers a client does not take ({date})",
        "\n".join(lines) + "\n",
    )


if __name__ == "__main__":
    main()
