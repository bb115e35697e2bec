"""Direct answers: hot-route requests that arrive whole are answered in the connection's own callback.

uvicorn gives every request an asyncio task and passes it through the app's whole middleware stack. For
the hot routes (``service/http/fastpath.py``) that machinery costs more than the work: on this project's
machine a one-id lookup's hash and gather take ~3 us, the task, FastAPI's outer layers and robez's three
limit and metrics middlewares ~25 us (docs/loadtest/). So ``protocol.RobezHttpProtocol`` asks
``DirectAnswers`` when a request's headers are in whether it may answer the request itself:

- yes when its method and path match a hot route (``FastRoutes``), its body has a ``Content-Length`` of
  at most ``MAX_DIRECT_BODY_BYTES``, it passes the worker's admission now (``Admission.admits``: body
  limit of its media type, room under ``max_in_flight`` and ``max_body_bytes_held``), and nothing about
  it needs uvicorn's proxy-header rewriting; what the admission would refuse, the stack refuses;
- the protocol then holds the request until its body is complete. If the body is not complete by the
  end of the bytes the connection just read, the request goes the usual way (a task and the whole stack,
  with its body timeout), so a stalled body never waits here.
- A complete request runs in the callback: uvicorn's own request cycle (``run_asgi``: its response
  writer, access log, keep-alive and error handling) around ``DirectAnswers.serve``, which does what the
  middleware stack does for a hot route, through the same ``Admission``: counts and times the request,
  holds its in-flight slot and body bytes, answers with the fast route's handler and the app's exception
  handlers, and answers an unexpected error 500.
- A handler that has to wait (a lookup that waits for a version, work sent to a thread, a write that
  waits for the disk) continues in a task of its own from where it stopped (``resume``), so no request
  runs twice and every path answers exactly as the stack would. Small requests on a table whose journal
  writes nothing never wait.

``ROBEZ_DIRECT_ANSWERS=false`` turns this off: every request then goes through the stack.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Generator
from typing import Any

from starlette.applications import Starlette
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from .admission import Admission, AnswerStatus
from .fastpath import FastRoute, FastRoutes, respond

logger = logging.getLogger("robez.direct")

# The lifespan state key under which the app hands its DirectAnswers to the connections.
LIFESPAN_DIRECT_KEY = "robez_direct"
# Bodies up to this size may be answered directly: a small request's, read in one go.
MAX_DIRECT_BODY_BYTES = 64 * 1024
# Headers that make uvicorn's proxy-header middleware rewrite the scope: such requests take the stack.
_PROXY_HEADERS = frozenset({b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host", b"forwarded"})


class DirectAnswers:
    """Which requests a connection may answer itself (``take``) and how (``serve``): module docstring."""

    def __init__(self, app: Starlette, routes: FastRoutes, admission: Admission) -> None:
        self.app = app
        self.routes = routes
        self.admission = admission

    def take(self, scope: Scope) -> tuple[FastRoute, str, int] | None:
        """The hot route to answer the request of ``scope`` (headers complete) with, its path parameter and
        the body's size; None: the stack answers it (and refuses it, if the admission would)."""
        matched = self.routes.match(scope)
        if matched is None:
            return None
        length = content_type = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = value
            elif name == b"content-type" and content_type is None:  # the first, as request.headers
                content_type = value
            elif name == b"transfer-encoding" or name in _PROXY_HEADERS:
                return None
        size = 0
        if length is not None:
            if not length.isdigit():
                return None
            size = int(length)
            if size > MAX_DIRECT_BODY_BYTES:
                return None
        if not self.admission.admits(scope["path"], size, content_type):
            return None
        return matched[0], matched[1], size

    async def serve(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        *,
        route: FastRoute,
        parameter: str,
        size: int,
        write: Callable[[Response], bool],
    ) -> None:
        """Answer a request ``take`` gave to ``route``, whose body (``size`` bytes) has arrived, as the
        middleware stack would, with the same ``Admission``: counted and timed, holding its body bytes and
        an in-flight slot, answered by the handler and the app's exception handlers (``fastpath.respond``),
        an unexpected error answered 500. ``write(response)`` may write a response itself, as ``send``
        would (True), or leave it to ``send``."""
        admission = self.admission
        answer = AnswerStatus(send, scope, admission)
        scope["app"] = self.app
        raised = True
        slot = admission.admit(scope["path"], size)
        try:
            response = await respond(scope, receive, route, parameter)
            if write(response):
                answer.status = response.status_code
            else:
                await response(scope, receive, answer.send)
            raised = False
        except Exception as exc:
            await admission.unexpected(scope, receive, answer, exc)
            raise
        finally:
            admission.finish(route.path, scope, answer, raised, slot, size)


class _Resume:
    """Awaits the rest of a coroutine that was started by hand and stopped at ``pending`` (what it
    yielded to the event loop): the task running this waits for ``pending`` as the coroutine would have,
    then sends the coroutine on (values and exceptions alike), until it returns."""

    def __init__(self, coroutine: Coroutine[Any, Any, Any], pending: Any) -> None:
        self.coroutine = coroutine
        self.pending = pending

    def __await__(self) -> Generator[Any, Any, Any]:
        pending = self.pending
        while True:
            try:
                value = yield pending
            except BaseException as exc:  # thrown into the task (cancellation): the coroutine's to handle
                try:
                    pending = self.coroutine.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    pending = self.coroutine.send(value)
                except StopIteration as stop:
                    return stop.value


async def resume(coroutine: Coroutine[Any, Any, Any], pending: Any) -> Any:
    """The coroutine that finishes ``coroutine`` (started by hand, stopped at ``pending``) in a task."""
    return await _Resume(coroutine, pending)
