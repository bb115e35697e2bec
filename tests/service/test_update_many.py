"""``POST /v1/update``: one step's pushes to several tables in one request (issue 37). Tables over one
array get one coalesced step (the local collection's), a table with its own array its one-table push;
bad input in any one table changes no table."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from robez_core.collection import prepare_shared_step
from robez_core.config import OptimizerConfig, TableConfig
from robez_core.table import Table
from service.client import AsyncRobezClient, RobezClient, RobezClientError
from service.client.calls import update_many_calls
from service.client.wire import IdsLike

from .conftest import SMALL_TABLE, assert_unchanged, create_table, error_of, table_state

OCTET = "application/octet-stream"
ADAGRAD = {"name": "adagrad", "lr": 0.05}


def binary_many(parts: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
    body = b"".join(
        np.asarray(ids, dtype="<i8").tobytes() + np.asarray(grads, dtype="<f4").tobytes()
        for ids, grads in parts.values()
    )
    return {
        "content": body,
        "headers": {
            "content-type": OCTET,
            "x-robez-tables": ",".join(f"{name}={len(ids)}" for name, (ids, _) in parts.items()),
            "x-robez-shapes": ";".join(f"{g.shape[0]},{g.shape[1]}" for _, g in parts.values()),
        },
    }


def three_tables(client: TestClient) -> None:
    """a and b share one array (different val_offset, the collection's layout); c has its own."""
    create_table(client, "a", optimizer=ADAGRAD)
    response = client.post(
        "/v1/tables",
        json={
            "name": "b",
            "config": {
                "num_embeddings": 500,
                "embedding_dim": 8,
                "memory_size": 4096,
                "chunk_size": 4,
                "val_offset": 1000,
            },
            "optimizer": ADAGRAD,
            "share_array_with": "a",
        },
    )
    assert response.status_code == 201, response.text
    create_table(client, "c", optimizer={"name": "adam", "lr": 0.01}, embedding_dim=4)


def step_parts(seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    generator = np.random.default_rng(seed)
    return {
        "a": (generator.integers(0, 1000, 20), generator.standard_normal((20, 8)).astype(np.float32)),
        "b": (generator.integers(0, 500, 7), generator.standard_normal((7, 8)).astype(np.float32)),
        "c": (generator.integers(0, 1000, 5), generator.standard_normal((5, 4)).astype(np.float32)),
    }


def twins(lr: float | None = None) -> dict[str, Table]:
    """Local tables as ``three_tables`` makes them on the server: a and b over one array and state."""
    adagrad = OptimizerConfig(**ADAGRAD)  # type: ignore[arg-type]
    a = Table(TableConfig(**SMALL_TABLE), adagrad)  # type: ignore[arg-type]
    b_config = TableConfig(**{**SMALL_TABLE, "num_embeddings": 500, "val_offset": 1000})  # type: ignore[arg-type]
    b = Table(b_config, adagrad, weight=a.weight, state=a.state)
    c = Table(TableConfig(**{**SMALL_TABLE, "embedding_dim": 4}), OptimizerConfig("adam", lr=0.01))  # type: ignore[arg-type]
    return {"a": a, "b": b, "c": c}


def step_twins(
    tables: dict[str, Table], parts: dict[str, tuple[np.ndarray, np.ndarray]], lr: float | None
) -> None:
    """What one multi-table push does: one coalesced step of a and b (one array), c's own step."""
    ids = [torch.from_numpy(parts[n][0]) for n in ("a", "b")]
    grads = [torch.from_numpy(parts[n][1]) for n in ("a", "b")]
    step = prepare_shared_step([tables["a"], tables["b"]], ids, grads, lr)
    tables["a"].check_step(step)
    tables["a"].apply_step(step)
    tables["c"].apply_gradients(torch.from_numpy(parts["c"][0]), torch.from_numpy(parts["c"][1]), lr=lr)


@pytest.mark.parametrize("encoding", ["binary", "json"])
def test_one_request_is_one_step_per_array(client_factory: Callable[..., TestClient], encoding: str) -> None:
    many, single = client_factory(), client_factory()
    three_tables(many)
    three_tables(single)
    local = twins()
    for step in range(3):
        parts = step_parts(step)
        if encoding == "binary":
            response = many.post("/v1/update", **binary_many(parts))
        else:
            payload = {
                "updates": [
                    {"table": n, "ids": i.tolist(), "grads": g.tolist()} for n, (i, g) in parts.items()
                ]
            }
            response = many.post("/v1/update", json=payload)
        assert response.status_code == 200, response.text
        body = response.json()
        assert [(r["table"], r["version"]) for r in body["results"]] == [
            ("a", step + 1),
            ("b", step + 1),
            ("c", step + 1),
        ]
        assert response.headers["x-robez-version"] == ",".join([str(step + 1)] * 3)
        assert set(body["timing"]) == {"hash_ms", "apply_ms", "total_ms"}
        stages = dict(part.strip().split(";dur=") for part in response.headers["server-timing"].split(","))
        assert list(stages) == ["read", "decode", "hash", "apply", "total"]  # the push's profile
        assert float(stages["decode"]) > 0 and float(stages["decode"]) <= float(stages["total"])
        step_twins(local, parts, None)
        ids, grads = parts["c"]
        assert single.post("/v1/tables/c/update", **binary_update(ids, grads)).status_code == 200
    for name in ("a", "b", "c"):
        got = table_state(many, name)
        assert got[1] == 3
        for key, tensor in local[name].tensors().items():
            assert torch.equal(got[0][key], tensor), (name, key)
    # A table with its own array: the same bits as its one-table pushes.
    assert torch.equal(table_state(many, "c")[0]["weight"], table_state(single, "c")[0]["weight"])


def binary_update(ids: np.ndarray, grads: np.ndarray) -> dict[str, Any]:
    n, d = grads.shape
    body = np.asarray(ids, dtype="<i8").tobytes() + np.asarray(grads, dtype="<f4").tobytes()
    return {"content": body, "headers": {"content-type": OCTET, "x-robez-shape": f"{n},{d}"}}


def test_lr_applies_to_every_table(client: TestClient) -> None:
    three_tables(client)
    local = twins()
    parts = step_parts(0)
    assert client.post("/v1/update?lr=0.5", **binary_many(parts)).status_code == 200
    step_twins(local, parts, 0.5)
    for name in parts:
        assert torch.equal(table_state(client, name)[0]["weight"], local[name].weight)


def test_bad_input_in_one_table_changes_no_table(client: TestClient) -> None:
    three_tables(client)
    before = {name: table_state(client, name) for name in ("a", "b", "c")}

    def refused(case: dict[str, Any], status: int = 422) -> str:
        response = client.post("/v1/update", **case)
        error_of(response, status)
        for name, state in before.items():
            assert_unchanged(client, name, state)
        return response.json()["error"]

    nan_parts = step_parts(1)
    nan_parts["c"][1][2, 1] = math.nan  # the last table's gradients: a and b were fine
    assert "'c'" in refused(binary_many(nan_parts))
    inf_parts = step_parts(1)
    inf_parts["a"][1][0, 0] = math.inf
    refused(binary_many(inf_parts))
    unknown = step_parts(1)
    unknown["nope"] = unknown.pop("b")
    assert "nope" in refused(binary_many(unknown), 404)
    wrong_dim = step_parts(1)
    wrong_dim["c"] = (wrong_dim["c"][0], np.zeros((5, 8), dtype=np.float32))  # c has d = 4
    refused(binary_many(wrong_dim))
    short = binary_many(step_parts(1))
    short["content"] = short["content"][:-4]
    assert "bytes" in refused(short)
    for header, value in [
        ("x-robez-tables", "a=20,b=7"),  # a table fewer than shapes
        ("x-robez-tables", "a=20,b=6,c=5"),  # counts disagree with the shapes
        ("x-robez-tables", "a=20,b=7,a=5"),  # one table twice
        ("x-robez-shapes", "20,8;7,8"),
        ("x-robez-shapes", "20,8;7,x;5,4"),
    ]:
        case = binary_many(step_parts(1))
        case["headers"][header] = value
        refused(case)
    for header in ("x-robez-tables", "x-robez-shapes"):
        case = binary_many(step_parts(1))
        del case["headers"][header]
        refused(case)
    row = [0.1] * 8
    for updates in [
        [
            {"table": "a", "ids": [1], "grads": [row]},
            {"table": "b", "ids": [1, 2], "grads": [row]},
        ],  # lengths
        [
            {"table": "a", "ids": [1], "grads": [row]},
            {"table": "b", "ids": [2**63], "grads": [row]},
        ],  # id range
        [
            {"table": "a", "ids": [1], "grads": [row]},
            {"table": "c", "ids": [1], "grads": [row]},
        ],  # c's d is 4
        [{"table": "a", "ids": [1], "grads": [row]}, {"table": "a", "ids": [2], "grads": [row]}],  # twice
        [{"table": "a", "ids": [1], "grads": [row], "lr": -1}],
    ]:
        refused({"json": {"updates": updates}})
    assert refused({"json": {"updates": [{"table": "zzz", "ids": [1], "grads": [row]}]}}, 404)
    nan_json = (
        b'{"updates": [{"table": "a", "ids": [1], "grads": [[' + b", ".join([b"0.5"] * 8) + b"]]},"
        b' {"table": "b", "ids": [1], "grads": [[NaN' + b", 0.5" * 7 + b"]]}]}"
    )
    refused({"content": nan_json, "headers": {"content-type": "application/json"}})
    refused({"json": {"updates": [{"table": "a", "ids": [1], "grads": [row]}]}, "params": {"lr": "-1"}})


def test_the_limits_apply_to_the_sum_of_the_tables(client_factory: Callable[..., TestClient]) -> None:
    client = client_factory(max_ids_per_request=30)
    three_tables(client)
    before = {name: table_state(client, name) for name in ("a", "b", "c")}
    response = client.post("/v1/update", **binary_many(step_parts(0)))  # 32 ids in all
    error_of(response, 422)
    assert "max_ids_per_request=30" in response.json()["error"]
    small = client_factory(max_body_bytes=1024)
    three_tables(small)
    response = small.post("/v1/update", **binary_many(step_parts(0)))
    error_of(response, 413)
    for name, state in before.items():
        assert_unchanged(client, name, state)


def test_the_client_sends_one_request_with_one_key(client: TestClient) -> None:
    three_tables(client)
    seen: list[httpx.Request] = []
    robez = RobezClient(http_client=client, busy_retries=0)
    client.event_hooks["request"].append(seen.append)
    parts = step_parts(2)
    versions = robez.update_many(
        {name: (torch.from_numpy(i), torch.from_numpy(g)) for name, (i, g) in parts.items()}
    )
    assert versions == {"a": 1, "b": 1, "c": 1}
    (request,) = [r for r in seen if r.url.path == "/v1/update"]
    assert request.headers["idempotency-key"]
    with pytest.raises(RobezClientError) as caught:
        robez.update_many({"a": parts["a"], "zzz": parts["b"]})
    assert caught.value.status == 404
    assert table_state(client, "a")[1] == 1


def test_a_push_over_the_update_limit_is_split_into_groups_of_tables() -> None:
    rows = {
        name: (np.arange(n), np.ones((n, 4), dtype=np.float32)) for name, n in [("a", 3), ("b", 2), ("c", 9)]
    }
    row_bytes = 8 + 4 * 4
    (one,) = update_many_calls(rows, None, "k", None)
    assert one.headers["X-Robez-Tables"] == "a=3,b=2,c=9"
    calls = update_many_calls(rows, None, "k", 5 * row_bytes)
    assert [c.headers["X-Robez-Tables"] for c in calls] == ["a=3,b=2", "c=5", "c=4"]
    assert [c.headers["Idempotency-Key"] for c in calls] == ["k.0", "k.1", "k.2"]
    assert sum(len(c.body()) for c in calls) == 14 * row_bytes
    with pytest.raises(RobezClientError, match="over the server"):
        update_many_calls(rows, None, "k", row_bytes - 1)


def test_a_multi_table_push_needs_the_write_key(client_factory: Callable[..., TestClient]) -> None:
    client = client_factory(api_key="w" * 16, read_api_key="r" * 16)
    three_tables_with = {"authorization": "Bearer " + "w" * 16}
    for name in ("a", "c"):
        payload = {"name": name, "config": {"num_embeddings": 100, "embedding_dim": 8, "memory_size": 256}}
        assert client.post("/v1/tables", json=payload, headers=three_tables_with).status_code == 201
    push = binary_many(
        {"a": (np.arange(2), np.ones((2, 8), np.float32)), "c": (np.arange(1), np.ones((1, 8), np.float32))}
    )
    for path in ("/v1/update", "/v1/update?lr=0.5"):  # the fast path and FastAPI's
        assert error_of(client.post(path, **push), 401) == "UnauthorizedError"
        read_only = {**push, "headers": {**push["headers"], "authorization": "Bearer " + "r" * 16}}
        assert error_of(client.post(path, **read_only), 403) == "ForbiddenError"
    assert table_state(client, "a")[1] == 0
    allowed = {**push, "headers": {**push["headers"], **three_tables_with}}
    assert client.post("/v1/update", **allowed).headers["x-robez-version"] == "1,1"


def test_a_push_of_strided_gradients_is_sent_as_parts_with_its_length() -> None:
    """The body goes out as its parts (no joined copy), framed by Content-Length, bytes as the wire
    format says: each table's ids then its gradients, the gradients gathered from a column view."""
    grad_output = torch.arange(5 * 12, dtype=torch.float32).reshape(5, 12)
    updates: dict[str, tuple[IdsLike, torch.Tensor]] = {
        "a": (torch.arange(5), grad_output[:, 0:4]),
        "b": (np.arange(5) + 9, grad_output[:, 4:12]),
    }
    expected = b"".join(
        np.asarray(ids, dtype="<i8").tobytes() + np.ascontiguousarray(grads, dtype="<f4").tobytes()
        for ids, grads in updates.values()
    )
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(
            200, json={"results": [{"table": "a", "version": 1}, {"table": "b", "version": 1}]}
        )

    (call,) = update_many_calls(updates, None, "k", None)
    assert isinstance(call.content, tuple) and call.body() == expected
    with RobezClient("http://robez.test", transport=httpx.MockTransport(answer)) as robez:
        assert robez.update_many(updates) == {"a": 1, "b": 1}

    async def send_async() -> dict[str, int]:
        async with AsyncRobezClient("http://robez.test", transport=httpx.MockTransport(answer)) as robez:
            return await robez.update_many(updates)

    assert asyncio.run(send_async()) == {"a": 1, "b": 1}
    for request in seen:
        assert (
            request.headers["content-length"] == str(len(expected))
            and "transfer-encoding" not in request.headers
        )
        assert request.content == expected


def test_a_step_that_would_overflow_is_refused_whole_and_leaves_no_mark(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    """Without a data directory a push of one step is checked in the pass that applies it (issue 37):
    one overflowing row among many (a and b over one array: one coalesced step; d alone) is refused,
    naming its tables, with every value as it was, and the next push is applied as version 1 with no
    repair of a dead writer (the refused push's pending marks were cleared)."""
    optimizer = {**ADAGRAD, "max_lr": 3e38}
    create_table(client, "a", optimizer=optimizer)
    response = client.post(
        "/v1/tables",
        json={"name": "b", "config": {**SMALL_TABLE, "val_offset": 1000}, "optimizer": optimizer,
              "share_array_with": "a"},
    )  # fmt: skip
    assert response.status_code == 201, response.text
    create_table(client, "d", optimizer={"name": "adam", "lr": 0.01, "max_lr": 3e38})
    generator = np.random.default_rng(3)
    parts = {
        name: (generator.integers(0, 1000, 100), generator.standard_normal((100, 8)).astype(np.float32))
        for name in ("a", "b")
    }
    before = {name: table_state(client, name) for name in ("a", "b", "d")}
    parts["b"][1][50] = 1e30  # lr 1e10 x 1e30: grad^2 overflows adagrad's sum at this row's locations
    alone = {"d": (parts["a"][0], parts["b"][1])}
    for case, tables in ((parts, "'a', 'b'"), (alone, "")):
        response = client.post("/v1/update", params={"lr": 1e10}, **binary_many(case))
        assert error_of(response, 422) == "InvalidInputError"
        assert "non-finite" in response.json()["error"] and tables in response.json()["error"]
        for name, state in before.items():
            assert_unchanged(client, name, state)
    parts["b"][1][50] = 0.5
    with caplog.at_level("WARNING", logger="robez"):
        response = client.post("/v1/update", **binary_many(parts))
    assert response.status_code == 200, response.text
    assert [result["version"] for result in response.json()["results"]] == [1, 1]
    assert not [r for r in caplog.records if "died" in r.getMessage()]


def with_lookup(case: dict[str, Any], lookups: dict[str, np.ndarray]) -> dict[str, Any]:
    """A binary push (``binary_many``) with a lookup part: ``X-Robez-Lookup`` and the ids after it."""
    body = case["content"] + b"".join(np.asarray(ids, dtype="<i8").tobytes() for ids in lookups.values())
    header = ",".join(f"{name}={len(ids)}" for name, ids in lookups.items())
    return {"content": body, "headers": {**case["headers"], "x-robez-lookup": header}}


def lookup_rows(client: TestClient, lookups: dict[str, np.ndarray]) -> bytes:
    response = client.post(
        "/v1/lookup",
        content=b"".join(np.asarray(ids, dtype="<i8").tobytes() for ids in lookups.values()),
        headers={
            "content-type": OCTET,
            "x-robez-tables": ",".join(f"{name}={len(ids)}" for name, ids in lookups.items()),
        },
    )
    assert response.status_code == 200, response.text
    return response.content


@pytest.mark.parametrize("encoding", ["binary", "json"])
def test_a_push_with_a_lookup_part_answers_the_rows_after_it(
    client_factory: Callable[..., TestClient], encoding: str
) -> None:
    """The lookup part is read once the push is applied (read-your-writes): its rows are those a
    ``/v1/lookup`` sent after the push answers, tables pushed or not, with the push's versions."""
    client = client_factory()
    three_tables(client)
    lookups = {"c": np.array([3, 1, 3]), "a": np.arange(5), "b": np.array([], dtype=np.int64)}
    parts = step_parts(4)
    if encoding == "binary":
        response = client.post("/v1/update", **with_lookup(binary_many(parts), lookups))
    else:
        response = client.post(
            "/v1/update",
            json={
                "updates": [
                    {"table": name, "ids": ids.tolist(), "grads": grads.tolist()}
                    for name, (ids, grads) in parts.items()
                ],
                "lookups": [{"table": name, "ids": ids.tolist()} for name, ids in lookups.items()],
            },
        )
    assert response.status_code == 200, response.text
    assert response.headers["x-robez-version"] == "1,1,1"
    timing = response.headers["server-timing"]
    assert "apply;dur=" in timing and "lookup;dur=" in timing and "lookup_hash;dur=" in timing
    metrics = client.get("/metrics").text  # both parts counted per table: the push's and the lookup's
    assert 'robez_update_apply_seconds_count{table="c"} 1.0' in metrics
    assert 'robez_lookup_seconds_count{table="c"} 1.0' in metrics
    after = lookup_rows(client, lookups)
    if encoding == "binary":
        assert response.headers["content-type"] == OCTET
        assert response.headers["x-robez-shapes"] == "3,4;5,8;0,8"
        assert response.headers["x-robez-lookup-version"] == "1,1,1"
        assert response.content == after
    else:
        body = response.json()
        assert [result["version"] for result in body["results"]] == [1, 1, 1]
        rows = [
            np.asarray(item["embeddings"], dtype="<f4").reshape(item["shape"]) for item in body["lookups"]
        ]
        assert b"".join(row.tobytes() for row in rows) == after
        assert [item["table"] for item in body["lookups"]] == ["c", "a", "b"]
    local = twins()
    step_twins(local, parts, None)
    expected = [local[name].lookup(torch.from_numpy(ids)) for name, ids in lookups.items()]
    assert after == b"".join(rows.numpy().astype("<f4").tobytes() for rows in expected)  # with the push


def test_a_bad_lookup_part_is_refused_before_the_push_is_applied(
    client_factory: Callable[..., TestClient],
) -> None:
    client = client_factory(max_ids_per_request=40)
    three_tables(client)
    before = {name: table_state(client, name) for name in ("a", "b", "c")}

    def refused(case: dict[str, Any], status: int = 422) -> str:
        response = client.post("/v1/update", **case)
        error_of(response, status)
        for name, state in before.items():
            assert_unchanged(client, name, state)
        return str(response.json()["error"])

    assert "nope" in refused(with_lookup(binary_many(step_parts(1)), {"nope": np.arange(2)}), 404)
    assert "max_ids_per_request=40" in refused(with_lookup(binary_many(step_parts(1)), {"a": np.arange(41)}))
    for header in ("a=x", "a=2,,b=1", "", "a=1000"):  # not name=n; or more ids than the body holds
        case = with_lookup(binary_many(step_parts(1)), {"a": np.arange(2)})
        case["headers"]["x-robez-lookup"] = header
        assert "X-Robez-Lookup" in refused(case)
    short = with_lookup(binary_many(step_parts(1)), {"a": np.arange(2)})
    short["content"] = short["content"][:-8]  # the push's bytes then come out short
    refused(short)
    row = [0.1] * 8
    updates = [{"table": "a", "ids": [1], "grads": [row]}]
    assert "zzz" in refused({"json": {"updates": updates, "lookups": [{"table": "zzz", "ids": [1]}]}}, 404)
    for lookup in [
        {"table": "a", "ids": [2**63]},  # outside int64
        {"table": "a", "ids": [1, 2], "offsets": [1]},  # bags must start at 0
        {"table": "a", "ids": [1], "pooling": "max"},
    ]:
        refused({"json": {"updates": updates, "lookups": [lookup]}})
    # The limits count the lookup part as a /v1/lookup of its own: each part within them is accepted.
    response = client.post("/v1/update", **with_lookup(binary_many(step_parts(1)), {"a": np.arange(40)}))
    assert response.status_code == 200, response.text


def test_the_body_limit_counts_the_lookup_part(client_factory: Callable[..., TestClient]) -> None:
    plain = binary_many(step_parts(0))
    small = client_factory(max_body_bytes=len(plain["content"]) + 8)
    three_tables(small)
    before = {name: table_state(small, name) for name in ("a", "b", "c")}
    fits = small.post("/v1/update", **with_lookup(binary_many(step_parts(0)), {"a": np.arange(1)}))
    assert fits.status_code == 200, fits.text
    for name in before:  # applied: the state to compare what follows with
        before[name] = table_state(small, name)
    response = small.post("/v1/update", **with_lookup(binary_many(step_parts(0)), {"a": np.arange(2)}))
    error_of(response, 413)
    assert "max_body_bytes" in response.json()["error"]
    for name, state in before.items():
        assert_unchanged(small, name, state)


def test_the_clients_push_and_pull_in_one_request(client: TestClient) -> None:
    three_tables(client)
    seen: list[httpx.Request] = []
    robez = RobezClient(http_client=client, busy_retries=0)
    client.event_hooks["request"].append(seen.append)
    parts = step_parts(5)
    updates = {name: (torch.from_numpy(i), torch.from_numpy(g)) for name, (i, g) in parts.items()}
    lookups: dict[str, IdsLike] = {"b": torch.tensor([4, 4, 0]), "c": [7]}
    versions, rows = robez.update_and_lookup(updates, lookups, lr=0.5)
    assert versions == {"a": 1, "b": 1, "c": 1}
    (request,) = seen
    assert request.url.path == "/v1/update" and request.headers["idempotency-key"]
    assert request.headers["x-robez-lookup"] == "b=3,c=1"
    assert list(rows) == ["b", "c"] and rows["b"].shape == (3, 8) and rows["c"].shape == (1, 4)
    assert torch.equal(rows["b"], robez.lookup("b", [4, 4, 0])) and torch.equal(
        rows["c"], robez.lookup("c", [7])
    )
    local = twins()
    step_twins(local, parts, 0.5)
    assert torch.equal(rows["c"], local["c"].lookup(torch.tensor([7])))
    with pytest.raises(RobezClientError) as caught:
        robez.update_and_lookup(updates, {"zzz": [1]})
    assert caught.value.status == 404
    assert table_state(client, "a")[1] == 1  # nothing applied

    async def pushed() -> tuple[dict[str, int], dict[str, torch.Tensor]]:
        transport = httpx.ASGITransport(app=client.app)
        async with AsyncRobezClient("http://robez", transport=transport) as async_client:
            return await async_client.update_and_lookup(updates, lookups)

    versions, again = asyncio.run(pushed())
    assert versions == {"a": 2, "b": 2, "c": 2}
    assert torch.equal(again["b"], robez.lookup("b", [4, 4, 0])) and torch.equal(
        again["c"], robez.lookup("c", [7])
    )


def test_a_split_push_sends_its_lookup_part_with_the_last_request() -> None:
    rows = {name: (np.arange(n), np.ones((n, 4), dtype=np.float32)) for name, n in [("a", 3), ("c", 9)]}
    calls = update_many_calls(rows, None, "k", 5 * (8 + 4 * 4), {"a": [1, 2]})
    assert ["X-Robez-Lookup" in c.headers for c in calls] == [False, False, True]
    assert calls[-1].headers["X-Robez-Lookup"] == "a=2" and calls[-1].body().endswith(
        np.array([1, 2], dtype="<i8").tobytes()
    )
