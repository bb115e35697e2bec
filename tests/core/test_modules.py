"""RobezEmbedding / RobezEmbeddingBag: fused backend against the reference backend and torch itself."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from robez_core import ConfigError, InvalidInputError, RobezEmbedding, RobezEmbeddingBag
from robez_core.config import DEFAULT_INIT_SCALE

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")


def _pair(cls: type, *args: object, **kwargs: object) -> tuple[nn.Module, nn.Module]:
    """A fused module and a reference module over two equal copies of one array."""
    fused = cls(*args, backend="fused", **kwargs)
    ref = cls(*args, backend="reference", weight=fused.weight.detach().clone(), **kwargs)
    return fused, ref


def _ids(gen: torch.Generator, n: int) -> torch.Tensor:
    """Ids over the whole int64 range, with repeats and the extremes."""
    wide = torch.randint(INT64_MIN, INT64_MAX, (n,), generator=gen, dtype=torch.int64)
    small = torch.randint(-5, 5, (n,), generator=gen, dtype=torch.int64)
    mixed = torch.where(torch.rand(n, generator=gen) < 0.5, wide, small)
    mixed[:2] = torch.tensor([INT64_MIN, INT64_MAX])[: min(2, n)]
    return mixed


@settings(max_examples=30, deadline=None)
@given(
    embedding_dim=st.integers(1, 70),
    chunk_size=st.integers(1, 40),
    extra_memory=st.sampled_from([0, 1, 7, 1000, 70000]),
    val_offset=st.integers(INT64_MIN, INT64_MAX),
    hash=st.sampled_from(["paper", "fast"]),
    shape=st.sampled_from([(0,), (1,), (17,), (3, 5), (2, 3, 4)]),
    seed=st.integers(0, 2**32 - 1),
)
def test_forward_fused_equals_reference_bitwise(
    embedding_dim: int,
    chunk_size: int,
    extra_memory: int,
    val_offset: int,
    hash: str,
    shape: tuple[int, ...],
    seed: int,
) -> None:
    memory_size = chunk_size + extra_memory  # extra_memory == 0 is the edge case m == Z
    kwargs = dict(chunk_size=chunk_size, val_offset=val_offset, hash=hash, seed=seed)
    fused, ref = _pair(RobezEmbedding, 1000, embedding_dim, memory_size, **kwargs)
    numel = 1
    for size in shape:
        numel *= size
    ids = _ids(torch.Generator().manual_seed(seed), numel).reshape(shape)
    out = fused(ids)
    assert out.shape == (*shape, embedding_dim) and out.dtype == torch.float32
    assert torch.equal(out, ref(ids))
    with torch.no_grad():  # the no-grad path uses the fused hash+gather kernel
        assert torch.equal(fused(ids), out)
    offsets = fused.hash_ids(ids)
    assert offsets.shape == (numel, fused.num_chunks)
    assert torch.equal(offsets, ref.hash_ids(ids))
    assert torch.equal(fused.gather(offsets), out.reshape(numel, embedding_dim))


def test_int32_ids_are_accepted_like_nn_embedding() -> None:
    emb = RobezEmbedding(100, 8, 64, chunk_size=4)
    ids = torch.tensor([1, 2, 3])
    assert torch.equal(emb(ids.to(torch.int32)), emb(ids))


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("dims", [(100, 32, 5000), (37, 8, 300), (5, 16, 16)])
def test_grads_fused_match_reference(sparse: bool, dims: tuple[int, int, int]) -> None:
    d, z, m = dims
    fused, ref = _pair(RobezEmbedding, 1000, d, m, chunk_size=z, sparse=sparse)
    gen = torch.Generator().manual_seed(5)
    ids = torch.cat([_ids(gen, 64), torch.tensor([3, 3, 3])])  # duplicates must add up
    upstream = torch.randn(len(ids), d, generator=gen)
    for module in (fused, ref):
        (module(ids) * upstream).sum().backward()
    g_fused, g_ref = fused.weight.grad, ref.weight.grad
    assert g_fused is not None and g_ref is not None
    assert g_fused.is_sparse == sparse and g_ref.is_sparse == sparse
    if sparse:
        assert g_fused.is_coalesced()
        assert torch.equal(g_fused._indices(), g_ref._indices())
    torch.testing.assert_close(g_fused.to_dense(), g_ref.to_dense(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sparse", [False, True])
def test_a_strided_id_column_is_hashed_in_place_with_the_same_rows_and_grads(sparse: bool) -> None:
    """``emb(pairs[:, 0])``: the column is not copied (the hash reads it with its stride), and rows and
    gradients equal those of the contiguous copy, in the fused module as in the reference."""
    fused, ref = _pair(RobezEmbedding, 1000, 40, 3000, chunk_size=16, sparse=sparse)
    gen = torch.Generator().manual_seed(11)
    pairs = torch.randint(-(1 << 40), 1 << 40, (300, 3), generator=gen)
    column = pairs[:, 1]
    assert not column.is_contiguous()
    upstream = torch.randn(300, 40, generator=gen)
    grads = []
    for module, ids in ((fused, column), (fused, column.contiguous()), (ref, column)):
        module.weight.grad = None
        rows = module(ids)
        (rows * upstream).sum().backward()
        assert module.weight.grad is not None
        grads.append((rows.detach(), module.weight.grad.to_dense()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][0], grads[2][0])
    assert torch.equal(grads[0][1], grads[1][1])
    torch.testing.assert_close(grads[0][1], grads[2][1], rtol=1e-5, atol=1e-5)


def test_the_dense_backward_keeps_int32_offsets_and_the_sparse_one_int64() -> None:
    """The training forward keeps its chunk offsets for the backward: int32 for a dense gradient (half
    the bytes), int64 for the sparse one's coalesce."""
    ids = torch.arange(50)
    for sparse, dtype in ((False, torch.int32), (True, torch.int64)):
        rows = RobezEmbedding(1000, 24, 2000, chunk_size=8, sparse=sparse)(ids)
        assert rows.grad_fn is not None
        assert rows.grad_fn.offsets.dtype == dtype  # type: ignore[attr-defined]


OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
_DENSE_OPTIMIZERS: dict[str, OptimizerFactory] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
}
_SPARSE_OPTIMIZERS: dict[str, OptimizerFactory] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "sparse_adam": lambda p: torch.optim.SparseAdam(p, lr=0.01),
}


@pytest.mark.parametrize(
    ("sparse", "name"),
    [(False, name) for name in _DENSE_OPTIMIZERS] + [(True, name) for name in _SPARSE_OPTIMIZERS],
)
def test_training_steps_fused_equal_reference(sparse: bool, name: str) -> None:
    d, z, m = 24, 8, 2000
    fused, ref = _pair(RobezEmbedding, 1000, d, m, chunk_size=z, sparse=sparse)
    factory = (_SPARSE_OPTIMIZERS if sparse else _DENSE_OPTIMIZERS)[name]
    opt_fused, opt_ref = factory([fused.weight]), factory([ref.weight])
    gen = torch.Generator().manual_seed(9)
    start = fused.weight.detach().clone()
    for _ in range(4):
        ids = torch.randint(0, 50, (40,), generator=gen)
        target = torch.randn(40, d, generator=gen)
        for module, opt in ((fused, opt_fused), (ref, opt_ref)):
            opt.zero_grad()
            F.mse_loss(module(ids), target).backward()
            opt.step()
    torch.testing.assert_close(fused.weight, ref.weight, rtol=1e-5, atol=1e-6)
    assert not torch.equal(fused.weight.detach(), start)  # the steps did move the array


