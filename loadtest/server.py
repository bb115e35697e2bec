"""Start, watch and stop ``robez serve`` subprocesses for the load test (loopback only).

The server gets the load test's own tables file (``LOADTEST_TABLES``), so the in-process kernel
baseline can build exactly the same tables, and is pinned to the cores it is given: the whole process
tree (uvicorn supervisor and workers) inherits the affinity set at spawn time.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from .launch import RobezProcess, affinity, free_port
from .transport import Target

MAIN_TABLE = "loadtest"
# The multi-table scenario spreads each request over these (a DLRM request touches many tables).
MULTI_TABLES: tuple[str, ...] = ("loadtest", "loadtest_1", "loadtest_2", "loadtest_3")
# The reference table (the service's demo table): d = 64, Z = 32, m = 262144 float32 values.
TABLE_CONFIG: dict[str, Any] = {
    "num_embeddings": 10_000_000,
    "embedding_dim": 64,
    "memory_size": 262_144,
    "chunk_size": 32,
}
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def tables_toml() -> str:
    """The tables file the load test serves: ``MULTI_TABLES``, each ``TABLE_CONFIG`` with its own seed."""
    sections = []
    for number, name in enumerate(MULTI_TABLES):
        fields = {**TABLE_CONFIG, "seed": 1024 + number}
        lines = [f"[tables.{name}]", *(f"{key} = {value}" for key, value in fields.items())]
        lines += [f"[tables.{name}.optimizer]", 'name = "sgd"', "lr = 0.01"]
        sections.append("\n".join(lines))
    return "\n\n".join(sections) + "\n"


def free_loopback_port() -> int:
    """A port nothing listens on right now (the server binds it a moment later)."""
    return free_port()


@dataclass
class ServerProcess:
    """A running ``robez serve``: its target, pid, workers, cores and log file."""

    target: Target
    process: subprocess.Popen[bytes]
    workers: int
    cores: tuple[int, ...] | None
    log_path: Path
    grpc_target: Target | None = None  # its gRPC port, when started with one

    def log_tail(self, limit: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the server's whole process tree so far."""
        return tree_cpu_seconds(self.process.pid)


def start_server(
    workers: int,
    cores: tuple[int, ...] | None,
    workdir: Path,
    *,
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 120.0,
    grpc: bool = False,
) -> ServerProcess:
    """Start ``robez serve --workers N`` on a free loopback port pinned to ``cores``; wait for /readyz
    (``loadtest.launch.RobezProcess``). ``grpc``: also serve the inference protocol over gRPC, on another
    free port.

    Raises:
        RuntimeError: the server exited or was not ready in time (the message carries its log's tail).
    """
    config_path = workdir / "tables.toml"
    config_path.write_text(tables_toml())
    port = free_port()
    args = ["--host", "127.0.0.1", "--workers", str(workers), "--config", str(config_path)]
    grpc_target = Target("127.0.0.1", free_port()) if grpc else None
    if grpc_target is not None:
        args += ["--grpc-port", str(grpc_target.port)]
    log_path = workdir / f"server-{workers}w-{port}.log"
    # The caller's environment as it is (ROBEZ_* included: the load test's own knobs reach the server).
    launched = RobezProcess(
        args,
        {"ROBEZ_LOG_LEVEL": "warning", **(env or {})},
        log_path=log_path,
        port=port,
        cores=cores,
        keep_robez_env=True,
    ).spawn()
    assert launched.process is not None
    server = ServerProcess(Target("127.0.0.1", port), launched.process, workers, cores, log_path, grpc_target)
    try:
        launched.wait_ready(ready_timeout_s, interval_s=0.2)
    except BaseException:
        stop_server(server)
        raise
    return server


def stop_server(server: ServerProcess, timeout_s: float = 15.0) -> None:
    """SIGTERM the server's process group (a graceful uvicorn shutdown); SIGKILL what is left."""
    _stop_group(server.process, timeout_s)


def _stop_group(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=timeout_s)
    # workers can outlive the supervisor; the group is ours alone
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5.0)


@contextlib.contextmanager
def running_server(
    workers: int, cores: tuple[int, ...] | None, *, env: dict[str, str] | None = None, grpc: bool = False
) -> Iterator[ServerProcess]:
    """``start_server`` in a temporary directory, stopped on exit."""
    with tempfile.TemporaryDirectory(prefix="robez-loadtest-") as workdir:
        server = start_server(workers, cores, Path(workdir), env=env, grpc=grpc)
        try:
            yield server
        finally:
            stop_server(server)


@dataclass
class BaselineProcess:
    """A baseline server the load test started (the framework floor or the Redis peer)."""

    name: str
    target: Target
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, limit: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""


def _spawn(
    name: str, command: list[str], cores: tuple[int, ...] | None, workdir: Path, port: int
) -> BaselineProcess:
    log_path = workdir / f"{name}-{port}.log"
    with log_path.open("wb") as log, affinity(cores):
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return BaselineProcess(name, Target("127.0.0.1", port), process, log_path)


