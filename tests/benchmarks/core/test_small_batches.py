"""The small-batch micro-benchmark's code path on a few calls, so it cannot rot between runs."""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.core import paper_tables, small_batches


def test_small_benchmark_writes_its_report(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    try:
        assert (
            paper_tables.main(["--small", "--calls", "3", "--repeats", "1", "--output-dir", str(tmp_path)])
            == 0
        )
    finally:
        torch.set_num_threads(threads)
    (report,) = tmp_path.glob("small-batches-*.md")
    text = report.read_text()
    assert "| vector extensions |" in text and "| kernel threads | 1 |" in text
    for optimizer in ("sgd", "adagrad", "adam"):
        assert f"| {optimizer} | " in text
    assert "| Table.lookup of 1 id |" in text and "| Table.apply_gradients of 8 ids |" in text


def test_targets_take_the_worst_optimizer() -> None:
    results = [
        small_batches.SmallResult("sgd", 2.0, 1.0, 10.0, 5.0),
        small_batches.SmallResult("adam", 6.0, 1.0, 20.0, 5.0),
    ]
    (lookup, update) = small_batches.targets(results)
    assert lookup[1] == 6.0 and lookup[1] > lookup[2]  # missed
    assert update[1] == 20.0 and update[1] <= update[2]  # met
