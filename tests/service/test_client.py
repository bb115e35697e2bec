"""Client wire format, error mapping and RemoteEmbedding, against httpx.MockTransport fakes.

Tests against the real app (in-process and as a subprocess) are in test_client_app.py.
"""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from service.client import (
    SHAPE_HEADER,
    SHAPES_HEADER,
    TABLES_HEADER,
    AsyncRobezClient,
    RemoteEmbedding,
    RemoteEmbeddingBag,
    RobezClient,
    RobezClientError,
    decode_rows,
    encode_ids,
    encode_rows,
    encode_update,
    parse_server_timing,
)

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)


# --- wire encoding ------------------------------------------------------------------------------


@given(st.lists(INT64, max_size=50))
def test_encode_ids_is_little_endian_int64(ids: list[int]) -> None:
    body, n = encode_ids(ids)
    assert n == len(ids)
    assert len(body) == 8 * n
    assert [int.from_bytes(body[8 * i : 8 * i + 8], "little", signed=True) for i in range(n)] == ids
    assert encode_ids(torch.tensor(ids, dtype=torch.int64))[0] == body
    assert encode_ids(np.array(ids, dtype=np.int64))[0] == body


def test_encode_ids_accepts_other_integer_dtypes() -> None:
    assert encode_ids(torch.tensor([1, 2], dtype=torch.int32))[0] == encode_ids([1, 2])[0]
    assert encode_ids(np.array([7], dtype=np.uint8))[0] == (7).to_bytes(8, "little")


@pytest.mark.parametrize(
    "bad",
    [
        [2**63],
        [-(2**63) - 1],
        [1.5, 2.0],
        torch.tensor([1.0]),
        torch.tensor([True]),
        [[1, 2], [3, 4]],
        np.array([2**64 - 1], dtype=np.uint64),
    ],
)
def test_encode_ids_rejects_non_int64(bad: object) -> None:
    with pytest.raises(ValueError):
        encode_ids(bad)  # type: ignore[arg-type]


@given(
    hnp.arrays(
        np.float32,
        hnp.array_shapes(min_dims=2, max_dims=2, min_side=0, max_side=9),
        elements=st.floats(width=32, allow_nan=True, allow_infinity=True),
    )
)
def test_rows_round_trip_bitwise(rows: np.ndarray) -> None:
    body, shape = encode_rows(rows)
    assert shape == rows.shape
    decoded = decode_rows(body, shape)
    assert decoded.dtype == torch.float32
    assert tuple(decoded.shape) == rows.shape
    # Bitwise, so NaN payloads and -0.0 survive too.
    assert decoded.numpy().view(np.int32).tolist() == rows.view(np.int32).tolist()
    decoded += 1  # the tensor owns writable memory, not the response's bytes


def test_decode_rows_reads_little_endian() -> None:
    body = np.array([[1.0, -2.5]], dtype=">f4").astype("<f4").tobytes()
    assert decode_rows(body, (1, 2)).tolist() == [[1.0, -2.5]]


def test_decode_rows_rejects_length_mismatch() -> None:
    with pytest.raises(ValueError, match="needs 24"):
        decode_rows(b"\0" * 20, (2, 3))


@given(st.integers(0, 6), st.integers(1, 5), st.data())
def test_encode_update_layout(n: int, d: int, data: st.DataObject) -> None:
    ids = data.draw(st.lists(INT64, min_size=n, max_size=n))
    grads = torch.randn(n, d)
    body, shape = encode_update(ids, grads)
    assert shape == f"{n},{d}"
    assert body[: 8 * n] == encode_ids(ids)[0]
    assert torch.equal(decode_rows(body[8 * n :], (n, d)), grads)


def test_encode_update_rejects_row_count_mismatch() -> None:
    with pytest.raises(ValueError, match="2 rows for 3 ids"):
        encode_update([1, 2, 3], torch.zeros(2, 4))
    with pytest.raises(ValueError, match="2-D"):
        encode_update([1], torch.zeros(4))


def test_parse_server_timing() -> None:
    header = 'hash;dur=0.125, lookup;desc="gather";dur=1.5,total;dur=2, broken;dur=x, nodur'
    assert parse_server_timing(header) == {"hash": 0.125, "lookup": 1.5, "total": 2.0}
    assert parse_server_timing(None) == {}


# --- a fake server over MockTransport --------------------------------------------------------------


