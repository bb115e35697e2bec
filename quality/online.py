"""Experiment 2: online training through a live ``robez serve``, test-then-train.

The ratings are replayed in timestamp order in mini-batches. For each batch the model first predicts
(the ROBE-Z rows looked up over HTTP by ``RemoteEmbedding`` / ``RemoteEmbeddingBag``), the predictions are
recorded, then ``loss.backward()`` pushes the rows' gradients and the server applies its optimizer
(adagrad by default) to the one shared array; a local Adam trains the MLP. So every prediction is made
before its rating is trained on. One served model per compression, and the same model with local full
``nn.Embedding`` tables (torch's optimizer of the same name and lr on them, the same Adam on the MLP, same
batches), are replayed side by side, and each gets a running AUC over a trailing window.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from loadtest.launch import RobezProcess
from service.client import RemoteEmbedding, RemoteEmbeddingBag, RobezClient, RobezClientError

from .model import INIT_SCALE, Embeddings, RatingModel, auc, full_embeddings, full_floats
from .movielens import Ratings

__all__ = ["OnlineConfig", "OnlineResult", "run_online", "serve"]


@dataclass(frozen=True)
class OnlineConfig:
    dim: int = 32
    compressions: tuple[int, ...] = (4, 16)  # one served model (its own tables) per compression
    chunk_size: int = 32
    batch_size: int = 500
    # The embeddings' optimizer: on the server for ROBE-Z, the same locally for the full tables
    # ("adam" is lazy on both sides: the server's lazy adam, torch's SparseAdam).
    # Measured: "adam" at lr 3e-3 ended lower for every model (full 0.707, 4x 0.688, 16x 0.692).
    optimizer: str = "adagrad"
    server_lr: float = 0.05
    mlp_lr: float = 3e-3
    window: int = 10_000  # ratings in the trailing window of the running AUC
    limit: int | None = None  # replay the first N ratings only (the quick run)
    seed: int = 0
    table_prefix: str = "ml100k_"


@dataclass
class OnlineResult:
    """Curves and totals of one replay; models are ``"full"`` and ``"robez-<c>x"`` per compression c."""

    seen: list[int] = field(default_factory=list)  # ratings replayed at each point of the curves
    auc: dict[str, list[float]] = field(default_factory=dict)  # trailing-window AUC per model
    progressive_auc: dict[str, float] = field(default_factory=dict)  # AUC of every prediction
    floats: dict[str, int] = field(default_factory=dict)  # embedding floats per model
    lookups: int = 0  # lookup requests (one per table per batch and served model)
    pushes: int = 0  # gradient pushes (one per table per batch and served model)
    lookup_seconds: float = 0.0  # wall time of the served models' forward passes
    push_seconds: float = 0.0  # wall time of their backward passes (the pushes and the MLP's backward)
    replay_seconds: float = 0.0

    @property
    def lookups_per_s(self) -> float:
        return self.lookups / self.lookup_seconds if self.lookup_seconds else float("nan")

    @property
    def pushes_per_s(self) -> float:
        return self.pushes / self.push_seconds if self.push_seconds else float("nan")


@contextmanager
def serve(startup_timeout_s: float = 60.0) -> Iterator[str]:
    """Runs ``robez serve`` (one worker, one kernel thread, no data dir) on a free port; yields the URL."""
    args = ["--host", "127.0.0.1", "--workers", "1", "--threads-per-worker", "1", "--log-level", "warning"]
    # Only the options above: no data dir, tables file or keys from the caller's environment (ROBEZ_*
    # is dropped); its output to a file, not a pipe nobody reads while the replay runs.
    with tempfile.TemporaryDirectory(prefix="robez-quality-") as directory:
        server = RobezProcess(args, log_path=Path(directory) / "server.log")
        try:
            yield server.start(startup_timeout_s, interval_s=0.2).url
        finally:
            server.stop(20.0)


def _remote_embeddings(
    client: RobezClient, data: Ratings, config: OnlineConfig, memory_size: int, prefix: str
) -> Embeddings:
    """One table per field and one for genres on the server, all sharing the first table's array."""
    names = [f"{prefix}{name}" for name in data.fields] + [f"{prefix}genres"]
    sizes = [*data.cardinalities, data.num_genres]
    optimizer = {"name": config.optimizer, "lr": config.server_lr}
    val_offset = 0
    for index, (name, size) in enumerate(zip(names, sizes, strict=True)):
        try:
            client.delete_table(name)
        except RobezClientError as error:
            if error.status != 404:
                raise
        table_config = {
            "num_embeddings": size,
            "embedding_dim": config.dim,
            "memory_size": memory_size,
            "chunk_size": config.chunk_size,
            "seed": config.seed,
            "val_offset": val_offset,
            "init_scale": INIT_SCALE,
        }
        client.create_table(name, table_config, optimizer, share_array_with=None if index == 0 else names[0])
        val_offset += size
    fields: list[nn.Module] = [RemoteEmbedding(client, name, embedding_dim=config.dim) for name in names[:-1]]
    genres = RemoteEmbeddingBag(client, names[-1], mode="mean", embedding_dim=config.dim)
    return Embeddings(fields, genres, config.dim)


