"""docker-compose.yml, the single-container stack: the README's calls, restarts, the volume, the
healthcheck, the user."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from typing import Any

from .common import Deadline, Failure, log, run
from .engine import SERVICE, Compose, project_leftovers

PROJECT = "robez-container-test"
README_GRADS = [0.5] * 64  # the README's update call: id 1, 64 values of 0.5


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
