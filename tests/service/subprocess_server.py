"""A real ``robez serve`` in a subprocess, for tests of what only a real server shows (kill -9, worker
deaths, sockets, disks): its own process group, a free port on 127.0.0.1, its log in a file, a bounded
wait for readiness, and stopped by its pid (group), always. The one helper every such test uses."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

START_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class RobezServer:
    """``python -m service serve`` with ``args`` and ``env`` added to a ROBEZ_-free environment.

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
        self.log_path = log_path
        self.verify = verify
        self.args = args
        self.program = program if program is not None else [sys.executable, "-m", "service"]
        self.cwd = cwd
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("ROBEZ_")}
        self.env.update({"ROBEZ_THREADS_PER_WORKER": "1", **env})
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        scheme = "https" if self.verify is not None else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start and wait until /readyz answers 200; a port taken meanwhile by another program is retried."""
        for _ in range(3):
            if self._start_once():
                return
        raise AssertionError(f"server could not bind a port:\n{self.log()}")

    def _start_once(self) -> bool:
        self.port = free_port()
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [*self.program, "serve", "--port", str(self.port), *self.args],
                env=self.env,
                cwd=self.cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # one killpg reaches the supervisor and every worker
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                if "address already in use" in self.log_path.read_text(errors="replace")[log_start:].lower():
                    return False
                raise AssertionError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                ready = httpx.get(f"{self.url}/readyz", timeout=2.0, verify=self.verify or True)
                if ready.status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.kill()
        raise AssertionError(f"server not ready after {START_TIMEOUT_S} s:\n{self.log()}")

    def kill(self) -> None:
        """SIGKILL the whole process group (a crash)."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM the server, SIGKILL its group if it has not stopped within 60 s."""
        if self.process is None or self.process.poll() is not None:
            self.kill()
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=60)
        self.kill()  # workers the supervisor left behind, if any

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM to the server's main process only (what ``docker stop`` sends to PID 1) and wait for it
        to exit by itself; returns its exit status."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout_s)

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
