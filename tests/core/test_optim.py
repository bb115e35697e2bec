"""Server-side fused optimizer steps against the reference path and torch.optim."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from robez_core import ConfigError, InvalidInputError, OptimizerConfig, RobezEmbedding, optim, reference
from robez_core.hashing import paper_random_numbers

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")


def test_state_layout_per_optimizer() -> None:
    m = 123
    assert optim.state_layout(OptimizerConfig("sgd"), m) == {}
    assert optim.state_layout(OptimizerConfig("adagrad"), m) == {"sum": ((m,), torch.float32)}
    assert optim.state_layout(OptimizerConfig("adam"), m) == {
        "exp_avg": ((m,), torch.float32),
        "exp_avg_sq": ((m,), torch.float32),
        "step": ((1,), torch.int64),
    }


def test_init_state_uses_initial_accumulator() -> None:
    state = optim.init_state(OptimizerConfig("adagrad", initial_accumulator_value=0.25), 10)
    assert torch.equal(state["sum"], torch.full((10,), 0.25))
    adam = optim.init_state(OptimizerConfig("adam"), 10)
    assert int(adam["step"]) == 0 and not bool(adam["exp_avg"].any())


@pytest.mark.parametrize(
    "state",
    [
        {},
        {"sum": torch.zeros(10), "extra": torch.zeros(10)},
        {"sum": torch.zeros(11)},
        {"sum": torch.zeros(10, dtype=torch.float64)},
        {"sum": torch.zeros(20)[::2]},
    ],
)
def test_validate_state_rejects_wrong_layout(state: dict[str, torch.Tensor]) -> None:
    with pytest.raises(ConfigError):
        optim.validate_state(OptimizerConfig("adagrad"), 10, state)


def _hashed(ids: torch.Tensor, d: int, z: int, m: int) -> torch.Tensor:
    return reference.chunk_offsets(ids, -(-d // z), z, m, paper_random_numbers(1024))


@settings(max_examples=20, deadline=None)
@given(
    name=st.sampled_from(["sgd", "adagrad", "adam"]),
    embedding_dim=st.integers(1, 40),
    chunk_size=st.integers(1, 16),
    extra_memory=st.sampled_from([0, 5, 300, 100_000]),
    num_ids=st.integers(0, 30),
    seed=st.integers(0, 1000),
)
def test_fused_update_equals_reference(
    name: str, embedding_dim: int, chunk_size: int, extra_memory: int, num_ids: int, seed: int
) -> None:
    d, z = embedding_dim, chunk_size
    m = z + extra_memory
    config = OptimizerConfig(name, lr=0.05, initial_accumulator_value=0.1)
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(m, generator=gen)
    ours_weight, ours_state = weight.clone(), optim.init_state(config, m)
    ref_weight, ref_state = weight.clone(), optim.init_state(config, m)
    for _ in range(3):
        ids = torch.randint(0, 8, (num_ids,), generator=gen)  # few distinct ids: many duplicates
        grads = torch.randn(num_ids, d, generator=gen)
        offsets = _hashed(ids, d, z, m)
        optim.fused_update(config, ours_weight, ours_state, offsets, grads, z)
        indices = reference.offsets_to_indices(offsets, d, z)
        reference.apply_gradients(
            ref_weight, ref_state, name, indices, grads, lr=config.lr, betas=config.betas, eps=config.eps
        )
    # Up to 30 x 40 gradient values land on one location when m is tiny; the kernel and the reference
    # add them in different orders, so float32 rounding differs by a few ulps of the sum.
    torch.testing.assert_close(ours_weight, ref_weight, rtol=1e-4, atol=1e-4)
    for key in ours_state:
        torch.testing.assert_close(ours_state[key], ref_state[key], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("name", "make_torch_optimizer"),
    [
        ("sgd", lambda p: torch.optim.SGD(p, lr=0.05)),
        ("adagrad", lambda p: torch.optim.Adagrad(p, lr=0.05, initial_accumulator_value=0.1, eps=1e-8)),
        ("adam", lambda p: torch.optim.SparseAdam(p, lr=0.05, betas=(0.9, 0.999), eps=1e-8)),
    ],
)
def test_fused_update_equals_torch_optim_on_the_sparse_grad(name: str, make_torch_optimizer) -> None:
    """The service's update == a module's sparse backward + the matching torch.optim step."""
    d, z, m = 20, 8, 4000
    module = RobezEmbedding(1000, d, m, chunk_size=z, sparse=True)
    opt = make_torch_optimizer([module.weight])
    config = OptimizerConfig(name, lr=0.05, initial_accumulator_value=0.1, eps=1e-8)
    weight = module.weight.detach().clone()
    state = optim.init_state(config, m)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        ids = torch.randint(0, 20, (50,), generator=gen)
        grads = torch.randn(50, d, generator=gen)
        opt.zero_grad()
        (module(ids) * grads).sum().backward()
        opt.step()
        optim.fused_update(config, weight, state, module.hash_ids(ids), grads, z)
    torch.testing.assert_close(weight, module.weight.detach(), rtol=1e-5, atol=1e-6)


def test_large_array_update_touches_only_hashed_locations() -> None:
    """m far above N * d: the sorted coalesce path; nothing outside the hashed blocks moves."""
    d, z, m = 16, 8, 20_000_000
    config = OptimizerConfig("adam", lr=0.1)
    weight = torch.zeros(m)
    state = optim.init_state(config, m)
    ids = torch.tensor([1, 2, 1])
    offsets = _hashed(ids, d, z, m)
    optim.fused_update(config, weight, state, offsets, torch.ones(3, d), z)
    touched = torch.unique(reference.offsets_to_indices(offsets, d, z))
    moved = torch.nonzero(weight).reshape(-1)
    assert torch.equal(moved, touched)
    assert torch.equal(torch.nonzero(state["exp_avg"]).reshape(-1), touched)
    assert int(state["step"]) == 1


def test_lr_override_and_bad_lr() -> None:
    config = OptimizerConfig("sgd", lr=1.0)
    weight = torch.zeros(100)
    offsets = _hashed(torch.tensor([3]), 4, 4, 100)
    optim.fused_update(config, weight, {}, offsets, torch.ones(1, 4), 4, lr=0.5)
    assert sorted(weight[weight != 0].tolist()) == [-0.5] * 4
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidInputError):
            optim.fused_update(config, weight, {}, offsets, torch.ones(1, 4), 4, lr=bad)
