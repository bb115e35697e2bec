"""gRPC without ``grpc.aio``: the server CPU of a unary call on HTTP/2 servers written on an asyncio
(uvloop) ``Protocol``, against ``grpc.aio``'s and grpcio's synchronous server, and a prototype of robez's
1-id ``ModelInfer`` on the cheapest of them beside ``robez serve``'s gRPC and ``/v1`` binary (issue 38).

    python -m benchmarks.service.grpc_h2 --floor [--rounds 5] [--calls 2000]
    python -m benchmarks.service.grpc_h2 --infer [--rounds 7] [--calls 1000] [--ids 1]
        [--stacks frames,h2 tuned]

Servers (each a process of its own on a free loopback port, every one answering ``/bench/Echo`` by
echoing its message, or robez's ``ModelInfer``):

- ``grpc.aio`` on uvloop, stream-unary, robez's options and its iomgr setting (``grpc_servers.FLOOR``);
- grpcio's synchronous server (``grpc.server`` on a thread pool), robez's options (``grpc_servers.FLOOR``);
- ``h2``: the ``h2`` library (``H2Connection``, its defaults) in a uvloop ``Protocol`` (``H2Protocol``);
- ``h2 tuned``: the same without h2's header validation and normalisation, with bytes headers, its
  answer's header blocks encoded once (``StaticEncoder``) and request header blocks that only index the
  tables decoded once (``CachingDecoder``);
- ``frames``: HTTP/2 frames read and written by hand (``FrameProtocol``; HPACK decoding by ``hpack``
  with the same cache), the least Python per call this design can do.

The caller is one synchronous ``grpcio`` channel sending robez's 1-id ``ModelInferRequest`` (33 bytes)
with a 10 s deadline (the header ``grpc-timeout``), as ``grpc_servers`` does. Server CPU per call from
/proc schedstat of every thread of the server's processes, split into the main threads (the event loop)
and the others (gRPC's pollers, a thread pool, numba/torch threads); variants alternate in every round;
medians over rounds.

The HTTP/2 servers here are benchmark code: enough HTTP/2 for grpcio's client (preface, SETTINGS and
their ACK, PING ACK, WINDOW_UPDATE both ways, CONTINUATION, padding, RST_STREAM, GOAWAY, answers held
back by the peer's flow-control windows), one message per call; ``--floor --tls`` serves over TLS with
ALPN h2. The frames server also checks what a gRPC server must per call (content type, message encoding,
``grpc-timeout`` as a deadline, at most 100 concurrent streams). None of them has keepalive or the
hardening against hostile peers a product endpoint needs (docs/benchmarks/grpc-floor-2026-11-28.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import ssl
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    RequestReceived,
    StreamEnded,
    StreamReset,
    WindowUpdated,
)
from h2.exceptions import ProtocolError
from hpack import Decoder, Encoder, NeverIndexedHeaderTuple

from benchmarks.service.grpc_servers import (
    FLOOR,
    TLS_DIR_VARIABLE,
    cpu_s,
    free_port,
    infer_message,
)
from loadtest.server import tree_pids
from service.grpc.engine import grpc_timeout_s  # the product engine's, as the prototype's calls use it

INFER = b"/inference.GRPCInferenceService/ModelInfer"
ECHO = b"/bench/Echo"
# An answer: (the response message, the gRPC status code, its message).
Answer = Callable[[bytes, bytes], tuple[bytes, int, str]]
_MAX_MESSAGE_BYTES = 4 << 20  # a call's body past this is refused (RESOURCE_EXHAUSTED), as gRPC's default
_RESOURCE_EXHAUSTED, _UNIMPLEMENTED, _INTERNAL = 8, 12, 13


def echo(path: bytes, message: bytes) -> tuple[bytes, int, str]:
    """The floor's handler: the message back."""
    return message, 0, ""


# -- HPACK: what every server here shares -------------------------------------------------------------


def _never_indexed(headers: list[tuple[bytes, bytes]]) -> bytes:
    """A header block that leaves both HPACK tables as they were (never-indexed literals; ``:status 200``
    too), so its bytes can be kept and sent again on any connection."""
    return Encoder().encode([NeverIndexedHeaderTuple(name, value) for name, value in headers], huffman=False)


RESPONSE_HEADERS = [(b":status", b"200"), (b"content-type", b"application/grpc")]
RESPONSE_BLOCK = _never_indexed(RESPONSE_HEADERS)
OK_TRAILERS = [(b"grpc-status", b"0")]
OK_TRAILERS_BLOCK = _never_indexed(OK_TRAILERS)


