"""Lookups through the HTTP API: JSON, binary, pooled, multi-table; timing; every error changes nothing."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from robez_core.config import OptimizerConfig, TableConfig
from robez_core.table import Table

from .conftest import SMALL_TABLE, assert_unchanged, create_table, error_of, store_of, table_state

OCTET = {"content-type": "application/octet-stream"}
INT64_MAX = 2**63 - 1


def reference_table(**config: object) -> Table:
    """A private table initialised like the server's (same seed), to compare rows with."""
    return Table(TableConfig(**{**SMALL_TABLE, **config}), OptimizerConfig())  # type: ignore[arg-type]


def rows_from_binary(response: object) -> torch.Tensor:
    n, d = (int(v) for v in response.headers["x-robez-shape"].split(","))  # type: ignore[attr-defined]
    array = np.frombuffer(response.content, dtype="<f4").reshape(n, d)  # type: ignore[attr-defined]
    return torch.from_numpy(array.copy())


def test_json_lookup_matches_the_core_table(client: TestClient) -> None:
    create_table(client, "small")
    ids = [0, 5, -3, INT64_MAX, -(2**63), 5]
    response = client.post("/v1/tables/small/lookup", json={"ids": ids})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["table"] == "small" and body["shape"] == [6, 8] and body["version"] == 0
    expected = reference_table().lookup(torch.tensor(ids, dtype=torch.int64))
    assert torch.equal(torch.tensor(body["embeddings"], dtype=torch.float32), expected)


def test_binary_lookup_matches_json(client: TestClient) -> None:
    ids = np.array([1, 2, 3, 1 << 40, -7], dtype="<i8")
    binary = client.post("/v1/tables/demo/lookup", content=ids.tobytes(), headers=OCTET)
    assert binary.status_code == 200
    assert binary.headers["content-type"] == "application/octet-stream"
    assert binary.headers["x-robez-shape"] == "5,64"
    as_json = client.post("/v1/tables/demo/lookup", json={"ids": ids.tolist()}).json()
    assert torch.equal(rows_from_binary(binary), torch.tensor(as_json["embeddings"], dtype=torch.float32))


def test_json_request_may_ask_for_a_binary_response(client: TestClient) -> None:
    response = client.post(
        "/v1/tables/demo/lookup",
        json={"ids": [1, 2, 3, 4], "offsets": [0, 1]},
        headers={"accept": "application/octet-stream"},
    )
    assert response.status_code == 422  # offsets need pooling
    response = client.post(
        "/v1/tables/demo/lookup",
        json={"ids": [1, 2, 3, 4], "offsets": [0, 1], "pooling": "sum"},
        headers={"accept": "application/octet-stream"},
    )
    assert response.headers["x-robez-shape"] == "2,64"


def test_lookup_reports_timing_in_body_and_header(client: TestClient) -> None:
    response = client.post("/v1/tables/demo/lookup", json={"ids": [1, 2]})
    timing = response.json()["timing"]
    assert set(timing) == {"hash_ms", "lookup_ms", "total_ms"}
    assert all(value >= 0 for value in timing.values())
    assert timing["total_ms"] >= timing["hash_ms"] + timing["lookup_ms"] - 1e-3
    stages = dict(part.strip().split(";dur=") for part in response.headers["server-timing"].split(","))
    assert set(stages) == {"hash", "lookup", "total"}
    assert all(float(value) >= 0 for value in stages.values())
    assert response.headers["x-robez-version"] == "0"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    bags=st.lists(st.lists(st.integers(-(2**63), INT64_MAX), max_size=5), min_size=1, max_size=6),
    mode=st.sampled_from(["sum", "mean"]),
    weighted=st.booleans(),
)
def test_pooled_lookup_matches_embedding_bag(
    client: TestClient, bags: list[list[int]], mode: str, weighted: bool
) -> None:
    ids = [i for bag in bags for i in bag]
    offsets = list(np.cumsum([0] + [len(bag) for bag in bags[:-1]]))
    weights = [0.5 + k for k in range(len(ids))] if weighted and mode == "sum" else None
    payload = {
        "ids": ids,
        "offsets": [int(v) for v in offsets],
        "pooling": mode,
        "per_sample_weights": weights,
    }
    response = client.post("/v1/tables/demo/lookup", json=payload)
    assert response.status_code == 200, response.text
    table = store_of(client).table("demo")
    rows = table.lookup(torch.tensor(ids, dtype=torch.int64))
    expected = F.embedding_bag(
        torch.arange(len(ids)),
        rows if len(ids) else torch.zeros(1, 64),
        torch.tensor([int(v) for v in offsets]),
        mode=mode,
        per_sample_weights=None if weights is None else torch.tensor(weights),
    )
    got = torch.tensor(response.json()["embeddings"], dtype=torch.float32)
    assert got.shape == (len(bags), 64)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-9)


def test_multi_table_lookup_json_and_binary(client: TestClient) -> None:
    create_table(client, "small")
    payload = {
        "lookups": [
            {"table": "small", "ids": [1, 2]},
            {"table": "demo", "ids": [3]},
            {"table": "small", "ids": []},
        ]
    }
    response = client.post("/v1/lookup", json=payload)
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [r["shape"] for r in results] == [[2, 8], [1, 64], [0, 8]]
    small = reference_table().lookup(torch.tensor([1, 2]))
    assert torch.equal(torch.tensor(results[0]["embeddings"], dtype=torch.float32), small)
    assert set(response.json()["timing"]) == {"hash_ms", "lookup_ms", "total_ms"}

    body = np.array([1, 2, 3], dtype="<i8").tobytes()
    binary = client.post("/v1/lookup", content=body, headers={**OCTET, "x-robez-tables": "small=2,demo=1"})
    assert binary.status_code == 200, binary.text
    assert binary.headers["x-robez-shapes"] == "2,8;1,64"
    values = np.frombuffer(binary.content, dtype="<f4")
    assert torch.equal(torch.from_numpy(values[:16].copy()).reshape(2, 8), small)
    assert np.array_equal(values[16:], np.asarray(results[1]["embeddings"], dtype=np.float32).ravel())


