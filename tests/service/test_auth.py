"""Bearer keys: writes need the write key (401 without, 403 wrong); an optional read key guards reads."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from pydantic import ValidationError

from .conftest import SMALL_TABLE, assert_unchanged, error_of, make_settings, table_state

WRITE_KEY = "w-secret-0123456789"
READ_KEY = "r-secret-9876543210"


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_writes_need_the_write_key(client_factory, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    client = client_factory(api_key=WRITE_KEY)
    before = table_state(client, "demo")
    update = {"ids": [1], "grads": [[0.5] * 64]}
    create = {"name": "t", "config": SMALL_TABLE}
    writes = [
        ("post", "/v1/tables/demo/update", update),
        ("post", "/v1/tables", create),
        ("delete", "/v1/tables/demo", None),
    ]
    for method, path, payload in writes:
        kwargs = {"json": payload} if payload is not None else {}
        response = getattr(client, method)(path, **kwargs)
        assert error_of(response, 401) == "UnauthorizedError"
        assert response.headers["www-authenticate"] == "Bearer"
        for wrong in (
            bearer("nope"),
            bearer(WRITE_KEY + "x"),
            {"authorization": WRITE_KEY},
            bearer(READ_KEY),
        ):
            response = getattr(client, method)(path, headers=wrong, **kwargs)
            assert response.status_code in (401, 403), response.text
        assert (
            error_of(getattr(client, method)(path, headers=bearer("nope"), **kwargs), 403) == "ForbiddenError"
        )
    assert_unchanged(client, "demo", before)
    assert client.get("/v1/tables").json()["tables"][0]["name"] == "demo"
    # Reads stay open without a read key; the right key writes.
    assert client.post("/v1/tables/demo/lookup", json={"ids": [1]}).status_code == 200
    assert (
        client.post("/v1/tables/demo/update", json=update, headers=bearer(WRITE_KEY)).json()["version"] == 1
    )
    assert client.post("/v1/tables", json=create, headers=bearer(WRITE_KEY)).status_code == 201
    assert client.delete("/v1/tables/t", headers=bearer(WRITE_KEY)).status_code == 204
    assert WRITE_KEY not in caplog.text


def test_read_key_guards_lookups_and_reads(client_factory) -> None:
    client = client_factory(api_key=WRITE_KEY, read_api_key=READ_KEY)
    reads: list[tuple[str, str, Any]] = [
        ("post", "/v1/tables/demo/lookup", {"ids": [1]}),
        ("get", "/v1/tables", None),
        ("get", "/v1/tables/demo", None),
        ("post", "/v1/lookup", {"lookups": [{"table": "demo", "ids": [1]}]}),
    ]
    for method, path, payload in reads:
        kwargs = {"json": payload} if payload is not None else {}
        error_of(getattr(client, method)(path, **kwargs), 401)
        error_of(getattr(client, method)(path, headers=bearer("nope"), **kwargs), 403)
        assert getattr(client, method)(path, headers=bearer(READ_KEY), **kwargs).status_code == 200
        assert getattr(client, method)(path, headers=bearer(WRITE_KEY), **kwargs).status_code == 200
    # The read key does not grant writes; probes stay open.
    error_of(
        client.post("/v1/tables/demo/update", json={"ids": [], "grads": []}, headers=bearer(READ_KEY)), 403
    )
    for path in ("/healthz", "/readyz", "/metrics"):
        assert client.get(path).status_code == 200


def test_empty_key_is_refused(tmp_path) -> None:
    with pytest.raises(ValidationError):
        make_settings(tmp_path, api_key="")
    assert WRITE_KEY not in repr(make_settings(tmp_path, api_key=WRITE_KEY))
