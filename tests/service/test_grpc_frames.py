"""The frames engine's HTTP/2 layer (``service/grpc/frames.py``) against a hostile peer: raw frames into a
``FrameConnection`` on an in-memory transport, its answers parsed back. No sockets, no app: milliseconds."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterator
from typing import Any

import pytest
from hpack import Decoder, Encoder

from service.grpc import frames as h2f
from service.grpc.frames import (
    ACK,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    NO_ERROR,
    PING,
    PREFACE,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    SETTINGS_TIMEOUT,
    STREAM_CLOSED,
    WINDOW_UPDATE,
    FrameConnection,
    Stream,
    frame,
)
from service.grpc.keepalive import Keepalive

REQUEST = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", "/s/m"),
    (":authority", "x"),
    ("te", "trailers"),
]


class Transport(asyncio.Transport):
    """What a connection writes, and whether it closed or stopped reading."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closed = False
        self.aborted = False
        self.reading = True

    def write(self, data: Any) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = self.aborted = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class Recorder(FrameConnection):
    """Streams stay open until the test answers them; every hook recorded."""

    def __init__(
        self,
        preface_timeout_s: float | None = None,
        idle_timeout_s: float | None = None,
        keepalive: Keepalive | None = None,
    ) -> None:
        super().__init__(preface_timeout_s, idle_timeout_s, keepalive)
        self.opened: dict[int, list[tuple[bytes, bytes]]] = {}
        self.data: dict[int, bytes] = {}
        self.ended: list[int] = []
        self.resets: list[int] = []

    def stream_opened(self, stream: Stream, headers: list[tuple[bytes, bytes]]) -> None:
        self.opened[stream.sid] = list(headers)

    def stream_data(self, stream: Stream, data: bytes) -> None:
        self.data[stream.sid] = self.data.get(stream.sid, b"") + data

    def stream_ended(self, stream: Stream) -> None:
        self.ended.append(stream.sid)

    def stream_reset(self, stream: Stream) -> None:
        self.resets.append(stream.sid)


class Peer:
    """The client side: an HPACK encoder, the connection under test, and its frames read back."""

    def __init__(self, loop: asyncio.AbstractEventLoop, **timeouts: Any) -> None:
        self.loop = loop
        self.encoder = Encoder()
        self.connection = Recorder(**timeouts)
        self.transport = Transport()

        async def made() -> None:
            self.connection.connection_made(self.transport)

        loop.run_until_complete(made())
        self.read = 0

    def send(self, *parts: bytes) -> None:
        self.connection.data_received(b"".join(parts))

    def start(self) -> None:
        """The preface, empty SETTINGS and the ACK of ours."""
        self.send(PREFACE, frame(SETTINGS, 0, 0), frame(SETTINGS, ACK, 0))

    def headers(
        self, sid: int, end_stream: bool = False, extra: list[tuple[str, str]] | None = None
    ) -> bytes:
        block = self.encoder.encode(REQUEST + (extra or []))
        return frame(HEADERS, END_HEADERS | (END_STREAM if end_stream else 0), sid, block)

    def frames(self) -> list[tuple[int, int, int, bytes]]:
        """The frames written since the last call: (type, flags, stream, payload)."""
        out, data, pos = [], bytes(self.transport.written), self.read
        while len(data) - pos >= 9:
            high, low, kind, flags, sid = h2f.HEAD.unpack_from(data, pos)
            length = high << 16 | low
            out.append((kind, flags, sid & 0x7FFFFFFF, data[pos + 9 : pos + 9 + length]))
            pos += 9 + length
        self.read = pos
        return out

    def goaway(self) -> int | None:
        """The error code of the GOAWAY written (None: none), asserting the connection closed after it; its
        debug data in ``self.debug``."""
        goaways = [payload for kind, _, _, payload in self.frames() if kind == GOAWAY]
        if not goaways:
            return None
        assert self.transport.closed
        self.debug = goaways[-1][8:]
        code: int = struct.unpack_from(">II", goaways[-1])[1]
        return code

    def resets(self) -> dict[int, int]:
        return {sid: int.from_bytes(p, "big") for kind, _, sid, p in self.frames() if kind == RST_STREAM}


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture
def peer(loop: asyncio.AbstractEventLoop) -> Peer:
    return Peer(loop)