class FakeServer:
    """Just enough of the HTTP API to exercise the client: one table, sgd updates, recorded requests."""

    def __init__(self, num_rows: int = 50, dim: int = 4, lr: float = 0.1) -> None:
        generator = torch.Generator().manual_seed(0)
        self.rows = torch.randn(num_rows, dim, generator=generator)
        self.lr = lr
        self.version = 0
        self.requests: list[httpx.Request] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        timing = {"Server-Timing": "hash;dur=0.5, lookup;dur=1.25, total;dur=2"}
        if path == "/v1/tables/t":
            return httpx.Response(200, json={"name": "t", "config": {"embedding_dim": self.rows.shape[1]}})
        if path == "/v1/tables/t/lookup":
            lookup_ids = torch.from_numpy(np.frombuffer(request.content, dtype="<i8").copy())
            rows = self.rows[lookup_ids]
            body, (n, d) = encode_rows(rows)
            return httpx.Response(200, content=body, headers={SHAPE_HEADER: f"{n},{d}", **timing})
        if path == "/v1/tables/t/update":
            n, d = (int(v) for v in request.headers[SHAPE_HEADER].split(","))
            update_ids = torch.from_numpy(np.frombuffer(request.content[: 8 * n], dtype="<i8").copy())
            grads = decode_rows(request.content[8 * n :], (n, d))
            lr = float(request.url.params.get("lr", self.lr))
            self.rows.index_add_(0, update_ids, grads, alpha=-lr)
            self.version += 1
            return httpx.Response(200, json={"version": self.version}, headers=timing)
        return httpx.Response(404, json={"error": f"no route {path}", "error_type": "NotFoundError"})

    def client(self, **kwargs: object) -> RobezClient:
        return RobezClient("http://fake", transport=httpx.MockTransport(self.handler), **kwargs)  # type: ignore[arg-type]

    def updates(self) -> list[httpx.Request]:
        return [r for r in self.requests if r.url.path.endswith("/update")]


def test_lookup_sends_binary_and_decodes_rows() -> None:
    server = FakeServer()
    client = server.client(api_key="secret")
    rows = client.lookup("t", torch.tensor([3, 1, 3]))
    assert torch.equal(rows, server.rows[[3, 1, 3]])
    request = server.requests[-1]
    assert request.method == "POST"
    assert request.headers["Content-Type"] == "application/octet-stream"
    assert request.headers["Authorization"] == "Bearer secret"
    assert request.content == encode_ids([3, 1, 3])[0]
    assert client.last_timing == {"hash": 0.5, "lookup": 1.25, "total": 2.0}


def test_update_sends_shape_lr_and_returns_version() -> None:
    server = FakeServer()
    client = server.client()
    before = server.rows.clone()
    grads = torch.ones(2, 4)
    assert client.update("t", [5, 6], grads, lr=0.5) == 1
    request = server.requests[-1]
    assert request.headers[SHAPE_HEADER] == "2,4"
    assert request.url.params["lr"] == "0.5"
    assert torch.allclose(server.rows[[5, 6]], before[[5, 6]] - 0.5)
    assert client.last_version == 1
    client.update("t", [5], torch.ones(1, 4))
    assert "lr" not in server.requests[-1].url.params


def test_table_name_cannot_add_path_segments() -> None:
    server = FakeServer()
    with pytest.raises(RobezClientError):
        server.client().lookup("../t", [1])
    assert server.requests[-1].url.raw_path.startswith(b"/v1/tables/..%2Ft/")


def test_no_auth_header_without_key() -> None:
    server = FakeServer()
    server.client().lookup("t", [1])
    assert "Authorization" not in server.requests[-1].headers


