"""The load generator's HTTP layer: loopback-only targets, Server-Timing parsing, the raw client."""

from __future__ import annotations

import asyncio

import pytest

from loadtest.transport import (
    HttpxConnection,
    PreparedRequest,
    RawConnection,
    RespConnection,
    Target,
    TransportError,
    loopback_target,
    prepare_request,
    resp_command,
)
from service.servertiming import parse_server_timing


@pytest.mark.parametrize(
    ("url", "host", "port"),
    [
        ("http://127.0.0.1:8000", "127.0.0.1", 8000),
        ("http://127.5.6.7:9", "127.5.6.7", 9),
        ("http://localhost:1234/", "localhost", 1234),
        ("http://[::1]:8000", "::1", 8000),
    ],
)
def test_loopback_targets_are_accepted(url: str, host: str, port: int) -> None:
    assert loopback_target(url) == Target(host, port)


@pytest.mark.parametrize(
    "url",
    [
        "http://10.0.0.1:8000",
        "http://192.168.1.1",
        "http://example.com:80",
        "http://0.0.0.0:8000",
        "http://[2001:db8::1]:80",
        "https://127.0.0.1:8000",
        "http://127.0.0.1:8000/v1",
        "ftp://127.0.0.1",
    ],
)
def test_non_loopback_targets_are_refused(url: str) -> None:
    with pytest.raises(ValueError):
        loopback_target(url)


def test_parse_server_timing() -> None:
    header = 'hash;dur=0.123, lookup;dur=1.5, total;desc="all";dur=2'
    assert parse_server_timing(header) == {"hash": 0.123, "lookup": 1.5, "total": 2.0}
    assert parse_server_timing("apply;dur=3e-1") == {"apply": 0.3}
    assert parse_server_timing(None) == {}
    assert parse_server_timing("cache, db;desc=x") == {}


def test_prepare_request_wire_format() -> None:
    request = prepare_request(Target("127.0.0.1", 80), "POST", "/x", b"abc", {"Content-Type": "a/b"})
    head, _, body = request.wire.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /x HTTP/1.1"
    assert "Host: 127.0.0.1:80" in lines
    assert "Content-Length: 3" in lines
    assert "Content-Type: a/b" in lines
    assert body == b"abc"


class _ScriptedServer:
    """A loopback server answering each request (read up to its blank line) with the next scripted bytes."""

    def __init__(self, replies: list[bytes]) -> None:
        self.replies = list(replies)
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Target:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return Target("127.0.0.1", port)

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.replies:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                reply = self.replies.pop(0)
                writer.write(reply)
                await writer.drain()
                if b"connection: close" in reply.lower() or reply == b"":
                    break
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()


def _run(coroutine: object) -> object:
    return asyncio.run(coroutine)  # type: ignore[arg-type]


def test_raw_connection_content_length_chunked_and_keepalive() -> None:
    replies = [
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nServer-Timing: hash;dur=1\r\n\r\nhello",
        b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n",
        b"HTTP/1.1 503 Busy\r\nContent-Length: 0\r\nRetry-After: 1\r\n\r\n",
    ]

    async def scenario() -> None:
        scripted = _ScriptedServer(replies)
        async with scripted as target:
            connection = RawConnection(target)
            request = prepare_request(target, "POST", "/p", b"12345678")
            first = await connection.send(request)
            second = await connection.send(request)
            third = await connection.send(prepare_request(target, "GET", "/healthz"))
            await connection.close()
        assert (first.status, first.body, first.headers["server-timing"]) == (200, b"hello", "hash;dur=1")
        assert (second.status, second.body) == (201, b"abcde")
        assert (third.status, third.headers["retry-after"]) == (503, "1")
        assert scripted.connections == 1  # keep-alive: one socket for all three

    _run(scenario())


def test_raw_connection_large_bodies_across_many_reads() -> None:
    """Bodies far larger than one socket read, of changing sizes, with headers and the body split
    anywhere: each answer is complete and exact (the socket is read straight into a body buffer)."""
    big = bytes(range(256)) * 4096  # 1 MiB, like a 4096-id lookup
    bodies = [big, big[::-1], big[: 3 * 65536 + 7], b"", big]
    replies = [b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body for body in bodies]

    async def scenario() -> None:
        async with _ScriptedServer(replies) as target:
            connection = RawConnection(target)
            request = prepare_request(target, "GET", "/")
            answers = [bytes((await connection.send(request)).body) for _ in bodies]
            await connection.close()
        assert answers == bodies

    _run(scenario())


