"""Report maths and files from a synthetic sweep: target ratios, shortfalls, CSV rows, plots."""

from __future__ import annotations

import csv
import time
from pathlib import Path

import pytest

from loadtest.baseline import KernelResult
from loadtest.profile import summarise
from loadtest.report import (
    composite,
    composite_ceiling_rate,
    composite_ratio,
    find_run,
    floor_checks,
    target_checks,
    write_report,
)
from loadtest.runner import RunResult, RunSpec
from loadtest.scenarios import FLOOR_ROWS
from loadtest.stats import Summary
from loadtest.sweep import PeerMemory, SweepConfig, SweepResult


def _run(
    scenario: str,
    batch: int,
    cores: int,
    ok: int,
    *,
    window: float = 1.0,
    mode: str = "closed",
    rate: float = 0.0,
) -> RunResult:
    spec = RunSpec(f"{scenario} run", scenario, batch_size=batch, mode=mode, rate=rate, concurrency=8)
    return RunResult(
        spec=spec,
        embedding_dim=64,
        window_s=window,
        scheduled=ok,
        sent=ok,
        completed=ok,
        ok=ok,
        errors={},
        error_samples=[],
        expected={},
        statuses={200: ok},
        ids=ok * batch,
        rows=ok * batch,
        response_bytes=ok * batch * 256,
        latency_ms=Summary.of([1.0, 2.0, 3.0]),
        hash_ms=Summary.of([0.1]),
        lookup_ms=Summary.of([0.2]),
        server_total_ms=Summary.of([0.5]),
        client_cpu=[0.4],
        max_send_lag_ms=0.0,
        failures=[],
        server_cores=cores,
        server_cpu_cores=0.9,
        server_cpu_s=0.9 * window,
        other_cpu_cores=0.1,
    )


def _kernel(batch: int, calls: int) -> KernelResult:
    return KernelResult(batch, 1, (0,), calls, 1.0, 1.0, 0.1, 0.2, 0.3, 0.05)


def _sweep(cores: int, runs: list[RunResult], kernel: list[KernelResult]) -> SweepResult:
    config = SweepConfig(cpus=(1, 2), batch_sizes=(1, 4096))
    result = SweepResult(config, "python -m loadtest", {"host": "h", "cores": str(cores)}, time.time())
    result.runs, result.kernel, result.finished = runs, kernel, result.started + 1
    return result


def test_targets_met_missed_and_not_measurable() -> None:
    runs = [
        _run("healthz", 1, 1, ok=1000),
        _run("json", 1, 1, ok=800),  # 0.8 of the floor: met
        _run("binary", 4096, 1, ok=100),  # 409,600 ids/s vs kernel 1,024,000: 0.4, missed
    ]
    checks = target_checks(_sweep(2, runs, [_kernel(4096, 250)]))
    binary, json_check, scaling = checks
    assert binary.ratio == pytest.approx(0.4) and binary.status == "missed"
    assert "missed by 0.10" in binary.shortfall and "1.25x" in binary.shortfall
    assert (
        json_check.ratio == pytest.approx(0.8) and json_check.status == "met" and json_check.shortfall == ""
    )
    assert scaling.status == "not measurable" and "2 cores" in scaling.detail


def test_scaling_target_with_four_workers() -> None:
    runs = [_run("binary", 4096, 1, ok=100), _run("binary", 4096, 4, ok=340)]
    scaling = target_checks(_sweep(8, runs, []))[2]
    assert scaling.ratio == pytest.approx(0.85) and scaling.status == "met"


def test_find_run_skips_the_httpx_cross_check() -> None:
    httpx_run = _run("healthz", 1, 1, ok=10)
    httpx_run.spec = RunSpec("HTTP floor, httpx client", "healthz", transport="httpx")
    raw_run = _run("healthz", 1, 1, ok=20)
    assert find_run([httpx_run, raw_run], "healthz", 1, 1) is raw_run
    assert find_run([httpx_run, raw_run], "healthz", 1, 1, transport="httpx") is httpx_run
    assert find_run([raw_run], "healthz", 1, 2) is None


