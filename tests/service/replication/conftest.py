"""Fixtures for replication tests: real NATS JetStream clusters on loopback (one shared by the package,
private ones for faults), and robez replicas as real ``python -m service serve --nats ...`` processes.
Everything is stopped by pid."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
import torch

from devtools.natscluster import NatsCluster, free_ports
from loadtest.launch import RobezProcess
from robez_core.config import OptimizerConfig, TableConfig
from robez_core.table import Table
from service.log.state_digest import digest_of_table

REPO = Path(__file__).resolve().parents[3]
SMALL = {"num_embeddings": 1000, "embedding_dim": 8, "memory_size": 4096, "chunk_size": 4}
ADAM = {"name": "adam", "lr": 0.01}
START_TIMEOUT_S = 90.0


@contextlib.contextmanager
def running_cluster(directory: Path, size: int, **options: Any) -> Iterator[NatsCluster]:
    """A ``size``-node JetStream cluster with its stores under ``directory`` (``options``: the other
    ``NatsCluster`` fields, e.g. ``max_payload``), stopped on leaving."""
    cluster = NatsCluster(directory, size=size, **options)
    try:
        cluster.start()
        cluster.wait_for_jetstream()
        yield cluster
    finally:
        cluster.stop()


# One secured 3-node cluster for the replication tests (package scope: stopped when the last of them
# ends, so its nodes and replicas do not idle beside the rest of the suite), shared by every module that
# leaves its nodes alone: each keeps to its own NATS prefix (its own streams and buckets) and table names.
# Private clusters remain for what changes the nodes themselves: kill -9 or SIGSTOP of a node
# (``replicas_nats``), a secured cluster with a narrowed prefix (test_nats_security.py), a small
# max_payload (test_scale_health.py).
@pytest.fixture(scope="package")
def shared_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    with running_cluster(tmp_path_factory.mktemp("nats-shared"), 3) as cluster:
        yield cluster


@pytest.fixture(scope="package")
def nats_cluster(shared_nats: NatsCluster) -> NatsCluster:
    """The shared cluster (the name the modules have always used)."""
    return shared_nats


@pytest.fixture(scope="package")
def single_nats(shared_nats: NatsCluster) -> NatsCluster:
    """Where tests of ``JetStreamLog`` alone (streams of one replica, ``replicas=1``) run: the shared
    cluster too, each test under its own prefix."""
    return shared_nats


@pytest.fixture(scope="package")
def replicas_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    """The cluster of ``replicas``, private to the tests that use that pair: some of them kill -9 or
    freeze its nodes (and restart or thaw them before they end), which no other module's streams should
    live through."""
    with running_cluster(tmp_path_factory.mktemp("nats-replicas"), 3) as cluster:
        yield cluster


class ReplicaServer(RobezProcess):
    """One ``robez serve --nats`` process (1 worker, 1 kernel thread) on a loopback port it keeps across
    restarts (``loadtest.launch.RobezProcess``; ``start`` only spawns it: start several, then
    ``wait_ready`` each)."""

    def __init__(self, name: str, cluster: NatsCluster, workdir: Path, prefix: str, **env: Any) -> None:
        self.name = name
        self.cluster = cluster
        self.workdir = workdir / name
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        super().__init__(
            ["--nats", ",".join(cluster.urls), "--replica-name", name],
            {
                "ROBEZ_SHM_DIR": str(self.workdir / "shm"),
                "ROBEZ_THREADS_PER_WORKER": "1",
                "ROBEZ_DEFAULT_TABLE": "false",
                "ROBEZ_NATS_PREFIX": prefix,
                "ROBEZ_LOG_LEVEL": "info",
                "PYTHONPATH": str(REPO),
                **cluster.robez_env(),
                **{key: str(value) for key, value in env.items()},
            },
            log_path=self.workdir / "server.log",
            port=free_ports(1)[0],
            cwd=REPO,
        )

    def start(self) -> ReplicaServer:  # type: ignore[override]
        """Spawn the process; ``wait_ready`` waits for it."""
        self.spawn()
        return self

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S, **_: Any) -> ReplicaServer:
        super().wait_ready(timeout_s, interval_s=0.1)
        return self

    def stop(self, timeout_s: float = 15.0) -> None:
        super().stop(timeout_s)

    def log(self) -> str:
        """The log's last 4000 characters (what an assertion message shows)."""
        return self.log_tail(4000)

    def checksum(self, table: str) -> dict[str, Any]:
        response = self.http.get(f"{self.url}/v1/tables/{table}/checksum")
        assert response.status_code == 200, response.text
        return dict(response.json())

    def version(self, table: str) -> int:
        response = self.http.get(f"{self.url}/v1/tables/{table}")
        assert response.status_code == 200, response.text
        return int(response.json()["version"])

    def wait_version(self, table: str, version: int, timeout_s: float = 30.0) -> None:
        """Until this replica has ``table`` at ``version`` or later; a table it has not made yet (404: its
        creation not applied here yet) is waited for too."""
        deadline = time.monotonic() + timeout_s
        while True:
            response = self.http.get(f"{self.url}/v1/tables/{table}")
            assert response.status_code in (200, 404), response.text
            if response.status_code == 200 and int(response.json()["version"]) >= version:
                return
            assert time.monotonic() < deadline, f"{self.name} stuck below version {version}:\n{self.log()}"
            time.sleep(0.05)