@pytest.mark.parametrize(
    ("status", "body", "headers", "error", "error_type", "retry_after"),
    [
        (
            404,
            {"error": "no table 'x'", "error_type": "NotFoundError"},
            {},
            "no table 'x'",
            "NotFoundError",
            None,
        ),
        (
            422,
            {"error": "grads NaN", "error_type": "InvalidInputError"},
            {},
            "grads NaN",
            "InvalidInputError",
            None,
        ),
        (503, {"error": "busy", "error_type": "BusyError"}, {"Retry-After": "2"}, "busy", "BusyError", 2.0),
        (502, b"Bad Gateway", {}, "Bad Gateway", None, None),
    ],
)
def test_error_mapping(
    status: int,
    body: object,
    headers: dict[str, str],
    error: str,
    error_type: str | None,
    retry_after: float | None,
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if isinstance(body, bytes):
            return httpx.Response(status, content=body, headers=headers)
        return httpx.Response(status, json=body, headers=headers)

    # busy_retries=0: the 503 case must surface at once (its Retry-After would make retries sleep)
    client = RobezClient("http://fake", busy_retries=0, transport=httpx.MockTransport(handler))
    for call in (
        lambda: client.lookup("x", [1]),
        lambda: client.table("x"),
        lambda: client.delete_table("x"),
    ):
        with pytest.raises(RobezClientError) as caught:
            call()
        assert caught.value.status == status
        assert caught.value.error == error
        assert caught.value.error_type == error_type
        assert caught.value.retry_after == retry_after


@pytest.mark.parametrize("busy_retries", [0, 1, 3])
def test_busy_answers_are_retried_then_raised(busy_retries: int) -> None:
    answers: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        answers.append(503)
        # Retry-After: 0 keeps the test instant; the client honours what the server asks.
        return httpx.Response(
            503, json={"error": "busy", "error_type": "BusyError"}, headers={"Retry-After": "0"}
        )

    client = RobezClient("http://fake", busy_retries=busy_retries, transport=httpx.MockTransport(handler))
    with pytest.raises(RobezClientError) as caught:
        client.update("t", [1], torch.ones(1, 4))
    assert caught.value.status == 503
    assert len(answers) == busy_retries + 1


def test_busy_then_served_sends_the_same_request_again() -> None:
    server = FakeServer()
    bodies: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(request.content)
        if len(bodies) == 1:
            return httpx.Response(
                503, json={"error": "busy", "error_type": "BusyError"}, headers={"Retry-After": "0"}
            )
        return server.handler(request)

    async def scenario() -> int:
        async with AsyncRobezClient("http://fake", transport=httpx.MockTransport(handler)) as client:
            return await client.update("t", [1], torch.ones(1, 4))

    assert RobezClient("http://fake", transport=httpx.MockTransport(handler)).lookup("t", [2]).shape == (1, 4)
    bodies.clear()
    assert asyncio.run(scenario()) == 1
    assert len(bodies) == 2 and bodies[0] == bodies[1]
    assert server.version == 1  # applied once
    with pytest.raises(ValueError):
        RobezClient(busy_retries=-1)


def test_malformed_lookup_response_is_a_client_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"\0" * 12, headers={SHAPE_HEADER: "1,4"})

    with pytest.raises(RobezClientError, match="needs 16") as caught:
        RobezClient("http://fake", transport=httpx.MockTransport(handler)).lookup("t", [1])
    assert caught.value.error_type == "ClientDecodeError"


