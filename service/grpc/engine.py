"""The ``frames`` gRPC engine (``ROBEZ_GRPC_ENGINE=frames``): unary gRPC calls on ``FrameConnection``.

The gRPC layer only: every call goes through the servicer's ``run`` (``server.py``), the one routine both
engines share (read key, room for the message, admission, handler, metrics, trace). What this layer adds:

- the call's headers: ``:method`` POST, ``content-type: application/grpc[+...]`` (else HTTP 415), the method
  among the served ones (else UNIMPLEMENTED, Trailers-Only), ``grpc-timeout`` as the call's deadline
  (DEADLINE_EXCEEDED, its work cancelled), the metadata (``authorization``, ``traceparent``) for ``run``;
- the message: until ``run`` reads it (read key checked, room held) the stream's window is not credited,
  so the peer holds at most the initial window; then its 5-byte prefix: a compressed message refused
  (UNIMPLEMENTED: identity only), the declared length checked against ``max_body_bytes`` before the
  message is read (RESOURCE_EXHAUSTED naming the limit); a message that stalls past ``body_timeout_s`` is
  cut (DEADLINE_EXCEEDED, the stream reset, its parts freed);
- the answer: HEADERS, one DATA (held back by the peer's windows), trailers ``grpc-status: 0``; errors as
  Trailers-Only with ``grpc-status`` and a percent-encoded ``grpc-message`` (at most 1024 characters);
- answers the peer has not taken (held back by its windows, or in the transport's buffer: a peer that
  reads nothing) are held in the worker's room for bodies (``max_body_bytes_held``, the admission's) until
  it takes them; an answer is refused (RESOURCE_EXHAUSTED naming the limit, the answer dropped) when its
  connection holds answers already and would hold more than ``grpc_max_unread_answer_bytes`` of them, or
  when the worker has no room for it (answers over ``ANSWER_CHECKED_BYTES`` to a peer that took everything
  are checked too; smaller ones go: sending them is how their memory goes soonest). Before, one peer with
  its windows at 0 held every answer of its up to 100 calls: 40 calls of 262,144 ids grew a worker by
  2.7 GB.

A call whose headers are over 16 KiB is answered alone (Trailers-Only RESOURCE_EXHAUSTED naming the limit),
the connection's other calls go on (``header_list_refused``).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from typing import Any

import grpc
from fastapi import FastAPI

from robez_core.errors import InvalidInputError

from ..config import Settings
from ..errors import PayloadTooLargeError
from ..http.admission import ANSWER_CHECKED_BYTES, Admission
from .frames import CANCEL, NO_ERROR, RST_STREAM, FrameConnection, Stream, frame
from .headers import MAX_HEADER_LIST, never_indexed
from .keepalive import Keepalive
from .server import SERVICE, CallRefused, InferenceServicer

logger = logging.getLogger("robez.grpc")

_TIMEOUT_UNITS = {72: 3600.0, 77: 60.0, 83: 1.0, 109: 1e-3, 117: 1e-6, 110: 1e-9}  # H M S m u n
RESPONSE_BLOCK = never_indexed(
    [(b":status", b"200"), (b"content-type", b"application/grpc"), (b"grpc-accept-encoding", b"identity")]
)
OK_TRAILERS_BLOCK = never_indexed([(b"grpc-status", b"0")])
_STATUS_415 = never_indexed([(b":status", b"415"), (b"content-type", b"text/plain")])
_STATUS_405 = never_indexed([(b":status", b"405")])
_MAX_MESSAGE_CHARS = 1024
_TLS_CLOSE_S = 2.0  # a TLS close waits this long for the peer's close_notify, as the HTTP port's
_PREFIX = f"/{SERVICE}/".encode()
_ANSWERS_RECOUNT_S = 0.05  # how soon answers a peer took without a word leave the worker's room


def grpc_timeout_s(value: bytes) -> float | None:
    """A ``grpc-timeout`` value (at most 8 digits and a unit) in seconds; None when malformed."""
    unit = _TIMEOUT_UNITS.get(value[-1]) if value else None
    digits = value[:-1]
    if unit is None or not digits.isdigit() or len(digits) > 8:
        return None
    return int(digits) * unit


def percent_encoded(message: str) -> bytes:
    """``grpc-message``'s encoding: printable ASCII but ``%`` as is, every other byte of UTF-8 as %XX."""
    out = []
    for byte in message[:_MAX_MESSAGE_CHARS].encode():
        out.append(chr(byte) if 0x20 <= byte <= 0x7E and byte != 0x25 else f"%{byte:02X}")
    return "".join(out).encode("ascii")


