"""Request limits that act before a route runs: body size (413) and saturation (503 + Retry-After).

Per-request id counts, table counts and memory limits are checked by ``TableStore`` (``store.Limits``),
which knows the table's dimension.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_response
from .metrics import Metrics

# Probes and scrapes must answer even when the data path is saturated.
UNLIMITED_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/v2/health/live", "/v2/health/ready"})


class BodySizeLimitMiddleware:
    """Refuse bodies over ``max_body_bytes``: by Content-Length up front, or while a chunked body streams."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _message(self) -> str:
        return f"request body is over the limit max_body_bytes={self.max_body_bytes}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > self.max_body_bytes:
                    response = error_response(413, self._message(), "PayloadTooLargeError")
                    await response(scope, receive, send)
                    return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    # An HTTPException, not a RobezError: FastAPI re-raises these from its own body reading.
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, counting_receive, send)


class InFlightLimitMiddleware:
    """Admit at most ``max_in_flight`` requests at once in this worker; answer the rest 503 at once.

    A saturated worker saying "retry later" keeps latency bounded for admitted requests, where an
    unbounded queue would grow every request's latency and memory.
    """

    def __init__(self, app: ASGIApp, max_in_flight: int, retry_after_s: int, metrics: Metrics) -> None:
        self.app = app
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self.metrics = metrics
        self.in_flight = 0  # one event loop per worker: no lock needed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNLIMITED_PATHS:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.max_in_flight:
            self.metrics.rejected_total.labels("saturated").inc()
            response = error_response(
                503,
                f"server saturated: {self.in_flight} requests in flight (max_in_flight={self.max_in_flight})",
                "BusyError",
                {"Retry-After": str(self.retry_after_s)},
            )
            await response(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
