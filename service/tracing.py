"""OpenTelemetry traces, off unless configured the standard way (``OTEL_*``; docs/observability.md).

``configure(settings)`` runs in every worker at start-up. Tracing is on when ``OTEL_TRACES_EXPORTER`` is
``otlp`` or ``console``, or an OTLP endpoint (``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``) is set, and
``OTEL_SDK_DISABLED`` is not true: then the SDK and its OTLP/HTTP exporter are imported and ``TRACER`` is
set. Otherwise nothing of OpenTelemetry is imported and ``TRACER`` stays None: the request paths test that
one module global (``if tracing.TRACER is not None``) and pay nothing else.

The exporter reads the rest of its configuration itself (endpoint, headers, batch delays, sampler,
``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``); the service name defaults to ``robez``.

A collector that is down or silent never holds the server: one export waits at most
``trace_export_timeout_s`` (2 s; the SDK's default is 10 s, retried, and its flush at shutdown waited up
to 30 s: a stop took 31 s, issue 40.5), the flush at a stop is bounded the same way, and spans that
cannot be sent are dropped, said once in the log (``_DroppingExporter``) and again when exports work.

Spans (every helper below is called only while ``TRACER`` is set):

- one per request (``start_request`` / ``end_request``): HTTP requests in the admission routine (the
  middleware stack and direct answers alike), gRPC calls in the servicer; its parent is the W3C
  ``traceparent`` of the request's headers or metadata;
- its children: ``hash`` and ``gather`` of a lookup, ``hash`` / ``log-append`` / ``apply`` of an update
  (``TableStore``), ``publish`` of a replicated update (``Replica.update``), each with the table, the
  ids count and the version; the stages' own timers give their times (``stage``), so the kernels are
  not timed twice;
- in replicated mode the trace context travels in the log entry's headers (``inject``, then
  ``records.encode_update``) and every replica's applier makes its ``apply`` a span of that trace
  (``from_headers``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from robez_core.errors import ConfigError

from .config import Settings
from .logfilters import limit_logs

logger = logging.getLogger("robez.tracing")

# The tracer when tracing is configured in this process, else None (the hot paths test this).
TRACER: Any = None
_provider: Any = None
_propagator: Any = None
_context_api: Any = None  # opentelemetry.context, imported by configure
_trace_api: Any = None  # opentelemetry.trace

_flush_timeout_s = 3.0  # set by configure: trace_export_timeout_s + 1 s
# Where the OTLP exporter and the SDK's batch processor log failed exports and full queues.
_EXPORT_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.sdk._shared_internal",
)

TRACEPARENT, TRACESTATE = "traceparent", "tracestate"
_TRACE_HEADERS = (TRACEPARENT.encode(), TRACESTATE.encode())
TABLE, IDS, VERSION = "robez.table", "robez.ids", "robez.version"
EXPORTERS = ("otlp", "console")


def enabled_by(settings: Settings) -> bool:
    """Whether ``settings`` (the ``OTEL_*`` they read) ask for traces."""
    if settings.otel_sdk_disabled:
        return False
    exporter = (settings.otel_traces_exporter or "").strip().lower()
    if exporter == "none":
        return False
    return bool(exporter) or bool(settings.otel_exporter_otlp_endpoint)


def configure(settings: Settings) -> None:
    """Set up this process's tracer if ``settings`` ask for one (module docstring); else do nothing.
    Raises ``ConfigError`` for an exporter robez does not ship."""
    global TRACER, _provider, _propagator, _context_api, _trace_api
    if not enabled_by(settings) or TRACER is not None:
        return
    exporter_name = (settings.otel_traces_exporter or "otlp").strip().lower()
    if exporter_name not in EXPORTERS:
        raise ConfigError(
            f"OTEL_TRACES_EXPORTER={settings.otel_traces_exporter!r}: robez exports traces with "
            f"{' or '.join(EXPORTERS)} (OTLP over HTTP/protobuf), or none"
        )
    from opentelemetry import context as context_api
    from opentelemetry import trace as trace_api
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    exporter: Any  # a SpanExporter
    if exporter_name == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = _DroppingExporter(OTLPSpanExporter(timeout=settings.trace_export_timeout_s))
        # The exporter's own lines (one per failed batch and retry while the collector is down): the
        # first of each kind, then one per 10 min; _DroppingExporter says what it means once.
        limit_logs(_EXPORT_LOGGERS, every_s=600.0)
    else:
        exporter = ConsoleSpanExporter()
    global _flush_timeout_s
    _flush_timeout_s = settings.trace_export_timeout_s + 1.0
    # Resource.create reads OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES; without a name there, "robez".
    resource = Resource.create()
    if str(resource.attributes.get("service.name", "unknown_service")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "robez"}))
    _provider = TracerProvider(resource=resource)
    _provider.add_span_processor(BatchSpanProcessor(exporter))
    _propagator = TraceContextTextMapPropagator()
    _context_api, _trace_api = context_api, trace_api
    TRACER = _provider.get_tracer("robez")
    logger.info("tracing on: %s exporter", exporter_name)


def shutdown() -> None:
    """Export what is pending and stop tracing in this process (a worker's shutdown), waiting at most
    ``trace_export_timeout_s`` + 1 s: spans a silent collector has not taken by then are dropped."""
    global TRACER, _provider
    provider, _provider, TRACER = _provider, None, None
    if provider is None:
        return
    # The SDK's shutdown joins its export thread for up to 30 s; on a daemon thread it cannot hold the
    # process past the bound.
    flush = threading.Thread(target=provider.shutdown, name="robez-trace-flush", daemon=True)
    flush.start()
    flush.join(_flush_timeout_s)
    if flush.is_alive():
        logger.warning(
            "traces: the OTLP collector took no spans within %g s of the stop; dropping the rest",
            _flush_timeout_s,
        )


class _DroppingExporter:
    """An exporter's wrapper (``SpanExporter``'s methods) that says once that spans are being dropped
    when exports fail (collector down, silent or refusing), and once when they work again."""

    def __init__(self, exporter: Any) -> None:
        self.exporter = exporter
        self._dropped = 0
        self._lock = threading.Lock()

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        result = self.exporter.export(spans)
        with self._lock:
            if result is not SpanExportResult.SUCCESS:
                if self._dropped == 0:
                    logger.warning(
                        "traces: the OTLP collector did not take %d span(s); dropping spans until it "
                        "does (each export waits at most the trace export timeout)",
                        len(spans),
                    )
                self._dropped += len(spans)
            elif self._dropped:
                logger.warning("traces: the OTLP collector takes spans again; %d were dropped", self._dropped)
                self._dropped = 0
        return result

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return bool(self.exporter.force_flush(timeout_millis))


def _context(carrier: Mapping[str, str]) -> Any:
    return _propagator.extract(carrier) if carrier else None


def carrier_of(headers: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """The W3C trace headers among an ASGI request's raw headers."""
    return {name.decode(): value.decode("latin-1") for name, value in headers if name in _TRACE_HEADERS}


