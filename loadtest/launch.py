"""Start ``robez serve`` in a subprocess and wait until it is ready: the one helper the tests, the load
test, the benchmarks, the quality run and ``make cluster`` start servers with.

A ``RobezProcess`` is ``python -m service serve --port P ARGS`` in its own process group (one signal
reaches the supervisor and every worker), listening on 127.0.0.1 on a free port unless told one, its
output appended to a log file, with a bounded wait for ``/readyz`` 200 that gives up at once when the
process exits. It is stopped by its pid (group), never by name. It lives in ``loadtest`` because every
tool may import ``loadtest`` while ``service`` imports none of them (tests/test_layout.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO

import httpx

# How long a start may take before it is called failed: importing torch and numba and loading the
# kernels' cache on a busy 2-core machine takes tens of seconds.
START_TIMEOUT_S = 180.0


class ServerNotReady(RuntimeError):
    """``robez serve`` exited, or did not answer ``/readyz`` 200 in time (the message has its log)."""


def free_port() -> int:
    """A TCP port nothing listens on right now on 127.0.0.1 (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def robez_command() -> list[str]:
    """How robez is started: this interpreter's ``-m service`` (works from a checkout and installed)."""
    return [sys.executable, "-m", "service"]


def without_robez_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default ``os.environ``) without ``ROBEZ_*``: a developer's settings must not leak
    into a server a tool starts."""
    source = os.environ if environ is None else environ
    return {key: value for key, value in source.items() if not key.startswith("ROBEZ_")}


def wait_ready(
    url: str,
    process: subprocess.Popen[bytes],
    timeout_s: float,
    *,
    interval_s: float = 0.2,
    verify: ssl.SSLContext | bool = True,
    on_poll: Callable[[], None] | None = None,
) -> bool:
    """Poll ``url``'s ``/readyz`` until it answers 200 (True), the process exits or ``timeout_s`` passes
    (False). ``on_poll`` runs before every poll (a benchmark samples the server's memory there)."""
    deadline = time.monotonic() + timeout_s
    # One client for every poll: a new one (what httpx.get makes) loads the CA bundle into a fresh SSL
    # context, ~25 ms of CPU, which ten polls a second take from the server starting beside it.
    with httpx.Client(timeout=2.0, verify=verify) as client:
        while time.monotonic() < deadline and process.poll() is None:
            if on_poll is not None:
                on_poll()
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}/readyz").status_code == 200:
                    return True
            time.sleep(interval_s)
    return False


