"""Table management endpoints: list, get, create (incl. shared arrays), delete, their errors and limits."""

from __future__ import annotations

import torch
from fastapi.testclient import TestClient

from service.config import DEMO_TABLE_CONFIG

from .conftest import SMALL_TABLE, assert_unchanged, create_table, error_of, store_of, table_state


def test_default_demo_table(client: TestClient) -> None:
    tables = client.get("/v1/tables").json()["tables"]
    assert [t["name"] for t in tables] == ["demo"]
    demo = client.get("/v1/tables/demo").json()
    assert demo["config"]["embedding_dim"] == 64 and demo["config"]["chunk_size"] == 32
    assert demo["config"]["memory_size"] == 262_144
    assert demo["optimizer"]["name"] == "sgd"
    assert demo["version"] == 0
    assert demo["compression_ratio"] == DEMO_TABLE_CONFIG.compression_ratio
    assert demo["memory_bytes"] == 262_144 * 4


def test_no_demo_when_disabled(client_factory) -> None:
    client = client_factory(default_table=False)
    assert client.get("/v1/tables").json() == {"tables": []}
    assert client.get("/readyz").json() == {"status": "ready", "tables": 0, "writable": True}


def test_create_get_delete(client: TestClient) -> None:
    info = create_table(
        client, "clicks-2", optimizer={"name": "adagrad", "lr": 0.1}, hash="fast", val_offset=7
    )
    assert (
        info["name"] == "clicks-2" and info["config"]["hash"] == "fast" and info["config"]["val_offset"] == 7
    )
    assert info["optimizer"]["name"] == "adagrad" and info["optimizer"]["lr"] == 0.1
    assert info["memory_bytes"] == 4096 * 4 * 2  # weight + adagrad sum
    assert client.get("/v1/tables/clicks-2").json() == info
    assert sorted(t["name"] for t in client.get("/v1/tables").json()["tables"]) == ["clicks-2", "demo"]
    assert client.delete("/v1/tables/clicks-2").status_code == 204
    error_of(client.get("/v1/tables/clicks-2"), 404)
    error_of(client.delete("/v1/tables/clicks-2"), 404)
    # The name is free again, and the new table starts afresh.
    again = create_table(client, "clicks-2")
    assert again["version"] == 0 and again["optimizer"]["name"] == "sgd"


def test_shared_array(client: TestClient) -> None:
    create_table(client, "users")
    info = create_table(client, "items", val_offset=1000)
    assert info["array_tables"] == ["items"]
    payload = {"name": "both", "config": {**SMALL_TABLE, "val_offset": 5}, "share_array_with": "users"}
    shared = client.post("/v1/tables", json=payload)
    assert shared.status_code == 201, shared.text
    assert sorted(shared.json()["array_tables"]) == ["both", "users"]
    store = store_of(client)
    assert store.table("both").weight.data_ptr() == store.table("users").weight.data_ptr()
    # An update through one table is read through the other (same array, different val_offset).
    client.post("/v1/tables/users/update", json={"ids": [5], "grads": [[1.0] * 8]})
    rows = client.post("/v1/tables/both/lookup", json={"ids": [0]}).json()["embeddings"]
    assert torch.equal(torch.tensor(rows), store.table("users").lookup(torch.tensor([5])))
    # Deleting the source keeps the array alive for the other table.
    assert client.delete("/v1/tables/users").status_code == 204
    assert client.get("/v1/tables/both").json()["array_tables"] == ["both"]
    assert client.post("/v1/tables/both/lookup", json={"ids": [0]}).json()["embeddings"] == rows


def test_create_errors_change_nothing(client_factory) -> None:
    client = client_factory(
        default_table=False,
        max_tables=2,
        max_memory_size=8192,
        max_embedding_dim=16,
        max_total_memory_bytes=64 * 1024,
    )
    create_table(client, "t")
    before = table_state(client, "t")
    cases = [
        ({"name": "t", "config": SMALL_TABLE}, 409),  # duplicate
        ({"name": "a/b", "config": SMALL_TABLE}, 422),  # path separator
        ({"name": "..", "config": SMALL_TABLE}, 422),
        ({"name": "", "config": SMALL_TABLE}, 422),
        ({"name": "x" * 65, "config": SMALL_TABLE}, 422),
        ({"name": "ok", "config": {**SMALL_TABLE, "memory_size": 2}}, 422),  # m < Z (ConfigError)
        ({"name": "ok", "config": {**SMALL_TABLE, "embedding_dim": 0}}, 422),
        ({"name": "ok", "config": {**SMALL_TABLE, "hash": "md5"}}, 422),
        ({"name": "ok", "config": {**SMALL_TABLE, "seed": -1}}, 422),
        # found by schemathesis: torch refused to draw U(-a, a) wider than float32, a 500
        ({"name": "ok", "config": {**SMALL_TABLE, "init_scale": 3.9891452584725284e307}}, 422),
        ({"name": "ok", "config": {**SMALL_TABLE, "init_scale": 1.8e38}}, 422),
        ({"name": "ok", "config": {**SMALL_TABLE, "bogus": 1}}, 422),
        ({"name": "ok", "config": SMALL_TABLE, "optimizer": {"name": "rmsprop"}}, 422),
        ({"name": "ok", "config": SMALL_TABLE, "optimizer": {"lr": -1}}, 422),
        ({"name": "ok", "config": SMALL_TABLE, "optimizer": {"betas": [1.5, 0.9]}}, 422),
        ({"name": "ok", "config": SMALL_TABLE, "share_array_with": "missing"}, 404),
        ({"name": "ok", "config": {**SMALL_TABLE, "memory_size": 2048}, "share_array_with": "t"}, 422),
        ({"name": "ok", "config": SMALL_TABLE, "optimizer": {"name": "adam"}, "share_array_with": "t"}, 422),
        # one Z an array: a shared push's chunks are cut by it (as the local collection's one chunk_size)
        ({"name": "ok", "config": {**SMALL_TABLE, "chunk_size": 8}, "share_array_with": "t"}, 422),
        ({"name": "ok", "config": {**SMALL_TABLE, "memory_size": 8193}}, 422),  # over max_memory_size
        ({"name": "ok", "config": {**SMALL_TABLE, "embedding_dim": 17}}, 422),  # over max_embedding_dim
        ({"name": "ok"}, 422),
    ]
    for payload, status in cases:
        error_of(client.post("/v1/tables", json=payload), status)
    limit = client.post(
        "/v1/tables",
        json={"name": "ok", "config": {**SMALL_TABLE, "memory_size": 8192}, "optimizer": {"name": "adam"}},
    )
    error_of(limit, 422)
    assert "max_total_memory_bytes=65536" in limit.json()["error"]
    create_table(client, "third")
    too_many = client.post("/v1/tables", json={"name": "fourth", "config": SMALL_TABLE})
    error_of(too_many, 422)
    assert "max_tables=2" in too_many.json()["error"]
    names = sorted(t["name"] for t in client.get("/v1/tables").json()["tables"])
    assert names == ["t", "third"]
    assert_unchanged(client, "t", before)
    leftovers = sorted(p.name for p in store_of(client).directory.arrays_dir.iterdir())
    assert len([name for name in leftovers if name.endswith(".weight")]) == 2


def test_unknown_routes_use_the_error_shape(client: TestClient) -> None:
    assert error_of(client.get("/v2/nothing"), 404) == "NotFound"
    assert error_of(client.put("/v1/tables/demo"), 405) == "MethodNotAllowed"
