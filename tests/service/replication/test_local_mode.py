"""What replication adds to the single-machine mode: /checksum and X-Robez-Min-Version (in-process)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.log.state_digest import digest_of_table

from ..conftest import create_table, store_of


def test_checksum_is_over_the_bytes_at_a_version(client: TestClient) -> None:
    create_table(client, "c", optimizer={"name": "adam", "lr": 0.1})
    first = client.get("/v1/tables/c/checksum").json()
    assert first["version"] == 0
    table = store_of(client).table("c")
    assert first["sha256"] == digest_of_table(table)
    assert client.post("/v1/tables/c/update", json={"ids": [1], "grads": [[1.0] * 8]}).status_code == 200
    second = client.get("/v1/tables/c/checksum").json()
    assert second["version"] == 1 and second["sha256"] != first["sha256"]
    assert client.get("/v1/tables/nope/checksum").status_code == 404


def test_min_version_waits_bounded_then_503(client_factory: Callable[..., TestClient]) -> None:
    client = client_factory(min_version_wait_ms=200)
    create_table(client, "m")
    assert client.post("/v1/tables/m/update", json={"ids": [1], "grads": [[1.0] * 8]}).status_code == 200
    reached = client.post("/v1/tables/m/lookup", json={"ids": [1]}, headers={"X-Robez-Min-Version": "1"})
    assert reached.status_code == 200 and reached.headers["X-Robez-Version"] == "1"
    start = time.monotonic()
    ahead = client.post("/v1/tables/m/lookup", json={"ids": [1]}, headers={"X-Robez-Min-Version": "2"})
    waited = time.monotonic() - start
    assert ahead.status_code == 503 and ahead.headers["Retry-After"] == "1"
    assert 0.15 < waited < 5.0
    many = client.post(
        "/v1/lookup",
        json={"lookups": [{"table": "m", "ids": [1]}]},
        headers={"X-Robez-Min-Version": "m=1"},
    )
    assert many.status_code == 200, many.text
    unnamed = client.post(
        "/v1/lookup", json={"lookups": [{"table": "m", "ids": [1]}]}, headers={"X-Robez-Min-Version": "1"}
    )
    assert unnamed.status_code == 422


def test_serve_refuses_a_single_server_data_dir_with_nats(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from service.cli import main

    (tmp_path / "demo").mkdir()  # a single server's table directory
    assert main(["serve", "--nats", "nats://127.0.0.1:1", "--data-dir", str(tmp_path)]) == 2
    assert "holds a single server's tables" in capsys.readouterr().err
