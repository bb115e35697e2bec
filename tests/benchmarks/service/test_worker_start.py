"""The worker-start benchmark's quick run: a real 2-worker server, one worker killed and replaced."""

from __future__ import annotations

import pytest

from benchmarks.service import worker_start

pytestmark = pytest.mark.slow


def test_quick_run_reports_memory_and_a_replacement(capsys: pytest.CaptureFixture[str]) -> None:
    assert worker_start.main(["--workers", "2", "--kills", "1"]) == 0
    report = capsys.readouterr().out
    (row,) = [line for line in report.splitlines() if line.startswith("| 2 |")]
    ready_s, pss, per_worker, heal = (cell.strip() for cell in row.strip("|").split("|")[1:])
    assert float(ready_s) > 0 and float(pss) > 100
    assert float(per_worker) == pytest.approx(float(pss) / 2, abs=1)
    median, maximum = (float(value) for value in heal.split(" / "))
    assert 0 < median <= maximum < 60
