"""The single overlay under `podman kube play`: ready, lookup, push (with the Secret's key), the pod's
security and /dev/shm, a graceful stop, a new pod on the same PersistentVolumeClaim."""

from __future__ import annotations

import json
import secrets
import time
import urllib.error
import urllib.request
from typing import Any

from container_test.common import Deadline, Failure, log
from container_test.engine import Engine
from container_test.single import wait_ready

from .manifests import EmptyDirs, pod_spec, podman_secret, publish, render, write_play

GRADS = [0.5] * 64  # the README's update: id 1, 64 values of 0.5


def call(base: str, path: str, body: Any = None, key: str | None = None) -> tuple[int, Any]:
    """One HTTP call: (status, JSON body)."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"{base}{path}", data=data, method="POST" if data else "GET")
    request.add_header("Content-Type", "application/json")
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


def ok(base: str, path: str, body: Any = None, key: str | None = None) -> Any:
    status, answer = call(base, path, body, key)
    if status != 200:
        raise Failure(f"{path} answered {status}: {answer}")
    return answer


class SinglePod:
    """The overlay's objects as Podman runs them, and the commands on its pod."""

    def __init__(self, engine: Engine, port: int, deadline: Deadline) -> None:
        self.engine = engine
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.objects = render("single", deadline)
        self.stand_ins: list[str] = []
        (self.deployment,) = [o for o in self.objects if o["kind"] == "Deployment"]
        name = self.deployment["metadata"]["name"]
        self.pod = f"{name}-pod-0"  # Podman names a Deployment's pod <name>-pod-<n>, its containers <pod>-<c>
        self.container = f"{self.pod}-robez"
        services = [o["metadata"]["name"] for o in self.objects if o["kind"] == "Service"]
        self.objects = [o for o in self.objects if o["kind"] != "Service"]
        publish(self.deployment, "robez", "http", port)
        self.stand_ins.append(f"Service {', '.join(services)}: hostPort 127.0.0.1:{port}")
        self.empty_dirs = EmptyDirs(engine.state)
        self.stand_ins.append(
            "emptyDir as the kubelet makes it: " + "; ".join(self.empty_dirs.substitute(self.deployment))
        )
        self.claims = [o["metadata"]["name"] for o in self.objects if o["kind"] == "PersistentVolumeClaim"]
        # Podman makes a volume for each claim and for each ConfigMap a pod mounts.
        self.volumes = self.claims + [o["metadata"]["name"] for o in self.objects if o["kind"] == "ConfigMap"]
        self.play_file = engine.state / "k8s" / "single.yaml"
        write_play(self.play_file, self.objects)
        # Podman's kube play refuses a claim whose volume exists: a later pod is played without the claim
        # objects (in Kubernetes they stay, bound, and the new pod mounts them).
        self.replay_file = engine.state / "k8s" / "single-again.yaml"
        write_play(self.replay_file, [o for o in self.objects if o["kind"] != "PersistentVolumeClaim"])
        self.stand_ins.append(
            "a later pod played without the claim objects (Podman refuses an existing claim)"
        )

    def up(self, deadline: Deadline, again: bool = False) -> float:
        self.empty_dirs.make(deadline)
        play = self.replay_file if again else self.play_file
        self.engine.podman("kube", "play", str(play), deadline=deadline, cap=300)
        return wait_ready(self.base, deadline, seconds=300)

    def down(self, deadline: Deadline) -> None:
        self.engine.podman("kube", "down", str(self.play_file), deadline=deadline, cap=300, check=False)
        self.empty_dirs.remove(deadline)

    def remove(self, deadline: Deadline) -> list[str]:
        """Everything of the test: the pod, the claims' volumes, the emptyDir mounts; returns leftovers."""
        self.down(deadline)
        for name in self.volumes:
            self.engine.podman("volume", "rm", "-f", name, deadline=deadline, check=False)
        left = [
            n
            for n in self.engine.podman("volume", "ls", "-q", deadline=deadline).split()
            if n in self.volumes
        ]
        left += [
            p
            for p in self.engine.podman(
                "pod", "ls", "-q", "--filter", f"name={self.pod}", deadline=deadline
            ).split()
        ]
        return left

    def exec(self, *command: str, deadline: Deadline, check: bool = True) -> str:
        return self.engine.podman("exec", self.container, *command, deadline=deadline, cap=60, check=check)


