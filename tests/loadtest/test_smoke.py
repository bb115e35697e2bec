"""A short real load test: `python -m loadtest` starts `robez serve`, runs, and writes its report."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest

from loadtest.__main__ import main
from loadtest.server import redis_server_path

MAX_REQUESTS = 300


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_run_against_a_real_server(tmp_path: Path) -> None:
    argv = [
        "--quick",
        "--cpus",
        "1",
        "--scenarios",
        "healthz,json,binary,update,mix,step",
        "--batch-sizes",
        "1,64",
    ]
    argv += [
        "--duration",
        "1.5",
        "--max-requests",
        str(MAX_REQUESTS),
        "--feature-batch",
        "16",
        "--clients",
        "1",
    ]
    argv += ["--out", str(tmp_path), "--note", "smoke-test machine note"]
    assert main(argv) == 0

    reports = sorted(tmp_path.glob("*-quick.md"))
    assert len(reports) == 1 and not (tmp_path / "latest.md").exists()  # quick runs leave latest.md alone
    text = reports[0].read_text()
    assert "## Targets" in text and "single-id JSON lookups" in text
    assert "No unexpected errors" in text
    assert "smoke-test machine note" in text and "d=64, Z=32, m=262144" in text

    with reports[0].with_suffix(".csv").open() as file:
        rows = list(csv.DictReader(file))
    http = [row for row in rows if row["kind"] == "http"]
    scenarios = {(row["scenario"], row["batch_size"], row["mode"]) for row in http}
    expected = {("healthz", "1", "closed"), ("json", "1", "closed"), ("binary", "1", "closed")}
    expected |= {("binary", "64", "closed"), ("update", "16", "closed"), ("mix", "16", "closed")}
    expected |= {("step", "16", "closed")}
    expected |= {("binary", "64", "open")}
    assert expected <= scenarios
    for row in http:
        ok, errors, expected_errors = int(row["ok"]), int(row["errors"]), int(row["expected_errors"])
        assert int(row["sent"]) == int(row["completed"]) == ok + errors + expected_errors
        assert errors == 0 and 0 < ok <= MAX_REQUESTS
        if row["mode"] == "open":
            assert int(row["scheduled"]) == int(row["sent"])
        batch = int(row["batch_size"]) if row["scenario"] != "healthz" else 0
        window = float(row["window_s"])
        assert float(row["ids_per_s"]) == pytest.approx(ok * batch / window, rel=1e-3)
        assert float(row["requests_per_s"]) == pytest.approx(ok / window, rel=1e-3)
        assert float(row["latency_p50_ms"]) <= float(row["latency_p99_ms"]) <= float(row["latency_max_ms"])
        if row["scenario"] in ("binary", "json"):
            # the server's own Server-Timing figures came through
            assert float(row["hash_p50_ms"]) >= 0 and float(row["lookup_p50_ms"]) >= 0
            assert row["server_cpu_cores"] != ""
    assert [row["kind"] for row in rows].count("kernel") == 2  # batch 1 and 64 in process
    for plot in ("throughput", "latency", "timesplit"):
        assert reports[0].with_name(reports[0].stem + f"-{plot}.png").exists()


def test_non_loopback_url_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--url", "http://10.1.2.3:8000", "--out", os.devnull])
    assert exit_info.value.code == 2
    assert "non-loopback" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_run_with_the_floor_and_the_peer(tmp_path: Path) -> None:
    argv = ["--quick", "--cpus", "1", "--scenarios", "floor,healthz,binary,oip,redis"]
    argv += ["--batch-sizes", "1,512"]
    argv += ["--duration", "1", "--max-requests", "200", "--num-ids", "3000", "--clients", "1"]
    argv += ["--feature-batch", "16", "--out", str(tmp_path)]
    assert main(argv) == 0
    (report,) = sorted(tmp_path.glob("*-quick.md"))
    text = report.read_text()
    assert "## Small requests against the framework floor" in text
    assert "/healthz, 1 worker: req/s / framework floor req/s" in text
    assert "No unexpected errors" in text
    with report.with_suffix(".csv").open() as file:
        scenarios = {row["scenario"] for row in csv.DictReader(file) if row["kind"] == "http"}
    assert {"floor", "healthz", "binary", "oip", "floor_rows"} <= scenarios
    # the floor answered the 512-id lookup's bytes, so the composite reading is in the report
    assert "## Large responses against the framework floor" in text and "| 512 | 131,072 |" in text
    if redis_server_path() is None:
        assert "the Redis peer was skipped" in text
    else:
        assert {"redis", "redis_set"} <= scenarios
        assert "| the table itself |" in text
