"""A bounded hostile soak of the default gRPC engine (frames): while normal clients keep calling, hostile
peers open many connections and streams with slowloris header blocks, starved windows (and peers that read
nothing), PING floods, rapid resets (CVE-2023-44487), oversized headers and HPACK bombs; the worker's PSS
and RSS are sampled every second and the normal calls' answers and latencies counted, before, during and
after the attack.

    flock /tmp/robez-bench.lock python -m benchmarks.service.grpc_frames_soak [--seconds 60] [--out FILE]

One ``robez serve`` of this checkout (one worker, one kernel thread, the demo table, ``--grpc-port``,
``grpc_idle_timeout_s`` 10 and ``header_timeout_s`` 5 so that the time bounds act within the run). Every
attacker reconnects when the server closes its connection, until the end of the attack phase; every loop is
bounded by that deadline. The report goes to ``docs/benchmarks/grpc-frames-soak-<date>.md`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import os
import platform
import statistics
import struct
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from hpack import Encoder
from tritonclient.grpc import service_pb2 as pb

from benchmarks.service.oip_transports import INFER, REPORT_DIR, Server
from loadtest.server import tree_pids
from robez_core import hostinfo
from service.grpc.frames import (
    ACK,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEAD,
    HEADERS,
    PING,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    frame,
)

PATH = INFER


def _machine() -> str:
    return (
        f"{hostinfo.cpu_model()}, {os.cpu_count()} CPUs (lscpu: 1 thread per core); "
        "server: 1 worker, 1 kernel thread; "
        f"Python {platform.python_version()}; {dt.datetime.now():%Y-%m-%d %H:%M}"
    )


def _load() -> str:
    return " ".join(f"{value:.2f}" for value in hostinfo.load_average())


def _message(ids: int) -> bytes:
    request = pb.ModelInferRequest(model_name="demo")
    request.inputs.add(name="ids", datatype="INT64", shape=[ids])
    request.raw_input_contents.append(np.arange(ids, dtype="<i8").tobytes())
    body = request.SerializeToString()
    return b"\0" + len(body).to_bytes(4, "big") + body


def memory_mib(root: int) -> tuple[float, float, int]:
    """PSS and RSS of the server's process tree (smaps_rollup), MiB, and its open sockets."""
    pss = rss = sockets = 0
    for pid in tree_pids(root):
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                sockets += os.readlink(fd).startswith("socket:")
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    pss += int(line.split()[1])
                elif line.startswith("Rss:"):
                    rss += int(line.split()[1])
    return pss / 1024, rss / 1024, sockets


