"""Admission: the rules a request passes before a route runs, once for both ways a request comes in.

The middleware stack (``middleware.py``: every request) and direct answers (``direct.py``: small hot-route
requests a connection answers itself) both ask one ``Admission`` per worker:

- a body is at most ``body_limit(its content type)`` (413), and the worker holds at most
  ``max_body_bytes_held`` of bodies at once, counted from their arrival until their answer (503 +
  Retry-After), with the answers its clients have not taken yet (``hold_answers``: an HTTP connection's
  unread response bytes, ``protocol.py``; gRPC's, ``service/grpc/``);
- an answer over ``ANSWER_CHECKED_BYTES`` that finds no room is answered with that 503 instead, and
  dropped (``answer_refusal``, at its response start: ``AnswerStatus.send``), so clients that read no
  answers cannot make a worker hold more than its room of them; smaller answers always go (sending them
  is how their memory goes soonest);
- a request takes one of ``max_in_flight`` slots until it is answered, unless it is a probe or a scrape
  (``UNLIMITED_PATHS``); none free: 503 + Retry-After;
- a lookup waiting for a table version (``X-Robez-Min-Version``, service/consistency.py) gives its slot
  back while it waits and takes one of ``max_version_waiters`` instead; none free: 503 + Retry-After, so
  waits can never take the slots other requests need;
- every request is counted and timed by route template, method, table and status (``finish``): 499 when
  its client left before an answer, 500 when it raised;
- an error no handler took is answered by the app's handler for ``Exception``: in the stack by
  Starlette's ``ServerErrorMiddleware`` (outermost, always), in a direct answer by ``unexpected``.

gRPC (``service/grpc/``) asks the same rules of a whole message at once (``refusal``).

The stack refuses what breaks a rule; direct answers take only what passes them all (``admits``) and
leave the rest to the stack, so a refusal always comes from one place.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from robez_core.errors import BusyError, RobezError

from .. import tracing
from ..codec import OCTET_STREAM
from ..config import Settings
from ..errors import PayloadTooLargeError, error_response
from ..metrics import Metrics, table_label

# Probes and scrapes must answer even when the data path is saturated.
UNLIMITED_PATHS = frozenset(
    {
        "/healthz",
        "/readyz",
        "/metrics",
        "/v2/health/live",
        "/v2/health/ready",
        "/inference.GRPCInferenceService/ServerLive",
        "/inference.GRPCInferenceService/ServerReady",
    }
)
# Answers larger than this are checked for room before they start (``Admission.answer_fits``): HTTP's and
# both gRPC engines' (service/grpc/).
ANSWER_CHECKED_BYTES = 256 * 1024
# The scope key under which a connection that counts its unread answers (protocol.py) hands each request
# the function that counts them again (``RobezHttpProtocol.count_answers``).
UNREAD_ANSWERS_KEY = "robez.count_answers"
# nginx's status for "the client closed the connection before the server answered"; never sent.
CLIENT_CLOSED_REQUEST = 499


@dataclass(frozen=True)
class BodyLimits:
    """How a request body must arrive: within ``timeout_s`` of its headers and within a size that depends
    on its type (binary is the bulk format; JSON takes 5-37x its size while decoded into Python objects,
    docs/benchmarks/body-memory-2026-11-22.md)."""

    max_body_bytes: int
    max_json_body_bytes: int
    timeout_s: float
    max_held_bytes: int  # bodies one worker holds at once, received or arriving, until answered
    retry_after_s: int = 1  # the Retry-After of a 503 (bodies held, saturated)

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


class AnswerStatus:
    """The status a request is counted under, and when it started: ``send`` records the status its
    response starts with (or set ``status`` when a response is written another way); ``final`` gives it,
    or, with no response started, 499 when the app returned (its client went away) and 500 when it raised
    (the handler for ``Exception`` answers 500). With tracing on, the request's span starts here (a child
    of its ``traceparent``) and ``Admission.finish`` ends it.

    ``send`` is also where every response of the stack and of the direct answers starts, so it is where an
    answer too large for the worker's room is refused (``Admission.answer_refusal``): the 503 goes instead,
    and the answer's body is dropped."""

    __slots__ = ("_admission", "_dropping", "_send", "_unread", "start", "status", "trace")

    def __init__(self, send: Send, scope: Scope, admission: Admission) -> None:
        self._send = send
        self._admission = admission
        self._unread: Callable[[], None] | None = scope.get(UNREAD_ANSWERS_KEY)
        self._dropping = False  # the answer was refused: its body goes nowhere
        self.status: int | None = None
        self.start = time.perf_counter()
        self.trace: Any = None
        if tracing.TRACER is not None:
            self.trace = tracing.start_request(
                scope["method"],
                tracing.carrier_of(scope["headers"]),
                {"http.request.method": scope["method"], "url.path": scope["path"]},
            )

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            refusal = self._admission.answer_refusal(_content_length(message), self._unread)
            if refusal is not None:
                self._dropping = True
                self.status = refusal.status_code
                await self._send(
                    {"type": kind, "status": refusal.status_code, "headers": refusal.raw_headers}
                )
                await self._send({"type": "http.response.body", "body": refusal.body})
                return
            self.status = int(message["status"])
        elif self._dropping and kind == "http.response.body":
            return
        await self._send(message)

    def final(self, raised: bool) -> int:
        if self.status is not None:
            return self.status
        return 500 if raised else CLIENT_CLOSED_REQUEST


