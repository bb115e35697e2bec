"""Record what a client sends: a plain TCP listener that saves each HTTP request it receives (head and
body) to ``<out>/http-<n>.bin``, and a gRPC server that saves each message of every call to
``<out>/grpc-<method>-<n>.bin``; both answer with errors. Used once per tool to make the recorded requests
``tests/service/test_oip_compat.py`` replays (``devtools/compat/run.sh record``).

    python -m devtools.compat.record --out DIR --http-port 18700 --grpc-port 18701 --seconds 60
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from pathlib import Path
from typing import Any

import grpc

_counter = itertools.count()


async def _http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, out: Path) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            body = await reader.readexactly(length)
            (out / f"http-{next(_counter)}.bin").write_bytes(head + body)
            reply = b'{"error": "recorded"}'
            writer.write(
                b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: "
                + str(len(reply)).encode()
                + b"\r\n\r\n"
                + reply
            )
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


def _grpc_handler(out: Path) -> grpc.GenericRpcHandler:
    class Recorder(grpc.GenericRpcHandler):
        def service(self, details: Any) -> Any:
            method = details.method.rsplit("/", 1)[-1]

            async def record(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
                (out / f"grpc-{method}-{next(_counter)}.bin").write_bytes(request)
                await context.abort(grpc.StatusCode.UNIMPLEMENTED, "recorded")
                return b""

            return grpc.unary_unary_rpc_method_handler(record)

    return Recorder()


async def _main(out: Path, http_port: int, grpc_port: int, seconds: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    server = await asyncio.start_server(lambda r, w: _http(r, w, out), "127.0.0.1", http_port)
    grpc_server = grpc.aio.server()
    grpc_server.add_generic_rpc_handlers((_grpc_handler(out),))
    grpc_server.add_insecure_port(f"127.0.0.1:{grpc_port}")
    await grpc_server.start()
    async with server:
        await asyncio.sleep(seconds)
    await grpc_server.stop(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--http-port", type=int, default=18700)
    parser.add_argument("--grpc-port", type=int, default=18701)
    parser.add_argument("--seconds", type=float, default=60)
    args = parser.parse_args()
    asyncio.run(_main(args.out, args.http_port, args.grpc_port, args.seconds))


if __name__ == "__main__":
    main()
