"""HTTP/2 conformance of the default gRPC engine (frames): RFC 9113's MUSTs a server meets, checked as
``h2spec`` would (h2spec is not installable here: no package ships it), with raw frames over a socket to one
real in-process server, a fresh connection per check.

A connection error is GOAWAY with the code, then the connection closed; a stream error is RST_STREAM with
the code, the connection going on (checked by a PING answered after it). One deviation, documented: HEADERS
on a lower, never used stream id is a connection error STREAM_CLOSED (the id is closed, RFC 9113 5.1.1),
where 5.1.1 asks for PROTOCOL_ERROR; telling the two apart would mean keeping every id ever used.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable, Iterator

import pytest
from hpack import Decoder, Encoder

from service.grpc.frames import (
    ACK,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEAD,
    HEADERS,
    MAX_CONCURRENT_STREAMS,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    STREAM_CLOSED,
    WINDOW_UPDATE,
    frame,
)

from .threaded_server import ThreadedServer, app_server

Frame = tuple[int, int, int, bytes]  # type, flags, stream, payload
LIVE = "/inference.GRPCInferenceService/ServerLive"
METADATA = "/inference.GRPCInferenceService/ServerMetadata"
EMPTY_MESSAGE = b"\0\0\0\0\0"  # ServerLiveRequest / ServerMetadataRequest: no fields


@pytest.fixture(scope="module")
def address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server: ThreadedServer = app_server(tmp_path_factory.mktemp("h2"), grpc_port=0, grpc_engine="frames")
    yield f"127.0.0.1:{server.app.state.grpc_port}"
    server.stop()


class Wire:
    """A raw HTTP/2 client connection: frames out, frames in, nothing checked on our side."""

    def __init__(self, address: str, settings: bytes = b"") -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.encoder = Encoder()
        self.buffer = b""
        self.closed = False
        self.pings = 0
        self.sock.sendall(PREFACE + frame(SETTINGS, 0, 0, settings))
        first = self.next()
        assert first is not None and first[:3] == (SETTINGS, 0, 0)  # the server's SETTINGS come first
        self.until(lambda f: f[:2] == (SETTINGS, ACK))  # ours acknowledged
        self.send(frame(SETTINGS, ACK, 0))

    def send(self, *frames: bytes) -> None:
        self.sock.sendall(b"".join(frames))

    def next(self) -> Frame | None:
        """The next frame, or None once the server closed the connection."""
        while len(self.buffer) < 9 or len(self.buffer) < 9 + int.from_bytes(self.buffer[:3], "big"):
            try:
                data = self.sock.recv(1 << 16)
            except ConnectionResetError:
                data = b""
            if not data:
                self.closed = True
                return None
            self.buffer += data
        high, low, kind, flags, sid = HEAD.unpack_from(self.buffer)
        length = high << 16 | low
        payload, self.buffer = self.buffer[9 : 9 + length], self.buffer[9 + length :]
        return kind, flags, sid & 0x7FFFFFFF, payload

    def until(self, done: Callable[[Frame], bool]) -> list[Frame]:
        """Frames up to the first that is ``done`` (included), or to the end of the connection."""
        seen = []
        while (got := self.next()) is not None:
            seen.append(got)
            if done(got):
                break
        return seen

    def goaway(self) -> int:
        """The code of the GOAWAY that ends the connection (asserting it is closed after it)."""
        goaways = [f for f in self.until(lambda f: False) if f[0] == GOAWAY]
        assert goaways and self.closed, "no GOAWAY, or the connection stayed open"
        code: int = struct.unpack_from(">II", goaways[-1][3])[1]
        return code

    def alive(self) -> list[Frame]:
        """A PING answered: everything sent before it was taken without a connection error. Returns the
        frames that came before its ACK."""
        self.pings += 1
        payload = self.pings.to_bytes(8, "big")
        self.send(frame(PING, 0, 0, payload))
        seen = self.until(lambda f: f[:2] == (PING, ACK) and f[3] == payload)
        assert seen and seen[-1][3] == payload, f"the connection ended: {seen}"
        return seen[:-1]

    def headers(
        self, sid: int, path: str = LIVE, flags: int = END_HEADERS, extra: list[tuple[str, str]] | None = None
    ) -> bytes:
        block = self.encoder.encode(
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", path),
                (":authority", "robez"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                *(extra or []),
            ]
        )
        return frame(HEADERS, flags, sid, block)

    def call(self, sid: int, path: str = LIVE) -> bytes:
        return self.headers(sid, path) + frame(DATA, END_STREAM, sid, EMPTY_MESSAGE)

    def answer(self, sid: int) -> list[Frame]:
        """A call's frames up to its end (END_STREAM or RST_STREAM)."""
        seen = self.until(
            lambda f: f[2] == sid and (f[0] == RST_STREAM or (f[0] == HEADERS and f[1] & END_STREAM))
        )
        return [f for f in seen if f[2] == sid]

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def wire(address: str) -> Iterator[Wire]:
    connection = Wire(address)
    yield connection
    connection.close()


