"""What HTTP clients that read none of their answers cost a worker: ``--connections`` connections, each
sending one binary lookup of ``--ids`` ids (a receive buffer of 4 KiB) and reading nothing; the server's
process tree (PSS and RSS, smaps_rollup) sampled every 0.25 s for ``--seconds``; then every client reads
its answer, and the statuses the server gave are counted. Then a normal lookup, to see the worker serve.

    flock /tmp/robez-bench.lock python -m benchmarks.service.http_unread_answers \\
        [--connections 200] [--ids 262144] [--seconds 15] [--source DIR ...] [--out FILE]

Each ``--source`` is a checkout whose ``robez serve`` is run (default: this one), so a change and its
base are measured in one run; one worker, one kernel thread, the demo table (d = 64: 262,144 ids answer
64 MiB), the defaults otherwise (``max_body_bytes_held`` 1 GiB). The report goes to
``docs/benchmarks/http-unread-answers-<date>.md``; the gRPC counterpart is ``grpc_unread_answers``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re
import socket
import ssl
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import httpx
import numpy as np

from benchmarks.common import append_report, checkout_revision
from benchmarks.service.grpc_frames_soak import TreeMemoryPeak
from benchmarks.service.oip_transports import REPORT_DIR, Server
from robez_core import hostinfo


def lookup_request(ids: int) -> bytes:
    """An HTTP/1.1 binary lookup of ``ids`` ids of the demo table, as it goes on the wire."""
    body = np.arange(ids, dtype="<i8").tobytes()
    return (
        "POST /v1/tables/demo/lookup HTTP/1.1\r\nHost: bench\r\nContent-Type: application/octet-stream\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def send_unread(
    port: int, connections: int, ids: int, tls: ssl.SSLContext | None = None
) -> list[socket.socket]:
    """``connections`` connections (over TLS with ``tls``) that have each sent one lookup of ``ids`` ids
    and read nothing yet (a receive buffer of 4 KiB: the kernel takes little of an answer for them)."""
    request = lookup_request(ids)
    sockets = []
    for _ in range(connections):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname="127.0.0.1")
        sock.sendall(request)
        sockets.append(sock)
    return sockets


def read_answer(stream: BinaryIO) -> tuple[int, bytes]:
    """The status of the next response on ``stream`` (a socket's file, so pipelined responses stay for
    the next call) and its body's first 300 bytes, the rest read and dropped."""
    status = int(stream.readline().split(b" ", 2)[1])
    length = 0
    while (line := stream.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    first = stream.read(min(length, 300))
    left = length - len(first)
    while left > 0:
        chunk = stream.read(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("closed mid-body")
        left -= len(chunk)
    return status, first


def read_status(sock: socket.socket, timeout_s: float = 120) -> str:
    """The status of the one response on ``sock``, or why there is none."""
    sock.settimeout(timeout_s)
    try:
        with sock.makefile("rb") as stream:
            return str(read_answer(stream)[0])
    except (OSError, ValueError, IndexError) as exc:  # no answer, or not a whole one
        return type(exc).__name__


@dataclass
class Row:
    source: str
    pss_before: float
    pss_peak: float
    rss_peak: float
    statuses: str  # status: count, once the clients read
    rejected: str  # robez_rejected_total by reason: why the 503s
    read_s: float
    serves_after: bool


def measure(source: Path, connections: int, ids: int, seconds: float) -> Row:
    server = Server(cwd=source)
    try:
        memory = TreeMemoryPeak(server.process.pid)
        sockets = send_unread(server.port, connections, ids)
        try:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                memory.sample()
                time.sleep(0.25)
            started = time.monotonic()
            statuses = Counter(read_status(sock) for sock in sockets)
            read_s = time.monotonic() - started
        finally:
            for sock in sockets:
                sock.close()
        small = np.arange(2, dtype="<i8").tobytes()
        answer = httpx.post(
            f"{server.url}/v1/tables/demo/lookup",
            content=small,
            headers={"content-type": "application/octet-stream"},
            timeout=60,
        )
        scrape = httpx.get(f"{server.url}/metrics", timeout=60).text
        rejected = re.findall(r'^robez_rejected_total\{reason="(\w+)"\} ([0-9.e+]+)$', scrape, re.M)
        return Row(
            checkout_revision(source),
            memory.pss_before,
            memory.pss_peak,
            memory.rss_peak,
            ", ".join(f"{status}: {count}" for status, count in sorted(statuses.items())),
            ", ".join(f"{reason}: {float(count):.0f}" for reason, count in rejected if float(count))
            or "none",
            read_s,
            answer.status_code == 200,
        )
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--connections", type=int, default=200)
    parser.add_argument("--ids", type=int, default=262_144)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument(
        "--source", type=Path, action="append", help="a checkout to serve (default: this one)"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sources = args.source or [Path.cwd()]
    load_before = hostinfo.load_average()
    rows = []
    for source in sources:
        print(
            f"{source}: {args.connections} connections, one lookup of {args.ids} ids each, unread", flush=True
        )
        row = measure(source.resolve(), args.connections, args.ids, args.seconds)
        print(f"  {row}", flush=True)
        rows.append(row)
    load_after = hostinfo.load_average()
    date = dt.date.today().isoformat()
    lines = [
        f"### HTTP answers clients do not read ({date})",
        "",
        f"`python -m benchmarks.service.http_unread_answers --connections {args.connections} "
        f"--ids {args.ids} --seconds {args.seconds:g}"
        + "".join(f" --source {source}" for source in args.source or [])
        + "`",
        "",
        f"- Machine: {hostinfo.cpu_model()}, {os.cpu_count()} CPUs; server: 1 worker, 1 kernel thread, the "
        f"demo table (d = 64), defaults otherwise (max_body_bytes_held 1 GiB); Python "
        f"{platform.python_version()}; {dt.datetime.now():%Y-%m-%d %H:%M}; load "
        f"{' '.join(f'{v:.2f}' for v in load_before)} before, "
        f"{' '.join(f'{v:.2f}' for v in load_after)} after.",
        f"- {args.connections} connections (SO_RCVBUF 4 KiB), each one binary lookup of {args.ids} ids "
        f"({args.ids * 64 * 4 / 2**20:.0f} MiB answers), none read for {args.seconds:g} s while the server's "
        "process tree is sampled every 0.25 s; then each reads its answer (statuses below).",
        "",
        "| checkout | PSS before MiB | PSS peak MiB | growth MiB | RSS peak MiB | statuses once read | "
        "503s by reason | read s | serves after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.source} | {row.pss_before:.0f} | {row.pss_peak:.0f} | "
            f"**{row.pss_peak - row.pss_before:.0f}** | {row.rss_peak:.0f} | {row.statuses} | "
            f"{row.rejected} | {row.read_s:.1f} | {row.serves_after} |"
        )
    append_report(
        args.out or REPORT_DIR / f"http-unread-answers-{date}.md",
        f"HTTP answers clients do not read ({date})",
        "\n".join(lines) + "\n",
    )


if __name__ == "__main__":
    main()
