"""Log lines that a client can cause are rate-limited, and the client text in them is cut short.

Some log lines are written for what an unauthenticated client sends: an over-long ``traceparent`` (one
WARNING from OpenTelemetry's propagator per request with tracing on: 1,000 ``/healthz`` calls wrote
1,000 lines in 1.8 s, issue 40.7), a malformed HTTP request (uvicorn), a request refused with a 5xx
(robez's error handlers). ``ClientInputLogLimit`` lets through the first line of each kind (logger and
message template) and then one per ``every_s`` seconds, saying how many like it were dropped in between;
string arguments over ``max_chars`` are cut there, so a line never echoes an unbounded header or path.

``limit_client_input_logs()`` installs it, once per process, on the loggers listed in
``CLIENT_INPUT_LOGGERS``; a new place that logs client input logs through one of them or is added there.
"""

from __future__ import annotations

import logging
import threading
import time

# Loggers whose lines a client's input can cause, one line per request.
CLIENT_INPUT_LOGGERS = (
    "opentelemetry.trace.propagation.tracecontext",  # traceparent / tracestate too long
    "opentelemetry.trace.span",  # tracestate: invalid or duplicate keys (echoes them)
    "uvicorn.error",  # "Invalid HTTP request received.", unsupported upgrades
    "robez.errors",  # 5xx answers (503 busy, ...) with the request's path
    "robez.grpc",  # the same for gRPC calls
)
EVERY_S = 10.0
MAX_CHARS = 200


def clip(value: object, max_chars: int = MAX_CHARS) -> object:
    """``value`` itself, or a string or bytes over ``max_chars`` cut there, its length said: for client
    text in a log line or an error message."""
    if isinstance(value, str | bytes) and len(value) > max_chars:
        return f"{value[:max_chars]!s}... ({len(value)} chars)"
    return value


class ClientInputLogLimit(logging.Filter):
    """A ``logging.Filter``: of the records with one (logger, template), the first passes, then at most
    one per ``every_s`` seconds, with the count dropped since appended (a record with a traceback always
    passes); string arguments longer than ``max_chars`` are cut (the record's message is formatted
    here, its ``args`` emptied)."""

    def __init__(self, every_s: float = EVERY_S, max_chars: int = MAX_CHARS) -> None:
        super().__init__()
        self.every_s = every_s
        self.max_chars = max_chars
        self._lock = threading.Lock()
        self._kinds: dict[tuple[str, str], tuple[float, int]] = {}  # -> (last passed, dropped since)

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.name, str(record.msg))
        now = time.monotonic()
        dropped, last = 0, now
        # A line with a traceback is a bug (an unexpected error), never dropped; its text is still cut.
        if record.exc_info is None:
            with self._lock:
                last, dropped = self._kinds.get(kind, (-float("inf"), 0))
                if now - last < self.every_s:
                    self._kinds[kind] = (last, dropped + 1)
                    return False
                if len(self._kinds) > 1000:  # templates are few; this only bounds a pathological caller
                    self._kinds.clear()
                self._kinds[kind] = (now, 0)
        args = record.args
        if isinstance(args, tuple):
            record.args = tuple(clip(arg, self.max_chars) for arg in args)
        message = record.getMessage()
        if len(message) > 4 * self.max_chars:
            message = f"{message[: 4 * self.max_chars]}... ({len(message)} chars)"
        if dropped:
            message += f" ({dropped} more like it dropped in the last {now - last:.0f} s)"
        record.msg, record.args = message, None
        return True


_install_lock = threading.Lock()


def limit_logs(names: tuple[str, ...], every_s: float = EVERY_S) -> None:
    """Install a ``ClientInputLogLimit`` (one line of a kind per ``every_s``) on each logger of
    ``names`` that has none yet."""
    with _install_lock:
        for name in names:
            named = logging.getLogger(name)
            if not any(isinstance(existing, ClientInputLogLimit) for existing in named.filters):
                named.addFilter(ClientInputLogLimit(every_s=every_s))


def limit_client_input_logs() -> None:
    """Install ``ClientInputLogLimit`` on every logger of ``CLIENT_INPUT_LOGGERS`` (once per process)."""
    limit_logs(CLIENT_INPUT_LOGGERS)


# asyncio's TLS transport warns whenever a StreamReaderProtocol (nats-py's connection) is told of the
# peer's close: the warning is about asyncio's own protocol plumbing, says nothing an operator can act on,
# and came once per replica at every stop of a TLS cluster (make cluster's Ctrl-C).
_TLS_EOF_NOTICE = "returning true from eof_received() has no effect when using ssl"


class _DropTlsEofNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != _TLS_EOF_NOTICE


def drop_tls_eof_notice() -> None:
    """Leave out asyncio's "returning true from eof_received() ..." warning (once per process)."""
    with _install_lock:
        named = logging.getLogger("asyncio")
        if not any(isinstance(existing, _DropTlsEofNotice) for existing in named.filters):
            named.addFilter(_DropTlsEofNotice())