def check_single(engine: Engine, port: int, deadline: Deadline) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    pod = SinglePod(engine, port, deadline)
    figures["stand_ins"] = pod.stand_ins
    spec = pod_spec(pod.deployment)
    grace = int(spec["terminationGracePeriodSeconds"])
    figures["grace"] = grace
    key = secrets.token_hex(16)
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "robez-api-keys"},
              "stringData": {"api-key": key}}  # fmt: skip
    try:
        with podman_secret(engine, secret, deadline):
            log(f"podman kube play {pod.play_file} (the single overlay; published on {pod.base})")
            pod.remove(deadline)  # of a run killed before its clean-up
            figures["ready_s"] = pod.up(deadline)
            if ok(pod.base, "/healthz") is None:
                raise Failure("/healthz answered no body")

            log("the demo table, a lookup and a push through the pod's port")
            dim = ok(pod.base, "/v1/tables/demo")["config"]["embedding_dim"]
            rows = ok(pod.base, "/v1/tables/demo/lookup", {"ids": [1, 2, 3]})["embeddings"]
            if len(rows) != 3 or any(len(row) != dim for row in rows):
                raise Failure(f"lookup of 3 ids did not answer 3 rows of {dim}")
            push = {"ids": [1], "grads": [GRADS[:dim]]}
            refused, _ = call(pod.base, "/v1/tables/demo/update", push)
            wrong, _ = call(pod.base, "/v1/tables/demo/update", push, key=key + "x")
            if (refused, wrong) != (401, 403):
                raise Failure(f"a push without the Secret's key answered {refused}, with a wrong one {wrong}")
            version = ok(pod.base, "/v1/tables/demo/update", push, key=key)["version"]
            after = ok(pod.base, "/v1/tables/demo/lookup", {"ids": [1]})["embeddings"][0]
            if after == rows[0]:
                raise Failure("the push did not change row 1")
            figures["version"] = version

            log("inside the pod: the user, the root file system, /dev/shm")
            status = pod.exec("cat", "/proc/1/status", deadline=deadline)
            uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
            if "0" in uids or uids[0] != str(spec["securityContext"]["runAsUser"]):
                raise Failure(f"pid 1 runs with uids {uids}")
            figures["uid"] = uids[0]
            figures["cmdline"] = (
                pod.exec("cat", "/proc/1/cmdline", deadline=deadline).replace("\0", " ").strip()
            )
            written = pod.exec("python", "-c", "open('/robez-k8s-test', 'w')", deadline=deadline, check=False)
            if "Read-only file system" not in written:
                raise Failure(f"writing to / inside the pod did not fail as read-only: {written!r}")
            mounts = pod.exec("cat", "/proc/mounts", deadline=deadline)
            shm = [line.split() for line in mounts.splitlines() if line.split()[1] == "/dev/shm"]
            if not shm or shm[-1][2] != "tmpfs":
                raise Failure(f"/dev/shm inside the pod is not a tmpfs: {shm}")
            figures["shm"] = next((o for o in shm[-1][3].split(",") if o.startswith("size=")), "size=?")
            if not any(
                name.startswith("robez-") for name in pod.exec("ls", "/dev/shm", deadline=deadline).split()
            ):
                raise Failure("no robez shared directory in /dev/shm")

            log(f"podman pod stop -t {grace}: SIGTERM, then the shutdown snapshot within the grace period")
            started = time.monotonic()
            engine.podman("pod", "stop", "-t", str(grace), pod.pod, deadline=deadline, cap=grace + 60)
            figures["stop_s"] = time.monotonic() - started
            exit_code = engine.podman(
                "inspect", "--format", "{{.State.ExitCode}}", pod.container, deadline=deadline
            )
            # A SIGTERM stop is a clean exit, 0, whatever the worker count (service/cli.py); 137 would be
            # the SIGKILL after the grace period, 143 the signal's default action (the clean-up skipped).
            if exit_code.strip() != "0":
                raise Failure(f"the server exited {exit_code.strip()} on SIGTERM (not a clean stop)")
            figures["exit_code"] = exit_code.strip()
            shm_dir = next(path for path, memory, _, _ in pod.empty_dirs.volumes if memory)
            if any(shm_dir.glob("robez-*")):
                raise Failure(
                    f"the stopped server left its shared tables in /dev/shm: {list(shm_dir.iterdir())}"
                )
            logs = engine.podman("logs", pod.container, deadline=deadline)
            figures["snapshot_logged"] = [line for line in logs.splitlines() if "snapshot" in line.lower()][
                -1:
            ]

            log("podman kube down, then play again: a new pod, fresh /dev/shm, the same claim")
            first = engine.podman("pod", "inspect", "--format", "{{.ID}}", pod.pod, deadline=deadline).strip()
            pod.down(deadline)
            figures["restart_ready_s"] = pod.up(deadline, again=True)
            second = engine.podman(
                "pod", "inspect", "--format", "{{.ID}}", pod.pod, deadline=deadline
            ).strip()
            if second == first:
                raise Failure("kube play after kube down did not make a new pod")
            again = ok(pod.base, "/v1/tables/demo/lookup", {"ids": [1]})
            if again["embeddings"][0] != after or again["version"] != version:
                raise Failure(
                    f"after the new pod: version {again['version']} (pushed {version}), row 1 "
                    f"{'unchanged' if again['embeddings'][0] == after else 'differs'}: the push was lost"
                )
    finally:
        left = pod.remove(Deadline(300))
        if left:
            raise Failure(f"left after the clean-up: {left}")
    figures["play_file"] = str(pod.play_file)
    return figures


def summary_lines(figures: dict[str, Any]) -> list[str]:
    return [
        "single overlay (podman kube play): stand-ins: " + "; ".join(figures["stand_ins"]),
        f"pod ready (/readyz 200) after {figures['ready_s']:.1f} s; a new pod on the same claim after "
        f"{figures['restart_ready_s']:.1f} s",
        "checked: GET /v1/tables/demo, lookup [1,2,3]; push refused without the Secret's key (401) and "
        f"with a wrong one (403), accepted with it (version {figures['version']})",
        f"checked: pid 1 `{figures['cmdline']}` as uid {figures['uid']}; root file system read-only; "
        f"/dev/shm a tmpfs ({figures['shm']}) holding robez's tables",
        f"checked: SIGTERM stop exited {figures['exit_code']} in {figures['stop_s']:.1f} s (grace period "
        f"{figures['grace']} s), its /dev/shm tables removed"
        + (
            f", last snapshot log line: {figures['snapshot_logged'][0][-100:]}"
            if figures["snapshot_logged"]
            else ""
        ),
        "checked: after kube down + play (new pod, fresh /dev/shm), row 1 and the version are the pushed "
        "ones (from the PersistentVolumeClaim); nothing of the test left",
    ]