def _error_trailers(code: int, message: str) -> list[tuple[bytes, bytes]]:
    quoted = "".join(c if " " <= c <= "~" and c != "%" else f"%{ord(c):02X}" for c in message[:1024])
    return [(b"grpc-status", str(code).encode()), (b"grpc-message", quoted.encode("ascii", "replace"))]


def only_indexed(block: bytes) -> bool:
    """Whether a header block is only indexed fields of one byte each (0x81-0xfe): decoding it changes
    neither HPACK table, so its decoded headers stay valid until a block that may change the table."""
    return all(0x81 <= byte <= 0xFE for byte in block)


class CachingDecoder(Decoder):
    """``hpack.Decoder`` that keeps the decoded headers of blocks made only of indexed fields: a client
    sending the same call again sends the same bytes (grpcio indexes its headers once). Any other block
    may change the dynamic table (its indices shift), so it empties the cache."""

    def __init__(self) -> None:
        super().__init__()
        self.cache: dict[bytes, Any] = {}

    def decode(self, data: bytes, raw: bool = False) -> Any:
        key = bytes(data)
        headers = self.cache.get(key)
        if headers is not None:
            return headers
        headers = super().decode(data, raw)
        if only_indexed(key):
            if len(self.cache) > 64:
                self.cache.clear()
            self.cache[key] = headers
        else:
            self.cache.clear()
        return headers


class StaticEncoder:
    """An encoder for h2 that writes never-indexed blocks, each kept once encoded (``_never_indexed``)."""

    def __init__(self) -> None:
        self.header_table_size = 4096  # h2 sets it from the peer's settings; nothing here indexes
        self.blocks: dict[tuple[tuple[bytes, bytes], ...], bytes] = {}

    def encode(self, headers: Any, huffman: bool = True) -> bytes:
        key = tuple((bytes(name), bytes(value)) for name, value in headers)
        block = self.blocks.get(key)
        if block is None:
            block = _never_indexed(list(key))
            if len(self.blocks) < 64:
                self.blocks[key] = block
        return block


def _split_message(body: bytes) -> tuple[bytes | None, int, str]:
    """The one gRPC message of a call's body (5-byte prefix: compressed flag, big-endian length)."""
    if len(body) < 5:
        return None, _INTERNAL, "the call carries no request message"
    if body[0]:
        return None, _UNIMPLEMENTED, "compressed messages are not accepted (grpc-encoding identity only)"
    length = int.from_bytes(body[1:5], "big")
    if len(body) != 5 + length:
        return None, _INTERNAL, "a unary call carries exactly one message"
    return body[5:], 0, ""


# -- h2 -----------------------------------------------------------------------------------------------


class H2Protocol(asyncio.Protocol):
    """gRPC unary calls on ``h2.H2Connection``: one message a call, answered when the stream ends."""

    def __init__(self, answer: Answer, tuned: bool) -> None:
        self.answer = answer
        self.tuned = tuned
        if tuned:
            config = H2Configuration(
                client_side=False,
                header_encoding=None,
                validate_outbound_headers=False,
                normalize_outbound_headers=False,
                split_outbound_cookies=False,
                validate_inbound_headers=False,
                normalize_inbound_headers=False,
            )
        else:
            config = H2Configuration(client_side=False, header_encoding=None)
        self.conn = H2Connection(config=config)
        if tuned:
            self.conn.encoder = StaticEncoder()  # type: ignore[assignment]
            self.conn.decoder = CachingDecoder()
        self.conn.local_settings.max_concurrent_streams = 100
        self.paths: dict[int, bytes] = {}
        self.bodies: dict[int, bytearray] = {}
        self.pending: dict[int, tuple[bytes, list[tuple[bytes, bytes]]]] = {}
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.conn.initiate_connection()
        self.transport.write(self.conn.data_to_send())  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        conn = self.conn
        try:
            events: list[Any] = conn.receive_data(data)
        except ProtocolError:
            self.transport.write(conn.data_to_send())  # type: ignore[union-attr]
            self.transport.close()  # type: ignore[union-attr]
            return
        for event in events:
            kind = type(event)
            if kind is RequestReceived:
                sid = event.stream_id
                self.bodies[sid] = bytearray()
                self.paths[sid] = next((value for name, value in event.headers if name == b":path"), b"")
            elif kind is DataReceived:
                sid = event.stream_id
                body = self.bodies.get(sid)
                if body is not None:
                    body += event.data
                    if len(body) > _MAX_MESSAGE_BYTES + 5:
                        self._finish(sid, b"", _error_trailers(_RESOURCE_EXHAUSTED, "message too large"))
                conn.acknowledge_received_data(event.flow_controlled_length, sid)
            elif kind is StreamEnded:
                self._call(event.stream_id)
            elif kind is WindowUpdated:
                self._flush()
            elif kind is StreamReset:
                self.bodies.pop(event.stream_id, None)
                self.pending.pop(event.stream_id, None)
            elif kind is ConnectionTerminated:
                self.transport.close()  # type: ignore[union-attr]
        out = conn.data_to_send()
        if out:
            self.transport.write(out)  # type: ignore[union-attr]

    def _call(self, sid: int) -> None:
        body = self.bodies.pop(sid, None)
        if body is None:
            return
        request, code, text = _split_message(bytes(body))
        message = b""
        if request is not None:
            message, code, text = self.answer(self.paths.pop(sid, b""), request)
        if code:
            self._finish(sid, b"", _error_trailers(code, text))
            return
        self._finish(sid, b"\0" + len(message).to_bytes(4, "big") + message, OK_TRAILERS)

    def _finish(self, sid: int, data: bytes, trailers: list[tuple[bytes, bytes]]) -> None:
        self.bodies.pop(sid, None)
        self.paths.pop(sid, None)
        self.conn.send_headers(sid, RESPONSE_HEADERS)
        self.pending[sid] = (data, trailers)
        self._flush()

    def _flush(self) -> None:
        """Send what the peer's windows let through; the trailers once all of an answer went."""
        conn = self.conn
        for sid, (data, trailers) in list(self.pending.items()):
            while data:
                room = min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size)
                if room <= 0:
                    break
                conn.send_data(sid, data[:room])
                data = data[room:]
            if data:
                self.pending[sid] = (data, trailers)
                continue
            del self.pending[sid]
            conn.send_headers(sid, trailers, end_stream=True)


