"""gRPC requests bounded like HTTP bodies, against a hostile client (issue 40, items 1, 2 and 7): typed
contents refused from their byte count before any array is built, partial messages held only within the
worker's ``max_body_bytes_held`` and cut after ``body_timeout_s``, memory back within 64 MiB after any
refused call, error messages that never quote a client's megabyte."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from urllib.parse import unquote

import grpc
import h2.config
import h2.connection
import h2.events
import h2.settings
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from benchmarks.service.grpc_unread_answers import unread_answers
from loadtest.server import tree_rss_bytes
from service.grpc.wire import decode_int64s, parse_request

from .subprocess_server import RobezServer, free_port
from .threaded_server import ThreadedServer

MiB = 1 << 20
INFER = "/inference.GRPCInferenceService/ModelInfer"


def _rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants (the server's process tree), in MiB."""
    return tree_rss_bytes(pid) / MiB


@contextlib.contextmanager
def _peak_rss(pid: int) -> Iterator[list[float]]:
    """The process tree's resident memory (MiB), sampled every 50 ms while the block runs."""
    peak = [_rss_mib(pid)]
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(0.05):
            peak.append(_rss_mib(pid))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        yield peak
    finally:
        sampling.set()
        sampler.join()


@pytest.fixture(scope="module")
def hostile_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RobezServer, str]]:
    """One worker with room for two 24 MiB messages held at once, a 1.5 s body timeout and 24 MiB of
    answers held for a gRPC connection's peer."""
    tmp_path = tmp_path_factory.mktemp("grpc-limits")
    port = free_port()
    env = {
        "ROBEZ_SHM_DIR": str(tmp_path / "shm"),
        "ROBEZ_MAX_BODY_BYTES": str(24 * MiB),
        "ROBEZ_MAX_BODY_BYTES_HELD": str(52 * MiB),
        "ROBEZ_BODY_TIMEOUT_S": "1.5",
        "ROBEZ_MAX_IDS_PER_REQUEST": str(1 << 16),
        "ROBEZ_GRPC_MAX_UNREAD_ANSWER_BYTES": str(24 * MiB),
    }
    server = RobezServer(tmp_path / "server.log", ["--grpc-port", str(port)], env)
    server.start()
    try:
        yield server, f"127.0.0.1:{port}"
    finally:
        server.stop()


def _typed_request(count: int) -> bytes:
    request = pb.ModelInferRequest(model_name="demo")
    tensor = request.inputs.add(name="ids", datatype="INT64", shape=[count])
    tensor.contents.int64_contents.extend(np.full(count, 300, dtype=np.int64).tolist())  # 2 bytes each
    return request.SerializeToString()


def test_typed_contents_past_max_ids_are_refused_before_any_array(
    hostile_target: tuple[RobezServer, str],
) -> None:
    """10 million ids in typed contents (20 MiB): refused naming the limit, promptly, the worker's memory
    unchanged (before: a Python list and an array of them first, 40-65x the message, kept)."""
    server, address = hostile_target
    message = _typed_request(10_000_000)
    assert 16 * MiB < len(message) < 24 * MiB
    assert server.process is not None
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(address, options=options) as channel:
        call = channel.unary_unary(INFER)
        call(_typed_request(60_000), timeout=60)  # the worker in service: its compute thread and arena
        before = _rss_mib(server.process.pid)
        for _ in range(3):
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as refused:
                call(message, timeout=60)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # as HTTP's 422
            assert "max_ids_per_request=65536" in refused.value.details()
            assert time.monotonic() - started < 5
    time.sleep(0.5)
    assert _rss_mib(server.process.pid) - before < 64


