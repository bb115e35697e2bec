"""Online training against a running robez server: a small click-through model whose user and item
embeddings live in two remote ROBE-Z tables.

    robez serve &                                   # or: make serve / docker compose up
    python examples/online_training.py --steps 300 --plot docs/online_training.png

The data is generated with a planted structure: users and items each belong to one of a few clusters,
and the chance of a click depends on how the two clusters get on (plus a little per-user taste). The
model sees only ids and clicks. Each step looks the batch's rows up from the server (``RemoteEmbedding``),
scores the pairs with a small local MLP, and on ``loss.backward()`` pushes the rows' gradients back:
the server applies each table's own optimizer (adagrad here), while a local Adam trains the MLP.
The held-out loss falls from ln 2 ~ 0.693 (knowing nothing) towards the best loss the planted
probabilities allow, which is printed as well.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from service.client import RemoteEmbedding, RobezClient, RobezClientError


@dataclass(frozen=True)
class Interactions:
    """(user, item) pairs with 0/1 clicks drawn from known click probabilities."""

    users: Tensor  # int64 (N,)
    items: Tensor  # int64 (N,)
    clicks: Tensor  # float32 (N,)
    probabilities: Tensor  # float32 (N,) the planted P(click), used only to report the best loss

    def __len__(self) -> int:
        return int(self.users.shape[0])

    def best_loss(self) -> float:
        """Expected log-loss of a model that knew the planted probabilities (the floor for any model)."""
        p = self.probabilities.clamp(1e-6, 1 - 1e-6)
        return float(-(p * p.log() + (1 - p) * (1 - p).log()).mean())


def planted_interactions(
    num_users: int, num_items: int, num_samples: int, num_clusters: int, generator: torch.Generator
) -> tuple[Interactions, Interactions]:
    """A train and a held-out set (same users and items, disjoint draws) from one planted model.

    P(click | user u, item i) = sigmoid(3 * affinity[cluster(u), cluster(i)] + 0.5 * taste(u) . style(i)),
    with affinity entries +-1, so cluster membership decides most of the signal.
    """
    user_cluster = torch.randint(num_clusters, (num_users,), generator=generator)
    item_cluster = torch.randint(num_clusters, (num_items,), generator=generator)
    affinity = torch.randint(2, (num_clusters, num_clusters), generator=generator).float() * 2 - 1
    taste = torch.randn(num_users, 4, generator=generator)
    style = torch.randn(num_items, 4, generator=generator)

    def draw(count: int) -> Interactions:
        users = torch.randint(num_users, (count,), generator=generator)
        items = torch.randint(num_items, (count,), generator=generator)
        logits = 3 * affinity[user_cluster[users], item_cluster[items]] + 0.5 * (
            taste[users] * style[items]
        ).sum(1)
        probabilities = torch.sigmoid(logits)
        clicks = (torch.rand(count, generator=generator) < probabilities).float()
        return Interactions(users, items, clicks, probabilities)

    return draw(num_samples), draw(max(1024, num_samples // 10))


class ClickModel(nn.Module):
    """Remote user and item embeddings -> local MLP over [u, v, u * v] -> click logit.

    Shape: users (B,), items (B,) int64 -> logits (B,).
    """

    def __init__(self, users: RemoteEmbedding, items: RemoteEmbedding, hidden: int = 32) -> None:
        super().__init__()
        self.users = users
        self.items = items
        dim = users.embedding_dim
        self.mlp = nn.Sequential(nn.Linear(3 * dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, users: Tensor, items: Tensor) -> Tensor:
        u = self.users(users)
        v = self.items(items)
        return self.mlp(torch.cat([u, v, u * v], dim=1)).squeeze(1)


def ensure_table(client: RobezClient, name: str, num_embeddings: int, args: argparse.Namespace) -> None:
    """Creates ``name`` unless it exists (``--reset``: recreates it); checks the dim of an existing one."""
    embedding_dim = args.dim
    try:
        info = client.table(name)
    except RobezClientError as error:
        if error.status != 404:
            raise
        info = None
    if info is not None and args.reset:
        client.delete_table(name)
        info = None
    if info is not None:
        dim = int(info.get("config", info)["embedding_dim"])
        if dim != embedding_dim:
            raise SystemExit(
                f"table {name!r} exists with embedding_dim {dim}, not {embedding_dim}; use --reset"
            )
        return
    memory_size = max(1024, int(num_embeddings * embedding_dim / args.compression))
    config = {
        "num_embeddings": num_embeddings,
        "embedding_dim": embedding_dim,
        "memory_size": memory_size,
        "chunk_size": args.chunk_size,
    }
    client.create_table(name, config, {"name": args.server_optimizer, "lr": args.server_lr})


@dataclass
class History:
    """Per-step training losses and periodic held-out losses, for printing, JSON and the plot."""

    best_loss: float
    train_loss: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)  # wall time of each step, client side
    server_push_ms: list[float] = field(default_factory=list)  # both pushes, as the server timed them


def evaluate(model: ClickModel, data: Interactions) -> float:
    """Mean held-out log-loss; under no_grad, so nothing is pushed to the server."""
    with torch.no_grad():
        logits = model(data.users, data.items)
        return float(nn.functional.binary_cross_entropy_with_logits(logits, data.clicks))


def train(args: argparse.Namespace) -> History:
    generator = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    train_data, eval_data = planted_interactions(
        args.users, args.items, args.samples, args.clusters, generator
    )
    client = RobezClient(args.url, api_key=args.api_key)
    user_table, item_table = f"{args.table_prefix}users", f"{args.table_prefix}items"
    ensure_table(client, user_table, args.users, args)
    ensure_table(client, item_table, args.items, args)
    model = ClickModel(
        RemoteEmbedding(client, user_table, embedding_dim=args.dim),
        RemoteEmbedding(client, item_table, embedding_dim=args.dim),
    )
    # Only the MLP is local; the embeddings have no local parameters and are trained by the server.
    optimizer = torch.optim.Adam(model.parameters(), lr=args.mlp_lr)
    history = History(best_loss=eval_data.best_loss())
    history.eval_steps.append(0)
    history.eval_loss.append(evaluate(model, eval_data))
    print(
        f"{len(train_data)} interactions, {args.users} users x {args.items} items, {args.clusters} clusters; "
        f"held-out loss {history.eval_loss[0]:.4f} (best possible {history.best_loss:.4f})",
        flush=True,
    )
    for step in range(1, args.steps + 1):
        started = time.perf_counter()
        batch = torch.randint(len(train_data), (args.batch_size,), generator=generator)
        logits = model(train_data.users[batch], train_data.items[batch])
        loss = nn.functional.binary_cross_entropy_with_logits(logits, train_data.clicks[batch])
        optimizer.zero_grad()
        loss.backward()  # pushes both tables' gradients; the server applies adagrad
        optimizer.step()
        step_ms = 1000 * (time.perf_counter() - started)
        # What the server spent applying the two pushes (its Server-Timing), out of the step's wall time.
        server_ms = model.users.last_push_timing.get("total", 0.0) + model.items.last_push_timing.get(
            "total", 0.0
        )
        loss_value = float(loss.detach())
        history.train_loss.append(loss_value)
        history.step_ms.append(step_ms)
        history.server_push_ms.append(server_ms)
        line = (
            f"step {step:4d}/{args.steps}  loss {loss_value:.4f}  {step_ms:6.1f} ms "
            f"(server push {server_ms:5.2f} ms)  "
            f"versions users={model.users.last_version} items={model.items.last_version}"
        )
        if step % args.eval_every == 0 or step == args.steps:
            history.eval_steps.append(step)
            history.eval_loss.append(evaluate(model, eval_data))
            line += f"  held-out {history.eval_loss[-1]:.4f}"
        print(line, flush=True)
    first, last = history.eval_loss[0], history.eval_loss[-1]
    print(f"held-out loss {first:.4f} -> {last:.4f} (best possible {history.best_loss:.4f})", flush=True)
    print(
        f"median step {statistics.median(history.step_ms):.1f} ms, of which the server's two pushes "
        f"{statistics.median(history.server_push_ms):.2f} ms (Server-Timing)",
        flush=True,
    )
    client.close()
    return history


def plot(history: History, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    steps = range(1, len(history.train_loss) + 1)
    window = 20
    smoothed = [
        sum(history.train_loss[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1))
        for i in range(len(history.train_loss))
    ]
    axes.plot(
        steps, history.train_loss, color="tab:blue", alpha=0.25, linewidth=0.8, label="train (per step)"
    )
    axes.plot(steps, smoothed, color="tab:blue", label=f"train ({window}-step mean)")
    axes.plot(history.eval_steps, history.eval_loss, "o-", color="tab:orange", markersize=3, label="held-out")
    axes.axhline(math.log(2), color="gray", linestyle=":", label="ln 2 (knows nothing)")
    axes.axhline(history.best_loss, color="tab:green", linestyle="--", label="best possible (planted)")
    axes.set_xlabel("step (one gradient push per table)")
    axes.set_ylabel("log-loss")
    axes.set_title("examples/online_training.py: embeddings trained by the robez server")
    axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="robez server")
    parser.add_argument("--api-key", default=None, help="write key, if the server has ROBEZ_API_KEY set")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--eval-every", type=int, default=25, help="steps between held-out evaluations")
    parser.add_argument("--users", type=int, default=1000)
    parser.add_argument("--items", type=int, default=500)
    parser.add_argument("--clusters", type=int, default=8)
    parser.add_argument("--samples", type=int, default=100_000, help="training interactions generated")
    parser.add_argument("--dim", type=int, default=16, help="embedding_dim of both tables")
    parser.add_argument("--compression", type=float, default=2.0, help="n*d / memory_size of new tables")
    parser.add_argument("--chunk-size", type=int, default=8, help="Z of new tables")
    parser.add_argument("--server-optimizer", choices=["sgd", "adagrad", "adam"], default="adagrad")
    parser.add_argument("--server-lr", type=float, default=0.3, help="lr of new tables' optimizer")
    parser.add_argument("--mlp-lr", type=float, default=0.01, help="local Adam lr of the MLP")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--table-prefix", default="example_", help="tables are <prefix>users, <prefix>items")
    parser.add_argument("--reset", action="store_true", help="delete and recreate the tables first")
    parser.add_argument("--plot", type=Path, default=None, help="write the loss curve (PNG) here")
    parser.add_argument("--history", type=Path, default=None, help="write the losses (JSON) here")
    args = parser.parse_args(argv)
    if not 1 <= args.steps <= 100_000:
        parser.error("--steps must be in [1, 100000]")
    if args.eval_every < 1:
        parser.error("--eval-every must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    history = train(args)
    if args.history is not None:
        args.history.write_text(json.dumps(history.__dict__, indent=1))
    if args.plot is not None:
        plot(history, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