# -- frames by hand -----------------------------------------------------------------------------------

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_HEAD = struct.Struct(">BHBBI")  # length (24 bits: 8 + 16), type, flags, stream id
_DATA, _HEADERS, _PRIORITY, _RST, _SETTINGS, _PUSH, _PING, _GOAWAY, _WINDOW, _CONTINUATION = range(10)
_END_STREAM, _ACK, _END_HEADERS, _PADDED, _PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
_MAX_FRAME = 16384  # what this server takes (the default of SETTINGS_MAX_FRAME_SIZE)
_WINDOW_0 = 65535
_WINDOW_UPDATE_AT = 32768  # bytes taken before the window is opened again (connection and stream)
_PROTOCOL_ERROR, _FRAME_SIZE_ERROR = 1, 6


_MAX_STREAMS = 100  # concurrent streams per connection (robez's grpc.max_concurrent_streams)


def frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _HEAD.pack(n >> 16, n & 0xFFFF, kind, flags, sid) + payload


_SETTINGS_ACK = frame(_SETTINGS, _ACK, 0)
# max concurrent streams, max header list 16 KiB (the window and frame size stay the defaults)
_SERVER_SETTINGS = frame(_SETTINGS, 0, 0, struct.pack(">HIHI", 3, _MAX_STREAMS, 6, 16384))


class _Stream:
    __slots__ = ("block", "body", "ended", "path", "taken", "timer", "window")

    def __init__(self, window: int) -> None:
        self.block = bytearray()  # a header block arriving in CONTINUATION frames
        self.body: list[bytes] = []
        self.taken = 0
        self.path = b""
        self.window = window  # the peer's window for what this server sends on the stream
        self.ended = False
        self.timer: asyncio.TimerHandle | None = None