def test_write_report_files(tmp_path: Path) -> None:
    runs = [
        _run("healthz", 1, 1, ok=1000),
        _run("json", 1, 1, ok=300),
        _run("binary", 1, 1, ok=900),
        _run("binary", 4096, 1, ok=100),
        _run("healthz", 1, 2, ok=1800),
        _run("binary", 4096, 2, ok=150),
        _run("binary", 4096, 1, ok=50, mode="open", rate=50.0),
        _run("binary", 4096, 1, ok=95, mode="open", rate=110.0),
    ]
    result = _sweep(2, runs, [_kernel(1, 30000), _kernel(4096, 250)])
    result.profiles.append(
        summarise("proc;a (x.py:1);b (service/routes/lookup.py:3) 3\nproc;a (x.py:2) 1\n", "p")
    )
    files = write_report(result, tmp_path, update_latest=True)
    text = files.markdown.read_text()
    for heading in ("## Machine", "## Targets", "## Runs", "## Scaling with cores", "## Profile", "## Plots"):
        assert heading in text
    assert "**missed**" in text and "not measurable" in text
    assert (tmp_path / "latest.md").read_text() == text
    with files.csv.open() as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == len(runs) + 2
    assert [row["kind"] for row in rows].count("kernel") == 2
    for row in rows:
        if row["kind"] == "http":
            assert int(row["ok"]) + int(row["errors"]) + int(row["expected_errors"]) == int(row["completed"])
    assert {p.name.rsplit("-", 1)[1] for p in files.plots} == {
        "throughput.png",
        "latency.png",
        "timesplit.png",
    }
    for plot in files.plots:
        assert plot.read_bytes().startswith(b"\x89PNG")
        assert f"]({plot.name})" in text


def test_profile_summary_merges_lines_and_ranks() -> None:
    collapsed = "\n".join(
        [
            "process 1;main (service/cli.py:3);lookup (service/routes/lookup.py:10) 6",
            "process 1;main (service/cli.py:3);lookup (service/routes/lookup.py:12) 2",
            "process 1;main (service/cli.py:3);notify (threading.py:382) 2",
            "garbage line",
        ]
    )
    summary = summarise(collapsed, "x")
    assert summary.samples == 10
    assert summary.top_self[0] == ("lookup (service/routes/lookup.py)", pytest.approx(0.8))
    assert ("lookup (service/routes/lookup.py)", pytest.approx(0.8)) in summary.top_inclusive
    assert all("cli.py" not in frame for frame, _ in summary.top_inclusive)
    assert summarise("", "empty").error is not None


def test_floor_targets_are_ratios_to_the_framework_floor() -> None:
    runs = [
        _run("floor", 1, 1, ok=1000),
        _run("healthz", 1, 1, ok=950),  # 0.95: met
        _run("binary", 1, 1, ok=500),  # 0.5 < 0.6: missed
        _run("json", 1, 1, ok=500),  # 0.5: met
        _run("binary", 4096, 1, ok=240),  # 983,040 / 1,024,000 = 0.96: met
    ]
    checks = floor_checks(_sweep(2, runs, [_kernel(4096, 250)]))
    by_name = {check.name.split(",")[0]: check for check in checks}
    assert by_name["/healthz"].ratio == pytest.approx(0.95) and by_name["/healthz"].status == "met"
    assert by_name["single-id binary lookups"].status == "missed"
    assert by_name["single-id JSON lookups"].status == "met"
    assert by_name["gradient pushes of 8 ids (binary"].status == "not measurable"
    regress = next(check for check in checks if "do not regress" in check.name)
    assert regress.ratio == pytest.approx(0.96) and regress.status == "met"
    assert checks[-1].name.startswith("proposed reading") and checks[-1].status == "not measurable"
    no_floor = floor_checks(_sweep(2, runs[1:], []))
    assert all(check.status == "not measurable" for check in no_floor)


def test_report_has_the_floor_and_peer_sections(tmp_path: Path) -> None:
    runs = [
        _run("floor", 1, 1, ok=1000),
        _run("binary", 1, 1, ok=700),
        _run("binary", 4096, 1, ok=100),
        _run("redis", 1, 1, ok=2000),
        _run("redis", 4096, 1, ok=10),
    ]
    result = _sweep(2, runs, [_kernel(1, 1000), _kernel(4096, 250)])
    result.peer_memory = PeerMemory(1000, 256, 400_000, 9 << 20, 1 << 20, 300 << 20)
    text = write_report(result, tmp_path, update_latest=False).markdown.read_text()
    assert "## Small requests against the framework floor" in text
    assert "| 1 | binary run | 1 | 700 | 1,000 | 0.70 |" in text
    assert "## Peer: Redis" in text
    assert "| lookup (binary / GET, MGET) | 4096 | 100 | 10 |" in text
    assert "| the table itself | 1.0 MiB" in text


