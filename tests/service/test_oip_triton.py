"""Triton's and KServe's tools against robez: the requests perf_analyzer and kserve's clients send
(recorded from the real tools by ``devtools/compat/``, replayed byte for byte), tritonclient's model
configuration, statistics and repository index calls, and one meaning of model versions on both
transports (the same calls through the HTTP and the gRPC client give the same answers)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

from .test_oip import _v1_rows
from .threaded_server import ThreadedServer, app_server

RECORDED = Path(__file__).parent / "data" / "compat"
INFER = "/inference.GRPCInferenceService/ModelInfer"


@pytest.fixture
def both(tmp_path: Path) -> Iterator[tuple[ThreadedServer, str]]:
    """One in-process app serving HTTP and gRPC: (server, its gRPC address)."""
    server = app_server(tmp_path, grpc_port=0)
    port = server.server.config.loaded_app.app.state.grpc_port  # type: ignore[union-attr]
    yield server, f"127.0.0.1:{port}"
    server.stop()


def _recorded_http(name: str) -> tuple[str, dict[str, str], bytes]:
    """(path, headers, body) of a recorded HTTP/1.1 request."""
    data = (RECORDED / name).read_bytes()
    head, body = data.split(b"\r\n\r\n", 1)
    request_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {key.lower(): value for key, value in (line.split(": ", 1) for line in lines)}
    headers.pop("host", None)
    headers.pop("content-length", None)
    return request_line.split(" ")[1], headers, body


def _rows_of_answer(reply: httpx.Response) -> np.ndarray:
    """The rows of an infer answer, binary or JSON."""
    length = reply.headers.get("Inference-Header-Content-Length")
    if length is None:
        return np.array(reply.json()["outputs"][0]["data"], dtype="<f4")
    return np.frombuffer(reply.content[int(length) :], dtype="<f4")


@pytest.mark.parametrize("recording", ["perf_analyzer-http-infer.http", "kserve-rest-infer.http"])
def test_recorded_rest_requests_are_answered(both: tuple[ThreadedServer, str], recording: str) -> None:
    """perf_analyzer's and kserve's REST inference (``model_name`` and ``id`` in the body, binary data):
    answered, rows equal /v1's."""
    server, _ = both
    path, headers, body = _recorded_http(recording)
    reply = httpx.post(f"{server.url}{path}", content=body, headers=headers, timeout=30)
    assert reply.status_code == 200, reply.text
    ids = np.frombuffer(body[int(headers["inference-header-content-length"]) :], dtype="<i8")
    assert _rows_of_answer(reply).tobytes() == _v1_rows(server.url, ids)


def test_recorded_rest_ready_is_answered(both: tuple[ThreadedServer, str]) -> None:
    server, _ = both
    path, headers, _ = _recorded_http("kserve-rest-ready.http")
    assert httpx.get(f"{server.url}{path}", headers=headers, timeout=30).json()["ready"] is True


@pytest.mark.parametrize("recording", ["perf_analyzer-grpc-infer.bin", "kserve-grpc-infer.bin"])
def test_recorded_grpc_requests_are_answered(both: tuple[ThreadedServer, str], recording: str) -> None:
    """perf_analyzer's ``triton_enable_empty_final_response`` and kserve's ``binary_data_size``: taken,
    rows equal /v1's."""
    server, address = both
    message = (RECORDED / recording).read_bytes()
    request = pb.ModelInferRequest.FromString(message)
    ids = np.frombuffer(request.raw_input_contents[0], dtype="<i8")
    with grpc.insecure_channel(address) as channel:
        answer = pb.ModelInferResponse.FromString(channel.unary_unary(INFER)(message, timeout=30))
    assert answer.raw_output_contents[0] == _v1_rows(server.url, ids)


def _grpc_infer(address: str, request: Any) -> grpc.RpcError | Any:
    with grpc.insecure_channel(address) as channel:
        try:
            return pb.ModelInferResponse.FromString(
                channel.unary_unary(INFER)(request.SerializeToString(), timeout=30)
            )
        except grpc.RpcError as error:
            return error


def test_parameters_known_ignored_unknown_refused(both: tuple[ThreadedServer, str]) -> None:
    server, address = both
    base = pb.ModelInferRequest.FromString((RECORDED / "kserve-grpc-infer.bin").read_bytes())

    wrong_size = pb.ModelInferRequest()
    wrong_size.CopyFrom(base)
    wrong_size.inputs[0].parameters["binary_data_size"].int64_param = 8
    refused = _grpc_infer(address, wrong_size)
    assert isinstance(refused, grpc.RpcError) and refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "binary_data_size is 8, its raw_input_contents 56 bytes" in refused.details()

    for key in ("priority", "timeout"):
        ignored = pb.ModelInferRequest()
        ignored.CopyFrom(base)
        ignored.parameters[key].int64_param = 5
        assert not isinstance(_grpc_infer(address, ignored), grpc.RpcError)
    unknown = pb.ModelInferRequest()
    unknown.CopyFrom(base)
    unknown.parameters["sequence_id"].int64_param = 5
    refused = _grpc_infer(address, unknown)
    assert isinstance(refused, grpc.RpcError) and refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sequence_id" in refused.details()

    path, headers, body = _recorded_http("kserve-rest-infer.http")
    other = body.replace(b'"model_name":"demo"', b'"model_name":"oops"')
    reply = httpx.post(f"{server.url}{path}", content=other, headers=headers, timeout=30)
    assert reply.status_code == 422 and "model_name 'oops' in the body" in reply.json()["error"]