def test_our_settings_go_first_and_the_peers_are_acknowledged(peer: Peer) -> None:
    first = peer.frames()
    assert first[0][0] == SETTINGS and not first[0][1] & ACK
    ours = dict(struct.unpack_from(">HI", first[0][3], n) for n in range(0, len(first[0][3]), 6))
    assert ours[0x3] == h2f.MAX_CONCURRENT_STREAMS and ours[0x6] == h2f.MAX_HEADER_LIST
    peer.start()
    assert [(kind, flags) for kind, flags, _, _ in peer.frames()] == [(SETTINGS, ACK)]
    assert not peer.transport.closed


@pytest.mark.parametrize(
    ("opening", "code"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", PROTOCOL_ERROR),  # not HTTP/2
        (PREFACE + frame(PING, 0, 0, bytes(8)), PROTOCOL_ERROR),  # the first frame is not SETTINGS
        (PREFACE + frame(SETTINGS, ACK, 0), PROTOCOL_ERROR),  # nor an ACK
        (PREFACE + frame(SETTINGS, 0, 0, b"\0\x02\0\0\0\x02"), PROTOCOL_ERROR),  # ENABLE_PUSH 2
        (PREFACE + frame(SETTINGS, 0, 0, b"\0\x04\x80\0\0\0"), FLOW_CONTROL_ERROR),  # window 2^31
        (PREFACE + frame(SETTINGS, 0, 0, b"\0\x05\0\0\0\x10"), PROTOCOL_ERROR),  # MAX_FRAME_SIZE 16
        (PREFACE + frame(SETTINGS, 0, 0, b"\0\x05\x01\0\0\0"), PROTOCOL_ERROR),  # MAX_FRAME_SIZE 2^24
        (PREFACE + frame(SETTINGS, 0, 0, b"\0\x04\0\0\0"), FRAME_SIZE_ERROR),  # not 6-byte entries
        (PREFACE + frame(SETTINGS, 0, 1), PROTOCOL_ERROR),  # on a stream
    ],
)
def test_the_preface_and_settings_are_checked(peer: Peer, opening: bytes, code: int) -> None:
    peer.frames()
    peer.send(opening)
    assert peer.goaway() == code


