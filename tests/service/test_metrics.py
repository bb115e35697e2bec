"""Prometheus metrics and Server-Timing."""

from __future__ import annotations

import numpy as np
from fastapi.testclient import TestClient

from service.metrics import server_timing


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
