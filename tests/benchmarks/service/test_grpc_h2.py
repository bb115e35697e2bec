"""The HTTP/2 servers of the gRPC floor benchmark serve grpcio's own client correctly (else their figures
would be of something that is not gRPC): echo, a message larger than the flow-control windows, a compressed
message refused, and the header cache decoding what hpack decodes."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import grpc
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
