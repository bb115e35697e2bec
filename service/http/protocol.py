"""Connection limits uvicorn lacks, and direct answers, as its HTTP protocol (httptools) with additions:

- a connection must send a request's headers within ``header_timeout_s`` of opening, or of the end of
  its previous response, else it is closed (checked by one sweep per worker, ``HeaderSweep``). uvicorn
  arms its keep-alive timer only after a response and drops it at the first byte, so a connection that
  sends nothing (or trickles headers) stays forever;
- the keep-alive timeout (``timeout_keep_alive``: no byte within it after a response closes the
  connection) is kept by the same sweep, not by a timer uvicorn arms and cancels for every request;
- at most ``max_connections`` connections per worker: one more is closed as soon as it is accepted, so
  idle or slow clients cannot take every file descriptor of the process;
- small hot-route requests that arrive whole are answered in the protocol's own callback, without an
  ASGI task (``service/http/direct.py`` says when and how; the hooks are ``_start_asgi_task``,
  ``on_message_complete`` and ``data_received``);
- the bytes of its responses a client has not taken yet (the transport's write buffer) count against the
  worker's room for bodies (``max_body_bytes_held``, the ``Admission``'s) until it takes them: counted
  after each response, on each read and every ``_ANSWERS_RECOUNT_S`` while any are held, given back when
  the connection goes (``count_answers``; over TLS, writes go to the transport in pieces so that it can
  see them: ``PiecewiseWrites``); a large answer that finds no room is refused 503 where every response
  starts (``admission.AnswerStatus.send``).

A stalled request *body* is the business of ``middleware.RequestBodyMiddleware`` (``body_timeout_s``).

With TLS, a connection reaches the protocol only once its handshake is done; until then it is asyncio's
(uvloop's), which waits 60 s for a handshake and 30 s for a peer's ``close_notify`` when closing: 300
stalled handshakes were all open after 15 s, and a stop with one idle HTTPS keep-alive client took 31 s
(issue 40.5). ``TlsTimeoutLoop`` is the event loop with those two bounded: the handshake by
``header_timeout_s`` (it is part of getting a request's headers), the closing by ``_TLS_CLOSE_S``.
A stop waits ``shutdown_grace_s`` for requests under way (uvicorn's ``timeout_graceful_shutdown``;
it waited for ever), then cancels them.

``uvicorn_options(settings)`` gives ``uvicorn.run`` all of this.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from dataclasses import dataclass
from typing import Any

import uvloop
from starlette.responses import Response
from uvicorn.config import Config
from uvicorn.logging import TRACE_LOG_LEVEL
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string
from uvicorn.server import ServerState

from ..codec import RawResponse
from ..config import Settings
from .admission import ANSWER_CHECKED_BYTES, UNREAD_ANSWERS_KEY, Admission
from .direct import LIFESPAN_DIRECT_KEY, DirectAnswers, resume
from .fastpath import FastRoute

# Direct answers with bodies up to this size go out in one write with their headers (one send); larger
# bodies are written on their own rather than copied.
_JOIN_MAX_BODY_BYTES = 16 * 1024
# The key under which the app's lifespan state hands its ``Metrics`` to the connections.
LIFESPAN_METRICS_KEY = "robez_metrics"
# The key under which it hands them the worker's ``Admission``: a connection's unread answers count there.
LIFESPAN_ADMISSION_KEY = "robez_admission"
# How soon answers a client took (without sending a byte) leave the worker's room, as gRPC's.
_ANSWERS_RECOUNT_S = 0.05
# Over TLS, larger writes are handed to the transport in pieces of this size (``PiecewiseWrites``).
_TLS_PIECE_BYTES = 256 * 1024
# A TLS connection being closed waits this long for the peer's close_notify (asyncio's default: 30 s).
_TLS_CLOSE_S = 2.0
# The ServerState attribute that holds a worker's HeaderSweep (one per uvicorn server, shared by its
# connections).
_SWEEP_ATTRIBUTE = "robez_header_sweep"


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float
    max_connections: int
    keep_alive_s: float = 5.0


class HeaderSweep:
    """Closes a worker's connections that have waited ``timeout_s`` for a request's headers, and those
    that have received no byte at all within ``keep_alive_s`` of their last response (``idle``; the
    keep-alive timeout uvicorn would keep with a timer per request). One callback checks every
    ``check_s`` seconds while any connection waits, instead of timers armed and cancelled for each
    request (~3.5 us of a small request here). A connection is closed between a timeout and the timeout
    plus ``check_s`` (at most 1 s) after it started waiting."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        connections: set[Any],
        timeout_s: float,
        keep_alive_s: float | None = None,
    ) -> None:
        self.loop = loop
        self.connections = connections  # uvicorn's: every open connection of this worker
        self.timeout_s = timeout_s
        self.keep_alive_s = timeout_s if keep_alive_s is None else keep_alive_s
        self.check_s = min(1.0, timeout_s / 4, self.keep_alive_s / 4)
        self._check: asyncio.TimerHandle | None = None

    def watch(self) -> None:
        """A connection started waiting: make sure a check is due."""
        if self._check is None:
            self._check = self.loop.call_later(self.check_s, self._sweep)

    def _sweep(self) -> None:
        self._check = None
        now = self.loop.time()
        waiting = False
        for connection in list(self.connections):
            since = getattr(connection, "waiting_since", None)
            if since is None:
                continue
            if getattr(connection, "idle", False) and now - since >= self.keep_alive_s:
                connection.keep_alive_timeout()
            elif now - since >= self.timeout_s:
                connection.header_timeout()
            else:
                waiting = True
        if waiting:
            self.watch()


