"""The frames engine's gRPC layer (``service/grpc/engine.py``) on a real in-process app: grpcio's client for
what a client sees, a raw HTTP/2 client (``h2``) for what only the frames show (Trailers-Only, windows not
opened, resets). The whole gRPC suite runs on this engine, the default (on grpcio: ``make grpcio-test``)."""

from __future__ import annotations

import contextlib
import itertools
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import numpy as np
import pytest
from hpack import Decoder
from tritonclient.grpc import service_pb2 as pb

from service.grpc import frames
from service.grpc.engine import grpc_timeout_s, percent_encoded

from .threaded_server import ThreadedServer

SERVICE = "/inference.GRPCInferenceService/"
INFER = SERVICE + "ModelInfer"


@pytest.fixture
def serve(
    grpc_server: Callable[..., tuple[ThreadedServer, str]],
) -> Callable[..., tuple[ThreadedServer, str]]:
    """``grpc_server`` (conftest.py) on the frames engine unless told."""

    def start(**settings: object) -> tuple[ThreadedServer, str]:
        settings.setdefault("grpc_engine", "frames")
        return grpc_server(**settings)

    return start


class Raw:
    """One HTTP/2 connection with h2's client: a call's headers and data out, what came back recorded."""

    def __init__(self, address: str) -> None:
        host, port = address.split(":")
        self.address = address
        self.sock = socket.create_connection((host, int(port)))
        self.sock.settimeout(0.05)
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.h2.initiate_connection()
        self.events: list[h2.events.Event] = []
        self.closed: set[int] = set()  # streams ended or reset
        self.flush()

    def flush(self) -> None:
        if data := self.h2.data_to_send():
            self.sock.sendall(data)

    def open(self, path: str = INFER, extra: list[tuple[str, str]] | None = None, end: bool = False) -> int:
        sid: int = self.h2.get_next_available_stream_id()
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", self.address),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *(extra or []),
        ]
        self.h2.send_headers(sid, headers, end_stream=end)
        self.flush()
        return sid

    def send(self, sid: int, data: bytes, end: bool = False) -> None:
        self.h2.send_data(sid, data, end_stream=end)
        self.flush()

    def until(self, done: Callable[[list[h2.events.Event]], bool], seconds: float = 10.0) -> None:
        deadline = time.monotonic() + seconds
        while not done(self.events) and time.monotonic() < deadline:
            try:
                incoming = self.sock.recv(1 << 16)
            except TimeoutError:
                continue
            if not incoming:
                break
            events = self.h2.receive_data(incoming)
            for event in events:  # the data taken: our windows open again (h2 leaves that to us)
                if isinstance(event, h2.events.DataReceived) and event.flow_controlled_length:
                    with contextlib.suppress(h2.exceptions.StreamClosedError):
                        self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                    self.closed.add(event.stream_id)
            self.events += events
            self.flush()

    def ended(self, sid: int) -> Callable[[list[h2.events.Event]], bool]:
        return lambda events: sid in self.closed

    def headers(self, sid: int) -> list[dict[bytes, bytes]]:
        return [
            dict(e.headers)
            for e in self.events
            if isinstance(e, h2.events.ResponseReceived | h2.events.TrailersReceived) and e.stream_id == sid
        ]

    def close(self) -> None:
        self.sock.close()


def _message(request: pb.ModelInferRequest) -> bytes:
    body = request.SerializeToString()
    return b"\0" + struct.pack(">I", len(body)) + body


def _ids_request(ids: list[int]) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="demo")
    request.inputs.add(name="ids", datatype="INT64", shape=[len(ids)])
    request.raw_input_contents.append(np.array(ids, dtype="<i8").tobytes())
    return request


