"""``least_squares_array`` / ``from_pretrained``: the compressed array is the least-squares fit."""

from __future__ import annotations

import pytest
import torch

from robez_core import ConfigError, RobezEmbedding, RobezEmbeddingBag
from robez_core.compress import least_squares_array
from robez_core.init import init_weight


def _locations(module: RobezEmbedding) -> torch.Tensor:
    """Array location of every value of every row: int64 (n, d)."""
    offsets = module.hash_ids(torch.arange(module.num_embeddings))  # (n, C)
    column = torch.arange(module.embedding_dim)
    return offsets[:, column // module.chunk_size] + column % module.chunk_size


@pytest.mark.parametrize(("chunk_size", "hash"), [(4, "paper"), (1, "paper"), (3, "fast"), (16, "paper")])
def test_matches_a_dense_least_squares_solve(chunk_size: int, hash: str) -> None:
    torch.manual_seed(0)
    full = torch.randn(40, 10)
    memory_size = 64
    module = RobezEmbedding.from_pretrained(full, memory_size, chunk_size=chunk_size, hash=hash, seed=3)
    locations = _locations(module).reshape(-1)
    design = torch.zeros(full.numel(), memory_size, dtype=torch.float64)
    design[torch.arange(full.numel()), locations] = 1.0
    solution = torch.linalg.lstsq(design, full.reshape(-1, 1).double(), driver="gelsd").solution.squeeze(1)
    hit = torch.bincount(locations, minlength=memory_size) > 0
    assert hit.sum() > memory_size // 2  # the test exercises many shared slots
    torch.testing.assert_close(module.weight.detach()[hit].double(), solution[hit], rtol=1e-5, atol=1e-5)
    # Slots nothing maps to keep the initial array's values.
    torch.testing.assert_close(module.weight.detach()[~hit], init_weight(memory_size, seed=3)[~hit])
    # And it is no worse than the dense solution at reproducing the table.
    error = (module(torch.arange(40)) - full).square().sum()
    best = (design @ solution - full.reshape(-1).double()).square().sum()
    assert float(error) <= float(best) * (1 + 1e-4) + 1e-6


def test_a_table_read_from_an_array_is_recovered_exactly() -> None:
    source = RobezEmbedding(300, 24, memory_size=500, chunk_size=8, seed=7, init_scale=1.0)
    full = source(torch.arange(300)).detach()
    rebuilt = RobezEmbedding.from_pretrained(full, 500, chunk_size=8, seed=7)
    torch.testing.assert_close(rebuilt(torch.arange(300)), full)


def test_tables_sharing_one_array_fit_all_their_values() -> None:
    torch.manual_seed(1)
    users, items = torch.randn(30, 8), torch.randn(50, 8)
    array = least_squares_array([users, items], 96, val_offsets=[0, 30], chunk_size=4, block_rows=7)
    u = RobezEmbedding(30, 8, weight=array.clone(), chunk_size=4)
    i = RobezEmbedding(50, 8, weight=u.weight, chunk_size=4, val_offset=30)
    locations = torch.cat([_locations(u).reshape(-1), _locations(i).reshape(-1)])
    values = torch.cat([users.reshape(-1), items.reshape(-1)])
    sums = torch.zeros(96, dtype=torch.float64).index_add_(0, locations, values.double())
    counts = torch.bincount(locations, minlength=96)
    hit = counts > 0
    torch.testing.assert_close(array[hit].double(), sums[hit] / counts[hit], rtol=1e-5, atol=1e-6)


def test_bag_freeze_and_options() -> None:
    full = torch.randn(20, 6)
    bag = RobezEmbeddingBag.from_pretrained(full, 40, chunk_size=2, mode="sum", freeze=False, sparse=True)
    assert isinstance(bag, RobezEmbeddingBag) and bag.mode == "sum" and bag.sparse
    assert bag.weight.requires_grad
    frozen = RobezEmbedding.from_pretrained(full, 40, chunk_size=2)
    assert not frozen.weight.requires_grad  # torch's from_pretrained default
    torch.testing.assert_close(bag.weight.detach(), frozen.weight.detach())


def test_bad_input_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        RobezEmbedding.from_pretrained(torch.randn(10), 40)
    with pytest.raises(ConfigError):
        least_squares_array([torch.randn(4, 3), torch.randn(4, 5)], 40)
    with pytest.raises(ConfigError):
        least_squares_array([torch.randn(4, 3)], 40, val_offsets=[0, 1])
    with pytest.raises(ConfigError):
        least_squares_array([torch.randn(4, 3)], 2, chunk_size=4)