def _status(frames: list[Frame]) -> str:
    """The grpc-status of a call's answer (its last header block)."""
    blocks = [f[3] for f in frames if f[0] == HEADERS]
    decoder = Decoder()
    headers = [dict(decoder.decode(block)) for block in blocks]
    return str(headers[-1]["grpc-status"])


def test_a_call_is_served_and_the_connection_goes_on(wire: Wire) -> None:
    wire.send(wire.call(1))
    answer = wire.answer(1)
    assert [f[0] for f in answer] == [HEADERS, DATA, HEADERS] and _status(answer) == "0"
    wire.send(wire.call(3, METADATA))
    assert _status(wire.answer(3)) == "0"


# 3.4, 4.1-4.2, 5.1, 5.1.1, 5.5, 6.x: one frame, a connection error of this code.
@pytest.mark.parametrize(
    ("frames", "code"),
    [
        pytest.param(
            frame(SETTINGS, ACK, 0, bytes(6)), FRAME_SIZE_ERROR, id="6.5 SETTINGS ACK with a payload"
        ),
        pytest.param(frame(SETTINGS, 0, 1), PROTOCOL_ERROR, id="6.5 SETTINGS on a stream"),
        pytest.param(frame(SETTINGS, 0, 0, bytes(5)), FRAME_SIZE_ERROR, id="6.5 SETTINGS not 6-byte entries"),
        pytest.param(
            frame(SETTINGS, 0, 0, struct.pack(">HI", 2, 2)), PROTOCOL_ERROR, id="6.5.2 ENABLE_PUSH 2"
        ),
        pytest.param(
            frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 1 << 31)), FLOW_CONTROL_ERROR, id="6.5.2 window 2^31"
        ),
        pytest.param(
            frame(SETTINGS, 0, 0, struct.pack(">HI", 5, 16383)), PROTOCOL_ERROR, id="6.5.2 MAX_FRAME_SIZE low"
        ),
        pytest.param(
            frame(SETTINGS, 0, 0, struct.pack(">HI", 5, 1 << 24)),
            PROTOCOL_ERROR,
            id="6.5.2 MAX_FRAME_SIZE high",
        ),
        pytest.param(frame(PING, 0, 1, bytes(8)), PROTOCOL_ERROR, id="6.7 PING on a stream"),
        pytest.param(frame(PING, 0, 0, bytes(6)), FRAME_SIZE_ERROR, id="6.7 PING not 8 bytes"),
        pytest.param(frame(GOAWAY, 0, 1, bytes(8)), PROTOCOL_ERROR, id="6.8 GOAWAY on a stream"),
        pytest.param(
            frame(WINDOW_UPDATE, 0, 0, bytes(4)), PROTOCOL_ERROR, id="6.9 connection WINDOW_UPDATE of 0"
        ),
        pytest.param(
            frame(WINDOW_UPDATE, 0, 0, bytes(3)), FRAME_SIZE_ERROR, id="6.9 WINDOW_UPDATE not 4 bytes"
        ),
        pytest.param(
            frame(WINDOW_UPDATE, 0, 0, ((1 << 31) - 1).to_bytes(4, "big")),
            FLOW_CONTROL_ERROR,
            id="6.9.1 connection window past 2^31-1",
        ),
        pytest.param(frame(DATA, 0, 0, b"x"), PROTOCOL_ERROR, id="6.1 DATA on stream 0"),
        pytest.param(frame(DATA, 0, 1, b"x"), PROTOCOL_ERROR, id="5.1 DATA on an idle stream"),
        pytest.param(
            frame(RST_STREAM, 0, 1, bytes(4)), PROTOCOL_ERROR, id="5.1 RST_STREAM on an idle stream"
        ),
        pytest.param(
            frame(WINDOW_UPDATE, 0, 1, b"\0\0\0\1"), PROTOCOL_ERROR, id="5.1 WINDOW_UPDATE on an idle stream"
        ),
        pytest.param(frame(RST_STREAM, 0, 0, bytes(4)), PROTOCOL_ERROR, id="6.4 RST_STREAM on stream 0"),
        pytest.param(frame(HEADERS, END_HEADERS, 0, b"\x82"), PROTOCOL_ERROR, id="6.2 HEADERS on stream 0"),
        pytest.param(frame(HEADERS, END_HEADERS, 2, b"\x82"), PROTOCOL_ERROR, id="5.1.1 an even stream id"),
        pytest.param(frame(PRIORITY, 0, 0, bytes(5)), PROTOCOL_ERROR, id="6.3 PRIORITY on stream 0"),
        pytest.param(
            frame(PUSH_PROMISE, END_HEADERS, 1, bytes(4)), PROTOCOL_ERROR, id="8.4 a client's PUSH_PROMISE"
        ),
        pytest.param(
            frame(CONTINUATION, END_HEADERS, 1, b"\x82"), PROTOCOL_ERROR, id="6.10 CONTINUATION alone"
        ),
        pytest.param(frame(DATA, 0, 1, bytes(16385)), FRAME_SIZE_ERROR, id="4.2 a frame over MAX_FRAME_SIZE"),
        pytest.param(
            frame(HEADERS, END_HEADERS, 1, b"\xff\xff\x7f"), COMPRESSION_ERROR, id="4.3 a bad HPACK index"
        ),
        pytest.param(
            frame(HEADERS, END_HEADERS | PADDED, 1, b"\x05\x82"), PROTOCOL_ERROR, id="6.2 padding too long"
        ),
    ],
)
def test_connection_errors(wire: Wire, frames: bytes, code: int) -> None:
    wire.send(frames)
    assert wire.goaway() == code


