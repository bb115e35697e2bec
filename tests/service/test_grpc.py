"""The inference protocol over gRPC, through the official client (tritonclient[grpc]) against real servers:
answers equal /v1's byte for byte, errors map from the one error table, auth and limits as HTTP's, and
every worker of ``robez serve --workers 2`` serves the one port."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from .subprocess_server import RobezServer, free_port
from .test_oip import _v1_rows
from .threaded_server import ThreadedServer, app_server

_DIM = 64  # the demo table's


@pytest.fixture
def grpc_server(tmp_path: Path) -> Iterator[Callable[..., tuple[ThreadedServer, str]]]:
    """Start in-process apps serving gRPC on a port the OS picks: (server, its gRPC address)."""
    servers: list[ThreadedServer] = []

    def start(**settings: Any) -> tuple[ThreadedServer, str]:
        server = app_server(tmp_path / str(len(servers)), grpc_port=0, **settings)
        servers.append(server)
        port = server.server.config.loaded_app.app.state.grpc_port  # type: ignore[union-attr]
        return server, f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop()


def _infer(client: triton.InferenceServerClient, ids: np.ndarray, **kwargs: Any) -> Any:
    tensor = triton.InferInput("ids", [int(ids.size)], "INT64")
    tensor.set_data_from_numpy(ids.astype(np.int64))
    return client.infer("demo", [tensor], **kwargs)


def _code(error: InferenceServerException) -> str | None:
    return error.status()


def test_grpc_answers_equal_v1_bit_for_bit(grpc_server: Callable[..., tuple[ThreadedServer, str]]) -> None:
    server, address = grpc_server()
    client = triton.InferenceServerClient(address)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("demo")
    assert client.get_server_metadata(as_json=True)["name"] == "robez"
    metadata = client.get_model_metadata("demo", as_json=True)
    assert metadata["outputs"] == [{"name": "embeddings", "datatype": "FP32", "shape": ["-1", str(_DIM)]}]

    ids = np.array([3, 1, 4, 1, 5, 9, 2**40, 0], dtype=np.int64)
    result = _infer(client, ids, request_id="r-7")
    rows = result.as_numpy("embeddings")
    assert rows.dtype == np.float32 and rows.shape == (ids.size, _DIM)
    assert rows.tobytes() == _v1_rows(server.url, ids)
    assert result.get_response().id == "r-7" and result.get_response().model_version == "0"

    # Typed contents (int64_contents in, fp32_contents out): the same bits.
    with grpc.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = pb.ModelInferRequest(model_name="demo")
        tensor = request.inputs.add(name="ids", datatype="INT64", shape=[ids.size])
        tensor.contents.int64_contents.extend(ids.tolist())
        response = stub.ModelInfer(request)
        assert not response.raw_output_contents
        typed = np.array(response.outputs[0].contents.fp32_contents, dtype=np.float32)
        assert typed.tobytes() == rows.tobytes()
        # Pooled bags, weighted, as /v1 pools them.
        request.parameters["pooling"].string_param = "sum"
        request.parameters["binary_data_output"].bool_param = True
        bag = request.inputs.add(name="offsets", datatype="INT64", shape=[2])
        bag.contents.int64_contents.extend([0, 3])
        weights = [0.5, -1.0, 2.0, 0.25, 1.0, 3.0, -0.5, 1.5]
        weighted = request.inputs.add(name="per_sample_weights", datatype="FP32", shape=[ids.size])
        weighted.contents.fp32_contents.extend(weights)
        pooled = stub.ModelInfer(request)
    bags = np.frombuffer(pooled.raw_output_contents[0], dtype="<f4").reshape(2, _DIM)
    reply = httpx.post(
        f"{server.url}/v1/tables/demo/lookup",
        json={"ids": ids.tolist(), "offsets": [0, 3], "pooling": "sum", "per_sample_weights": weights},
        headers={"accept": "application/octet-stream"},
    )
    assert reply.status_code == 200, reply.text
    assert bags.tobytes() == reply.content


def test_grpc_errors_limits_auth_and_metrics(grpc_server: Callable[..., tuple[ThreadedServer, str]]) -> None:
    server, address = grpc_server(read_api_key="reader", max_body_bytes=4096)
    client = triton.InferenceServerClient(address)
    auth = {"authorization": "Bearer reader"}
    ids = np.arange(10, dtype=np.int64)

    assert client.is_server_live()  # probes need no key, as /v2/health/*
    with pytest.raises(InferenceServerException) as missing:
        _infer(client, ids)
    assert _code(missing.value) == "StatusCode.UNAUTHENTICATED"
    with pytest.raises(InferenceServerException) as wrong:
        _infer(client, ids, headers={"authorization": "Bearer nope"})
    assert _code(wrong.value) == "StatusCode.PERMISSION_DENIED"
    with pytest.raises(InferenceServerException) as no_key_metadata:
        client.get_model_metadata("demo")
    assert _code(no_key_metadata.value) == "StatusCode.UNAUTHENTICATED"
    assert _infer(client, ids, headers=auth).as_numpy("embeddings").tobytes() == _v1_rows(
        server.url, ids, auth
    )

    with pytest.raises(InferenceServerException) as unknown:
        client.infer(
            "nope", [triton.InferInput("ids", [1], "INT64").set_data_from_numpy(ids[:1])], headers=auth
        )
    assert _code(unknown.value) == "StatusCode.NOT_FOUND" and "nope" in unknown.value.message()
    # Not ready, as over HTTP (and as Triton answers): an unknown table or a version it does not serve.
    assert not client.is_model_ready("nope", headers=auth)
    assert not client.is_model_ready("demo", "1", headers=auth)

    with grpc.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        metadata = (("authorization", "Bearer reader"),)
        bad_shape = pb.ModelInferRequest(model_name="demo")
        bad_shape.inputs.add(name="ids", datatype="INT64", shape=[2, 2])
        bad_shape.raw_input_contents.append(np.zeros(4, dtype="<i8").tobytes())
        with pytest.raises(grpc.RpcError) as shape_error:
            stub.ModelInfer(bad_shape, metadata=metadata)
        assert shape_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "shape [n]" in str(shape_error.value.details())
        short = pb.ModelInferRequest(model_name="demo")
        short.inputs.add(name="ids", datatype="INT64", shape=[3])
        short.raw_input_contents.append(b"\0" * 16)
        with pytest.raises(grpc.RpcError) as size_error:
            stub.ModelInfer(short, metadata=metadata)
        assert size_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        big = pb.ModelInferRequest(model_name="demo")
        big.inputs.add(name="ids", datatype="INT64", shape=[1000])
        big.raw_input_contents.append(np.zeros(1000, dtype="<i8").tobytes())
        with pytest.raises(grpc.RpcError) as too_big:
            stub.ModelInfer(big, metadata=metadata)
        assert too_big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_body_bytes=4096" in str(too_big.value.details())
        with pytest.raises(grpc.RpcError) as garbage:
            channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(
                b"\xff\xff\xff", metadata=metadata
            )
        assert garbage.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    text = httpx.get(f"{server.url}/metrics").text
    endpoint = 'endpoint="/inference.GRPCInferenceService/ModelInfer",method="GRPC"'
    # A failure on a table is counted under it (its statistics' "fail"); on no known table, under "".
    counts = {
        (status, table): _sample(
            text, f'robez_requests_total{{{endpoint},status="{status}",table="{table}"}}'
        )
        for status, table in (
            ("200", "demo"),
            ("401", ""),
            ("403", ""),
            ("404", ""),
            ("413", ""),
            ("422", ""),
            ("422", "demo"),
        )
    }
    assert list(counts.values()) == [1, 1, 1, 1, 1, 1, 2], counts


def _sample(text: str, series: str) -> float:
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == series:
            return float(value)
    return 0.0


def _listening_sockets(port: int) -> int:
    """How many TCP sockets listen on 127.0.0.1:``port`` (gRPC binds it as an IPv4-mapped IPv6 address;
    in /proc/net/tcp[6], state 0A is LISTEN)."""
    locals_ = {f"0100007F:{port:04X}", f"0000000000000000FFFF00000100007F:{port:04X}"}
    lines = [
        line.split()
        for name in ("tcp", "tcp6")
        for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]
    ]
    return sum(1 for fields in lines if fields[1] in locals_ and fields[3] == "0A")


@pytest.mark.slow
def test_every_worker_serves_the_grpc_port(tmp_path: Path) -> None:
    port = free_port()
    env = {"ROBEZ_SHM_DIR": str(tmp_path / "shm"), "ROBEZ_LOG_LEVEL": "warning"}
    server = RobezServer(tmp_path / "server.log", ["--workers", "2", "--grpc-port", str(port)], env)
    try:
        server.start()
        # Each worker listens on the port with a socket of its own (SO_REUSEPORT; without it the second
        # worker could not bind it and would fail to start). /readyz answered once one worker was up.
        deadline = time.monotonic() + 120
        while _listening_sockets(port) < 2:
            assert time.monotonic() < deadline and server.process is not None, server.log()
            assert server.process.poll() is None, server.log()
            time.sleep(0.2)
        assert _listening_sockets(port) == 2
        ids = np.array([7, 8, 9], dtype=np.int64)
        expected = _v1_rows(server.url, ids)
        for _ in range(8):  # fresh connections: the kernel spreads them over the workers' sockets
            client = triton.InferenceServerClient(f"127.0.0.1:{port}")
            assert _infer(client, ids).as_numpy("embeddings").tobytes() == expected
            client.close()
        assert server.process is not None and server.process.poll() is None
    finally:
        server.stop()


@pytest.mark.parametrize("name", ["demo", "t" * 200, "é"])
@pytest.mark.parametrize("request_id", [None, "", "r-1", "é" * 100])
@pytest.mark.parametrize(
    ("count", "dim", "version"), [(1, 64, 0), (0, 64, 5), (4096, 8, 300), (3, 200, 2**40)]
)
def test_a_raw_answer_written_by_hand_is_what_protobuf_writes(
    name: str, request_id: str | None, count: int, dim: int, version: int
) -> None:
    from tritonclient.grpc import service_pb2 as pb

    from service.grpc.server import encode_response
    from service.oip import Inference
    from service.store import LookupResult

    rows = np.random.default_rng(count).random((count, dim), dtype=np.float32)
    inference = Inference(np.arange(count), None, "none", None, request_id, True)
    message = encode_response(name, request_id, inference, LookupResult(rows, version, 0.0, 0.0))
    expected = pb.ModelInferResponse(model_name=name, model_version=str(version), id=request_id or "")
    expected.outputs.add(name="embeddings", datatype="FP32", shape=[count, dim])
    expected.raw_output_contents.append(rows.tobytes())
    assert message == expected.SerializeToString()