def test_our_settings_must_be_acknowledged_in_time(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(h2f, "SETTINGS_ACK_S", 0.02)
    late, prompt = Peer(loop), Peer(loop)
    late.send(PREFACE, frame(SETTINGS, 0, 0))
    prompt.start()
    loop.run_until_complete(asyncio.sleep(0.1))
    assert late.goaway() == SETTINGS_TIMEOUT
    assert prompt.goaway() is None and not prompt.transport.closed


@pytest.mark.parametrize(
    ("kind", "flags", "sid", "payload", "code"),
    [
        (PING, 0, 0, bytes(7), FRAME_SIZE_ERROR),
        (PING, 0, 1, bytes(8), PROTOCOL_ERROR),
        (WINDOW_UPDATE, 0, 0, bytes(3), FRAME_SIZE_ERROR),
        (WINDOW_UPDATE, 0, 0, bytes(4), PROTOCOL_ERROR),  # an increment of 0
        (WINDOW_UPDATE, 0, 0, ((1 << 31) - 1).to_bytes(4, "big"), FLOW_CONTROL_ERROR),  # past 2^31-1
        (RST_STREAM, 0, 0, bytes(4), PROTOCOL_ERROR),
        (RST_STREAM, 0, 9, bytes(4), PROTOCOL_ERROR),  # an idle stream
        (DATA, 0, 9, b"x", PROTOCOL_ERROR),  # an idle stream
        (DATA, 0, 0, b"x", PROTOCOL_ERROR),
        (HEADERS, END_HEADERS, 2, b"\x83", PROTOCOL_ERROR),  # an even (server) stream id
        (PUSH_PROMISE, END_HEADERS, 1, bytes(4), PROTOCOL_ERROR),
        (CONTINUATION, END_HEADERS, 1, b"\x83", PROTOCOL_ERROR),  # no header block under way
        (GOAWAY, 0, 1, bytes(8), PROTOCOL_ERROR),
        (DATA, 0, 1, bytes(16385), FRAME_SIZE_ERROR),  # over our SETTINGS_MAX_FRAME_SIZE
    ],
)
def test_malformed_frames_are_connection_errors(
    peer: Peer, kind: int, flags: int, sid: int, payload: bytes, code: int
) -> None:
    peer.start()
    peer.frames()
    peer.send(frame(kind, flags, sid, payload))
    assert peer.goaway() == code


def test_stream_ids_and_states(peer: Peer) -> None:
    """Ids odd and increasing; HEADERS or DATA after END_STREAM: stream errors STREAM_CLOSED; HEADERS on a
    closed stream, or an id lower than one already opened: connection error."""
    peer.start()
    peer.send(peer.headers(1, end_stream=True), peer.headers(3))
    assert sorted(peer.connection.opened) == [1, 3] and peer.connection.ended == [1]
    peer.frames()
    peer.send(peer.headers(1, end_stream=True))  # trailers on a half-closed (remote) stream
    peer.send(frame(DATA, END_STREAM, 1, b"x"))
    assert peer.resets() == {1: STREAM_CLOSED}
    peer.send(frame(DATA, 0, 3, b"ab"), frame(DATA, END_STREAM, 3, b"c"))
    assert peer.connection.data[3] == b"abc" and peer.connection.ended == [1, 3]
    peer.send(peer.headers(5, end_stream=True))
    assert peer.goaway() is None
    peer.send(peer.headers(1, end_stream=True))  # stream 1 was reset: closed
    assert peer.goaway() == STREAM_CLOSED


def test_a_lower_stream_id_is_a_connection_error(peer: Peer) -> None:
    peer.start()
    peer.send(peer.headers(7))
    peer.frames()
    peer.send(peer.headers(5))
    assert peer.goaway() == STREAM_CLOSED


def test_the_101st_stream_is_refused_and_hpack_stays_in_step(peer: Peer) -> None:
    peer.start()
    peer.send(*(peer.headers(2 * n + 1) for n in range(100)))
    assert len(peer.connection.opened) == 100
    peer.frames()
    # its block inserts a header into the dynamic table that the next stream's block refers to
    peer.send(peer.headers(201, extra=[("x-new", "v" * 50)]))
    assert peer.resets() == {201: REFUSED_STREAM} and 201 not in peer.connection.opened
    peer.send(frame(RST_STREAM, 0, 1, bytes(4)))
    peer.send(peer.headers(203, extra=[("x-new", "v" * 50)]))
    assert (b"x-new", b"v" * 50) in peer.connection.opened[203]
    assert peer.connection.resets == [1]


def test_a_stream_holds_at_most_its_window_until_it_is_opened(peer: Peer) -> None:
    """Unopened, a stream gets no WINDOW_UPDATE: past 65,535 bytes it is reset (FLOW_CONTROL_ERROR). Opened,
    it is credited as data arrives. The connection's window is credited as data arrives."""
    peer.start()
    peer.send(peer.headers(1), peer.headers(3))
    peer.frames()
    chunk = bytes(16384)
    peer.send(*(frame(DATA, 0, 1, chunk) for _ in range(3)), frame(DATA, 0, 1, bytes(16383)))
    written = peer.frames()
    assert {sid for kind, _, sid, _ in written if kind == WINDOW_UPDATE} <= {0}
    assert peer.resets() == {}
    peer.send(frame(DATA, 0, 1, b"x"))  # one byte over the stream's window
    assert peer.resets() == {1: FLOW_CONTROL_ERROR}
    assert peer.connection.resets == [1]  # the layer above is told of the connection's own resets

    connection = peer.connection
    connection.open_window(connection.streams[3])
    peer.send(*(frame(DATA, 0, 3, chunk) for _ in range(8)))  # 128 KiB: credited as it comes
    connection.flush()
    updates = [
        int.from_bytes(p, "big") for kind, _, sid, p in peer.frames() if kind == WINDOW_UPDATE and sid == 3
    ]
    assert sum(updates) >= 8 * 16384 - 65535 // 2
    assert len(connection.data[3]) == 8 * 16384 and not peer.transport.closed


def test_window_updates_overflowing_a_stream_reset_it(peer: Peer) -> None:
    peer.start()
    peer.send(peer.headers(1), peer.headers(3))
    peer.frames()
    peer.send(frame(WINDOW_UPDATE, 0, 1, ((1 << 31) - 1).to_bytes(4, "big")))
    peer.send(frame(WINDOW_UPDATE, 0, 3, bytes(4)))
    assert peer.resets() == {1: FLOW_CONTROL_ERROR, 3: PROTOCOL_ERROR}
    peer.send(frame(SETTINGS, 0, 0, struct.pack(">HI", 4, (1 << 31) - 1)))
    assert peer.goaway() is None  # no stream left open to overflow


def test_settings_moving_open_streams_past_2_31_is_a_connection_error(peer: Peer) -> None:
    peer.start()
    peer.send(peer.headers(1))
    peer.send(frame(WINDOW_UPDATE, 0, 1, ((1 << 31) - 1 - 65535).to_bytes(4, "big")))
    peer.frames()
    peer.send(frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 65536)))
    assert peer.goaway() == FLOW_CONTROL_ERROR


