"""A stop (SIGTERM) ends within a grace period whatever clients hold open (issue 40.5): an idle HTTPS
keep-alive client held it 31 s (asyncio waited 30 s for the client's close_notify), and stalled TLS
handshakes stayed open for a minute, past the header timeout, before they were even HTTP connections.
Real servers (the TLS handshake and the stop are the event loop's and the process's); timeouts made
short by settings."""

from __future__ import annotations

import socket
import ssl
import time
from pathlib import Path

import httpx
import pytest
import trustme

from benchmarks.service.hostile_stop import still_open

from .subprocess_server import RobezServer

pytestmark = pytest.mark.slow

# The old stop took 31 s; a stop here takes 1-3 s on a quiet machine. The bound leaves room for a
# loaded one and still fails on the old behaviour.
STOP_WITHIN_S = 15.0


def test_stalled_handshakes_are_cut_and_an_idle_https_client_does_not_hold_the_stop(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ca_file, cert_file, key_file = tmp_path / "ca.pem", tmp_path / "server.pem", tmp_path / "server.key"
    ca.cert_pem.write_to_path(str(ca_file))
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    cert.private_key_pem.write_to_path(str(key_file))
    shm_dir = tmp_path / "shm"
    env = {
        "ROBEZ_SHM_DIR": str(shm_dir),
        "ROBEZ_TLS_CERT": str(cert_file),
        "ROBEZ_TLS_KEY": str(key_file),
        "ROBEZ_HEADER_TIMEOUT_S": "1",
        "ROBEZ_KEEP_ALIVE_TIMEOUT_S": "60",  # the idle client must still be connected at the stop
        "ROBEZ_SHUTDOWN_GRACE_S": "1",
    }
    verify = ssl.create_default_context(cafile=str(ca_file))
    server = RobezServer(tmp_path / "server.log", [], env, verify=verify)
    stalled: list[socket.socket] = []
    try:
        server.start()
        # Connections that never send a ClientHello: cut at the header timeout (they waited 60 s).
        stalled = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(20)]
        deadline = time.monotonic() + 20
        while still_open(stalled) and time.monotonic() < deadline:
            time.sleep(0.25)
        assert still_open(stalled) == 0, "stalled TLS handshakes still open well past the header timeout"

        with httpx.Client(base_url=server.url, verify=verify) as idle:
            assert idle.get("/healthz").status_code == 200  # its connection stays open, idle
            (directory,) = shm_dir.glob("robez-*")
            started = time.monotonic()
            assert server.terminate(timeout_s=60) == 0
            stopped_in = time.monotonic() - started
        assert stopped_in < STOP_WITHIN_S, f"the stop took {stopped_in:.1f} s:\n{server.log()[-3000:]}"
        assert not directory.exists()
    finally:
        for sock in stalled:
            sock.close()
        server.stop()
