"""A do-nothing OTLP/HTTP receiver: answers every POST 200 and drops it, so a traced server's exporter
has a peer to send to without a collector (``python -m loadtest.hotpath`` with tracing on, see
docs/observability.md). ``python -m loadtest.otlp_sink --port 4318``; loopback only."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class _Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the exporter's session expects

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.otlp_sink", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--port", type=int, default=4318)
    args = parser.parse_args(argv)
    ThreadingHTTPServer(("127.0.0.1", args.port), _Sink).serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
