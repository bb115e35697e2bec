"""The framework floor: a bare Starlette app with trivial routes, served like ``robez serve``.

``python -m loadtest.floor --port P --workers k`` runs it under uvicorn with the options ``robez serve``
passes (loopback host, worker count, log level, no access log, uvicorn's defaults otherwise: httptools
and uvloop when installed), so the load test can report every scenario as a ratio to what the same
server stack answers with no application work at all:

- ``GET /`` answers ``ok``: the floor of a small request.
- ``POST /rows/{rows}/{dim}`` reads the request body (the load test sends the same int64 ids as a
  binary lookup) and answers ``rows x dim`` float32 bytes of zeros, precomputed once per size, with
  the headers of robez's binary lookup answer (``X-Robez-Shape``, ``X-Robez-Version``, a
  ``Server-Timing`` of the same length): the floor of a large response, the framework's cost of
  sending those bytes.
"""

from __future__ import annotations

import argparse
import sys

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

OCTET_STREAM = "application/octet-stream"
# The same limits as a lookup: at most 32768 ids per request (loadtest.scenarios.MAX_BATCH_SIZE) of a
# table with d <= 4096 (robez_core's limit on embedding_dim).
MAX_ROWS = 32768
MAX_DIM = 4096
_MAX_CACHED_SIZES = 8
# What robez's Server-Timing looks like on a lookup (same entries, same digits): only its length matters.
SERVER_TIMING = "hash;dur=0.026, lookup;dur=0.082, total;dur=0.191"

_bodies: dict[tuple[int, int], memoryview] = {}


def rows_body(rows: int, dim: int) -> memoryview:
    """``rows x dim`` float32 zeros as bytes, built on first use of that size and kept."""
    key = (rows, dim)
    body = _bodies.get(key)
    if body is None:
        if len(_bodies) >= _MAX_CACHED_SIZES:
            _bodies.clear()
        body = _bodies[key] = memoryview(bytes(rows * dim * 4))
    return body


async def _ok(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


async def _rows(request: Request) -> Response:
    rows, dim = request.path_params["rows"], request.path_params["dim"]
    if not (1 <= rows <= MAX_ROWS and 1 <= dim <= MAX_DIM):
        return PlainTextResponse(f"rows must be in [1, {MAX_ROWS}] and dim in [1, {MAX_DIM}]", 400)
    await request.body()  # read like a lookup reads its ids
    headers = {"Server-Timing": SERVER_TIMING, "X-Robez-Version": "0", "X-Robez-Shape": f"{rows},{dim}"}
    return Response(rows_body(rows, dim), media_type=OCTET_STREAM, headers=headers)


app = Starlette(
    routes=[Route("/", _ok), Route("/rows/{rows:int}/{dim:int}", _rows, methods=["POST"])],
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.floor", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    import uvicorn

    uvicorn.run(
        "loadtest.floor:app",
        host=args.host,
        port=args.port,
        workers=args.workers,
        log_level=args.log_level,
        access_log=False,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
