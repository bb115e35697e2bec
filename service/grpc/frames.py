"""HTTP/2 (RFC 9113) server connections on robez's own frames, for the ``frames`` gRPC engine.

``FrameConnection`` is an ``asyncio.Protocol`` that reads and writes HTTP/2 frames itself: one loop over the
frames of each read, one ``write`` with everything a read answered. It is the connection layer only; the gRPC
layer (``engine.py``) subclasses it and gets a stream's decoded header list (``stream_opened``), its data
(``stream_data``, ``stream_ended``) and its reset (``stream_reset``); it answers with ``send_headers``,
``send_data`` and ``reset``, and opens a stream's receive window with ``open_window``: until then the peer
may send at most ``INITIAL_WINDOW`` bytes on the stream (our SETTINGS), so a call is checked from its
headers before its message is taken from the connection.

What a hostile peer meets (each a connection error, GOAWAY with the code, unless said otherwise):

- the preface, then a SETTINGS frame first; every setting in its range (ENABLE_PUSH 0/1, INITIAL_WINDOW_SIZE
  at most 2^31-1: FLOW_CONTROL_ERROR, MAX_FRAME_SIZE 2^14..2^24-1); our SETTINGS acknowledged within
  ``SETTINGS_ACK_S`` (SETTINGS_TIMEOUT); frames of the wrong length (FRAME_SIZE_ERROR) or stream;
- streams: client ids odd and increasing; a frame on an idle stream (PROTOCOL_ERROR), HEADERS or DATA on a
  closed stream (STREAM_CLOSED) or on a half-closed one (stream error STREAM_CLOSED); past
  ``MAX_CONCURRENT_STREAMS`` a stream is refused (stream error REFUSED_STREAM), its header block still
  decoded so that HPACK stays in step;
- flow control both ways: DATA past the connection's window (FLOW_CONTROL_ERROR) or a stream's (stream
  error FLOW_CONTROL_ERROR); a WINDOW_UPDATE of 0 (PROTOCOL_ERROR) or past 2^31-1 (FLOW_CONTROL_ERROR);
- header blocks: at most ``MAX_HEADER_BLOCK`` bytes in ``MAX_BLOCK_FRAMES`` frames, nothing between them but
  their CONTINUATION (the CONTINUATION flood: ENHANCE_YOUR_CALM); HPACK's table bounded by our
  HEADER_TABLE_SIZE, a bad block COMPRESSION_ERROR; a list over MAX_HEADER_LIST_SIZE (16 KiB) is still
  decoded in full, so that HPACK's dynamic table stays in step, and its stream alone is answered
  (``header_list_refused``); decoding stops past ``HARD_HEADER_LIST`` (64 KiB), where the table can no
  longer be kept in step: that is a connection error COMPRESSION_ERROR;
- floods: RST_STREAM (rapid reset, CVE-2023-44487), PING and SETTINGS frames from the peer, header lists
  over the limit, and frames that change nothing (empty DATA, PRIORITY, unknown types), each at most
  ``FLOOD_LIMITS`` per ``FLOOD_WINDOW_S`` (ENHANCE_YOUR_CALM);
- time: the preface and SETTINGS within ``preface_timeout_s`` of opening (else closed), and a connection
  with no stream open for ``idle_timeout_s``, or with answers held back for a peer that sent nothing for
  that long (dead, or never opening its windows), is sent GOAWAY NO_ERROR and closed; a closing connection
  whose peer takes nothing of what is left to write for ``CLOSE_GRACE_S`` is aborted;
- keepalive (``keepalive.py``, grpcio's defaults): a silent peer with calls open is PINGed and, unanswered,
  aborted; the peer's PINGs are answered and policed (GOAWAY ENHANCE_YOUR_CALM ``too_many_pings``);
- write back-pressure: while the transport's buffer is over its high mark, the connection stops reading
  and the layer above starts no call (``writable``): a peer that reads nothing holds at most the buffer
  and the answers of the calls already under way, and is cut off after a bound;
- ``drain``: GOAWAY NO_ERROR with the last stream id taken, new streams refused, the connection closed once
  its streams are done or at the deadline.
"""

from __future__ import annotations

import asyncio
import struct
import time
from typing import Any

from hpack import HPACKError

from .headers import (
    HARD_HEADER_LIST,
    HEADER_TABLE_SIZE,
    MAX_HEADER_LIST,
    TOO_LARGE,
    CachingDecoder,
    never_indexed,
)
from .keepalive import TOO_MANY_PINGS, Keepalive, PingPolicy

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEAD = struct.Struct(">BHBBI")  # length (24 bits as 8 + 16), type, flags, stream id

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    range(10)
)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20

NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR, SETTINGS_TIMEOUT = 0x0, 0x1, 0x2, 0x3, 0x4
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 0x5, 0x6, 0x7, 0x8, 0x9
ENHANCE_YOUR_CALM = 0xB

MAX_WINDOW = (1 << 31) - 1
DEFAULT_WINDOW = 65535  # RFC 9113's initial windows, the connection's and (our SETTINGS) each stream's
INITIAL_WINDOW = DEFAULT_WINDOW
MAX_FRAME = 16384  # what we take (our SETTINGS_MAX_FRAME_SIZE stays the default)
MAX_CONCURRENT_STREAMS = 100  # as grpc.aio's setting today, Envoy's and nginx's defaults
MAX_HEADER_BLOCK = HARD_HEADER_LIST  # compressed, across HEADERS and its CONTINUATION frames
MAX_BLOCK_FRAMES = 32  # HEADERS and CONTINUATION frames of one header block (empty ones are a flood too)
SETTINGS_ACK_S = 10.0
CLOSE_GRACE_S = 5.0  # a closing connection's buffer must be taken within this, else it is aborted
FLOOD_WINDOW_S = 1.0
# frames from the peer per FLOOD_WINDOW_S: resets of streams (rapid reset), PINGs, SETTINGS
NO_OP = -1  # frames that change nothing: empty DATA without END_STREAM, PRIORITY, unknown types
BIG_LIST = -2  # header lists over MAX_HEADER_LIST (each decoded in full: up to HARD_HEADER_LIST)
FLOOD_LIMITS = {RST_STREAM: 200, PING: 50, SETTINGS: 50, NO_OP: 200, BIG_LIST: 10}
_JOINED_BYTES = 4096  # answers' data up to this is joined into the one write; larger, written as is
WRITE_HIGH_BYTES = 256 * 1024  # the transport's buffer past which the connection stops reading

_SERVER_SETTINGS = struct.pack(
    ">HIHIHIHI", 0x1, HEADER_TABLE_SIZE, 0x2, 0, 0x3, MAX_CONCURRENT_STREAMS, 0x6, MAX_HEADER_LIST
)


def frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return HEAD.pack(n >> 16, n & 0xFFFF, kind, flags, sid) + payload


# The connection's window: room for every stream's (each stream's window is what bounds what it holds).
CONNECTION_WINDOW = MAX_CONCURRENT_STREAMS * INITIAL_WINDOW
# what a connection opens with: our SETTINGS, and the connection's window widened to CONNECTION_WINDOW
_OPENING = frame(SETTINGS, 0, 0, _SERVER_SETTINGS) + frame(
    WINDOW_UPDATE, 0, 0, (CONNECTION_WINDOW - DEFAULT_WINDOW).to_bytes(4, "big")
)


_SETTINGS_ACK = frame(SETTINGS, ACK, 0)
_STATUS_431 = never_indexed([(b":status", b"431")])  # Request Header Fields Too Large (RFC 6585, 9113 10.5.1)


class ConnectionError_(Exception):
    """A connection error: GOAWAY with ``code`` (and ``debug`` data), then the connection closed."""

    def __init__(self, code: int, why: str, debug: bytes = b"") -> None:
        super().__init__(why)
        self.code = code
        self.debug = debug


class Stream:
    """One stream's state on the connection (client-initiated; open or half-closed remote)."""

    __slots__ = ("app", "ended", "opened", "recv_window", "sid", "taken", "window")

    def __init__(self, sid: int, window: int) -> None:
        self.sid = sid
        self.window = window  # the peer's window for what we send on the stream
        self.recv_window = INITIAL_WINDOW  # what the peer may still send on it
        self.taken = 0  # bytes received since the last WINDOW_UPDATE for it (once opened)
        self.opened = False  # its receive window is credited as data arrives (``open_window``)
        self.ended = False  # END_STREAM received (half-closed remote)
        self.app: Any = None  # the layer above's state of the stream