def test_shared_array_with_val_offsets() -> None:
    m, d, z = 3000, 16, 4
    first = RobezEmbedding(100, d, m, chunk_size=z, val_offset=0)
    second = RobezEmbedding(200, d, weight=first.weight, chunk_size=z, val_offset=100)
    assert second.weight is first.weight
    model = nn.ModuleList([first, second])
    assert len(list(model.parameters())) == 1  # one array for the optimizer

    ref_second = RobezEmbedding(
        200, d, weight=first.weight.detach().clone(), chunk_size=z, val_offset=100, backend="reference"
    )
    ids = torch.arange(10)
    assert torch.equal(second(ids), ref_second(ids))
    # With the paper hash, table 2's id x reads what table 1 would read for id x + 100.
    assert torch.equal(second(ids), first(ids + 100))
    assert not torch.equal(second(ids), first(ids))

    (first(ids).sum() + second(ids).sum()).backward()
    grad = first.weight.grad
    assert grad is not None
    expected = torch.zeros(m)
    for table in (first, second):
        rows_idx = table.hash_ids(ids)[:, torch.arange(d) // z] + torch.arange(d) % z
        expected.index_add_(0, rows_idx.reshape(-1), torch.ones(rows_idx.numel()))
    torch.testing.assert_close(grad, expected)


def test_shared_plain_tensor_shares_storage() -> None:
    array = torch.zeros(100)
    emb = RobezEmbedding(10, 4, weight=array, chunk_size=2)
    assert isinstance(emb.weight, nn.Parameter)
    array[:] = 1.0
    assert bool((emb(torch.tensor([1, 2])) == 1.0).all())


def test_sparse_grads_from_two_shared_tables_work_with_sparse_adam() -> None:
    first = RobezEmbedding(10, 8, 500, chunk_size=4, sparse=True)
    second = RobezEmbedding(10, 8, weight=first.weight, chunk_size=4, val_offset=3, sparse=True)
    opt = torch.optim.SparseAdam([first.weight], lr=0.01)
    before = first.weight.detach().clone()
    ids = torch.tensor([0, 1, 2])
    (first(ids).sum() + second(ids).sum()).backward()
    grad = first.weight.grad
    assert grad is not None and grad.is_sparse
    dense = grad.to_dense()  # sums duplicate entries if the two contributions overlap
    opt.step()
    changed = first.weight.detach() != before
    assert torch.equal(changed, dense != 0)


def test_new_array_is_seeded_uniform_with_documented_scale() -> None:
    emb = RobezEmbedding(1000, 16, 20000, seed=3)
    again = RobezEmbedding(1000, 16, 20000, seed=3)
    assert torch.equal(emb.weight, again.weight)
    values = emb.weight.detach()
    assert float(values.abs().max()) <= DEFAULT_INIT_SCALE
    assert float(values.std()) > DEFAULT_INIT_SCALE / 4  # spread over the range, not all zeros
    scaled = RobezEmbedding(1000, 16, 20000, init_scale=0.5)
    assert 0.25 < float(scaled.weight.detach().abs().max()) <= 0.5


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_embeddings=10, embedding_dim=4),  # neither memory_size nor weight
        dict(num_embeddings=10, embedding_dim=4, memory_size=3, chunk_size=4),  # m < Z
        dict(num_embeddings=0, embedding_dim=4, memory_size=100),
        dict(num_embeddings=10, embedding_dim=0, memory_size=100),
        dict(num_embeddings=10, embedding_dim=4, memory_size=100, chunk_size=0),
        dict(num_embeddings=10, embedding_dim=4, memory_size=100, hash="md5"),
        dict(num_embeddings=10, embedding_dim=4, memory_size=100, backend="cuda"),
        dict(num_embeddings=10, embedding_dim=4, memory_size=100, seed=-1),
        dict(num_embeddings=10, embedding_dim=4, memory_size=100, random_numbers=[1, 2, 3]),
        dict(num_embeddings=10, embedding_dim=4, memory_size=50, weight=torch.zeros(100)),
        dict(num_embeddings=10, embedding_dim=4, weight=torch.zeros(100, dtype=torch.float64)),
        dict(num_embeddings=10, embedding_dim=4, weight=torch.zeros(10, 10)),
        dict(num_embeddings=10, embedding_dim=4, weight=torch.zeros(200)[::2]),
    ],
)
def test_bad_config_raises_config_error(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        RobezEmbedding(**kwargs)


def test_bad_ids_raise_invalid_input() -> None:
    emb = RobezEmbedding(10, 4, 100)
    with pytest.raises(InvalidInputError):
        emb(torch.tensor([1.0, 2.0]))
    with pytest.raises(InvalidInputError):
        emb([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_sparse_ids_and_offsets_raise_invalid_input(backend: str) -> None:
    # .contiguous() of a sparse tensor used to escape as torch's RuntimeError
    emb = RobezEmbedding(10, 4, 100, backend=backend)
    bag = RobezEmbeddingBag(10, 4, 100, backend=backend)
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(InvalidInputError, match="ids must be a dense tensor"):
        emb(ids.to_sparse())
    with pytest.raises(InvalidInputError, match="ids must be a dense tensor"):
        bag(ids.to_sparse(), torch.tensor([0]))
    with pytest.raises(InvalidInputError, match="offsets must be a dense tensor"):
        bag(ids, torch.tensor([0]).to_sparse())


def test_custom_random_numbers_override_seed() -> None:
    constants = [2_147_483_647, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    emb = RobezEmbedding(10, 8, 1000, chunk_size=4, random_numbers=constants)
    ref = RobezEmbedding(
        10, 8, weight=emb.weight.detach().clone(), chunk_size=4, random_numbers=constants, backend="reference"
    )
    assert emb.random_numbers.tolist() == constants
    ids = torch.arange(-20, 20)
    assert torch.equal(emb(ids), ref(ids))


def test_state_dict_round_trip_and_deepcopy() -> None:
    emb = RobezEmbedding(10, 8, 300, chunk_size=4, sparse=True)
    clone = RobezEmbedding(10, 8, 300, chunk_size=4, seed=99)
    clone.load_state_dict(emb.state_dict())
    ids = torch.arange(5)
    assert torch.equal(clone(ids), emb(ids))
    copied = copy.deepcopy(emb)
    assert torch.equal(copied(ids), emb(ids))


# ------------------------------------------------------------------------------------------- bags


def _materialised(bag: RobezEmbeddingBag, num_rows: int) -> torch.Tensor:
    """The full (n, d) table ``bag`` represents, differentiable w.r.t. its array (reference path)."""
    ref = RobezEmbedding(
        num_rows,
        bag.embedding_dim,
        weight=bag.weight,
        chunk_size=bag.chunk_size,
        val_offset=bag.val_offset,
        sparse=bag.sparse,
        backend="reference",
    )
    return ref(torch.arange(num_rows))


@settings(max_examples=30, deadline=None)
@given(
    bag_sizes=st.lists(st.integers(0, 6), min_size=1, max_size=8),
    mode=st.sampled_from(["sum", "mean"]),
    weighted=st.booleans(),
    include_last_offset=st.booleans(),
    backend=st.sampled_from(["fused", "reference"]),
    sparse=st.booleans(),
    data=st.data(),
)
def test_bag_matches_embedding_bag_on_materialised_table(
    bag_sizes: list[int],
    mode: str,
    weighted: bool,
    include_last_offset: bool,
    backend: str,
    sparse: bool,
    data: st.DataObject,
) -> None:
    num_rows, d, z, m = 40, 20, 8, 700
    bag = RobezEmbeddingBag(
        num_rows,
        d,
        m,
        chunk_size=z,
        mode=mode,
        include_last_offset=include_last_offset,
        backend=backend,
        sparse=sparse,
        val_offset=7,
        init_scale=1.0,
    )
    num_ids = sum(bag_sizes)
    ids = torch.tensor(data.draw(st.lists(st.integers(0, num_rows - 1), min_size=num_ids, max_size=num_ids)))
    ids = ids.to(torch.int64).reshape(-1)
    bounds = torch.tensor([0, *bag_sizes]).cumsum(0)
    offsets = bounds if include_last_offset else bounds[:-1]
    psw = torch.rand(num_ids, requires_grad=True) if weighted and mode == "sum" else None
    upstream = torch.randn(len(bag_sizes), d)

    pooled = bag(ids, offsets, psw)
    (pooled * upstream).sum().backward()
    grad_weight = bag.weight.grad
    grad_psw = None if psw is None else psw.grad

    bag.weight.grad = None
    psw2 = None if psw is None else psw.detach().clone().requires_grad_()
    table = _materialised(bag, num_rows)
    expected = F.embedding_bag(
        ids, table, bounds[:-1], mode=mode, per_sample_weights=psw2
    )  # torch's own pooling over the same rows
    (expected * upstream).sum().backward()

    torch.testing.assert_close(pooled, expected, rtol=1e-5, atol=1e-5)
    assert grad_weight is not None and bag.weight.grad is not None
    assert grad_weight.is_sparse == sparse
    torch.testing.assert_close(grad_weight.to_dense(), bag.weight.grad.to_dense(), rtol=1e-5, atol=1e-5)
    if psw2 is not None:
        torch.testing.assert_close(grad_psw, psw2.grad, rtol=1e-5, atol=1e-5)


def test_bag_2d_ids_are_fixed_size_bags() -> None:
    bag = RobezEmbeddingBag(100, 12, 500, chunk_size=5, mode="sum")
    ids = torch.tensor([[1, 2, 3], [4, 4, 9]])
    emb = RobezEmbedding(100, 12, weight=bag.weight, chunk_size=5)
    assert torch.equal(bag(ids), emb(ids).sum(dim=1))
    weights = torch.rand(2, 3)
    torch.testing.assert_close(
        bag(ids, per_sample_weights=weights), (emb(ids) * weights.unsqueeze(-1)).sum(1)
    )
    with torch.no_grad():
        assert torch.equal(bag(ids), emb(ids).sum(dim=1))


def test_bag_empty_bags_give_zeros() -> None:
    bag = RobezEmbeddingBag(100, 6, 200, chunk_size=3, mode="mean")
    out = bag(torch.tensor([5, 6]), torch.tensor([0, 0, 2]))
    assert out.shape == (3, 6)
    assert torch.equal(out[0], torch.zeros(6)) and torch.equal(out[2], torch.zeros(6))


@pytest.mark.parametrize(
    ("ids", "offsets", "psw", "kwargs"),
    [
        (torch.tensor([1, 2]), None, None, {}),  # 1-D ids need offsets
        (torch.tensor([[1, 2]]), torch.tensor([0]), None, {}),  # 2-D ids take no offsets
        (torch.tensor([1, 2]), torch.tensor([1]), None, {}),  # first offset must be 0
        (torch.tensor([1, 2]), torch.tensor([0, 3]), None, {}),  # past the end
        (torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1]), None, {}),  # decreasing
        (torch.tensor([1, 2]), torch.tensor([0, 1]), None, {"include_last_offset": True}),  # last != N
        (torch.tensor([1, 2]), torch.tensor([0]), torch.ones(2), {"mode": "mean"}),  # psw needs sum
        (torch.tensor([1, 2]), torch.tensor([0]), torch.ones(3), {"mode": "sum"}),  # psw shape
        (torch.ones(2, 2, 2, dtype=torch.int64), None, None, {}),  # 3-D ids
    ],
)
def test_bag_bad_input_raises(ids, offsets, psw, kwargs) -> None:
    bag = RobezEmbeddingBag(10, 4, 100, **kwargs)
    with pytest.raises(InvalidInputError):
        bag(ids, offsets, psw)


def test_bag_bad_mode_is_config_error() -> None:
    with pytest.raises(ConfigError):
        RobezEmbeddingBag(10, 4, 100, mode="max")  # type: ignore[arg-type]


def test_repr_names_the_config() -> None:
    text = repr(RobezEmbeddingBag(10, 4, 100, chunk_size=2, mode="sum", sparse=True))
    assert "memory_size=100" in text and "chunk_size=2" in text and "mode='sum'" in text
