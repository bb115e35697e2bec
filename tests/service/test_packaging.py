"""Dockerfile and docker-compose.yml, checked by reading them (no Docker engine in CI): they must stay
consistent with the CLI, the Settings, the constraints file and the packages they ship."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import yaml

from service.cli import _parser, _settings_from
from service.config import DEMO_TABLE_CONFIG, DEMO_TABLE_NAME, Settings, load_tables_file

REPO = Path(__file__).resolve().parents[2]


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    logical: list[str] = []
    pending = ""
    for line in (REPO / "Dockerfile").read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        logical.append(pending + stripped)
        pending = ""
    assert not pending, "Dockerfile ends inside a continuation"
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1]) for text in logical]


def base_images() -> list[str]:
    """The image of each FROM, with ${ARG} references replaced by the ARG defaults declared before it."""
    defaults: dict[str, str] = {}
    images: list[str] = []
    for name, args in dockerfile_instructions():
        if name == "ARG" and "=" in args:
            key, value = args.split("=", 1)
            defaults[key] = value.strip('"')
        elif name == "FROM":
            image = args.split()[0]
            images.append(re.sub(r"\$\{(\w+)\}", lambda match: defaults[match[1]], image))
    return images


def final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions()
    last_from = max(i for i, (name, _) in enumerate(instructions) if name == "FROM")
    return instructions[last_from:]


def dockerfile_instruction_json(name: str) -> list[str]:
    """The exec-form (JSON array) command of the final stage's CMD or HEALTHCHECK."""
    (arguments,) = [args for instruction, args in final_stage() if instruction == name]
    if name == "HEALTHCHECK":
        arguments = arguments[arguments.index("CMD ") + len("CMD ") :]
    command = json.loads(arguments)
    assert isinstance(command, list) and all(isinstance(part, str) for part in command)
    return command


def compose_service() -> dict[str, Any]:
    document = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    (service,) = document["services"].values()
    assert isinstance(service, dict)
    return service


def test_dockerfile_stages_are_slim_and_run_unprivileged() -> None:
    # Default build: both stages on the official slim image (PYTHON_IMAGE overrides it offline).
    assert base_images() == ["python:3.11-slim"] * 2
    stage = dict(final_stage())
    assert stage["USER"] not in ("root", "0")
    assert stage["EXPOSE"] == "8000"
    assert json.loads(stage["VOLUME"]) == ["/data"]
    assert "/healthz" in stage["HEALTHCHECK"]


def test_dockerfile_cmd_is_a_valid_robez_serve() -> None:
    command = dockerfile_instruction_json("CMD")
    assert command[:2] == ["robez", "serve"]
    args = _parser().parse_args(command[1:])
    settings = _settings_from(args)
    assert settings.host == "0.0.0.0"  # reachable through the published port
    assert settings.data_dir == Path("/data")
    # The HEALTHCHECK probes ROBEZ_PORT, which the image sets to the port the server uses by default.
    image_env = next(args for name, args in final_stage() if name == "ENV")
    assert re.search(r"\bROBEZ_PORT=8000\b", image_env)
    assert Settings.model_fields["port"].default == 8000


