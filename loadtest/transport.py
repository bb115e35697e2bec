"""Loopback HTTP/1.1 transports for the load generator.

Two interchangeable clients send the same pre-built requests:

- ``raw``: a minimal keep-alive HTTP/1.1 client (an ``asyncio.BufferedProtocol`` that reads a body
  straight into a reused buffer of its size). The request bytes are built once per distinct body, so a
  request costs the client one write, a header parse and the socket reads. On this project's
  2-core machine httpx's AsyncClient spent ~1 ms of client CPU per request (about 900 req/s from one
  saturated process against a trivial endpoint) while this client sent 5 600 req/s at 27% CPU; with
  httpx the client, not the server, would be what a run measures.
- ``grpc`` (``GrpcConnection``, for the ``grpc`` scenario): one ``grpc.aio`` channel per connection,
  sending the pre-serialized message as raw bytes (no protobuf work in the measured loop).
- ``httpx``: ``httpx.AsyncClient``, the library the project's own client uses; kept to cross-check
  the raw client and to show the cost of a full-featured client (the report runs both on /healthz).

Only loopback targets are accepted: a load generator pointed elsewhere is a denial-of-service tool.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from dataclasses import dataclass
from typing import Protocol, cast
from urllib.parse import urlsplit

TRANSPORTS: tuple[str, ...] = ("raw", "httpx")
# The peer baseline's wire (Redis's RESP2); chosen by the sweep for its Redis runs, not by --transport.
RESP = "resp"
# gRPC (the inference protocol's GRPCInferenceService); chosen by the sweep for its gRPC runs.
GRPC = "grpc"
# gRPC status code name -> the HTTP status the server's error table gives it (service/errors.py).
_STATUS_BY_GRPC_CODE = {
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "RESOURCE_EXHAUSTED": 413,
    "INVALID_ARGUMENT": 422,
    "UNAVAILABLE": 503,
}


class TransportError(Exception):
    """The connection failed or the server sent something that is not a valid HTTP/1.1 response."""


@dataclass(frozen=True)
class Target:
    """A loopback HTTP server: host (an IP literal or ``localhost``) and port."""

    host: str
    port: int

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def loopback_target(url: str) -> Target:
    """Parse ``http://host:port`` and refuse any host that is not loopback.

    Hostnames other than ``localhost`` are refused without being resolved (no DNS lookups).

    Raises:
        ValueError: not plain http, not loopback, or no usable port.
    """
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"only plain http:// loopback targets are supported, got {url!r}")
    host = parts.hostname or ""
    if host != "localhost":
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(
                f"refusing non-loopback host {host!r}: use 127.0.0.1, ::1 or localhost"
            ) from None
        if not address.is_loopback:
            raise ValueError(f"refusing non-loopback host {host!r}: the load test targets loopback only")
    if parts.path not in ("", "/"):
        raise ValueError(f"the url must be just scheme://host:port, got path {parts.path!r}")
    port = parts.port or 80
    return Target(host=host, port=port)


@dataclass(frozen=True)
class PreparedRequest:
    """One request, encoded once and reused: ``wire`` is the complete HTTP/1.1 request for ``raw``."""

    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    wire: bytes


def prepare_request(
    target: Target, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> PreparedRequest:
    """Encode a request for both transports; adds Host and Content-Length."""
    all_headers = dict(headers or {})
    lines = [f"{method} {path} HTTP/1.1", f"Host: {target.host}:{target.port}"]
    lines += [f"{name}: {value}" for name, value in all_headers.items()]
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}")
    wire = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
    return PreparedRequest(method, path, tuple(all_headers.items()), body, wire)


@dataclass(frozen=True)
class Response:
    """Status, lower-cased headers and body of one response.

    ``raw`` hands a body that did not fit its head buffer out as the connection's reusable body
    buffer: it is valid until the next request on that connection (the runner checks it at once).
    """

    status: int
    headers: dict[str, str]
    body: bytes | bytearray


class Connection(Protocol):
    """One client connection (raw) or one shared pool (httpx); ``send`` raises TransportError."""

    async def send(self, request: PreparedRequest) -> Response: ...

    async def close(self) -> None: ...


class _StreamConnection:
    """One keep-alive connection over asyncio streams; reconnects lazily after an error or
    ``Connection: close``. Subclasses parse the answer (``_read``)."""

    def __init__(self, target: Target) -> None:
        self._target = target
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def send(self, request: PreparedRequest) -> Response:
        try:
            if self._writer is None:
                self._reader, self._writer = await asyncio.open_connection(
                    self._target.host, self._target.port, limit=1 << 20
                )
            assert self._reader is not None
            self._writer.write(request.wire)
            response = await self._read(self._reader)
        except (OSError, EOFError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            await self.close()
            raise TransportError(f"{type(exc).__name__}: {exc}") from exc
        except asyncio.CancelledError:
            # a request abandoned mid-response leaves the stream out of step: never reuse it
            self._abort()
            raise
        return response

    async def _read(self, reader: asyncio.StreamReader) -> Response:
        raise NotImplementedError

    def _abort(self) -> None:
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()

    async def close(self) -> None:
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


# Free space offered to the socket while reading a response head; bodies get a buffer of their own size.
_HEAD_READ_BYTES = 1 << 16
_MAX_HEAD_BYTES = 1 << 20


class _HttpReplyProtocol(asyncio.BufferedProtocol):
    """Reads HTTP/1.1 responses straight into their final buffers (``asyncio.BufferedProtocol``).

    Once a response's Content-Length is known the socket is read directly into a body buffer of that
    size, reused while the size stays the same, so a 1 MiB body costs one copy out of the kernel. With
    ``asyncio.StreamReader`` every read was copied into the reader's buffer and out of it again into a
    fresh 1 MiB object: at 4096-id lookups the client needed about 2x the CPU per request, could not
    keep one server core busy, and an under-used server spends more CPU per request (see "Server CPU
    per request" in docs/loadtest/README.md).
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._head = bytearray(_HEAD_READ_BYTES)
        self._filled = 0
        self._body: bytearray | None = None
        self._spare: bytearray | None = None
        self._body_filled = 0
        self._status = 0
        self._headers: dict[str, str] = {}
        self._waiter: asyncio.Future[Response] | None = None
        self._lost: BaseException | None = None

    # -- asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body is not None:
            return memoryview(self._body)[self._body_filled :]
        if len(self._head) - self._filled < _HEAD_READ_BYTES:
            self._head.extend(bytes(_HEAD_READ_BYTES))
        return memoryview(self._head)[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._body is not None:
                self._body_filled += nbytes
                if self._body_filled == len(self._body):
                    body, self._body = self._body, None
                    self._finish(body)
            else:
                self._filled += nbytes
                self._parse()
        except ValueError as exc:
            self._fail(exc)
            if self.transport is not None:
                self.transport.close()

    def eof_received(self) -> bool:
        self._fail(EOFError("the server closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or EOFError("the connection was closed"))

    # -- request side
    def expect(self) -> asyncio.Future[Response]:
        """A future for the next response; call after writing the request."""
        if self._lost is not None:
            raise EOFError(str(self._lost))
        if self._filled:
            raise ValueError(f"{self._filled} unexpected bytes before the response")
        self._waiter = asyncio.get_running_loop().create_future()
        return self._waiter

    # -- parsing
    def _parse(self) -> None:
        head_end = self._head.find(b"\r\n\r\n", 0, self._filled)
        if head_end < 0:
            if self._filled > _MAX_HEAD_BYTES:
                raise ValueError("response head over 1 MiB")
            return
        if not self._headers and self._status == 0:
            self._status, self._headers = _parse_head(bytes(self._head[:head_end]))
        start = head_end + 4
        if "chunked" in self._headers.get("transfer-encoding", "").lower():
            parsed = _parse_chunked(self._head, start, self._filled)
            if parsed is not None:
                body, end = parsed
                self._consume(end)
                self._finish(body)
            elif self._filled > _MAX_HEAD_BYTES + (64 << 20):
                raise ValueError("chunked response over 64 MiB")
            return
        length = int(self._headers.get("content-length", "0"))
        available = self._filled - start
        if available >= length:
            body_bytes = bytes(self._head[start : start + length])
            self._consume(start + length)
            self._finish(body_bytes)
            return
        # a run's answers on one connection have one size: reuse the buffer (a fresh 1 MiB bytearray
        # per answer is zero-filled, and with glibc's defaults often mmap'ed and page-faulted anew)
        buffer = self._spare if self._spare is not None and len(self._spare) == length else bytearray(length)
        self._spare = buffer
        buffer[:available] = self._head[start : self._filled]
        self._body, self._body_filled = buffer, available
        self._filled = 0

    def _consume(self, end: int) -> None:
        rest = self._filled - end
        if rest:
            self._head[:rest] = self._head[end : self._filled]
        self._filled = rest

    def _finish(self, body: bytes | bytearray) -> None:
        response = Response(self._status, self._headers, body)
        self._status, self._headers = 0, {}
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(response)
        elif self._filled or body:
            raise ValueError("a response nobody asked for")

    def _fail(self, exc: BaseException) -> None:
        self._lost = self._lost or exc
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    status_parts = lines[0].split(" ", 2)
    if len(status_parts) < 2 or not status_parts[0].startswith("HTTP/1."):
        raise ValueError(f"bad status line {lines[0]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_parts[1]), headers


def _parse_chunked(buffer: bytearray, start: int, stop: int) -> tuple[bytes, int] | None:
    """A chunked body in ``buffer[start:stop]``: (the body, where it ends), or None while incomplete."""
    pieces: list[bytes] = []
    position = start
    while True:
        line_end = buffer.find(b"\r\n", position, stop)
        if line_end < 0:
            return None
        size = int(bytes(buffer[position:line_end]).split(b";", 1)[0].strip(), 16)
        position = line_end + 2
        if size == 0:
            # optional trailers, then the blank line that ends the message
            while True:
                line_end = buffer.find(b"\r\n", position, stop)
                if line_end < 0:
                    return None
                blank = line_end == position
                position = line_end + 2
                if blank:
                    return b"".join(pieces), position
        if position + size + 2 > stop:
            return None
        pieces.append(bytes(buffer[position : position + size]))
        position += size + 2


class RawConnection:
    """One keep-alive HTTP/1.1 connection; reconnects lazily after an error or ``Connection: close``."""

    def __init__(self, target: Target) -> None:
        self._target = target
        self._protocol: _HttpReplyProtocol | None = None

    async def send(self, request: PreparedRequest) -> Response:
        try:
            protocol = self._protocol
            if protocol is None or protocol.transport is None or protocol.transport.is_closing():
                loop = asyncio.get_running_loop()
                _, protocol = await loop.create_connection(
                    _HttpReplyProtocol, self._target.host, self._target.port
                )
                self._protocol = protocol
            assert protocol.transport is not None
            waiter = protocol.expect()
            protocol.transport.write(request.wire)
            response = await waiter
        except (OSError, EOFError, ValueError) as exc:
            await self.close()
            raise TransportError(f"{type(exc).__name__}: {exc}") from exc
        except asyncio.CancelledError:
            # a request abandoned mid-response leaves the stream out of step: never reuse it
            self._abort()
            raise
        if response.headers.get("connection", "").lower() == "close":
            await self.close()
        return response

    def _abort(self) -> None:
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            protocol.transport.abort()

    async def close(self) -> None:
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            protocol.transport.close()


def resp_command(*parts: bytes) -> bytes:
    """One Redis command in RESP2 (an array of bulk strings)."""
    pieces = [b"*%d\r\n" % len(parts)]
    for part in parts:
        pieces += [b"$%d\r\n" % len(part), part, b"\r\n"]
    return b"".join(pieces)


class RespConnection(_StreamConnection):
    """One connection to a Redis server speaking RESP2, behind the same ``Connection`` interface
    (the stream connection handling, a RESP reply parser).

    ``request.wire`` is the encoded command. The answer maps to a ``Response``: status 200 with the
    reply's payload as body (a bulk string's bytes; an array of bulk strings concatenated; a status
    line's text), 500 with the message for an error reply, 404 for a nil (a key that is missing).
    """

    async def _read(self, reader: asyncio.StreamReader) -> Response:
        return await self._read_reply(reader)

    @staticmethod
    async def _read_reply(reader: asyncio.StreamReader) -> Response:
        line = await reader.readuntil(b"\r\n")
        kind, rest = line[:1], line[1:-2]
        if kind in (b"+", b":"):
            return Response(200, {}, bytes(rest))
        if kind == b"-":
            return Response(500, {}, bytes(rest))
        if kind == b"$":
            size = int(rest)
            if size < 0:
                return Response(404, {}, b"")
            return Response(200, {}, (await reader.readexactly(size + 2))[:-2])
        if kind != b"*":
            raise ValueError(f"unexpected RESP reply {line[:40]!r}")
        # An array of bulk strings, parsed from a local buffer: one await per socket read, not two
        # per element (an MGET of 4096 rows would otherwise cost the client more than the server).
        count = int(rest)
        buffer = b""
        position = 0
        items: list[bytes] = []
        missing = False
        while len(items) < count:
            end = buffer.find(b"\r\n", position)
            if end < 0:
                buffer = buffer[position:] + await _more(reader)
                position = 0
                continue
            if buffer[position : position + 1] != b"$":
                raise ValueError(f"unexpected RESP array element {buffer[position : position + 40]!r}")
            size = int(buffer[position + 1 : end])
            if size < 0:
                missing = True
                items.append(b"")
                position = end + 2
                continue
            stop = end + 2 + size + 2
            while len(buffer) < stop:
                buffer += await _more(reader)
            items.append(buffer[end + 2 : stop - 2])
            position = stop
        if position != len(buffer):
            raise ValueError("bytes after a RESP reply")
        return Response(404 if missing else 200, {}, b"".join(items))


async def _more(reader: asyncio.StreamReader) -> bytes:
    data = await reader.read(1 << 16)
    if not data:
        raise EOFError("the server closed the connection mid-reply")
    return data


class HttpxConnection:
    """``httpx.AsyncClient`` behind the ``Connection`` interface (its pool holds the sockets)."""

    def __init__(self, target: Target, max_connections: int, timeout_s: float) -> None:
        import httpx  # imported here so the raw path never pays for it

        self._httpx = httpx
        self._client = httpx.AsyncClient(
            base_url=target.base_url,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            timeout=timeout_s,
        )

    async def send(self, request: PreparedRequest) -> Response:
        try:
            reply = await self._client.request(
                request.method, request.path, content=request.body or None, headers=dict(request.headers)
            )
        except self._httpx.HTTPError as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}") from exc
        return Response(reply.status_code, {k.lower(): v for k, v in reply.headers.items()}, reply.content)

    async def close(self) -> None:
        await self._client.aclose()


class GrpcConnection:
    """One gRPC channel (one HTTP/2 connection) behind the ``Connection`` interface: ``request.path`` is
    the method (``/inference.GRPCInferenceService/ModelInfer``), ``request.body`` the serialized message,
    ``request.headers`` the metadata. An answer is status 200 with the serialized response as body; an
    error status maps to the HTTP status of the server's error table (500 for the rest), its details as
    body. grpc is imported when the first such connection is made."""

    def __init__(self, target: Target) -> None:
        self._target = target
        self._channel: object | None = None
        self._calls: dict[str, object] = {}

    async def send(self, request: PreparedRequest) -> Response:
        import grpc

        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(f"{self._target.host}:{self._target.port}")
        call = self._calls.get(request.path)
        if call is None:
            channel = cast(grpc.aio.Channel, self._channel)
            call = self._calls[request.path] = channel.unary_unary(request.path)
        metadata = tuple((name.lower(), value) for name, value in request.headers)
        try:
            body = await call(request.body, metadata=metadata)  # type: ignore[operator]
        except grpc.aio.AioRpcError as error:
            status = _STATUS_BY_GRPC_CODE.get(error.code().name, 500)
            if error.code() == grpc.StatusCode.UNAVAILABLE and "connect" in (error.details() or "").lower():
                raise TransportError(f"UNAVAILABLE: {error.details()}") from error
            return Response(status, {}, (error.details() or "").encode())
        return Response(200, {}, body)

    async def close(self) -> None:
        channel, self._channel = self._channel, None
        self._calls.clear()
        if channel is not None:
            await channel.close()  # type: ignore[attr-defined]