class FrameProtocol(asyncio.Protocol):
    """gRPC unary calls on HTTP/2 frames read and written here: a loop over the frames of each read, one
    write per read with everything it answered. Header blocks are decoded by ``CachingDecoder``; answers
    go with constant header blocks (``RESPONSE_BLOCK``, ``OK_TRAILERS_BLOCK``). ``read_timeout_s``: a
    timer per call (as robez's read bound) that resets the stream if its message is not in by then."""

    def __init__(self, answer: Answer, read_timeout_s: float | None = None) -> None:
        self.answer = answer
        self.read_timeout_s = read_timeout_s
        self.decoder = CachingDecoder()
        self.buffer = b""
        self.preface = False
        self.streams: dict[int, _Stream] = {}
        self.last_sid = 0
        self.window_taken = 0  # connection-level bytes taken since the last WINDOW_UPDATE
        self.send_window = _WINDOW_0  # the peer's connection window
        self.initial_window = _WINDOW_0  # the peer's SETTINGS_INITIAL_WINDOW_SIZE
        self.max_frame = _MAX_FRAME  # the peer's SETTINGS_MAX_FRAME_SIZE
        self.out: list[bytes] = []
        self.pending: dict[int, tuple[_Stream, bytes, bytes]] = {}  # answers held back by flow control
        self.transport: asyncio.Transport | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.loop = asyncio.get_running_loop()
        transport.write(_SERVER_SETTINGS)  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        for stream in self.streams.values():
            if stream.timer is not None:
                stream.timer.cancel()
        self.streams.clear()

    def _goaway(self, code: int) -> None:
        self.out.append(frame(_GOAWAY, 0, 0, struct.pack(">II", self.last_sid, code)))
        self.transport.write(b"".join(self.out))  # type: ignore[union-attr]
        self.out.clear()
        self.transport.close()  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        buf = self.buffer + data if self.buffer else data
        pos = 0
        if not self.preface:
            if len(buf) < 24:
                self.buffer = buf
                return
            if buf[:24] != PREFACE:
                self._goaway(_PROTOCOL_ERROR)
                return
            self.preface, pos = True, 24
        end = len(buf)
        unpack = _HEAD.unpack_from
        while end - pos >= 9:
            high, low, kind, flags, sid = unpack(buf, pos)
            length = high << 16 | low
            if length > _MAX_FRAME:
                self._goaway(_FRAME_SIZE_ERROR)
                return
            stop = pos + 9 + length
            if stop > end:
                break
            payload = buf[pos + 9 : stop]
            pos = stop
            sid &= 0x7FFFFFFF
            if kind == _DATA:
                self._data(sid, flags, payload, length)
            elif kind == _HEADERS:
                self._headers(sid, flags, payload)
            elif kind == _CONTINUATION:
                stream = self.streams.get(sid)
                if stream is None:
                    self._goaway(_PROTOCOL_ERROR)
                    return
                stream.block += payload
                if flags & _END_HEADERS:
                    self._headers_done(sid, stream)
            elif kind == _SETTINGS:
                if not flags & _ACK:
                    self._settings(payload)
            elif kind == _PING:
                if not flags & _ACK:
                    self.out.append(frame(_PING, _ACK, 0, payload))
            elif kind == _WINDOW:
                self._window(sid, int.from_bytes(payload, "big") & 0x7FFFFFFF)
            elif kind == _RST:
                self._drop(sid)
            elif kind == _GOAWAY:
                self.transport.close()  # type: ignore[union-attr]
                return
            elif kind in (_PUSH,):
                self._goaway(_PROTOCOL_ERROR)
                return
            # PRIORITY and unknown frame types are ignored (RFC 9113 5.5)
        self.buffer = buf[pos:] if pos < end else b""
        if self.out:
            self.transport.write(b"".join(self.out))  # type: ignore[union-attr]
            self.out.clear()

    def _settings(self, payload: bytes) -> None:
        for offset in range(0, len(payload) - 5, 6):
            key, value = struct.unpack_from(">HI", payload, offset)
            if key == 4:  # INITIAL_WINDOW_SIZE: every open stream's window moves by the difference
                delta, self.initial_window = value - self.initial_window, value
                for stream in self.streams.values():
                    stream.window += delta
            elif key == 5:
                self.max_frame = value
        self.out.append(_SETTINGS_ACK)
        if self.pending:
            self._flush()

    def _window(self, sid: int, increment: int) -> None:
        if sid == 0:
            self.send_window += increment
        else:
            stream = self.streams.get(sid)
            if stream is None:
                return
            stream.window += increment
        if self.pending:
            self._flush()

    def _headers(self, sid: int, flags: int, payload: bytes) -> None:
        if sid <= self.last_sid or not sid & 1:
            if sid in self.streams:  # trailers of a call: unary calls have none, the stream ends here
                if flags & _END_STREAM:
                    self._end(sid)
                return
            self._goaway(_PROTOCOL_ERROR)
            return
        self.last_sid = sid
        if len(self.streams) >= _MAX_STREAMS:  # our SETTINGS_MAX_CONCURRENT_STREAMS
            self.out.append(frame(_RST, 0, sid, b"\0\0\0\x07"))  # REFUSED_STREAM
            return
        start, stop = 0, len(payload)
        if flags & _PADDED:
            start, stop = 1, stop - payload[0]
        if flags & _PRIORITY_FLAG:
            start += 5
        stream = self.streams[sid] = _Stream(self.initial_window)
        stream.ended = bool(flags & _END_STREAM)
        if self.read_timeout_s is not None:
            stream.timer = self.loop.call_later(self.read_timeout_s, self._expired, sid)  # type: ignore[union-attr]
        if flags & _END_HEADERS:
            stream.block = payload[start:stop]  # type: ignore[assignment]
            self._headers_done(sid, stream)
        else:
            stream.block += payload[start:stop]

    def _headers_done(self, sid: int, stream: _Stream) -> None:
        """The call's headers: its method, and what a gRPC server must check before its message (the
        content type, the message encoding) or keep (its deadline: the read timer shortened to it)."""
        content_type = encoding = timeout = b""
        for name, value in self.decoder.decode(bytes(stream.block), raw=True):
            if name == b":path":
                stream.path = value
            elif name == b"content-type":
                content_type = value
            elif name == b"grpc-encoding":
                encoding = value
            elif name == b"grpc-timeout":
                timeout = value
        stream.block = bytearray()
        refusal = None
        if not content_type.startswith(b"application/grpc"):
            refusal = _error_trailers(_INTERNAL, "content-type must be application/grpc")
        elif encoding and encoding != b"identity":
            refusal = _error_trailers(_UNIMPLEMENTED, "grpc-encoding identity only")
        elif timeout:
            seconds = grpc_timeout_s(timeout)
            if seconds is None:
                refusal = _error_trailers(_INTERNAL, "malformed grpc-timeout")
            elif self.read_timeout_s is None or seconds < self.read_timeout_s:
                if stream.timer is not None:
                    stream.timer.cancel()
                stream.timer = self.loop.call_later(seconds, self._expired, sid)  # type: ignore[union-attr]
        if refusal is not None:
            ended = stream.ended
            self._answer(sid, stream, b"", refusal)
            if not ended:
                self.out.append(frame(_RST, 0, sid, b"\0\0\0\0"))  # NO_ERROR: its message is not needed
            return
        if stream.ended:
            self._end(sid)

    def _data(self, sid: int, flags: int, payload: bytes, length: int) -> None:
        self.window_taken += length
        if self.window_taken >= _WINDOW_UPDATE_AT:
            self.out.append(frame(_WINDOW, 0, 0, self.window_taken.to_bytes(4, "big")))
            self.window_taken = 0
        stream = self.streams.get(sid)
        if stream is None:
            return
        if flags & _PADDED:
            payload = payload[1 : len(payload) - payload[0]]
        stream.body.append(payload)
        stream.taken += length
        if stream.taken > _MAX_MESSAGE_BYTES + 5:
            self._answer(sid, stream, b"", _error_trailers(_RESOURCE_EXHAUSTED, "message too large"))
            self.out.append(frame(_RST, 0, sid, b"\0\0\0\0"))  # NO_ERROR: the rest is not needed
            return
        if flags & _END_STREAM:
            self._end(sid)
        elif stream.taken >= _WINDOW_UPDATE_AT:
            self.out.append(frame(_WINDOW, 0, sid, stream.taken.to_bytes(4, "big")))
            stream.taken = 0

    def _end(self, sid: int) -> None:
        stream = self.streams[sid]
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None
        request, code, text = _split_message(b"".join(stream.body))
        stream.body = []
        message = b""
        if request is not None:
            message, code, text = self.answer(stream.path, request)
        if code:
            self._answer(sid, stream, b"", _error_trailers(code, text))
        else:
            self._answer(sid, stream, b"\0" + len(message).to_bytes(4, "big") + message, OK_TRAILERS_BLOCK)

    def _answer(self, sid: int, stream: _Stream, data: bytes, trailers: Any) -> None:
        block = trailers if isinstance(trailers, bytes) else _never_indexed(trailers)
        size = len(data)
        if size <= self.send_window and size <= stream.window and size <= self.max_frame:
            # the usual answer: headers, data and trailers in one piece of the read's one write
            self.send_window -= size
            self.out.append(frame(_HEADERS, _END_HEADERS, sid, RESPONSE_BLOCK))
            if data:
                self.out.append(frame(_DATA, 0, sid, data))
            self.out.append(frame(_HEADERS, _END_HEADERS | _END_STREAM, sid, block))
            self._drop(sid)
            return
        self.out.append(frame(_HEADERS, _END_HEADERS, sid, RESPONSE_BLOCK))
        self.pending[sid] = (stream, data, block)
        self._flush()

    def _flush(self) -> None:
        for sid, (stream, data, block) in list(self.pending.items()):
            while data:
                room = min(self.send_window, stream.window, self.max_frame)
                if room <= 0:
                    break
                self.out.append(frame(_DATA, 0, sid, data[:room]))
                data = data[room:]
                self.send_window -= room
                stream.window -= room
            if data:
                self.pending[sid] = (stream, data, block)
                continue
            del self.pending[sid]
            self.out.append(frame(_HEADERS, _END_HEADERS | _END_STREAM, sid, block))
            self._drop(sid)

    def _drop(self, sid: int) -> None:
        stream = self.streams.pop(sid, None)
        if stream is not None and stream.timer is not None:
            stream.timer.cancel()
        self.pending.pop(sid, None)

    def _expired(self, sid: int) -> None:
        """A call whose message did not arrive in time (the read bound, or its deadline if sooner):
        DEADLINE_EXCEEDED, the stream reset."""
        stream = self.streams.get(sid)
        if stream is None:
            return
        stream.timer = None
        self._answer(sid, stream, b"", _error_trailers(4, "the request message did not arrive in time"))
        self.out.append(frame(_RST, 0, sid, b"\0\0\0\x08"))  # CANCEL
        self.transport.write(b"".join(self.out))  # type: ignore[union-attr]
        self.out.clear()