def test_a_bad_preface_is_a_connection_error(address: str) -> None:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"PRI * HTTP/1.1\r\n\r\nSM\r\n\r\n")
        data = b""
        while chunk := sock.recv(1 << 16):
            data += chunk
    # the server's SETTINGS and window come first, then GOAWAY PROTOCOL_ERROR, then the end
    goaway = data.rfind(frame(GOAWAY, 0, 0, bytes(8))[:9])
    assert goaway >= 0 and struct.unpack_from(">I", data, goaway + 13)[0] == PROTOCOL_ERROR


def test_settings_pings_and_unknown_frames(wire: Wire) -> None:
    """SETTINGS acknowledged (unknown settings ignored), PINGs answered with their payload (unknown flags
    ignored), a PING ACK not answered, unknown frame types ignored (4.1, 5.5, 6.5, 6.7)."""
    wire.send(frame(SETTINGS, 0, 0, struct.pack(">HI", 0x99, 7)))
    assert [f[:2] for f in wire.alive()] == [(SETTINGS, ACK)]
    wire.send(frame(PING, 0x10, 0, b"12345678"), frame(PING, ACK, 0, b"unasked!"), frame(0xEE, 0xFF, 0, b"?"))
    assert wire.alive() == [(PING, ACK, 0, b"12345678")]