def test_dockerfile_installs_cpu_torch_at_the_pinned_version() -> None:
    pins = dict(
        line.split("==")
        for line in (REPO / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    text = (REPO / "Dockerfile").read_text()
    assert f'"torch=={pins["torch"]}+cpu"' in text
    # The default source is PyTorch's CPU index; TORCH_PIP_ARGS replaces it for offline builds.
    assert 'ARG TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"' in text
    assert 'pip install ${TORCH_PIP_ARGS} "torch==' in text
    assert re.search(r"pip install -c constraints\.txt \.", text)


def test_dockerfile_copies_every_package_and_nothing_ignored() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    ignored = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copied: set[str] = set()
    for name, args in dockerfile_instructions():
        if name != "COPY" or args.startswith("--from"):
            continue
        *sources, _ = args.split()
        for source in sources:
            assert (REPO / source).exists(), source
            assert not any(fnmatch.fnmatch(source, pattern) for pattern in ignored), source
            copied.add(source)
    packages = {
        pattern.rstrip("*") for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    assert packages <= copied, packages - copied
    assert {"pyproject.toml", pyproject["project"]["readme"], "constraints.txt"} <= copied
    assert {".venv", ".git", "tests"} <= set(ignored)


def test_tools_ship_neither_in_the_wheel_nor_in_the_image() -> None:
    from setuptools import find_packages

    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    shipped = find_packages(str(REPO), include=include["include"])
    assert {"robez_core", "service"} <= set(shipped)
    tools = ("benchmarks", "devtools", "tests", "loadtest", "quality")
    assert not [name for name in shipped if name.split(".")[0] in tools], shipped
    copied = [args.split()[0] for name, args in dockerfile_instructions() if name == "COPY"]
    assert not [source for source in copied if source.split("/")[0] in tools], copied


def test_compose_serves_port_8000_with_data_volume_and_tables_file() -> None:
    document = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    service = compose_service()
    assert service["build"] == "."
    assert any(str(mapping).endswith(":8000") for mapping in service["ports"])

    mounts = [str(volume).split(":") for volume in service["volumes"]]
    (data_volume,) = [source for source, target, *_ in mounts if target == "/data"]
    assert data_volume in document["volumes"]  # a named volume, declared

    config_path = service["environment"]["ROBEZ_CONFIG"]
    (config_mount,) = [mount for mount in mounts if mount[1] == config_path]
    source, _, mode = config_mount
    assert mode == "ro"
    specs = load_tables_file(REPO / source)
    # The README's first curl call uses the demo table; it must exist in the container too.
    assert specs[DEMO_TABLE_NAME].config == DEMO_TABLE_CONFIG

    # Shared tables live in /dev/shm; Docker's 64 MB default would cap them.
    assert service["shm_size"]


def test_compose_environment_names_real_settings() -> None:
    for name in compose_service()["environment"]:
        assert name.startswith("ROBEZ_")
        assert name.removeprefix("ROBEZ_").lower() in Settings.model_fields, name


def test_offline_build_arguments_match_the_container_test() -> None:
    """`make container-test` (deploy/container_test/, not run in CI) builds with PYTHON_IMAGE and
    TORCH_PIP_ARGS and a wheel in deploy/wheels/: renaming either in the Dockerfile must fail here."""
    script = (REPO / "deploy" / "container_test" / "images.py").read_text()
    instructions = dockerfile_instructions()
    assert instructions[0] == ("ARG", "PYTHON_IMAGE=python:3.11-slim")  # global: usable in every FROM
    assert [args.split()[0] for name, args in instructions if name == "FROM"] == [
        "${PYTHON_IMAGE}",
        "${PYTHON_IMAGE}",
    ]
    assert "PYTHON_IMAGE=" in script and "TORCH_PIP_ARGS=--find-links deploy/wheels" in script
    build_stage = instructions[: [name for name, _ in instructions].index("FROM", 2)]
    assert any(name == "ARG" and args.startswith("TORCH_PIP_ARGS=") for name, args in build_stage)
    assert ("COPY", "deploy/wheels ./deploy/wheels") in build_stage
    assert (REPO / "deploy" / "wheels").is_dir()
    ignored = (REPO / ".dockerignore").read_text().split()
    assert not any(fnmatch.fnmatch("deploy/wheels/torch.whl", pattern) for pattern in ignored)
    assert "/deploy/wheels/*.whl" in (REPO / ".gitignore").read_text().split()
    # --record rewrites the block between these markers.
    deploy_doc = (REPO / "docs" / "deploy.md").read_text()
    assert deploy_doc.count("<!-- container-test summary: begin -->") == 1
    assert deploy_doc.count("<!-- container-test summary: end -->") == 1


# Every product module, imported in a fresh interpreter where ``import matplotlib`` fails: the server's
# dependencies (pyproject's ``dependencies``) must not need the tools' plotting library.
_IMPORT_WITHOUT_MATPLOTLIB = """
import importlib, pkgutil, sys

class NoMatplotlib:
    def find_spec(self, name, path=None, target=None):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("matplotlib is not a dependency of the product")
        return None

sys.meta_path.insert(0, NoMatplotlib())
count = 0
for package in ("robez_core", "service"):
    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        if not info.name.endswith(".__main__"):  # would run the program
            importlib.import_module(info.name)
            count += 1
print("imported", count)
"""


def test_the_product_imports_without_matplotlib() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    runtime = [
        re.split(r"[\[<>=;\s]", requirement)[0].lower()
        for requirement in pyproject["project"]["dependencies"]
    ]
    assert "matplotlib" not in runtime
    extras = pyproject["project"]["optional-dependencies"]
    assert any(r.startswith("matplotlib") for r in extras["loadtest"])
    assert any(r.startswith("matplotlib") for r in extras["quality"])
    assert "robez[loadtest,quality]" in extras["dev"]  # make setup still installs the tools' needs
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_WITHOUT_MATPLOTLIB],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # the walk found the modules (not a vacuous pass)
    assert int(done.stdout.split()[-1]) > 50, done.stdout[-3000:]