# -- robez's ModelInfer on these servers ----------------------------------------------------------------


class InferAnswer:
    """robez's 1-id ``ModelInfer`` as the servicer does it, transport aside: room for the message held and
    given back, the admission (refusal, admit, release), the message walked (``wire.parse_request``),
    ``oip.infer`` with the servicer's ``decode_request``, the answer written by ``encode_response``, the
    request counted and timed (``Metrics.observe_request``), errors as gRPC codes from the one table."""

    def __init__(self, app: Any) -> None:
        # imported here: the echo servers of this module do without robez's modules
        from robez_core.errors import RobezError
        from service.errors import grpc_code_for, status_for
        from service.grpc.server import decode_request, encode_response, receive_limit
        from service.grpc.wire import parse_request
        from service.oip import infer

        self.robez_error, self.status_for, self.grpc_code_for = RobezError, status_for, grpc_code_for
        self.parse, self.decode, self.infer, self.encode = (
            parse_request,
            decode_request,
            infer,
            encode_response,
        )
        state = app.state
        self.store, self.metrics, self.admission = state.store, state.metrics, state.admission
        settings = state.settings
        self.max_ids = settings.max_ids_per_request
        self.reading_bytes = min(receive_limit(settings), settings.max_body_bytes_held)
        self.path = INFER.decode()

    def __call__(self, path: bytes, message: bytes) -> tuple[bytes, int, str]:
        start = time.perf_counter()
        if path != INFER:
            return b"", _UNIMPLEMENTED, "method not found"
        admission, name = self.admission, self.path
        # the room a message may take while it arrives (held at its first byte in a product endpoint)
        if not admission.hold(self.reading_bytes):
            return b"", _RESOURCE_EXHAUSTED, "the worker holds too many bodies"
        admission.release(False, self.reading_bytes)
        size, slot, held, table, status = len(message), False, 0, "", 200
        try:
            refused = admission.refusal(name, size)
            if refused is not None:
                raise refused
            slot, held = admission.admit(name, size), size
            request = self.parse(message)
            table = request.model_name
            max_ids, decode = self.max_ids, self.decode
            inference, result = self.infer(self.store, self.metrics, table, lambda: decode(request, max_ids))
            return self.encode(table, inference.request_id, inference, result), 0, ""
        except self.robez_error as exc:
            status = self.status_for(exc)
            return b"", grpc.StatusCode[self.grpc_code_for(status)].value[0], str(exc)
        finally:
            admission.release(slot, held)
            self.metrics.observe_request(name, "GRPC", table, status, time.perf_counter() - start)


