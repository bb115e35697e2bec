"""`make container-test`: the command line, the order of the parts, the summary, the clean-up."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from . import __doc__ as package_doc
from .cluster import (
    CLUSTER_FILE,
    CLUSTER_PORT_VARIABLE,
    CLUSTER_PROJECT,
    check_cluster_stack,
    ensure_cluster_standins,
)
from .common import REPO, Deadline, Failure, begin_run, log, run, write_summary
from .engine import Compose, Engine, remove_projects
from .images import IMAGE, STANDIN_IMAGE, build_image, ensure_apt_packages, ensure_compose
from .single import PROJECT, check_compose_stack

RECORD_BEGIN = "<!-- container-test summary: begin -->"
RECORD_END = "<!-- container-test summary: end -->"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def cluster_compose(binary: Path, engine: Engine) -> Compose:
    """The cluster file under its own project, its load balancer published on a host port free now."""
    return Compose(binary, engine, CLUSTER_FILE, CLUSTER_PROJECT, free_port(), CLUSTER_PORT_VARIABLE)


def machine() -> str:
    # Not robez_core.hostinfo: this runs under the system Python, without torch or robez installed.
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


def clean(engine: Engine, deadline: Deadline) -> None:
    """Delete the state folder: containers and images first, so no overlay mount is left behind."""
    if (engine.state / "storage.conf").exists() and shutil.which("podman"):
        engine.podman("rm", "-af", deadline=deadline, check=False)
        engine.podman("rmi", "-af", deadline=deadline, check=False)
    shutil.rmtree(engine.state)
    log(f"removed {engine.state}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(package_doc or "").split("\n\n")[0])
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

    begun = begin_run("container-test", "apt-get, rootful Podman", args.state, args.timeout)
    if begun is None:
        return 2
    deadline, _lock = begun

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
            cluster = cluster_compose(binary, engine)
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
            # A port free now, just before its `up` (the one above only served `config --images`).
            cluster = cluster_compose(binary, engine)
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
        write_summary(header + lines, args.record, RECORD_BEGIN, RECORD_END)
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