class RobezProcess:
    """One ``robez serve`` subprocess.

    Args:
        args: ``robez serve`` arguments (``--port`` is added; give ``--host`` only for another address).
        env: environment added to this process's own, from which ``ROBEZ_*`` is dropped unless
            ``keep_robez_env`` (tests and benchmarks want only the settings they name).
        log_path: where stdout and stderr of every start are appended; None: inherited (``make cluster``).
        port: a fixed port; None: a free one per start (a port taken meanwhile is retried).
        program: the command before ``serve`` (default ``robez_command()``; e.g. the installed script).
        cwd: the server's working directory (default: the caller's).
        verify: for a server started with ``--tls-cert``: what httpx checks its certificate with; the
            URL is then ``https://``.
        cores: CPUs the server's whole process tree is pinned to (inherited at spawn), None: any.
    """

    def __init__(
        self,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        *,
        log_path: Path | None = None,
        port: int | None = None,
        program: Sequence[str] | None = None,
        cwd: Path | None = None,
        verify: ssl.SSLContext | None = None,
        cores: tuple[int, ...] | None = None,
        keep_robez_env: bool = False,
    ) -> None:
        self.args = list(args)
        self.env = dict(os.environ) if keep_robez_env else without_robez_env()
        self.env.update(env or {})
        self.log_path = log_path
        self.fixed_port = port
        self.port = port or 0
        self.program = list(program) if program is not None else robez_command()
        self.cwd = cwd
        self.verify = verify
        self.cores = cores
        self.process: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0  # time.monotonic() of the last spawn
        self._log_start = 0  # the log's size at the last spawn
        self._http: httpx.Client | None = None

    @property
    def url(self) -> str:
        scheme = "https" if self.verify is not None else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    @property
    def http(self) -> httpx.Client:
        """A client kept for requests to this server (``httpx.get`` makes a new one each time: ~25 ms of
        CPU for its SSL context, which polling loops pay many times a second)."""
        if self._http is None:
            self._http = httpx.Client(base_url=self.url, timeout=30.0, verify=self.verify or True)
        return self._http

    @property
    def pid(self) -> int:
        assert self.process is not None, "not started"
        return self.process.pid

    def spawn(self) -> RobezProcess:
        """Start the process without waiting for it (start several, then ``wait_ready`` each)."""
        if self.fixed_port is None:
            self.port = free_port()
            self._http = None  # its base URL names the old port
        self._log_start = self.log_path.stat().st_size if self.log_path and self.log_path.exists() else 0
        output: IO[bytes] | None = self.log_path.open("ab") if self.log_path is not None else None
        try:
            with affinity(self.cores):
                self.started_at = time.monotonic()
                self.process = subprocess.Popen(
                    [*self.program, "serve", "--port", str(self.port), *self.args],
                    env=self.env,
                    cwd=self.cwd,
                    stdout=output,
                    stderr=subprocess.STDOUT if output is not None else None,
                    start_new_session=True,  # one killpg reaches the supervisor and every worker
                )
        finally:
            if output is not None:
                output.close()
        return self

    def wait_ready(
        self,
        timeout_s: float = START_TIMEOUT_S,
        *,
        interval_s: float = 0.1,
        on_poll: Callable[[], None] | None = None,
    ) -> RobezProcess:
        """Until ``/readyz`` answers 200. Raises ``ServerNotReady`` (with the log) if the process exits
        or ``timeout_s`` passes; a server that did not exit is killed first."""
        assert self.process is not None, "not started"
        ready = wait_ready(
            self.url,
            self.process,
            timeout_s,
            interval_s=interval_s,
            verify=self.verify or True,
            on_poll=on_poll,
        )
        if ready:
            return self
        if self.process.poll() is not None:
            raise ServerNotReady(f"robez serve exited with {self.process.returncode}:\n{self.log_tail()}")
        self.kill()
        raise ServerNotReady(f"robez serve not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def start(self, timeout_s: float = START_TIMEOUT_S, *, interval_s: float = 0.1) -> RobezProcess:
        """``spawn`` and ``wait_ready``; a free port that another program took meanwhile is retried
        (twice) with a new one."""
        for attempt in range(3):
            self.spawn()
            try:
                return self.wait_ready(timeout_s, interval_s=interval_s)
            except ServerNotReady:
                if attempt == 2 or self.fixed_port is not None or not self._port_was_taken():
                    raise
        raise AssertionError("unreachable")

    def _port_was_taken(self) -> bool:
        if self.log_path is None or not self.log_path.exists():
            return False
        with self.log_path.open("rb") as log:
            log.seek(self._log_start)
            return b"address already in use" in log.read().lower()

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole process group (a crash) and reap the server."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM the process group (a graceful shutdown); SIGKILL what is left after ``timeout_s``
        (workers the supervisor left behind included)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=timeout_s)
        self.kill()

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM to the main process only (what ``docker stop`` sends to PID 1); waits for it to exit by
        itself and returns its exit status."""
        assert self.process is not None, "not started"
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout_s)

    def log(self) -> str:
        """Everything the server wrote to its log file (empty without one)."""
        return self._read_log()

    def log_tail(self, limit: int = 4000) -> str:
        """The log's last ``limit`` characters (what an error message shows)."""
        return self._read_log()[-limit:]

    def _read_log(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def running(server: RobezProcess, timeout_s: float = START_TIMEOUT_S) -> Iterator[RobezProcess]:
    """``server`` started, and stopped on leaving the block whatever happens."""
    try:
        yield server.start(timeout_s)
    finally:
        server.stop()


@contextlib.contextmanager
def affinity(cores: tuple[int, ...] | None) -> Iterator[None]:
    """Pin the calling thread while it spawns a child (the child inherits it), then restore it."""
    if not cores:
        yield
        return
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous)
