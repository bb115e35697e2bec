"""Log lines a client's input causes are rate-limited and cut short (``service/logfilters.py``): an over-long
``traceparent`` wrote one WARNING per request with tracing on (1,000 unauthenticated ``/healthz`` calls,
1,000 lines; issue 40.7)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service import logfilters
from service.app import create_app
from service.logfilters import ClientInputLogLimit

from .conftest import make_settings


def test_an_over_long_traceparent_logs_once_however_many_requests_carry_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(make_settings(tmp_path, otel_traces_exporter="console"))
    header = "00-" + "a" * 600
    with caplog.at_level(logging.WARNING), TestClient(app) as client:
        for _ in range(200):
            assert client.get("/healthz", headers={"traceparent": header}).status_code == 200
    lines = [r for r in caplog.records if r.name == "opentelemetry.trace.propagation.tracecontext"]
    assert len(lines) == 1, [r.getMessage() for r in lines[:5]]
    assert "traceparent header exceeded the maximum length" in lines[0].getMessage()


def test_the_limit_passes_one_line_per_interval_counting_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(logfilters.time, "monotonic", lambda: clock[0])
    limit = ClientInputLogLimit(every_s=10.0, max_chars=20)
    logger = logging.getLogger("tests.client_input")

    def record(path: str, template: str = "refused %s") -> logging.LogRecord:
        return logger.makeRecord(logger.name, logging.WARNING, __file__, 1, template, (path,), None)

    first = record("/short")
    assert limit.filter(first) and first.getMessage() == "refused /short"
    assert not any(limit.filter(record("/again")) for _ in range(7))
    assert limit.filter(record("/other", template="another kind %s"))  # its own budget
    try:
        raise RuntimeError("a bug")
    except RuntimeError:
        bug = logger.makeRecord(
            logger.name, logging.ERROR, __file__, 1, "refused %s", ("/bug",), sys.exc_info()
        )
    assert limit.filter(bug)  # a traceback is never dropped
    clock[0] += 10.0
    later = record("/p" + "x" * 5000)
    assert limit.filter(later)
    assert (
        later.getMessage()
        == "refused /pxxxxxxxxxxxxxxxxxx... (5002 chars) (7 more like it dropped in the last 10 s)"
    )
