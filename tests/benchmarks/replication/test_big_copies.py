"""The replica big-copies benchmark's quick run: one NATS node, one replica, a tiny table; its checksum and
its count-started snapshot (local and upload) are found in the replica's log and reported, and nothing it
made is left in /dev/shm."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.replication import big_copies

pytestmark = pytest.mark.slow


def _figure(report: str, starts: str) -> str:
    (line,) = [line for line in report.splitlines() if line.startswith(f"| {starts}")]
    return line.rsplit("|", 2)[1].strip()


def test_quick_run_reports_the_replicas_checksum_and_snapshot(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    before = set(Path("/dev/shm").glob("robez-bench-bigcopies-*"))
    argv = ["--memory-size", "65536", "--workers", "1", "--snapshot-every", "300"]
    argv += ["--requests", "20", "--window-pushes", "10", "--max-seconds", "60", "--workdir", str(tmp_path)]
    assert big_copies.main(argv) == 0
    report = capsys.readouterr().out
    assert "Note:" not in report  # no failed push, no snapshot during the checksum, the upload seen
    for hold in ("the checksum's longest update-lock hold", "the snapshot copy's longest update-lock hold"):
        found = re.fullmatch(r"\*\*([\d.,]+) ms\*\* \(lock-free, .*\)", _figure(report, hold))
        assert found is not None, report
    assert "upload and local snapshot (one copy)" in report
    assert float(_figure(report, "... the upload to the Object Store").split()[0]) >= 0
    assert re.match(r"[\d.]+ / [\d.]+ / [\d.]+ ms", _figure(report, "pushes outside the snapshot"))
    assert set(Path("/dev/shm").glob("robez-bench-bigcopies-*")) == before
    assert list(tmp_path.iterdir()) == []  # the NATS stores and the data directory removed