def test_a_lower_stream_id_and_headers_after_end_stream_are_connection_errors(address: str) -> None:
    """5.1.1: ids increase; 5.1: a closed stream takes no HEADERS (STREAM_CLOSED; module docstring)."""
    for first, second in ((5, 3), (1, 1)):
        wire = Wire(address)
        wire.send(wire.call(first))
        wire.answer(first)
        wire.send(wire.headers(second, flags=END_HEADERS | END_STREAM))
        assert wire.goaway() == STREAM_CLOSED
        wire.close()


def test_stream_errors_leave_the_connection_open(wire: Wire) -> None:
    """5.1 half-closed (remote): DATA after END_STREAM is STREAM_CLOSED; 6.9: a stream WINDOW_UPDATE of 0
    is PROTOCOL_ERROR, one past 2^31-1 FLOW_CONTROL_ERROR; 6.3: PRIORITY of the wrong length
    FRAME_SIZE_ERROR; 8.2.2, 8.3: a malformed request PROTOCOL_ERROR. Each on its stream alone."""
    wire.send(wire.headers(1, flags=END_HEADERS | END_STREAM), frame(DATA, 0, 1, b"x"))
    wire.send(wire.headers(3), frame(WINDOW_UPDATE, 0, 3, bytes(4)))
    wire.send(wire.headers(5), frame(WINDOW_UPDATE, 0, 5, ((1 << 31) - 1).to_bytes(4, "big")))
    wire.send(wire.headers(7), frame(PRIORITY, 0, 7, bytes(4)))
    wire.send(wire.headers(9, extra=[("Upper", "1")]), wire.headers(11, extra=[("connection", "close")]))
    resets = {f[2]: int.from_bytes(f[3], "big") for f in wire.alive() if f[0] == RST_STREAM}
    assert resets == {
        1: STREAM_CLOSED,
        3: PROTOCOL_ERROR,
        5: FLOW_CONTROL_ERROR,
        7: FRAME_SIZE_ERROR,
        9: PROTOCOL_ERROR,
        11: PROTOCOL_ERROR,
    }
    wire.send(wire.call(13))
    assert _status(wire.answer(13)) == "0"


def test_frames_on_closed_streams_are_ignored(wire: Wire) -> None:
    """5.1 closed: RST_STREAM, WINDOW_UPDATE and PRIORITY on a stream that ended are ignored; PRIORITY on
    an idle stream too (5.1 idle)."""
    wire.send(wire.call(1))
    wire.answer(1)
    wire.send(
        frame(RST_STREAM, 0, 1, bytes(4)),
        frame(WINDOW_UPDATE, 0, 1, b"\0\0\1\0"),
        frame(PRIORITY, 0, 1, bytes(5)),
    )
    wire.send(frame(PRIORITY, 0, 9, bytes(5)))
    assert wire.alive() == []
    wire.send(wire.call(3))
    assert _status(wire.answer(3)) == "0"


