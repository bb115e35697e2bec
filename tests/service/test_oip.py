"""Open Inference Protocol v2: through the official client (tritonclient[http]) against a real server,
and the protocol's edge cases through the in-process app. Answers are compared byte for byte with /v1."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from fastapi.testclient import TestClient
from tritonclient.utils import InferenceServerException

from service.oip import HEADER_LENGTH

from .conftest import SMALL_TABLE, assert_unchanged, create_table, error_of, table_state
from .threaded_server import ThreadedServer, app_server

OCTET = "application/octet-stream"


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Callable[..., ThreadedServer]]:
    servers: list[ThreadedServer] = []

    def start(**settings: Any) -> ThreadedServer:
        server = app_server(tmp_path / str(len(servers)), **settings)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def _v1_rows(url: str, ids: np.ndarray, headers: dict[str, str] | None = None) -> bytes:
    reply = httpx.post(
        f"{url}/v1/tables/demo/lookup",
        content=ids.astype("<i8").tobytes(),
        headers={"content-type": OCTET, **(headers or {})},
    )
    assert reply.status_code == 200, reply.text
    return reply.content


def _ids_input(ids: np.ndarray, binary: bool) -> triton.InferInput:
    tensor = triton.InferInput("ids", [int(ids.size)], "INT64")
    tensor.set_data_from_numpy(ids.astype(np.int64), binary_data=binary)
    return tensor


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_infer_gives_the_bytes_of_a_v1_lookup(
    server_factory: Callable[..., ThreadedServer], binary: bool
) -> None:
    server = server_factory()
    client = triton.InferenceServerClient(server.address)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("demo") and not client.is_model_ready("nope")
    ids = np.array([0, 7, -3, 2**62, 7], dtype=np.int64)
    output = triton.InferRequestedOutput("embeddings", binary_data=binary)
    result = client.infer("demo", [_ids_input(ids, binary)], outputs=[output], request_id="r1")
    rows = result.as_numpy("embeddings")
    assert rows.dtype == np.float32 and rows.shape == (5, 64)
    assert rows.astype("<f4").tobytes() == _v1_rows(server.url, ids)
    response = result.get_response()
    assert response["model_name"] == "demo" and response["id"] == "r1" and response["model_version"] == "0"
    # no outputs named: the client asks for binary_data_output, as Triton's clients do
    default = client.infer("demo", [_ids_input(ids, binary)]).as_numpy("embeddings")
    assert default.astype("<f4").tobytes() == _v1_rows(server.url, ids)


def test_tritonclient_pooled_bags_match_v1(server_factory: Callable[..., ThreadedServer]) -> None:
    server = server_factory()
    client = triton.InferenceServerClient(server.address)
    ids = np.arange(10, dtype=np.int64) * 31
    offsets = np.array([0, 4, 4, 9], dtype=np.int64)  # one empty bag
    weights = np.linspace(-1, 1, 10).astype(np.float32)
    inputs = [_ids_input(ids, True)]
    for name, array, datatype in (("offsets", offsets, "INT64"), ("per_sample_weights", weights, "FP32")):
        tensor = triton.InferInput(name, [int(array.size)], datatype)
        tensor.set_data_from_numpy(array, binary_data=name == "offsets")  # one JSON, one binary
        inputs.append(tensor)
    result = client.infer("demo", inputs, parameters={"pooling": "sum"})
    bags = result.as_numpy("embeddings")
    reply = httpx.post(
        f"{server.url}/v1/tables/demo/lookup",
        json={
            "ids": ids.tolist(),
            "offsets": offsets.tolist(),
            "pooling": "sum",
            "per_sample_weights": weights.tolist(),
        },
        headers={"accept": OCTET},
    )
    assert reply.status_code == 200, reply.text
    assert bags.shape == (4, 64) and bags.astype("<f4").tobytes() == reply.content


def test_tritonclient_metadata_and_errors(server_factory: Callable[..., ThreadedServer]) -> None:
    server = server_factory(read_api_key="r-key")
    client = triton.InferenceServerClient(server.address)
    with pytest.raises(InferenceServerException) as unauthorised:
        client.get_model_metadata("demo")
    assert unauthorised.value.status() == "401"
    headers = {"Authorization": "Bearer r-key"}
    metadata = client.get_model_metadata("demo", headers=headers)
    assert metadata["name"] == "demo"
    # The one required input; offsets and per_sample_weights are named in the config's parameters.
    assert metadata["inputs"] == [{"name": "ids", "datatype": "INT64", "shape": [-1]}]
    assert metadata["outputs"] == [{"name": "embeddings", "datatype": "FP32", "shape": [-1, 64]}]
    assert client.get_server_metadata()["extensions"] == [
        "binary_tensor_data",
        "statistics",
        "model_configuration",
    ]
    ids = np.array([1, 2], dtype=np.int64)
    with pytest.raises(InferenceServerException) as missing:
        client.infer("nope", [_ids_input(ids, True)], headers=headers)
    assert missing.value.status() == "404" and "nope" in str(missing.value.message())
    wrong = triton.InferInput("ids", [2], "INT32")
    wrong.set_data_from_numpy(ids.astype(np.int32))
    with pytest.raises(InferenceServerException) as invalid:
        client.infer("demo", [wrong], headers=headers)
    assert invalid.value.status() == "422" and "INT64" in str(invalid.value.message())


# --------------------------------------------------------------- protocol details, in process


def _infer(
    client: TestClient, table: str, request: dict[str, Any], binary: bytes = b"", **headers: str
) -> Any:
    header = json.dumps(request).encode()
    if binary:
        headers[HEADER_LENGTH] = str(len(header))
    return client.post(f"/v2/models/{table}/infer", content=header + binary, headers=headers)


def test_json_infer_answers_the_protocol_shape(client: TestClient) -> None:
    create_table(client, "small")
    ids = [3, 1, 3]
    response = _infer(
        client, "small", {"inputs": [{"name": "ids", "shape": [3], "datatype": "INT64", "data": ids}]}
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    assert "total;dur=" in response.headers["server-timing"] and response.headers["x-robez-version"] == "0"
    body = response.json()
    assert body["model_name"] == "small" and "id" not in body
    (output,) = body["outputs"]
    assert output["name"] == "embeddings" and output["datatype"] == "FP32" and output["shape"] == [3, 8]
    v1 = client.post("/v1/tables/small/lookup", json={"ids": ids}).json()["embeddings"]
    assert np.array_equal(
        np.array(output["data"], dtype=np.float32).reshape(3, 8), np.array(v1, dtype=np.float32)
    )


def test_binary_infer_frames_the_response(client: TestClient) -> None:
    ids = np.array([5, 6], dtype="<i8")
    request = {
        "inputs": [
            {"name": "ids", "shape": [2], "datatype": "INT64", "parameters": {"binary_data_size": 16}}
        ],
        "parameters": {"binary_data_output": True},
    }
    response = _infer(client, "demo", request, ids.tobytes())
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == OCTET
    split = int(response.headers[HEADER_LENGTH.lower()])
    header = json.loads(response.content[:split])
    assert header["outputs"][0]["parameters"] == {"binary_data_size": 2 * 64 * 4}
    assert "data" not in header["outputs"][0]
    v1 = client.post("/v1/tables/demo/lookup", content=ids.tobytes(), headers={"content-type": OCTET})
    assert response.content[split:] == v1.content


def test_health_and_metadata(client: TestClient) -> None:
    assert client.get("/v2/health/live").json() == {"live": True}
    assert client.get("/v2/health/ready").json() == {"ready": True}
    assert client.get("/v2").json()["name"] == "robez"
    assert client.get("/v2/models/demo/ready").json() == {"name": "demo", "ready": True}
    assert error_of(client.get("/v2/models/nope/ready"), 404) == "NotFoundError"
    assert error_of(client.get("/v2/models/nope"), 404) == "NotFoundError"
    for path in ("/v2/health/live", "/v2/health/ready", "/v2", "/v2/models/demo"):
        assert "total;dur=" in client.get(path).headers["server-timing"], path


_IDS = {"name": "ids", "shape": [2], "datatype": "INT64", "data": [1, 2]}


@pytest.mark.parametrize(
    ("request_body", "binary", "header_length", "message"),
    [
        ({"inputs": []}, b"", None, "'ids'"),
        ({"inputs": [{**_IDS, "datatype": "FP32"}]}, b"", None, "INT64"),
        ({"inputs": [{**_IDS, "shape": [1, 2]}]}, b"", None, "shape"),
        ({"inputs": [{**_IDS, "shape": [3]}]}, b"", None, "2 values"),
        ({"inputs": [{**_IDS, "data": [[1, 2]]}]}, b"", None, "(flat)"),
        ({"inputs": [{**_IDS, "data": [[1], [2]]}]}, b"", None, "flat list of integers"),
        ({"inputs": [{**_IDS, "data": [1.5, 2]}]}, b"", None, "integers"),
        ({"inputs": [{**_IDS, "data": [1, 2**63]}]}, b"", None, "int64"),
        ({"inputs": [{**_IDS, "name": "idz"}]}, b"", None, "unknown input"),
        ({"inputs": [_IDS, _IDS]}, b"", None, "twice"),
        ({"inputs": [_IDS], "parameters": {"pooling": "max"}}, b"", None, "pooling"),
        ({"inputs": [_IDS], "parameters": {"sequence_id": 3}}, b"", None, "unknown request parameters"),
        ({"inputs": [_IDS], "outputs": [{"name": "rows"}]}, b"", None, "unknown output"),
        ({"inputs": [_IDS], "parameters": {"binary_data_output": "yes"}}, b"", None, "true or false"),
        ({"inputs": [{**_IDS, "offsets": [0]}]}, b"", None, "invalid request"),
        (
            {"inputs": [_IDS, {"name": "offsets", "shape": [1], "datatype": "INT64", "data": [0]}]},
            b"",
            None,
            "pooling",
        ),
        (
            {
                "inputs": [
                    _IDS,
                    {"name": "per_sample_weights", "shape": [2], "datatype": "FP32", "data": [1e39, 1]},
                ],
                "parameters": {"pooling": "sum"},
            },
            b"",
            None,
            "finite",
        ),
        (
            {"inputs": [{**_IDS, "data": None, "parameters": {"binary_data_size": 16}}]},
            bytes(8),
            "auto",
            "more bytes",
        ),
        (
            {"inputs": [{**_IDS, "data": None, "parameters": {"binary_data_size": 12}}]},
            bytes(12),
            "auto",
            "16",
        ),
        ({"inputs": [{**_IDS, "parameters": {"binary_data_size": 16}}]}, bytes(16), "auto", "both"),
        ({"inputs": [_IDS]}, bytes(8), "auto", "no input claims"),
        ({"inputs": [_IDS]}, b"", "lots", HEADER_LENGTH),
        ({"inputs": [_IDS]}, b"", "99999", HEADER_LENGTH),
    ],
)
def test_bad_infer_requests_are_422_and_change_nothing(
    client: TestClient, request_body: dict[str, Any], binary: bytes, header_length: str | None, message: str
) -> None:
    before = table_state(client, "demo")
    header = json.dumps(request_body).encode()
    headers = (
        {}
        if header_length is None
        else {HEADER_LENGTH: str(len(header)) if header_length == "auto" else header_length}
    )
    response = client.post("/v2/models/demo/infer", content=header + binary, headers=headers)
    assert error_of(response, 422) in ("InvalidInputError", "ValidationError")
    assert message in response.json()["error"], response.json()
    assert_unchanged(client, "demo", before)


def test_infer_limits_and_auth_are_those_of_v1(client_factory: Callable[..., TestClient]) -> None:
    client = client_factory(max_ids_per_request=4, read_api_key="r-key")
    request = {"inputs": [{"name": "ids", "shape": [5], "datatype": "INT64", "data": [1, 2, 3, 4, 5]}]}
    assert error_of(_infer(client, "demo", request), 401) == "UnauthorizedError"
    assert error_of(_infer(client, "demo", request, authorization="Bearer no"), 403) == "ForbiddenError"
    response = _infer(client, "demo", request, authorization="Bearer r-key")
    assert error_of(response, 422) == "LimitExceededError"
    # probes stay open
    assert client.get("/v2/health/live").status_code == 200


def test_small_table_pooled_mean(client: TestClient) -> None:
    create_table(client, "small", **{k: v for k, v in SMALL_TABLE.items() if k == "embedding_dim"})
    request = {
        "inputs": [
            {"name": "ids", "shape": [4], "datatype": "INT64", "data": [1, 2, 3, 4]},
            {"name": "offsets", "shape": [2], "datatype": "INT64", "data": [0, 1]},
        ],
        "parameters": {"pooling": "mean"},
    }
    response = _infer(client, "small", request)
    assert response.status_code == 200, response.text
    v1 = client.post(
        "/v1/tables/small/lookup", json={"ids": [1, 2, 3, 4], "offsets": [0, 1], "pooling": "mean"}
    ).json()
    assert response.json()["outputs"][0]["shape"] == v1["shape"] == [2, 8]
    assert np.array_equal(
        np.array(response.json()["outputs"][0]["data"], dtype=np.float32),
        np.array(v1["embeddings"], dtype=np.float32).reshape(-1),
    )


@pytest.mark.parametrize(
    "request_body",
    [
        {"inputs": [{**_IDS, "data": [1]}]},
        {
            "model_name": "demo",
            "model_version": "",
            "id": "r-1",
            "parameters": {"pooling": "sum", "binary_data_output": True},
            "inputs": [
                {**_IDS, "data": [1]},
                {"name": "offsets", "shape": [1], "datatype": "INT64", "data": [0]},
            ],
            "outputs": [{"name": "embeddings", "parameters": {"binary_data": False}}],
        },
        {"inputs": [{**_IDS, "parameters": {"binary_data_size": 8}}], "outputs": [{"name": "embeddings"}]},
        {"inputs": [{**_IDS, "data": [1]}], "model_name": None, "outputs": None, "parameters": None},
        # Values the model coerces or refuses: they go through it (its values, its messages).
        {"inputs": [{**_IDS, "shape": [1.0], "data": [1]}]},
        {"inputs": [{**_IDS, "shape": [True], "data": [1]}]},
        {"inputs": [{**_IDS, "data": [1]}], "model_name": 5},
        {"inputs": [{**_IDS, "data": [1], "extra": 1}]},
        {"inputs": {"name": "ids"}},
        {"outputs": []},
        [1, 2],
    ],
)
def test_the_hand_check_of_an_infer_header_takes_what_the_model_takes(request_body: Any) -> None:
    """A plain header is read from its dicts (no model: the fast way); what it gives equals the model's
    reading, and whatever is not plain is the model's to coerce or refuse, with its own message."""
    from pydantic import ValidationError

    from robez_core.errors import InvalidInputError
    from service.oip import InferRequest, parsed_request

    body = json.dumps(request_body).encode()
    try:
        expected: Any = InferRequest.model_validate_json(body).model_dump()
    except ValidationError:
        expected = InvalidInputError
    if expected is InvalidInputError:
        with pytest.raises(InvalidInputError):
            parsed_request(body)
        return
    parsed = parsed_request(body)
    # The model fills every field it knows (None); the hand-checked dicts leave absent ones out.
    assert _without_none(parsed) == _without_none(expected)
    for tensor in parsed["inputs"]:
        assert all(type(dim) is int for dim in tensor["shape"])


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _without_none(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_none(item) for item in value]
    return value
