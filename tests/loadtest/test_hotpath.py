"""``python -m loadtest.hotpath``: every scenario answers 200 through uvicorn's protocol over the
in-memory transport, and the report reads its ratios against the floor measured in the same run."""

from __future__ import annotations

import argparse

from loadtest.hotpath import HotpathResult, measure, render, run_event_loop, scenario_requests


def test_every_scenario_is_served_and_timed() -> None:
    results = run_event_loop(measure(rounds=1, requests=20, profile=True))
    assert [r.scenario for r in results] == list(scenario_requests())
    for result in results:
        assert result.status_line == "HTTP/1.1 200 OK", result
        assert result.us_per_request > 0
        assert bool(result.profile) == (result.scenario != "floor")


def test_report_reads_ratios_against_the_floor() -> None:
    def result(name: str, us: float) -> HotpathResult:
        return HotpathResult(name, us, us, us, "HTTP/1.1 200 OK", "")

    args = argparse.Namespace(rounds=1, requests=1, profile=False)
    results = [result("floor", 20.0), result("healthz", 21.0), result("binary1", 50.0)]
    text = render(results, args, "1.00, 1.00, 1.00", "1.00, 1.00, 1.00")
    assert (
        "| healthz | 21.0 | 21.0 / 21.0 | 0.95 | >= 0.90 (/healthz) | within the goal here (0.95) |" in text
    )
    # 0.6 of a 20 us floor allows 33.3 us: 16.7 over
    assert "| binary1 | 50.0 | 50.0 / 50.0 | 0.40 |" in text and "16.7 us over the 33.3 us" in text