def test_the_nine_methods_answer_as_on_grpcio(serve: Callable[..., tuple[ThreadedServer, str]]) -> None:
    """Every served method, the same request on both engines: the same response bytes (statistics: the
    same models, their counts differ with the calls each server took)."""
    _, frames = serve()
    _, grpcio = serve(grpc_engine="grpcio")
    calls = [
        ("ServerLive", pb.ServerLiveRequest(), pb.ServerLiveResponse),
        ("ServerReady", pb.ServerReadyRequest(), pb.ServerReadyResponse),
        ("ServerMetadata", pb.ServerMetadataRequest(), pb.ServerMetadataResponse),
        ("ModelReady", pb.ModelReadyRequest(name="demo"), pb.ModelReadyResponse),
        ("ModelMetadata", pb.ModelMetadataRequest(name="demo"), pb.ModelMetadataResponse),
        ("ModelConfig", pb.ModelConfigRequest(name="demo"), pb.ModelConfigResponse),
        ("RepositoryIndex", pb.RepositoryIndexRequest(), pb.RepositoryIndexResponse),
        ("ModelInfer", _ids_request([3, 1, 4, 2**40]), pb.ModelInferResponse),
        ("ModelInfer", _ids_request(list(range(4096))), pb.ModelInferResponse),  # 1 MiB: many frames
    ]
    answers: dict[str, list[bytes]] = {}
    for address in (frames, grpcio):
        with grpc.insecure_channel(address) as channel:
            for index, (name, request, _) in enumerate(calls):
                method = channel.unary_unary(SERVICE + name)
                answers.setdefault(f"{index} {name}", []).append(
                    method(request.SerializeToString(), timeout=30)
                )
            stats = channel.unary_unary(SERVICE + "ModelStatistics")(
                pb.ModelStatisticsRequest(name="demo").SerializeToString(), timeout=30
            )
            parsed = pb.ModelStatisticsResponse.FromString(stats)
            assert [m.name for m in parsed.model_stats] == ["demo"]
            assert parsed.model_stats[0].inference_stats.success.count == 2
    for name, (on_frames, on_grpcio) in answers.items():
        assert on_frames == on_grpcio, name


def test_unknown_methods_and_compressed_messages_are_unimplemented(
    serve: Callable[..., tuple[ThreadedServer, str]],
) -> None:
    _, address = serve()
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as unknown:
            channel.unary_unary(SERVICE + "ModelStreamInfer")(b"", timeout=30)
        assert unknown.value.code() == grpc.StatusCode.UNIMPLEMENTED
        infer = channel.unary_unary(INFER)
        with pytest.raises(grpc.RpcError) as compressed:  # zeros: gzip makes it smaller, so it is sent so
            infer(_ids_request([0] * 1000).SerializeToString(), timeout=30, compression=grpc.Compression.Gzip)
        assert compressed.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "identity" in compressed.value.details()
        answer = pb.ModelInferResponse.FromString(infer(_ids_request([1]).SerializeToString(), timeout=30))
        assert answer.model_name == "demo"  # the connection still serves


def test_errors_are_trailers_only_with_a_bounded_percent_encoded_message(
    serve: Callable[..., tuple[ThreadedServer, str]],
) -> None:
    _, address = serve()
    raw = Raw(address)
    try:
        request = _ids_request([1])
        request.model_name = "é%" + "m" * 5000
        sid = raw.open()
        raw.send(sid, _message(request), end=True)
        raw.until(raw.ended(sid))
        (only,) = raw.headers(sid)  # one header block: Trailers-Only
        assert only[b":status"] == b"200" and only[b"grpc-status"] == b"5"  # NOT_FOUND
        message = only[b"grpc-message"]
        assert message.startswith(b"no table named '%C3%A9%25mmm") and len(message) < 1200
    finally:
        raw.close()
    assert percent_encoded("a é%\n") == b"a %C3%A9%25%0A"
    assert len(percent_encoded("x" * 5000)) == 1024


