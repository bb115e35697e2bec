"""The client and RemoteEmbedding against the real app, in-process (TestClient as the client's session).

Every server-side result is compared with a local twin: a ``robez_core`` Table built from the same
config (same seed, so the same initial array) and updated with ``Table.apply_gradients``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from robez_core import OptimizerConfig, TableConfig
from robez_core.table import Table
from service.client import (
    AsyncRobezClient,
    RemoteEmbedding,
    RemoteEmbeddingBag,
    RobezClient,
    RobezClientError,
)

CONFIG: dict[str, Any] = {
    "num_embeddings": 1000,
    "embedding_dim": 8,
    "memory_size": 4096,
    "chunk_size": 4,
    "seed": 7,
}
ADAGRAD = {"name": "adagrad", "lr": 0.05}
# Same kernels on both sides, but a parallel reduction may sum duplicates in another order.
ATOL = 1e-6


def twin(optimizer: dict[str, Any] = ADAGRAD) -> Table:
    return Table(TableConfig(**CONFIG), OptimizerConfig(**optimizer))


@pytest.fixture
def app_client(client_factory: Callable[..., TestClient]) -> TestClient:
    return client_factory()


@pytest.fixture
def robez(app_client: TestClient) -> RobezClient:
    client = RobezClient(http_client=app_client)
    client.create_table("t", CONFIG, ADAGRAD)
    return client


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    assert torch.allclose(actual, expected, rtol=0, atol=ATOL), (actual - expected).abs().max()


def test_control_calls(robez: RobezClient) -> None:
    assert robez.health()["status"] == "ok"
    assert robez.ready()["status"] == "ready"
    assert {info["name"] for info in robez.tables()} == {"demo", "t"}
    info = robez.table("t")
    assert info["config"]["embedding_dim"] == 8
    assert info["optimizer"]["name"] == "adagrad"
    assert info["version"] == 0
    robez.delete_table("t")
    with pytest.raises(RobezClientError) as caught:
        robez.table("t")
    assert (caught.value.status, caught.value.error_type) == (404, "NotFoundError")


def test_lookup_matches_local_table(robez: RobezClient) -> None:
    ids = torch.tensor([0, 5, -3, 2**62, 5, 999_999_999])
    rows = robez.lookup("t", ids)
    assert rows.dtype == torch.float32
    assert torch.equal(rows, twin().lookup(ids))
    assert set(robez.last_timing) == {"hash", "lookup", "total"}
    assert all(value >= 0 for value in robez.last_timing.values())
    assert robez.last_version == 0


def test_update_is_applied_like_table_apply_gradients(robez: RobezClient) -> None:
    local = twin()
    generator = torch.Generator().manual_seed(1)
    probe = torch.arange(50)
    for step in range(1, 4):
        ids = torch.randint(0, 20, (30,), generator=generator)  # plenty of duplicates
        grads = torch.randn(30, 8, generator=generator)
        lr = 0.2 if step == 2 else None
        assert robez.update("t", ids, grads, lr=lr) == step
        local.apply_gradients(ids, grads, lr=lr)
        assert set(robez.last_timing) == {"hash", "apply", "total"}
        assert_close(robez.lookup("t", probe), local.lookup(probe))
    assert robez.table("t")["version"] == 3


def test_lookup_many_and_pooled_match_local_table(robez: RobezClient) -> None:
    local = twin()
    demo = robez.lookup("demo", [1, 2])
    rows = robez.lookup_many({"t": torch.tensor([3, 4, 3]), "demo": [1, 2]})
    assert torch.equal(rows["t"], local.lookup(torch.tensor([3, 4, 3])))
    assert torch.equal(rows["demo"], demo)
    ids, offsets = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 2, 2])
    weights = torch.tensor([0.5, 1.0, 2.0, -1.0, 0.25])
    for pooling in ("sum", "mean"):
        pooled = robez.lookup_pooled("t", ids, offsets, pooling=pooling)
        assert_close(pooled, local.lookup_bag(ids, offsets, mode=pooling))
    weighted = robez.lookup_pooled("t", ids, offsets, per_sample_weights=weights)
    assert_close(weighted, local.lookup_bag(ids, offsets, per_sample_weights=weights))


def test_errors_carry_status_and_type_and_change_nothing(robez: RobezClient) -> None:
    before = robez.lookup("t", torch.arange(20))
    cases: list[tuple[Callable[[], object], int, str]] = [
        (lambda: robez.lookup("missing", [1]), 404, "NotFoundError"),
        (lambda: robez.update("t", [1], torch.tensor([[float("nan")] * 8])), 422, "InvalidInputError"),
        (lambda: robez.update("t", [1, 2], torch.ones(2, 3)), 422, "InvalidInputError"),
        (lambda: robez.update("t", [1], torch.ones(1, 8), lr=-1.0), 422, ""),
        (lambda: robez.create_table("t", CONFIG), 409, "ConflictError"),
        (lambda: robez.create_table("bad/name", CONFIG), 422, ""),
    ]
    for call, status, error_type in cases:
        with pytest.raises(RobezClientError) as caught:
            call()
        assert caught.value.status == status, caught.value
        if error_type:
            assert caught.value.error_type == error_type
        assert caught.value.error
    assert robez.table("t")["version"] == 0
    assert torch.equal(robez.lookup("t", torch.arange(20)), before)


def test_api_key(client_factory: Callable[..., TestClient]) -> None:
    app_client = client_factory(api_key="s3cret")
    for key, status in ((None, 401), ("wrong", 403)):
        with pytest.raises(RobezClientError) as caught:
            RobezClient(api_key=key, http_client=app_client).update("demo", [1], torch.ones(1, 64))
        assert caught.value.status == status
    assert RobezClient(api_key="s3cret", http_client=app_client).update("demo", [1], torch.ones(1, 64)) == 1


def test_remote_embedding_trains_the_server_table(robez: RobezClient) -> None:
    """One forward/backward through RemoteEmbedding == autograd on a local twin + apply_gradients."""
    local = twin()
    embedding = RemoteEmbedding(robez, "t")
    assert embedding.embedding_dim == 8
    ids = torch.tensor([[1, 7, 1], [9, 7, 7]])
    target = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(2))

    out = embedding(ids)
    local_rows = local.lookup(ids.reshape(-1)).requires_grad_(True)
    assert torch.equal(out.reshape(-1, 8), local_rows.detach())
    ((out - target) ** 2).mean().backward()
    ((local_rows.reshape(2, 3, 8) - target) ** 2).mean().backward()
    assert local_rows.grad is not None
    local.apply_gradients(ids.reshape(-1), local_rows.grad)

    assert embedding.pushes == 1
    assert embedding.last_version == 1
    assert set(embedding.last_push_timing) == {"hash", "apply", "total"}
    probe = torch.arange(12)
    assert_close(robez.lookup("t", probe), local.lookup(probe))

    # lr override: a second step at lr 0.5 must match the twin stepping at 0.5.
    embedding.lr = 0.5
    out = embedding(torch.tensor([3]))
    local_rows = local.lookup(torch.tensor([3])).requires_grad_(True)
    out.sum().backward()
    local_rows.sum().backward()
    assert local_rows.grad is not None
    local.apply_gradients(torch.tensor([3]), local_rows.grad, lr=0.5)
    assert_close(robez.lookup("t", probe), local.lookup(probe))


def test_remote_embedding_bag_trains_the_server_table(robez: RobezClient) -> None:
    local = twin()
    bag = RemoteEmbeddingBag(robez, "t", mode="mean")
    ids, offsets = torch.tensor([4, 5, 4, 6]), torch.tensor([0, 3])
    pooled = bag(ids, offsets)
    local_rows = local.lookup(ids).requires_grad_(True)
    local_pooled = torch.stack([local_rows[:3].mean(0), local_rows[3:].mean(0)])
    assert_close(pooled, local_pooled.detach())
    pooled.sum().backward()
    local_pooled.sum().backward()
    assert local_rows.grad is not None
    local.apply_gradients(ids, local_rows.grad)
    assert_close(robez.lookup("t", torch.arange(10)), local.lookup(torch.arange(10)))


def test_async_client_against_app(robez: RobezClient, app_client: TestClient) -> None:
    """The async twin over ASGI, while the TestClient keeps the app (and its tables) started."""
    local = twin()
    ids, grads = torch.tensor([2, 3, 2]), torch.ones(3, 8)
    local.apply_gradients(ids, grads, lr=0.1)

    async def scenario() -> torch.Tensor:
        transport = httpx.ASGITransport(app=app_client.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            client = AsyncRobezClient(http_client=http)
            assert await client.update("t", ids, grads, lr=0.1) == 1
            rows = await asyncio.gather(*(client.lookup("t", torch.arange(6)) for _ in range(4)))
            for other in rows[1:]:
                assert torch.equal(other, rows[0])
            return rows[0]

    assert_close(asyncio.run(scenario()), local.lookup(torch.arange(6)))
