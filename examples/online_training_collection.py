"""Online training of a whole recommendation model's embeddings on a running robez server: every
categorical feature's table in one ROBE-Z array on the server, trained through a
``RemoteEmbeddingBagCollection`` (one pull and one push per step, whatever the number of features).

    robez serve &                       # no --data-dir: tables sharing one array live in memory
    python examples/online_training_collection.py --steps 200 [--prefetch]

The data is generated with a planted click model: each of F categorical features has Zipf-distributed
ids, and each (feature, id) carries a fixed hidden score; P(click) = sigmoid(sum of the scores of the
sample's ids + a dense part). The model: the collection pools each feature's bag (sum) into d values,
a local MLP turns [dense features, pooled embeddings] into a logit. The server applies Adagrad to the
shared array (the step a local ``RobezEmbeddingBagCollection`` would make, bit for bit); a local Adam
trains the MLP. ``--prefetch`` pulls the next batch's rows while this batch computes and lets one push
be in flight (rows one step stale, see docs/online_training.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from robez_core import EmbeddingBagConfig, OptimizerConfig
from service.client import RemoteEmbeddingBagCollection, RobezClient, RobezClientError


@dataclass(frozen=True)
class Batch:
    """A key-major jagged batch (the collection's input) with its dense features and clicks."""

    keys: list[str]
    values: Tensor  # int64 (F * B,): feature f's ids are values[f * B:(f + 1) * B]
    lengths: Tensor  # int64 (F * B,): one id per feature per sample
    dense: Tensor  # float32 (B, 4)
    clicks: Tensor  # float32 (B,)


class PlantedClicks:
    """Batches drawn from a fixed click model; ``batch(i)`` is the same for the same seed and i."""

    def __init__(self, cardinalities: list[int], seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.cardinalities = cardinalities
        self.scores = [torch.randn(n, generator=generator) * 0.6 for n in cardinalities]
        self.dense_weights = torch.randn(4, generator=generator) * 0.5
        self.seed = seed

    def batch(self, index: int, size: int) -> Batch:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        values, logit = [], torch.randn(size, 4, generator=generator)
        dense = logit.clone()
        logit = dense @ self.dense_weights - 0.5
        for scores, n in zip(self.scores, self.cardinalities, strict=True):
            # Zipf-like: a few hot ids, a long tail
            ids = (torch.rand(size, generator=generator) ** 3 * n).long().clamp(max=n - 1)
            logit = logit + scores[ids]
            values.append(ids)
        clicks = (torch.rand(size, generator=generator) < torch.sigmoid(logit)).float()
        keys = [f"f{i}" for i in range(len(self.cardinalities))]
        lengths = torch.ones(size * len(keys), dtype=torch.int64)
        return Batch(keys, torch.cat(values), lengths, dense, clicks)


def tables_of(cardinalities: list[int], dim: int) -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(f"ctr_t{i}", n, dim, [f"f{i}"]) for i, n in enumerate(cardinalities)]


def ensure_tables(client: RobezClient, tables: list[EmbeddingBagConfig], args: argparse.Namespace) -> None:
    """Creates the model's tables over one shared array unless they exist (``--reset`` recreates them)."""
    existing = {info["name"] for info in client.tables()}
    names = [table.name for table in tables]
    if args.reset:
        for name in reversed(names):
            if name in existing:
                client.delete_table(name)
        existing = set()
    if all(name in existing for name in names):
        return
    if any(name in existing for name in names):
        raise SystemExit(f"some of {names} exist and some do not; run with --reset")
    memory_size = max(4096, sum(t.num_embeddings for t in tables) * args.dim // args.compression)
    RemoteEmbeddingBagCollection.create_tables(
        client, tables, memory_size=memory_size, optimizer=OptimizerConfig("adagrad", lr=args.server_lr)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--features", type=int, default=8)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--compression", type=int, default=8, help="sum of table rows * d / array floats")
    parser.add_argument("--server-lr", type=float, default=0.05)
    parser.add_argument("--mlp-lr", type=float, default=3e-3)
    parser.add_argument("--prefetch", action="store_true", help="pull ahead, one push in flight")
    parser.add_argument("--reset", action="store_true", help="recreate the tables (fresh embeddings)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    cardinalities = [int(100 * 4**i) for i in range(args.features)]  # 100 .. 1.6M rows
    data = PlantedClicks(cardinalities, args.seed)
    tables = tables_of(cardinalities, args.dim)
    client = RobezClient(args.url, api_key=args.api_key)
    try:
        ensure_tables(client, tables, args)
    except RobezClientError as error:
        raise SystemExit(f"creating the tables failed: {error}") from error
    mlp = nn.Sequential(nn.Linear(4 + args.features * args.dim, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.Adam(mlp.parameters(), lr=args.mlp_lr)
    loss_fn = nn.BCEWithLogitsLoss()
    held_out = [data.batch(10**6 + i, args.batch_size) for i in range(4)]

    def logits_of(ebc: RemoteEmbeddingBagCollection, batch: Batch) -> Tensor:
        pooled = ebc(keys=batch.keys, values=batch.values, lengths=batch.lengths)  # (B, F * d)
        return mlp(torch.cat([batch.dense, pooled.values()], dim=1)).squeeze(1)

    def evaluate(ebc: RemoteEmbeddingBagCollection) -> float:
        with torch.no_grad():  # nothing is pushed
            return statistics.fmean(float(loss_fn(logits_of(ebc, b), b.clicks)) for b in held_out)

    pending = 1 if args.prefetch else 0
    step_ms: list[float] = []
    with RemoteEmbeddingBagCollection(client, tables, max_pending_pushes=pending) as ebc:
        first = evaluate(ebc)
        print(
            f"{args.features} features, {sum(cardinalities):,} rows on the server; held-out loss {first:.4f}"
        )
        ebc.reset_stats()
        batch = data.batch(0, args.batch_size)
        for step in range(args.steps):
            start = time.perf_counter()
            next_batch = data.batch(step + 1, args.batch_size)
            logits = logits_of(ebc, batch)  # one pull (none when prefetched)
            if args.prefetch and step + 1 < args.steps:  # the next rows come while this batch computes
                ebc.prefetch(keys=next_batch.keys, values=next_batch.values, lengths=next_batch.lengths)
            loss = loss_fn(logits, batch.clicks)
            optimizer.zero_grad()
            loss.backward()  # the MLP's gradients, and one push of every feature's rows' gradients
            optimizer.step()
            step_ms.append((time.perf_counter() - start) * 1e3)
            if (step + 1) % 50 == 0 or step + 1 == args.steps:
                print(f"step {step + 1}: train loss {loss.item():.4f}, {step_ms[-1]:.1f} ms", flush=True)
            batch = next_batch
        ebc.flush()  # every push applied (a failed one is raised here)
        stats = ebc.reset_stats()
        last = evaluate(ebc)
    print(f"held-out loss {first:.4f} -> {last:.4f}")
    print(
        f"median step {statistics.median(step_ms):.1f} ms; "
        f"{stats.requests / args.steps:.2f} requests a step; "
        f"server time {stats.server_ms / args.steps:.2f} ms a step (Server-Timing)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
