"""The DLRM training benchmark: its data and model shapes, its reading of the goals, and a --quick run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.training import dlrm


def test_data_is_deterministic_and_in_range():
    settings = dlrm.QUICK
    data = dlrm.SyntheticCriteo(settings)
    first, again = data.batch(3), dlrm.SyntheticCriteo(settings).batch(3)
    assert torch.equal(first.values, again.values) and torch.equal(first.labels, again.labels)
    size = settings.batch_size
    for f, n in enumerate(settings.cardinalities):
        ids = first.values[f * size : (f + 1) * size]
        assert int(ids.min()) >= 0 and int(ids.max()) < n
    assert 0.05 < float(first.labels.mean()) < 0.95  # the planted model gives both classes
    assert max(dlrm.Settings().cardinalities) == 6_000_000


def test_the_dense_model_has_the_issues_shapes():
    model = dlrm.DenseDLRM(26, 16)
    assert model.top[0].in_features == 367  # 351 pairs of 27 vectors + 16
    logits = model(torch.randn(4, 13), torch.randn(4, 26 * 16))
    assert logits.shape == (4,)


def _result(step: float, embedding: float) -> dict:
    medians = {"step": step, "embedding": embedding}
    return {"median_seconds": {"wall": medians, "cpu": medians}}


def test_goals_are_read_from_the_ratios():
    lines = dlrm.goals(
        {
            "full": _result(0.100, 0.040),
            "robez_per_feature": _result(0.200, 0.100),
            "robez_collection": _result(0.090, 0.060),
        }
    )
    assert "wall: collection step / full nn.EmbeddingBag step = 0.90 (goal <= 1.00): met" in lines
    assert any("embedding part = 0.60 (goal <= 0.50): missed" in line for line in lines)


@pytest.mark.slow
def test_quick_run_writes_a_report(tmp_path: Path):
    # two variants, few steps: each trains in a child process as the real run does
    code = dlrm.main(
        [
            "--quick",
            "--variants",
            "full,robez_collection",
            "--steps",
            "6",
            "--repeats",
            "1",
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert code == 0
    (report,) = tmp_path.glob("dlrm-*-quick.md")
    text = report.read_text()
    assert "RobezEmbeddingBagCollection" in text and "nn.EmbeddingBag(sparse=True)" in text
    assert "collection step / full nn.EmbeddingBag step" in text
    assert "### CPU time of the trainer thread" in text and "## Machine" in text


def _remote(step: float, eval_loss: float, samples: float, **extra: object) -> dict:
    medians = {"step": step, "embedding": step}
    return {
        "name": "remote",
        "median_seconds": {"wall": medians, "cpu": medians},
        "eval_loss": eval_loss,
        "samples_per_second": samples,
        "requests_per_step": 2.0,
        **extra,
    }


def test_remote_goals_are_read_from_the_wall_clock_ratios():
    local = _remote(0.100, 0.4000, 20_000.0)
    lines = dlrm.remote_goals(
        {
            "robez_collection": local,
            "remote_collection": _remote(0.120, 0.4000, 17_000.0),
            "remote_prefetch": _remote(0.120, 0.4030, 17_000.0),
            "remote_prefetch_after_push": _remote(0.110, 0.4000, 18_000.0),
            "remote_push_with_next_pull": _remote(0.140, 0.4010, 15_000.0),
            "remote_2_trainers": _remote(
                0.150,
                0.4,
                13_000.0,
                aggregate_samples_per_second=26_000.0,
                trainers=[{"server_worker": 7}, {"server_worker": 8}],
            ),
        }
    )
    assert "wall: remote collection step / local collection step = 1.20 (goal <= 1.3): met" in lines
    assert (
        "wall: remote collection + prefetch step / local collection step = 1.20 (goal <= 1.15): missed"
        in lines
    )
    assert any("= 0.0030 (goal <= 0.002): missed" in line for line in lines)
    assert any("bit for bit the same" in line for line in lines)
    assert any("pids [7, 8]) / 1 trainer samples/s = 1.53 (goal >= 1.4): met" in line for line in lines)
    assert (
        "wall: remote collection + prefetch after the push step / local collection step = 1.10 "
        "(goal <= 1.15): met" in lines
    )
    assert "eval loss, remote + prefetch after the push vs local: bit for bit the same (0.400000)" in lines
    assert (
        "wall: remote collection, push held for the next pull step / local collection step = 1.40 "
        "(goal <= 1.3): missed" in lines
    )
    assert "eval loss, remote, push held for the next pull vs local: different (0.401000)" in lines


@pytest.mark.slow
def test_quick_remote_run_trains_the_local_bits_through_a_server(tmp_path: Path):
    code = dlrm.main(
        [
            "--quick", "--variants", "robez_collection,remote_collection", "--steps", "6",
            "--repeats", "1", "--output-dir", str(tmp_path),
        ]
    )  # fmt: skip
    assert code == 0
    text = next(tmp_path.glob("dlrm-*-quick.md")).read_text()
    assert "### Remote collection" in text and "| 2.00 |" in text
    assert "eval loss, remote (no prefetch) vs local: bit for bit the same" in text


def test_passes_combine_into_means_and_the_largest_peak():
    passes = [
        {**_result(0.100, 0.040), "peak_rss_mib": 100.0, "eval_loss": 0.5},
        {**_result(0.300, 0.060), "peak_rss_mib": 300.0, "eval_loss": 0.5},
    ]
    combined = dlrm.combine(passes, dlrm.QUICK)
    assert combined["median_seconds"]["cpu"]["step"] == pytest.approx(0.200)
    assert combined["peak_rss_mib"] == 300.0 and combined["pass_wall_steps"] == [0.100, 0.300]
    assert combined["samples_per_second"] == pytest.approx(dlrm.QUICK.batch_size / 0.200)