def test_answers_wait_for_the_peers_windows(peer: Peer) -> None:
    peer.start()
    peer.send(peer.headers(1, end_stream=True))
    peer.frames()
    answer = bytes(range(256)) * 400  # 102,400 bytes, over the 65,535 of both windows
    peer.connection.send_data(1, answer, trailers=b"\x88", prefix=b"\0\0\1\x90\0")
    peer.connection.flush()
    sent = [p for kind, _, _, p in peer.frames() if kind == DATA]
    assert sum(map(len, sent)) == 65535 and all(len(p) <= 16384 for p in sent)
    peer.send(frame(WINDOW_UPDATE, 0, 0, (1 << 20).to_bytes(4, "big")))
    assert [kind for kind, *_ in peer.frames() if kind != DATA] == []  # the stream's window is still shut
    peer.send(frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 1 << 20)))  # every stream's window moves
    rest = peer.frames()
    assert b"".join(sent + [p for kind, _, _, p in rest if kind == DATA]) == b"\0\0\1\x90\0" + answer
    assert (HEADERS, END_HEADERS | END_STREAM, 1) in [(k, f, s) for k, f, s, _ in rest]
    assert 1 not in peer.connection.streams


@pytest.mark.parametrize(
    ("size", "count"),
    [(16000, 5), (0, h2f.MAX_BLOCK_FRAMES)],  # bytes past the bound (64 KiB); empty frames
)
def test_continuation_floods_are_cut(peer: Peer, size: int, count: int) -> None:
    peer.start()
    peer.frames()
    block = peer.encoder.encode(REQUEST)
    continuations = [frame(CONTINUATION, 0, 1, bytes(size)) for _ in range(count - 1)]
    peer.send(frame(HEADERS, 0, 1, block), *continuations)
    assert peer.goaway() is None
    peer.send(frame(CONTINUATION, 0, 1, bytes(size)))
    assert peer.goaway() == ENHANCE_YOUR_CALM


def test_a_header_block_cannot_be_interrupted(loop: asyncio.AbstractEventLoop) -> None:
    for interruption in (frame(PING, 0, 0, bytes(8)), frame(CONTINUATION, END_HEADERS, 3, b"")):
        peer = Peer(loop)
        peer.start()
        peer.frames()
        block = peer.encoder.encode(REQUEST)
        peer.send(frame(HEADERS, 0, 1, block[:3]), interruption)
        assert peer.goaway() == PROTOCOL_ERROR


def test_a_header_block_in_continuations_is_decoded(peer: Peer) -> None:
    peer.start()
    block = peer.encoder.encode(REQUEST)
    peer.send(frame(HEADERS, END_STREAM, 1, block[:2]), frame(CONTINUATION, 0, 1, block[2:5]))
    peer.send(frame(CONTINUATION, END_HEADERS, 1, block[5:]))
    assert peer.connection.opened[1][2] == (b":path", b"/s/m") and peer.connection.ended == [1]