def test_json_calls() -> None:
    seen: list[tuple[str, str, object]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        payload = json.loads(request.content) if request.content else None
        seen.append((request.method, request.url.path, payload))
        if request.url.path == "/v1/tables" and request.method == "GET":
            return httpx.Response(200, json={"tables": [{"name": "a"}]})
        if request.url.path == "/v1/tables/a/lookup":
            return httpx.Response(200, json={"table": "a", "shape": [2, 1], "embeddings": [[1.0], [2.0]]})
        if request.method == "DELETE":
            return httpx.Response(204)
        return httpx.Response(200, json={"status": "ok", "name": "a"})

    client = RobezClient("http://fake", transport=httpx.MockTransport(handler))
    assert client.tables() == [{"name": "a"}]
    assert client.health() == {"status": "ok", "name": "a"}
    pooled = client.lookup_pooled("a", torch.tensor([1, 2, 3]), [0, 2], pooling="mean")
    assert pooled.tolist() == [[1.0], [2.0]]
    assert seen[-1][2] == {"ids": [1, 2, 3], "offsets": [0, 2], "pooling": "mean", "per_sample_weights": None}
    client.create_table(
        "a", {"embedding_dim": 2, "memory_size": 64}, {"name": "adagrad"}, share_array_with="b"
    )
    assert seen[-1] == (
        "POST",
        "/v1/tables",
        {
            "name": "a",
            "config": {"embedding_dim": 2, "memory_size": 64},
            "optimizer": {"name": "adagrad"},
            "share_array_with": "b",
        },
    )
    client.delete_table("a")
    assert seen[-1][:2] == ("DELETE", "/v1/tables/a")


def test_lookup_many_is_one_binary_request() -> None:
    requests: list[httpx.Request] = []
    tables = {"a": torch.randn(10, 2), "b": torch.randn(10, 3), "c": torch.randn(10, 4)}

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        ids = torch.from_numpy(np.frombuffer(request.content, dtype="<i8").copy())
        counts = [
            (name, int(n)) for name, n in (p.split("=") for p in request.headers[TABLES_HEADER].split(","))
        ]
        bodies, shapes = [], []
        for (name, _), part in zip(counts, torch.split(ids, [n for _, n in counts]), strict=True):
            body, (n, d) = encode_rows(tables[name][part])
            bodies.append(body)
            shapes.append(f"{n},{d}")
        return httpx.Response(200, content=b"".join(bodies), headers={SHAPES_HEADER: ";".join(shapes)})

    client = RobezClient("http://fake", transport=httpx.MockTransport(handler))
    rows = client.lookup_many({"a": [1, 2, 3], "b": torch.tensor([9]), "c": []})
    assert len(requests) == 1
    assert requests[0].headers[TABLES_HEADER] == "a=3,b=1,c=0"
    assert torch.equal(rows["a"], tables["a"][[1, 2, 3]])
    assert torch.equal(rows["b"], tables["b"][[9]])
    assert rows["c"].shape == (0, 4)


def test_lookup_many_rejects_inconsistent_response() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"\0" * 12, headers={SHAPES_HEADER: "1,2"})

    client = RobezClient("http://fake", transport=httpx.MockTransport(handler))
    with pytest.raises(RobezClientError, match="1 shapes for 2 tables"):
        client.lookup_many({"a": [1], "b": [2]})
    with pytest.raises(RobezClientError, match="shapes need 8"):
        client.lookup_many({"a": [1]})


def test_async_client_matches_sync() -> None:
    server = FakeServer()

    async def scenario() -> tuple[torch.Tensor, int, dict[str, float]]:
        transport = httpx.MockTransport(server.handler)
        async with AsyncRobezClient("http://fake", api_key="k", transport=transport) as client:
            rows = await client.lookup("t", [2, 4])
            version = await client.update("t", [2], torch.ones(1, 4), lr=1.0)
            with pytest.raises(RobezClientError) as caught:
                await client.table("missing")
            assert caught.value.status == 404
            return rows, version, client.last_timing

    before = server.rows.clone()
    rows, version, timing = asyncio.run(scenario())
    assert torch.equal(rows, before[[2, 4]])
    assert version == 1
    assert torch.allclose(server.rows[2], before[2] - 1.0)
    assert timing == {}  # the 404 carried no Server-Timing
    assert server.requests[0].headers["Authorization"] == "Bearer k"


# --- RemoteEmbedding ------------------------------------------------------------------------------


def test_remote_embedding_forward_matches_server_rows() -> None:
    server = FakeServer()
    embedding = RemoteEmbedding(server.client(), "t")
    assert embedding.embedding_dim == 4
    ids = torch.tensor([[1, 2, 1], [7, 7, 0]])
    out = embedding(ids)
    assert out.shape == (2, 3, 4)
    assert torch.equal(out, server.rows[ids])
    # Each distinct id crossed the wire once.
    lookup = server.requests[-1]
    assert sorted(np.frombuffer(lookup.content, dtype="<i8").tolist()) == [0, 1, 2, 7]


def test_remote_embedding_backward_pushes_summed_gradients() -> None:
    server = FakeServer(lr=0.1)
    embedding = RemoteEmbedding(server.client(), "t", embedding_dim=4)
    weight = server.rows.clone().requires_grad_(True)  # a local twin to compare gradients with
    ids = torch.tensor([3, 9, 3, 3, 0])
    target = torch.randn(5, 4)

    loss = ((embedding(ids) - target) ** 2).sum()
    assert not server.updates()  # forward alone pushes nothing
    loss.backward()
    ((weight[ids] - target) ** 2).sum().backward()
    assert weight.grad is not None

    (update,) = server.updates()
    assert update.headers[SHAPE_HEADER] == "3,4"
    assert "lr" not in update.url.params
    pushed_ids = np.frombuffer(update.content[:24], dtype="<i8").tolist()
    pushed = decode_rows(update.content[24:], (3, 4))
    for row, row_id in enumerate(pushed_ids):
        assert torch.allclose(pushed[row], weight.grad[row_id], atol=1e-5)
    expected = weight.detach() - 0.1 * weight.grad
    assert torch.allclose(server.rows, expected, atol=1e-5)
    assert embedding.pushes == 1
    assert embedding.last_version == 1
    assert embedding.last_push_timing == {"hash": 0.5, "lookup": 1.25, "total": 2.0}