# -- the servers' processes -----------------------------------------------------------------------------

H2_VARIANTS = ("h2", "h2 tuned", "frames")
_GRPC_FLOOR = {
    "grpc.aio uvloop (robez's options, iomgr)": (
        "GRPC_EXPERIMENTS=-event_engine_listener,-event_engine_for_all_other_endpoints"
    ),
    "grpc.aio uvloop (robez's options)": "base (robez's options)",
    "grpc sync server (robez's options)": "sync server (robez's options)",
    "grpc sync server (robez's options, iomgr)": "sync server, iomgr",
}


def protocol_factory(
    variant: str, answer: Answer, read_timeout_s: float | None
) -> Callable[[], asyncio.Protocol]:
    if variant == "frames":
        return lambda: FrameProtocol(answer, read_timeout_s)
    tuned = variant == "h2 tuned"
    return lambda: H2Protocol(answer, tuned)


def serve(variant: str, port: int, infer_app: bool) -> None:
    """Serve ``variant`` (one of ``H2_VARIANTS``) on 127.0.0.1:``port`` until terminated: the echo, or
    robez's ModelInfer over an app whose lifespan (tables, warm kernels) runs in this process."""
    import uvloop

    tls: ssl.SSLContext | None = None
    folder = os.environ.get(TLS_DIR_VARIABLE)
    if folder:  # TLS 1.2+ with ALPN h2, as gRPC clients require
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(Path(folder) / "server.pem", Path(folder) / "server.key")
        tls.set_alpn_protocols(["h2"])

    async def run() -> None:
        loop = asyncio.get_running_loop()
        if not infer_app:
            factory = protocol_factory(variant, echo, None)
            server = await loop.create_server(factory, "127.0.0.1", port, ssl=tls)
            await server.serve_forever()
            return
        from service.app import create_app
        from service.config import Settings

        stop = asyncio.Event()  # SIGTERM ends the lifespan, which removes the tables' shared memory
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        app = create_app(Settings(data_dir=Path(os.environ["BENCH_DATA_DIR"])))
        async with app.router.lifespan_context(app):
            answer = InferAnswer(app)
            timeout_s = app.state.settings.body_timeout_s
            server = await loop.create_server(protocol_factory(variant, answer, timeout_s), "127.0.0.1", port)
            async with server:
                await stop.wait()

    uvloop.run(run())


