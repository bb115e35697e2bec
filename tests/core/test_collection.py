"""``RobezEmbeddingBagCollection`` and its kernels: against the pure-torch reference, bit for bit against
the per-feature modules and a server's one-step update of the shared array, and bad input refused."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import numba
import pytest
import torch

from robez_core import (
    ConfigError,
    EmbeddingBagConfig,
    InvalidInputError,
    OptimizerConfig,
    RobezEmbeddingBagCollection,
    Table,
    TableConfig,
    kernels,
    reference,
)
from robez_core.collection import parse_jagged, per_id_gradients, prepare_shared_step
from robez_core.hashing import paper_random_numbers
from robez_core.kernels import _jit

RANDOM_NUMBERS = paper_random_numbers()


@pytest.fixture(autouse=True, scope="module")
def _parallel_even_for_small_batches() -> Iterator[None]:
    """Small test batches must reach the parallel compilation of the forward too (at 2 threads)."""
    previous = _jit._PARALLEL_MIN_WORK
    _jit._PARALLEL_MIN_WORK = 0
    try:
        yield
    finally:
        _jit._PARALLEL_MIN_WORK = previous


@dataclass
class Batch:
    keys: list[str]
    ids: torch.Tensor  # (N,)
    offsets: torch.Tensor  # (F * B + 1,)
    batch_size: int

    def feature(self, f: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Feature f's ids (N_f,) and its B + 1 offsets from 0."""
        B = self.batch_size
        bounds = self.offsets[f * B : (f + 1) * B + 1]
        return self.ids[int(bounds[0]) : int(bounds[-1])], bounds - bounds[0]

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]


def make_batch(
    tables: list[EmbeddingBagConfig], batch_size: int, seed: int, max_len: int = 4, empty_feature: int = -1
) -> Batch:
    """Random jagged batch: bag lengths 0..max_len (empty bags included), ids with duplicates (a few
    distinct values), one feature optionally all empty."""
    gen = torch.Generator().manual_seed(seed)
    keys, ids, lengths = [], [], []
    f = 0
    for table in tables:
        for name in table.feature_names:
            keys.append(name)
            counts = torch.randint(0, max_len + 1, (batch_size,), generator=gen)
            if f == empty_feature:
                counts.zero_()
            distinct = torch.randint(0, table.num_embeddings, (3,), generator=gen)
            fresh = torch.randint(0, table.num_embeddings, (int(counts.sum()),), generator=gen)
            dup = distinct[torch.randint(0, 3, (int(counts.sum()),), generator=gen)]
            pick = torch.rand(int(counts.sum()), generator=gen) < 0.4
            ids.append(torch.where(pick, dup, fresh))
            lengths.append(counts)
            f += 1
    all_lengths = torch.cat(lengths)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), all_lengths.cumsum(0)])
    return Batch(keys, torch.cat(ids), offsets, batch_size)


def tables_mixed() -> list[EmbeddingBagConfig]:
    """Mixed dims (chunk_size 8: 16 = 2 whole chunks, 5 = one short chunk, 20 = 2 + a short one), mixed
    pooling, one table with two features."""
    return [
        EmbeddingBagConfig("t0", 100, 16, ["a"], pooling="mean"),
        EmbeddingBagConfig("t1", 7, 5, ["b", "c"], pooling="sum"),
        EmbeddingBagConfig("t2", 3000, 20, ["d"], pooling="mean"),
    ]


def tables_equal(num: int = 4, dim: int = 16) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(f"t{i}", 50 + 40 * i, dim, [f"f{i}"], pooling="mean" if i % 2 else "sum")
        for i in range(num)
    ]


def collection(
    tables: list[EmbeddingBagConfig], memory_size: int = 4096, **kwargs
) -> RobezEmbeddingBagCollection:
    kwargs.setdefault("chunk_size", 8)
    ebc = RobezEmbeddingBagCollection(tables, memory_size, **kwargs)
    with torch.no_grad():
        ebc.weight.normal_(generator=torch.Generator().manual_seed(7))
    return ebc


