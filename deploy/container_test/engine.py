"""Podman in its own configuration and storage, its Docker API socket, and the Compose v2 CLI on it;
removing what a compose project left."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .common import Deadline, Failure, log, run

SERVICE = "robez"


class Engine:
    """Podman with its own configuration and storage under the state folder, and its Docker API socket."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.socket = state / "podman.sock"
        self.service: subprocess.Popen[bytes] | None = None
        self.env = dict(
            os.environ,
            CONTAINERS_CONF=str(state / "containers.conf"),
            CONTAINERS_STORAGE_CONF=str(state / "storage.conf"),
            CONTAINERS_REGISTRIES_CONF=str(state / "registries.conf"),
        )

    def write_config(self) -> None:
        state = self.state
        for folder in ("storage", "run", "networks", "tmp"):
            (state / folder).mkdir(parents=True, exist_ok=True)
        (state / "containers.conf").write_text(
            "# Written by make container-test; Podman reads it through CONTAINERS_CONF.\n"
            "[containers]\n"
            "# The sandbox's limits; Podman's defaults (nofile 1048576) are refused.\n"
            'default_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]\n'
            "[engine]\n"
            "# crun fails on this kind of host (hybrid cgroups v1); runc with cgroupfs works.\n"
            'runtime = "runc"\n'
            'cgroup_manager = "cgroupfs"\n'
            'events_logger = "file"\n'
            "# conmon keeps a finished exec session for this long (Docker API clients inspect it); 300 s\n"
            "# by default, which would leave a conmon per `docker compose exec` running after the test.\n"
            "exit_command_delay = 10\n"
            f'tmp_dir = "{state / "tmp"}"\n'
            "[network]\n"
            f'network_config_dir = "{state / "networks"}"\n'
        )
        (state / "storage.conf").write_text(
            f'[storage]\ndriver = "overlay"\ngraphroot = "{state / "storage"}"\nrunroot = "{state / "run"}"\n'
        )
        (state / "registries.conf").write_text(
            'unqualified-search-registries = ["docker.io"]\nshort-name-mode = "permissive"\n'
        )

    def podman(self, *args: str, deadline: Deadline, cap: float = 300, check: bool = True, **kw: Any) -> str:
        return run(["podman", *args], deadline, cap=cap, env=self.env, check=check, **kw).stdout or ""

    def image_exists(self, image: str, deadline: Deadline) -> bool:
        result = run(["podman", "image", "exists", image], deadline, env=self.env, check=False)
        return result.returncode == 0

    def start_service(self, deadline: Deadline) -> None:
        self.socket.unlink(missing_ok=True)
        log_file = (self.state / "podman-service.log").open("wb")
        self.service = subprocess.Popen(
            ["podman", "system", "service", "--time=0", f"unix://{self.socket}"],
            env=self.env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        limit = time.monotonic() + deadline.left(60)
        while time.monotonic() < limit:
            if self.service.poll() is not None:
                raise Failure(f"podman system service exited: see {self.state / 'podman-service.log'}")
            if self.socket.exists() and self._ping():
                return
            time.sleep(0.2)
        raise Failure("podman system service did not answer /_ping within 60 s")

    def _ping(self) -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.settimeout(2)
            try:
                client.connect(str(self.socket))
                client.sendall(b"GET /_ping HTTP/1.0\r\n\r\n")
                return b" 200 " in client.recv(64)
            except OSError:
                return False

    def stop_service(self) -> None:
        if self.service is None or self.service.poll() is not None:
            return
        self.service.terminate()
        try:
            self.service.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.service.kill()
            self.service.wait(timeout=10)
        self.socket.unlink(missing_ok=True)


class Compose:
    """The Compose v2 CLI on one compose file, talking to Podman's socket, under its own project name."""

    def __init__(
        self, binary: Path, engine: Engine, file: str, project: str, port: int, port_variable: str | None
    ) -> None:
        """`port` is the published host port the checks use; `port_variable`, the variable the file reads
        it from (docker-compose.yml: ROBEZ_HOST_PORT; deploy/cluster: ROBEZ_CLUSTER_PORT), is set to it."""
        self.binary = binary
        self.engine = engine
        self.file = file
        self.project = project
        self.port = port
        self.env = dict(
            os.environ,
            DOCKER_HOST=f"unix://{engine.socket}",
            DOCKER_CONFIG=str(engine.state / "docker-config"),
        )
        if port_variable is not None:
            self.env[port_variable] = str(port)

    def __call__(self, *args: str, deadline: Deadline, cap: float = 300, check: bool = True) -> str:
        command = [str(self.binary), "-f", self.file, "-p", self.project, *args]
        return run(command, deadline, cap=cap, env=self.env, check=check).stdout or ""

    def exec(
        self, *command: str, deadline: Deadline, env: Sequence[str] = (), service: str = SERVICE
    ) -> subprocess.CompletedProcess[str]:
        envs = [part for name in env for part in ("-e", name)]
        argv = [str(self.binary), "-f", self.file, "-p", self.project, "exec", "-T", *envs, service, *command]
        return run(argv, deadline, cap=120, env=self.env, check=False)


def project_leftovers(engine: Engine, project: str, deadline: Deadline) -> dict[str, list[str]]:
    label = f"label=com.docker.compose.project={project}"
    found = {
        "containers": engine.podman("ps", "-aq", "--filter", label, deadline=deadline).split(),
        "volumes": engine.podman("volume", "ls", "-q", "--filter", label, deadline=deadline).split(),
        "networks": engine.podman("network", "ls", "-q", "--filter", label, deadline=deadline).split(),
    }
    return {kind: names for kind, names in found.items() if names}


def engine_conmons(engine: Engine) -> list[int]:
    """Pids of the conmon monitors of this state folder's containers and exec sessions (the lock makes
    them this run's)."""
    storage = str(engine.state / "storage").encode()
    pids = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if entry.name.isdigit() and argv[0].endswith(b"conmon") and any(storage in arg for arg in argv):
                pids.append(int(entry.name))
    return pids


def reap_conmons(engine: Engine, seconds: float = 30) -> None:
    """Wait for the engine's conmons to finish (exit_command_delay), then end the rest by pid."""
    limit = time.monotonic() + seconds
    while engine_conmons(engine) and time.monotonic() < limit:
        time.sleep(1)
    for pid in engine_conmons(engine):
        log(f"ending conmon {pid}, still running {seconds:.0f} s after its container was removed")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def remove_projects(engine: Engine, projects: Sequence[str], composes: Sequence[Compose] = ()) -> None:
    """Best effort, on every exit: compose down -v, then whatever still carries a project's label."""
    deadline = Deadline(300)
    for compose in composes:
        if engine.service is not None and engine.service.poll() is None:
            with contextlib.suppress(Failure):
                compose(
                    "down",
                    "-v",
                    "--remove-orphans",
                    "--timeout",
                    "10",
                    deadline=deadline,
                    cap=120,
                    check=False,
                )
    for project in projects:
        with contextlib.suppress(Failure):
            leftovers = project_leftovers(engine, project, deadline)
            for kind, command in (("containers", ["rm", "-f"]), ("volumes", ["volume", "rm", "-f"]),
                                  ("networks", ["network", "rm", "-f"])):  # fmt: skip
                if leftovers.get(kind):
                    log(f"removing leftover {kind}: {' '.join(leftovers[kind])}")
                    engine.podman(*command, *leftovers[kind], deadline=deadline, check=False)
    reap_conmons(engine)