def test_header_blocks_in_continuation_frames_and_padding(wire: Wire, address: str) -> None:
    """6.10: a block in HEADERS and CONTINUATION frames, with nothing between them (another frame, or a
    CONTINUATION of another stream, is PROTOCOL_ERROR); 6.1, 6.2: padded HEADERS and DATA."""
    block = wire.headers(1)[9:]
    wire.send(frame(HEADERS, 0, 1, block[:3]), frame(CONTINUATION, 0, 1, block[3:6]))
    wire.send(frame(CONTINUATION, END_HEADERS, 1, block[6:]), frame(DATA, END_STREAM, 1, EMPTY_MESSAGE))
    assert _status(wire.answer(1)) == "0"
    block = wire.headers(3)[9:]
    padded = bytes([4]) + block + bytes(4)
    wire.send(frame(HEADERS, END_HEADERS | PADDED, 3, padded))
    wire.send(frame(DATA, END_STREAM | PADDED, 3, bytes([10]) + EMPTY_MESSAGE + bytes(10)))
    assert _status(wire.answer(3)) == "0"
    for interruption in (frame(PING, 0, 0, bytes(8)), frame(CONTINUATION, END_HEADERS, 7, b"")):
        other = Wire(address)
        block = other.headers(5)[9:]
        other.send(frame(HEADERS, 0, 5, block[:3]), interruption)
        assert other.goaway() == PROTOCOL_ERROR
        other.close()


def test_answers_keep_to_the_clients_windows(address: str) -> None:
    """6.9, 6.9.2: with SETTINGS_INITIAL_WINDOW_SIZE 1, the answer's DATA comes a byte at a time, each
    after a WINDOW_UPDATE of ours; a SETTINGS change moves the open stream's window."""
    wire = Wire(address, settings=struct.pack(">HI", 4, 1))
    try:
        wire.send(wire.call(1, METADATA))
        first = wire.until(lambda f: f[0] == DATA)
        assert first[-1][0] == DATA and len(first[-1][3]) == 1
        assert wire.alive() == []  # nothing more without room
        wire.send(frame(WINDOW_UPDATE, 0, 1, b"\0\0\0\2"))
        assert [(f[0], len(f[3])) for f in wire.until(lambda f: f[0] == DATA)] == [(DATA, 2)]
        wire.send(frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 65535)))  # the window moves by 65,534
        rest = wire.answer(1)
        assert rest[-1][0] == HEADERS and _status(first + rest) == "0"
    finally:
        wire.close()


def test_max_concurrent_streams(address: str) -> None:
    """5.1.2: past our SETTINGS_MAX_CONCURRENT_STREAMS (100) a stream is refused (REFUSED_STREAM), and one
    closing makes room again. The streams stay open on their answers, held by our window of 0."""
    wire = Wire(address, settings=struct.pack(">HI", 4, 0))
    try:
        wire.send(*(wire.call(2 * n + 1) for n in range(MAX_CONCURRENT_STREAMS)))
        heads: set[int] = set()  # the answers' headers come; their data waits for our window
        wire.until(
            lambda f: f[0] == HEADERS and heads.add(f[2]) is None and len(heads) == MAX_CONCURRENT_STREAMS
        )
        over = 2 * MAX_CONCURRENT_STREAMS + 1
        wire.send(wire.call(over))
        resets = {f[2]: int.from_bytes(f[3], "big") for f in wire.alive() if f[0] == RST_STREAM}
        assert resets == {over: REFUSED_STREAM}
        wire.send(frame(WINDOW_UPDATE, 0, 1, b"\0\0\1\0"))
        assert [f[0] for f in wire.answer(1)] == [DATA, HEADERS]  # stream 1 done: room for one more
        wire.send(wire.call(over + 2))
        wire.until(lambda f: f[:3] == (HEADERS, END_HEADERS, over + 2))
        wire.send(frame(WINDOW_UPDATE, 0, over + 2, b"\0\0\1\0"))
        assert [f[0] for f in wire.answer(over + 2)] == [DATA, HEADERS]
    finally:
        wire.close()


def test_a_clients_goaway_lets_the_calls_under_way_finish(wire: Wire) -> None:
    """6.8: GOAWAY from the client: its calls under way are still answered."""
    wire.send(wire.headers(1), frame(GOAWAY, 0, 0, bytes(8)), frame(DATA, END_STREAM, 1, EMPTY_MESSAGE))
    assert _status(wire.answer(1)) == "0"
