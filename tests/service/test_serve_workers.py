"""A real `robez serve --workers 2`: an update through one connection is seen through both workers, and
the table's memory is one shared mapping, not one copy per worker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from .subprocess_server import RobezServer

pytestmark = pytest.mark.slow

MAX_FRESH_CONNECTIONS = 400


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RobezServer]:
    env = {"ROBEZ_SHM_DIR": str(tmp_path / "shm"), "ROBEZ_LOG_LEVEL": "warning"}
    server = RobezServer(tmp_path / "server.log", ["--workers", "2"], env)
    try:
        server.start()
        yield server
    finally:
        server.stop()


def lookup_on_fresh_connection(url: str, ids: bytes) -> tuple[int, int, bytes]:
    """(worker pid, version, rows) from one new connection: /healthz then the lookup on the same socket,
    so both are answered by the worker that accepted it."""
    with httpx.Client(base_url=url, timeout=30) as client:
        pid = int(client.get("/healthz").json()["pid"])
        response = client.post(
            "/v1/tables/demo/lookup", content=ids, headers={"content-type": "application/octet-stream"}
        )
        assert response.status_code == 200, response.text
        return pid, int(response.headers["x-robez-version"]), response.content


def mapping_of(pid: int, path: Path) -> dict[str, int]:
    """The smaps fields (kB) of ``pid``'s mapping of ``path``, and its inode; {} if not mapped."""
    fields: dict[str, int] = {}
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 5 and "-" in parts[0] and ":" in parts[3]:  # a mapping header line
            inside = line.endswith(str(path))
            if inside:
                fields["inode"] = int(parts[4])
                fields["shared_mapping"] = int("s" in parts[1])
        elif inside and parts and parts[0].endswith(":") and len(parts) >= 2 and parts[1].isdigit():
            fields[parts[0][:-1]] = int(parts[1])
    return fields


def test_two_workers_share_tables_and_see_each_others_updates(server: RobezServer, tmp_path: Path) -> None:
    url, shm_dir = server.url, tmp_path / "shm"
    ids = np.array([1, 2, 3, 10_000_000], dtype="<i8").tobytes()
    _, version_before, rows_before = lookup_on_fresh_connection(url, ids)
    assert version_before == 0

    with httpx.Client(base_url=url, timeout=30) as writer:
        grads = np.ones((4, 64), dtype="<f4")
        update = writer.post(
            "/v1/tables/demo/update",
            content=ids + grads.tobytes(),
            headers={"content-type": "application/octet-stream", "x-robez-shape": "4,64"},
        )
        assert update.status_code == 200, update.text
        assert update.json()["version"] == 1
        rows_after = writer.post(
            "/v1/tables/demo/lookup", content=ids, headers={"content-type": "application/octet-stream"}
        ).content
    assert rows_after != rows_before

    seen: dict[int, int] = {}
    for _ in range(MAX_FRESH_CONNECTIONS):
        pid, version, rows = lookup_on_fresh_connection(url, ids)
        assert version == 1
        assert rows == rows_after, f"worker {pid} served stale rows"
        seen[pid] = seen.get(pid, 0) + 1
        if len(seen) == 2 and min(seen.values()) >= 5:
            break
    assert len(seen) == 2, f"only worker(s) {sorted(seen)} answered {MAX_FRESH_CONNECTIONS} fresh connections"

    # /metrics through any worker counts every worker's lookups: 1 before, 1 after the update, the rest.
    lookups = 2 + sum(seen.values())
    for _ in range(2):
        text = httpx.get(f"{url}/metrics", timeout=30).text
        assert f'robez_lookup_seconds_count{{table="demo"}} {float(lookups)}' in text

    # One copy of the table: one weight file of m float32 values, mapped MAP_SHARED by both workers.
    # smaps' Private_* / Pss count pages of a shared mapping that only this process has touched *so
    # far* (they depend on which worker served which request), so they are not asserted. The property
    # is: the same inode, mapped shared ("s"), no anonymous (copy-on-write) pages in that mapping, and
    # the pages both workers read are the same physical pages (counted in both processes' Shared_*).
    (directory,) = shm_dir.glob("robez-*")
    (weight_file,) = (directory / "arrays").glob("*.weight")
    assert weight_file.stat().st_size == 262_144 * 4
    mappings = [mapping_of(pid, weight_file) for pid in seen]
    for pid, mapping in zip(seen, mappings, strict=True):
        assert mapping, f"worker {pid} does not map {weight_file}"
        assert mapping["shared_mapping"] == 1, f"worker {pid} maps the table privately"
        assert mapping["inode"] == weight_file.stat().st_ino
        assert mapping["Anonymous"] == 0, f"worker {pid} holds a copy-on-write copy of table pages"
        assert mapping["Shared_Clean"] + mapping["Shared_Dirty"] > 0, f"worker {pid} shares no page"

    assert server.terminate() == 0
    assert not directory.exists(), "shared memory left behind after shutdown"


def test_one_worker_removes_shared_tables_on_sigterm(tmp_path: Path) -> None:
    """With one worker uvicorn runs in the serve process and re-raises SIGTERM after its shutdown;
    the shared tables must still be removed (docker stop sends SIGTERM)."""
    shm_dir = tmp_path / "shm"
    server = RobezServer(
        tmp_path / "server.log", [], {"ROBEZ_SHM_DIR": str(shm_dir), "ROBEZ_LOG_LEVEL": "warning"}
    )
    try:
        server.start()
        (directory,) = shm_dir.glob("robez-*")
        server.terminate()
        assert not directory.exists(), "shared memory left behind after SIGTERM"
    finally:
        server.stop()
