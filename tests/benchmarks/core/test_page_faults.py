"""The page-fault benchmark: a worker's measurements, and the report's reading of them."""

from __future__ import annotations

import datetime as dt

from benchmarks.core import page_faults
from benchmarks.core.page_faults import Cell, FaultResult


def _cell(median_ms: float, faults: int) -> Cell:
    return Cell([median_ms], [median_ms / 1e3] * 10, [faults] * 10)


def _result() -> FaultResult:
    cells = {
        ("host", "default", "step"): _cell(10.0, 2000),
        ("host", "tuned", "step"): _cell(8.0, 100),
        ("host", "default", "lookup"): _cell(1.0, 0),
        ("host", "tuned", "lookup"): _cell(1.2, 0),
        ("host", "default", "share"): _cell(5.0, 50),
        ("host", "tuned", "share"): _cell(5.05, 0),
    }
    workers: dict[tuple[str, str], dict[str, object]] = {
        ("host", allocator): {"kernel target": "x", "torch": "y", "max_rss_mib": 100.0}
        for allocator in page_faults.ALLOCATORS
    }
    now = dt.datetime.now(dt.UTC)
    return FaultResult(
        now, "python -m benchmarks.core.page_faults", 1, cells, workers, 1.0, (0, 0, 0), (0, 0, 0)
    )


def test_reading_sorts_calls_by_what_the_tuning_can_do():
    paid, unpaid, quiet = page_faults.reading(_result())
    assert "host, step: 2000 -> 100 faults per call, median 10.00 -> 8.00 ms (-20%)" in paid
    assert "host, share" in unpaid and "step" not in unpaid
    assert "host: lookup" in quiet and "step" not in quiet


def test_report_gives_every_cell_and_a_verdict():
    text = page_faults.render_markdown(_result())
    assert "| step | 10.000 | 8.000 |" in text and "tuned faster by 20%" in text
    assert "no faults to remove (+20%: noise)" in text
    assert "| malloc |" in text


def test_worker_measures_time_and_faults_of_every_scenario():
    data = page_faults.run_worker("default", calls=4)
    scenarios = data["scenarios"]
    assert isinstance(scenarios, dict) and len(scenarios) == 5
    for values in scenarios.values():
        assert len(values["seconds"]) >= 4 and len(values["faults"]) == len(values["seconds"])
        assert all(s > 0 for s in values["seconds"]) and all(f >= 0 for f in values["faults"])
    assert data["tuned"] is False
