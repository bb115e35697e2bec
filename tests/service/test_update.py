"""Gradient pushes: results equal the core table's fused step; versions; every error changes nothing."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from robez_core.config import OptimizerConfig, TableConfig
from robez_core.table import Table

from .conftest import SMALL_TABLE, assert_unchanged, create_table, error_of, store_of, table_state

OCTET = "application/octet-stream"


def binary_update(ids: np.ndarray, grads: np.ndarray) -> dict[str, Any]:
    n, d = grads.shape
    body = np.asarray(ids, dtype="<i8").tobytes() + np.asarray(grads, dtype="<f4").tobytes()
    return {"content": body, "headers": {"content-type": OCTET, "x-robez-shape": f"{n},{d}"}}


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_updates_equal_the_core_step_and_count_versions(client: TestClient, optimizer: str) -> None:
    opt = {"name": optimizer, "lr": 0.05}
    create_table(client, "t", optimizer=opt)
    reference = Table(TableConfig(**SMALL_TABLE), OptimizerConfig(**opt))  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        ids = torch.randint(-50, 50, (12,), generator=generator)  # duplicates included
        grads = torch.randn(12, 8, generator=generator)
        if step % 2:
            response = client.post("/v1/tables/t/update", **binary_update(ids.numpy(), grads.numpy()))
        else:
            response = client.post("/v1/tables/t/update", json={"ids": ids.tolist(), "grads": grads.tolist()})
        assert response.status_code == 200, response.text
        assert response.json()["version"] == step + 1
        reference.apply_gradients(ids, grads)
    tensors, version = table_state(client, "t")
    assert version == 3
    for key, tensor in reference.tensors().items():
        assert torch.equal(tensors[key], tensor), key
    probe = client.post("/v1/tables/t/lookup", json={"ids": [1, 2, 3]}).json()
    assert probe["version"] == 3
    assert torch.equal(torch.tensor(probe["embeddings"]), reference.lookup(torch.tensor([1, 2, 3])))


def test_lr_override_and_timing(client: TestClient) -> None:
    reference = Table(TableConfig(**SMALL_TABLE))  # type: ignore[arg-type]
    create_table(client, "t")
    ids, grads = torch.tensor([3, 4]), torch.ones(2, 8)
    response = client.post("/v1/tables/t/update?lr=0.5", json={"ids": ids.tolist(), "grads": grads.tolist()})
    assert response.status_code == 200
    body = response.json()
    assert set(body["timing"]) == {"hash_ms", "apply_ms", "total_ms"}
    stages = dict(part.strip().split(";dur=") for part in response.headers["server-timing"].split(","))
    assert set(stages) == {"hash", "apply", "total"}
    reference.apply_gradients(ids, grads, lr=0.5)
    assert torch.equal(store_of(client).table("t").weight, reference.weight)
    response = client.post("/v1/tables/t/update", json={"ids": [3], "grads": [[1.0] * 8], "lr": 0.25})
    reference.apply_gradients(torch.tensor([3]), torch.ones(1, 8), lr=0.25)
    assert torch.equal(store_of(client).table("t").weight, reference.weight)


def _nan_body(value: str) -> bytes:
    return ('{"ids": [1], "grads": [[' + ", ".join([value] + ["0.5"] * 7) + "]]}").encode()


def test_update_errors_change_nothing(client: TestClient) -> None:
    create_table(client, "t", optimizer={"name": "adam"})
    before = table_state(client, "t")
    good_row = [0.1] * 8
    json_cases: list[dict[str, Any]] = [
        {"ids": [1], "grads": [[0.1] * 7]},  # dim mismatch
        {"ids": [1, 2], "grads": [good_row]},  # rows != ids
        {"ids": [1], "grads": [good_row, good_row]},
        {"ids": [1], "grads": [[0.1] * 8, [0.2]]},
        {"ids": [2**63], "grads": [good_row]},  # id outside int64
        {"ids": [1], "grads": [["a"] * 8]},  # mistyped
        {"ids": [1], "grads": good_row},
        {"ids": [1]},  # missing grads
        {"ids": [1], "grads": [[1e39] + [0.0] * 7]},  # overflows float32 -> Inf
        {"ids": [1], "grads": [good_row], "lr": -1.0},
        {"ids": [1], "grads": [good_row], "lr": 0},
    ]
    for payload in json_cases:
        error_of(client.post("/v1/tables/t/update", json=payload), 422)
    for token in ("NaN", "Infinity", "-Infinity"):
        response = client.post(
            "/v1/tables/t/update", content=_nan_body(token), headers={"content-type": "application/json"}
        )
        assert error_of(response, 422) == "InvalidInputError"
    error_of(client.post("/v1/tables/t/update?lr=-2", json={"ids": [1], "grads": [good_row]}), 422)
    error_of(client.post("/v1/tables/t/update?lr=inf", json={"ids": [1], "grads": [good_row]}), 422)
    error_of(client.post("/v1/tables/t/update?lr=nan", json={"ids": [1], "grads": [good_row]}), 422)

    ids = np.array([1, 2], dtype="<i8")
    nan_grads = np.full((2, 8), 0.5, dtype="<f4")
    nan_grads[1, 3] = math.nan
    inf_grads = np.full((2, 8), 0.5, dtype="<f4")
    inf_grads[0, 0] = math.inf
    for grads in (nan_grads, inf_grads):
        error_of(client.post("/v1/tables/t/update", **binary_update(ids, grads)), 422)
    wrong_dim = binary_update(ids, np.zeros((2, 7), dtype="<f4"))
    error_of(client.post("/v1/tables/t/update", **wrong_dim), 422)
    short = binary_update(ids, np.zeros((2, 8), dtype="<f4"))
    short["content"] = short["content"][:-4]
    error_of(client.post("/v1/tables/t/update", **short), 422)
    for header in ("2", "2,8,1", "a,b", "-2,8", ""):
        case = binary_update(ids, np.zeros((2, 8), dtype="<f4"))
        case["headers"]["x-robez-shape"] = header
        error_of(client.post("/v1/tables/t/update", **case), 422)
    no_header = binary_update(ids, np.zeros((2, 8), dtype="<f4"))
    del no_header["headers"]["x-robez-shape"]
    error_of(client.post("/v1/tables/t/update", **no_header), 422)
    assert (
        error_of(client.post("/v1/tables/nope/update", json={"ids": [1], "grads": [good_row]}), 404)
        == "NotFoundError"
    )
    assert_unchanged(client, "t", before)


def test_update_limits(client_factory) -> None:
    client = client_factory(max_ids_per_request=2)
    before = table_state(client, "demo")
    response = client.post(
        "/v1/tables/demo/update", **binary_update(np.arange(3), np.zeros((3, 64), dtype="<f4"))
    )
    error_of(response, 422)
    assert "max_ids_per_request=2" in response.json()["error"]
    assert_unchanged(client, "demo", before)


def test_empty_update_bumps_the_version_only(client: TestClient) -> None:
    before = table_state(client, "demo")
    response = client.post("/v1/tables/demo/update", json={"ids": [], "grads": []})
    assert response.status_code == 200, response.text
    assert response.json()["version"] == 1
    tensors, _ = table_state(client, "demo")
    assert torch.equal(tensors["weight"], before[0]["weight"])


F32_MAX = float(np.finfo(np.float32).max)


@pytest.mark.parametrize(
    ("lr", "grad"),
    [(1e39, 0.5), (1e308, 1e30), (1001.0, 0.5)],  # over the default max_lr (1000): the issue's cases
)
def test_an_lr_over_the_tables_max_lr_is_refused(client: TestClient, lr: float, grad: float) -> None:
    before = table_state(client, "demo")
    for body_lr in (False, True):
        ids, grads = [1, 2], [[grad] * 64] * 2
        if body_lr:
            response = client.post("/v1/tables/demo/update", json={"ids": ids, "grads": grads, "lr": lr})
        else:
            response = client.post(
                "/v1/tables/demo/update", params={"lr": lr}, json={"ids": ids, "grads": grads}
            )
        assert error_of(response, 422) == "InvalidInputError"
        assert "max_lr=1000" in response.json()["error"]
    assert_unchanged(client, "demo", before)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize(
    ("lr", "grads"),
    [
        (1e10, [[1e30] * 8]),  # lr x grad overflows (sgd); grad^2 overflows the state (adagrad, adam)
        (1.0, [[3e38] * 8, [3e38] * 8]),  # one id twice: the summed gradient overflows
    ],
)
def test_an_update_that_would_leave_a_non_finite_value_is_refused_before_it_is_logged(
    client_factory: Any, tmp_path: Any, optimizer: str, lr: float, grads: list[list[float]]
) -> None:
    client = client_factory(data_dir=tmp_path / "data", default_table=False)
    create_table(client, "t", optimizer={"name": optimizer, "lr": 0.01, "max_lr": F32_MAX})
    assert client.post("/v1/tables/t/update", json={"ids": [7], "grads": [[0.5] * 8]}).status_code == 200
    log = tmp_path / "data" / "t" / "updates.wal"
    log_bytes, before = log.stat().st_size, table_state(client, "t")
    ids = [5] * len(grads)
    response = client.post("/v1/tables/t/update", params={"lr": lr}, json={"ids": ids, "grads": grads})
    assert error_of(response, 422) == "InvalidInputError"
    assert "non-finite" in response.json()["error"]
    assert_unchanged(client, "t", before)
    assert log.stat().st_size == log_bytes  # not logged: a restart cannot replay it
    good = client.post("/v1/tables/t/update", json={"ids": [5], "grads": [[0.5] * 8]})
    assert good.status_code == 200 and good.json()["version"] == 2
    weight, *state = table_state(client, "t")[0].values()
    assert all(bool(torch.isfinite(t.float()).all()) for t in (weight, *state))


def test_max_lr_is_part_of_the_optimizer_config(client: TestClient) -> None:
    table = {"name": "t", "config": SMALL_TABLE}
    for optimizer in ({"lr": 2.0, "max_lr": 1.0}, {"max_lr": 1e39}, {"max_lr": 0}):
        response = client.post("/v1/tables", json={**table, "optimizer": optimizer})
        assert response.status_code == 422, response.text
    info = create_table(client, "t", optimizer={"lr": 0.5, "max_lr": 2.0})
    assert info["optimizer"]["max_lr"] == 2.0
    ok = client.post("/v1/tables/t/update?lr=2.0", json={"ids": [1], "grads": [[0.5] * 8]})
    assert ok.status_code == 200, ok.text
    refused = client.post("/v1/tables/t/update?lr=2.5", json={"ids": [1], "grads": [[0.5] * 8]})
    assert error_of(refused, 422) == "InvalidInputError" and "max_lr=2" in refused.json()["error"]