def test_a_call_is_checked_from_its_headers(serve: Callable[..., tuple[ThreadedServer, str]]) -> None:
    """Without the read key: refused from the headers, the stream's window never opened (no WINDOW_UPDATE
    for it). A wrong content type: HTTP 415. With the key, in the ``authorization`` metadata: answered."""
    _, address = serve(read_api_key="k" * 32)
    raw = Raw(address)
    try:
        sid = raw.open()
        raw.send(sid, b"\0" + struct.pack(">I", 1 << 20))
        for _ in range(4):
            raw.send(sid, bytes(15000))  # under the stream's first window
        raw.until(raw.ended(sid))
        (only,) = raw.headers(sid)
        assert only[b"grpc-status"] == str(grpc.StatusCode.UNAUTHENTICATED.value[0]).encode()
        assert not [e for e in raw.events if isinstance(e, h2.events.WindowUpdated) and e.stream_id == sid]
        sid = raw.h2.get_next_available_stream_id()
        raw.h2.send_headers(
            sid,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", INFER),
                (":authority", address),
                ("content-type", "text/plain"),
            ],
            end_stream=True,
        )
        raw.flush()
        raw.until(raw.ended(sid))
        assert raw.headers(sid)[0][b":status"] == b"415"
        sid = raw.h2.get_next_available_stream_id()
        raw.h2.send_headers(
            sid,
            [(":method", "GET"), (":scheme", "http"), (":path", INFER), (":authority", address)],
            end_stream=True,
        )
        raw.flush()
        raw.until(raw.ended(sid))
        assert raw.headers(sid)[0][b":status"] == b"405"
    finally:
        raw.close()
    with grpc.insecure_channel(address) as channel:
        answer = channel.unary_unary(INFER)(
            _ids_request([1]).SerializeToString(),
            timeout=30,
            metadata=[("authorization", "Bearer " + "k" * 32)],
        )
        assert pb.ModelInferResponse.FromString(answer).model_name == "demo"


def test_a_call_whose_headers_are_over_the_limit_is_refused_alone(
    serve: Callable[..., tuple[ThreadedServer, str]],
) -> None:
    """Metadata over 16 KiB: that call gets Trailers-Only RESOURCE_EXHAUSTED naming the limit; the call under
    way on the same connection is answered, and so is a grpcio client's next call (before: the connection
    was closed with COMPRESSION_ERROR, every call on it lost)."""
    _, address = serve()
    raw = Raw(address)
    try:
        under_way = raw.open()
        big = raw.open(extra=[("x-token", "t" * 17000)], end=True)
        raw.until(raw.ended(big))
        (only,) = raw.headers(big)
        assert only[b"grpc-status"] == str(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]).encode()
        assert b"16384" in only[b"grpc-message"]
        raw.send(under_way, _message(_ids_request([1])), end=True)
        raw.until(raw.ended(under_way))
        assert raw.headers(under_way)[-1][b"grpc-status"] == b"0"
        assert not [e for e in raw.events if isinstance(e, h2.events.ConnectionTerminated)]
    finally:
        raw.close()
    with grpc.insecure_channel(address) as channel:
        infer = channel.unary_unary(INFER)
        with pytest.raises(grpc.RpcError) as refused:
            infer(_ids_request([1]).SerializeToString(), timeout=30, metadata=[("x-token", "t" * 17000)])
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert pb.ModelInferResponse.FromString(infer(_ids_request([1]).SerializeToString(), timeout=30))


@pytest.mark.parametrize("engine", ["frames", "grpcio"])
def test_pings_are_policed_alike_on_both_engines(
    serve: Callable[..., tuple[ThreadedServer, str]], engine: str
) -> None:
    """``grpc_max_ping_strikes`` on either engine: a client PINGing an idle connection is answered (the
    PING one too many as well), then past its strikes sent GOAWAY ENHANCE_YOUR_CALM "too_many_pings"."""
    _, address = serve(grpc_engine=engine, grpc_max_ping_strikes=1)
    raw = Raw(address)
    try:
        for n in range(3):
            raw.h2.ping(n.to_bytes(8, "big"))
            raw.flush()
            raw.until(lambda events, n=n: len([e for e in events if _ping_or_end(e)]) > n, seconds=5)
        acks = [e for e in raw.events if isinstance(e, h2.events.PingAckReceived)]
        (end,) = [e for e in raw.events if isinstance(e, h2.events.ConnectionTerminated)]
        assert len(acks) == 3 and end.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
        assert end.additional_data == b"too_many_pings"
    finally:
        raw.close()


def _ping_or_end(event: h2.events.Event) -> bool:
    return isinstance(event, h2.events.PingAckReceived | h2.events.ConnectionTerminated)


def test_the_declared_length_is_refused_before_the_message(
    serve: Callable[..., tuple[ThreadedServer, str]],
) -> None:
    _, address = serve(max_body_bytes=4096)
    raw = Raw(address)
    try:
        sid = raw.open()
        raw.send(sid, b"\0" + struct.pack(">I", 5000))  # its prefix only: nothing more comes
        raw.until(raw.ended(sid), seconds=5)
        (only,) = raw.headers(sid)
        assert only[b"grpc-status"] == str(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]).encode()
        assert b"max_body_bytes=4096" in only[b"grpc-message"]
    finally:
        raw.close()


