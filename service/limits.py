"""Request limits that act before a route runs: the body (size: 413, time: 408, client gone: counted) and
saturation (503 + Retry-After). Connection-level limits (idle connections, connections per worker) are in
``service/connections.py``.

Per-request id counts, table counts and memory limits are checked by ``TableStore`` (``store.Limits``),
which knows the table's dimension.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import anyio
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .codec import OCTET_STREAM
from .config import Settings
from .errors import error_response
from .metrics import Metrics

# Probes and scrapes must answer even when the data path is saturated.
UNLIMITED_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


@dataclass(frozen=True)
class BodyLimits:
    """How a request body must arrive: within ``timeout_s`` of its headers and within a size that depends
    on its type (binary is the bulk format; JSON grows ~10x when parsed into Python objects)."""

    max_body_bytes: int
    max_json_body_bytes: int
    timeout_s: float
    max_held_bytes: int  # bodies one worker holds at once, received or arriving, until answered
    retry_after_s: int = 1

    @classmethod
    def from_settings(cls, settings: Settings) -> BodyLimits:
        return cls(
            settings.max_body_bytes,
            settings.max_json_body_bytes,
            settings.body_timeout_s,
            settings.max_body_bytes_held,
            settings.retry_after_s,
        )

    def max_bytes_for(self, content_type: str) -> tuple[int, str]:
        """(limit, the setting's name) for a body of ``content_type``: every body that is not
        ``application/octet-stream`` is parsed as JSON by the routes, so it gets the JSON limit."""
        if content_type.split(";")[0].strip().lower() == OCTET_STREAM:
            return self.max_body_bytes, "max_body_bytes"
        if self.max_json_body_bytes < self.max_body_bytes:
            return self.max_json_body_bytes, "max_json_body_bytes"
        return self.max_body_bytes, "max_body_bytes"


class BodyTooLarge(Exception):
    """The body is over its limit (413)."""


class BodyTimeout(Exception):
    """The body did not arrive within ``body_timeout_s`` (408)."""


class ClientGone(Exception):
    """The client disconnected before its body arrived (no answer is possible)."""


class WorkerFull(Exception):
    """This worker already holds ``max_body_bytes_held`` of bodies (503, retry later)."""


async def read_body(receive: Receive, max_bytes: int, timeout_s: float, hold: Callable[[int], None]) -> bytes:
    """The whole request body from ASGI ``receive``, at most ``max_bytes`` within ``timeout_s`` seconds;
    ``hold(n)`` is told of every ``n`` bytes received before they are kept (it may raise ``WorkerFull``).

    Raises ``BodyTooLarge``, ``BodyTimeout``, ``ClientGone`` or ``WorkerFull``. The only place a request
    body is read from the connection; routes read it from memory afterwards (``request.body()``).
    """
    chunks: list[bytes] = []
    received = 0
    try:
        with anyio.fail_after(timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone()
                chunk = message.get("body", b"")
                if chunk:
                    received += len(chunk)
                    if received > max_bytes:
                        raise BodyTooLarge()
                    hold(len(chunk))
                    chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)  # one chunk: returned as is, no copy
    except TimeoutError as exc:
        raise BodyTimeout() from exc


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


class RequestBodyMiddleware:
    """Receive each request's whole body before the app sees the request.

    - over its size limit (by ``Content-Length`` up front, or while it streams in): 413;
    - not all there within ``body_timeout_s``: 408 and the connection is closed, so a client that stalls
      mid-body (slowloris) holds a connection for a bounded time and never a request slot;
    - the client went away meanwhile: counted in ``robez_client_disconnects_total``, nothing answered and
      nothing logged (a client leaving is normal);
    - the worker already holds ``max_body_bytes_held`` of bodies (counted from what has arrived, until
      each request is answered): 503 + Retry-After, so many large bodies at once cannot take the machine.

    The app then gets the body in one message from memory. Placed outside ``InFlightLimitMiddleware``, so
    a request counts against ``max_in_flight`` only once its body is here.
    """

    def __init__(self, app: ASGIApp, limits: BodyLimits, metrics: Metrics) -> None:
        self.app = app
        self.limits = limits
        self.metrics = metrics
        self.held_bytes = 0  # one event loop per worker: no lock needed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is None and _header(scope, b"transfer-encoding") is None:
            await self.app(scope, receive, send)  # no body (RFC 9112 6.3): nothing to wait for
            return
        content_type = (_header(scope, b"content-type") or b"").decode("latin-1")
        max_bytes, setting = self.limits.max_bytes_for(content_type)
        too_large = error_response(
            413,
            f"request body is over the limit {setting}={max_bytes}",
            "PayloadTooLargeError",
        )
        declared = int(length) if length is not None and length.isdigit() else 0
        if declared > max_bytes:
            await too_large(scope, receive, send)
            return
        if self.held_bytes + declared > self.limits.max_held_bytes:
            await self._worker_full(scope, receive, send, close=False)
            return
        held = 0

        def hold(size: int) -> None:
            nonlocal held
            if self.held_bytes + size > self.limits.max_held_bytes:
                raise WorkerFull()
            self.held_bytes += size
            held += size

        try:
            await self._receive_then_call(scope, receive, send, max_bytes, hold, too_large)
        finally:
            self.held_bytes -= held

    async def _receive_then_call(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        max_bytes: int,
        hold: Callable[[int], None],
        too_large: Response,
    ) -> None:
        try:
            body = await read_body(receive, max_bytes, self.limits.timeout_s, hold)
        except BodyTooLarge:
            await too_large(scope, receive, send)
            return
        except WorkerFull:
            await self._worker_full(scope, receive, send, close=True)
            return
        except BodyTimeout:
            self.metrics.rejected_total.labels("body_timeout").inc()
            timeout = error_response(
                408,
                f"the request body did not arrive within body_timeout_s={self.limits.timeout_s:g}",
                "RequestTimeoutError",
                {"Connection": "close"},
            )
            await timeout(scope, receive, send)
            return
        except ClientGone:
            self.metrics.client_disconnects_total.inc()
            return
        await self.app(scope, _replay(body, receive), send)

    async def _worker_full(self, scope: Scope, receive: Receive, send: Send, *, close: bool) -> None:
        self.metrics.rejected_total.labels("bodies_held").inc()
        headers = {"Retry-After": str(self.limits.retry_after_s)}
        if close:  # part of the body is unread and will not be
            headers["Connection"] = "close"
        message = (
            f"server busy: this worker holds {self.held_bytes} bytes of request bodies "
            f"(max_body_bytes_held={self.limits.max_held_bytes})"
        )
        await error_response(503, message, "BusyError", headers)(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the app: the buffered body first, then the connection's own (disconnect) events."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


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
