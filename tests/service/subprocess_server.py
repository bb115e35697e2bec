"""A real ``robez serve`` in a subprocess, for tests of what only a real server shows (kill -9, worker
deaths, sockets, disks): its own process group, a free port on 127.0.0.1, its log in a file, a bounded
wait for readiness, and stopped by its pid (group), always. The one helper every such test uses."""

from __future__ import annotations

import contextlib
import os
import re
import ssl
from collections.abc import Iterator
from pathlib import Path

from loadtest.launch import RobezProcess, free_port
from loadtest.server import worker_pids

__all__ = ["RobezServer", "free_port", "serve", "worker_pids"]

START_TIMEOUT_S = 180.0
# GRPC_ENGINE_UNDER_TEST=grpcio: servers started here serve gRPC on that engine (as conftest's).
_ENGINE = (
    {"ROBEZ_GRPC_ENGINE": os.environ["GRPC_ENGINE_UNDER_TEST"]}
    if "GRPC_ENGINE_UNDER_TEST" in os.environ
    else {}
)


class RobezServer(RobezProcess):
    """``python -m service serve`` with ``args`` and ``env`` added to a ROBEZ_-free environment
    (``loadtest.launch.RobezProcess``, one kernel thread unless ``env`` says otherwise).

    Args:
        log_path: stdout and stderr of every start, appended.
        args: extra ``robez serve`` arguments (``--port`` is added).
        env: extra environment (``ROBEZ_SHM_DIR`` should point into the test's temporary folder).
        program: how robez is started (default ``python -m service``; e.g. the installed ``robez`` script).
        cwd: the server's working directory (default: the test's).
        verify: for a server started with ``--tls-cert``: what httpx checks its certificate with (an
            ``ssl.SSLContext``); the URL is then ``https://``.
    """

    def __init__(
        self,
        log_path: Path,
        args: list[str],
        env: dict[str, str],
        program: list[str] | None = None,
        cwd: Path | None = None,
        verify: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(
            args,
            {"ROBEZ_THREADS_PER_WORKER": "1", **_ENGINE, **env},
            log_path=log_path,
            program=program,
            cwd=cwd,
            verify=verify,
        )

    def start(self, timeout_s: float = START_TIMEOUT_S, *, interval_s: float = 0.2) -> RobezServer:
        """Start and wait until /readyz answers 200; a port taken meanwhile by another program is retried."""
        super().start(timeout_s, interval_s=interval_s)
        return self

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of ``/metrics`` (0 when absent)."""
        text = self.http.get("/metrics").text
        want = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
        for line in text.splitlines():
            match = re.fullmatch(r"(\w+)(?:\{(.*)\})? (\S+)", line)
            if match and match.group(1) == name and (match.group(2) or "") == want:
                return float(match.group(3))
        return 0.0


@contextlib.contextmanager
def serve(tmp_path: Path, **settings: str) -> Iterator[RobezServer]:
    """``robez serve`` (one worker, the demo table) with ``ROBEZ_<NAME>`` = value for each setting,
    started, and stopped on leaving the block."""
    env = {"ROBEZ_SHM_DIR": str(tmp_path / "shm")}
    env.update({f"ROBEZ_{key.upper()}": value for key, value in settings.items()})
    server = RobezServer(tmp_path / "server.log", [], env)
    try:
        server.start()
        yield server
    finally:
        server.stop()