@pytest.fixture(scope="package")
def replicas(
    replicas_nats: NatsCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[ReplicaServer]]:
    """Two replicas on ``replicas_nats`` (prefix ``t``) for every module here: tests create their own
    tables on them (names unique across the modules that use them) and restart what they kill."""
    workdir = tmp_path_factory.mktemp("replicas")
    with running_replicas(
        [ReplicaServer(name, replicas_nats, workdir, "t") for name in ("a", "b")]
    ) as servers:
        yield servers


@contextlib.contextmanager
def running_replicas(servers: list[ReplicaServer]) -> Iterator[list[ReplicaServer]]:
    """``servers`` started (all at once, then each waited for) and stopped again by pid, whatever happens."""
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.stop()


def create_table(server: ReplicaServer, name: str, optimizer: dict[str, Any] | None = None) -> None:
    payload = {"name": name, "config": SMALL, "optimizer": optimizer or ADAM}
    response = httpx.post(f"{server.url}/v1/tables", json=payload, timeout=30)
    assert response.status_code == 201, response.text


def push_grads(seed: int, rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic push: ids and float32 gradients that a test can regenerate from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SMALL["num_embeddings"], (rows,), generator=generator)
    grads = torch.randn(rows, SMALL["embedding_dim"], generator=generator)
    return ids, grads


def replay_checksum(pushes_in_order: list[int], optimizer: dict[str, Any] | None = None) -> str:
    """The checksum a table must have after the pushes (by seed) in this order, from a private Table:
    what every replica computes independently, byte for byte."""
    table = Table(TableConfig.from_dict(SMALL), OptimizerConfig.from_dict(optimizer or ADAM))
    for seed in pushes_in_order:
        ids, grads = push_grads(seed)
        table.apply_gradients(ids, grads)
    return digest_of_table(table)


def stream_leader(cluster: NatsCluster, prefix: str, table: str) -> str:
    """Name of the NATS node leading the stream of ``table`` (current incarnation)."""

    async def find() -> str:
        nc = await nats.connect(servers=cluster.urls, **cluster.connect_options())
        try:
            js = nc.jetstream(timeout=5)
            for info in await js.streams_info():
                name = info.config.name
                if name is not None and name.startswith(f"{prefix}_{table}_") and info.cluster is not None:
                    return str(info.cluster.leader)
        finally:
            await nc.close()
        raise AssertionError(f"no stream for table {table}")

    return asyncio.run(find())


def stream_bounds(cluster: NatsCluster, prefix: str, table: str) -> tuple[int, int]:
    async def bounds() -> tuple[int, int]:
        nc = await nats.connect(servers=cluster.urls, **cluster.connect_options())
        try:
            js = nc.jetstream(timeout=5)
            for info in await js.streams_info():
                name = info.config.name
                if name is not None and name.startswith(f"{prefix}_{table}_"):
                    return int(info.state.first_seq), int(info.state.last_seq)
        finally:
            await nc.close()
        raise AssertionError(f"no stream for table {table}")

    return asyncio.run(bounds())
