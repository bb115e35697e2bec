"""A full data directory on a real small file system (an 8 MiB tmpfs): every write is refused with the
same 507 naming the data directory, nothing is applied, lookups go on, and writes work again once space
is freed; a kill -9 afterwards recovers exactly the acknowledged updates.

Mounting needs root (CI runs as root); where ``mount -t tmpfs`` fails the test is skipped, saying why.
"""

from __future__ import annotations

import errno
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from .subprocess_server import RobezServer

pytestmark = pytest.mark.slow

FS_BYTES = 8 << 20
DIM = 64  # the demo table
IDS = np.arange(256, dtype="<i8") * 7919  # a 256-id push: a 67,628-byte log record
LOOKUP_IDS = np.array([0, 1, 2, 3, 5000, 9_999_999], dtype="<i8").tobytes()


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mount_point = tmp_path / "small-fs"
    mount_point.mkdir()
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs", str(mount_point)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        pytest.skip(f"cannot run mount here ({error}); this test needs a small real file system")
    if mounted.returncode != 0:
        pytest.skip(
            f"`mount -t tmpfs` failed ({mounted.stderr.strip() or mounted.returncode}): mounting needs root; "
            "this test needs a small real file system"
        )
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, timeout=30)


def _fill(directory: Path) -> Path:
    """Write zeros into one file until the file system refuses (ENOSPC); returns the file."""
    filler = directory / "filler"
    chunk = b"\0" * (64 << 10)
    with open(filler, "wb") as handle:
        try:
            for _ in range(2 * FS_BYTES // len(chunk)):
                handle.write(chunk)
                handle.flush()
        except OSError as error:
            assert error.errno == errno.ENOSPC, error
        else:
            raise AssertionError("the small file system never filled up")
    return filler


def _push_binary(client: httpx.Client, scale: float) -> httpx.Response:
    grads = np.full((IDS.size, DIM), scale, dtype="<f4")
    return client.post(
        "/v1/tables/demo/update",
        content=IDS.tobytes() + grads.tobytes(),
        headers={"content-type": "application/octet-stream", "x-robez-shape": f"{IDS.size},{DIM}"},
    )


def _push_json(client: httpx.Client) -> httpx.Response:
    ids = [int(i) for i in IDS[:64]]  # 64 ids: a 16,940-byte record, more than a page of slack
    return client.post("/v1/tables/demo/update", json={"ids": ids, "grads": [[0.25] * DIM] * len(ids)})


def _state(client: httpx.Client) -> tuple[int, bytes]:
    response = client.post(
        "/v1/tables/demo/lookup", content=LOOKUP_IDS, headers={"content-type": "application/octet-stream"}
    )
    assert response.status_code == 200, response.text
    return int(response.headers["x-robez-version"]), response.content


def _storage_full_count(client: httpx.Client) -> float:
    match = re.search(r"^robez_storage_full_total (\S+)$", client.get("/metrics").text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_a_full_data_directory_refuses_writes_with_507_and_recovers(tmp_path: Path, small_fs: Path) -> None:
    data_dir = small_fs / "data"
    server = RobezServer(
        tmp_path / "server.log",
        ["--data-dir", str(data_dir)],
        {"ROBEZ_SHM_DIR": str(tmp_path / "shm"), "ROBEZ_LOG_LEVEL": "warning"},
    )
    server.start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert _push_binary(client, 0.5).status_code == 200
            before = _state(client)
            assert before[0] == 1
            filler = _fill(small_fs)

            refused = [_push_binary(client, 1.0) for _ in range(4)] + [_push_json(client) for _ in range(2)]
            refused.append(client.post("/v1/tables/demo/snapshot"))  # a 1 MiB snapshot does not fit either
            new_table = {"num_embeddings": 1000, "embedding_dim": 8, "memory_size": 1 << 16, "chunk_size": 4}
            refused.append(client.post("/v1/tables", json={"name": "fresh", "config": new_table}))
            for response in refused:
                assert response.status_code == 507, response.text
                body = response.json()
                assert body["error_type"] == "StorageFullError"
                assert str(data_dir) in body["error"] and "nothing was applied" in body["error"]
            assert _state(client) == before  # nothing applied, lookups still served
            assert client.get("/v1/tables/fresh").status_code == 404
            assert _storage_full_count(client) == len(refused)

            ready = client.get("/readyz")
            assert ready.status_code == 200 and ready.json()["writable"] is False
            assert str(data_dir) in ready.json()["write_problem"]
            assert client.get("/readyz", params={"writes": "true"}).status_code == 503

            filler.unlink()
            assert client.get("/readyz", params={"writes": "true"}).status_code == 200
            assert _push_binary(client, 1.0).status_code == 200
            after = _state(client)
            assert after[0] == 2 and after[1] != before[1]
        server.kill()  # kill -9: the restart must hold exactly the acknowledged updates
        server.start()
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert _state(client) == after
    finally:
        server.stop()
    log = server.log()
    assert "507 on POST /v1/tables/demo/update" in log and str(data_dir) in log
    assert "Traceback" not in log and "Exception in ASGI application" not in log
