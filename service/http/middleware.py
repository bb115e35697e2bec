"""The ASGI middlewares every request passes that a connection does not answer itself (``direct.py``),
outermost first: ``RequestMetricsMiddleware`` (counts and times every answer),
``RequestBodyMiddleware`` (the body: size 413, time 408, client gone: counted, bodies held 503),
``InFlightLimitMiddleware`` (saturation: 503 + Retry-After). The rules are ``admission.Admission``'s,
shared with the direct answers. Connection-level limits (idle connections, connections per worker) are in
``protocol.py``.

Per-request id counts, table counts and memory limits are checked by ``TableStore`` (``store.Limits``),
which knows the table's dimension.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import Callable
from typing import Any, BinaryIO

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .admission import Admission, AnswerStatus, endpoint


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
    receive: Receive,
    max_bytes: int,
    timeout_s: float,
    hold: Callable[[int], None],
    deadlines: BodyDeadlines,
    spool: BinaryIO | None = None,
) -> bytes:
    """The whole request body from ASGI ``receive``, at most ``max_bytes`` within ``timeout_s`` seconds
    (watched by ``deadlines``); ``hold(n)`` is told of every ``n`` bytes received before they are kept (it
    may raise ``WorkerFull``). With ``spool``, each chunk is written to it as it arrives and ``b""`` is
    returned: the body is never whole in memory.

    Raises ``BodyTooLarge``, ``BodyTimeout``, ``ClientGone`` or ``WorkerFull``. The only place a request
    body is read from the connection; routes read it from memory afterwards (``request.body()``), or
    from the spool file.
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
                if spool is None:
                    chunks.append(chunk)
                else:
                    spool.write(chunk)  # to the page cache: microseconds for a chunk of uvicorn's 64 KiB
            if not message.get("more_body", False):
                return b"".join(chunks)  # one chunk: returned as is, no copy
    except asyncio.CancelledError:
        # Our cancellation (and no one else's, e.g. a shutdown's): the deadline passed.
        if deadlines.remove(task) and task.uncancel() <= cancelling:
            raise BodyTimeout() from None
        raise
    finally:
        deadlines.remove(task)


class RequestBodyMiddleware:
    """Receive each request's whole body before the app sees the request.

    - over its size limit (by ``Content-Length`` up front, or while it streams in): 413;
    - not all there within ``body_timeout_s``: 408 and the connection is closed, so a client that stalls
      mid-body (slowloris) holds a connection for a bounded time and never a request slot;
    - the client went away meanwhile: counted in ``robez_client_disconnects_total``, nothing answered and
      nothing logged (a client leaving is normal);
    - the worker already holds ``max_body_bytes_held`` of bodies (counted from what has arrived, until
      each request is answered): 503 + Retry-After, so many large bodies at once cannot take the machine.

    The app then gets the body in one message from memory, except for routes that ``spools(scope)``
    names (checkpoint uploads): their body is written to an anonymous temporary file in ``spool_dir``
    (None: the system's temp directory) as it arrives, which the app finds in ``scope[spool_key]`` and
    which is closed (so gone) when the request ends, however it ends; it counts against
    ``max_body_bytes_held`` like a body in memory, which bounds the disk uploads take. Placed outside
    ``InFlightLimitMiddleware``, so a request counts against ``max_in_flight`` only once its body is here.
    """

    def __init__(
        self,
        app: ASGIApp,
        admission: Admission,
        spools: Callable[[Scope], bool] | None = None,
        spool_key: str = "",
        spool_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.app = app
        self.admission = admission
        self.deadlines = BodyDeadlines(check_s=min(1.0, admission.limits.timeout_s / 4))
        self.spools = spools
        self.spool_key = spool_key
        self.spool_dir = spool_dir

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
        admission = self.admission
        max_bytes, setting = admission.body_limit(content_type)
        declared = int(length) if length is not None and length.isdigit() else 0
        if declared > max_bytes:
            await admission.too_large(setting, max_bytes)(scope, receive, send)
            return
        if admission.over_held(declared):
            await admission.refuse_bodies_held(close=False)(scope, receive, send)
            return
        held = 0

        def hold(size: int) -> None:
            nonlocal held
            if not admission.hold(size):
                raise WorkerFull()
            held += size

        try:
            with contextlib.ExitStack() as stack:
                spool = None
                if self.spools is not None and self.spools(scope):
                    # O_TMPFILE where the file system has it: no name, so nothing to remove on any path.
                    spool = stack.enter_context(
                        tempfile.TemporaryFile(prefix=".robez-upload-", dir=self.spool_dir, buffering=0)
                    )
                    scope[self.spool_key] = spool
                    stack.callback(scope.pop, self.spool_key, None)
                timeout_s = admission.limits.timeout_s
                body = await read_body(receive, max_bytes, timeout_s, hold, self.deadlines, spool)
                await self.app(scope, _replay(body, receive), send)
        except BodyTooLarge:
            await admission.too_large(setting, max_bytes)(scope, receive, send)
        except WorkerFull:
            await admission.refuse_bodies_held(close=True)(scope, receive, send)
        except BodyTimeout:
            await admission.refuse_body_timeout()(scope, receive, send)
        except ClientGone:
            admission.client_gone()
        finally:
            admission.release(slot=False, size=held)


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

    def __init__(self, app: ASGIApp, admission: Admission) -> None:
        self.app = app
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        admission = self.admission
        path = scope["path"]
        if admission.saturated(path):
            await admission.refuse_saturated()(scope, receive, send)
            return
        slot = admission.admit(path, 0)
        try:
            await self.app(scope, receive, send)
        finally:
            admission.release(slot, 0)


class RequestMetricsMiddleware:
    """Counts and times every HTTP request by route template, method, table and status (pure ASGI);
    requests whose client left before any answer count under status 499, those that raised under 500
    (Starlette's ``ServerErrorMiddleware``, outside it, answers them with the app's handler for
    ``Exception``).

    The table label is set only by routes that resolved an existing table (``request.state.table``), so
    requests for unknown names cannot grow the label set.
    """

    def __init__(self, app: ASGIApp, admission: Admission) -> None:
        self.app = app
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        answer = AnswerStatus(send, scope, self.admission)
        raised = True
        try:
            await self.app(scope, receive, answer.send)
            raised = False
        finally:
            self.admission.finish(endpoint(scope), scope, answer, raised)
