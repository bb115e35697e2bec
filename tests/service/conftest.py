"""Fixtures for the service tests: an in-process app (TestClient) over shared memory in a temp dir."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from service.faults import Faults
from service.store import TableStore

from .forked import ForkedPython

if TYPE_CHECKING:  # threaded_server imports make_settings from here
    from .threaded_server import ThreadedServer

# GRPC_ENGINE_UNDER_TEST=grpcio runs every in-process gRPC test on that engine, not the default (ROBEZ_* are
# cleared for each test, so the switch has a name of its own).
GRPC_ENGINE_UNDER_TEST = os.environ.get("GRPC_ENGINE_UNDER_TEST")

SMALL_TABLE = {"num_embeddings": 1000, "embedding_dim": 8, "memory_size": 4096, "chunk_size": 4}


def make_settings(tmp_path: Path, **overrides: Any) -> Settings:
    """Settings isolated from the environment and from /dev/shm; demo table on unless overridden."""
    values: dict[str, Any] = {"shm_dir": tmp_path / "shm", "threads_per_worker": 1, **overrides}
    if GRPC_ENGINE_UNDER_TEST is not None:
        values.setdefault("grpc_engine", GRPC_ENGINE_UNDER_TEST)
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


@pytest.fixture(autouse=True)
def _no_robez_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A developer's ROBEZ_* variables must not change what the tests see."""
    for name in list(os.environ):
        if name.startswith("ROBEZ_"):
            monkeypatch.delenv(name)


@pytest.fixture(scope="session")
def forked_python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkedPython]:
    """Scripts run as forks of one process that imported robez (``forked.py``): one per test process."""
    forks = ForkedPython(tmp_path_factory.mktemp("forked"))
    try:
        yield forks
    finally:
        forks.close()


@pytest.fixture
def client_factory(tmp_path: Path) -> Iterator[Callable[..., TestClient]]:
    """Start apps with custom settings; every one is shut down (and its shared memory removed) after."""
    clients: list[TestClient] = []

    def start(**overrides: Any) -> TestClient:
        # Hooks of its own, all off: a test may turn one on on this app's store (``store.faults``).
        app = create_app(make_settings(tmp_path, **overrides), faults=Faults())
        client = TestClient(app, raise_server_exceptions=False)
        client.__enter__()
        clients.append(client)
        return client

    yield start
    for client in reversed(clients):
        client.__exit__(None, None, None)


@pytest.fixture
def grpc_server(tmp_path: Path) -> Iterator[Callable[..., tuple[ThreadedServer, str]]]:
    """In-process apps serving gRPC on a port the OS picks: (server, its gRPC address)."""
    from .threaded_server import app_server

    servers: list[ThreadedServer] = []

    def start(**settings: object) -> tuple[ThreadedServer, str]:
        server = app_server(tmp_path / str(len(servers)), grpc_port=0, **settings)
        servers.append(server)
        return server, f"127.0.0.1:{server.server.config.loaded_app.app.state.grpc_port}"  # type: ignore[union-attr]

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def client(client_factory: Callable[..., TestClient]) -> TestClient:
    return client_factory()


def store_of(client: TestClient) -> TableStore:
    store: TableStore = client.app.state.store  # type: ignore[attr-defined]
    return store


def table_state(client: TestClient, name: str) -> tuple[dict[str, torch.Tensor], int]:
    """A copy of a table's array, optimizer state and version, to check that a request changed nothing."""
    store = store_of(client)
    return {key: t.clone() for key, t in store.table(name).tensors().items()}, store.version(name)


def assert_unchanged(client: TestClient, name: str, before: tuple[dict[str, torch.Tensor], int]) -> None:
    tensors, version = table_state(client, name)
    assert version == before[1]
    assert tensors.keys() == before[0].keys()
    for key, tensor in tensors.items():
        assert torch.equal(tensor, before[0][key]), f"{key} changed"


def create_table(
    client: TestClient, name: str, optimizer: dict[str, Any] | None = None, **config: Any
) -> Any:
    payload: dict[str, Any] = {"name": name, "config": {**SMALL_TABLE, **config}}
    if optimizer is not None:
        payload["optimizer"] = optimizer
    response = client.post("/v1/tables", json=payload)
    assert response.status_code == 201, response.text
    return response.json()


def error_of(response: Any, status: int) -> str:
    """Asserts the status and the one error body shape; returns the error_type."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error", "error_type"}, body
    assert isinstance(body["error"], str) and body["error"]
    return str(body["error_type"])
