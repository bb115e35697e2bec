"""Property-based API fuzzing from the app's own OpenAPI schema: no request may produce a 5xx."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings

from service.app import create_app
from service.config import Settings

pytestmark = pytest.mark.slow

# Tight limits so generated create requests stay small (tables live in a temp dir on disk here).
FUZZ_LIMITS: dict[str, Any] = {
    "max_memory_size": 1 << 18,
    "max_total_memory_bytes": 16 << 20,
    "max_tables": 8,
    "max_ids_per_request": 4096,
    "max_values_per_request": 1 << 18,
    "max_embedding_dim": 256,
    "threads_per_worker": 1,
}

schema = schemathesis.openapi.from_dict(create_app(Settings(**FUZZ_LIMITS)).openapi())


@pytest.fixture(scope="module")
def fuzz_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    app = create_app(Settings(shm_dir=tmp_path_factory.mktemp("shm"), **FUZZ_LIMITS))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def _send(client: TestClient, case: schemathesis.Case) -> Any:
    """Send a generated case through our own client (so the app's lifespan is ours to start and stop)."""
    kwargs = case.as_transport_kwargs(base_url="http://testserver")
    content = kwargs.get("data")
    if content is None and "json" in kwargs:
        content = json.dumps(kwargs["json"], allow_nan=True)
    return client.request(
        kwargs["method"],
        kwargs["url"],
        params=kwargs.get("params"),
        headers={k: str(v) for k, v in (kwargs.get("headers") or {}).items()},
        content=content.encode() if isinstance(content, str) else content,
    )


@schema.parametrize()
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
    ],
)
def test_no_server_errors(case: schemathesis.Case, fuzz_client: TestClient) -> None:
    response = _send(fuzz_client, case)
    assert response.status_code < 500, (
        f"{case.method} {case.formatted_path}: {response.status_code} {response.text}"
    )
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error", "error_type"}, body