class PiecewiseWrites:
    """A TLS transport whose large writes are handed on in pieces of ``_TLS_PIECE_BYTES``. uvloop's TLS
    transport encrypts what it is given and passes it to the socket's own transport while that one is
    not full; its write buffer size (what ``count_answers`` counts) leaves out what it passed on. Given a
    whole answer at once, it passes all of it on, uncounted; given pieces, it stops passing them once
    the socket's transport is full, and keeps the rest where its size counts."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        if view.nbytes <= _TLS_PIECE_BYTES:
            self._transport.write(data)
            return
        for start in range(0, view.nbytes, _TLS_PIECE_BYTES):
            self._transport.write(view[start : start + _TLS_PIECE_BYTES])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class RobezHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header timeout and a cap on connections (module docstring)."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        limits: ConnectionLimits,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        # loop.time() since when this connection waits for a request's headers; None while it does not.
        self.waiting_since: float | None = None
        # True from the end of a response until the next byte: the keep-alive timeout applies.
        self.idle = False
        sweep = getattr(server_state, _SWEEP_ATTRIBUTE, None)
        if sweep is None or sweep.loop is not self.loop:
            sweep = HeaderSweep(
                self.loop, server_state.connections, limits.header_timeout_s, limits.keep_alive_s
            )
            setattr(server_state, _SWEEP_ATTRIBUTE, sweep)
        self._sweep: HeaderSweep = sweep
        # Direct answers (service/http/direct.py): the app's, unless uvicorn wraps the app in a logger.
        direct = app_state.get(LIFESPAN_DIRECT_KEY)
        self._direct: DirectAnswers | None = direct if self.logger.level > TRACE_LOG_LEVEL else None
        self._at_headers = False  # inside on_headers_complete
        # The request held for a direct answer until its body is complete: its cycle and route.
        self._held: tuple[RequestResponseCycle, FastRoute, str, int] | None = None
        # uvicorn's default headers (date, server), encoded: (the list they were encoded from, bytes).
        self._default_headers: tuple[list[tuple[bytes, bytes]] | None, bytes] = (None, b"")
        # Where this connection's unread answers count (None: nowhere, or no more: the connection is gone).
        self._admission: Admission | None = app_state.get(LIFESPAN_ADMISSION_KEY)
        self.answers_held = 0  # bytes of responses written and not yet taken by the client, counted there
        self._answers_timer: asyncio.TimerHandle | None = None  # counts them again while any are held

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if self._admission is not None and transport.get_extra_info("ssl_object") is not None:
            transport = PiecewiseWrites(transport)  # type: ignore[assignment]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._count_closed("max_connections")
            transport.close()
            return
        self._wait_for_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self.waiting_since = None
        self._held = None
        if self._answers_timer is not None:
            self._answers_timer.cancel()
            self._answers_timer = None
        if self._admission is not None:  # what the client did not take is freed with the transport
            self._admission.hold_answers(-self.answers_held)
            self.answers_held = 0
            self._admission = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.idle = False
        if self.answers_held:  # a client sending its next request may have taken its answers
            self.count_answers()
        super().data_received(data)
        if self._held is not None:  # its body is still on its way: the stack reads it (and times it)
            cycle = self._held[0]
            self._held = None
            if not self.transport.is_closing():
                super()._start_asgi_task(cycle, self.app)

    def on_headers_complete(self) -> None:
        self.waiting_since = None
        if self._admission is not None:  # the request's answer counts this connection's unread ones first
            self.scope[UNREAD_ANSWERS_KEY] = self.count_answers  # type: ignore[literal-required]
        self._at_headers = True
        try:
            super().on_headers_complete()
        finally:
            self._at_headers = False

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        # Called by on_headers_complete for a request that may start now (not queued behind another).
        if self._at_headers and self._direct is not None and app is self.app:
            route = self._direct.take(cycle.scope)  # type: ignore[arg-type]
            if route is not None:
                self._held = (cycle, *route)
                return
        super()._start_asgi_task(cycle, app)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        held = self._held
        if held is None or held[0] is not self.cycle:
            return
        self._held = None
        cycle, route, parameter, size = held
        assert self._direct is not None
        write = functools.partial(self._write_raw, cycle)
        serve = functools.partial(
            self._direct.serve, route=route, parameter=parameter, size=size, write=write
        )
        # uvicorn's own cycle around the direct answer: the response writer, access log, keep-alive and
        # error handling a task would have, run here; it continues in a task only if it has to wait.
        context = contextvars.copy_context()
        coroutine = cycle.run_asgi(serve)
        try:
            pending = context.run(coroutine.send, None)
        except StopIteration:
            return
        task = self.loop.create_task(resume(coroutine, pending), context=context)
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    def on_response_complete(self) -> None:
        # uvicorn's, with its keep-alive timer left to the sweep: the connection now waits for its next
        # request's headers, and is idle until its next byte (unless a pipelined request is already
        # under way, or the connection is closing).
        self.server_state.total_requests += 1
        self.count_answers()  # what the kernel did not take of the response is held until the client takes it
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        else:
            self.idle = True
            self._wait_for_headers()

    def _write_raw(self, cycle: RequestResponseCycle, response: Response) -> bool:
        """What uvicorn's ``cycle.send`` does with a ``RawResponse``'s two messages (its headers, then its
        whole body), written at once: the same bytes (header checks, default headers, ``connection:
        close``, access log, keep-alive), one write and no two awaits. False, having done nothing, for
        anything else: ``send`` then answers as usual."""
        if (
            type(response) is not RawResponse
            or cycle.response_started
            or cycle.disconnected
            or self.flow.write_paused
            or cycle.scope["method"] == "HEAD"
            or len(response.body) > ANSWER_CHECKED_BYTES  # checked for room by ``send`` (admission.py)
        ):
            return False
        headers = response.raw_headers
        names = b"".join([name for name, _ in headers])
        if HEADER_RE.search(names) or HEADER_VALUE_RE.search(b"".join([value for _, value in headers])):
            return False  # send raises for it
        if b"connection" in names.lower() or b"transfer-encoding" in names:
            return False
        defaults, encoded = self._default_headers
        if defaults is not cycle.default_headers:  # the date changed (once a second)
            defaults = cycle.default_headers
            if any(HEADER_RE.search(n) or HEADER_VALUE_RE.search(v) for n, v in defaults):
                return False
            encoded = b"".join([b"%s: %s\r\n" % (name.lower(), value) for name, value in defaults])
            self._default_headers = (defaults, encoded)
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        status = response.status_code
        scope = cycle.scope
        if cycle.access_log:
            cycle.access_logger.info(
                '%s - "%s %s HTTP/%s" %d',
                get_client_addr(scope),
                scope["method"],
                get_path_with_query_string(scope),
                scope["http_version"],
                status,
            )
        content = [STATUS_LINE[status], encoded]
        for name, value in headers:
            content += (name, b": ", value, b"\r\n")
        if not cycle.keep_alive:
            content.append(b"connection: close\r\n")
        content.append(b"\r\n")
        body: Any = response.body  # bytes or a memoryview
        if len(body) <= _JOIN_MAX_BODY_BYTES:
            content.append(body)
            self.transport.write(b"".join(content))
        else:
            self.transport.write(b"".join(content))
            self.transport.write(body)
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            self.transport.close()
        cycle.on_response()
        return True

    def count_answers(self) -> None:
        """Hold the bytes of this connection's responses its client has not taken yet (its transport's
        write buffer: what the kernel did not take) in the worker's room for bodies, what it took given
        back; counted again every ``_ANSWERS_RECOUNT_S`` while any are held, as a client takes them without
        a word. Before, a client that read no answer held each in full until it left: 200 connections
        with one lookup of 262,144 ids each grew a worker by 4.3 GB. Over TLS, what uvloop's transport
        passed on to the socket's own is not seen: at most a piece or two (``PiecewiseWrites``)."""
        admission = self._admission
        if admission is None:
            return
        backlog = self.transport.get_write_buffer_size()
        if backlog != self.answers_held:
            admission.hold_answers(backlog - self.answers_held)
            self.answers_held = backlog
        if backlog and self._answers_timer is None:
            self._answers_timer = self.loop.call_later(_ANSWERS_RECOUNT_S, self._recount_answers)

    def _recount_answers(self) -> None:
        self._answers_timer = None
        self.count_answers()

    def _wait_for_headers(self) -> None:
        self.waiting_since = self.loop.time()
        self._sweep.watch()

    def shutdown(self) -> None:
        """Called by uvicorn when a stop begins: an idle TLS connection is dropped at once (a clean TLS
        close would wait up to ``_TLS_CLOSE_S`` for the client's ``close_notify``, which an idle client
        need not send; no response is cut, and the client opens a new connection for its next request);
        the rest as uvicorn does (a plain close; a request under way finishes, then closes)."""
        idle = self.cycle is None or self.cycle.response_complete
        if idle and self.transport.get_extra_info("ssl_object") is not None:
            self.transport.abort()
        else:
            super().shutdown()

    def keep_alive_timeout(self) -> None:
        """Called by the sweep: no byte within the keep-alive timeout after a response (as uvicorn's
        ``timeout_keep_alive_handler``, uncounted)."""
        self.waiting_since = None
        self.idle = False
        if not self.transport.is_closing():
            self.transport.close()

    def header_timeout(self) -> None:
        """Called by the sweep: this connection sent no complete headers within ``header_timeout_s``."""
        self.waiting_since = None
        if not self.transport.is_closing():
            self._count_closed("header_timeout")
            self.transport.close()

    def _count_closed(self, reason: str) -> None:
        metrics = self.app_state.get(LIFESPAN_METRICS_KEY)
        if metrics is not None:
            metrics.connections_closed_total.labels(reason).inc()