@pytest.mark.parametrize(
    "block",
    [
        b"\xff\x80\x01",  # an index past both tables
        b"\x3f\x81\x20",  # a table size update to 4096 + 32: over our SETTINGS_HEADER_TABLE_SIZE
        b"\x82" + b"\x40\x05x-big\x7f\x81\x1f" + bytes(160),  # a literal longer than its block
    ],
)
def test_bad_header_blocks_are_compression_errors(peer: Peer, block: bytes) -> None:
    peer.start()
    peer.frames()
    peer.send(frame(HEADERS, END_HEADERS, 1, block))
    assert peer.goaway() == COMPRESSION_ERROR


def test_a_small_block_cannot_decode_into_a_huge_list(peer: Peer) -> None:
    """HPACK bomb: one 4000-byte header indexed once, then referenced over and over by one byte each. Past
    HARD_HEADER_LIST (64 KiB) decoded the connection goes: decoding stops there."""
    peer.start()
    peer.send(peer.headers(1, extra=[("x-bomb", "b" * 3900)]))
    peer.frames()
    bomb = peer.encoder.encode([*REQUEST, *([("x-bomb", "b" * 3900)] * 17)])
    assert len(bomb) < 100
    peer.send(frame(HEADERS, END_HEADERS, 3, bomb))
    assert peer.goaway() == COMPRESSION_ERROR


def test_a_header_list_over_the_limit_refuses_its_stream_alone(peer: Peer) -> None:
    """Over MAX_HEADER_LIST (16 KiB): that stream alone is answered (431, the rest of it not wanted), never
    opened; the other streams and HPACK's table go on (the refused block inserted a header that the next
    block refers to). Over the limit as a small HPACK bomb, or in CONTINUATION frames, the same."""
    peer.start()
    peer.send(peer.headers(1))
    peer.frames()
    big = peer.encoder.encode([*REQUEST, ("x-indexed", "i" * 100), ("x-big", "b" * 17000)])
    peer.send(frame(HEADERS, 0, 3, big[:16000]), frame(CONTINUATION, END_HEADERS, 3, big[16000:]))
    written = peer.frames()
    assert [(kind, flags, sid) for kind, flags, sid, _ in written] == [
        (HEADERS, END_HEADERS | END_STREAM, 3),
        (RST_STREAM, 0, 3),
    ]
    assert Decoder().decode(written[0][3]) == [(":status", "431")]
    assert 3 not in peer.connection.opened and not peer.transport.closed
    bomb = peer.encoder.encode([*REQUEST, ("x-indexed", "i" * 100), *([("x-bomb", "b" * 3900)] * 5)])
    peer.send(frame(HEADERS, END_HEADERS | END_STREAM, 5, bomb))  # under 100 bytes, over 16 KiB decoded
    assert [(kind, sid) for kind, _, sid, _ in peer.frames()] == [(HEADERS, 5)]  # it ended: no reset
    peer.send(peer.headers(7, end_stream=True, extra=[("x-indexed", "i" * 100)]))
    assert (b"x-indexed", b"i" * 100) in peer.connection.opened[7]
    peer.send(frame(DATA, END_STREAM, 1, b"x"), frame(DATA, 0, 3, b"dropped"))
    assert peer.connection.data == {1: b"x"} and peer.connection.ended == [7, 1]
    assert peer.goaway() is None


def test_header_lists_over_the_limit_are_bounded_per_second(peer: Peer) -> None:
    """Each costs a full decode: at most FLOOD_LIMITS[BIG_LIST] a second, then ENHANCE_YOUR_CALM."""
    peer.start()
    limit = h2f.FLOOD_LIMITS[h2f.BIG_LIST]
    blocks = [peer.headers(2 * n + 1, end_stream=True, extra=[("x-big", "b" * 17000)]) for n in range(limit)]
    peer.send(*blocks)
    assert peer.goaway() is None
    peer.send(peer.headers(2 * limit + 1, end_stream=True, extra=[("x-big", "b" * 17000)]))
    assert peer.goaway() == ENHANCE_YOUR_CALM


def test_trailers_over_the_limit_reset_their_stream(peer: Peer) -> None:
    peer.start()
    peer.send(peer.headers(1), peer.headers(3))
    peer.frames()
    peer.send(frame(HEADERS, END_HEADERS | END_STREAM, 1, peer.encoder.encode([("x-big", "b" * 17000)])))
    assert peer.resets() == {1: ENHANCE_YOUR_CALM} and peer.connection.resets == [1]
    assert 3 in peer.connection.streams and not peer.transport.closed


