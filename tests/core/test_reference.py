"""The reference path is the oracle, so it is itself checked against independent computations:
the formula evaluated with Python integers, ``F.embedding_bag`` on the materialised table, and
``torch.optim`` steps on the same gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from robez_core import reference
from robez_core.hashing import PAPER_PRIME, paper_random_numbers

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")


def _wrap(value: int) -> int:
    """Python int -> int64 two's-complement value."""
    return ((value - INT64_MIN) % (1 << 64)) + INT64_MIN


def _paper_index(x: int, j: int, *, chunk_size: int, memory_size: int, val_offset: int, rn: list[int]) -> int:
    """idx(x, j) of the issue's formula with Python's exact integers (floor mod, explicit wrap)."""
    key = _wrap(x + val_offset)
    h = _wrap(_wrap(key * rn[3]) + _wrap((j // chunk_size) * rn[2]) + rn[1])
    return (h % rn[0]) % (memory_size - chunk_size + 1) + j % chunk_size


@settings(max_examples=40, deadline=None)
@given(
    ids=st.lists(st.integers(INT64_MIN, INT64_MAX), min_size=1, max_size=8),
    embedding_dim=st.integers(1, 40),
    chunk_size=st.integers(1, 16),
    extra_memory=st.integers(0, 5000),
    val_offset=st.integers(INT64_MIN, INT64_MAX),
    seed=st.integers(0, 2**32 - 1),
)
def test_lookup_matches_python_integer_formula(
    ids: list[int], embedding_dim: int, chunk_size: int, extra_memory: int, val_offset: int, seed: int
) -> None:
    memory_size = chunk_size + extra_memory
    rn_tensor = paper_random_numbers(seed)
    rn = rn_tensor.tolist()
    weight = torch.arange(memory_size, dtype=torch.float32)  # value == its own index (exact below 2**24)
    rows = reference.lookup(
        weight, torch.tensor(ids), embedding_dim, chunk_size, rn_tensor, val_offset, "paper"
    )
    expected = [
        [
            _paper_index(x, j, chunk_size=chunk_size, memory_size=memory_size, val_offset=val_offset, rn=rn)
            for j in range(embedding_dim)
        ]
        for x in ids
    ]
    assert rows.dtype == torch.float32
    assert rows.to(torch.int64).tolist() == expected


def test_paper_constants_are_the_papers() -> None:
    rn = paper_random_numbers(1024)
    assert rn.tolist()[0] == PAPER_PRIME
    assert rn.shape == (11,)


def _materialised(
    weight: torch.Tensor, num_rows: int, d: int, z: int, rn: torch.Tensor, off: int
) -> torch.Tensor:
    return reference.lookup(weight, torch.arange(num_rows), d, z, rn, off)


@settings(max_examples=25, deadline=None)
@given(
    bag_sizes=st.lists(st.integers(0, 5), min_size=1, max_size=6),
    mode=st.sampled_from(["sum", "mean"]),
    weighted=st.booleans(),
    embedding_dim=st.integers(1, 20),
    chunk_size=st.integers(1, 8),
    data=st.data(),
)
def test_bag_matches_embedding_bag_on_materialised_table(
    bag_sizes: list[int], mode: str, weighted: bool, embedding_dim: int, chunk_size: int, data: st.DataObject
) -> None:
    num_rows, memory_size, val_offset = 30, 97, 5
    rn = paper_random_numbers(7)
    weight = torch.randn(memory_size, generator=torch.Generator().manual_seed(0))
    num_ids = sum(bag_sizes)
    ids = torch.tensor(data.draw(st.lists(st.integers(0, num_rows - 1), min_size=num_ids, max_size=num_ids)))
    ids = ids.to(torch.int64).reshape(-1)
    starts = torch.tensor([0, *bag_sizes[:-1]]).cumsum(0)
    bounds = torch.cat([starts, torch.tensor([num_ids])])
    psw = torch.rand(num_ids) if weighted and mode == "sum" else None
    pooled = reference.lookup_bag(
        weight, ids, bounds, psw, mode, embedding_dim, chunk_size, rn, val_offset, "paper"
    )
    table = _materialised(weight, num_rows, embedding_dim, chunk_size, rn, val_offset)
    expected = F.embedding_bag(ids, table, starts, mode=mode, per_sample_weights=psw)
    torch.testing.assert_close(pooled, expected)


def test_dense_and_sparse_grads_match_autograd_of_indexing() -> None:
    d, z, m = 13, 4, 50
    rn = paper_random_numbers(3)
    weight = torch.randn(m, requires_grad=True)
    ids = torch.tensor([5, -1, 5, 1 << 40])
    grad_rows = torch.randn(len(ids), d)

    idx = reference.offsets_to_indices(reference.chunk_offsets(ids, 4, z, m, rn), d, z)
    (weight[idx] * grad_rows).sum().backward()
    assert weight.grad is not None
    expected = weight.grad.clone()

    dense_weight = weight.detach().clone().requires_grad_()
    (reference.lookup(dense_weight, ids, d, z, rn) * grad_rows).sum().backward()
    assert dense_weight.grad is not None and not dense_weight.grad.is_sparse
    torch.testing.assert_close(dense_weight.grad, expected)

    sparse_weight = weight.detach().clone().requires_grad_()
    rows = reference.lookup(sparse_weight, ids, d, z, rn, sparse=True)
    # autograd.grad hands back the Function's own tensor (``.grad`` storage would drop the flag)
    (grad,) = torch.autograd.grad((rows * grad_rows).sum(), sparse_weight)
    assert grad is not None and grad.is_sparse and grad.is_coalesced()
    torch.testing.assert_close(grad.to_dense(), expected)


def test_coalesce_sums_duplicates_sorted() -> None:
    indices = torch.tensor([[3, 1], [3, 7]])
    grads = torch.tensor([[1.0, 2.0], [10.0, 5.0]])
    locations, values = reference.coalesce_grad(grads, indices)
    assert locations.tolist() == [1, 3, 7]
    assert values.tolist() == [2.0, 11.0, 5.0]


def _sparse(locations: torch.Tensor, values: torch.Tensor, m: int) -> torch.Tensor:
    return torch.sparse_coo_tensor(locations.unsqueeze(0), values, (m,), check_invariants=True)


def test_optimizer_steps_match_torch_optim() -> None:
    m = 20
    gen = torch.Generator().manual_seed(1)
    start = torch.randn(m, generator=gen)
    locations = torch.tensor([0, 4, 5, 19])
    steps = [torch.randn(4, generator=gen) for _ in range(3)]

    def run(make_opt, ours) -> None:
        param = torch.nn.Parameter(start.clone())
        opt = make_opt([param])
        weight = start.clone()
        for values in steps:
            param.grad = _sparse(locations, values, m)
            opt.step()
            ours(weight, values)
        torch.testing.assert_close(weight, param.detach(), rtol=1e-6, atol=1e-6)

    run(lambda p: torch.optim.SGD(p, lr=0.1), lambda w, g: reference.sgd_step(w, locations, g, 0.1))
    state_sum = torch.full((m,), 0.1)
    run(
        lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.1, eps=1e-10),
        lambda w, g: reference.adagrad_step(w, state_sum, locations, g, 0.1, 1e-10),
    )
    exp_avg, exp_avg_sq = torch.zeros(m), torch.zeros(m)
    counter = iter(range(1, 100))
    run(
        lambda p: torch.optim.SparseAdam(p, lr=0.01, betas=(0.8, 0.9), eps=1e-8),
        lambda w, g: reference.adam_step(
            w, exp_avg, exp_avg_sq, locations, g, 0.01, 0.8, 0.9, 1e-8, next(counter)
        ),
    )


def test_apply_gradients_sums_duplicates_before_the_step() -> None:
    m, d, z = 64, 6, 3
    rn = paper_random_numbers(11)
    ids = torch.tensor([9, 9, 2])
    grads = torch.randn(3, d)
    idx = reference.offsets_to_indices(reference.chunk_offsets(ids, 2, z, m, rn), d, z)
    for name, state in [
        ("sgd", {}),
        ("adagrad", {"sum": torch.zeros(m)}),
        (
            "adam",
            {
                "exp_avg": torch.zeros(m),
                "exp_avg_sq": torch.zeros(m),
                "step": torch.zeros(1, dtype=torch.int64),
            },
        ),
    ]:
        weight = torch.zeros(m)
        reference.apply_gradients(weight, state, name, idx, grads, lr=0.5)
        summed_idx = idx[1:]
        summed = torch.stack([grads[0] + grads[1], grads[2]])
        other = torch.zeros(m)
        fresh = {k: torch.zeros_like(v) for k, v in state.items()}
        reference.apply_gradients(other, fresh, name, summed_idx, summed, lr=0.5)
        torch.testing.assert_close(weight, other)
        if name == "adam":
            assert int(state["step"]) == 1
