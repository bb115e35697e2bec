"""End to end: ``examples/online_training_collection.py`` against a real ``robez serve`` subprocess: the
held-out loss falls, every step costs two requests, and each table's version counts one push a step.
Both runs share one server (the example's ``--reset`` recreates its tables: fresh embeddings, version 0)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.client import RobezClient

from .subprocess_server import RobezServer
from .test_online_training import ROBEZ, clean_env

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp_path = tmp_path_factory.mktemp("collection-example")
    (tmp_path / "shm").mkdir()
    server = RobezServer(
        tmp_path / "server.log",
        ["--host", "127.0.0.1", "--log-level", "warning"],
        {"ROBEZ_SHM_DIR": str(tmp_path / "shm"), "ROBEZ_THREADS_PER_WORKER": "1"},
        program=ROBEZ,
        cwd=tmp_path,
    )
    try:
        server.start()
        yield server.url
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", [False, True])
def test_collection_example_trains_through_two_requests_a_step(server_url: str, prefetch: bool) -> None:
    steps = 60
    command = [
        sys.executable, str(REPO / "examples" / "online_training_collection.py"),
        "--url", server_url, "--steps", str(steps), "--features", "4", "--batch-size", "256", "--reset",
        *(["--prefetch"] if prefetch else []),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=clean_env(), cwd=REPO)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    lines = result.stdout.splitlines()
    losses = next(line for line in lines if line.startswith("held-out loss")).split()
    first, last = float(losses[2]), float(losses[4])
    assert last < first - 0.02, result.stdout
    assert "2.00 requests a step" in result.stdout
    client = RobezClient(server_url)
    assert [client.table(f"ctr_t{i}")["version"] for i in range(4)] == [steps] * 4
    assert len({client.table(f"ctr_t{i}")["array"] for i in range(4)}) == 1  # one shared array
