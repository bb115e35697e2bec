"""A real `robez serve --workers 2`: an update through one connection is seen through both workers, and
the table's memory is one shared mapping, not one copy per worker."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from service.faults import SLOW_VARIABLE
from service.store import TableStore
from service.wal import WalJournal

from .conftest import make_settings
from .subprocess_server import RobezServer, worker_pids

pytestmark = pytest.mark.slow

MAX_FRESH_CONNECTIONS = 400


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RobezServer]:
    # Two kernel threads a worker: the workers are forks of a process that imported the kernels, and each
    # runs numba's OpenMP pool of its own (the warm-up's parallel lookup at start, the lookups below).
    env = {
        "ROBEZ_SHM_DIR": str(tmp_path / "shm"),
        "ROBEZ_LOG_LEVEL": "warning",
        "ROBEZ_THREADS_PER_WORKER": "2",
    }
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
    the shared tables must still be removed (docker stop sends SIGTERM), and the exit status is 0, as
    with several workers (it was 143, 128 + SIGTERM, issue 36)."""
    shm_dir = tmp_path / "shm"
    server = RobezServer(
        tmp_path / "server.log", [], {"ROBEZ_SHM_DIR": str(shm_dir), "ROBEZ_LOG_LEVEL": "warning"}
    )
    try:
        server.start()
        (directory,) = shm_dir.glob("robez-*")
        assert server.terminate() == 0
        assert not directory.exists(), "shared memory left behind after SIGTERM"
    finally:
        server.stop()


def _data_dir_with_table(tmp_path: Path, memory_size: int) -> Path:
    """A data directory holding one adagrad table ``big`` (weight and state: 8 x ``memory_size`` bytes),
    written by a start with a tables file naming it."""
    data_dir = tmp_path / "data"
    tables = tmp_path / "tables.toml"
    tables.write_text(
        f"[tables.big]\nnum_embeddings = 1000\nembedding_dim = 16\nmemory_size = {memory_size}\n"
        '[tables.big.optimizer]\nname = "adagrad"\n'
    )
    settings = make_settings(tmp_path, data_dir=data_dir, config=tables)
    journal = WalJournal.from_settings(settings)
    try:
        TableStore.prepare(settings, journal).remove()
    finally:
        journal.close()
    return data_dir


def _fork_servers(pid: int) -> list[int]:
    """The fork server of the supervisor ``pid`` (its child running multiprocessing's ``forkserver``)."""
    found = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        with contextlib.suppress(OSError):
            if b"forkserver" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(int(child))
    return found