def test_report_says_when_the_peer_was_skipped(tmp_path: Path) -> None:
    result = _sweep(2, [_run("binary", 1, 1, ok=10)], [])
    result.notes.append("the Redis peer was skipped: no redis-server (or valkey-server) on PATH.")
    text = write_report(result, tmp_path, update_latest=False).markdown.read_text()
    assert "## Peer: Redis\n\nthe Redis peer was skipped" in text


def test_composite_ceiling_adds_per_request_times() -> None:
    # 250 kernel calls/s (4 ms) then 450 floor answers/s (2.22 ms): 6.22 ms a request
    assert composite_ceiling_rate(250.0, 450.0) == pytest.approx(1 / (1 / 250 + 1 / 450))
    assert composite_ratio(9.0, 4.0, 2.0) == pytest.approx(6 / 9)
    assert composite_ratio(6.0, 4.0, 2.0) == pytest.approx(1.0)
    for bad in ((0.0, 4.0, 2.0), (9.0, float("nan"), 2.0), (9.0, 4.0, -1.0)):
        assert composite_ratio(*bad) != composite_ratio(*bad)  # NaN
    assert composite_ceiling_rate(0.0, 450.0) != composite_ceiling_rate(0.0, 450.0)


def _composite_runs(floor_cpu_cores: float = 0.9) -> list[RunResult]:
    floor = _run(FLOOR_ROWS, 4096, 1, ok=450)  # 0.9 CPU-s / 450 = 2 ms a request, 450 req/s
    floor.server_cpu_cores, floor.server_cpu_s = floor_cpu_cores, floor_cpu_cores
    floor.ok = int(450 * floor_cpu_cores / 0.9)
    return [floor, _run("binary", 4096, 1, ok=100)]  # 9 ms a request, 100 req/s


def _kernel_of(batch: int, calls: int, call_ms: float) -> KernelResult:
    return KernelResult(batch, 1, (0,), calls, 1.0, call_ms, 0.1, 0.2, 0.3, 0.05)


def test_composite_target_row_and_section(tmp_path: Path) -> None:
    # kernel: 4 ms a call (its median), 250 calls/s
    result = _sweep(2, _composite_runs(), [_kernel_of(4096, 250, 4.0)])
    found = composite(result, 4096)
    assert found is not None
    assert (found.kernel_ms, found.floor_ms, found.server_ms) == pytest.approx((4.0, 2.0, 9.0))
    assert found.ratio == pytest.approx(6 / 9)
    assert found.rate_ratio == pytest.approx(100 / composite_ceiling_rate(250, 450))
    checks = floor_checks(result)
    kernel_row = next(check for check in checks if "do not regress" in check.name)
    proposed = checks[-1]
    # the row stays as it is; the proposed one comes beside it with the same threshold
    assert kernel_row.threshold == proposed.threshold == 0.9
    assert proposed.name.startswith("proposed reading") and proposed.status == "missed"
    assert proposed.ratio == pytest.approx(6 / 9) and "missed by 0.23" in proposed.shortfall
    assert "kernel 4.000 + floor 2.000 = 6.000 ms vs server 9.000 ms" in proposed.detail
    text = write_report(result, tmp_path, update_latest=False).markdown.read_text()
    assert "## Large responses against the framework floor" in text
    assert "| 4096 | 1,048,576 | 4.000 | 2.000 | 6.000 | 9.000 | 0.67 | 100 |" in text
    assert "- batch 4096: 0.67 misses the proposed 0.90 by 0.23" in text
    assert "busy only" not in text
    assert "Server CPU per 4096-id request against how busy" not in text  # one binary run: no table

    quiet = _run("binary", 4096, 1, ok=20, mode="open", rate=20.0)
    quiet.server_cpu_cores = quiet.server_cpu_s = 0.3  # 15 ms a request at 30% busy
    result.runs.append(quiet)
    text = write_report(result, tmp_path, update_latest=False).markdown.read_text()
    assert "| binary run | 20 | 30% | 15.000 |" in text
    assert "At 30% busy the server spent 1.67x the CPU per request it spent at 90% busy." in text


def test_composite_flags_a_server_that_was_not_busy() -> None:
    result = _sweep(2, _composite_runs(floor_cpu_cores=0.5), [_kernel_of(4096, 250, 4.0)])
    proposed = floor_checks(result)[-1]
    assert "server core busy only floor 50%" in proposed.detail
