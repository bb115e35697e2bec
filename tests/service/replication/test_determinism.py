"""Replicas at the same version must be bitwise identical even when they run different kernel thread
counts: the same updates applied with 1 and with 2 threads must give the same bytes.

The updates are big enough (4096 rows x 64 = 262,144 values) to take the kernels' parallel paths, which
start at 64k values. (It passes on this branch as of the kernels' coalesce-then-apply design; if a kernel
change makes it fail, that kernel broke a promise replicas rely on: docs/replication.md.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from robez_core.config import OptimizerConfig, TableConfig
from robez_core.table import Table

CONFIG = TableConfig(num_embeddings=1_000_000, embedding_dim=64, memory_size=1 << 16, chunk_size=16)


@pytest.fixture
def restore_threads() -> Iterator[None]:
    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)


def _apply(optimizer: OptimizerConfig, threads: int) -> dict[str, torch.Tensor]:
    torch.set_num_threads(threads)
    table = Table(CONFIG, optimizer)
    generator = torch.Generator().manual_seed(11)
    for _ in range(4):
        ids = torch.randint(0, CONFIG.num_embeddings, (4096,), generator=generator)
        ids[:512] = ids[512:1024]  # duplicates: their gradients are summed, in some order
        grads = torch.randn(4096, CONFIG.embedding_dim, generator=generator)
        table.apply_gradients(ids, grads)
    return {key: tensor.clone() for key, tensor in table.tensors().items()}


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_same_updates_same_bytes_with_1_and_2_threads(optimizer: str, restore_threads: None) -> None:
    config = OptimizerConfig(name=optimizer, lr=0.05)  # type: ignore[arg-type]
    one = _apply(config, 1)
    two = _apply(config, 2)
    for key in one:
        assert torch.equal(one[key].view(torch.uint8), two[key].view(torch.uint8)), (
            f"{optimizer}: {key} differs"
        )
