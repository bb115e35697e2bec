"""The hot routes' short way in: lookups, updates, inference and probes skip FastAPI's request machinery.

FastAPI's router, dependency solving and response serialisation cost about 70 us of CPU per request on
this project's machine, more than the whole work of a one-id lookup (see docs/loadtest/). The routes
that small online requests hit are therefore also registered here, as plain ASGI handlers over the same
code as their FastAPI endpoints (each route module's ``fast_routes``):

- ``FastPathMiddleware`` sits innermost among the app's middlewares, so metrics, the in-flight limit and
  the body size limit see these requests exactly as any other. Small ones that arrive whole are
  answered before the stack, by the connection itself (``service/http/direct.py``), with the same
  ``FastRoutes`` and ``serve``.
- A request is taken here only when its method and path match a hot route exactly (and, for routes
  with query parameters, it has no query string); anything else (405s, trailing slashes, query
  parameters to validate) goes on to FastAPI, which answers as before.
- The FastAPI routes stay registered: the OpenAPI document is built from them, and they answer every
  request this layer passes on.
- Errors raised by a handler are answered by the app's own exception handlers (``errors.py``), as
  FastAPI's ``ExceptionMiddleware`` would; unexpected ones go on up to ``ServerErrorMiddleware``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send

# handler(request, path parameter or None) -> the response
FastHandler = Callable[[Request, str], Awaitable[Response]]


@dataclass(frozen=True)
class FastRoute:
    """A route template with at most one path parameter ``{...}`` (one segment), its method, its handler
    and the app's own route of that template (set as ``scope["route"]``: metrics label requests by its
    ``path``). ``query`` False: requests with a query string go to FastAPI (which validates them)."""

    method: str
    path: str
    handler: FastHandler
    route: BaseRoute
    query: bool = True

    @classmethod
    def of(
        cls, router: APIRouter, method: str, path: str, handler: FastHandler, query: bool = True
    ) -> FastRoute:
        """The fast route for ``router``'s route ``method path`` (which must exist)."""
        for route in router.routes:
            if getattr(route, "path", None) == path and method in (getattr(route, "methods", None) or ()):
                return cls(method, path, handler, route, query)
        raise LookupError(f"{method} {path} is not a route of this router")

    @property
    def prefix(self) -> str:
        return self.path.split("{", 1)[0]

    @property
    def suffix(self) -> str:
        return self.path.rsplit("}", 1)[1] if "}" in self.path else ""


class FastRoutes:
    """Matches requests to the hot routes (method and path exactly; a query string only where allowed)."""

    def __init__(self, routes: Sequence[FastRoute]) -> None:
        self._exact: dict[tuple[str, str], FastRoute] = {}
        self._templated: list[FastRoute] = []
        for route in routes:
            if "{" in route.path:
                self._templated.append(route)
            else:
                self._exact[(route.method, route.path)] = route

    def match(self, scope: Scope) -> tuple[FastRoute, str] | None:
        """The route of an HTTP ``scope`` and its path parameter (or ""), or None: FastAPI answers it."""
        if scope.get("root_path"):
            return None
        method: str = scope["method"]
        path: str = scope["path"]
        matched = self._match(method, path)
        if matched is None or (scope["query_string"] and not matched[0].query):
            return None
        return matched

    def _match(self, method: str, path: str) -> tuple[FastRoute, str] | None:
        route = self._exact.get((method, path))
        if route is not None:
            return route, ""
        for route in self._templated:
            if route.method != method:
                continue
            prefix, suffix = route.prefix, route.suffix
            if len(path) > len(prefix) + len(suffix) and path.startswith(prefix) and path.endswith(suffix):
                parameter = path[len(prefix) : len(path) - len(suffix)]
                if "/" not in parameter:
                    return route, parameter
        return None


class FastPathMiddleware:
    """Answers requests to ``routes`` directly; passes everything else to ``app`` (pure ASGI)."""

    def __init__(self, app: ASGIApp, routes: FastRoutes) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        matched = self.routes.match(scope) if scope["type"] == "http" else None
        if matched is None:
            await self.app(scope, receive, send)
            return
        await serve(scope, receive, send, *matched)


async def serve(scope: Scope, receive: Receive, send: Send, route: FastRoute, parameter: str) -> None:
    """Answer a request ``FastRoutes.match`` gave to ``route``."""
    response = await respond(scope, receive, route, parameter)
    await response(scope, receive, send)


async def respond(scope: Scope, receive: Receive, route: FastRoute, parameter: str) -> Response:
    """The response to a request ``FastRoutes.match`` gave to ``route`` (here and in ``direct.py``): its
    handler's, or the app's exception handlers' for what the handler raised."""
    scope["route"] = route.route
    request = Request(scope, receive)
    try:
        return await route.handler(request, parameter)
    except Exception as exc:
        return await handled(request, exc)


async def handled(request: Request, exc: Exception) -> Response:
    """The response the app's exception handlers give ``exc``; re-raises what only ServerErrorMiddleware
    handles (as Starlette's ExceptionMiddleware does)."""
    handlers = request.app.exception_handlers
    for cls in type(exc).__mro__:
        if cls is Exception:
            break
        handler = handlers.get(cls)
        if handler is not None:
            response: Response = await handler(request, exc)
            return response
    raise exc