class TlsTimeoutLoop(uvloop.Loop):
    """uvloop's event loop, whose TLS servers cut a handshake after ``handshake_timeout_s`` and wait
    ``shutdown_timeout_s`` for a closing peer's ``close_notify`` (module docstring)."""

    def __init__(self, handshake_timeout_s: float, shutdown_timeout_s: float) -> None:
        super().__init__()
        self.handshake_timeout_s = handshake_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s

    async def create_server(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("ssl") is not None:
            kwargs.setdefault("ssl_handshake_timeout", self.handshake_timeout_s)
            kwargs.setdefault("ssl_shutdown_timeout", self.shutdown_timeout_s)
        return await super().create_server(*args, **kwargs)


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """``uvicorn.run`` keyword arguments for the connection limits of ``settings``. The protocol and the
    loop factory are ``functools.partial``s of module-level classes, so they pickle into spawned
    workers (uvicorn takes a callable ``loop`` as the factory of its event loop)."""
    limits = ConnectionLimits(
        settings.header_timeout_s, settings.max_connections, settings.keep_alive_timeout_s
    )
    options: dict[str, Any] = {
        "http": functools.partial(RobezHttpProtocol, limits=limits),
        "timeout_keep_alive": settings.keep_alive_timeout_s,
        "timeout_graceful_shutdown": settings.shutdown_grace_s,
    }
    if settings.tls_cert is not None:
        options["loop"] = functools.partial(
            TlsTimeoutLoop,
            handshake_timeout_s=settings.header_timeout_s,
            shutdown_timeout_s=min(_TLS_CLOSE_S, settings.shutdown_grace_s),
        )
    return options
