"""A real ``robez serve`` subprocess on a free loopback port, for tests of what only a socket shows
(stalled bodies, idle connections, clients that leave). Stopped by pid, always."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

START_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Served:
    url: str
    port: int
    log_path: Path
    process: subprocess.Popen[bytes]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of ``/metrics`` (0 when absent)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        want = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
        for line in text.splitlines():
            match = re.fullmatch(r"(\w+)(?:\{(.*)\})? (\S+)", line)
            if match and match.group(1) == name and (match.group(2) or "") == want:
                return float(match.group(3))
        return 0.0


@contextmanager
def serve(tmp_path: Path, **settings: str) -> Iterator[Served]:
    """``robez serve`` (one worker, the demo table) with ``ROBEZ_<NAME>`` = value for each setting."""
    port = free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith("ROBEZ_")}
    env.update({"ROBEZ_SHM_DIR": str(tmp_path / "shm"), "ROBEZ_THREADS_PER_WORKER": "1"})
    env.update({f"ROBEZ_{key.upper()}": value for key, value in settings.items()})
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "service", "serve", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    served = Served(f"http://127.0.0.1:{port}", port, log_path, process)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert process.poll() is None, served.log()
            try:
                if httpx.get(f"{served.url}/readyz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not start:\n" + served.log()
            time.sleep(0.2)
        yield served
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=30)


def raw_connection(port: int, data: bytes = b"") -> socket.socket:
    """A plain TCP connection to the server that has sent ``data`` (nothing by default)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    if data:
        sock.sendall(data)
    return sock


def read_until_closed(sock: socket.socket, deadline: float) -> bytes | None:
    """Everything the server sends until it closes the connection; None if still open at ``deadline``
    (a monotonic time)."""
    received = b""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return None
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk


def read_response(sock: socket.socket) -> bytes:
    """One whole HTTP/1.1 response with a Content-Length (status line, headers and body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed mid-response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = re.search(rb"(?im)^content-length: *(\d+)", head)
    assert length is not None, head
    while len(body) < int(length.group(1)):
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        body += chunk
    return head + b"\r\n\r\n" + body
