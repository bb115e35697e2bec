"""Train a small model with ROBE-Z embeddings locally, then keep the table as a checkpoint.

Two tables (users and items) share one ROBE-Z array, as in the paper's DLRM setup, each with its own
``val_offset``. The model scores a (user, item) pair by the dot product of their rows and learns
synthetic ratings generated from hidden factors, so the loss has something real to go down to.

    python examples/train_local.py [--sparse] [--steps 200]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from robez_core import OptimizerConfig, RobezEmbedding, Table

NUM_USERS, NUM_ITEMS, EMBEDDING_DIM = 100_000, 50_000, 32
MEMORY_SIZE = 1 << 18  # 262,144 floats (1 MiB) for 150,000 x 32 logical values: ~18x compression


class PairModel(nn.Module):
    """score(user, item) = <user row, item row>; both tables read one shared ROBE-Z array."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.users = RobezEmbedding(NUM_USERS, EMBEDDING_DIM, MEMORY_SIZE, chunk_size=32, sparse=sparse)
        # The item table shares the array; its offset keeps item x apart from user x.
        self.items = RobezEmbedding(
            NUM_ITEMS,
            EMBEDDING_DIM,
            weight=self.users.weight,
            chunk_size=32,
            val_offset=NUM_USERS,
            sparse=sparse,
        )

    def forward(self, pairs: torch.Tensor) -> torch.Tensor:
        """pairs int64 (B, 2) of (user id, item id) -> scores float32 (B,)."""
        return (self.users(pairs[:, 0]) * self.items(pairs[:, 1])).sum(dim=1)


def synthetic_batch(generator: torch.Generator, batch_size: int, factors: tuple[torch.Tensor, torch.Tensor]):
    """Random pairs and their ratings from hidden rank-4 factors (the signal the model must find)."""
    users = torch.randint(0, 2000, (batch_size,), generator=generator)  # a hot subset: learnable quickly
    items = torch.randint(0, 1000, (batch_size,), generator=generator)
    ratings = (factors[0][users] * factors[1][items]).sum(dim=1)
    return torch.stack([users, items], dim=1), ratings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sparse", action="store_true", help="sparse gradients + SparseAdam")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=4096)
    args = parser.parse_args()

    generator = torch.Generator().manual_seed(0)
    factors = (torch.randn(2000, 4, generator=generator), torch.randn(1000, 4, generator=generator))
    model = PairModel(sparse=args.sparse)
    print(model)
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,} floats (one shared array)")
    optimizer: torch.optim.Optimizer = (
        torch.optim.SparseAdam(model.parameters(), lr=0.01)
        if args.sparse
        else torch.optim.Adam(model.parameters(), lr=0.01, fused=True)  # one pass over the array per step
    )

    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        pairs, ratings = synthetic_batch(generator, args.batch_size, factors)
        loss = F.mse_loss(model(pairs), ratings)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 1 or step % 50 == 0 or step == args.steps:
            print(f"step {step:4d}  loss {loss.item():.4f}")
    print(f"{args.steps} steps in {time.perf_counter() - started:.2f} s")

    # Hand the trained array to the serving side: a Table shares it and checkpoints it (safetensors).
    table = Table.from_module(model.users, OptimizerConfig("adagrad", lr=0.05))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "users.safetensors"
        table.save(path)
        restored = Table.load(path)
        ids = torch.arange(5)
        assert torch.equal(restored.lookup(ids), model.users(ids).detach())
        print(f"checkpoint {path.name}: {path.stat().st_size:,} bytes, restored rows match")


if __name__ == "__main__":
    main()
