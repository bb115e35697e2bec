"""The framework floor: a bare Starlette app with one trivial route, served like ``robez serve``.

``python -m loadtest.floor --port P --workers k`` runs it under uvicorn with the options ``robez serve``
passes (loopback host, worker count, log level, no access log, uvicorn's defaults otherwise: httptools
and uvloop when installed), so the load test can report every small-request scenario as a ratio to what
the same server stack answers with no application at all.
"""

from __future__ import annotations

import argparse
import sys

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route


async def _ok(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


app = Starlette(routes=[Route("/", _ok)])


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