Clients = tuple[triton_http.InferenceServerClient, triton_grpc.InferenceServerClient]


@pytest.fixture
def clients(both: tuple[ThreadedServer, str]) -> Clients:
    server, address = both
    return triton_http.InferenceServerClient(server.address), triton_grpc.InferenceServerClient(address)


def _outcome(call: Callable[[], Any]) -> Any:
    """A call's answer, or the kind of its error (the HTTP status its gRPC code maps from)."""
    try:
        return call()
    except InferenceServerException as error:
        return {"400": 400, "404": 404, "StatusCode.NOT_FOUND": 404}.get(str(error.status()), error.status())


def test_versions_mean_the_same_on_both_transports(clients: Clients) -> None:
    """A table serves one version, its current one (0 here): asking for it or for none works; any other
    is not ready and not found, through either client, for readiness, metadata and inference."""
    ids = np.array([5, 7, 2**33], dtype=np.int64)
    answers = []
    for client, module in zip(clients, (triton_http, triton_grpc), strict=True):
        tensor = module.InferInput("ids", [3], "INT64")
        tensor.set_data_from_numpy(ids)

        def infer(version: str, client: Any = client, tensor: Any = tensor) -> Any:
            return _outcome(
                lambda: client.infer("demo", [tensor], model_version=version).as_numpy("embeddings")
            )

        def metadata(version: str, client: Any = client) -> Any:
            def call() -> Any:
                if client is clients[0]:
                    return client.get_model_metadata("demo", version)["versions"]
                return client.get_model_metadata("demo", version, as_json=True)["versions"]

            return _outcome(call)

        answers.append(
            {
                "ready": [client.is_model_ready("demo", v) for v in ("", "0", "1")],
                "ready unknown": client.is_model_ready("nope"),
                "metadata": [metadata(v) for v in ("", "0", "1")],
                "infer": [infer(v) for v in ("", "0", "1")],
            }
        )
    over_http, over_grpc = answers
    assert over_http["ready"] == over_grpc["ready"] == [True, True, False]
    assert over_http["ready unknown"] is over_grpc["ready unknown"] is False
    assert over_http["metadata"] == over_grpc["metadata"] == [["0"], ["0"], 404]
    for rows_http, rows_grpc in zip(over_http["infer"][:2], over_grpc["infer"][:2], strict=True):
        assert rows_http.tobytes() == rows_grpc.tobytes()
    assert over_http["infer"][2] == over_grpc["infer"][2] == 404


def _ints(value: Any) -> Any:
    """protobuf's JSON writes int64 as strings; Triton's REST answers write numbers."""
    if isinstance(value, dict):
        return {key: _ints(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_ints(item) for item in value]
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return value


def test_config_index_and_statistics_through_tritonclient(clients: Clients) -> None:
    over_http, over_grpc = clients
    config = over_http.get_model_config("demo")
    assert config["max_batch_size"] == 0 and config["platform"] == "robez"
    assert config["input"] == [{"name": "ids", "data_type": "TYPE_INT64", "dims": [-1], "optional": False}]
    assert config["output"] == [{"name": "embeddings", "data_type": "TYPE_FP32", "dims": [-1, 64]}]
    grpc_config = _ints(over_grpc.get_model_config("demo", as_json=True)["config"])
    for key in ("name", "platform", "max_batch_size", "output", "parameters"):
        assert grpc_config.get(key, 0) == _ints(config[key])

    assert over_http.get_model_repository_index() == [
        {"name": "demo", "version": "0", "state": "READY", "reason": ""}
    ]
    assert _ints(over_grpc.get_model_repository_index(as_json=True))["models"] == [
        {"name": "demo", "version": 0, "state": "READY"}
    ]

    ids = np.arange(16, dtype=np.int64)
    for client, module in zip(clients, (triton_http, triton_grpc), strict=True):
        tensor = module.InferInput("ids", [16], "INT64")
        tensor.set_data_from_numpy(ids)
        for _ in range(3):
            client.infer("demo", [tensor])
    with pytest.raises(InferenceServerException):
        over_http.infer("demo", [], model_version="")  # no ids: a failure, counted as such
    stats_http = over_http.get_inference_statistics("demo")["model_stats"][0]
    stats_grpc = _ints(over_grpc.get_inference_statistics("demo", as_json=True)["model_stats"][0])
    everything = _ints(over_grpc.get_inference_statistics(as_json=True)["model_stats"])
    assert [entry["name"] for entry in everything] == ["demo"]
    for stats in (stats_http, stats_grpc):
        inference = stats["inference_stats"]
        assert stats["inference_count"] == 6 and inference["success"]["count"] == 6
        assert inference["fail"]["count"] == 1
        assert inference["success"]["ns"] > inference["compute_infer"]["ns"] > 0
        counts = {inference[key]["count"] for key in ("compute_input", "compute_infer", "compute_output")}
        assert counts == {6}
    assert over_http.get_inference_statistics()["model_stats"][0]["name"] == "demo"