def _content_length(start: Message) -> int:
    """The Content-Length of a response start (0 without one: a stream, bounded by uvicorn's flow
    control as it goes)."""
    for name, value in start.get("headers", ()):
        if name == b"content-length":
            return int(value)
    return 0


def endpoint(scope: Scope) -> str:
    """The metrics label of a request: the template of the route that took it, else "unmatched"."""
    route: Any = scope.get("route")
    return getattr(route, "path", None) or "unmatched"


class Admission:
    """One worker's admission of requests (module docstring): its limits, what it holds now, its metrics.
    One event loop per worker: the counts need no lock.

    Args:
        limits: the body limits and the Retry-After of a 503.
        max_in_flight: requests admitted at once (probes and scrapes apart).
        metrics: where requests and refusals are counted.
        max_waiting: requests waiting for a table version at once (they hold no in-flight slot meanwhile).
    """

    def __init__(
        self, limits: BodyLimits, max_in_flight: int, metrics: Metrics, max_waiting: int = 32
    ) -> None:
        self.limits = limits
        self.max_in_flight = max_in_flight
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.in_flight = 0  # requests admitted and not yet answered (waiters apart)
        self.waiting = 0  # admitted requests waiting for a table version
        self.held_bytes = 0  # bytes of request bodies held, received or arriving, until answered

    @classmethod
    def from_settings(cls, settings: Settings, metrics: Metrics) -> Admission:
        return cls(
            BodyLimits.from_settings(settings), settings.max_in_flight, metrics, settings.max_version_waiters
        )

    # -- the rules: whether a request passes (nothing changes) ---------------------------------------------

    def saturated(self, path: str) -> bool:
        """Whether a request for ``path`` finds no in-flight slot free (503)."""
        return path not in UNLIMITED_PATHS and self.in_flight >= self.max_in_flight

    def body_limit(self, content_type: bytes | None) -> tuple[int, str]:
        """(limit, the setting's name) for a body sent with the Content-Type ``content_type`` (the first
        such header, as ``request.headers`` reads it; None: no header)."""
        return self.limits.max_bytes_for(content_type.decode("latin-1") if content_type else "")

    def over_held(self, size: int) -> bool:
        """Whether ``size`` more bytes of bodies are more than the worker may hold now (503)."""
        return self.held_bytes + size > self.limits.max_held_bytes

    def admits(self, path: str, size: int, content_type: bytes | None) -> bool:
        """Whether a request whose headers are in, with a body of ``size`` bytes (declared), passes every
        rule now: the stack would refuse none of it."""
        # saturated(), body_limit() and over_held() written out: this runs for every direct answer.
        if path not in UNLIMITED_PATHS and self.in_flight >= self.max_in_flight:
            return False
        if size == 0:
            return True
        limits = self.limits
        max_bytes, _ = limits.max_bytes_for(content_type.decode("latin-1") if content_type else "")
        return size <= max_bytes and self.held_bytes + size <= limits.max_held_bytes

    # -- what an admitted request holds --------------------------------------------------------------------

    def admit(self, path: str, size: int) -> bool:
        """Hold ``size`` bytes of body and, unless ``path`` is unlimited, an in-flight slot; whether a slot
        was taken. ``release`` gives both back."""
        self.held_bytes += size
        if path in UNLIMITED_PATHS:
            return False
        self.in_flight += 1
        return True

    def hold(self, size: int) -> bool:
        """Hold ``size`` more bytes of a body as they arrive, if the worker has room for them."""
        if self.over_held(size):
            return False
        self.held_bytes += size
        return True

    def hold_answers(self, change: int) -> None:
        """Count ``change`` more (or, negative, fewer) bytes of answers a client has not taken yet among the
        bytes held. An answer is checked (``over_held``) before it is sent; what it holds then is counted
        whatever the room, as it is in the process already."""
        self.held_bytes += change

    def answer_fits(self, size: int, behind: bool = False) -> bool:
        """Whether an answer of ``size`` bytes may go now: one up to ``ANSWER_CHECKED_BYTES`` to a client
        that took its earlier answers always may (sending it is how its memory goes soonest); a larger one,
        or any to a client ``behind`` with them, only if the worker has room for it."""
        return not (behind or size > ANSWER_CHECKED_BYTES) or not self.over_held(size)

    def answer_refusal(self, size: int, count_unread: Callable[[], None] | None = None) -> Response | None:
        """The 503 an HTTP answer of ``size`` bytes is refused with, as bodies that find no room are (counted
        ``bodies_held``), or None when it may go: answers up to ``ANSWER_CHECKED_BYTES`` always may.
        ``count_unread`` first counts again what its connection's client has not taken yet (its earlier
        answers): a client that reads nothing cannot hold more than the room through one connection."""
        if size <= ANSWER_CHECKED_BYTES:
            return None
        if count_unread is not None:
            count_unread()
        if self.answer_fits(size):
            return None
        return self.refuse_bodies_held(close=False)

    def wait_begins(self) -> bool:
        """An admitted request (holding an in-flight slot) starts waiting for a table version: its slot is
        given back and it counts as a waiter, if fewer than ``max_waiting`` wait; else nothing changes and
        False (the caller refuses it, 503). ``wait_ends`` undoes it."""
        if self.waiting >= self.max_waiting:
            self.metrics.rejected_total.labels("version_waiters").inc()
            return False
        self.waiting += 1
        self.in_flight -= 1
        return True

    def wait_ends(self) -> None:
        """The wait is over: the request holds an in-flight slot again (``finish`` gives it back). It may
        briefly make ``in_flight`` exceed the limit: the request was admitted before its wait."""
        self.waiting -= 1
        self.in_flight += 1

    def release(self, slot: bool, size: int) -> None:
        """Give back an in-flight slot (if ``slot``) and ``size`` bytes of body held."""
        if slot:
            self.in_flight -= 1
        self.held_bytes -= size

    # -- refusals: counted, with the one error body -------------------------------------------------------

    def too_large(self, setting: str, max_bytes: int) -> Response:
        return error_response(
            413, f"request body is over the limit {setting}={max_bytes}", "PayloadTooLargeError"
        )

    def refuse_bodies_held(self, *, close: bool) -> Response:
        """503: the worker holds ``max_body_bytes_held`` of bodies; ``close``: part of the body is unread
        and will not be."""
        self.metrics.rejected_total.labels("bodies_held").inc()
        headers = {"Retry-After": str(self.limits.retry_after_s)}
        if close:
            headers["Connection"] = "close"
        return error_response(503, self.bodies_held_message(), "BusyError", headers)

    def refuse_saturated(self) -> Response:
        self.metrics.rejected_total.labels("saturated").inc()
        return error_response(
            503, self._saturated_message(), "BusyError", {"Retry-After": str(self.limits.retry_after_s)}
        )

    def refusal(self, path: str, size: int) -> RobezError | None:
        """For a request whose whole message (``size`` bytes) is in hand, as gRPC gives it: the error the
        rules refuse it with (``PayloadTooLargeError``, or ``BusyError`` counted as the stack counts its
        503s), or None when it may be admitted (``admit``). The same rules and messages as HTTP's."""
        if size > self.limits.max_body_bytes:
            return PayloadTooLargeError(
                f"request body is over the limit max_body_bytes={self.limits.max_body_bytes}"
            )
        if self.saturated(path):
            self.metrics.rejected_total.labels("saturated").inc()
            return BusyError(self._saturated_message())
        if self.over_held(size):
            self.metrics.rejected_total.labels("bodies_held").inc()
            return BusyError(self.bodies_held_message())
        return None

    def bodies_held_message(self) -> str:
        return (
            f"server busy: this worker holds {self.held_bytes} bytes of request bodies and unread answers "
            f"(max_body_bytes_held={self.limits.max_held_bytes})"
        )

    def _saturated_message(self) -> str:
        return f"server saturated: {self.in_flight} requests in flight (max_in_flight={self.max_in_flight})"

    def refuse_body_timeout(self) -> Response:
        self.metrics.rejected_total.labels("body_timeout").inc()
        return error_response(
            408,
            f"the request body did not arrive within body_timeout_s={self.limits.timeout_s:g}",
            "RequestTimeoutError",
            {"Connection": "close"},
        )

    def client_gone(self) -> None:
        """The client left before its body arrived: counted, nothing answered."""
        self.metrics.client_disconnects_total.inc()

    # -- every request -------------------------------------------------------------------------------------

    def finish(
        self,
        endpoint: str,
        scope: Scope,
        answer: AnswerStatus,
        raised: bool,
        slot: bool = False,
        size: int = 0,
    ) -> None:
        """A request is over (``raised``: by an error): give back its in-flight slot (if ``slot``) and the
        ``size`` bytes of body it held (as ``release``), then count and time it under ``endpoint`` (its
        route template), its method, table and final status."""
        if slot:
            self.in_flight -= 1
        self.held_bytes -= size
        status = answer.final(raised)
        table = table_label(scope)
        self.metrics.observe_request(
            endpoint, scope["method"], table, status, time.perf_counter() - answer.start
        )
        if answer.trace is not None:
            attributes = {"http.route": endpoint, "http.response.status_code": status, tracing.TABLE: table}
            tracing.end_request(answer.trace, f"{scope['method']} {endpoint}", attributes, status >= 500)

    async def unexpected(self, scope: Scope, receive: Receive, answer: AnswerStatus, exc: Exception) -> None:
        """What Starlette's ``ServerErrorMiddleware`` does with an error no handler took, for a request
        answered without the stack: the app's handler for ``Exception`` logs it and answers 500, unless an
        answer has started; the caller raises it on (uvicorn closes the connection)."""
        handler = getattr(scope.get("app"), "exception_handlers", {}).get(Exception)
        if handler is None:
            return
        response: Response = await handler(Request(scope), exc)
        if answer.status is None:
            await response(scope, receive, answer.send)