def start_request(name: str, carrier: Mapping[str, str], attributes: Mapping[str, Any]) -> tuple[Any, Any]:
    """Start a request's span (a child of ``carrier``'s ``traceparent``, if any) and make it current;
    returns (span, token) for ``end_request``."""
    server = _trace_api.SpanKind.SERVER
    span = TRACER.start_span(name, context=_context(carrier), kind=server, attributes=attributes)
    return span, _context_api.attach(_trace_api.set_span_in_context(span))


def end_request(
    handle: tuple[Any, Any], name: str | None, attributes: Mapping[str, Any], error: bool
) -> None:
    """End a request's span (renamed to ``name`` once the route is known) with its final attributes."""
    span, token = handle
    _context_api.detach(token)
    if name is not None:
        span.update_name(name)
    span.set_attributes({key: value for key, value in attributes.items() if value not in (None, "")})
    if error:
        span.set_status(_trace_api.Status(_trace_api.StatusCode.ERROR))
    span.end()


def stage(name: str, table: str, ids: int, version: int, seconds: float, ended_ns: int | None = None) -> int:
    """Record a finished stage of ``seconds`` ending at ``ended_ns`` (default: now) as a child span of the
    current one; returns its start (ns), where the stage before it ended."""
    end = time.time_ns() if ended_ns is None else ended_ns
    start = end - int(seconds * 1e9)
    if not _trace_api.get_current_span().is_recording():  # the request was not sampled: nor are its stages
        return start
    span = TRACER.start_span(name, start_time=start, attributes={TABLE: table, IDS: ids, VERSION: version})
    span.end(end_time=end)
    return start


def span(name: str, table: str, ids: int, version: int | None = None, parent: Any = None) -> Any:
    """A child span of the current one (or of ``parent``, a context) as a context manager; set the
    version on it later when it is known only at the end."""
    if parent is None and not (current := _trace_api.get_current_span()).is_recording():
        return contextlib.nullcontext(current)  # an unsampled request: its stages are not recorded either
    attributes: dict[str, Any] = {TABLE: table, IDS: ids}
    if version is not None:
        attributes[VERSION] = version
    return TRACER.start_as_current_span(name, context=parent, attributes=attributes)


def inject() -> dict[str, str]:
    """The current trace context as W3C headers (for a log entry's headers)."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier


def from_headers(headers: Mapping[str, str]) -> Any:
    """The trace context a log entry's headers carry (None: a root span)."""
    return _context({key: value for key, value in headers.items() if key in (TRACEPARENT, TRACESTATE)})