def test_deadlines_and_stalled_messages_are_cut(serve: Callable[..., tuple[ThreadedServer, str]]) -> None:
    """A partial message: cut at the client's grpc-timeout (DEADLINE_EXCEEDED, the stream reset) or, with
    none, at body_timeout_s; the worker serves on and holds nothing for them."""
    server, address = serve(body_timeout_s=0.5)
    raw = Raw(address)
    try:
        started = time.monotonic()
        timed = raw.open(extra=[("grpc-timeout", "100m")])
        stalled = raw.open()
        for sid in (timed, stalled):
            raw.send(sid, b"\0" + struct.pack(">I", 1000) + bytes(10))
        raw.until(raw.ended(timed), seconds=5)
        assert time.monotonic() - started < 0.45
        assert (
            raw.headers(timed)[0][b"grpc-status"] == str(grpc.StatusCode.DEADLINE_EXCEEDED.value[0]).encode()
        )
        raw.until(raw.ended(stalled), seconds=5)
        (only,) = raw.headers(stalled)
        assert only[b"grpc-status"] == str(grpc.StatusCode.DEADLINE_EXCEEDED.value[0]).encode()
        assert b"body_timeout_s=0.5" in only[b"grpc-message"]
    finally:
        raw.close()
    admission = server.server.config.loaded_app.app.state.admission  # type: ignore[union-attr]
    assert admission.held_bytes == 0 and admission.in_flight == 0
    with grpc.insecure_channel(address) as channel:
        answer = channel.unary_unary(INFER)(_ids_request([1]).SerializeToString(), timeout=30)
        assert pb.ModelInferResponse.FromString(answer).model_name == "demo"


def test_grpc_timeout_values() -> None:
    assert grpc_timeout_s(b"100m") == pytest.approx(0.1)
    assert grpc_timeout_s(b"2S") == 2.0 and grpc_timeout_s(b"1H") == 3600.0
    for bad in (b"", b"m", b"123456789m", b"10x", b"-1S", b"1.5S"):
        assert grpc_timeout_s(bad) is None


def test_tls_requires_alpn_h2(serve: Callable[..., tuple[ThreadedServer, str]], tmp_path: Path) -> None:
    """Over TLS (the HTTP port's certificate): grpcio's client (ALPN h2) is served; a client that does not
    offer h2 is closed before a frame."""
    import ssl

    import trustme

    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    issued.cert_chain_pems[0].write_to_path(str(cert))
    issued.private_key_pem.write_to_path(str(key))
    _, address = serve(tls_cert=cert, tls_key=key)
    credentials = grpc.ssl_channel_credentials(root_certificates=ca.cert_pem.bytes())
    with grpc.secure_channel(address, credentials) as channel:
        answer = channel.unary_unary(INFER)(_ids_request([1]).SerializeToString(), timeout=30)
        assert pb.ModelInferResponse.FromString(answer).model_name == "demo"
    context = ssl.create_default_context(cadata=ca.cert_pem.bytes().decode())
    context.set_alpn_protocols(["http/1.1"])
    host, port = address.split(":")
    with (
        socket.create_connection((host, int(port))) as sock,
        context.wrap_socket(sock, server_hostname=host) as tls,
    ):
        tls.settimeout(5)
        tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        received = b""
        with contextlib.suppress(ConnectionResetError, ssl.SSLError):
            received = tls.recv(100)
        assert received == b""  # closed: no SETTINGS


def test_a_message_in_any_pieces_is_one_message(serve: Callable[..., tuple[ThreadedServer, str]]) -> None:
    """The prefix split over DATA frames, the message over several: the same answer as in one frame."""
    _, address = serve()
    message = _message(_ids_request(list(range(3000))))  # 24 kB: past the first frame
    raw = Raw(address)
    try:
        answers = []
        for cuts in ([16000], [2, 3, 7000, 16000], [5, 16384 + 5]):  # h2 sends frames of 16 kB at most
            sid = raw.open()
            edges = [0, *cuts, len(message)]
            for start, stop in itertools.pairwise(edges):
                raw.send(sid, message[start:stop], end=stop == len(message))
            raw.until(raw.ended(sid))
            data = b"".join(
                e.data for e in raw.events if isinstance(e, h2.events.DataReceived) and e.stream_id == sid
            )
            assert raw.headers(sid)[-1][b"grpc-status"] == b"0"
            answers.append(data)
        assert answers[0] == answers[1] == answers[2] and len(answers[0]) > 3000 * 64 * 4
    finally:
        raw.close()


