"""Request limits that act before a route runs: the body (size: 413, time: 408, client gone: counted) and
saturation (503 + Retry-After). Connection-level limits (idle connections, connections per worker) are in
``service/http/protocol.py``.

Per-request id counts, table counts and memory limits are checked by ``TableStore`` (``store.Limits``),
which knows the table's dimension.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..codec import OCTET_STREAM
from ..config import Settings
from ..errors import error_response
from ..metrics import Metrics

# Probes and scrapes must answer even when the data path is saturated.
UNLIMITED_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/v2/health/live", "/v2/health/ready"})


@dataclass(frozen=True)
class BodyLimits:
    """How a request body must arrive: within ``timeout_s`` of its headers and within a size that depends
    on its type (binary is the bulk format; JSON takes 5-37x its size while decoded into Python objects,
    docs/benchmarks/body-memory-2026-11-22.md)."""

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


@dataclass
class WorkerLoad:
    """What one worker holds at once, shared by the limit middlewares and the direct answers
    (``service/http/direct.py``): requests admitted and not yet answered, and bytes of request bodies held.
    One event loop per worker: no lock needed."""

    in_flight: int = 0
    held_bytes: int = 0


class BodyTooLarge(Exception):
    """The body is over its limit (413)."""


class BodyTimeout(Exception):
    """The body did not arrive within ``body_timeout_s`` (408)."""


class ClientGone(Exception):
    """The client disconnected before its body arrived (no answer is possible)."""


class WorkerFull(Exception):
    """This worker already holds ``max_body_bytes_held`` of bodies (503, retry later)."""


class BodyDeadlines:
    """Cancels the tasks still reading a body past their deadline. One callback per worker checks every
    ``check_s`` seconds while any body is being read, instead of a timer per request: an
    ``asyncio.timeout`` costs ~5 us, a whole small request ~150-400 us of CPU. A deadline is kept to
    within ``check_s``."""

    def __init__(self, check_s: float) -> None:
        self.check_s = check_s
        self._deadlines: dict[asyncio.Task[Any], float] = {}
        self._expired: set[asyncio.Task[Any]] = set()
        self._check: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, task: asyncio.Task[Any], timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        self._deadlines[task] = loop.time() + timeout_s
        if self._check is None or self._loop is not loop:  # none pending, or a new loop (tests)
            self._loop = loop
            self._check = loop.call_later(self.check_s, self._expire)

    def remove(self, task: asyncio.Task[Any]) -> bool:
        """Stop watching ``task``; whether its deadline had passed (and it was cancelled for it)."""
        self._deadlines.pop(task, None)
        if task in self._expired:
            self._expired.discard(task)
            return True
        return False

    def _expire(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        for task, deadline in list(self._deadlines.items()):
            if deadline <= now:
                del self._deadlines[task]
                self._expired.add(task)
                task.cancel()
        self._check = self._loop.call_later(self.check_s, self._expire) if self._deadlines else None


async def read_body(
    receive: Receive, max_bytes: int, timeout_s: float, hold: Callable[[int], None], deadlines: BodyDeadlines
) -> bytes:
    """The whole request body from ASGI ``receive``, at most ``max_bytes`` within ``timeout_s`` seconds
    (watched by ``deadlines``); ``hold(n)`` is told of every ``n`` bytes received before they are kept (it
    may raise ``WorkerFull``).

    Raises ``BodyTooLarge``, ``BodyTimeout``, ``ClientGone`` or ``WorkerFull``. The only place a request
    body is read from the connection; routes read it from memory afterwards (``request.body()``).
    """
    task = asyncio.current_task()
    assert task is not None
    cancelling = task.cancelling()
    chunks: list[bytes] = []
    received = 0
    deadlines.add(task, timeout_s)
    try:
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
    except asyncio.CancelledError:
        # Our cancellation (and no one else's, e.g. a shutdown's): the deadline passed.
        if deadlines.remove(task) and task.uncancel() <= cancelling:
            raise BodyTimeout() from None
        raise
    finally:
        deadlines.remove(task)


def _too_large(setting: str, max_bytes: int) -> Response:
    return error_response(
        413, f"request body is over the limit {setting}={max_bytes}", "PayloadTooLargeError"
    )


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

    def __init__(
        self, app: ASGIApp, limits: BodyLimits, metrics: Metrics, load: WorkerLoad | None = None
    ) -> None:
        self.app = app
        self.limits = limits
        self.metrics = metrics
        self.load = load if load is not None else WorkerLoad()
        self.deadlines = BodyDeadlines(check_s=min(1.0, limits.timeout_s / 4))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = chunked = content_type = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = value
            elif name == b"transfer-encoding":
                chunked = value
            elif name == b"content-type" and content_type is None:  # the first, as request.headers
                content_type = value
        if length is None and chunked is None:
            await self.app(scope, receive, send)  # no body (RFC 9112 6.3): nothing to wait for
            return
        max_bytes, setting = self.limits.max_bytes_for(content_type.decode("latin-1") if content_type else "")
        declared = int(length) if length is not None and length.isdigit() else 0
        if declared > max_bytes:
            await _too_large(setting, max_bytes)(scope, receive, send)
            return
        load = self.load
        if load.held_bytes + declared > self.limits.max_held_bytes:
            await self._worker_full(scope, receive, send, close=False)
            return
        held = 0

        def hold(size: int) -> None:
            nonlocal held
            if load.held_bytes + size > self.limits.max_held_bytes:
                raise WorkerFull()
            load.held_bytes += size
            held += size

        try:
            body = await read_body(receive, max_bytes, self.limits.timeout_s, hold, self.deadlines)
            await self.app(scope, _replay(body, receive), send)
        except BodyTooLarge:
            await _too_large(setting, max_bytes)(scope, receive, send)
        except WorkerFull:
            await self._worker_full(scope, receive, send, close=True)
        except BodyTimeout:
            self.metrics.rejected_total.labels("body_timeout").inc()
            timeout = error_response(
                408,
                f"the request body did not arrive within body_timeout_s={self.limits.timeout_s:g}",
                "RequestTimeoutError",
                {"Connection": "close"},
            )
            await timeout(scope, receive, send)
        except ClientGone:
            self.metrics.client_disconnects_total.inc()
        finally:
            load.held_bytes -= held

    async def _worker_full(self, scope: Scope, receive: Receive, send: Send, *, close: bool) -> None:
        self.metrics.rejected_total.labels("bodies_held").inc()
        headers = {"Retry-After": str(self.limits.retry_after_s)}
        if close:  # part of the body is unread and will not be
            headers["Connection"] = "close"
        message = (
            f"server busy: this worker holds {self.load.held_bytes} bytes of request bodies "
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

    def __init__(
        self,
        app: ASGIApp,
        max_in_flight: int,
        retry_after_s: int,
        metrics: Metrics,
        load: WorkerLoad | None = None,
    ) -> None:
        self.app = app
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self.metrics = metrics
        self.load = load if load is not None else WorkerLoad()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNLIMITED_PATHS:
            await self.app(scope, receive, send)
            return
        load = self.load
        if load.in_flight >= self.max_in_flight:
            self.metrics.rejected_total.labels("saturated").inc()
            response = error_response(
                503,
                f"server saturated: {load.in_flight} requests in flight (max_in_flight={self.max_in_flight})",
                "BusyError",
                {"Retry-After": str(self.retry_after_s)},
            )
            await response(scope, receive, send)
            return
        load.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            load.in_flight -= 1
