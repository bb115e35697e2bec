"""The DLRM-style rating model of the quality experiments, its embedding variants, training and metrics.

``RatingModel``: one embedding per categorical field (user, item, age, gender, occupation, zip3, year) and
a mean-pooled bag for the movie's genres -> the field vectors and their pairwise dot products (DLRM's
interaction) -> an MLP -> the logit of "rating >= 4". The embeddings are one of:

- ``full_embeddings``: an ``nn.Embedding`` per field and an ``nn.EmbeddingBag`` (the reference);
- ``robez_embeddings``: ``RobezEmbedding`` per field and a ``RobezEmbeddingBag``, all reading one shared
  ROBE-Z array, each table with its own ``val_offset`` (the cumulative vocabulary sizes). ``chunk_size=1``
  is the plain hashing trick;
- ``compressed_embeddings``: the same, with the array fitted to a trained full model's tables
  (``robez_core.compress.least_squares_array``).

Any module mapping ids (B,) -> (B, d) and a bag module (ids, offsets) -> (B, d) will do, which is how the
online experiment puts ``RemoteEmbedding`` in the same model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from robez_core import RobezEmbedding, RobezEmbeddingBag
from robez_core.compress import least_squares_array

from .movielens import Ratings

__all__ = [
    "Embeddings",
    "RatingModel",
    "auc",
    "compressed_embeddings",
    "evaluate",
    "full_embeddings",
    "full_floats",
    "log_loss",
    "predict_all",
    "robez_embeddings",
    "train_epoch",
]

INIT_SCALE = 0.01  # U(-0.01, 0.01) for every embedding variant, so only the storage differs


@dataclass
class Embeddings:
    """One module per single-valued field (ids (B,) -> (B, d)), a genre bag ((ids, offsets) -> (B, d))."""

    fields: list[nn.Module]
    genres: nn.Module
    dim: int


def full_floats(data: Ratings, dim: int) -> int:
    """Floats of the full tables: every vocabulary entry (fields and genres) times d."""
    return (sum(data.cardinalities) + data.num_genres) * dim


def _val_offsets(data: Ratings) -> list[int]:
    sizes = [*data.cardinalities, data.num_genres]
    return [sum(sizes[:index]) for index in range(len(sizes))]


def full_embeddings(data: Ratings, dim: int, generator: torch.Generator, sparse: bool = False) -> Embeddings:
    fields: list[nn.Module] = []
    for cardinality in data.cardinalities:
        table = nn.Embedding(cardinality, dim, sparse=sparse)
        nn.init.uniform_(table.weight, -INIT_SCALE, INIT_SCALE, generator=generator)
        fields.append(table)
    genres = nn.EmbeddingBag(data.num_genres, dim, mode="mean", sparse=sparse)
    nn.init.uniform_(genres.weight, -INIT_SCALE, INIT_SCALE, generator=generator)
    return Embeddings(fields, genres, dim)


def robez_embeddings(
    data: Ratings, dim: int, memory_size: int, chunk_size: int, seed: int, weight: Tensor | None = None
) -> Embeddings:
    """All tables over one array of ``memory_size`` floats (new, or ``weight``), hash seeded ``seed``."""
    offsets = _val_offsets(data)
    first = RobezEmbedding(
        data.cardinalities[0],
        dim,
        memory_size if weight is None else None,
        weight=weight,
        chunk_size=chunk_size,
        seed=seed,
        val_offset=offsets[0],
        init_scale=INIT_SCALE,
    )
    shared = {"weight": first.weight, "chunk_size": chunk_size, "seed": seed, "init_scale": INIT_SCALE}
    fields: list[nn.Module] = [first]
    for cardinality, val_offset in zip(data.cardinalities[1:], offsets[1:-1], strict=True):
        fields.append(RobezEmbedding(cardinality, dim, val_offset=val_offset, **shared))  # type: ignore[arg-type]
    genres = RobezEmbeddingBag(data.num_genres, dim, mode="mean", val_offset=offsets[-1], **shared)  # type: ignore[arg-type]
    return Embeddings(fields, genres, dim)


def compressed_embeddings(
    data: Ratings, full: Embeddings, memory_size: int, chunk_size: int, seed: int
) -> Embeddings:
    """ROBE-Z tables over one array fitted (least squares) to the tables of a trained full model."""
    modules = [*full.fields, full.genres]
    tables = [module.weight.detach() for module in modules if isinstance(module.weight, Tensor)]
    array = least_squares_array(
        tables,
        memory_size,
        val_offsets=_val_offsets(data),
        chunk_size=chunk_size,
        seed=seed,
        init_scale=INIT_SCALE,
    )
    return robez_embeddings(data, full.dim, memory_size, chunk_size, seed, weight=array)


class RatingModel(nn.Module):
    """Embeddings -> [field vectors, their pairwise dots] -> MLP -> logit of "rating >= 4".

    Shapes: ids int64 (B, F), genre ids (G,) with bag starts (B,) -> logits (B,).
    """

    def __init__(self, embeddings: Embeddings, hidden: int = 64) -> None:
        super().__init__()
        self.fields = nn.ModuleList(embeddings.fields)
        self.genres = embeddings.genres
        vectors = len(embeddings.fields) + 1
        pairs = vectors * (vectors - 1) // 2
        self.pair_index = torch.triu_indices(vectors, vectors, offset=1)
        self.mlp = nn.Sequential(
            nn.Linear(vectors * embeddings.dim + pairs, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden // 2),
            nn.ReLU(),
            nn.Linear(hidden // 2, 1),
        )

    def forward(self, ids: Tensor, genre_ids: Tensor, genre_starts: Tensor) -> Tensor:
        vectors = [table(ids[:, column]) for column, table in enumerate(self.fields)]
        vectors.append(self.genres(genre_ids, genre_starts))
        stacked = torch.stack(vectors, dim=1)  # (B, F + 1, d)
        dots = torch.bmm(stacked, stacked.transpose(1, 2))[:, self.pair_index[0], self.pair_index[1]]
        return self.mlp(torch.cat([stacked.flatten(1), dots], dim=1)).squeeze(1)

    def predict(self, data: Ratings, index: Tensor | slice) -> Tensor:
        """Logits of the ratings at ``index`` (B,)."""
        ids = data.ids[index]
        genre_ids, genre_starts = data.genre_bags(ids[:, data.item_column])
        return self(ids, genre_ids, genre_starts)


def train_epoch(
    model: RatingModel,
    optimizers: Sequence[torch.optim.Optimizer],
    data: Ratings,
    batch_size: int,
    generator: torch.Generator,
) -> float:
    """One pass over ``data`` in a random order; returns the mean training log-loss."""
    model.train()
    order = torch.randperm(len(data), generator=generator)
    total = 0.0
    for start in range(0, len(data), batch_size):
        batch = order[start : start + batch_size]
        loss = nn.functional.binary_cross_entropy_with_logits(model.predict(data, batch), data.labels[batch])
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
        total += float(loss.detach()) * batch.numel()
    return total / len(data)


def auc(scores: Tensor, labels: Tensor) -> float:
    """Area under the ROC curve (ties count one half), by the rank-sum statistic; NaN without both classes."""
    positives = int(labels.sum())
    negatives = labels.numel() - positives
    if positives == 0 or negatives == 0:
        return math.nan
    order = torch.argsort(scores.double())
    sorted_scores = scores.double()[order]
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    # The average 1-based rank of each run of tied scores.
    ends = torch.cumsum(counts, 0).double()
    average_rank = (ends - (counts.double() - 1) / 2)[inverse]
    rank_sum = float(average_rank[labels[order] > 0.5].sum())
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def log_loss(logits: Tensor, labels: Tensor) -> float:
    return float(nn.functional.binary_cross_entropy_with_logits(logits, labels))


def predict_all(model: RatingModel, data: Ratings, batch_size: int = 8192) -> Tensor:
    """Logits (N,) of every rating of ``data``, without gradients."""
    model.eval()
    with torch.no_grad():
        return torch.cat(
            [
                model.predict(data, slice(start, start + batch_size))
                for start in range(0, len(data), batch_size)
            ]
        )


def evaluate(model: RatingModel, data: Ratings, batch_size: int = 8192) -> tuple[float, float]:
    """(AUC, log-loss) of ``model`` on ``data``."""
    logits = predict_all(model, data, batch_size)
    return auc(logits, data.labels), log_loss(logits, data.labels)
