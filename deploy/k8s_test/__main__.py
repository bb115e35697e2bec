"""`make k8s-test`: the command line, the container test's engine and image, the summary."""

from __future__ import annotations

import argparse
import datetime
import fcntl
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from container_test.__main__ import free_port, machine
from container_test.common import Deadline, Failure, log, run
from container_test.engine import Engine, reap_conmons
from container_test.images import STANDIN_IMAGE, build_image, ensure_apt_packages

from . import __doc__ as package_doc
from .manifests import kubectl
from .single import check_single, summary_lines

RECORD = "docs/kubernetes.md"
RECORD_BEGIN = "<!-- k8s-test summary: begin -->"
RECORD_END = "<!-- k8s-test summary: end -->"


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(package_doc or "").split("\n\n")[0])
    parser.add_argument("--state", type=Path, default=Path("/var/tmp/robez-container-test"),
                        help="the container test's engine state (images, configuration)")  # fmt: skip
    parser.add_argument("--base", choices=("standin", "official"), default="standin",
                        help="standin: a debootstrap stand-in; official: python:3.11-slim")  # fmt: skip
    parser.add_argument("--torch", choices=("wheel", "index"), default="wheel",
                        help="wheel: from pip's find-links if there; index: PyTorch's")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=3600, help="the whole run's budget, seconds")
    parser.add_argument("--record", type=Path, help=f"replace the summary block of this file ({RECORD})")
    args = parser.parse_args(argv)

    if os.geteuid() != 0:
        print("k8s-test needs root (apt-get, rootful Podman, tmpfs mounts)", file=sys.stderr)
        return 2
    deadline = Deadline(args.timeout)
    signal.signal(signal.SIGTERM, _interrupt)
    args.state.mkdir(parents=True, exist_ok=True)
    # The container test's lock: the two share the engine's state folder.
    lock = (args.state / "lock").open("w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"another container-test or k8s-test holds {args.state / 'lock'}", file=sys.stderr)
        return 2

    started = time.monotonic()
    engine = Engine(args.state)
    try:
        ensure_apt_packages(deadline)
        engine.write_config()
        image = build_image(engine, args, deadline)
        figures = check_single(engine, free_port(), deadline)
        versions = (
            engine.podman("--version", deadline=deadline).strip()
            + ", runc "
            + run(["runc", "--version"], deadline).stdout.split()[2]
            + ", "
            + run([str(kubectl()), "version", "--client"], deadline).stdout.splitlines()[0].strip()
        )
        tree = run(["git", "log", "-1", "--format=%h %s"], deadline, check=False).stdout.strip()[:90]
        dirty = run(["git", "status", "--porcelain", "--untracked-files=no"], deadline, check=False).stdout
        base = STANDIN_IMAGE if args.base == "standin" else "python:3.11-slim"
        lines = [
            f"make k8s-test: passed {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC "
            f"in {time.monotonic() - started:.0f} s",
            f"tree: {tree or 'not a git checkout'}{' (with uncommitted changes)' if dirty.strip() else ''}",
            f"machine: {machine()}",
            f"engine: {versions}",
            f"image localhost/robez:latest on {base}: "
            f"{image['size'] / 2**20:.0f} MiB, build {image['seconds']:.0f} s (cached layers reused)",
            *summary_lines(figures),
            "cluster overlay: not run (Podman 4.3 runs no StatefulSet); rendered, validated and its NATS "
            "configuration run as a 3-node cluster by make test",
        ]
        summary(lines, args.record)
        return 0
    except Failure as failure:
        log(f"FAILED: {failure}")
        return 1
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # let the clean-up finish
        reap_conmons(engine)
        log(f"done ({time.monotonic() - started:.0f} s in all)")


if __name__ == "__main__":
    sys.exit(main())
