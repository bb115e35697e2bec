"""The HTTP/2 servers of the gRPC floor benchmark serve grpcio's own client correctly (else their figures
would be of something that is not gRPC): echo, a message larger than the flow-control windows, a compressed
message refused, and the header cache decoding what hpack decodes."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import pytest
from hpack import Decoder, Encoder

from benchmarks.service import grpc_h2


@pytest.fixture(scope="module")
def ports() -> Iterator[dict[str, int]]:
    loop = asyncio.new_event_loop()
    servers: dict[str, asyncio.Server] = {}

    async def start() -> None:
        for variant in grpc_h2.H2_VARIANTS:
            factory = grpc_h2.protocol_factory(variant, grpc_h2.echo, 5.0)
            servers[variant] = await loop.create_server(factory, "127.0.0.1", 0)

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    yield {name: server.sockets[0].getsockname()[1] for name, server in servers.items()}
    for server in servers.values():
        loop.call_soon_threadsafe(server.close)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.mark.parametrize("variant", grpc_h2.H2_VARIANTS)
def test_grpcio_calls_are_echoed(ports: dict[str, int], variant: str) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{ports[variant]}") as channel:
        call = channel.unary_unary("/bench/Echo")
        for size in (1, 33, 300_000):  # the last past the 64 KiB windows, in several frames
            message = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
            assert call(message, timeout=10) == message
        with pytest.raises(grpc.RpcError) as refused:
            call(b"y" * 100, timeout=10, compression=grpc.Compression.Gzip)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert call(b"after", timeout=10) == b"after"  # the connection still serves


def test_the_header_cache_follows_the_dynamic_table() -> None:
    """The cached decoder answers as hpack's own at every step, a replayed block after an insertion too
    (its indices then name other entries)."""
    encoder, cached, reference = Encoder(), grpc_h2.CachingDecoder(), Decoder()
    first = [(b":path", b"/a"), (b"x-key", b"1")]
    indexed = b""
    for headers in (first, first, [(b"x-other", b"2")], first, None):
        block = encoder.encode(headers) if headers is not None else indexed  # None: replay the indexed
        assert list(cached.decode(block, raw=True)) == list(reference.decode(block, raw=True))
        if not indexed and headers == first and grpc_h2.only_indexed(block):
            indexed = block  # the second call's block, replayed after the insertion
            assert block in cached.cache
    assert indexed and list(reference.decode(indexed, raw=True)) != first


def _h2_client(port: int) -> tuple[socket.socket, h2.connection.H2Connection]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    sock.sendall(connection.data_to_send())
    return sock, connection


def _events_until(
    sock: socket.socket, connection: h2.connection.H2Connection, done: Callable[[list[Any]], bool]
) -> list[Any]:
    events: list[Any] = []
    deadline = time.monotonic() + 5
    while not done(events) and time.monotonic() < deadline:
        events += connection.receive_data(sock.recv(1 << 16))
        sock.sendall(connection.data_to_send())
    return events


def _call_headers(port: int, **extra: str) -> list[tuple[str, str]]:
    headers = {
        ":method": "POST",
        ":scheme": "http",
        ":path": "/bench/Echo",
        ":authority": f"127.0.0.1:{port}",
        "content-type": "application/grpc",
        "te": "trailers",
    }
    return list({**headers, **extra}.items())


def test_frames_checks_a_calls_headers_its_deadline_and_the_stream_limit(ports: dict[str, int]) -> None:
    port = ports["frames"]
    sock, connection = _h2_client(port)
    try:
        # a stalled message: cut at its grpc-timeout (0.2 s), not at the read bound (5 s here)
        connection.send_headers(1, _call_headers(port, **{"grpc-timeout": "200m"}))
        connection.send_data(1, b"\0\0\0\0\x10")  # 16 bytes declared, none sent
        # a call that is not gRPC
        connection.send_headers(3, _call_headers(port, **{"content-type": "text/plain"}), end_stream=True)
        sock.sendall(connection.data_to_send())
        started = time.monotonic()
        events = _events_until(sock, connection, lambda got: _trailers(got, 1) is not None)
        assert 0.15 < time.monotonic() - started < 2
        assert _trailers(events, 1) == "4"  # DEADLINE_EXCEEDED
        assert _trailers(events, 3) == "13"
    finally:
        sock.close()
    # 100 calls open at once; the 101st is refused (sent before the client reads the server's limit)
    sock, connection = _h2_client(port)
    try:
        for stream in range(1, 1 + 2 * 101, 2):
            connection.send_headers(stream, _call_headers(port))
        sock.sendall(connection.data_to_send())
        events = _events_until(
            sock, connection, lambda got: any(type(e) is h2.events.StreamReset for e in got)
        )
        (reset,) = [event for event in events if type(event) is h2.events.StreamReset]
        assert reset.stream_id == 1 + 2 * 100 and reset.error_code == h2.errors.ErrorCodes.REFUSED_STREAM
    finally:
        sock.close()


def _trailers(events: list[Any], stream: int) -> str | None:
    """The grpc-status a stream ended with, if it has."""
    for event in events:
        if type(event) is h2.events.TrailersReceived and event.stream_id == stream:
            return dict(event.headers)[b"grpc-status"].decode()
    return None


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(b"10S", 10.0), (b"200m", 0.2), (b"1H", 3600.0), (b"5u", 5e-6), (b"", None), (b"123456789S", None)],
)
def test_grpc_timeouts_are_read(value: bytes, seconds: float | None) -> None:
    assert grpc_h2.grpc_timeout_s(value) == pytest.approx(seconds) if seconds else seconds is None