@pytest.mark.parametrize(
    ("make", "limit"),
    [
        (lambda n: frame(PING, 0, 0, n.to_bytes(8, "big")), h2f.FLOOD_LIMITS[PING]),
        (lambda n: frame(SETTINGS, 0, 0), h2f.FLOOD_LIMITS[SETTINGS] - 1),  # start() sent one
    ],
)
def test_control_frame_floods_are_cut(loop: asyncio.AbstractEventLoop, make: Any, limit: int) -> None:
    """The bound on every peer, whatever its PING policy (here none: ``max_ping_strikes=0``)."""
    peer = Peer(loop, keepalive=Keepalive(max_ping_strikes=0))
    peer.start()
    peer.send(*(make(n) for n in range(limit)))
    assert peer.goaway() is None
    peer.send(make(limit))
    assert peer.goaway() == ENHANCE_YOUR_CALM


@pytest.mark.parametrize(
    "make",
    [
        lambda n: frame(DATA, 0, 1, b""),  # empty DATA on an open stream
        lambda n: frame(DATA, 0x8, 1, b"\0"),  # padded to nothing
        lambda n: frame(0x2, 0, 1, bytes(5)),  # PRIORITY
        lambda n: frame(0xFA, 0, 0, b"x"),  # an unknown type
    ],
)
def test_frames_that_change_nothing_are_bounded(peer: Peer, make: Any) -> None:
    peer.start()
    peer.send(peer.headers(1))
    limit = h2f.FLOOD_LIMITS[h2f.NO_OP]
    peer.send(*(make(n) for n in range(limit)))
    assert peer.goaway() is None
    peer.send(make(limit))
    assert peer.goaway() == ENHANCE_YOUR_CALM


def test_rapid_reset_is_cut(peer: Peer) -> None:
    """CVE-2023-44487: streams opened and reset at once, as fast as the peer can."""
    peer.start()
    limit = h2f.FLOOD_LIMITS[RST_STREAM]
    for n in range(limit):
        sid = 2 * n + 1
        peer.send(peer.headers(sid), frame(RST_STREAM, 0, sid, (8).to_bytes(4, "big")))
    assert peer.goaway() is None and not peer.connection.streams
    sid = 2 * limit + 1
    peer.send(peer.headers(sid), frame(RST_STREAM, 0, sid, (8).to_bytes(4, "big")))
    assert peer.goaway() == ENHANCE_YOUR_CALM


def test_a_peer_that_reads_nothing_stops_our_reading(peer: Peer) -> None:
    peer.start()
    peer.connection.pause_writing()
    assert not peer.transport.reading
    peer.connection.resume_writing()
    assert peer.transport.reading


def test_drain_sends_goaway_refuses_new_streams_and_waits_for_the_open_ones(
    peer: Peer, loop: asyncio.AbstractEventLoop
) -> None:
    peer.start()
    peer.send(peer.headers(1, end_stream=True))
    peer.frames()
    connection = peer.connection

    async def drain_while_answering() -> None:
        draining = asyncio.ensure_future(connection.drain(loop.time() + 5))
        await asyncio.sleep(0.02)
        goaways = [struct.unpack(">II", p) for kind, _, _, p in peer.frames() if kind == GOAWAY]
        assert goaways == [(1, NO_ERROR)] and not peer.transport.closed
        peer.send(peer.headers(3))
        assert peer.resets() == {3: REFUSED_STREAM}
        connection.send_headers(1, b"\x88", end_stream=True)  # the call under way ends
        await asyncio.sleep(0.05)
        assert peer.transport.closed and not draining.done()  # closed; waits for the transport's end
        connection.connection_lost(None)  # as the transport does once its buffer is written
        await asyncio.wait_for(draining, 1)

    loop.run_until_complete(drain_while_answering())


def test_drain_closes_at_its_deadline(peer: Peer, loop: asyncio.AbstractEventLoop) -> None:
    peer.start()
    peer.send(peer.headers(1))

    async def drain() -> None:
        draining = asyncio.ensure_future(peer.connection.drain(loop.time() + 0.05))
        await asyncio.sleep(0.1)
        assert peer.transport.closed
        peer.connection.connection_lost(None)
        await asyncio.wait_for(draining, 1)

    loop.run_until_complete(drain())
    assert peer.connection.resets == [1]  # the stream left open is reset for the layer above