def _flood_unread(address: str, calls: int, ids: int, wide: bool) -> Raw:
    """``calls`` ModelInfer calls of ``ids`` ids each (answers of ids * 256 bytes) from a peer that reads
    nothing; ``wide``: it opens its windows wide (the answers fill the server's write buffer), else they
    stay at 64 KiB (the answers are held back by flow control)."""
    raw = Raw.__new__(Raw)
    host, port = address.split(":")
    raw.address = address
    raw.sock = socket.socket()
    raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    raw.sock.connect((host, int(port)))
    raw.sock.settimeout(0.05)
    raw.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    raw.h2.initiate_connection()
    if wide:
        raw.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: (1 << 31) - 1})
    raw.h2.increment_flow_control_window((1 << 31) - 1 - 65535)
    raw.events = []
    raw.closed = set()
    raw.flush()
    # the server's opening only (its SETTINGS and connection window), so as to send every call at once
    raw.until(lambda events: any(isinstance(e, h2.events.WindowUpdated) and not e.stream_id for e in events))
    message = _message(_ids_request(list(range(ids))))
    for _ in range(calls):
        sid = raw.open()
        for start in range(0, len(message), 16384):
            raw.send(sid, message[start : start + 16384], end=start + 16384 >= len(message))
    return raw


def _wait_for(condition: Callable[[], bool], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


@pytest.mark.parametrize("wide", [True, False], ids=["wide windows", "shut windows"])
def test_a_peer_that_reads_nothing_holds_a_bounded_amount(
    serve: Callable[..., tuple[ThreadedServer, str]], wide: bool
) -> None:
    """100 calls of 512 KiB answers (50 MiB) from a peer that reads nothing: the server starts no more of
    its calls once its answers are not taken (its write buffer full, or its windows shut), holding a few
    answers, not 50 MiB; once the peer reads, every call is answered."""
    server, address = serve()
    engine = server.server.config.loaded_app.app.state.grpc_frames  # type: ignore[union-attr]
    raw = _flood_unread(address, calls=100, ids=2048, wide=wide)
    try:
        assert _wait_for(lambda: any(c.blocked for c in engine.connections))
        time.sleep(0.3)  # what a missing bound would let through meanwhile: the rest of the calls
        (connection,) = engine.connections
        assert connection.transport.get_write_buffer_size() + connection.held < 4 << 20
        # answers made: the calls taken in and ended (the rest wait, or are still unread in the socket)
        answered = (connection.last_sid + 1) // 2 - len(connection.streams)
        assert answered < 40, f"{answered} answers of 512 KiB made for a peer that reads none"
        sids = list(range(1, 200, 2))
        if not wide:  # the peer reads, and opens its windows as it does
            raw.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: (1 << 31) - 1})
            raw.flush()
        raw.until(lambda events: len(raw.closed) == len(sids), seconds=60)
        assert [raw.headers(sid)[-1][b"grpc-status"] for sid in sids] == [b"0"] * 100
    finally:
        raw.close()


@pytest.mark.parametrize("wide", [True, False], ids=["wide windows", "shut windows"])
def test_a_peer_that_never_reads_is_cut_off(
    serve: Callable[..., tuple[ThreadedServer, str]], wide: bool
) -> None:
    server, address = serve(body_timeout_s=0.3)
    engine = server.server.config.loaded_app.app.state.grpc_frames  # type: ignore[union-attr]
    raw = _flood_unread(address, calls=50, ids=2048, wide=wide)
    try:
        assert _wait_for(lambda: any(c.blocked for c in engine.connections))
        assert _wait_for(lambda: not engine.connections, seconds=5)
        admission = server.server.config.loaded_app.app.state.admission  # type: ignore[union-attr]
        assert _wait_for(lambda: admission.held_bytes == 0 and admission.in_flight == 0)
    finally:
        raw.close()


