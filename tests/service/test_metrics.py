"""Prometheus metrics and Server-Timing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.metrics import Metrics, server_timing


def test_server_timing_format() -> None:
    assert (
        server_timing(hash=0.001, lookup=0.0025, total=0.01)
        == "hash;dur=1.0000, lookup;dur=2.5000, total;dur=10.0000"
    )


def test_metrics_after_lookups_and_updates(client: TestClient) -> None:
    client.post("/v1/tables/demo/lookup", json={"ids": [1, 2, 3]})
    client.post(
        "/v1/tables/demo/lookup",
        content=np.arange(4, dtype="<i8").tobytes(),
        headers={"content-type": "application/octet-stream"},
    )
    client.post("/v1/tables/demo/update", json={"ids": [1], "grads": [[0.0] * 64]})
    client.post("/v1/tables/nope/lookup", json={"ids": [1]})
    text = client.get("/metrics").text
    assert 'robez_hash_seconds_count{table="demo"} 3.0' in text
    assert 'robez_lookup_seconds_count{table="demo"} 2.0' in text
    assert 'robez_update_apply_seconds_count{table="demo"} 1.0' in text
    route = 'endpoint="/v1/tables/{name}/lookup",method="POST"'
    assert f'robez_requests_total{{{route},status="200",table="demo"}} 2.0' in text
    # Unknown tables do not become label values.
    assert (
        'robez_requests_total{endpoint="/v1/tables/{name}/lookup",method="POST",status="404",table=""} 1.0'
        in text
    )
    assert "nope" not in text
    assert "robez_request_duration_seconds_bucket" in text


def test_lookup_and_update_server_timings_are_server_timing_as_bytes() -> None:
    from service.metrics import lookup_server_timing, server_timing, update_server_timing

    for stages in [(0.0, 0.0, 0.0), (1.23456e-5, 7e-4, 0.0312), (2.5, 1e-9, 3.0)]:
        expected = server_timing(hash=stages[0], lookup=stages[1], total=stages[2]).encode()
        assert lookup_server_timing(*stages) == expected
        expected = server_timing(hash=stages[0], apply=stages[1], total=stages[2]).encode()
        assert update_server_timing(*stages) == expected


SMALL_TABLE = {"num_embeddings": 100, "embedding_dim": 4, "memory_size": 64, "chunk_size": 2}


def _table_labels(text: str) -> set[str]:
    import re

    return set(re.findall(r'table="([^"]*)"', text)) - {""}


def test_series_of_dropped_tables_go_and_table_labels_are_capped(
    client_factory: Callable[..., TestClient],
) -> None:
    """A create/lookup/delete history of distinct names leaves no series behind (issue 28: 2,066 table
    labels, 15.7 MB), and at most ``max_metric_tables`` tables have their own label at once."""
    client = client_factory(default_table=False, max_metric_tables=3)
    body = {"ids": [1, 2]}
    for name in ("kept1", "kept2"):
        assert client.post("/v1/tables", json={"name": name, "config": SMALL_TABLE}).status_code == 201
        assert client.post(f"/v1/tables/{name}/lookup", json=body).status_code == 200
    for index in range(30):
        name = f"gone{index}"
        assert client.post("/v1/tables", json={"name": name, "config": SMALL_TABLE}).status_code == 201
        assert client.post(f"/v1/tables/{name}/lookup", json=body).status_code == 200
        assert client.delete(f"/v1/tables/{name}").status_code == 204
        if index % 3 == 0:
            client.get("/metrics")  # scrapes now and then, as Prometheus would
    text = client.get("/metrics").text
    assert _table_labels(text) <= {"kept1", "kept2", "_other"}, sorted(_table_labels(text))
    assert {"kept1", "kept2"} <= _table_labels(text)
    # Places freed by the dropped tables are given again: a new table is labelled with its name.
    assert client.post("/v1/tables", json={"name": "late", "config": SMALL_TABLE}).status_code == 201
    assert client.post("/v1/tables/late/lookup", json=body).status_code == 200
    assert "late" in _table_labels(client.get("/metrics").text)
    # Over the cap (3 tables labelled), a fourth shares _other.
    assert client.post("/v1/tables", json={"name": "fourth", "config": SMALL_TABLE}).status_code == 201
    assert client.post("/v1/tables/fourth/lookup", json=body).status_code == 200
    labels = _table_labels(client.get("/metrics").text)
    assert "fourth" not in labels and "_other" in labels


def test_private_endpoints_need_a_key(client_factory: Callable[..., TestClient]) -> None:
    open_client = client_factory(api_key="w", read_api_key="r")
    for path in ("/metrics", "/docs", "/openapi.json", "/v2"):
        assert open_client.get(path).status_code == 200, path  # open by default (docs/api.md)
    client = client_factory(api_key="w", read_api_key="r", private_endpoints=True)
    for path in ("/metrics", "/docs", "/openapi.json", "/v2"):
        assert client.get(path).status_code == 401, path
        assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 403, path
        for key in ("r", "w"):
            response = client.get(path, headers={"Authorization": f"Bearer {key}"})
            assert response.status_code == 200, (path, key)
    assert client.get("/redoc").status_code == 404
    for path in ("/healthz", "/readyz"):
        assert client.get(path).status_code == 200


def _file_keys(directory: Path) -> dict[str, set[str]]:
    """The series in each metrics file of ``directory`` (file name without the pid: its type)."""
    from prometheus_client.mmap_dict import MmapedDict

    return {
        path.name.rsplit("_", 1)[0]: {entry[0] for entry in MmapedDict.read_all_values_from_file(str(path))}
        for path in sorted(directory.glob("*.db"))
    }


def test_create_drop_churn_leaves_the_multiprocess_files_as_they_were(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 39: with several workers, each worker's samples live in files prometheus_client only grows;
    2,000 tables created, used (lookups, requests, replication lag) and dropped must leave the files and
    the scrape as the first 10 did: their series removed from the files, not only hidden, and the cap on
    table labels not used up (a new table still gets its own label, not _other)."""
    from prometheus_client import values

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))  # as robez serve sets it for workers
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue())
    metrics = Metrics(tmp_path, max_tables=64)
    live = {"kept"}
    metrics.live_tables = lambda: live

    def use(name: str) -> None:
        metrics.stages(name).hash_seconds.observe(1e-4)
        metrics.observe_request("/v1/tables/{name}/lookup", "POST", name, 200, 1e-3)
        metrics.replication_lag_versions.labels(name).set(2)

    use("kept")

    def cycles(start: int, stop: int) -> tuple[dict[str, set[str]], set[str]]:
        for index in range(start, stop):
            name = f"t{index}"
            live.add(name)
            use(name)
            live.discard(name)
            if index % 50 == 0:
                metrics.render(live)  # scrapes now and then
        text = metrics.render(live)[0].decode()
        return _file_keys(tmp_path), _table_labels(text)

    files, labels = cycles(0, 10)
    assert labels == {"kept"}
    assert cycles(10, 2000) == (files, labels)
    live.add("late")
    use("late")
    assert "late" in _table_labels(metrics.render(live)[0].decode())