def _wait_until(baseline: BaselineProcess, ready: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if baseline.process.poll() is not None:
            raise RuntimeError(
                f"{baseline.name} exited with {baseline.process.returncode}:\n{baseline.log_tail()}"
            )
        with contextlib.suppress(OSError, httpx.HTTPError):
            if ready():
                return
        time.sleep(0.1)
    raise RuntimeError(f"{baseline.name} not ready after {timeout_s:.0f} s:\n{baseline.log_tail()}")


def stop_baseline(baseline: BaselineProcess, timeout_s: float = 15.0) -> None:
    """SIGTERM the baseline's process group; SIGKILL what is left."""
    _stop_group(baseline.process, timeout_s)


@contextlib.contextmanager
def running_floor(
    workers: int, cores: tuple[int, ...] | None, *, ready_timeout_s: float = 60.0
) -> Iterator[BaselineProcess]:
    """``python -m loadtest.floor`` with ``workers`` on ``cores`` (as ``robez serve``), stopped on exit."""
    port = free_loopback_port()
    command = [sys.executable, "-m", "loadtest.floor", "--port", str(port), "--workers", str(workers)]
    with tempfile.TemporaryDirectory(prefix="robez-floor-") as workdir:
        floor = _spawn("the framework floor", command, cores, Path(workdir), port)
        try:
            _wait_until(
                floor,
                lambda: httpx.get(f"{floor.target.base_url}/", timeout=2.0).status_code == 200,
                ready_timeout_s,
            )
            yield floor
        finally:
            stop_baseline(floor)


def redis_server_path() -> str | None:
    """The ``redis-server`` (or Valkey's ``valkey-server``) on PATH, if any; the load test installs none."""
    return shutil.which("redis-server") or shutil.which("valkey-server")


def _redis_ping(target: Target) -> bool:
    with socket.create_connection((target.host, target.port), timeout=2.0) as sock:
        sock.sendall(b"*1\r\n$4\r\nPING\r\n")
        return sock.recv(64).startswith(b"+PONG")


@contextlib.contextmanager
def running_redis(
    executable: str, cores: tuple[int, ...] | None, *, ready_timeout_s: float = 30.0
) -> Iterator[BaselineProcess]:
    """A private in-memory Redis on loopback (no persistence, no other clients), pinned to ``cores``."""
    port = free_loopback_port()
    with tempfile.TemporaryDirectory(prefix="robez-redis-") as workdir:
        command = [
            executable, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
            "--dir", workdir, "--protected-mode", "yes", "--daemonize", "no", "--loglevel", "warning",
        ]  # fmt: skip
        redis = _spawn("redis-server", command, cores, Path(workdir), port)
        try:
            _wait_until(redis, lambda: _redis_ping(redis.target), ready_timeout_s)
            yield redis
        finally:
            stop_baseline(redis)


def rss_bytes(pid: int) -> int:
    """Resident memory of one process (VmRSS), 0 if it is gone."""
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/status") as file:
        for line in file:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def tree_pids(pid: int, max_processes: int = 1024) -> list[int]:
    """``pid`` and its live descendants (Linux /proc), at most ``max_processes`` of them."""
    found: list[int] = []
    pending, seen = [pid], set[int]()
    while pending and len(seen) < max_processes:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        found.append(current)
        pending += _children(current)
    return found


def worker_pids(server_pid: int) -> list[int]:
    """The live workers of a ``robez serve --workers N`` (N > 1) whose pid is ``server_pid``: the children of
    its fork server (``service.supervisor``), itself the server's child; for a server of before the fork
    server (a benchmark's ``--source``), its spawned children."""
    workers = []
    for pid in tree_pids(server_pid):
        try:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        forked = b"forkserver" in command and parent != server_pid
        if forked or b"spawn_main" in command:
            workers.append(pid)
    return workers


def tree_rss_bytes(pid: int, max_processes: int = 1024) -> int:
    """Resident memory of ``pid`` and its descendants, summed (pages shared between them count twice)."""
    return sum(rss_bytes(each) for each in tree_pids(pid, max_processes))


def _children(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as file:
                found += [int(child) for child in file.read().split()]
    return found


def _cpu_ticks(pid: int) -> int:
    """utime + stime of one process (clock ticks); 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            stat = file.read()
    except OSError:
        return 0
    # the command name may contain spaces and parentheses: fields start after the last ')'
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


def tree_cpu_seconds(pid: int, max_processes: int = 1024) -> float:
    """CPU seconds (user + system) used so far by ``pid`` and all its live descendants (Linux /proc)."""
    return sum(_cpu_ticks(each) for each in tree_pids(pid, max_processes)) / _CLK_TCK


def machine_busy_seconds() -> float:
    """CPU seconds all cores of the machine have spent busy so far (user, nice, system, irq, softirq).

    Compared with the server's and the clients' own CPU time over a run it shows how much other work
    (other processes on a shared machine) competed with the measurement.
    """
    try:
        with open("/proc/stat") as file:
            fields = file.readline().split()
    except OSError:
        return math.nan
    user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[1:8])
    return (user + nice + system + irq + softirq) / _CLK_TCK
