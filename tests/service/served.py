"""Raw sockets against a real ``robez serve`` (``subprocess_server.serve``), for tests of what only a
socket shows: stalled bodies, idle connections, clients that leave."""

from __future__ import annotations

import re
import socket
import time


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
