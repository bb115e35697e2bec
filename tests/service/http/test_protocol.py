"""Connection limits on a real server: connections that send no request's headers in time are closed, and
a worker holds at most max_connections at once."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from ..served import raw_connection, read_response, read_until_closed
from ..subprocess_server import serve

pytestmark = pytest.mark.slow

OCTET = {"content-type": "application/octet-stream"}


def test_idle_connections_are_closed_and_capped(tmp_path: Path) -> None:
    """25 connections against a cap of 20: 5 closed on accept; the 20 others, idle or stuck halfway
    through their headers, closed after header_timeout_s. Then the server serves as before."""
    cap, over, partial = 20, 5, 3
    with serve(tmp_path, header_timeout_s="3", keep_alive_timeout_s="1", max_connections=str(cap)) as server:
        sockets = [raw_connection(server.port) for _ in range(cap + over - partial)]
        # Headers that never complete: uvicorn's keep-alive timer does not cover these either.
        sockets += [raw_connection(server.port, b"GET /healthz HTTP/1.1\r\nHost: t") for _ in range(partial)]
        try:
            deadline = time.monotonic() + 60
            closed = [read_until_closed(sock, deadline) for sock in sockets]
        finally:
            for sock in sockets:
                sock.close()
        assert all(answer == b"" for answer in closed), "connections still open (or answered)"
        assert server.metric("robez_connections_closed_total", reason="max_connections") == over
        assert server.metric("robez_connections_closed_total", reason="header_timeout") == cap
        ids = np.arange(4, dtype="<i8").tobytes()
        assert (
            httpx.post(f"{server.url}/v1/tables/demo/lookup", content=ids, headers=OCTET).status_code == 200
        )
        # A keep-alive connection with requests 0.5 s apart outlives header_timeout_s=3 and
        # keep_alive_timeout_s=1: both restart with every request.
        with raw_connection(server.port) as sock:
            for _ in range(8):
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
                assert read_response(sock).startswith(b"HTTP/1.1 200 ")
                time.sleep(0.5)
            # Silent after its response: closed by the keep-alive timeout (1 s, checked every 0.25 s by
            # the sweep), before the header timeout (3 s) would have closed it.
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
            assert read_response(sock).startswith(b"HTTP/1.1 200 ")
            answered = time.monotonic()
            assert read_until_closed(sock, answered + 2.9) == b""
            assert time.monotonic() - answered >= 0.95