def trailers_only(code: grpc.StatusCode, message: str) -> bytes:
    """A Trailers-Only answer's block: the status, the content type, the call's status and message."""
    return never_indexed(
        [
            (b":status", b"200"),
            (b"content-type", b"application/grpc"),
            (b"grpc-status", str(code.value[0]).encode()),
            (b"grpc-message", percent_encoded(message)),
        ]
    )


def _trailers(code: grpc.StatusCode, message: str) -> bytes:
    return never_indexed(
        [(b"grpc-status", str(code.value[0]).encode()), (b"grpc-message", percent_encoded(message))]
    )


_HEADERS_TOO_LARGE = trailers_only(
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    f"the call's headers are over the limit of {MAX_HEADER_LIST} bytes (SETTINGS_MAX_HEADER_LIST_SIZE: "
    "name + value + 32 bytes a field)",
)


class _Call:
    """One call's state: its message as it arrives, the reader waiting for it, its task and timers."""

    __slots__ = ("deadline", "declared", "error", "parts", "reader", "size", "task", "timer")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0
        self.declared = -1  # the message's length from its prefix (-1: not in yet)
        self.error: Exception | None = None  # what the message turned out to be refused for
        self.reader: asyncio.Future[bytes | None] | None = None  # set while ``run`` waits for the message
        self.task: asyncio.Task[Any] | None = None
        self.timer: asyncio.TimerHandle | None = None  # the read bound while ``run`` waits
        self.deadline: asyncio.TimerHandle | None = None  # the client's grpc-timeout


