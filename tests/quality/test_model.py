"""The metric and the model's embedding variants."""

from __future__ import annotations

import itertools

import torch

from quality import movielens
from quality.model import RatingModel, auc, compressed_embeddings, full_embeddings, robez_embeddings
from tests.quality.test_movielens import INTER, ITEM, USER


def _pairwise_auc(scores: list[float], labels: list[int]) -> float:
    wins = 0.0
    pairs = 0
    for (s_pos, l_pos), (s_neg, l_neg) in itertools.product(zip(scores, labels, strict=True), repeat=2):
        if l_pos == 1 and l_neg == 0:
            pairs += 1
            wins += 1.0 if s_pos > s_neg else 0.5 if s_pos == s_neg else 0.0
    return wins / pairs


def test_auc_matches_counting_pairs_with_ties() -> None:
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        scores = torch.randint(0, 6, (40,), generator=generator).float()  # many ties
        labels = torch.randint(0, 2, (40,), generator=generator)
        expected = _pairwise_auc(scores.tolist(), labels.tolist())
        assert abs(auc(scores, labels.float()) - expected) < 1e-12
    assert auc(torch.tensor([0.1, 0.9]), torch.tensor([0.0, 1.0])) == 1.0


def test_every_variant_scores_a_batch_and_compression_keeps_the_rows() -> None:
    data = movielens.parse(INTER, USER, ITEM)
    full = full_embeddings(data, 8, torch.Generator().manual_seed(0))
    variants = [full, robez_embeddings(data, 8, 64, 4, seed=1), robez_embeddings(data, 8, 64, 1, seed=1)]
    for embeddings in variants:
        logits = RatingModel(embeddings).predict(data, slice(0, 5))
        assert logits.shape == (5,) and bool(torch.isfinite(logits).all())
    # At 1x with m >= every full value, compressing gives rows close to the full ones (few collisions).
    total = (sum(data.cardinalities) + data.num_genres) * 8
    compressed = compressed_embeddings(data, full, 64 * total, 1, seed=1)
    for full_table, small_table in zip(full.fields, compressed.fields, strict=True):
        ids = torch.arange(full_table.num_embeddings)
        assert (small_table(ids) - full_table(ids)).abs().max() < 0.02