def test_lookup_errors_change_nothing(client: TestClient) -> None:
    before = table_state(client, "demo")
    cases = [
        ({"json": {"ids": [2**63]}}, 422),  # outside int64
        ({"json": {"ids": [-(2**63) - 1]}}, 422),
        ({"json": {"ids": ["1"]}}, 422),  # mistyped
        ({"json": {"ids": [1.5]}}, 422),
        ({"json": {"ids": [True]}}, 422),
        ({"json": {"idz": [1]}}, 422),  # unknown field
        ({"content": b"{not json", "headers": {"content-type": "application/json"}}, 422),
        ({"content": b"\x01\x02\x03", "headers": OCTET}, 422),  # not a multiple of 8 bytes
        ({"json": {"ids": [1, 2], "offsets": [1], "pooling": "sum"}}, 422),  # offsets[0] != 0
        ({"json": {"ids": [1, 2], "offsets": [0, 3], "pooling": "sum"}}, 422),  # past the end
        ({"json": {"ids": [1, 2], "offsets": [0, 2, 1], "pooling": "sum"}}, 422),  # decreasing
        ({"json": {"ids": [1], "pooling": "max"}}, 422),
        ({"json": {"ids": [1], "pooling": "mean", "per_sample_weights": [1.0]}}, 422),
        ({"json": {"ids": [1, 2], "pooling": "sum", "per_sample_weights": [1.0]}}, 422),
    ]
    for kwargs, status in cases:
        response = client.post("/v1/tables/demo/lookup", **kwargs)  # type: ignore[arg-type]
        error_of(response, status)
    error_type = error_of(client.post("/v1/tables/missing/lookup", json={"ids": [1]}), 404)
    assert error_type == "NotFoundError"
    error_of(client.post("/v1/lookup", json={"lookups": [{"table": "missing", "ids": [1]}]}), 404)
    error_of(client.post("/v1/lookup", content=b"", headers={**OCTET, "x-robez-tables": "demo=1"}), 422)
    error_of(client.post("/v1/lookup", content=b"", headers=OCTET), 422)
    assert_unchanged(client, "demo", before)


def test_id_and_value_limits_answer_422_with_the_limit(client_factory) -> None:
    client = client_factory(max_ids_per_request=4, max_values_per_request=64 * 3)
    response = client.post("/v1/tables/demo/lookup", json={"ids": [1, 2, 3, 4, 5]})
    error_of(response, 422)
    assert "max_ids_per_request=4" in response.json()["error"]
    response = client.post("/v1/tables/demo/lookup", json={"ids": [1, 2, 3, 4]})
    error_of(response, 422)
    assert "max_values_per_request=192" in response.json()["error"]
    many = {"lookups": [{"table": "demo", "ids": [1, 2]}, {"table": "demo", "ids": [3, 4]}]}
    assert "max_values_per_request" in client.post("/v1/lookup", json=many).json()["error"]


def test_body_limit_answers_413(client_factory) -> None:
    client = client_factory(max_body_bytes=64)
    body = np.arange(9, dtype="<i8").tobytes()  # 72 bytes
    response = client.post("/v1/tables/demo/lookup", content=body, headers=OCTET)
    assert error_of(response, 413) == "PayloadTooLargeError"
    assert "max_body_bytes=64" in response.json()["error"]

    def chunks():
        yield body[:40]
        yield body[40:]

    # No Content-Length: the limit is enforced while the body streams in.
    response = client.post("/v1/tables/demo/lookup", content=chunks(), headers=OCTET)
    assert error_of(response, 413) == "PayloadTooLargeError"
    response = client.post("/v1/tables", json={"name": "x" * 60, "config": SMALL_TABLE})
    error_of(response, 413)


def test_json_bodies_are_bounded_apart_from_binary(client: TestClient) -> None:
    """A JSON body grows ~5-36x when decoded (docs/benchmarks/body-memory-*.md): over
    max_json_body_bytes (default 4 MiB) it is refused unread, while binary of that size is read."""
    settings = client.app.state.settings  # type: ignore[attr-defined]
    ids = settings.max_json_body_bytes // 2 + 1
    body = b'{"ids":[' + b",".join([b"0"] * ids) + b"]}"
    response = client.post(
        "/v1/tables/demo/lookup", content=body, headers={"content-type": "application/json"}
    )
    assert error_of(response, 413) == "PayloadTooLargeError"
    assert f"max_json_body_bytes={settings.max_json_body_bytes}" in response.json()["error"]
    binary = np.zeros(len(body) // 8, dtype="<i8").tobytes()  # as many bytes, under max_body_bytes
    response = client.post("/v1/tables/demo/lookup", content=binary, headers=OCTET)
    assert error_of(response, 422) == "LimitExceededError"  # read, then refused by max_ids_per_request


def test_empty_lookup(client: TestClient) -> None:
    response = client.post("/v1/tables/demo/lookup", content=b"", headers=OCTET)
    assert response.status_code == 200
    assert response.headers["x-robez-shape"] == "0,64" and response.content == b""
