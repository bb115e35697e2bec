"""End to end: a real ``robez serve`` subprocess, the online-training example against it, and the
Dockerfile's HEALTHCHECK command probing it."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.client import RobezClient

from .subprocess_server import RobezServer, free_port
from .test_packaging import dockerfile_instruction_json

REPO = Path(__file__).resolve().parents[2]
# The installed console script, as a user runs it (``python -m service`` is the same entry point).
ROBEZ_SCRIPT = Path(sys.executable).with_name("robez")
ROBEZ = [str(ROBEZ_SCRIPT)] if ROBEZ_SCRIPT.exists() else [sys.executable, "-m", "service"]


def clean_env(**extra: str) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("ROBEZ_")}
    return {**env, **extra}


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One server for the module: the example makes its own tables (prefix ``e2e_``), the healthcheck
    only reads."""
    tmp_path = tmp_path_factory.mktemp("online-server")
    (tmp_path / "shm").mkdir()
    server = RobezServer(
        tmp_path / "server.log",
        ["--host", "127.0.0.1", "--log-level", "warning"],
        {"ROBEZ_SHM_DIR": str(tmp_path / "shm")},
        program=ROBEZ,
        cwd=tmp_path,
    )
    try:
        server.start()
        yield server.url
    finally:
        server.stop()


@pytest.mark.slow
def test_online_training_example_loss_falls(server_url: str, tmp_path: Path) -> None:
    history_path = tmp_path / "history.json"
    plot_path = tmp_path / "loss.png"
    steps = 60
    command = [
        sys.executable,
        str(REPO / "examples" / "online_training.py"),
        "--url", server_url,
        "--steps", str(steps),
        "--eval-every", "30",
        "--samples", "20000",
        "--table-prefix", "e2e_",
        "--history", str(history_path),
        "--plot", str(plot_path),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=clean_env(), cwd=REPO)
    assert result.returncode == 0, f"{shlex.join(command)}\n{result.stdout}\n{result.stderr}"
    assert result.stdout.count("step ") >= steps  # progress printed every step

    history = json.loads(history_path.read_text())
    assert len(history["train_loss"]) == steps
    first, last = history["eval_loss"][0], history["eval_loss"][-1]
    assert 0.68 < first < 0.71  # a fresh table knows nothing: ~ln 2
    assert last < first - 0.03, history["eval_loss"]
    assert sum(history["train_loss"][-10:]) < sum(history["train_loss"][:10])
    assert plot_path.stat().st_size > 10_000

    # Every step pushed exactly once per table, and the server counted it.
    client = RobezClient(server_url)
    assert client.table("e2e_users")["version"] == steps
    assert client.table("e2e_items")["version"] == steps
    assert client.table("e2e_users")["optimizer"]["name"] == "adagrad"

    # Run again without --reset: the tables are reused and training goes on from where it was.
    rerun = subprocess.run(
        [*command[:-4], "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(),
        cwd=REPO,
    )
    assert rerun.returncode == 0, rerun.stderr
    assert client.table("e2e_users")["version"] == steps + 1


@pytest.mark.slow
def test_dockerfile_healthcheck_probes_a_live_server(server_url: str) -> None:
    """The image's HEALTHCHECK command, run here: 0 against a live server, non-zero against no server."""
    healthcheck = dockerfile_instruction_json("HEALTHCHECK")
    assert healthcheck[:2] == ["python", "-c"]
    probe = [sys.executable, "-c", healthcheck[2]]
    port = server_url.rsplit(":", 1)[1]
    assert subprocess.run(probe, env=clean_env(ROBEZ_PORT=port), timeout=30).returncode == 0
    closed = subprocess.run(
        probe, env=clean_env(ROBEZ_PORT=str(free_port())), timeout=30, capture_output=True
    )
    assert closed.returncode != 0