class GrpcConnection(FrameConnection):
    """One client connection of the frames engine (module docstring)."""

    def __init__(self, engine: FramesServer) -> None:
        super().__init__(engine.preface_timeout_s, engine.idle_timeout_s, engine.keepalive)
        self.engine = engine
        self.answers_held = 0  # bytes of answers not yet taken by the peer, held in the admission's room
        self.answers_timer: asyncio.TimerHandle | None = None  # re-counts them while any are held

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None and ssl_object.selected_alpn_protocol() != "h2":
            transport.close()  # gRPC over TLS is HTTP/2 by ALPN only
            self.closed = True
            return
        if len(self.engine.connections) >= self.engine.max_connections:
            transport.close()  # as the HTTP port does past max_connections: closed as soon as accepted
            self.closed = True
            return
        super().connection_made(transport)
        self.engine.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.engine.connections.discard(self)
        if self.answers_timer is not None:
            self.answers_timer.cancel()
            self.answers_timer = None
        self._count_answers(0)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.answers_held:  # the peer's WINDOW_UPDATEs and resets let held answers go
            self._count_answers(self._backlog())

    # -- streams in ---------------------------------------------------------------------------------------

    def stream_opened(self, stream: Stream, headers: list[tuple[bytes, bytes]]) -> None:
        method = path = content_type = timeout = b""
        metadata: list[tuple[str, str]] = []
        for name, value in headers:
            if name[:1] == b":":
                if name == b":path":
                    path = value
                elif name == b":method":
                    method = value
            elif name == b"content-type":
                content_type = value
            elif name == b"grpc-timeout":
                timeout = value
            else:
                metadata.append((name.decode("latin-1"), value.decode("latin-1")))
        if method != b"POST":
            self._refuse(stream, _STATUS_405)
            return
        if not (
            content_type == b"application/grpc"
            or content_type.startswith((b"application/grpc+", b"application/grpc;"))
        ):
            self._refuse(stream, _STATUS_415)
            return
        method_entry = self.engine.methods.get(path)
        if method_entry is None:
            self._refuse(
                stream,
                trailers_only(grpc.StatusCode.UNIMPLEMENTED, f"unknown method {path.decode('latin-1')}"),
            )
            return
        call = stream.app = _Call()
        if timeout:
            seconds = grpc_timeout_s(timeout)
            if seconds is None:
                self._refuse(stream, trailers_only(grpc.StatusCode.INTERNAL, "malformed grpc-timeout"))
                return
            call.deadline = self.loop.call_later(seconds, self._deadline, stream)  # type: ignore[union-attr]
        method_name, handler, read_key = method_entry
        call.task = self.loop.create_task(  # type: ignore[union-attr]
            self._run(stream, call, method_name, handler, read_key, metadata)
        )

    def stream_data(self, stream: Stream, data: bytes) -> None:
        call: _Call | None = stream.app
        if call is None or call.error is not None:
            return  # refused already: what is left of its message is dropped
        call.parts.append(data)
        call.size += len(data)
        if call.declared < 0 and call.size >= 5:
            head = b"".join(call.parts)[:5]
            if head[0]:
                self._fail(
                    call,
                    CallRefused(
                        grpc.StatusCode.UNIMPLEMENTED,
                        501,
                        "compressed messages are not accepted (grpc-encoding identity only)",
                    ),
                )
                return
            call.declared = int.from_bytes(head[1:5], "big")
            limit = self.engine.max_body_bytes
            if call.declared > limit:
                self._fail(
                    call, PayloadTooLargeError(f"request body is over the limit max_body_bytes={limit}")
                )
                return
        if call.declared >= 0 and call.size > call.declared + 5:
            self._fail(call, InvalidInputError("a unary call carries exactly one message"))

    def stream_ended(self, stream: Stream) -> None:
        call: _Call | None = stream.app
        if call is None or call.error is not None:
            return
        if call.size and call.size != call.declared + 5:
            self._fail(call, InvalidInputError("the request message is cut short"))
            return
        self._deliver(call)

    def header_list_refused(self, sid: int, ended: bool) -> None:
        """A call's metadata over the limit: that call alone is answered (Trailers-Only RESOURCE_EXHAUSTED
        naming the limit), the connection's other calls go on."""
        self.send_headers(sid, _HEADERS_TOO_LARGE, end_stream=True)
        if not ended:
            self.out.append(_rst(sid, NO_ERROR))

    def stream_reset(self, stream: Stream) -> None:
        call: _Call | None = stream.app
        if call is None:
            return
        self._cancel_timers(call)
        call.parts = []
        if call.task is not None and not call.task.done():
            call.task.cancel()

    # -- the call -----------------------------------------------------------------------------------------

    async def _run(
        self,
        stream: Stream,
        call: _Call,
        name: str,
        handler: Any,
        read_key: bool,
        metadata: list[tuple[str, str]],
    ) -> None:
        async def read(timeout_s: float) -> bytes | None:
            return await self._read(stream, call, timeout_s)

        if self.blocked:  # the peer is not taking our answers: no new work for it until it does
            try:
                await self.writable(self.engine.body_timeout_s)
            except TimeoutError:
                return  # the connection is cut: its streams are reset
        response, code, message = await self.engine.servicer.run(name, handler, read_key, metadata, read)
        self._cancel_timers(call)
        call.parts = []
        if stream.sid not in self.streams:
            return  # reset meanwhile
        if code is grpc.StatusCode.OK:
            refusal = self._answer_refusal(len(response) + 5)
            if refusal is not None:
                response = b""  # dropped now: the peer is not taking what it was sent
                code, message = grpc.StatusCode.RESOURCE_EXHAUSTED, refusal
        if code is grpc.StatusCode.OK:
            self.send_headers(stream.sid, RESPONSE_BLOCK)
            prefix = b"\0" + len(response).to_bytes(4, "big")
            self.send_data(stream.sid, response, OK_TRAILERS_BLOCK, prefix)
        else:
            self._refuse(stream, trailers_only(code, message))
        self.flush()
        backlog = self._backlog()
        if backlog != self.answers_held:
            self._count_answers(backlog)

    # -- answers the peer has not taken (module docstring) -------------------------------------------------

    def _backlog(self) -> int:
        """Bytes of answers the peer has not taken: held back by its windows, or in the transport's buffer."""
        if self.transport is None or self.closed:
            return 0
        return self.held + self.transport.get_write_buffer_size()

    def _answer_refusal(self, size: int) -> str | None:
        """Why an answer of ``size`` bytes is refused, or None when it may be sent."""
        backlog = self._backlog()
        if backlog != self.answers_held:
            self._count_answers(backlog)
        if not backlog and size <= ANSWER_CHECKED_BYTES:
            return None  # the common case, as ``Admission.answer_fits``: a small answer, nothing behind
        limit = self.engine.max_unread_answer_bytes
        admission = self.engine.admission
        if backlog and backlog + size > limit:
            admission.metrics.rejected_total.labels("answers_held").inc()
            return (
                f"the client has not taken {backlog} bytes of answers on this connection; one more of {size} "
                f"bytes would be over the limit grpc_max_unread_answer_bytes={limit}"
            )
        if not admission.answer_fits(size, behind=bool(backlog)):
            admission.metrics.rejected_total.labels("bodies_held").inc()
            return admission.bodies_held_message()
        return None

    def _count_answers(self, backlog: int) -> None:
        """Hold ``backlog`` bytes of answers in the worker's room (what the peer took is given back), and
        count them again shortly while any are held (a peer may take them without sending anything)."""
        self.engine.admission.hold_answers(backlog - self.answers_held)
        self.answers_held = backlog
        if backlog and self.answers_timer is None and self.loop is not None and not self.closed:
            self.answers_timer = self.loop.call_later(_ANSWERS_RECOUNT_S, self._recount_answers)

    def _recount_answers(self) -> None:
        self.answers_timer = None
        self._count_answers(self._backlog())

    async def _read(self, stream: Stream, call: _Call, timeout_s: float) -> bytes | None:
        """The call's message once it is in; its window opened now (the read key and room are checked)."""
        if call.error is None and not stream.ended:
            self.open_window(stream)
            self.flush()
        reader = call.reader = self.loop.create_future()  # type: ignore[union-attr]
        if call.error is not None or stream.ended:
            self._deliver(call)
        else:
            call.timer = self.loop.call_later(max(timeout_s, 0.0), self._read_expired, stream, call)  # type: ignore[union-attr]
        try:
            return await reader
        finally:
            call.reader = None
            if call.timer is not None:
                call.timer.cancel()
                call.timer = None

    def _deliver(self, call: _Call) -> None:
        reader = call.reader
        if reader is None or reader.done():
            return
        if call.error is not None:
            reader.set_exception(call.error)
        elif call.size == 0:
            reader.set_result(None)
        else:
            parts, call.parts = call.parts, []
            if len(parts[0]) >= 5:  # the prefix off the first part (a frame's worth), then one join
                parts[0] = parts[0][5:]
                message = b"".join(parts) if len(parts) > 1 else parts[0]
            else:  # the prefix itself came in pieces
                message = b"".join(parts)[5:]
            reader.set_result(message)

    def _fail(self, call: _Call, error: Exception) -> None:
        call.error = error
        call.parts = []
        self._deliver(call)

    def _read_expired(self, stream: Stream, call: _Call) -> None:
        """The message is not in within ``body_timeout_s``: its parts freed, ``run`` answers the timeout."""
        call.timer = None
        call.parts = []
        reader = call.reader
        if reader is not None and not reader.done():
            reader.set_exception(TimeoutError())

    def _deadline(self, stream: Stream) -> None:
        """The client's grpc-timeout passed: its work cancelled, DEADLINE_EXCEEDED, the stream reset."""
        call: _Call | None = stream.app
        if call is None or stream.sid not in self.streams:
            return
        call.deadline = None
        if call.task is not None and not call.task.done():
            call.task.cancel()
        self._cancel_timers(call)
        call.parts = []
        if stream.sid in self.pending:  # its answer under way: too late for a status
            self.reset(stream.sid, CANCEL)
            self.flush()
            return
        self.send_headers(
            stream.sid, trailers_only(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"), end_stream=True
        )
        self.out.append(_rst(stream.sid, CANCEL))
        self.flush()

    def _refuse(self, stream: Stream, block: bytes) -> None:
        """An answer of headers only (END_STREAM); the rest of the request is not needed (RST NO_ERROR)."""
        ended = stream.ended
        self.send_headers(stream.sid, block, end_stream=True)
        if not ended:
            self.out.append(_rst(stream.sid, NO_ERROR))
        call: _Call | None = stream.app
        if call is not None:
            self._cancel_timers(call)
            call.parts = []

    @staticmethod
    def _cancel_timers(call: _Call) -> None:
        for timer in (call.timer, call.deadline):
            if timer is not None:
                timer.cancel()
        call.timer = call.deadline = None


def _rst(sid: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, sid, code.to_bytes(4, "big"))


class FramesServer:
    """A worker's frames engine: its listening socket and connections."""

    def __init__(self, servicer: InferenceServicer, settings: Settings) -> None:
        self.servicer = servicer
        self.max_body_bytes = settings.max_body_bytes
        self.max_unread_answer_bytes = settings.grpc_max_unread_answer_bytes
        self.admission: Admission = servicer.app.state.admission  # the worker's room for bodies and answers
        self.max_connections = settings.max_connections  # this worker's gRPC connections, as HTTP's
        self.body_timeout_s = settings.body_timeout_s  # also how long a peer may read none of our answers
        self.preface_timeout_s = settings.header_timeout_s  # as HTTP's first request headers
        self.idle_timeout_s = settings.grpc_idle_timeout_s
        self.keepalive = keepalive_of(settings)
        self.methods = {
            _PREFIX + name.encode(): (name, handler, read_key)
            for name, (handler, read_key) in servicer.methods().items()
        }
        self.connections: set[GrpcConnection] = set()
        self.server: asyncio.AbstractServer | None = None

    def protocol(self) -> GrpcConnection:
        return GrpcConnection(self)

    async def stop(self, grace_s: float) -> None:
        """No new connections; GOAWAY on each, its calls given ``grace_s`` to finish, then closed."""
        if self.server is not None:
            self.server.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        await asyncio.gather(
            *(connection.drain(deadline) for connection in list(self.connections)), return_exceptions=True
        )
        if self.server is not None:
            await self.server.wait_closed()


def keepalive_of(settings: Settings) -> Keepalive:
    return Keepalive(
        time_s=settings.grpc_keepalive_time_s,
        timeout_s=settings.grpc_keepalive_timeout_s,
        permit_without_calls=settings.grpc_keepalive_permit_without_calls,
        min_ping_interval_s=settings.grpc_min_ping_interval_s,
        max_ping_strikes=settings.grpc_max_ping_strikes,
    )


def ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """The HTTP port's TLS policy for gRPC: its certificate, client certificates required when it requires
    them, ALPN ``h2`` (a connection without it is closed)."""
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(settings.tls_cert, settings.tls_key)
    if settings.tls_client_ca is not None:
        context.load_verify_locations(settings.tls_client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    context.set_alpn_protocols(["h2"])
    return context


async def start_frames(app: FastAPI, settings: Settings) -> tuple[FramesServer, int]:
    """Listen on ``settings.host:settings.grpc_port`` (SO_REUSEPORT, as every worker does) with the frames
    engine; returns it and the port bound."""
    assert settings.grpc_port is not None
    engine = FramesServer(InferenceServicer(app), settings)
    context = ssl_context(settings)
    factory: Callable[[], GrpcConnection] = engine.protocol
    engine.server = await asyncio.get_running_loop().create_server(
        factory,
        settings.host,
        settings.grpc_port,
        reuse_port=True,
        ssl=context,
        ssl_handshake_timeout=settings.header_timeout_s if context is not None else None,
        ssl_shutdown_timeout=_TLS_CLOSE_S if context is not None else None,
    )
    port = engine.server.sockets[0].getsockname()[1]
    logger.info(
        "gRPC inference protocol (frames engine) on %s:%d (%s)",
        settings.host,
        port,
        "plaintext" if context is None else "TLS",
    )
    return engine, port
