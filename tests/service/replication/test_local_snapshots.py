"""A replica's own snapshots in its data directory (``--nats ... --data-dir``, localsnap.py): restart from
the local snapshot after kill -9, fall back to the Object Store and the log when the file is corrupted,
and the two data-directory layouts (replica, single server) refuse each other."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devtools.natscluster import NatsCluster
from robez_core.config import TableConfig
from robez_core.table import Table
from service import cli
from service.full_import import table_bytes
from service.replication.localsnap import MARKER_FILE, SNAPSHOT_DIR

from .conftest import REPO, ReplicaServer, create_table, replay_checksum
from .test_replicas import assert_converged, push

pytestmark = pytest.mark.slow


def local_snapshots(data_dir: Path, table: str) -> list[Path]:
    return sorted((data_dir / SNAPSHOT_DIR).glob(f"{table}.*.safetensors"))


def wait_for_log(server: ReplicaServer, text: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in server.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"{server.name} never logged {text!r}:\n{server.log()}"
        time.sleep(0.1)


def test_restart_from_the_local_snapshot_and_fall_back_when_it_is_corrupted(
    nats_cluster: NatsCluster, tmp_path: Path
) -> None:
    data_dir = tmp_path / "b-data"
    other = ReplicaServer("la", nats_cluster, tmp_path, "local").start()
    local = ReplicaServer(
        "lb",
        nats_cluster,
        tmp_path,
        "local",
        ROBEZ_DATA_DIR=data_dir,
        ROBEZ_REPLICA_LOCAL_SNAPSHOT_EVERY_UPDATES=5,
    ).start()
    try:
        other.wait_ready()
        local.wait_ready()
        table = "loc"
        create_table(other, table)
        for seed in range(12):
            assert push(other, table, seed).status_code == 200
        local.wait_version(table, 12)
        wait_for_log(local, "local snapshot at version 10 written")
        local.kill()
        files = local_snapshots(data_dir, table)
        assert len(files) == 1 and files[0].name.endswith(".000000000010.safetensors"), files
        for seed in range(12, 15):
            assert push(other, table, seed).status_code == 200

        local.start().wait_ready()
        assert "bootstrapped from the local snapshot at version 10" in local.log_path.read_text()
        assert_converged([other, local], table, 15, replay_checksum(list(range(15))))
        assert local.checksum(table) == other.checksum(table)

        local.stop()  # clean stop: a local snapshot of the updates since the last one (at 15)
        files = local_snapshots(data_dir, table)
        assert len(files) == 1 and files[0].name.endswith(".000000000015.safetensors"), files
        data = bytearray(files[0].read_bytes())
        middle = len(data) // 2
        data[middle : middle + 64] = bytes(64 - i for i in range(64))
        files[0].write_bytes(bytes(data))
        for seed in range(15, 17):
            assert push(other, table, seed).status_code == 200

        local.start().wait_ready()
        text = local.log_path.read_text()
        assert f"the local snapshot {files[0]} is unusable" in text, local.log()
        assert_converged([other, local], table, 17, replay_checksum(list(range(17))))
    finally:
        other.stop()
        local.stop()


def run_serve(*args: str, data_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("ROBEZ_")}
    env["PYTHONPATH"] = str(REPO)
    command = [sys.executable, "-m", "service", "serve", "--port", "1", "--data-dir", str(data_dir), *args]
    return subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=60)


def test_replica_and_single_server_data_dirs_refuse_each_other(tmp_path: Path) -> None:
    single = tmp_path / "single"
    (single / "demo").mkdir(parents=True)  # a single server's table directory
    (single / "demo" / "meta.json").write_text("{}")
    result = run_serve("--nats", "nats://127.0.0.1:1", data_dir=single)
    assert result.returncode != 0
    assert "holds a single server's tables (demo)" in result.stderr + result.stdout
    assert not (single / MARKER_FILE).exists()

    replica = tmp_path / "replica"
    (replica / SNAPSHOT_DIR).mkdir(parents=True)
    (replica / MARKER_FILE).write_text("robez replica data directory\n")
    result = run_serve(data_dir=replica)
    assert result.returncode != 0
    assert "is a replica's (--nats)" in result.stderr + result.stdout
    assert sorted(path.name for path in replica.iterdir()) == sorted([MARKER_FILE, SNAPSHOT_DIR])


@pytest.mark.parametrize("command", [["snapshot"], ["import", "CHECKPOINT", "--table", "t"]])
def test_offline_commands_refuse_a_replica_data_dir(tmp_path: Path, command: list[str]) -> None:
    """``robez snapshot`` / ``robez import`` are single-server tools: on a replica's directory they stop
    with exit status 2 before reading or writing anything there."""
    checkpoint = tmp_path / "table.safetensors"  # a valid checkpoint: only the directory is wrong
    checkpoint.write_bytes(table_bytes(Table(TableConfig(100, 8, memory_size=64, chunk_size=4))))
    command = [str(checkpoint) if part == "CHECKPOINT" else part for part in command]
    replica = tmp_path / "replica"
    (replica / SNAPSHOT_DIR).mkdir(parents=True)
    (replica / MARKER_FILE).write_text("robez replica data directory\n")
    assert cli.main([*command, "--data-dir", str(replica)]) == 2
    assert sorted(path.name for path in replica.iterdir()) == sorted([MARKER_FILE, SNAPSHOT_DIR])
