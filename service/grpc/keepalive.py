"""Keepalive for the frames engine, as grpcio's server does it by default (its channel arguments in brackets):

- the server's own PINGs: a connection from which nothing came for ``time_s`` (GRPC_ARG_KEEPALIVE_TIME_MS,
  2 hours) is sent a PING, if it has calls open or ``permit_without_calls``
  (GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, off); nothing back within ``timeout_s``
  (GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20 s): the peer is taken for dead and the connection closed;
- the client's PINGs, policed (``PingPolicy``): a PING sooner than ``min_ping_interval_s``
  (GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 5 minutes) after the last one, with no HEADERS,
  DATA or WINDOW_UPDATE sent by the server in between, is a strike (with no call open and without
  ``permit_without_calls`` the interval is 2 hours, as TCP keepalive's); past ``max_ping_strikes``
  (GRPC_ARG_HTTP2_MAX_PING_STRIKES, 2; 0: no limit) the connection is sent GOAWAY ENHANCE_YOUR_CALM with
  the debug data ``too_many_pings`` (what grpc clients recognise: they double their keepalive time) and
  closed. Every PING is answered with its ACK until then.

The same settings configure grpcio's engine (``server.py``), so both engines keep one policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

IDLE_PING_INTERVAL_S = (
    7200.0  # a connection without calls: one PING per two hours, as TCP keepalive (RFC 1122)
)
TOO_MANY_PINGS = b"too_many_pings"


@dataclass(frozen=True)
class Keepalive:
    """The engine's keepalive settings (module docstring); the defaults are grpcio's."""

    time_s: float = 7200.0
    timeout_s: float = 20.0
    permit_without_calls: bool = False
    min_ping_interval_s: float = 300.0
    max_ping_strikes: int = 2


class PingPolicy:
    """grpc's server-side policing of the client's PINGs, for one connection."""

    __slots__ = ("keepalive", "last", "strikes")

    def __init__(self, keepalive: Keepalive) -> None:
        self.keepalive = keepalive
        self.last = -math.inf  # when the last PING came (monotonic seconds)
        self.strikes = 0

    def received(self, now: float, calls_open: bool) -> bool:
        """A PING came at ``now``; whether the peer is now over its strikes (GOAWAY ENHANCE_YOUR_CALM)."""
        keepalive = self.keepalive
        idle = not calls_open and not keepalive.permit_without_calls
        interval = IDLE_PING_INTERVAL_S if idle else keepalive.min_ping_interval_s
        allowed, self.last = self.last + interval, now
        if allowed <= now:
            return False
        self.strikes += 1
        return keepalive.max_ping_strikes != 0 and self.strikes > keepalive.max_ping_strikes

    def reset(self) -> None:
        """The server sent HEADERS, DATA or a WINDOW_UPDATE: the next PING is welcome whenever it comes."""
        self.last = -math.inf
        self.strikes = 0
