"""Connection limits uvicorn lacks, as its HTTP protocol (httptools) with two additions:

- a connection must send a request's headers within ``header_timeout_s`` of opening, or of the end of
  its previous response, else it is closed. uvicorn arms its keep-alive timer only after a response and
  drops it at the first byte, so a connection that sends nothing (or trickles headers) stays forever;
- at most ``max_connections`` connections per worker: one more is closed as soon as it is accepted, so
  idle or slow clients cannot take every file descriptor of the process.

A stalled request *body* is the business of ``limits.RequestBodyMiddleware`` (``body_timeout_s``); an
idle keep-alive connection's is uvicorn's ``timeout_keep_alive``. ``uvicorn_options(settings)`` gives
``uvicorn.run`` all three.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from .config import Settings

# The key under which the app's lifespan state hands its ``Metrics`` to the connections.
LIFESPAN_METRICS_KEY = "robez_metrics"


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float
    max_connections: int


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
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._count_closed("max_connections")
            transport.close()
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def on_headers_complete(self) -> None:
        self._cancel_header_timer()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # uvicorn armed its keep-alive timer: the connection now waits for its next request's headers.
        # (It did not when a pipelined request is already under way, or when the connection is closing.)
        if self.timeout_keep_alive_task is not None:
            self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self._count_closed("header_timeout")
            self.transport.close()

    def _count_closed(self, reason: str) -> None:
        metrics = self.app_state.get(LIFESPAN_METRICS_KEY)
        if metrics is not None:
            metrics.connections_closed_total.labels(reason).inc()


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """``uvicorn.run`` keyword arguments for the connection limits of ``settings``. The protocol is a
    ``functools.partial`` of a module-level class, so it pickles into spawned workers."""
    limits = ConnectionLimits(settings.header_timeout_s, settings.max_connections)
    return {
        "http": functools.partial(RobezHttpProtocol, limits=limits),
        "timeout_keep_alive": settings.keep_alive_timeout_s,
    }
