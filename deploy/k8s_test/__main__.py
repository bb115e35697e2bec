"""`make k8s-test`: the command line, the container test's engine and image, the summary."""

from __future__ import annotations

import argparse
import datetime
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from container_test.__main__ import free_port, machine
from container_test.common import Failure, begin_run, log, run, write_summary
from container_test.engine import Engine, reap_conmons
from container_test.images import STANDIN_IMAGE, build_image, ensure_apt_packages

from . import __doc__ as package_doc
from .manifests import kubectl
from .single import check_single, summary_lines

RECORD = "docs/kubernetes.md"
RECORD_BEGIN = "<!-- k8s-test summary: begin -->"
RECORD_END = "<!-- k8s-test summary: end -->"


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

    begun = begin_run("k8s-test", "apt-get, rootful Podman, tmpfs mounts", args.state, args.timeout)
    if begun is None:
        return 2
    deadline, _lock = begun

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
        write_summary(lines, args.record, RECORD_BEGIN, RECORD_END)
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