def _trailing_auc(scores: list[torch.Tensor], labels: list[torch.Tensor], window: int) -> float:
    all_scores, all_labels = torch.cat(scores), torch.cat(labels)
    return auc(all_scores[-window:], all_labels[-window:])


def run_online(
    data: Ratings, url: str, config: OnlineConfig, log: Callable[[str], None] = print
) -> OnlineResult:
    total = full_floats(data, config.dim)
    result = OnlineResult()
    client = RobezClient(url)
    try:
        torch.manual_seed(config.seed)
        generator = torch.Generator().manual_seed(config.seed)
        full = RatingModel(full_embeddings(data, config.dim, generator, sparse=config.optimizer == "adam"))
        result.floats["full"] = total
        tables = [*full.fields.parameters(), *full.genres.parameters()]
        local: torch.optim.Optimizer
        if config.optimizer == "adam":
            local = torch.optim.SparseAdam(tables, lr=config.server_lr)
        elif config.optimizer == "adagrad":
            local = torch.optim.Adagrad(tables, lr=config.server_lr)
        else:
            local = torch.optim.SGD(tables, lr=config.server_lr)
        # (model, its optimizers): the served models' embeddings are trained by the server.
        models: dict[str, tuple[RatingModel, list[torch.optim.Optimizer]]] = {
            "full": (
                full,
                [torch.optim.Adam(full.mlp.parameters(), lr=config.mlp_lr), local],
            )
        }
        for compression in config.compressions:
            memory_size = max(config.chunk_size, total // compression)
            prefix = f"{config.table_prefix}{compression}x_"
            served = RatingModel(_remote_embeddings(client, data, config, memory_size, prefix))
            served.mlp.load_state_dict(full.mlp.state_dict())  # every model starts from the same MLP
            name = f"robez-{compression}x"
            models[name] = (served, [torch.optim.Adam(served.mlp.parameters(), lr=config.mlp_lr)])
            result.floats[name] = memory_size
        scores: dict[str, list[torch.Tensor]] = {name: [] for name in models}
        result.auc = {name: [] for name in models}
        labels: list[torch.Tensor] = []
        count = len(data) if config.limit is None else min(config.limit, len(data))
        report_every = max(1, count // config.batch_size // 50)
        started = time.perf_counter()
        for number, start in enumerate(range(0, count, config.batch_size), start=1):
            batch = torch.arange(start, min(start + config.batch_size, count))
            target = data.labels[batch]
            for name, (model, optimizers) in models.items():
                before = time.perf_counter()
                logits = model.predict(data, batch)  # served: the lookups
                after_lookup = time.perf_counter()
                loss = nn.functional.binary_cross_entropy_with_logits(logits, target)
                for optimizer in optimizers:
                    optimizer.zero_grad()
                loss.backward()  # served: the pushes
                for optimizer in optimizers:
                    optimizer.step()
                scores[name].append(logits.detach())
                if name != "full":
                    result.lookup_seconds += after_lookup - before
                    result.push_seconds += time.perf_counter() - after_lookup
                    result.lookups += len(model.fields) + 1
                    result.pushes += len(model.fields) + 1
            labels.append(target)
            seen = int(batch[-1]) + 1
            if number % report_every == 0 or seen == count:
                result.seen.append(seen)
                for name in models:
                    result.auc[name].append(_trailing_auc(scores[name], labels, config.window))
                log(
                    f"{seen:6d} ratings: trailing AUC "
                    + ", ".join(f"{name} {values[-1]:.4f}" for name, values in result.auc.items())
                )
        result.replay_seconds = time.perf_counter() - started
        all_labels = torch.cat(labels)
        result.progressive_auc = {name: auc(torch.cat(scores[name]), all_labels) for name in models}
    finally:
        client.close()
    log(
        f"replayed {count} ratings in {result.replay_seconds:.1f} s: {result.lookups_per_s:.0f} lookups/s, "
        f"{result.pushes_per_s:.0f} pushes/s; AUC of every prediction: "
        + ", ".join(f"{name} {value:.4f}" for name, value in result.progressive_auc.items())
    )
    return result
