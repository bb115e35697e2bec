"""The one change robez makes to nats-py: a TLS close that a hung server never completes is aborted.

Why: closing a TLS connection waits for the peer's ``close_notify``. From a hung (SIGSTOPped, frozen VM)
NATS server that takes the event loop's SSL shutdown timeout, 30 s, and nats-py waits for that close
before it reconnects to another node (a plain TCP connection closes at once). A replica whose node hangs
would then answer no push for 30 s instead of moving on within its ping timeout (docs/replication.md,
"What a failure costs"; ``test_writes_get_past_a_hung_nats_node_and_readyz_tells_a_lost_quorum``).

nats-py offers no option for it, so ``bound_tls_close`` replaces its private ``TcpTransport.wait_closed``
for the whole process. That reaches into nats-py's internals (``_io_writer``, ``_bare_io_writer``), so it
is applied only to the nats-py versions it was read against (``TESTED``, the range pyproject.toml allows)
and otherwise refuses with an error naming the version: a new nats-py is checked, then the range widened.
"""

from __future__ import annotations

import asyncio
from importlib.metadata import PackageNotFoundError, version

# nats-py releases whose TcpTransport.wait_closed / _io_writer / _bare_io_writer this patch was read
# against (the source of 2.9.0 through 2.16.x); the same bounds as pyproject.toml's nats-py requirement.
TESTED = ((2, 9), (2, 17))  # from, up to (exclusive)
# How long a close may wait for the peer before its sockets are aborted (seconds).
TLS_CLOSE_WAIT_S = 0.25


class UnsupportedNatsPy(RuntimeError):
    """The installed nats-py is outside the versions ``bound_tls_close`` was checked against."""


def nats_py_version() -> str:
    """The installed nats-py's version string, ``"unknown"`` if its metadata cannot be read."""
    try:
        return version("nats-py")
    except PackageNotFoundError:
        return "unknown"


def _release(text: str) -> tuple[int, int] | None:
    parts = text.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def check_nats_py(installed: str | None = None) -> None:
    """Raise ``UnsupportedNatsPy`` naming ``installed`` (default: the installed nats-py) unless it is in
    ``TESTED`` and its ``TcpTransport`` still has the private attributes the patch reads."""
    installed = nats_py_version() if installed is None else installed
    release = _release(installed)
    low, high = TESTED
    if release is None or not low <= release < high:
        raise UnsupportedNatsPy(
            f"nats-py {installed} is not one robez was tested with (>= {low[0]}.{low[1]}, < {high[0]}."
            f"{high[1]}): robez patches its private TcpTransport.wait_closed (service/replication/"
            "natspatch.py); install a nats-py in that range"
        )
    from nats.aio.transport import TcpTransport

    transport = TcpTransport()
    missing = [name for name in ("_io_writer", "_bare_io_writer") if not hasattr(transport, name)]
    if missing or not asyncio.iscoroutinefunction(TcpTransport.wait_closed):
        raise UnsupportedNatsPy(
            f"nats-py {installed}: TcpTransport no longer has {missing or 'an async wait_closed'}, which "
            "robez's patch (service/replication/natspatch.py) relies on"
        )


def bound_tls_close() -> None:
    """Make nats-py's TCP transport abort a close that a hung peer does not complete within
    ``TLS_CLOSE_WAIT_S`` (process-wide, idempotent). Raises ``UnsupportedNatsPy`` on an unknown nats-py."""
    from nats.aio.transport import TcpTransport

    if getattr(TcpTransport.wait_closed, "_robez_bounded", False):
        return
    check_nats_py()

    async def wait_closed(self: TcpTransport) -> None:
        writer = self._io_writer
        if writer is None:
            return
        try:
            await asyncio.wait_for(writer.wait_closed(), TLS_CLOSE_WAIT_S)
        except TimeoutError:
            writer.transport.abort()
            if self._bare_io_writer is not None:
                self._bare_io_writer.transport.abort()

    wait_closed._robez_bounded = True  # type: ignore[attr-defined]
    TcpTransport.wait_closed = wait_closed  # type: ignore[method-assign]