def reference_pooled(ebc: RobezEmbeddingBagCollection, batch: Batch) -> list[torch.Tensor]:
    """Each feature's pooled rows (B, d) by the pure-torch reference, in batch key order."""
    out = []
    for f, key in enumerate(batch.keys):
        module = ebc.feature_module(key)
        ids, bounds = batch.feature(f)
        out.append(
            reference.lookup_bag(
                ebc.weight.detach(),
                ids,
                bounds,
                None,
                module.mode,
                module.embedding_dim,
                module.chunk_size,
                ebc.random_numbers,
                module.val_offset,
                ebc.hash,
            )
        )
    return out


def per_feature_update(
    ebc: RobezEmbeddingBagCollection, batch: Batch, grad: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per feature in key order: chunk offsets, ids and per-id gradients, as the modules use them."""
    offsets, ids_list, grads = [], [], []
    out = ebc(keys=batch.keys, values=batch.ids, offsets=batch.offsets)
    for f, key in enumerate(batch.keys):
        module = ebc.feature_module(key)
        ids, bounds = batch.feature(f)
        start = out.offset_per_key()[ebc.feature_names.index(key)]
        offsets.append(module.hash_ids(ids))
        ids_list.append(ids)
        grads.append(per_id_gradients(grad[:, start : start + module.embedding_dim], bounds, module.mode))
    return offsets, ids_list, grads


# ------------------------------------------------------------------------------------------ forward


@pytest.mark.parametrize("hash", ["paper", "fast"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_forward_matches_reference_and_per_feature_modules_bit_for_bit(hash, seed):
    tables = tables_mixed()
    ebc = collection(tables, hash=hash)
    batch = make_batch(tables, batch_size=9, seed=seed, empty_feature=seed % 4)
    out = ebc(keys=batch.keys, values=batch.ids, lengths=batch.lengths())
    assert out.values().shape == (9, 16 + 5 + 5 + 20)
    for f, (key, expected) in enumerate(zip(batch.keys, reference_pooled(ebc, batch), strict=True)):
        # the reference divides a mean bag by its length where the kernels multiply by its inverse
        torch.testing.assert_close(out[key], expected, rtol=1e-6, atol=1e-6)
        ids, bounds = batch.feature(f)
        module_out = ebc.feature_module(key)(ids, bounds)
        assert torch.equal(out[key], module_out), key
    assert torch.equal(torch.cat([out[k] for k in ebc.feature_names], dim=1), out.values())


def test_forward_at_two_threads_is_the_one_thread_result():
    if numba.config.NUMBA_NUM_THREADS < 2:  # type: ignore[attr-defined]
        pytest.skip("numba has one thread")
    tables = tables_equal(6, 16)
    ebc = collection(tables, memory_size=1 << 16, chunk_size=16)
    batch = make_batch(tables, batch_size=600, seed=3, max_len=3)
    previous = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(ebc(keys=batch.keys, values=batch.ids, offsets=batch.offsets).values().clone())
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(results[0], results[1])


def test_keys_in_another_order_give_the_same_output():
    tables = tables_mixed()
    ebc = collection(tables)
    batch = make_batch(tables, batch_size=5, seed=4)
    order = [2, 0, 3, 1]
    B = batch.batch_size
    ids = torch.cat([batch.feature(f)[0] for f in order])
    lengths = torch.cat([batch.lengths()[f * B : (f + 1) * B] for f in order])
    expected = ebc(keys=batch.keys, values=batch.ids, lengths=batch.lengths()).values()
    got = ebc(keys=[batch.keys[f] for f in order], values=ids, lengths=lengths)
    assert got.keys() == ebc.feature_names
    assert torch.equal(got.values(), expected)


def test_a_keyed_jagged_tensor_is_taken_as_it_is():
    class FakeKJT:  # torchrec's KeyedJaggedTensor surface the collection reads, and nothing else
        def __init__(self, keys, values, lengths):
            self._keys, self._values, self._lengths = keys, values, lengths

        def keys(self):
            return self._keys

        def values(self):
            return self._values

        def lengths(self):
            return self._lengths

    tables = tables_mixed()
    ebc = collection(tables)
    batch = make_batch(tables, batch_size=4, seed=5)
    keys, ids, bounds = parse_jagged(FakeKJT(batch.keys, batch.ids, batch.lengths()))
    assert keys == tuple(batch.keys) and torch.equal(ids, batch.ids) and torch.equal(bounds, batch.offsets)
    out = ebc(FakeKJT(batch.keys, batch.ids, batch.lengths()))
    assert torch.equal(out.values(), ebc(keys=batch.keys, values=batch.ids, offsets=batch.offsets).values())
    assert set(out.to_dict()) == set(batch.keys)
    assert out.length_per_key() == [16, 5, 5, 20] and out.offset_per_key() == [0, 16, 21, 26, 46]


def test_a_batch_of_no_samples_gives_an_empty_output():
    ebc = collection(tables_mixed())
    out = ebc(
        keys=["a", "b", "c", "d"],
        values=torch.zeros(0, dtype=torch.int64),
        offsets=torch.zeros(1, dtype=torch.int64),
    )
    assert out.values().shape == (0, 46)


# ------------------------------------------------------------------------------------------ backward


@pytest.mark.parametrize("memory_size", [300, 1 << 16])  # the dense-scratch and the sorted coalesce
def test_sparse_gradient_is_one_coalesced_update_of_every_feature(memory_size):
    tables = tables_mixed()
    ebc = collection(tables, memory_size=memory_size, sparse=True)
    batch = make_batch(tables, batch_size=11, seed=6, empty_feature=1)
    grad = torch.randn(11, 46, generator=torch.Generator().manual_seed(1))
    out = ebc(keys=batch.keys, values=batch.ids, offsets=batch.offsets)
    out.values().backward(grad)
    got = ebc.weight.grad
    assert got is not None and got.is_sparse
    offsets, _, grads = per_feature_update(ebc, batch, grad)
    locations, values = kernels.coalesce_chunk_rows(offsets, grads, ebc.chunk_size, memory_size)
    assert torch.equal(got._indices()[0], locations) and torch.equal(got._values(), values)
    # the pure-torch reference, per feature, summed: the same gradient up to float rounding
    weight = ebc.weight.detach().clone().requires_grad_(True)
    total = sum(
        (
            reference.lookup_bag(
                weight,
                *batch.feature(f),
                None,
                m.mode,
                m.embedding_dim,
                m.chunk_size,
                ebc.random_numbers,
                m.val_offset,
            )
            * grad[:, out.offset_per_key()[f] : out.offset_per_key()[f + 1]]
        ).sum()
        for f, m in enumerate(ebc.feature_module(k) for k in batch.keys)
    )
    total.backward()
    torch.testing.assert_close(got.to_dense(), weight.grad, rtol=1e-5, atol=1e-5)


def test_dense_gradient_matches_the_sparse_one_and_one_feature_matches_its_module_bit_for_bit():
    tables = tables_mixed()
    dense = collection(tables)
    sparse = collection(tables, sparse=True)
    batch = make_batch(tables, batch_size=8, seed=8)
    grad = torch.randn(8, 46, generator=torch.Generator().manual_seed(2))
    dense(keys=batch.keys, values=batch.ids, offsets=batch.offsets).values().backward(grad)
    sparse(keys=batch.keys, values=batch.ids, offsets=batch.offsets).values().backward(grad)
    torch.testing.assert_close(dense.weight.grad, sparse.weight.grad.to_dense(), rtol=1e-6, atol=1e-6)

    one = [EmbeddingBagConfig("t", 1000, 20, ["x"], pooling="mean")]
    for is_sparse in (False, True):
        ebc = collection(one, memory_size=2000, sparse=is_sparse)
        solo = make_batch(one, batch_size=30, seed=9)
        g = torch.randn(30, 20, generator=torch.Generator().manual_seed(3))
        ebc(keys=["x"], values=solo.ids, offsets=solo.offsets).values().backward(g)
        got = ebc.weight.grad
        ebc.weight.grad = None
        ebc.feature_module("x")(solo.ids, solo.offsets).backward(g)
        expected = ebc.weight.grad
        if is_sparse:
            got, expected = got.coalesce(), expected.coalesce()
            assert torch.equal(got.indices(), expected.indices()) and torch.equal(
                got.values(), expected.values()
            )
        else:
            assert torch.equal(got, expected)


@pytest.mark.parametrize("memory_size", [500, 1 << 18])
def test_coalesce_chunk_rows_of_equal_dims_is_coalesce_grad_of_the_concatenation(memory_size):
    gen = torch.Generator().manual_seed(0)
    offsets = [torch.randint(0, memory_size - 8 + 1, (n, 2), generator=gen) for n in (40, 0, 25)]
    offsets[2][:5] = offsets[0][:5]  # duplicated rows across tables
    rows = [torch.randn(o.shape[0], 12, generator=gen) for o in offsets]
    got = kernels.coalesce_chunk_rows(offsets, rows, 8, memory_size)
    expected = kernels.coalesce_grad(torch.cat(rows), torch.cat(offsets), 8, memory_size)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    ref = reference.coalesce_grad(torch.cat(rows), reference.offsets_to_indices(torch.cat(offsets), 12, 8))
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ optimizer


@pytest.mark.parametrize(
    "optimizer",
    [OptimizerConfig("sgd", lr=0.1), OptimizerConfig("adagrad", lr=0.05), OptimizerConfig("adam", lr=0.01)],
)
def test_fused_step_is_the_servers_step_bit_for_bit(optimizer):
    tables = tables_mixed()
    ebc = collection(tables, memory_size=1 << 14, optimizer=optimizer)
    # the server: one Table per table over a copy of the same array and state
    weight = ebc.weight.detach().clone()
    state = {k: v.clone() for k, v in ebc.optimizer_state.items()}
    server = {
        name: Table(config, optimizer, weight=weight, state=state)
        for name, config in ebc.table_configs.items()
    }
    ref_weight = ebc.weight.detach().clone()
    ref_state = {k: v.clone() for k, v in ebc.optimizer_state.items()}
    table_of = {name: t.name for t in tables for name in t.feature_names}
    for step in range(3):
        batch = make_batch(tables, batch_size=16, seed=10 + step)
        grad = torch.randn(16, 46, generator=torch.Generator().manual_seed(step))
        offsets, ids, grads = per_feature_update(ebc, batch, grad)  # before the step changes the array
        ebc(keys=batch.keys, values=batch.ids, offsets=batch.offsets).values().backward(grad)
        assert ebc.weight.grad is None and set(ebc.timings) == {"lookup", "backward", "optimizer"}
        prepared = prepare_shared_step([server[table_of[k]] for k in batch.keys], ids, grads)
        server["t0"].check_step(prepared)
        server["t0"].apply_step(prepared)
        assert torch.equal(ebc.weight.detach(), weight), step
        for name, tensor in state.items():
            assert torch.equal(ebc.optimizer_state[name], tensor), name
        # the pure-torch reference of the same step: equal to float rounding
        indices = torch.cat(
            [
                reference.offsets_to_indices(o, g.shape[1], ebc.chunk_size).reshape(-1)
                for o, g in zip(offsets, grads, strict=True)
            ]
        )
        flat_grads = torch.cat([g.reshape(-1) for g in grads])
        locations, values = reference.coalesce_grad(flat_grads, indices.reshape(-1))
        if optimizer.name == "sgd":
            reference.sgd_step(ref_weight, locations, values, optimizer.lr)
        elif optimizer.name == "adagrad":
            reference.adagrad_step(
                ref_weight, ref_state["sum"], locations, values, optimizer.lr, optimizer.eps
            )
        else:
            ref_state["step"] += 1
            reference.adam_step(
                ref_weight,
                ref_state["exp_avg"],
                ref_state["exp_avg_sq"],
                locations,
                values,
                optimizer.lr,
                *optimizer.betas,
                optimizer.eps,
                int(ref_state["step"]),
            )
        torch.testing.assert_close(ebc.weight.detach(), ref_weight, rtol=1e-5, atol=1e-6)


def test_table_view_reads_what_the_collection_reads():
    tables = tables_equal(2, 8)
    ebc = collection(tables, optimizer=OptimizerConfig("adagrad"))
    table = ebc.table("t1")
    ids = torch.tensor([0, 5, 5, 89])
    rows = table.lookup(ids)
    out = ebc(keys=["f0", "f1"], values=ids, lengths=torch.tensor([0, 0, 1, 3]))  # B = 2; f1 mean of 3
    torch.testing.assert_close(out["f1"][1], rows[1:].mean(0))
    assert table.state["sum"].data_ptr() == ebc.optimizer_state["sum"].data_ptr()


# ------------------------------------------------------------------------------------------ bad input


def test_bad_input_is_refused_with_a_clear_error():
    ebc = collection(tables_mixed())
    keys = ["a", "b", "c", "d"]
    ok_lengths = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1])  # B = 2
    ids = torch.tensor([1, 2, 3, 4, 5])
    ebc(keys=keys, values=ids, lengths=ok_lengths)
    cases = {
        "unknown feature keys": dict(keys=["a", "b", "c", "zz"], values=ids, lengths=ok_lengths),
        "missing": dict(keys=["a", "b", "c"], values=ids[:3], lengths=ok_lengths[:6]),
        "lengths sum to": dict(keys=keys, values=ids[:4], lengths=ok_lengths),
        "do not split": dict(keys=keys, values=ids, lengths=torch.tensor([1, 0, 1, 1, 0, 0, 2])),
        "offsets end at": dict(keys=keys, values=ids, offsets=torch.tensor([0, 1, 1, 2, 3, 3, 3, 4, 4])),
        "non-decreasing": dict(keys=keys, values=ids, offsets=torch.tensor([0, 2, 1, 2, 3, 3, 3, 4, 5])),
        "lengths must be >= 0": dict(keys=keys, values=ids, lengths=torch.tensor([1, 0, 2, -1, 1, 0, 1, 1])),
        "exactly one of lengths and offsets": dict(keys=keys, values=ids),
        "int64": dict(keys=keys, values=ids.float(), lengths=ok_lengths),
        "outside [0, 7)": dict(keys=keys, values=torch.tensor([1, 2, 7, 4, 5]), lengths=ok_lengths),
        "id -1 is outside": dict(keys=keys, values=torch.tensor([-1, 2, 3, 4, 5]), lengths=ok_lengths),
    }
    before = ebc.weight.detach().clone()
    for message, kwargs in cases.items():
        with pytest.raises(InvalidInputError, match=re.escape(message)):
            ebc(**kwargs)
    assert torch.equal(before, ebc.weight.detach())


def test_bad_configs_raise_in_init():
    t = EmbeddingBagConfig("t", 10, 4, ["x"])
    with pytest.raises(ConfigError, match="pooling"):
        EmbeddingBagConfig("t", 10, 4, ["x"], pooling="max")
    with pytest.raises(ConfigError, match=">= 1"):
        EmbeddingBagConfig("t", 0, 4, ["x"])
    with pytest.raises(ConfigError, match="unique"):
        RobezEmbeddingBagCollection([t, EmbeddingBagConfig("u", 10, 4, ["x"])], 100)
    with pytest.raises(ConfigError, match="unique"):
        RobezEmbeddingBagCollection([t, t], 100)
    with pytest.raises(ConfigError, match="memory_size"):
        RobezEmbeddingBagCollection([t], 4, chunk_size=8)
    with pytest.raises(ConfigError, match="memory_size"):
        RobezEmbeddingBagCollection([t])
    with pytest.raises(ConfigError, match="exclude"):
        RobezEmbeddingBagCollection([t], 100, sparse=True, optimizer=OptimizerConfig())
    with pytest.raises(ConfigError, match="non-empty"):
        RobezEmbeddingBagCollection([], 100)
    assert EmbeddingBagConfig("t", 10, 4).feature_names == ("t",)


def test_default_val_offsets_place_tables_one_after_another():
    ebc = collection(tables_mixed())
    assert [ebc.table_configs[n].val_offset for n in ("t0", "t1", "t2")] == [0, 100, 107]
    assert TableConfig(10, 4, 100).val_offset == 0


def test_prepare_shared_step_refuses_tables_of_different_arrays_and_nan():
    ebc = collection(tables_equal(2, 8), optimizer=OptimizerConfig("sgd"))
    other = collection(tables_equal(2, 8), optimizer=OptimizerConfig("sgd"))
    ids = torch.tensor([1, 2])
    grads = torch.ones(2, 8)
    with pytest.raises(InvalidInputError, match="share one array"):
        prepare_shared_step([ebc.table("t0"), other.table("t1")], [ids, ids], [grads, grads])
    with pytest.raises(InvalidInputError, match="NaN"):
        prepare_shared_step([ebc.table("t0"), ebc.table("t1")], [ids, ids], [grads, grads * float("nan")])


def test_a_new_array_and_state_start_as_a_table_s_do():
    # the collection allocates them itself (huge pages): the values must be init_weight's and zeros
    from robez_core.init import init_weight

    ebc = RobezEmbeddingBagCollection(tables_equal(2, 8), 5000, seed=3, optimizer=OptimizerConfig("adam"))
    assert torch.equal(ebc.weight.detach(), init_weight(5000, seed=3))
    assert set(ebc.optimizer_state) == {"exp_avg", "exp_avg_sq", "step"}
    assert all(int(t.count_nonzero()) == 0 for t in ebc.optimizer_state.values())
    assert dict(ebc.named_buffers())["optimizer_exp_avg"] is ebc.optimizer_state["exp_avg"]


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_per_id_gradients_of_one_id_bags_are_the_bags_gradients_copied(pooling):
    # the one-id-per-bag shortcut (Criteo's features) gives the general path's bits, in a new tensor
    grad = torch.randn(6, 12)[:, 4:8]  # a strided column block, as a collection's output gradient gives
    one_each = torch.arange(7)
    got = per_id_gradients(grad, one_each, pooling)
    assert torch.equal(got, grad / 1.0 if pooling == "mean" else grad)
    assert got.is_contiguous() and got.data_ptr() != grad.data_ptr()
    # bags of 0 and 2 ids (same total count) take the general path: no shortcut on the id count alone
    uneven = torch.tensor([0, 0, 2, 3, 4, 5, 6])
    assert torch.equal(per_id_gradients(grad, uneven, "sum")[:2], grad[1].expand(2, 4))


@pytest.mark.parametrize("size", [0, 7, 3000])
def test_distinct_by_table_is_each_table_s_unique_ids_in_one_pass(size):
    """A remote collection's pull: per table (features 0 and 2 share table 1, apart), the distinct ids in
    order of first appearance, each id's index into them, and the first id out of its feature's range;
    the kernel's probe table is left empty, so a second batch (other ids) is right too."""
    generator = torch.Generator().manual_seed(size)
    tables = torch.tensor([1, 0, 1, 2]).numpy()
    limits = torch.tensor([50, 1 << 62, 60, 3]).numpy()
    for _ in range(2):
        lengths = torch.randint(0, 2 * size + 1, (4,), generator=generator)
        ids = torch.cat([(torch.rand(int(n), generator=generator) ** 3 * lim).long() for n, lim in zip(
            lengths.tolist(), [50, 1 << 40, 60, 3], strict=True)])  # fmt: skip
        starts = [0, *torch.cumsum(lengths, 0).tolist()]
        distinct, inverse, table_starts, bad = kernels.distinct_by_table(ids, starts, tables, limits)
        assert bad == -1 and torch.equal(distinct[inverse], ids) and table_starts[-1] == distinct.numel()
        for table in range(3):
            mine = distinct[table_starts[table] : table_starts[table + 1]]
            features = [f for f in range(4) if tables[f] == table]
            theirs = torch.cat([ids[starts[f] : starts[f + 1]] for f in features])
            first_seen = list(dict.fromkeys(theirs.tolist()))
            assert mine.tolist() == first_seen  # no duplicates, every id, first appearance first
            for f in features:  # each id points into its own table's part
                part = inverse[starts[f] : starts[f + 1]]
                assert bool(((part >= table_starts[table]) & (part < table_starts[table + 1])).all())
    if size:  # an id past feature 2's range (60) and one below 0: the first is named, both still counted
        ids[starts[2]], ids[starts[3]] = 60, -1
        distinct, inverse, _, bad = kernels.distinct_by_table(ids, starts, tables, limits)
        assert bad == starts[2] and torch.equal(distinct[inverse], ids)


def test_distinct_by_table_refuses_bad_arguments():
    ids = torch.arange(4)
    tables, limits = torch.tensor([0, 1]).numpy(), torch.tensor([9, 9]).numpy()
    with pytest.raises(InvalidInputError, match="int64"):
        kernels.distinct_by_table(ids.int(), [0, 2, 4], tables, limits)
    with pytest.raises(InvalidInputError, match="F \\+ 1"):
        kernels.distinct_by_table(ids, [0, 4], tables, limits)
    with pytest.raises(InvalidInputError, match="end at len"):
        kernels.distinct_by_table(ids, [0, 2, 3], tables, limits)
    with pytest.raises(InvalidInputError, match=">= 0"):
        kernels.distinct_by_table(ids, [0, 2, 4], torch.tensor([0, -1]).numpy(), limits)