def test_stop_sends_goaway_and_lets_the_call_under_way_finish(
    serve: Callable[..., tuple[ThreadedServer, str]],
) -> None:
    """At the worker's stop: GOAWAY NO_ERROR naming the last call taken, the call under way still answered
    (its message completed after the GOAWAY), then the connection closed."""
    import threading

    server, address = serve(shutdown_grace_s=10)
    raw = Raw(address)
    try:
        message = _message(_ids_request([1, 2]))
        sid = raw.open()
        raw.send(sid, message[:7])  # the call under way: its message not all in yet
        engine = server.server.config.loaded_app.app.state.grpc_frames  # type: ignore[union-attr]
        assert _wait_for(lambda: any(c.streams for c in engine.connections))
        stopping = threading.Thread(target=server.stop)
        stopping.start()
        raw.until(lambda events: any(isinstance(e, h2.events.ConnectionTerminated) for e in events))
        (goaway,) = [e for e in raw.events if isinstance(e, h2.events.ConnectionTerminated)]
        assert goaway.error_code == 0 and goaway.last_stream_id == sid
        # h2's client sends nothing after a GOAWAY: the rest of the message as raw frames, the answer read so
        raw.sock.sendall(frames.frame(frames.DATA, frames.END_STREAM, sid, message[7:]))
        received = bytearray()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                chunk = raw.sock.recv(1 << 16)
            except TimeoutError:
                continue
            if not chunk:
                break  # closed by the server once the call is done
            received += chunk
        blocks, pos = [], 0
        while pos + 9 <= len(received):
            high, low, kind, _, stream = frames.HEAD.unpack_from(received, pos)
            length = high << 16 | low
            if kind == frames.HEADERS and stream == sid:
                blocks.append(dict(Decoder().decode(bytes(received[pos + 9 : pos + 9 + length]), raw=True)))
            pos += 9 + length
        assert (
            blocks[-1][b"grpc-status"] == b"0"
        )  # the answer's trailers (never-indexed: any decoder reads them)
        stopping.join(timeout=30)
        assert not stopping.is_alive()
    finally:
        raw.close()


def test_a_call_the_client_resets_is_counted_as_client_closed(
    serve: Callable[..., tuple[ThreadedServer, str]],
) -> None:
    """A call reset by its client mid-message: its work cancelled, its room freed, counted under 499 as
    HTTP counts a request whose client left (before: counted as a 200)."""
    import httpx

    server, address = serve()
    raw = Raw(address)
    try:
        sid = raw.open()
        raw.send(sid, _message(_ids_request([1]))[:7])
        engine = server.server.config.loaded_app.app.state.grpc_frames  # type: ignore[union-attr]
        assert _wait_for(lambda: any(c.streams for c in engine.connections))
        raw.h2.reset_stream(sid, 8)
        raw.flush()
        assert _wait_for(lambda: not any(c.streams for c in engine.connections))
    finally:
        raw.close()
    admission = server.server.config.loaded_app.app.state.admission  # type: ignore[union-attr]
    assert _wait_for(lambda: admission.held_bytes == 0 and admission.in_flight == 0)
    series = (
        'robez_requests_total{endpoint="/inference.GRPCInferenceService/ModelInfer",method="GRPC",status="'
    )

    def counted(status: str) -> bool:
        return series + status in httpx.get(f"{server.url}/metrics").text

    assert _wait_for(lambda: counted("499"))
    assert not counted("200")


def test_connections_past_max_connections_are_closed(
    serve: Callable[..., tuple[ThreadedServer, str]],
) -> None:
    server, address = serve(max_connections=2)
    engine = server.server.config.loaded_app.app.state.grpc_frames  # type: ignore[union-attr]
    kept = [Raw(address), Raw(address)]
    try:
        assert _wait_for(lambda: len(engine.connections) == 2)
        extra = socket.create_connection(("127.0.0.1", int(address.split(":")[1])))
        extra.settimeout(5)
        with extra, contextlib.suppress(ConnectionResetError):
            extra.sendall(frames.PREFACE)
            assert extra.recv(100) == b""  # closed: no SETTINGS
        for raw in kept:  # the others still served
            answer = raw.open(end=False)
            raw.send(answer, _message(_ids_request([1])), end=True)
            raw.until(raw.ended(answer))
            assert raw.headers(answer)[-1][b"grpc-status"] == b"0"
        assert len(engine.connections) == 2
    finally:
        for raw in kept:
            raw.close()
