"""One server with big tables (issue 27): a bad tables file changes nothing; checksums and snapshots do
not block pushes; a restart's memory is bounded by the table. Tables of a few MB, made slow by the test
hook ``ROBEZ_FAULT_SLOW_SECONDS`` (service/faults.py), not by size."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from robez_core.errors import LimitExceededError
from service.config import Settings
from service.faults import SLOW_VARIABLE
from service.store import TableStore
from service.wal import WalJournal

from .conftest import make_settings, store_of


def _tables_file(path: Path, count: int, memory_size: int = 1024) -> Path:
    path.write_text(
        "".join(
            f"[tables.x{index}]\nnum_embeddings = 100\nembedding_dim = 8\nmemory_size = {memory_size}\n"
            for index in range(count)
        )
    )
    return path


def _prepare(settings: Settings) -> None:
    journal = WalJournal.from_settings(settings)
    try:
        TableStore.prepare(settings, journal).remove()
    finally:
        journal.close()


def _tree(directory: Path) -> list[str]:
    return sorted(
        str(path.relative_to(directory)) for path in directory.rglob("*") if ".lock" not in path.name
    )


def test_a_tables_file_over_max_tables_changes_nothing(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    (tmp_path / "shm").mkdir()
    _prepare(make_settings(tmp_path, data_dir=data_dir, config=_tables_file(tmp_path / "two.toml", 2)))
    before = _tree(data_dir)
    too_many = _tables_file(tmp_path / "tables.toml", 65)
    with pytest.raises(LimitExceededError) as refused:
        _prepare(make_settings(tmp_path, data_dir=data_dir, config=too_many))
    message = str(refused.value)
    assert "'x64'" in message and str(too_many) in message and "max_tables=64" in message, message
    assert _tree(data_dir) == before  # x2..x63 were not written
    assert not list((tmp_path / "shm").iterdir())
    _prepare(make_settings(tmp_path, data_dir=data_dir, config=_tables_file(too_many, 64)))
    assert len([path for path in data_dir.iterdir() if not path.name.startswith(".")]) == 64


def test_the_total_limit_counts_the_tables_already_in_the_data_dir(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    (tmp_path / "shm").mkdir()
    table_bytes = (1 << 16) * 4  # memory_size 1 << 16 float32, sgd
    limit = {"max_total_memory_bytes": 2 * table_bytes + 10}
    _prepare(
        make_settings(tmp_path, data_dir=data_dir, config=_tables_file(tmp_path / "one.toml", 2, 1 << 16))
    )
    before = _tree(data_dir)
    three = _tables_file(tmp_path / "three.toml", 3, 1 << 16)
    with pytest.raises(LimitExceededError) as refused:
        _prepare(make_settings(tmp_path, data_dir=data_dir, config=three, **limit))
    assert "'x2'" in str(refused.value) and "max_total_memory_bytes" in str(refused.value)
    assert _tree(data_dir) == before


BIG = {"num_embeddings": 100_000, "embedding_dim": 16, "memory_size": 1 << 22, "chunk_size": 16}
SLOW_SECONDS = 1.0  # per 16 MiB piece: a table of 2 x 16 MiB takes >= 2 s to hash


def _pushes_during(work: Callable[[], Any], push: Callable[[], None]) -> tuple[list[float], float, float]:
    """Run ``work`` on a thread and push from this one until it ends; returns every push's seconds and
    when ``work`` started and ended (time.monotonic)."""
    started = time.monotonic()
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(work()))
    thread.start()
    latencies: list[float] = []
    try:
        while thread.is_alive():
            begin = time.monotonic()
            push()
            latencies.append(time.monotonic() - begin)
    finally:
        thread.join(timeout=120)
    assert result, "the work failed"
    return latencies, started, time.monotonic()


def _big_client(client_factory: Callable[..., TestClient], tmp_path: Path, **overrides: Any) -> TestClient:
    client = client_factory(data_dir=tmp_path / "data", default_table=False, **overrides)
    response = client.post(
        "/v1/tables", json={"name": "big", "config": BIG, "optimizer": {"name": "adagrad"}}
    )
    assert response.status_code == 201, response.text
    return client


def _push(client: TestClient) -> None:
    ids = torch.randint(0, BIG["num_embeddings"], (64,))
    store_of(client).update("big", ids, torch.randn(64, BIG["embedding_dim"]))


@pytest.mark.slow
def test_a_push_completes_while_a_checksum_is_hashed(
    client_factory: Callable[..., TestClient], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = _big_client(client_factory, tmp_path)
    store = store_of(client)
    quiet_version, quiet_digest = store.checksum("big")
    monkeypatch.setenv(SLOW_VARIABLE, str(SLOW_SECONDS))
    latencies, started, ended = _pushes_during(lambda: store.checksum("big"), lambda: _push(client))
    assert ended - started >= 2 * SLOW_SECONDS  # the hook made it slow
    # Pushes went on the whole time: none waited for the hash (under the lock it would wait ~2 s).
    assert len(latencies) >= 3 and max(latencies) < SLOW_SECONDS, latencies
    monkeypatch.delenv(SLOW_VARIABLE)
    assert store.checksum("big")[0] == quiet_version + len(latencies)
    response = client.get("/v1/tables/big/checksum")
    assert response.status_code == 200 and response.json()["sha256"] != quiet_digest
