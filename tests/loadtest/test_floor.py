"""The framework floor app: the trivial route and the large answer of a binary lookup's size."""

from __future__ import annotations

from starlette.testclient import TestClient

from loadtest.floor import MAX_ROWS, app, rows_body


def test_trivial_route() -> None:
    with TestClient(app) as client:
        reply = client.get("/")
    assert (reply.status_code, reply.text) == (200, "ok")


def test_rows_route_answers_the_lookup_size_with_its_headers() -> None:
    ids = bytes(8 * 4096)
    with TestClient(app) as client:
        headers = {"Content-Type": "application/octet-stream"}
        reply = client.post("/rows/4096/64", content=ids, headers=headers)
        small = client.post("/rows/3/2", content=bytes(24))
    assert reply.status_code == 200 and len(reply.content) == 4096 * 64 * 4  # 1 MiB, as robez answers
    assert reply.headers["content-type"] == "application/octet-stream"
    assert reply.headers["x-robez-shape"] == "4096,64" and reply.headers["x-robez-version"] == "0"
    assert reply.headers["server-timing"].startswith("hash;dur=")
    assert small.content == bytes(24) and small.headers["x-robez-shape"] == "3,2"
    assert rows_body(4096, 64) is rows_body(4096, 64)  # built once per size


def test_rows_route_refuses_bad_sizes() -> None:
    with TestClient(app) as client:
        assert client.post(f"/rows/{MAX_ROWS + 1}/64").status_code == 400
        assert client.post("/rows/0/64").status_code == 400
        assert client.post("/rows/4/0").status_code == 400
        assert client.post("/rows/x/64").status_code == 404
        assert client.get("/rows/4/64").status_code == 405