def _cpu_tree(pid: int) -> tuple[float, float]:
    """CPU seconds of process ``pid`` and its children: (their main threads, their other threads)."""
    main = others = 0.0
    for child in tree_pids(pid):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            m, o = cpu_s(child)
            main, others = main + m, others + o
    return main, others


def _wait_for(call: Callable[[], object], process: subprocess.Popen[bytes], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            call()
            return
        except (grpc.RpcError, OSError):
            if time.monotonic() > deadline or process.poll() is not None:
                raise
            time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--floor", action="store_true", help="the echo on every server")
    mode.add_argument("--infer", action="store_true", help="robez's ModelInfer, /v1 binary, the prototype")
    mode.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--stacks", default="frames,h2 tuned", help="--infer: the prototype's stacks")
    parser.add_argument("--ids", type=int, default=1, help="--infer: ids per request")
    parser.add_argument("--tls", action="store_true", help="--floor: every server over TLS (ALPN h2)")
    args = parser.parse_args()
    if args.tls and not args.floor:
        parser.error("--tls goes with --floor")
    if args.serve:
        serve(args.serve[0], int(args.serve[1]), bool(os.environ.get("BENCH_DATA_DIR")))
        return
    load_start = " ".join(f"{value:.2f}" for value in os.getloadavg())
    message = infer_message() if args.ids == 1 else _ids_message(args.ids)
    senders: dict[str, tuple[int, Callable[[], None]]] = {}
    processes: list[subprocess.Popen[bytes]] = []
    temporary: list[str] = []
    robez: Any = None
    prototype_ports: list[int] = []
    try:
        if args.floor:
            env, ca = dict(os.environ), None
            if args.tls:
                folder = tempfile.mkdtemp(prefix="robez-h2-tls-")
                temporary.append(folder)
                ca = _certificates(Path(folder))
                env[TLS_DIR_VARIABLE] = folder
            for label, floor in _GRPC_FLOOR.items():
                port = free_port()
                command = [
                    sys.executable,
                    "-m",
                    "benchmarks.service.grpc_servers",
                    "--serve",
                    floor,
                    str(port),
                ]
                processes.append(subprocess.Popen(command, env={**env, **FLOOR[floor][3]}))
                senders[label] = (processes[-1].pid, _grpc_sender(port, ECHO, message, ca=ca))
            for variant in H2_VARIANTS:
                port = free_port()
                command = [sys.executable, "-m", "benchmarks.service.grpc_h2", "--serve", variant, str(port)]
                processes.append(subprocess.Popen(command, env=env))
                senders[variant] = (processes[-1].pid, _grpc_sender(port, ECHO, message, ca=ca))
            warm_s = 30.0
        else:
            from benchmarks.service.oip_transports import Server, oip_senders

            robez = Server()
            robez_senders = oip_senders(robez, args.ids)
            senders["/v1 binary (robez serve)"] = (robez.process.pid, robez_senders["v1 binary"])
            senders["OIP gRPC (robez serve, grpc.aio)"] = (robez.process.pid, robez_senders["OIP gRPC"])
            # robez's own answer: each prototype's must be byte for byte the same
            robez_answer = grpc.insecure_channel(f"127.0.0.1:{robez.grpc_port}").unary_unary(INFER.decode())(
                message, timeout=30
            )
            for stack in args.stacks.split(","):
                data = tempfile.mkdtemp(prefix="robez-h2-proto-")
                temporary.append(data)
                port = free_port()
                command = [sys.executable, "-m", "benchmarks.service.grpc_h2", "--serve", stack, str(port)]
                env = {k: v for k, v in os.environ.items() if not k.startswith("ROBEZ_")}
                env.update(
                    {
                        "BENCH_DATA_DIR": f"{data}/data",
                        "ROBEZ_SHM_DIR": f"{data}/shm",  # removed with the folder, whatever happens
                        "ROBEZ_THREADS_PER_WORKER": "1",
                    }
                )
                processes.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL))
                prototype_ports.append(port)
                senders[f"OIP gRPC prototype on {stack}"] = (
                    processes[-1].pid,
                    _grpc_sender(port, INFER, message, robez_answer),
                )
            warm_s = 600.0
        for pid, send in senders.values():
            process = next((p for p in processes if p.pid == pid), None)
            if process is not None:
                _wait_for(send, process, warm_s)
        if robez is not None:  # a refusal too: the same code and message as robez's servicer
            unknown = _ids_message(1, "no-such-table")
            for port in prototype_ports:
                assert _refusal(port, unknown) == _refusal(robez.grpc_port, unknown), _refusal(port, unknown)
            for _ in range(300):
                send()
        results: dict[str, list[tuple[float, float, float]]] = {label: [] for label in senders}
        for _ in range(args.rounds):
            for label, (pid, send) in senders.items():
                (main_cpu, other_cpu), wall = _cpu_tree(pid), time.perf_counter()
                for _ in range(args.calls):
                    send()
                wall = time.perf_counter() - wall
                main_after, other_after = _cpu_tree(pid)
                scale = 1e6 / args.calls
                results[label].append(
                    ((main_after - main_cpu) * scale, (other_after - other_cpu) * scale, args.calls / wall)
                )
    finally:
        for process in processes:
            process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=60)
        if robez is not None:
            robez.stop()
        for path in temporary:
            shutil.rmtree(path, ignore_errors=True)
    load_end = " ".join(f"{value:.2f}" for value in os.getloadavg())
    base = results.get("/v1 binary (robez serve)")
    print(
        f"| server | CPU µs/call (median of {args.rounds}) | main threads | other threads | calls/s"
        + (" | x /v1 binary |" if base else " |")
    )
    print("|---|---:|---:|---:|---:|" + ("---:|" if base else ""))
    for label, runs in results.items():
        total = statistics.median(m + o for m, o, _ in runs)
        cells = [
            f"{total:.0f}",
            f"{statistics.median(m for m, _, _ in runs):.0f}",
            f"{statistics.median(o for _, o, _ in runs):.0f}",
            f"{statistics.median(r for _, _, r in runs):.0f}",
        ]
        if base:
            ratio = statistics.median(
                (m + o) / (bm + bo) for (m, o, _), (bm, bo, _) in zip(runs, base, strict=True)
            )
            cells.append(f"{ratio:.2f}")
        print(f"| {label} | " + " | ".join(cells) + " |")
    print(f"\nload average: {load_start} at the start, {load_end} at the end; grpc {grpc.__version__}")