class FrameConnection(asyncio.Protocol):
    """An HTTP/2 server connection (module docstring). Subclasses implement the ``stream_*`` hooks."""

    def __init__(
        self,
        preface_timeout_s: float | None = None,
        idle_timeout_s: float | None = None,
        keepalive: Keepalive | None = None,
    ) -> None:
        self.preface_timeout_s = preface_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.keepalive = keepalive if keepalive is not None else Keepalive()
        self.pings = PingPolicy(self.keepalive)  # the peer's PINGs, policed
        self.keepalive_timer: asyncio.TimerHandle | None = None
        self.watchdog: asyncio.TimerHandle | None = None  # our PING's answer awaited
        self.ping_out: bytes | None = None  # our PING's payload while unanswered
        self.ping_sent = 0.0  # loop.time() it went
        self.preface_timer: asyncio.TimerHandle | None = None
        self.idle_timer: asyncio.TimerHandle | None = None
        self.idle_since = 0.0  # loop.time() when the last stream closed (or the connection opened)
        self.last_read = 0.0  # loop.time() of the last bytes from the peer
        self.decoder = CachingDecoder()
        self.buffer = b""
        self.preface = False
        self.settings_seen = False
        self.streams: dict[int, Stream] = {}
        self.last_sid = 0  # the highest stream id the peer opened
        self.block = bytearray()  # a header block arriving in CONTINUATION frames
        self.block_sid = 0  # its stream (0: none arriving)
        self.block_flags = 0
        self.block_frames = 0
        self.recv_window = CONNECTION_WINDOW  # what the peer may still send on the connection
        self.recv_taken = 0
        self.send_window = DEFAULT_WINDOW  # the peer's connection window
        self.initial_window = DEFAULT_WINDOW  # the peer's SETTINGS_INITIAL_WINDOW_SIZE
        self.max_frame = MAX_FRAME  # the peer's SETTINGS_MAX_FRAME_SIZE
        self.out: list[bytes | memoryview] = []
        # answers under flow control: stream, what is left of its prefix and its data, its trailers block
        self.pending: dict[int, tuple[Stream, bytes, memoryview, bytes | None]] = {}
        self.out_bytes = 0  # of the big pieces in ``out`` (answers' data, written without a copy)
        self.transport: asyncio.Transport | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.settings_timer: asyncio.TimerHandle | None = None
        self.floods = {kind: [0.0, 0] for kind in FLOOD_LIMITS}  # kind -> [window start, count]
        self.paused = False  # the transport's buffer is over its high mark: reading stopped
        self.resumed: asyncio.Event | None = None  # set when no longer ``blocked``, once a call waited
        self.held = 0  # bytes of answers held back by the peer's windows (``pending``)
        self.draining = False  # GOAWAY sent: no new streams
        self.closed = False
        self.done: asyncio.Future[None] | None = None  # set once the connection is lost

    # -- asyncio.Protocol ---------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.loop = asyncio.get_running_loop()
        self.done = self.loop.create_future()
        self.transport.set_write_buffer_limits(high=WRITE_HIGH_BYTES)  # type: ignore[union-attr]
        self.transport.write(_OPENING)  # type: ignore[union-attr]
        self.settings_timer = self.loop.call_later(SETTINGS_ACK_S, self._settings_timeout)
        self.idle_since = self.last_read = self.loop.time()
        if self.preface_timeout_s is not None:
            self.preface_timer = self.loop.call_later(self.preface_timeout_s, self._preface_expired)
        if self.idle_timeout_s is not None:
            self.idle_timer = self.loop.call_later(self.idle_timeout_s, self._idle_check)
        self.keepalive_timer = self.loop.call_later(self.keepalive.time_s, self._keepalive_check)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        for timer in (
            self.settings_timer,
            self.preface_timer,
            self.idle_timer,
            self.keepalive_timer,
            self.watchdog,
        ):
            if timer is not None:
                timer.cancel()
        for sid in list(self.streams):
            self._close_stream(sid, reset=True)
        self.pending.clear()
        self.buffer = b""
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    def pause_writing(self) -> None:
        self.paused = True
        self._blocked_changed()
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        self._blocked_changed()
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    @property
    def blocked(self) -> bool:
        """Whether the peer is behind with our answers: the transport's buffer over its high mark, or more
        than ``WRITE_HIGH_BYTES`` of answers held back by its windows."""
        return self.paused or self.held > WRITE_HIGH_BYTES

    def _blocked_changed(self) -> None:
        if self.resumed is not None:
            if self.blocked:
                self.resumed.clear()
            else:
                self.resumed.set()

    async def writable(self, timeout_s: float) -> None:
        """Return once the peer takes our answers again (at once unless ``blocked``); a peer that takes none
        for ``timeout_s`` is cut off (the connection aborted: what it holds freed, its streams reset)."""
        if not self.blocked:
            return
        if self.resumed is None:
            self.resumed = asyncio.Event()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            while self.blocked and not self.closed:
                self.resumed.clear()
                await asyncio.wait_for(self.resumed.wait(), max(deadline - loop.time(), 0.0))
        except TimeoutError:
            if not self.closed:
                self.closed = True
                self.transport.abort()  # type: ignore[union-attr]
            raise
        if self.closed:
            raise TimeoutError

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self.last_read = self.loop.time()  # type: ignore[union-attr]
        try:
            self._frames(data)
        except ConnectionError_ as exc:
            self.goaway(exc.code, close=True, debug=exc.debug)
            return
        self.flush()

    # -- hooks for the layer above ------------------------------------------------------------------------

    def stream_opened(self, stream: Stream, headers: list[tuple[bytes, bytes]]) -> None:
        """A new stream's decoded header list (``stream.ended``: it came with END_STREAM)."""

    def stream_data(self, stream: Stream, data: bytes) -> None:
        """Data received on an open stream (not yet credited back unless ``open_window`` was called)."""

    def stream_ended(self, stream: Stream) -> None:
        """END_STREAM received on a stream (after its data)."""

    def stream_reset(self, stream: Stream) -> None:
        """The stream is gone before its answer ended (the peer reset it, or the connection closed)."""

    def header_list_refused(self, sid: int, ended: bool) -> None:
        """A new stream's header list was over ``MAX_HEADER_LIST``: the stream is never opened; this answers
        it (HTTP 431 here; ``ended``: the request came with END_STREAM, else the rest is not wanted)."""
        self.send_headers(sid, _STATUS_431, end_stream=True)
        if not ended:
            self.out.append(frame(RST_STREAM, 0, sid, NO_ERROR.to_bytes(4, "big")))

    # -- what the layer above sends -----------------------------------------------------------------------

    def flush(self) -> None:
        """Write what the frames handled so far answered, in one write (small pieces joined; large answers'
        data as views of their bytes, gathered by ``writelines``)."""
        if self.out and not self.closed:
            if self.out_bytes:
                self.transport.writelines(self.out)  # type: ignore[union-attr]
                self.out_bytes = 0
            else:
                self.transport.write(b"".join(self.out))  # type: ignore[union-attr]
            self.out.clear()

    def send_headers(self, sid: int, block: bytes, end_stream: bool = False) -> None:
        """A header block (at most the peer's frame size: ours are small constant blocks)."""
        self.pings.reset()
        self.out.append(frame(HEADERS, END_HEADERS | (END_STREAM if end_stream else 0), sid, block))
        if end_stream:
            self._close_stream(sid, reset=False)

    def send_data(self, sid: int, data: bytes, trailers: bytes | None, prefix: bytes = b"") -> None:
        """``prefix`` then ``data`` on stream ``sid`` under the peer's windows (held back until they open), in
        frames of at most the peer's frame size, ``data`` never copied; then the trailers block
        (END_STREAM), which closes the stream."""
        stream = self.streams.get(sid)
        if stream is None:
            return
        size = len(prefix) + len(data)
        if not self.pending and size <= self.send_window and size <= stream.window and size <= self.max_frame:
            self.send_window -= size
            stream.window -= size
            if size:
                self.pings.reset()
                self.out.append(HEAD.pack(size >> 16, size & 0xFFFF, DATA, 0, sid) + prefix)
                self.out.append(data)
                self.out_bytes += len(data) if len(data) > _JOINED_BYTES else 0
            if trailers is not None:
                self.send_headers(sid, trailers, end_stream=True)
            return
        self.pending[sid] = (stream, prefix, memoryview(data), trailers)
        self._send_pending()

    def reset(self, sid: int, code: int, notify: bool = False) -> None:
        """RST_STREAM ``code``: the stream is closed (``notify``: the layer above is told, ``stream_reset``,
        as for the connection's own stream errors)."""
        self.out.append(frame(RST_STREAM, 0, sid, code.to_bytes(4, "big")))
        self._close_stream(sid, reset=notify)

    def open_window(self, stream: Stream) -> None:
        """From now on the stream's receive window is credited back as its data arrives."""
        if stream.opened:
            return
        stream.opened = True
        taken = INITIAL_WINDOW - stream.recv_window
        if taken and not stream.ended:
            self.pings.reset()
            stream.recv_window += taken
            self.out.append(frame(WINDOW_UPDATE, 0, stream.sid, taken.to_bytes(4, "big")))

    def goaway(self, code: int, close: bool, debug: bytes = b"") -> None:
        """GOAWAY with the last stream id taken (and ``debug`` data); ``close``: then closed."""
        if self.closed:
            return
        self.draining = True
        self.out.append(frame(GOAWAY, 0, 0, struct.pack(">II", self.last_sid, code) + debug))
        self.flush()
        if close:
            self.close()

    def close(self) -> None:
        """Closed once what is buffered is written; a peer that takes none of it for ``CLOSE_GRACE_S`` is
        cut off (aborted), so that a closed connection never lingers on a peer that reads nothing."""
        self.closed = True
        self.transport.close()  # type: ignore[union-attr]
        self.loop.call_later(CLOSE_GRACE_S, self._abort_unless_gone)  # type: ignore[union-attr]

    def _abort_unless_gone(self) -> None:
        if self.done is not None and not self.done.done():
            self.transport.abort()  # type: ignore[union-attr]

    async def drain(self, deadline: float) -> None:
        """GOAWAY NO_ERROR, then wait until the streams under way are done (or ``deadline``, a
        ``loop.time()``), then close."""
        if self.closed or self.loop is None:
            return
        self.goaway(NO_ERROR, close=False)
        while self.streams and self.loop.time() < deadline and not self.closed:
            await asyncio.sleep(min(0.01, max(deadline - self.loop.time(), 0)))
        if not self.closed:
            self.close()
        if self.done is not None:
            await asyncio.wait_for(asyncio.shield(self.done), timeout=1.0)

    # -- frames in ----------------------------------------------------------------------------------------

    def _frames(self, data: bytes) -> None:
        buf = self.buffer + data if self.buffer else data
        pos = 0
        if not self.preface:
            if len(buf) < 24:
                if not PREFACE.startswith(buf):
                    raise ConnectionError_(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                self.buffer = buf
                return
            if buf[:24] != PREFACE:
                raise ConnectionError_(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            self.preface, pos = True, 24
        end = len(buf)
        unpack = HEAD.unpack_from
        while end - pos >= 9 and not self.closed:
            high, low, kind, flags, sid = unpack(buf, pos)
            length = high << 16 | low
            if length > MAX_FRAME:
                raise ConnectionError_(FRAME_SIZE_ERROR, "frame over SETTINGS_MAX_FRAME_SIZE")
            stop = pos + 9 + length
            if stop > end:
                break
            payload = buf[pos + 9 : stop]
            pos = stop
            sid &= 0x7FFFFFFF
            if not self.settings_seen:
                if kind != SETTINGS or flags & ACK:
                    raise ConnectionError_(PROTOCOL_ERROR, "the preface's first frame must be SETTINGS")
                self.settings_seen = True
                if self.preface_timer is not None:
                    self.preface_timer.cancel()
                    self.preface_timer = None
            if self.block_sid and (kind != CONTINUATION or sid != self.block_sid):
                raise ConnectionError_(PROTOCOL_ERROR, "a header block interrupted")
            if kind == DATA:
                self._data(sid, flags, payload)
            elif kind == HEADERS:
                self._headers(sid, flags, payload)
            elif kind == CONTINUATION:
                if not self.block_sid:
                    raise ConnectionError_(PROTOCOL_ERROR, "CONTINUATION without a header block")
                self._block_part(payload, flags)
            elif kind == SETTINGS:
                self._settings(sid, flags, payload)
            elif kind == PING:
                self._ping(sid, flags, payload)
            elif kind == WINDOW_UPDATE:
                self._window_update(sid, payload)
            elif kind == RST_STREAM:
                self._rst(sid, payload)
            elif kind == PRIORITY:
                if sid == 0:
                    raise ConnectionError_(PROTOCOL_ERROR, "PRIORITY on stream 0")
                if length != 5:
                    self.reset(sid, FRAME_SIZE_ERROR, notify=True)
                self._flood(NO_OP)
            elif kind == GOAWAY:
                if sid != 0:
                    raise ConnectionError_(PROTOCOL_ERROR, "GOAWAY on a stream")
                self.draining = True  # the peer opens no more streams; ours finish
            elif kind == PUSH_PROMISE:
                raise ConnectionError_(PROTOCOL_ERROR, "a client cannot push")
            else:  # unknown frame types are ignored (RFC 9113 5.5), within the no-op frames' bound
                self._flood(NO_OP)
        self.buffer = buf[pos:] if pos < end else b""

    def _flood(self, kind: int) -> None:
        counter = self.floods[kind]
        now = time.monotonic()
        if now - counter[0] > FLOOD_WINDOW_S:
            counter[0], counter[1] = now, 0
        counter[1] += 1
        if counter[1] > FLOOD_LIMITS[kind]:
            raise ConnectionError_(ENHANCE_YOUR_CALM, "too many control frames")

    def _settings(self, sid: int, flags: int, payload: bytes) -> None:
        if sid != 0:
            raise ConnectionError_(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise ConnectionError_(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            if self.settings_timer is not None:
                self.settings_timer.cancel()
                self.settings_timer = None
            return
        if len(payload) % 6:
            raise ConnectionError_(FRAME_SIZE_ERROR, "SETTINGS not a multiple of 6 bytes")
        self._flood(SETTINGS)
        for offset in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, offset)
            if key == 0x2 and value > 1:
                raise ConnectionError_(PROTOCOL_ERROR, "SETTINGS_ENABLE_PUSH not 0 or 1")
            if key == 0x4:
                if value > MAX_WINDOW:
                    raise ConnectionError_(FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE over 2^31-1")
                delta, self.initial_window = value - self.initial_window, value
                for stream in self.streams.values():
                    stream.window += delta
                    if stream.window > MAX_WINDOW:
                        raise ConnectionError_(FLOW_CONTROL_ERROR, "a stream window over 2^31-1")
            elif key == 0x5:
                if not MAX_FRAME <= value <= (1 << 24) - 1:
                    raise ConnectionError_(PROTOCOL_ERROR, "SETTINGS_MAX_FRAME_SIZE out of range")
                self.max_frame = value
            # HEADER_TABLE_SIZE: our blocks are never-indexed literals, whatever the peer's table
        self.out.append(_SETTINGS_ACK)
        if self.pending:
            self._send_pending()

    def _preface_expired(self) -> None:
        """No preface and SETTINGS within ``preface_timeout_s`` of opening (a slow or idle opener)."""
        self.preface_timer = None
        if not self.settings_seen and not self.closed:
            self.close()

    def _idle_check(self) -> None:
        """GOAWAY NO_ERROR and close once no stream was open for ``idle_timeout_s``."""
        assert self.idle_timeout_s is not None and self.loop is not None
        self.idle_timer = None
        if self.closed:
            return
        now = self.loop.time()
        idle, quiet = now - self.idle_since, now - self.last_read
        if not self.streams and idle >= self.idle_timeout_s:
            self.goaway(NO_ERROR, close=True)
            return
        if self.pending and quiet >= self.idle_timeout_s:
            # answers held for a peer that has sent nothing, not even a WINDOW_UPDATE, for that long
            self.goaway(NO_ERROR, close=True)
            return
        if not self.streams:
            wait = self.idle_timeout_s - idle
        elif self.pending:
            wait = self.idle_timeout_s - quiet
        else:  # calls under way, none held back: each is bounded by its own timers
            wait = self.idle_timeout_s
        self.idle_timer = self.loop.call_later(max(wait, 0.01), self._idle_check)

    def _settings_timeout(self) -> None:
        self.settings_timer = None
        self.goaway(SETTINGS_TIMEOUT, close=True)

    def _ping(self, sid: int, flags: int, payload: bytes) -> None:
        if sid != 0:
            raise ConnectionError_(PROTOCOL_ERROR, "PING on a stream")
        if len(payload) != 8:
            raise ConnectionError_(FRAME_SIZE_ERROR, "PING not 8 bytes")
        if flags & ACK:
            if payload == self.ping_out:  # our keepalive PING answered
                self.ping_out = None
                if self.watchdog is not None:
                    self.watchdog.cancel()
                    self.watchdog = None
            return
        self._flood(PING)
        self.out.append(frame(PING, ACK, 0, payload))  # answered even when it is one too many, as grpcio
        if self.pings.received(time.monotonic(), bool(self.streams)):
            raise ConnectionError_(ENHANCE_YOUR_CALM, "too many PINGs without data", TOO_MANY_PINGS)

    def _keepalive_check(self) -> None:
        """PING a peer that sent nothing for ``keepalive.time_s`` (with calls open, or always if
        ``permit_without_calls``), then watch for its answer (``_keepalive_expired``)."""
        assert self.loop is not None
        self.keepalive_timer = None
        if self.closed:
            return
        keepalive, now = self.keepalive, self.loop.time()
        quiet = now - self.last_read
        wait = keepalive.time_s - quiet if quiet < keepalive.time_s else keepalive.time_s
        if (
            quiet >= keepalive.time_s
            and self.ping_out is None
            and (self.streams or keepalive.permit_without_calls)
        ):
            self.ping_out, self.ping_sent = struct.pack(">d", now), now
            self.out.append(frame(PING, 0, 0, self.ping_out))
            self.flush()
            self.watchdog = self.loop.call_later(keepalive.timeout_s, self._keepalive_expired)
        self.keepalive_timer = self.loop.call_later(max(wait, 0.01), self._keepalive_check)

    def _keepalive_expired(self) -> None:
        """No answer to our PING within ``keepalive.timeout_s``: unless anything else came from the peer
        since (alive, only slow), it is taken for dead and the connection aborted (its buffer dropped)."""
        self.watchdog = None
        if self.closed or self.ping_out is None:
            return
        self.ping_out = None
        if self.last_read > self.ping_sent:
            return
        self.closed = True
        self.transport.abort()  # type: ignore[union-attr]

    def _window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ConnectionError_(FRAME_SIZE_ERROR, "WINDOW_UPDATE not 4 bytes")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if sid == 0:
            if increment == 0:
                raise ConnectionError_(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise ConnectionError_(FLOW_CONTROL_ERROR, "connection window over 2^31-1")
        else:
            if sid > self.last_sid:
                raise ConnectionError_(PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
            stream = self.streams.get(sid)
            if stream is None:
                return  # closed: may cross our RST_STREAM or END_STREAM
            if increment == 0:
                self.reset(sid, PROTOCOL_ERROR, notify=True)
                return
            stream.window += increment
            if stream.window > MAX_WINDOW:
                self.reset(sid, FLOW_CONTROL_ERROR, notify=True)
                return
        if self.pending:
            self._send_pending()

    def _rst(self, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise ConnectionError_(PROTOCOL_ERROR, "RST_STREAM on stream 0")
        if len(payload) != 4:
            raise ConnectionError_(FRAME_SIZE_ERROR, "RST_STREAM not 4 bytes")
        if sid > self.last_sid:
            raise ConnectionError_(PROTOCOL_ERROR, "RST_STREAM on an idle stream")
        self._flood(RST_STREAM)
        self._close_stream(sid, reset=True)

    def _strip_padding(self, flags: int, payload: bytes) -> tuple[int, int]:
        start, stop = 0, len(payload)
        if flags & PADDED:
            if not payload or payload[0] >= len(payload):
                raise ConnectionError_(PROTOCOL_ERROR, "padding as long as the frame")
            start, stop = 1, stop - payload[0]
        return start, stop

    def _headers(self, sid: int, flags: int, payload: bytes) -> None:
        if sid == 0:
            raise ConnectionError_(PROTOCOL_ERROR, "HEADERS on stream 0")
        start, stop = self._strip_padding(flags, payload)
        if flags & PRIORITY_FLAG:
            start += 5
            if start > stop:
                raise ConnectionError_(FRAME_SIZE_ERROR, "HEADERS shorter than its priority")
        if sid <= self.last_sid:
            stream = self.streams.get(sid)
            if stream is None:
                raise ConnectionError_(STREAM_CLOSED, "HEADERS on a closed stream")
            # trailers (gRPC's unary clients send none): decoded to keep HPACK in step, then checked
            self.block_flags = flags | 0x100  # marks trailers
        elif not sid & 1:
            raise ConnectionError_(PROTOCOL_ERROR, "a client stream id must be odd")
        else:
            self.last_sid = sid
            self.block_flags = flags
        self.block_sid = sid
        self.block = bytearray()
        self.block_frames = 0
        self._block_part(payload[start:stop], flags)

    def _block_part(self, part: bytes, flags: int) -> None:
        self.block += part
        self.block_frames += 1
        if len(self.block) > MAX_HEADER_BLOCK or self.block_frames > MAX_BLOCK_FRAMES:
            raise ConnectionError_(ENHANCE_YOUR_CALM, "a header block over its bounds (CONTINUATION flood)")
        if flags & END_HEADERS:
            sid, block, first = self.block_sid, bytes(self.block), self.block_flags
            self.block_sid, self.block = 0, bytearray()
            try:
                if first & 0x100:  # trailers: rare, not cached
                    headers, problem = self.decoder.decode_checked(block, trailers=True)
                else:
                    headers, problem = self.decoder.decode_request(block)
            except HPACKError as exc:
                raise ConnectionError_(COMPRESSION_ERROR, f"a bad header block: {exc}") from exc
            self._header_list(sid, first, headers, problem)

    def _header_list(
        self, sid: int, flags: int, headers: list[tuple[bytes, bytes]], problem: str | None
    ) -> None:
        """A decoded header block: a new stream's request, or trailers (flag 0x100); ``problem``: what is
        malformed in it (a stream error PROTOCOL_ERROR, RFC 9113 8.1.1, after the state's own checks), or
        ``TOO_LARGE``: the stream alone is answered (``header_list_refused``; trailers: reset
        ENHANCE_YOUR_CALM), the connection and HPACK's table go on."""
        if problem is TOO_LARGE:
            self._flood(BIG_LIST)
        if flags & 0x100:  # on a stream already open
            stream = self.streams[sid]
            if stream.ended:
                self.reset(sid, STREAM_CLOSED, notify=True)
            elif problem is TOO_LARGE:
                self.reset(sid, ENHANCE_YOUR_CALM, notify=True)
            elif not flags & END_STREAM or problem is not None:
                self.reset(sid, PROTOCOL_ERROR, notify=True)  # trailers: must end the stream, well formed
            else:
                stream.ended = True
                self.stream_ended(stream)
            return
        if self.draining or len(self.streams) >= MAX_CONCURRENT_STREAMS:
            self.out.append(frame(RST_STREAM, 0, sid, REFUSED_STREAM.to_bytes(4, "big")))
            return
        if problem is TOO_LARGE:
            self.header_list_refused(sid, bool(flags & END_STREAM))
            return
        if problem is not None:
            self.out.append(frame(RST_STREAM, 0, sid, PROTOCOL_ERROR.to_bytes(4, "big")))
            return
        stream = self.streams[sid] = Stream(sid, self.initial_window)
        stream.ended = bool(flags & END_STREAM)
        self.stream_opened(stream, headers)
        if stream.ended and sid in self.streams:
            self.stream_ended(stream)

    def _data(self, sid: int, flags: int, payload: bytes) -> None:
        if sid == 0:
            raise ConnectionError_(PROTOCOL_ERROR, "DATA on stream 0")
        length = len(payload)
        self.recv_window -= length
        if self.recv_window < 0:
            raise ConnectionError_(FLOW_CONTROL_ERROR, "DATA past the connection window")
        # the connection's window is credited as data arrives: each stream's bounds what it holds
        self.recv_taken += length
        if self.recv_taken >= CONNECTION_WINDOW // 4:
            self.pings.reset()
            self.out.append(frame(WINDOW_UPDATE, 0, 0, self.recv_taken.to_bytes(4, "big")))
            self.recv_window += self.recv_taken
            self.recv_taken = 0
        if sid > self.last_sid:
            raise ConnectionError_(PROTOCOL_ERROR, "DATA on an idle stream")
        stream = self.streams.get(sid)
        if stream is None:
            return  # closed by us (a reset crossing the peer's data) or done: dropped
        if stream.ended:
            self.reset(sid, STREAM_CLOSED, notify=True)
            return
        start, stop = self._strip_padding(flags, payload)
        if stop == start and not flags & END_STREAM:
            self._flood(NO_OP)  # empty DATA frames cost us and carry nothing (CVE-2019-9518)
        stream.recv_window -= length
        if stream.recv_window < 0:
            self.reset(sid, FLOW_CONTROL_ERROR, notify=True)
            return
        if stop > start:
            self.stream_data(stream, payload[start:stop])
        if sid not in self.streams:
            return
        if flags & END_STREAM:
            stream.ended = True
            self.stream_ended(stream)
        elif stream.opened:
            stream.taken += length
            if stream.taken >= INITIAL_WINDOW // 2:
                stream.recv_window += stream.taken
                self.pings.reset()
                self.out.append(frame(WINDOW_UPDATE, 0, sid, stream.taken.to_bytes(4, "big")))
                stream.taken = 0

    # -- frames out under flow control --------------------------------------------------------------------

    def _send_pending(self) -> None:
        for sid, (stream, prefix, data, trailers) in list(self.pending.items()):
            while prefix or data:
                room = min(self.send_window, stream.window, self.max_frame, len(prefix) + len(data))
                if room <= 0:
                    break
                head, prefix = prefix[:room], prefix[room:]
                rest = room - len(head)
                self.pings.reset()
                self.out.append(HEAD.pack(room >> 16, room & 0xFFFF, DATA, 0, sid) + head)
                if rest:
                    self.out.append(data[:rest])
                    self.out_bytes += rest
                    data = data[rest:]
                self.send_window -= room
                stream.window -= room
            if prefix or data:
                self.pending[sid] = (stream, prefix, data, trailers)
                continue
            del self.pending[sid]
            if trailers is not None:
                self.send_headers(sid, trailers, end_stream=True)
        self._count_held()

    def _count_held(self) -> None:
        was = self.blocked
        self.held = sum(len(prefix) + len(data) for _, prefix, data, _ in self.pending.values())
        if self.blocked != was:
            self._blocked_changed()

    def _close_stream(self, sid: int, reset: bool) -> None:
        stream = self.streams.pop(sid, None)
        if self.pending.pop(sid, None) is not None:
            self._count_held()
        if not self.streams and self.loop is not None:
            self.idle_since = self.loop.time()
        if stream is not None and reset:
            self.stream_reset(stream)