def test_raw_connection_reconnects_after_connection_close() -> None:
    replies = [
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nConnection: close\r\n\r\na",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nb",
    ]

    async def scenario() -> None:
        scripted = _ScriptedServer(replies)
        async with scripted as target:
            connection = RawConnection(target)
            request = prepare_request(target, "GET", "/")
            assert (await connection.send(request)).body == b"a"
            assert (await connection.send(request)).body == b"b"
            await connection.close()
        assert scripted.connections == 2

    _run(scenario())


def test_raw_connection_reports_transport_errors() -> None:
    async def scenario() -> None:
        scripted = _ScriptedServer([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort"])
        async with scripted as target:
            connection = RawConnection(target)
            with pytest.raises(TransportError):
                # the server closes after 5 of the 10 promised bytes
                await connection.send(prepare_request(target, "GET", "/"))
        with pytest.raises(TransportError):
            await RawConnection(target).send(prepare_request(target, "GET", "/"))  # nothing listens now

    _run(scenario())


def test_raw_connection_rejects_garbage() -> None:
    async def scenario() -> None:
        async with _ScriptedServer([b"SSH-2.0-OpenSSH\r\n\r\n"]) as target:
            with pytest.raises(TransportError):
                await RawConnection(target).send(prepare_request(target, "GET", "/"))

    _run(scenario())


def test_httpx_connection_same_answers() -> None:
    async def scenario() -> None:
        reply = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Robez-Shape: 1,2\r\n\r\nok"
        async with _ScriptedServer([reply]) as target:
            connection = HttpxConnection(target, max_connections=2, timeout_s=5.0)
            response = await connection.send(prepare_request(target, "POST", "/p", b"x"))
            await connection.close()
        assert (response.status, response.body, response.headers["x-robez-shape"]) == (200, b"ok", "1,2")

    _run(scenario())


class _RespServer:
    """A loopback server answering every RESP command with the next scripted reply, in small pieces."""

    def __init__(self, replies: list[bytes], piece: int = 7) -> None:
        self.replies = list(replies)
        self.piece = piece
        self.commands: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Target:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return Target("127.0.0.1", self.server.sockets[0].getsockname()[1])

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while self.replies:
                count = int((await reader.readuntil(b"\r\n"))[1:-2])
                parts = []
                for _ in range(count):
                    size = int((await reader.readuntil(b"\r\n"))[1:-2])
                    parts.append((await reader.readexactly(size + 2))[:-2])
                self.commands.append(b" ".join(parts))
                reply = self.replies.pop(0)
                for start in range(0, len(reply), self.piece):  # replies arrive split at odd places
                    writer.write(reply[start : start + self.piece])
                    await writer.drain()
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()


def test_resp_command_encoding() -> None:
    assert resp_command(b"GET", b"k") == b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"
    assert resp_command(b"SET", b"k", b"\r\n") == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\n\r\n\r\n"


def test_resp_connection_replies() -> None:
    rows = [bytes([i]) * 12 for i in range(3)]
    array = b"*3\r\n" + b"".join(b"$12\r\n" + row + b"\r\n" for row in rows)
    replies = [
        b"$5\r\nhello\r\n",
        array,
        b"+OK\r\n",
        b"-ERR wrong\r\n",
        b"*2\r\n$1\r\na\r\n$-1\r\n",
        b"$-1\r\n",
    ]

    async def scenario() -> None:
        server = _RespServer(replies)
        async with server as target:
            connection = RespConnection(target)

            async def send(*parts: bytes) -> tuple[int, bytes]:
                wire = resp_command(*parts)
                reply = await connection.send(PreparedRequest(parts[0].decode(), "", (), b"", wire))
                return reply.status, reply.body

            assert await send(b"GET", b"a") == (200, b"hello")
            assert await send(b"MGET", b"a", b"b", b"c") == (200, b"".join(rows))
            assert await send(b"SET", b"a", b"1") == (200, b"OK")
            assert await send(b"GET", b"x") == (500, b"ERR wrong")
            assert (await send(b"MGET", b"a", b"missing"))[0] == 404
            assert await send(b"GET", b"missing") == (404, b"")
            await connection.close()
        assert server.commands[1] == b"MGET a b c"

    _run(scenario())


def test_resp_connection_reports_a_broken_reply() -> None:
    async def scenario() -> None:
        async with _RespServer([b"?what\r\n"]) as target:
            connection = RespConnection(target)
            with pytest.raises(TransportError):
                await connection.send(PreparedRequest("GET", "", (), b"", resp_command(b"GET", b"a")))

    _run(scenario())