def test_a_connection_must_open_in_time_and_is_closed_once_idle(loop: asyncio.AbstractEventLoop) -> None:
    silent = Peer(loop, preface_timeout_s=0.03)
    slow = Peer(loop, preface_timeout_s=0.03)
    slow.send(PREFACE[:10])
    prompt = Peer(loop, preface_timeout_s=0.03, idle_timeout_s=0.1)
    prompt.start()
    prompt.send(prompt.headers(1))
    loop.run_until_complete(asyncio.sleep(0.06))
    assert silent.transport.closed and slow.transport.closed and not prompt.transport.closed
    loop.run_until_complete(asyncio.sleep(0.1))
    assert not prompt.transport.closed  # a stream is open: not idle
    prompt.connection.send_headers(1, b"\x88", end_stream=True)
    loop.run_until_complete(asyncio.sleep(0.05))
    assert not prompt.transport.closed
    loop.run_until_complete(asyncio.sleep(0.15))
    assert prompt.goaway() == NO_ERROR


def test_answers_held_for_a_silent_peer_are_dropped_in_time(
    loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer whose windows stay shut and that sends nothing more: its held answer goes with the connection
    after ``idle_timeout_s``, and if it does not even read our GOAWAY, the connection is aborted after
    ``CLOSE_GRACE_S`` (else its close would wait on it for ever); a peer that keeps sending (here PINGs)
    keeps it."""
    monkeypatch.setattr(h2f, "CLOSE_GRACE_S", 0.05)
    unpoliced = Keepalive(max_ping_strikes=0)
    silent = Peer(loop, idle_timeout_s=0.1)
    talking = Peer(loop, idle_timeout_s=0.1, keepalive=unpoliced)
    for peer in (silent, talking):
        peer.start()
        peer.send(peer.headers(1, end_stream=True))
        peer.connection.send_data(1, bytes(100_000), trailers=b"\x88")  # over the peer's 65,535
        peer.connection.flush()
        peer.frames()
    for n in range(6):
        loop.run_until_complete(asyncio.sleep(0.04))
        talking.send(frame(PING, 0, 0, n.to_bytes(8, "big")))
    assert silent.goaway() == NO_ERROR
    assert not talking.transport.closed and talking.connection.pending
    loop.run_until_complete(asyncio.sleep(0.06))
    assert silent.transport.aborted  # it read nothing, not even the GOAWAY


@pytest.mark.parametrize(
    "headers",
    [
        [(":method", "POST"), (":scheme", "http"), (":path", "/s/m"), (":path", "/s/n")],  # repeated
        [(":method", "POST"), (":scheme", "http"), (":path", "/s/m"), (":status", "200")],  # a response's
        [(":method", "POST"), (":scheme", "http")],  # no :path
        [(":method", "POST"), ("x", "1"), (":scheme", "http"), (":path", "/s/m")],  # pseudo after regular
        [*REQUEST, ("X-Upper", "1")],
        [*REQUEST, ("connection", "keep-alive")],
        [*REQUEST[:-1], ("te", "gzip")],
    ],
)
def test_malformed_requests_are_stream_errors(peer: Peer, headers: list[tuple[str, str]]) -> None:
    """RFC 9113 8.1.1: a malformed request is reset (PROTOCOL_ERROR), never seen by the layer above; the
    connection goes on, and the same bytes again (a cached block) are refused again."""
    peer.start()
    peer.frames()
    for sid in (1, 3):
        block = peer.encoder.encode(headers)
        peer.send(frame(HEADERS, END_HEADERS | END_STREAM, sid, block))
    assert peer.resets() == {1: PROTOCOL_ERROR, 3: PROTOCOL_ERROR}
    assert peer.connection.opened == {}
    peer.send(peer.headers(5, end_stream=True))
    assert 5 in peer.connection.opened and peer.goaway() is None


def test_malformed_trailers_reset_the_stream(peer: Peer) -> None:
    peer.start()
    peer.send(peer.headers(1))
    peer.frames()
    peer.send(frame(HEADERS, END_HEADERS | END_STREAM, 1, peer.encoder.encode([(":path", "/x")])))
    assert peer.resets() == {1: PROTOCOL_ERROR} and peer.connection.resets == [1]


def test_pings_are_answered_and_policed_as_grpcio_does(loop: asyncio.AbstractEventLoop) -> None:
    """Every PING gets its ACK (the same 8 bytes). Without a call open, a second PING within 2 hours is a
    strike; the third strike (max_ping_strikes 2) is GOAWAY ENHANCE_YOUR_CALM "too_many_pings" (grpcio
    1.85's server, to the frame: tests/service/test_grpc_engine.py)."""
    idle = Peer(loop)
    idle.start()
    idle.frames()
    for n in range(3):
        idle.send(frame(PING, 0, 0, n.to_bytes(8, "big")))
        assert idle.frames() == [(PING, ACK, 0, n.to_bytes(8, "big"))]
    idle.send(frame(PING, 0, 0, bytes(8)))  # answered all the same (as grpcio does), then GOAWAY
    assert [kind for kind, *_ in idle.frames()] == [PING, GOAWAY]
    idle.read = 0
    assert idle.goaway() == ENHANCE_YOUR_CALM and idle.debug == b"too_many_pings"


def test_pings_with_calls_open_keep_to_the_interval_or_follow_our_data(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """With a call open the interval is ``min_ping_interval_s``; whatever the server sends (HEADERS, DATA,
    WINDOW_UPDATE) makes the next PING welcome, as a grpc client's BDP pings follow the server's data."""
    peer = Peer(loop, keepalive=Keepalive(min_ping_interval_s=0.05))
    peer.start()
    peer.send(peer.headers(1), peer.headers(3))
    for _ in range(4):  # spaced past the interval: no strike
        peer.send(frame(PING, 0, 0, bytes(8)))
        loop.run_until_complete(asyncio.sleep(0.06))
    for sid in (1, 3):  # two quick ones answered by data of ours each: no strike either
        peer.send(frame(PING, 0, 0, bytes(8)), frame(PING, 0, 0, bytes(8)))
        peer.connection.send_headers(sid, b"\x88", end_stream=True)
        peer.connection.flush()
    peer.send(peer.headers(5), *(frame(PING, 0, 0, bytes(8)) for _ in range(3)))  # two strikes
    assert peer.goaway() is None
    peer.send(frame(PING, 0, 0, bytes(8)))
    assert peer.goaway() == ENHANCE_YOUR_CALM


def test_a_silent_peer_with_a_call_open_is_pinged_and_dropped_without_an_answer(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """After ``time_s`` of silence with a call open: our PING; its ACK keeps the connection, nothing back
    within ``timeout_s`` aborts it. Without a call (``permit_without_calls`` off) nobody is pinged."""
    keepalive = Keepalive(time_s=0.05, timeout_s=0.3)
    dead, alive, idle = (Peer(loop, keepalive=keepalive) for _ in range(3))
    for peer in (dead, alive, idle):
        peer.start()
    for peer in (dead, alive):
        peer.send(peer.headers(1))
        peer.frames()
    idle.frames()
    seen: dict[Peer, list[tuple[int, int, int, bytes]]] = {dead: [], alive: [], idle: []}

    def until(condition: Any) -> None:
        for _ in range(200):  # 2 s at most
            if condition():
                return
            loop.run_until_complete(asyncio.sleep(0.01))
            for peer, frames in seen.items():
                frames += peer.frames()

    until(lambda: seen[dead] and seen[alive])
    (ping,) = seen[alive]
    assert ping[:3] == (PING, 0, 0) and [f[:2] for f in seen[dead]] == [(PING, 0)]
    alive.send(frame(PING, ACK, 0, ping[3]))
    until(lambda: dead.transport.aborted)
    assert dead.transport.aborted and not alive.transport.closed
    until(lambda: len(seen[alive]) > 1)
    assert [f[:2] for f in seen[alive]] == [(PING, 0)] * 2  # pinged again once quiet again
    assert seen[idle] == [] and not idle.transport.closed
    assert alive.connection.pings.strikes == 0  # our PINGs and their ACKs are no strikes
