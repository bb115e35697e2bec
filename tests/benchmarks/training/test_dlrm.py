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
        ["--quick", "--variants", "full,robez_collection", "--steps", "6", "--output-dir", str(tmp_path)]
    )
    assert code == 0
    (report,) = tmp_path.glob("dlrm-*-quick.md")
    text = report.read_text()
    assert "RobezEmbeddingBagCollection" in text and "nn.EmbeddingBag(sparse=True)" in text
    assert "collection step / full nn.EmbeddingBag step" in text
    assert "### CPU time of the trainer thread" in text and "## Machine" in text