def _stall(address: str, streams: int, declared: int, send: int, seconds: float) -> tuple[int, int]:
    """Open ``streams`` ModelInfer calls on one HTTP/2 connection, each declaring a ``declared``-byte
    message and sending up to ``send`` bytes of it as flow control allows, then stalling; for ``seconds``.
    Returns (bytes the server let in, streams it ended or reset)."""
    host, port = address.split(":")
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(0.1)
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    sent: dict[int, int] = {}
    for _ in range(streams):
        stream = connection.get_next_available_stream_id()
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", INFER),
            (":authority", address),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
        connection.send_headers(stream, headers)
        connection.send_data(stream, b"\x00" + struct.pack(">I", declared))
        sent[stream] = 0
    sock.sendall(connection.data_to_send())
    chunk = b"\x01" * (1 << 20)
    closed: set[int] = set()
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline and len(closed) < streams:
            for stream in sent:
                while stream not in closed and sent[stream] < send:
                    size = min(
                        connection.local_flow_control_window(stream),
                        connection.max_outbound_frame_size,
                        send - sent[stream],
                        len(chunk),
                    )
                    if size <= 0:
                        break
                    connection.send_data(stream, chunk[:size])
                    sent[stream] += size
            if outgoing := connection.data_to_send():
                sock.sendall(outgoing)
            try:
                incoming = sock.recv(1 << 16)
            except TimeoutError:
                continue
            if not incoming:
                break
            for event in connection.receive_data(incoming):
                if isinstance(event, h2.events.StreamReset | h2.events.StreamEnded):
                    closed.add(event.stream_id)
            if outgoing := connection.data_to_send():
                sock.sendall(outgoing)
    except h2.exceptions.StreamClosedError:
        pass
    finally:
        sock.close()
    return sum(sent.values()), len(closed)


def test_stalled_partial_messages_are_bounded_and_cut(hostile_target: tuple[RobezServer, str]) -> None:
    """Eight calls each declaring 20 MiB and sending 16 MiB, then stalling: the worker holds no more than
    its room for messages (two at once here), cuts every call after the body timeout, and its memory comes
    back (before: all 128 MiB taken in and kept, the calls open for good)."""
    server, address = hostile_target
    assert server.process is not None
    pid = server.process.pid
    before = _rss_mib(pid)
    with _peak_rss(pid) as peak:
        accepted, closed = _stall(address, streams=8, declared=20 * MiB, send=16 * MiB, seconds=8)
    assert closed == 8, "every stalled call is ended by the server"
    # Two messages in read at once (52 MiB of room, 25 MiB each); a call whose turn comes at the end of
    # its body timeout lets a little more in before it is cut (before: all 128 MiB, kept).
    assert accepted < 64 * MiB, f"{accepted / MiB:.0f} MiB let in"
    assert max(peak) - before < 80, f"peak {max(peak) - before:.0f} MiB over the start"
    time.sleep(1.0)
    assert _rss_mib(server.process.pid) - before < 64
    with grpc.insecure_channel(address) as channel:  # and the worker still serves
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ModelReady(pb.ModelReadyRequest(name="demo"), timeout=30).ready


def test_answers_a_peer_does_not_take_are_bounded(hostile_target: tuple[RobezServer, str]) -> None:
    """One peer with its windows at 0 sends 16 calls of 65,536 ids (16 MiB answers) and takes no
    answer's data: the worker holds answers for it up to ``grpc_max_unread_answer_bytes`` (24 MiB here)
    and within its room for bodies, and refuses the rest, RESOURCE_EXHAUSTED naming the limit; its memory
    does not grow with the calls (before: every answer held, 256 MiB, until the connection's idle timeout;
    40 calls of 262,144 ids at the defaults grew a worker by 2.7 GB)."""
    server, address = hostile_target
    assert server.process is not None
    pid = server.process.pid
    before = _rss_mib(pid)
    with _peak_rss(pid) as peak:
        statuses = unread_answers(address, calls=16, ids=65536, seconds=20, window=0, ended=12)
    # RESOURCE_EXHAUSTED, or DEADLINE_EXCEEDED for a call that found no room to read its message in time
    assert sum(code != "0" for code, _ in statuses.values()) >= 12, statuses
    refused = [message for code, message in statuses.values() if code == "8"]
    assert refused
    # its connection's bound, or the worker's room when the room holds messages in read too
    limits = ("grpc_max_unread_answer_bytes=25165824", "max_body_bytes_held=54525952")
    assert all(any(limit in unquote(message) for limit in limits) for message in refused), refused[:2]
    # grpcio keeps copies of an answer it is sending (its slices): ~6x what the room counts
    bound = 130 if os.environ.get("GRPC_ENGINE_UNDER_TEST", "frames") == "frames" else 500
    assert max(peak) - before < bound, f"peak {max(peak) - before:.0f} MiB over the start"
    with grpc.insecure_channel(address) as channel:  # and the worker still serves
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ModelReady(pb.ModelReadyRequest(name="demo"), timeout=30).ready


