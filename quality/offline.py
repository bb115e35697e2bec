"""Experiments 1 and 3: quality vs memory offline, and compressing a trained full model.

1. Every method is trained on the earliest 80% of the ratings and tested on the latest 20%, at the same
   number of embedding floats: full tables (the reference, 1x), ROBE-Z Z = 32, ROBE-Z Z = 8 and the plain
   hashing trick (ROBE-Z Z = 1), at each compression (m = full floats / compression).
2. Each seed's trained full model has its tables compressed (``least_squares_array``) at 16x and 64x
   (Z = 32): test AUC right after compressing, then after one epoch of fine-tuning the whole model.

Every run uses the same optimizer (Adam on all parameters), batch size and epochs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from .model import (
    Embeddings,
    RatingModel,
    auc,
    compressed_embeddings,
    evaluate,
    full_embeddings,
    full_floats,
    predict_all,
    robez_embeddings,
    train_epoch,
)
from .movielens import Ratings

__all__ = ["METHODS", "CompressionResult", "OfflineConfig", "Result", "run_offline"]

# method name -> chunk size Z of its ROBE-Z array (None: full tables)
METHODS: dict[str, int | None] = {"full": None, "robez-z32": 32, "robez-z8": 8, "hashing-z1": 1}


@dataclass(frozen=True)
class OfflineConfig:
    seeds: tuple[int, ...] = (0, 1, 2)
    compressions: tuple[int, ...] = (1, 4, 16, 64, 256)
    finetune_compressions: tuple[int, ...] = (16, 64)
    dim: int = 32
    epochs: int = 2
    batch_size: int = 1024
    lr: float = 3e-3
    train_limit: int | None = None  # first N training ratings only (the quick run)


@dataclass(frozen=True)
class Result:
    method: str
    compression: int  # full floats / array floats
    floats: int  # embedding floats (the array, or every full table)
    seed: int
    auc: float
    log_loss: float
    untrained_auc: float
    train_seconds: float
    seen_user_auc: float  # test ratings by users who also rated in the training period
    new_user_auc: float  # test ratings by users first seen in the test period (cold start)


@dataclass(frozen=True)
class CompressionResult:
    compression: int
    seed: int
    full_auc: float
    compressed_auc: float
    finetuned_auc: float
    compressed_log_loss: float
    finetuned_log_loss: float


def _train(
    embeddings: Embeddings,
    train: Ratings,
    test: Ratings,
    config: OfflineConfig,
    generator: torch.Generator,
    epochs: int,
) -> tuple[RatingModel, float, float, float, float]:
    """(model, untrained AUC, AUC, log-loss, seconds) after ``epochs`` epochs of Adam."""
    model = RatingModel(embeddings)
    untrained_auc, _ = evaluate(model, test)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    started = time.perf_counter()
    for _ in range(epochs):
        train_epoch(model, [optimizer], train, config.batch_size, generator)
    seconds = time.perf_counter() - started
    test_auc, test_loss = evaluate(model, test)
    return model, untrained_auc, test_auc, test_loss, seconds


def run_offline(
    data: Ratings, config: OfflineConfig, log: Callable[[str], None] = print
) -> tuple[list[Result], list[CompressionResult]]:
    train, test = data.time_split(0.8)
    if config.train_limit is not None:
        train = train.subset(slice(0, config.train_limit))
    total = full_floats(data, config.dim)
    user = data.fields.index("user")
    seen = torch.isin(test.ids[:, user], train.ids[:, user])
    log(f"{int(seen.sum())} of {len(test)} test ratings are by users who rated in the training period")
    results: list[Result] = []
    compressions: list[CompressionResult] = []
    for seed in config.seeds:
        for method, chunk_size in METHODS.items():
            for compression in (1,) if chunk_size is None else config.compressions:
                torch.manual_seed(seed)  # the MLP's init
                generator = torch.Generator().manual_seed(seed)  # embedding init and batch order
                if chunk_size is None:
                    embeddings, floats = full_embeddings(data, config.dim, generator), total
                else:
                    floats = max(chunk_size, total // compression)
                    embeddings = robez_embeddings(data, config.dim, floats, chunk_size, seed)
                model, untrained, test_auc, test_loss, seconds = _train(
                    embeddings, train, test, config, generator, config.epochs
                )
                logits = predict_all(model, test)
                seen_auc = auc(logits[seen], test.labels[seen])
                new_auc = auc(logits[~seen], test.labels[~seen])
                results.append(
                    Result(
                        method,
                        compression,
                        floats,
                        seed,
                        test_auc,
                        test_loss,
                        untrained,
                        seconds,
                        seen_auc,
                        new_auc,
                    )
                )
                log(
                    f"seed {seed} {method:10s} {compression:4d}x {floats:7d} floats: AUC {test_auc:.4f} "
                    f"(returning users {seen_auc:.4f}, new users {new_auc:.4f}) log-loss {test_loss:.4f} "
                    f"(untrained AUC {untrained:.4f}, {seconds:.1f} s)"
                )
                if chunk_size is None:
                    compressions += _compress_and_finetune(
                        data, model, embeddings, test_auc, seed, config, log
                    )
    return results, compressions


def _compress_and_finetune(
    data: Ratings,
    full_model: RatingModel,
    full: Embeddings,
    full_auc: float,
    seed: int,
    config: OfflineConfig,
    log: Callable[[str], None],
) -> list[CompressionResult]:
    train, test = data.time_split(0.8)
    if config.train_limit is not None:
        train = train.subset(slice(0, config.train_limit))
    total = full_floats(data, config.dim)
    out = []
    for compression in config.finetune_compressions:
        chunk_size = METHODS["robez-z32"]
        assert chunk_size is not None
        embeddings = compressed_embeddings(
            data, full, max(chunk_size, total // compression), chunk_size, seed
        )
        model = RatingModel(embeddings)
        model.mlp.load_state_dict(full_model.mlp.state_dict())  # the trained MLP comes along
        compressed_auc, compressed_loss = evaluate(model, test)
        generator = torch.Generator().manual_seed(seed)
        optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
        train_epoch(model, [optimizer], train, config.batch_size, generator)
        finetuned_auc, finetuned_loss = evaluate(model, test)
        out.append(
            CompressionResult(
                compression, seed, full_auc, compressed_auc, finetuned_auc, compressed_loss, finetuned_loss
            )
        )
        log(
            f"seed {seed} compress full -> {compression}x: AUC {full_auc:.4f} -> {compressed_auc:.4f}, "
            f"after one epoch {finetuned_auc:.4f}"
        )
    return out


def as_dicts(rows: Sequence[Result] | Sequence[CompressionResult]) -> list[dict[str, object]]:
    return [asdict(row) for row in rows]
