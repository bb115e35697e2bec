"""Experiment 2: online training through a live ``robez serve``, test-then-train.

The ratings are replayed in timestamp order in mini-batches. For each batch the model first predicts
(the ROBE-Z rows looked up over HTTP by ``RemoteEmbedding`` / ``RemoteEmbeddingBag``), the predictions are
recorded, then ``loss.backward()`` pushes the rows' gradients and the server applies adagrad to the one
shared array; a local Adam trains the MLP. So every prediction is made before its rating is trained on.
The same model with local full ``nn.Embedding`` tables (torch's Adagrad with the same lr on them, the same
Adam on the MLP, same batches) is replayed beside it, and both get a running AUC over a trailing window.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from service.client import RemoteEmbedding, RemoteEmbeddingBag, RobezClient, RobezClientError

from .model import INIT_SCALE, Embeddings, RatingModel, auc, full_embeddings, full_floats
from .movielens import Ratings

__all__ = ["OnlineConfig", "OnlineResult", "run_online", "serve"]


@dataclass(frozen=True)
class OnlineConfig:
    dim: int = 32
    compression: int = 16
    chunk_size: int = 32
    batch_size: int = 500
    server_lr: float = 0.05  # adagrad, on the server for ROBE-Z and locally for the full tables
    mlp_lr: float = 3e-3
    window: int = 10_000  # ratings in the trailing window of the running AUC
    limit: int | None = None  # replay the first N ratings only (the quick run)
    seed: int = 0
    table_prefix: str = "ml100k_"


@dataclass
class OnlineResult:
    seen: list[int] = field(default_factory=list)  # ratings replayed at each point of the curves
    robez_auc: list[float] = field(default_factory=list)  # trailing-window AUC, served ROBE-Z model
    full_auc: list[float] = field(default_factory=list)  # the same for the local full model
    robez_progressive_auc: float = float("nan")  # AUC of every prediction of the replay
    full_progressive_auc: float = float("nan")
    lookups: int = 0  # lookup requests (one per table per batch)
    pushes: int = 0  # gradient pushes (one per table per batch)
    lookup_seconds: float = 0.0  # wall time of the forward passes of the served model
    push_seconds: float = 0.0  # wall time of its backward passes (the pushes and the MLP's backward)
    replay_seconds: float = 0.0
    memory_size: int = 0
    full_floats: int = 0

    @property
    def lookups_per_s(self) -> float:
        return self.lookups / self.lookup_seconds if self.lookup_seconds else float("nan")

    @property
    def pushes_per_s(self) -> float:
        return self.pushes / self.push_seconds if self.push_seconds else float("nan")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def serve(startup_timeout_s: float = 60.0) -> Iterator[str]:
    """Runs ``robez serve`` (one worker, one kernel thread, no data dir) on a free port; yields the URL."""
    port = _free_port()
    command = [
        sys.executable,
        "-m",
        "service",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--threads-per-worker",
        "1",
        "--log-level",
        "warning",
    ]
    # Only the options above: no data dir, tables file or keys from the caller's environment.
    env = {key: value for key, value in os.environ.items() if not key.startswith("ROBEZ_")}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        with RobezClient(url, timeout=5.0) as client:
            while True:
                if process.poll() is not None:
                    error = process.stderr.read().decode(errors="replace") if process.stderr else ""
                    raise RuntimeError(f"robez serve exited with {process.returncode}: {error[-2000:]}")
                try:
                    client.ready()
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"robez serve not ready after {startup_timeout_s} s") from None
                    time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _remote_embeddings(
    client: RobezClient, data: Ratings, config: OnlineConfig, memory_size: int
) -> Embeddings:
    """One table per field and one for genres on the server, all sharing the first table's array."""
    names = [f"{config.table_prefix}{name}" for name in data.fields] + [f"{config.table_prefix}genres"]
    sizes = [*data.cardinalities, data.num_genres]
    optimizer = {"name": "adagrad", "lr": config.server_lr}
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
    torch.manual_seed(config.seed)
    total = full_floats(data, config.dim)
    memory_size = max(config.chunk_size, total // config.compression)
    client = RobezClient(url)
    try:
        served = RatingModel(_remote_embeddings(client, data, config, memory_size))
        torch.manual_seed(config.seed)
        full = RatingModel(full_embeddings(data, config.dim, torch.Generator().manual_seed(config.seed)))
        full.mlp.load_state_dict(served.mlp.state_dict())  # both start from the same MLP
        served_opt = torch.optim.Adam(served.mlp.parameters(), lr=config.mlp_lr)
        full_opts = [
            torch.optim.Adam(full.mlp.parameters(), lr=config.mlp_lr),
            torch.optim.Adagrad([*full.fields.parameters(), *full.genres.parameters()], lr=config.server_lr),
        ]
        result = OnlineResult(memory_size=memory_size, full_floats=total)
        scores: dict[str, list[torch.Tensor]] = {"robez": [], "full": []}
        labels: list[torch.Tensor] = []
        count = len(data) if config.limit is None else min(config.limit, len(data))
        report_every = max(1, count // config.batch_size // 50)
        started = time.perf_counter()
        for number, start in enumerate(range(0, count, config.batch_size), start=1):
            batch = torch.arange(start, min(start + config.batch_size, count))
            target = data.labels[batch]
            before = time.perf_counter()
            logits = served.predict(data, batch)  # the lookups
            after_lookup = time.perf_counter()
            loss = nn.functional.binary_cross_entropy_with_logits(logits, target)
            served_opt.zero_grad()
            loss.backward()  # the pushes
            served_opt.step()
            result.lookup_seconds += after_lookup - before
            result.push_seconds += time.perf_counter() - after_lookup
            result.lookups += len(served.fields) + 1
            result.pushes += len(served.fields) + 1

            full_logits = full.predict(data, batch)
            full_loss = nn.functional.binary_cross_entropy_with_logits(full_logits, target)
            for optimizer in full_opts:
                optimizer.zero_grad()
            full_loss.backward()
            for optimizer in full_opts:
                optimizer.step()

            scores["robez"].append(logits.detach())
            scores["full"].append(full_logits.detach())
            labels.append(target)
            seen = int(batch[-1]) + 1
            if number % report_every == 0 or seen == count:
                result.seen.append(seen)
                result.robez_auc.append(_trailing_auc(scores["robez"], labels, config.window))
                result.full_auc.append(_trailing_auc(scores["full"], labels, config.window))
                log(
                    f"{seen:6d} ratings: trailing AUC served ROBE-Z {result.robez_auc[-1]:.4f}, "
                    f"local full {result.full_auc[-1]:.4f}"
                )
        result.replay_seconds = time.perf_counter() - started
        all_labels = torch.cat(labels)
        result.robez_progressive_auc = auc(torch.cat(scores["robez"]), all_labels)
        result.full_progressive_auc = auc(torch.cat(scores["full"]), all_labels)
    finally:
        client.close()
    log(
        f"replayed {count} ratings in {result.replay_seconds:.1f} s: {result.lookups_per_s:.0f} lookups/s, "
        f"{result.pushes_per_s:.0f} pushes/s; progressive AUC served {result.robez_progressive_auc:.4f}, "
        f"full {result.full_progressive_auc:.4f}"
    )
    return result
