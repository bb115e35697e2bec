"""The one admission (service/http/admission.py): its rules, and what an admitted request holds."""

from __future__ import annotations

from service.http.admission import Admission, BodyLimits
from service.metrics import Metrics

OCTET = b"application/octet-stream"
LOOKUP = "/v1/tables/demo/lookup"


def _admission(max_in_flight: int = 2, held: int = 100) -> Admission:
    limits = BodyLimits(max_body_bytes=64, max_json_body_bytes=16, timeout_s=30.0, max_held_bytes=held)
    return Admission(limits, max_in_flight, Metrics())


def test_admits_what_passes_every_rule() -> None:
    admission = _admission()
    assert admission.admits(LOOKUP, 64, OCTET) and not admission.admits(LOOKUP, 65, OCTET)
    assert admission.admits(LOOKUP, 16, b"application/json") and not admission.admits(LOOKUP, 17, None)
    assert admission.body_limit(b"application/json; charset=utf-8") == (16, "max_json_body_bytes")
    admission.held_bytes = 90
    assert admission.admits(LOOKUP, 10, OCTET) and not admission.admits(LOOKUP, 11, OCTET)
    admission.held_bytes = 0
    admission.in_flight = 2
    assert admission.saturated(LOOKUP) and not admission.admits(LOOKUP, 0, None)
    assert not admission.saturated("/healthz") and admission.admits("/healthz", 0, None)


def test_admit_and_release_give_back_what_they_took() -> None:
    admission = _admission(max_in_flight=1)
    slot = admission.admit(LOOKUP, 40)
    assert slot and admission.in_flight == 1 and admission.held_bytes == 40
    probe = admission.admit("/metrics", 0)  # probes and scrapes take no slot
    assert not probe and admission.in_flight == 1
    assert admission.hold(60) and not admission.hold(1)  # 100 held: the budget
    admission.release(probe, 0)
    admission.release(slot, 40)
    admission.release(False, 60)
    assert admission.in_flight == 0 and admission.held_bytes == 0


def test_refusals_are_counted_with_the_one_error_body() -> None:
    admission = _admission(max_in_flight=1)
    admission.in_flight = 1
    saturated = admission.refuse_saturated()
    assert saturated.status_code == 503 and saturated.headers["retry-after"] == "1"
    assert b"max_in_flight=1" in saturated.body and b'"error_type":"BusyError"' in saturated.body
    held = admission.refuse_bodies_held(close=True)
    assert held.status_code == 503 and held.headers["connection"] == "close"
    assert admission.too_large("max_body_bytes", 64).status_code == 413
    assert admission.refuse_body_timeout().status_code == 408
    counts = {
        sample.labels["reason"]: sample.value
        for metric in admission.metrics.rejected_total.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    }
    assert counts == {"saturated": 1.0, "bodies_held": 1.0, "body_timeout": 1.0}


def test_admits_is_the_rules_written_out() -> None:
    """``admits`` writes the three rules out for speed: it must agree with them everywhere."""
    admission = _admission(max_in_flight=2, held=100)

    def rules(path: str, size: int, content_type: bytes | None) -> bool:
        if admission.saturated(path):
            return False
        return size == 0 or (size <= admission.body_limit(content_type)[0] and not admission.over_held(size))

    for path in (LOOKUP, "/healthz"):
        for in_flight in (0, 1, 2, 3):
            for held in (0, 50, 100):
                for size in (0, 1, 16, 17, 50, 51, 64, 65):
                    for content_type in (None, b"", OCTET, b"application/json", b"text/plain"):
                        admission.in_flight, admission.held_bytes = in_flight, held
                        assert admission.admits(path, size, content_type) == rules(path, size, content_type)