def _live_in_group(group: int) -> list[int]:
    """Pids of the processes of process group ``group`` still running (not zombies: a process the
    exited server left to init to reap holds nothing)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _parent, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(pgrp) == group and state != "Z":
            live.append(int(stat.parent.name))
    return live


def _maps_torch(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.timeout(240)
def test_the_app_is_imported_while_the_tables_load_and_workers_are_forks_of_it(tmp_path: Path) -> None:
    """A restart's cost is the load, not the load plus the workers' start-up: the fork server has imported
    torch (the app) while the supervisor is still reading the table (made slow by the test hook, 1.5 s
    per 16 MiB); the two workers are its forks, started once the table is loaded, and serve it."""
    data_dir = _data_dir_with_table(tmp_path, 1 << 22)  # 32 MiB: two slow pieces
    server = RobezServer(
        tmp_path / "server.log",
        ["--workers", "2", "--data-dir", str(data_dir)],
        {
            "ROBEZ_SHM_DIR": str(tmp_path / "shm"),
            "ROBEZ_LOG_LEVEL": "info",
            "ROBEZ_DEFAULT_TABLE": "false",
            SLOW_VARIABLE: "1.5",
        },
    )
    ready = threading.Thread(target=server.start)
    ready.start()
    try:
        seen_during_load: set[int] = set()
        deadline = time.monotonic() + 180
        while "loaded table big" not in (server.log() if server.log_path.exists() else ""):
            assert time.monotonic() < deadline and ready.is_alive(), server.log()
            if server.process is not None:
                seen_during_load |= {pid for pid in _fork_servers(server.process.pid) if _maps_torch(pid)}
            time.sleep(0.05)
        assert len(seen_during_load) == 1, f"fork servers with torch during the load: {seen_during_load}"
        ready.join(timeout=180)
        assert server.process is not None
        workers = worker_pids(server.process.pid)
        assert len(workers) == 2, workers
        for worker in workers:  # forks of the fork server: its parent, and torch without a new import
            parent = int(Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[1])
            assert parent in seen_during_load and _maps_torch(worker)
        response = httpx.post(f"{server.url}/v1/tables/big/lookup", json={"ids": [1, 2]}, timeout=30)
        assert response.status_code == 200, response.text
    finally:
        ready.join(timeout=180)
        server.stop()


def test_a_failed_load_stops_the_workers_started_meanwhile(tmp_path: Path) -> None:
    """A snapshot that fails its checksum at start: the server exits 2 naming it, and leaves neither the
    workers it started while loading nor its shared memory behind."""
    data_dir = _data_dir_with_table(tmp_path, 1 << 16)
    (snapshot,) = (data_dir / "big").glob("snapshot-*.safetensors")
    data = bytearray(snapshot.read_bytes())
    data[len(data) // 2] ^= 0xFF
    snapshot.write_bytes(bytes(data))
    shm_dir = tmp_path / "shm"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROBEZ_")}
    env.update(ROBEZ_SHM_DIR=str(shm_dir), ROBEZ_DEFAULT_TABLE="false", ROBEZ_THREADS_PER_WORKER="1")
    serve = [sys.executable, "-m", "service", "serve", "--workers", "2", "--port", "0"]
    process = subprocess.Popen(
        [*serve, "--data-dir", str(data_dir)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 2, output.decode(errors="replace")
    assert b"fails its checksum" in output and snapshot.name.encode() in output
    # multiprocessing's resource tracker ends when it sees the server gone: allow it a moment.
    deadline = time.monotonic() + 10
    while _live_in_group(process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _live_in_group(process.pid), "processes of the server left running"
    assert not list(shm_dir.glob("robez-*")), "shared memory left behind"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_workers_die_with_their_fork_server_and_a_group_sigterm_stops_them_gracefully(tmp_path: Path) -> None:
    """A fork server killed (-9) takes its workers along (none left serving unsupervised): the supervisor
    starts two new ones from a new fork server, which serve. Then a SIGTERM to the whole process group (what
    systemd or a terminal sends) is a graceful stop: the fork server ignores it, each worker finishes its
    shutdown, the server exits 0, and nothing of it is left running."""
    server = RobezServer(
        tmp_path / "server.log",
        ["--workers", "2"],
        {"ROBEZ_SHM_DIR": str(tmp_path / "shm"), "ROBEZ_LOG_LEVEL": "info"},
    )
    server.start()
    try:
        assert server.process is not None
        pid = server.process.pid
        old_workers = worker_pids(pid)
        (old_fork_server,) = _fork_servers(pid)
        assert len(old_workers) == 2, old_workers
        os.kill(old_fork_server, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            new_workers = set(worker_pids(pid)) - set(old_workers)
            gone = not any(_alive(worker) for worker in old_workers)
            if gone and len(new_workers) == 2:
                break
            assert time.monotonic() < deadline, f"old alive: {gone=}, new: {new_workers}\n{server.log_tail()}"
            time.sleep(0.05)
        while (
            httpx.post(f"{server.url}/v1/tables/demo/lookup", json={"ids": [1]}, timeout=30).status_code
            != 200
        ):
            assert time.monotonic() < deadline, server.log_tail()
            time.sleep(0.1)
        os.killpg(pid, signal.SIGTERM)
        assert server.process.wait(timeout=60) == 0, server.log_tail()
        for worker in new_workers:
            assert f"Finished server process [{worker}]" in server.log(), server.log_tail()
        deadline = time.monotonic() + 10
        while _live_in_group(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _live_in_group(pid), "processes of the server left running"
    finally:
        server.stop()
    assert "Traceback" not in server.log()
