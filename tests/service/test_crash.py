"""kill -9 a real ``robez serve --data-dir`` while a client streams updates; restart; compare bitwise.

The oracle applies exactly the acknowledged updates (in the order of the versions the server answered)
to the table as it was created. The one update in flight when the server died may or may not have
been made durable: the recovered table must equal the oracle either without it or with it, nothing else.
Periodic snapshots every few updates make some kills land around a snapshot too.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from torch import Tensor

from robez_core.config import OptimizerConfig, TableConfig
from robez_core.table import Table
from service.store.journal import UpdateRecord
from service.wal import LOG_FILE, WalJournal

from .subprocess_server import RobezServer, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

DIM = 8
TABLE = {
    "name": "t",
    "config": {"num_embeddings": 100_000, "embedding_dim": DIM, "memory_size": 4096, "chunk_size": 4},
    "optimizer": {"name": "adam", "lr": 0.01},
}
# Three kills with one worker; two with two (each restart of two workers costs ~15 s on a busy 2-core box).
KILLS = {1: 3, 2: 2}
STARTUP_SECONDS = 90.0
ROBEZ = [sys.executable, "-m", "service.cli"]


def _server(tmp_path: Path, workers: int, **env: str) -> RobezServer:
    """``robez serve --data-dir`` with ``workers`` workers, no default table, a snapshot every 7 updates."""
    return RobezServer(
        tmp_path / "server.log",
        ["--data-dir", str(tmp_path / "data"), "--workers", str(workers)],
        {
            "ROBEZ_SHM_DIR": str(tmp_path / "shm"),
            "ROBEZ_DEFAULT_TABLE": "false",
            "ROBEZ_SNAPSHOT_EVERY_UPDATES": "7",
            "ROBEZ_LOG_LEVEL": "warning",
            **env,
        },
    )


@dataclass
class _Update:
    ids: Tensor
    grads: Tensor

    def body(self) -> bytes:
        return self.ids.numpy().astype("<i8").tobytes() + self.grads.numpy().astype("<f4").tobytes()


def _stream(
    url: str, generator: torch.Generator, stop: threading.Event
) -> tuple[list[tuple[int, _Update]], _Update | None]:
    """Push updates one at a time (a fresh connection each, so every worker serves some) until the
    server dies or ``stop`` is set. Returns the acknowledged (version, update) pairs and the update that
    was in flight when the connection broke, if any."""
    acknowledged: list[tuple[int, _Update]] = []
    headers = {"Content-Type": "application/octet-stream", "Connection": "close"}
    for _ in range(100_000):  # bounded; the kill ends it long before
        if stop.is_set():
            return acknowledged, None
        num_ids = int(torch.randint(1, 6, (1,), generator=generator))
        update = _Update(
            torch.randint(-(2**40), 2**40, (num_ids,), generator=generator),
            torch.randn(num_ids, DIM, generator=generator),
        )
        try:
            response = httpx.post(
                f"{url}/v1/tables/t/update",
                content=update.body(),
                headers={**headers, "X-Robez-Shape": f"{num_ids},{DIM}"},
                timeout=30.0,
            )
        except httpx.TransportError:
            return acknowledged, update
        if response.status_code != 200:
            # A 5xx from a dying worker: not acknowledged, and possibly journalled.
            return acknowledged, update
        acknowledged.append((int(response.json()["version"]), update))
    return acknowledged, None


def _download(url: str, tmp_path: Path) -> tuple[Table, int]:
    response = httpx.get(f"{url}/v1/tables/t/checkpoint", timeout=60.0)
    assert response.status_code == 200, response.text
    path = tmp_path / f"download-{time.monotonic_ns()}.safetensors"
    path.write_bytes(response.content)
    table = Table.load(path)
    path.unlink()
    return table, int(response.headers["X-Robez-Version"])


def _applied(table: Table, updates: list[_Update]) -> Table:
    state = {name: tensor.clone() for name, tensor in table.state.items()}
    out = Table(table.config, table.optimizer, weight=table.weight.clone(), state=state)
    for update in updates:
        out.apply_gradients(update.ids, update.grads, table.optimizer.lr)
    return out


def _bitwise_equal(left: Tensor, right: Tensor) -> bool:
    return torch.equal(left.view(torch.uint8), right.view(torch.uint8))


def _same(left: Table, right: Table) -> bool:
    a, b = left.tensors(), right.tensors()
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a
    )


def _collect(
    into: list[tuple[list[tuple[int, _Update]], _Update | None]],
    url: str,
    generator: torch.Generator,
    stop: threading.Event,
) -> None:
    into.append(_stream(url, generator, stop))


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[list[RobezServer]]:
    servers: list[RobezServer] = []
    yield servers
    for server in servers:
        if server.process is not None and server.process.poll() is None:
            server.kill()


@pytest.mark.parametrize("workers", [1, 2])
def test_acknowledged_updates_survive_kill_9(
    workers: int, tmp_path: Path, server_factory: list[RobezServer]
) -> None:
    rng = random.Random(1234 + workers)
    generator = torch.Generator().manual_seed(99 + workers)
    server = _server(tmp_path, workers)
    server_factory.append(server)
    server.start()
    response = httpx.post(f"{server.url}/v1/tables", json=TABLE, timeout=60.0)
    assert response.status_code == 201, response.text
    initial, version = _download(server.url, tmp_path)
    assert version == 0
    history: list[_Update] = []  # every update the recovered table holds, in version order
    streamed = 0  # updates acknowledged while the server was about to be killed

    for kill in range(KILLS[workers]):
        # One acknowledged push first: the first update after a start loads the table's kernels (0.5 s
        # and more on a busy machine), and a kill before any acknowledgement would test nothing.
        warm = _Update(
            torch.randint(0, 1000, (2,), generator=generator), torch.randn(2, DIM, generator=generator)
        )
        assert _push(server.url, warm) == len(history) + 1
        history.append(warm)
        stop = threading.Event()
        result: list[tuple[list[tuple[int, _Update]], _Update | None]] = []
        streamer = threading.Thread(target=_collect, args=(result, server.url, generator, stop))
        streamer.start()
        time.sleep(rng.uniform(0.4, 1.5))
        server.kill()
        streamer.join(timeout=60)
        assert not streamer.is_alive() and result
        acknowledged, in_flight = result[0]
        versions = [v for v, _ in acknowledged]
        assert versions == list(range(len(history) + 1, len(history) + 1 + len(acknowledged))), versions
        history.extend(update for _, update in acknowledged)
        streamed += len(acknowledged)

        started = time.monotonic()
        server.start()
        print(
            f"kill {kill}: {len(acknowledged)} acked, in flight {in_flight is not None}, "
            f"restart {time.monotonic() - started:.1f} s"
        )
        recovered, version = _download(server.url, tmp_path)
        expected = _applied(initial, history)
        if version == len(history) + 1 and in_flight is not None:
            expected = _applied(initial, [*history, in_flight])
            history.append(in_flight)
            print("  the in-flight update was recovered")
        assert version == len(history), (kill, version, len(history), in_flight is not None)
        assert _same(recovered, expected), f"kill {kill}: table differs from the oracle at version {version}"

    assert streamed, "no streamed update was acknowledged before any kill: the test exercised nothing"
    server.stop()
    assert server.process is not None and server.process.returncode is not None


def _push(url: str, update: _Update) -> int | None:
    """One update on a fresh connection: the version it produced, or None if it was not acknowledged."""
    num_ids = int(update.ids.shape[0])
    headers = {"Content-Type": "application/octet-stream", "Connection": "close"}
    try:
        response = httpx.post(
            f"{url}/v1/tables/t/update",
            content=update.body(),
            headers={**headers, "X-Robez-Shape": f"{num_ids},{DIM}"},
            timeout=30.0,
        )
    except httpx.TransportError:
        return None
    return int(response.json()["version"]) if response.status_code == 200 else None


def test_a_worker_killed_in_the_middle_of_an_update_loses_nothing(
    tmp_path: Path, server_factory: list[RobezServer]
) -> None:
    """One of two workers dies after appending an update and applying half of it (a test hook), twice.
    The other workers must repair the table before their next update: the live table, and the table
    recovered after kill -9 of the whole server, equal bitwise a twin given only the acknowledged
    updates. (Before the repair, the next writer appended the same version again: the data directory
    could no longer be recovered.)"""
    fault = tmp_path / "die-now"
    server = _server(tmp_path, 2, ROBEZ_FAULT_DIE_AFTER_APPEND=str(fault), ROBEZ_SNAPSHOT_EVERY_UPDATES="0")
    server_factory.append(server)
    server.start()
    response = httpx.post(f"{server.url}/v1/tables", json=TABLE, timeout=60.0)
    assert response.status_code == 201, response.text
    initial, _ = _download(server.url, tmp_path)
    generator = torch.Generator().manual_seed(7)

    def update() -> _Update:
        return _Update(
            torch.randint(0, 50_000, (4,), generator=generator), torch.randn(4, DIM, generator=generator)
        )

    acknowledged: list[_Update] = []
    for _kill in range(2):
        for _ in range(8):
            pushed = update()
            assert _push(server.url, pushed) == len(acknowledged) + 1, server.log()
            acknowledged.append(pushed)
        fault.touch()
        assert _push(server.url, update()) is None, "the worker that took the update should have died"
        assert not fault.exists()
        for _ in range(8):  # served by the surviving worker (and the replacement once it is up)
            pushed = update()
            assert _push(server.url, pushed) == len(acknowledged) + 1, server.log()
            acknowledged.append(pushed)

    expected = _applied(initial, acknowledged)
    live, version = _download(server.url, tmp_path)
    assert version == len(acknowledged)
    assert _same(live, expected), "the live table holds part of a dead worker's update"
    assert "a worker died while applying update" in server.log()

    server.kill()
    server.start()
    recovered, version = _download(server.url, tmp_path)
    assert version == len(acknowledged)
    assert _same(recovered, expected), "the recovered table differs from the acknowledged updates"
    server.stop()


def _data_dir_with_log(data_dir: Path, num_updates: int) -> tuple[Path, Table]:
    """A data directory holding table ``t`` with ``num_updates`` logged updates; the log path and the
    table those updates produce."""
    config = TableConfig(num_embeddings=100_000, embedding_dim=DIM, memory_size=4096, chunk_size=4)
    table = Table(config, OptimizerConfig("sgd", lr=0.1))
    journal = WalJournal(data_dir)
    journal.create("t", table, 0)
    generator = torch.Generator().manual_seed(5)
    for version in range(1, num_updates + 1):
        ids, grads = (
            torch.randint(0, 1000, (3,), generator=generator),
            torch.randn(3, DIM, generator=generator),
        )
        journal.append(UpdateRecord("t", version, ids, grads, 0.1))
        table.apply_gradients(ids, grads, 0.1)
    journal.close()
    return data_dir / "t" / LOG_FILE, table


def test_a_torn_tail_does_not_stop_the_server(tmp_path: Path, server_factory: list[RobezServer]) -> None:
    log, table = _data_dir_with_log(tmp_path / "data", 3)
    with open(log, "ab") as handle:
        handle.write(b"RZUP\x01\x00")  # the first bytes of a record whose write was cut short
    server = _server(tmp_path, 1)
    server_factory.append(server)
    server.start()
    recovered, version = _download(server.url, tmp_path)
    assert version == 3 and _same(recovered, table)
    assert "dropping a torn tail of 6 bytes" in server.log()
    server.stop()


def test_corruption_in_the_middle_refuses_to_start(tmp_path: Path) -> None:
    log, _ = _data_dir_with_log(tmp_path / "data", 3)
    data = bytearray(log.read_bytes())
    data[len(data) // 2] ^= 0x10  # inside a record that has good records after it
    log.write_bytes(bytes(data))
    env = {**os.environ, "ROBEZ_SHM_DIR": str(tmp_path / "shm"), "ROBEZ_DEFAULT_TABLE": "false"}
    command = [*ROBEZ, "serve", "--data-dir", str(tmp_path / "data"), "--port", str(free_port())]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=STARTUP_SECONDS)
    assert result.returncode != 0
    assert "CorruptionError" in result.stderr and "damaged in the middle" in result.stderr, result.stderr[
        -2000:
    ]
    assert bytes(data) == log.read_bytes()  # left as found, for a person to look at


def test_a_second_server_on_the_same_data_dir_fails_fast(
    tmp_path: Path, server_factory: list[RobezServer]
) -> None:
    server = _server(tmp_path, 1)
    server_factory.append(server)
    server.start()
    env = {**os.environ, "ROBEZ_SHM_DIR": str(tmp_path / "shm"), "ROBEZ_DEFAULT_TABLE": "false"}
    command = [*ROBEZ, "serve", "--data-dir", str(tmp_path / "data"), "--port", str(free_port())]
    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=STARTUP_SECONDS)
    assert second.returncode == 2, second.stderr[-2000:]
    assert server.process is not None
    assert f"in use by another robez serve (pid {server.process.pid})" in second.stderr, second.stderr[-2000:]
    assert httpx.get(f"{server.url}/readyz", timeout=10.0).status_code == 200  # the first one is untouched
    server.stop()
    server.start()  # the lock went with the first server
    server.stop()