def _certificates(folder: Path) -> bytes:
    """A CA and a server certificate for ``localhost`` in ``folder`` (``server.pem``, ``server.key``);
    returns the CA's certificate (PEM)."""
    import trustme

    ca = trustme.CA()
    certificate = ca.issue_cert("localhost")
    certificate.private_key_pem.write_to_path(str(folder / "server.key"))
    (folder / "server.pem").write_bytes(b"".join(blob.bytes() for blob in certificate.cert_chain_pems))
    return ca.cert_pem.bytes()


def _ids_message(count: int, model: str = "demo") -> bytes:
    """A ``ModelInferRequest`` of ``count`` ids as raw contents (as ``oip_transports`` sends them)."""
    import numpy as np
    from tritonclient.grpc import service_pb2

    ids = np.random.default_rng(count).integers(0, 2**40, count, dtype=np.int64)
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name="ids", datatype="INT64", shape=[count])
    request.raw_input_contents.append(ids.astype("<i8").tobytes())
    message: bytes = request.SerializeToString()
    return message


def _refusal(port: int, message: bytes) -> tuple[grpc.StatusCode, str]:
    """The code and details a server refuses ``message`` with."""
    try:
        grpc.insecure_channel(f"127.0.0.1:{port}").unary_unary(INFER.decode())(message, timeout=30)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    raise AssertionError("the call was answered")


def _grpc_sender(
    port: int, method: bytes, message: bytes, expected: bytes | None = None, ca: bytes | None = None
) -> Callable[[], None]:
    """One call of ``method`` with ``message``; its answer must be ``expected`` (or the message back).
    ``ca``: over TLS, trusting this CA (the servers' certificate names ``localhost``)."""
    target = f"127.0.0.1:{port}"
    if ca is None:
        channel = grpc.insecure_channel(target)
    else:
        override = [("grpc.ssl_target_name_override", "localhost")]
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(ca), options=override)
    call = channel.unary_unary(method.decode())
    expected = message if expected is None else expected

    def send() -> None:
        answer = call(message, timeout=10)
        assert answer == expected, (answer, expected)

    return send


if __name__ == "__main__":
    main()