class TreeMemoryPeak:
    """PSS and RSS (MiB) of the process tree of ``pid`` at the start and at their highest of every
    ``sample``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.pss_before, rss, _ = memory_mib(pid)
        self.pss_peak, self.rss_peak = self.pss_before, rss

    def sample(self) -> None:
        pss, rss, _ = memory_mib(self.pid)
        self.pss_peak, self.rss_peak = max(self.pss_peak, pss), max(self.rss_peak, rss)


class Stats:
    def __init__(self) -> None:
        self.events: Counter[str] = Counter()  # what the server did to the attackers
        self.phase = "before"
        self.calls: dict[str, list[float]] = {"before": [], "attack": [], "after": []}
        self.failures: Counter[str] = Counter()
        self.memory: dict[str, list[tuple[float, float, int]]] = {"before": [], "attack": [], "after": []}


class Peer:
    """A raw hostile connection: frames out; what comes back parsed for GOAWAY and RST_STREAM (or not read
    at all, ``read=False``)."""

    def __init__(self, stats: Stats) -> None:
        self.stats = stats
        self.encoder = Encoder()
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self, port: int, settings: bytes = b"", read: bool = True) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", port)
        self.writer.write(PREFACE + frame(SETTINGS, 0, 0, settings) + frame(SETTINGS, ACK, 0))
        self.closed = asyncio.Event()
        self.task = asyncio.ensure_future(self._read() if read else self._watch())

    async def _read(self) -> None:
        assert self.reader is not None
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while True:
                head = await self.reader.readexactly(9)
                high, low, kind, _, _ = HEAD.unpack(head)
                payload = await self.reader.readexactly(high << 16 | low)
                if kind == GOAWAY:
                    code = struct.unpack_from(">I", payload, 4)[0]
                    self.stats.events[f"GOAWAY {code:#x} {payload[8:].decode(errors='replace')}".strip()] += 1
                elif kind == RST_STREAM:
                    self.stats.events[f"RST_STREAM {int.from_bytes(payload, 'big'):#x}"] += 1
        self.stats.events["closed by the server"] += 1
        self.closed.set()

    async def _watch(self) -> None:  # reads nothing (the transport takes what fits its buffer, then stops)
        assert self.writer is not None
        self.writer.transport.pause_reading()  # type: ignore[attr-defined]

    def send(self, *frames: bytes) -> bool:
        if self.writer is None or self.writer.transport.is_closing() or self.closed.is_set():
            return False
        self.writer.write(b"".join(frames))
        return True

    def headers(self, sid: int, flags: int, extra: list[tuple[str, str]] | None = None) -> bytes:
        block = self.encoder.encode(
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", PATH),
                (":authority", "soak"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                *(extra or []),
            ]
        )
        return frame(HEADERS, flags, sid, block)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.transport.abort()


async def _attacker(name: str, stats: Stats, port: int, deadline: float, body: Any) -> None:
    """Runs ``body(peer)`` on a fresh connection, again each time the server ends one, until ``deadline``."""
    while time.monotonic() < deadline:
        peer = Peer(stats)
        try:
            await body(peer, deadline)
        except OSError:
            stats.events[f"{name}: connect/send error"] += 1
            await asyncio.sleep(0.2)
        finally:
            peer.close()
        stats.events[f"{name}: connections"] += 1
        await asyncio.sleep(0.1)  # reconnecting, not spinning: the attackers share the machine


async def _until_closed(peer: Peer, deadline: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(peer.closed.wait(), max(deadline - time.monotonic(), 0.01))


async def slowloris(peer: Peer, port: int, deadline: float) -> None:
    """A header block that never ends: a byte of CONTINUATION a second."""
    await peer.open(port)
    peer.send(peer.headers(1, 0))  # no END_HEADERS
    while time.monotonic() < deadline and peer.send(frame(CONTINUATION, 0, 1, b"\x82")):
        await asyncio.sleep(1.0)
        if peer.closed.is_set():
            return


async def slow_preface(peer: Peer, port: int, deadline: float) -> None:
    """Half a preface, then nothing."""
    peer.reader, peer.writer = await asyncio.open_connection("127.0.0.1", port)
    peer.closed = asyncio.Event()
    peer.task = asyncio.ensure_future(peer._read())
    peer.writer.write(PREFACE[:10])
    await _until_closed(peer, deadline)


async def starved(peer: Peer, port: int, deadline: float, read: bool) -> None:
    """Windows of 0 (or nothing read at all): 100 calls of 4096 ids whose answers cannot be sent."""
    await peer.open(port, settings=struct.pack(">HI", 4, 0), read=read)
    message = _message(4096)
    for n in range(100):
        sid = 2 * n + 1
        peer.send(peer.headers(sid, END_HEADERS))
        for start in range(0, len(message), 16384):  # frames of 16 KiB, END_STREAM on the last
            last = start + 16384 >= len(message)
            peer.send(frame(DATA, END_STREAM if last else 0, sid, message[start : start + 16384]))
    if read:
        await _until_closed(peer, deadline)
    else:  # it would not notice the end: it holds its connection for the whole attack
        await asyncio.sleep(max(deadline - time.monotonic(), 0.0))


async def ping_flood(peer: Peer, port: int, deadline: float) -> None:
    await peer.open(port)
    n = 0
    while time.monotonic() < deadline and peer.send(
        *(frame(PING, 0, 0, (n + k).to_bytes(8, "big")) for k in range(10))
    ):
        n += 10
        await asyncio.sleep(0.01)


async def rapid_reset(peer: Peer, port: int, deadline: float) -> None:
    await peer.open(port)
    sid = 1
    while time.monotonic() < deadline:
        batch = []
        for _ in range(50):
            batch += [peer.headers(sid, END_HEADERS), frame(RST_STREAM, 0, sid, (8).to_bytes(4, "big"))]
            sid += 2
        if not peer.send(*batch):
            return
        await asyncio.sleep(0.01)


async def oversized(peer: Peer, port: int, deadline: float) -> None:
    """Calls with 20 KiB of metadata (each refused alone), and now and then an HPACK bomb past 64 KiB."""
    await peer.open(port)
    sid = 1
    while time.monotonic() < deadline:
        token = os.urandom(10_000).hex()
        if not peer.send(peer.headers(sid, END_HEADERS | END_STREAM, [("x-token", token)])):
            return
        sid += 2
        if sid % 40 == 1:
            peer.send(peer.headers(sid, END_HEADERS | END_STREAM, [("x-bomb", "b" * 3900)]))
            bomb = peer.encoder.encode([(":method", "POST"), *([("x-bomb", "b" * 3900)] * 20)])
            peer.send(frame(HEADERS, END_HEADERS | END_STREAM, sid + 2, bomb))
            sid += 4
        await asyncio.sleep(0.05)


def normal_client(stats: Stats, port: int, stop: threading.Event) -> None:
    """A well-behaved grpcio client: one ModelInfer of 1 id after another, each with a 5 s deadline."""
    request = _message(1)[5:]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(INFER)
        while not stop.is_set():
            phase = stats.phase
            start = time.perf_counter()
            try:
                call(request, timeout=5)
                stats.calls[phase].append(time.perf_counter() - start)
            except grpc.RpcError as exc:
                stats.failures[f"{phase}: {exc.code().name}"] += 1
                time.sleep(0.05)


async def soak(server: Server, seconds: float, stats: Stats) -> None:
    port = server.grpc_port
    stop = threading.Event()
    clients = [threading.Thread(target=normal_client, args=(stats, port, stop)) for _ in range(2)]
    for client in clients:
        client.start()

    async def sample(until: float) -> None:
        while time.monotonic() < until:
            stats.memory[stats.phase].append(memory_mib(server.process.pid))
            await asyncio.sleep(1.0)

    await sample(time.monotonic() + 5)
    stats.phase = "attack"
    deadline = time.monotonic() + seconds
    attacks = [
        *(("slowloris", lambda p, d: slowloris(p, port, d)) for _ in range(50)),
        *(("slow preface", lambda p, d: slow_preface(p, port, d)) for _ in range(20)),
        *(("starved windows", lambda p, d: starved(p, port, d, True)) for _ in range(10)),
        *(("reads nothing", lambda p, d: starved(p, port, d, False)) for _ in range(10)),
        *(("ping flood", lambda p, d: ping_flood(p, port, d)) for _ in range(5)),
        *(("rapid reset", lambda p, d: rapid_reset(p, port, d)) for _ in range(5)),
        *(("oversized headers", lambda p, d: oversized(p, port, d)) for _ in range(5)),
    ]
    tasks = [asyncio.ensure_future(_attacker(name, stats, port, deadline, body)) for name, body in attacks]
    await sample(deadline)
    await asyncio.wait(tasks, timeout=15)
    for task in tasks:
        task.cancel()
    stats.phase = "after"
    await sample(time.monotonic() + 10)
    stop.set()
    for client in clients:
        client.join(timeout=10)


def _latency(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return f"{statistics.median(ordered) * 1e3:.1f} / {p99 * 1e3:.1f} / {ordered[-1] * 1e3:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="the attack phase (default 60)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    load_start = _load()
    server = Server({"ROBEZ_GRPC_IDLE_TIMEOUT_S": "10", "ROBEZ_HEADER_TIMEOUT_S": "5"})
    stats = Stats()
    try:
        asyncio.run(soak(server, args.seconds, stats))
        alive = server.process.poll() is None
    finally:
        server.stop()
    lines = [
        f"### gRPC frames engine: hostile soak ({dt.date.today()})",
        "",
        f"Machine: {_machine()}.",
        "",
        f"Command: `python -m benchmarks.service.grpc_frames_soak --seconds {args.seconds:g}` (under"
        " the bench lock); attackers: 50 slowloris header blocks, 20 half prefaces, 10 starved-window and 10"
        " read-nothing peers (100 calls of 4096 ids each), 5 PING floods, 5 rapid-reset floods, 5"
        " oversized-header senders (20 KiB metadata, HPACK bombs past 64 KiB); each reconnects when cut off"
        " (the read-nothing peers hold theirs to the end). Two normal grpcio clients call ModelInfer (1 id,"
        " 5 s deadline) throughout.",
        "",
        f"Load average at the start: {load_start}",
        "",
        "| phase | normal calls answered | failed | latency ms p50 / p99 / max | server PSS MiB | RSS MiB"
        " | sockets |",
        "|---|---:|---:|---|---|---|---|",
    ]
    for phase in ("before", "attack", "after"):
        memory = stats.memory[phase] or [(0.0, 0.0, 0)]
        pss, rss, sockets = [m[0] for m in memory], [m[1] for m in memory], [m[2] for m in memory]
        failed = sum(n for key, n in stats.failures.items() if key.startswith(phase))
        lines.append(
            f"| {phase} | {len(stats.calls[phase])} | {failed} | {_latency(stats.calls[phase])} | "
            f"{min(pss):.0f}-{max(pss):.0f} (last {pss[-1]:.0f}) | {min(rss):.0f}-{max(rss):.0f} | "
            f"{min(sockets)}-{max(sockets)} (last {sockets[-1]}) |"
        )
    lines += ["", "What the server did to the attackers (counts over the attack):", ""]
    lines += [f"- {key}: {count}" for key, count in sorted(stats.events.items())]
    if stats.failures:
        failures = ", ".join(f"{key} x{count}" for key, count in sorted(stats.failures.items()))
        lines += ["", f"Normal calls that failed: {failures}"]
    lines += ["", f"Server still running at the end: {alive}.", "", f"Load average at the end: {_load()}"]
    text = "\n".join(lines) + "\n"
    print(text)
    out = args.out or REPORT_DIR / f"grpc-frames-soak-{dt.date.today()}.md"
    if args.out is not None or not out.exists():
        out.write_text(text)


if __name__ == "__main__":
    main()