def test_remote_embedding_lr_override_and_no_grad() -> None:
    server = FakeServer()
    embedding = RemoteEmbedding(server.client(), "t", embedding_dim=4, lr=0.25)
    embedding(torch.tensor([1])).sum().backward()
    assert server.updates()[-1].url.params["lr"] == "0.25"
    embedding(torch.tensor([1]), lr=2.0).sum().backward()
    assert server.updates()[-1].url.params["lr"] == "2.0"
    with torch.no_grad():
        out = embedding(torch.tensor([1, 2]))
    assert not out.requires_grad
    assert len(server.updates()) == 2
    assert embedding(torch.zeros(0, 3, dtype=torch.int64)).shape == (0, 3, 4)
    with pytest.raises(ValueError):
        embedding(torch.tensor([1.0]))


def test_remote_embedding_has_no_local_parameters() -> None:
    embedding = RemoteEmbedding(FakeServer().client(), "t", embedding_dim=4)
    assert list(embedding.parameters()) == []


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("with_offsets", [False, True])
def test_remote_embedding_bag_matches_torch(mode: str, with_offsets: bool) -> None:
    server = FakeServer(lr=1.0)
    bag = RemoteEmbeddingBag(server.client(), "t", mode=mode, embedding_dim=4)
    weight = server.rows.clone().requires_grad_(True)
    if with_offsets:
        ids, offsets = torch.tensor([4, 5, 4, 8, 1, 2]), torch.tensor([0, 3, 3, 5])  # one empty bag
        weights = torch.rand(6) if mode == "sum" else None
    else:
        ids, offsets = torch.tensor([[4, 5, 4], [8, 1, 2]]), None
        weights = torch.rand(2, 3) if mode == "sum" else None
    out = bag(ids, offsets, per_sample_weights=weights)
    expected = torch.nn.functional.embedding_bag(ids, weight, offsets, mode=mode, per_sample_weights=weights)
    assert torch.allclose(out, expected, atol=1e-6)
    gradient = torch.randn_like(expected)
    (out * gradient).sum().backward()
    (expected * gradient).sum().backward()
    assert weight.grad is not None
    assert torch.allclose(server.rows, weight.detach() - weight.grad, atol=1e-5)


def test_remote_embedding_bag_rejects_bad_offsets() -> None:
    bag = RemoteEmbeddingBag(FakeServer().client(), "t", embedding_dim=4)
    with pytest.raises(ValueError, match="start at 0"):
        bag(torch.tensor([1, 2]), torch.tensor([1]))
    with pytest.raises(ValueError, match="past"):
        bag(torch.tensor([1, 2]), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="mode='sum'"):
        RemoteEmbeddingBag(FakeServer().client(), "t", mode="mean", embedding_dim=4)(
            torch.tensor([[1]]), per_sample_weights=torch.ones(1, 1)
        )


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 49), min_size=1, max_size=30), st.floats(0.01, 2.0))
def test_remote_embedding_step_equals_local_sgd(ids: list[int], lr: float) -> None:
    server = FakeServer()
    embedding = RemoteEmbedding(server.client(), "t", embedding_dim=4, lr=lr)
    weight = server.rows.clone().requires_grad_(True)
    ids_tensor = torch.tensor(ids)
    embedding(ids_tensor).pow(2).sum().backward()
    weight[ids_tensor].pow(2).sum().backward()
    assert weight.grad is not None
    expected = weight.detach() - lr * weight.grad
    assert torch.allclose(server.rows, expected, atol=1e-4 * max(1.0, math.sqrt(len(ids))))


def test_worker_and_reconnect() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"status": "ok", "pid": 4242})

    client = RobezClient("http://fake", transport=httpx.MockTransport(handler))
    first = client._http
    assert client.worker() == 4242
    client.reconnect()
    assert client._http is not first and first.is_closed
    assert client.worker() == 4242
    with pytest.raises(RuntimeError, match="cannot reconnect"):
        RobezClient(http_client=httpx.Client(transport=httpx.MockTransport(handler))).reconnect()