def test_answers_held_leave_the_worker_room_when_taken_or_dropped(
    grpc_server: Callable[..., tuple[ThreadedServer, str]],
) -> None:
    """The accounting behind the bound, in process: answers held back by a peer's windows count in the
    worker's room for bodies, at most ``grpc_max_unread_answer_bytes`` and one answer for one connection
    (which calls get that far depends on when their messages come: a call that starts while answers are
    held back waits for the peer), and answers left in the transport by a peer that reads nothing too;
    both are given back when the connection goes; a client that takes its answers leaves nothing counted."""
    server, address = grpc_server(grpc_max_unread_answer_bytes=4 * MiB)
    admission = server.app.state.admission

    def room_given_back(seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while admission.held_bytes and time.monotonic() < deadline:
            time.sleep(0.05)
        return admission.held_bytes == 0

    frames = server.app.state.settings.grpc_engine == "frames"  # grpcio: no bound per connection
    held = [0]

    def sample() -> None:  # answers counted for the connection (the room also holds messages in read)
        if frames:
            counted = sum(c.answers_held for c in server.app.state.grpc_frames.connections)
            held[0] = max(held[0], counted)

    unread_answers(address, calls=24, ids=4096, seconds=4, window=0, sample=sample)
    if frames:
        assert 0 < held[0] <= 4 * MiB + (1 << 20) + 4096  # 1 MiB answers: the limit and one answer
    assert room_given_back(10)
    unread_answers(address, calls=24, ids=4096, seconds=3, window=(1 << 31) - 1, read=False)
    assert room_given_back(10)
    options = [("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(address, options=options) as channel:
        call = channel.unary_unary(INFER)
        request = pb.ModelInferRequest(model_name="demo")
        request.inputs.add(name="ids", datatype="INT64", shape=[1024])
        request.raw_input_contents.append(np.arange(1024, dtype=np.int64).tobytes())
        futures = [call.future(request.SerializeToString(), timeout=30) for _ in range(8)]  # 2 MiB at most
        assert all(len(future.result()) > 1024 * 64 * 4 for future in futures)
    assert room_given_back(5)


def test_no_message_is_read_before_the_read_key(
    grpc_server: Callable[..., tuple[ThreadedServer, str]],
) -> None:
    """With a read key, a call without it is refused from its metadata, its message never taken in."""
    _, address = grpc_server(read_api_key="k" * 32, body_timeout_s=30)
    started = time.monotonic()
    accepted, closed = _stall(address, streams=4, declared=8 * MiB, send=8 * MiB, seconds=10)
    assert closed == 4 and time.monotonic() - started < 9
    assert accepted <= 4 * 128 * 1024


def test_error_messages_quote_no_megabyte(grpc_server: Callable[..., tuple[ThreadedServer, str]]) -> None:
    """A 1 MiB model name is refused as not found with a message of bounded length (before: the name
    echoed whole into grpc-message, the client's own header limit then failing the call); typed BYTES ids
    are refused by their datatype (before: 'carries its values in None')."""
    _, address = grpc_server()
    with grpc.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = pb.ModelInferRequest(model_name="m" * MiB)
        request.inputs.add(name="ids", datatype="INT64", shape=[1]).contents.int64_contents.append(1)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(request, timeout=30)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        assert len(refused.value.details()) <= 1024

        request = pb.ModelInferRequest(model_name="demo")
        request.inputs.add(name="ids", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"1")
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(request, timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "must be INT64, got 'BYTES'" in refused.value.details()
        assert "None" not in refused.value.details()


@pytest.mark.parametrize(
    "values",
    [
        [0, 1, 127, 128, 300, 2**40, 2**63 - 1, -1, -(2**63), -300],
        list(range(1000)),
        [],
    ],
)
def test_wire_decoding_equals_protobufs(values: list[int]) -> None:
    """The wire walker gives the generated parser's values, from views of the message."""
    request = pb.ModelInferRequest(model_name="demo", id="r", model_version="")
    tensor = request.inputs.add(name="ids", datatype="INT64", shape=[len(values)])
    tensor.contents.int64_contents.extend(values)
    weights = request.inputs.add(name="per_sample_weights", datatype="FP32", shape=[2])
    weights.contents.fp32_contents.extend([0.5, -2.0])
    request.parameters["pooling"].string_param = "sum"
    request.parameters["binary_data_output"].bool_param = True
    request.outputs.add(name="embeddings").parameters["binary_data"].bool_param = False
    parsed = parse_request(request.SerializeToString())
    assert (parsed.model_name, parsed.id) == ("demo", "r")
    assert parsed.parameters == {"pooling": "sum", "binary_data_output": True}
    assert parsed.outputs == [("embeddings", {"binary_data": False})]
    ids, weights_in = parsed.inputs
    assert (ids.name, ids.datatype, ids.shape) == ("ids", "INT64", [len(values)])
    decoded = decode_int64s(ids.contents.get(3, memoryview(b"")), 1 << 20, "ids")
    assert decoded.tolist() == values
    assert np.frombuffer(weights_in.contents[6], "<f4").tolist() == [0.5, -2.0]


@pytest.mark.parametrize(
    "message",
    [b"\x0a\xff", b"\x2a\x05\x1a\x03\x80\x80", b"\x0b", b"\x08" + b"\xff" * 11],
)
def test_malformed_messages_are_refused(message: bytes) -> None:
    from robez_core.errors import InvalidInputError

    with pytest.raises(InvalidInputError):
        request = parse_request(message)
        for tensor in request.inputs:
            decode_int64s(tensor.contents.get(3, memoryview(b"")), 10, "ids")


def test_a_read_is_cut_at_its_timeout_and_only_then() -> None:
    """``InferenceServicer._read``: a message that never comes ends in TimeoutError (the 408 /
    DEADLINE_EXCEEDED), one that comes is returned and leaves no cancellation pending, and a cancellation
    from outside (the server's stop) stays a cancellation, not a timeout."""
    import asyncio
    from types import SimpleNamespace

    from service.config import Settings
    from service.grpc.server import InferenceServicer

    servicer = InferenceServicer(SimpleNamespace(state=SimpleNamespace(settings=Settings())))  # type: ignore[arg-type]

    class Context:
        def __init__(self, message: bytes | None) -> None:
            self.message = message

        async def read(self) -> bytes:
            if self.message is None:
                await asyncio.Event().wait()  # never arrives
            assert self.message is not None
            return self.message

    async def main() -> None:
        started = time.perf_counter()
        with pytest.raises(TimeoutError):
            await servicer._read(Context(None), 0.05)
        assert 0.04 <= time.perf_counter() - started < 1.0
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0
        assert await servicer._read(Context(b"abc"), 0.05) == b"abc"
        await asyncio.sleep(0.1)  # past the timeout: its timer was cancelled, nothing fires
        assert task.cancelling() == 0

        reader = asyncio.ensure_future(servicer._read(Context(None), 30))
        await asyncio.sleep(0.01)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader

    asyncio.run(main())
