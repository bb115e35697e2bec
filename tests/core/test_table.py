"""Table: in-place fused updates, validation, safetensors checkpoints, the paper's state_dict."""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path

import numba
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from robez_core import (
    ConfigError,
    CorruptionError,
    InvalidInputError,
    NotFoundError,
    OptimizerConfig,
    RobezEmbedding,
    Table,
    TableConfig,
    import_paper_state_dict,
    kernels,
    optim,
    reference,
)
from robez_core.checkpoint import CheckpointFile, CheckpointWriter
from robez_core.config import MAX_INIT_SCALE
from robez_core.hashing import PAPER_PRIME
from robez_core.kernels import _jit
from robez_core.small import SMALL_BATCH_MAX_IDS

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
OPTIMIZERS = [
    OptimizerConfig("sgd", lr=0.1),
    OptimizerConfig("adagrad", lr=0.1, initial_accumulator_value=0.05),
    OptimizerConfig("adam", lr=0.01, betas=(0.8, 0.95)),
]


def _table(optimizer: OptimizerConfig | None = None, **overrides: object) -> Table:
    config = dict(num_embeddings=1000, embedding_dim=20, memory_size=3000, chunk_size=8, val_offset=3)
    config.update(overrides)
    return Table(TableConfig(**config), optimizer)  # type: ignore[arg-type]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits (so -0.0 != 0.0 and NaN payloads count)."""
    return tensor.contiguous().view(torch.uint8)


def _snapshot(table: Table) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in table.tensors().items()}


def _assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(_bits(a[name]), _bits(b[name])), name


# ------------------------------------------------------------------------------------ construction


def test_new_table_array_matches_a_new_module() -> None:
    table = _table(seed=77)
    module = RobezEmbedding(1000, 20, 3000, chunk_size=8, val_offset=3, seed=77)
    assert torch.equal(table.weight, module.weight.detach())
    assert table.optimizer == OptimizerConfig()  # no optimizer given: plain sgd


def test_given_weight_and_state_are_used_in_place() -> None:
    config = TableConfig(100, 8, 500, chunk_size=4)
    optimizer = OptimizerConfig("adam")
    weight = torch.zeros(500)
    state = {
        name: torch.zeros(shape, dtype=dtype)
        for name, (shape, dtype) in Table.state_layout(optimizer, 500).items()
    }
    table = Table(config, optimizer, weight=weight, state=state)
    assert table.weight.data_ptr() == weight.data_ptr()
    assert all(table.state[k].data_ptr() == state[k].data_ptr() for k in state)
    table.apply_gradients(torch.tensor([1, 2]), torch.ones(2, 8))
    assert bool(weight.any()) and bool(state["exp_avg"].any()) and int(state["step"]) == 1


@pytest.mark.parametrize(
    ("weight", "state"),
    [
        (torch.zeros(499), None),
        (torch.zeros(500, dtype=torch.float64), None),
        (torch.zeros(1000)[::2], None),
        (None, {"sum": torch.zeros(500)}),
        (None, {"exp_avg": torch.zeros(500), "exp_avg_sq": torch.zeros(500)}),
        (None, {"exp_avg": torch.zeros(500), "exp_avg_sq": torch.zeros(500), "step": torch.zeros(1)}),
    ],
)
def test_bad_weight_or_state_is_config_error(weight: torch.Tensor | None, state: dict | None) -> None:
    with pytest.raises(ConfigError):
        Table(TableConfig(100, 8, 500, chunk_size=4), OptimizerConfig("adam"), weight=weight, state=state)


# ---------------------------------------------------------------------------------------- reads


@pytest.mark.parametrize("hash", ["paper", "fast"])
def test_reads_match_reference(hash: str) -> None:
    table = _table(hash=hash)
    c = table.config
    ids = torch.tensor([0, 1, -1, INT64_MIN, INT64_MAX, 12345678901234])
    offsets = table.hash(ids)
    assert torch.equal(
        offsets,
        reference.chunk_offsets(
            ids, c.num_chunks, c.chunk_size, c.memory_size, table.random_numbers, c.val_offset, c.hash
        ),
    )
    expected = reference.lookup(
        table.weight, ids, c.embedding_dim, c.chunk_size, table.random_numbers, c.val_offset, c.hash
    )
    assert torch.equal(table.lookup(ids), expected)
    assert torch.equal(table.gather(offsets), expected)
    bag_starts = torch.tensor([0, 2, 2])
    psw = torch.rand(len(ids))
    bounds = torch.tensor([0, 2, 2, len(ids)])
    for mode, weights in (("sum", psw), ("sum", None), ("mean", None)):
        pooled = table.lookup_bag(ids, bag_starts, weights, mode)
        expected_bag = reference.lookup_bag(
            table.weight,
            ids,
            bounds,
            weights,
            mode,
            c.embedding_dim,
            c.chunk_size,
            table.random_numbers,
            c.val_offset,
            c.hash,
        )
        torch.testing.assert_close(pooled, expected_bag)


def test_empty_batch() -> None:
    table = _table(OptimizerConfig("adagrad"))
    empty = torch.empty(0, dtype=torch.int64)
    assert table.lookup(empty).shape == (0, 20)
    before = _snapshot(table)
    table.apply_gradients(empty, torch.empty(0, 20))
    _assert_bitwise_equal(before, _snapshot(table))


# -------------------------------------------------------------------------------------- updates


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.name)
def test_apply_gradients_with_duplicates_equals_reference_on_summed_grads(optimizer: OptimizerConfig) -> None:
    table = _table(optimizer)
    start = table.weight.clone()
    c = table.config
    gen = torch.Generator().manual_seed(4)
    ids = torch.tensor([5, 9, 5, 5, -3])
    grads = torch.randn(5, c.embedding_dim, generator=gen)
    table.apply_gradients(ids, grads)
    table.apply_gradients(ids, grads, lr=optimizer.lr / 2)

    # The same two steps, done by the reference on distinct ids with their gradients summed by hand.
    unique_ids = torch.tensor([5, 9, -3])
    summed = torch.stack([grads[0] + grads[2] + grads[3], grads[1], grads[4]])
    indices = reference.offsets_to_indices(
        reference.chunk_offsets(
            unique_ids, c.num_chunks, c.chunk_size, c.memory_size, table.random_numbers, c.val_offset
        ),
        c.embedding_dim,
        c.chunk_size,
    )
    weight = start.clone()
    state = {k: torch.zeros_like(v) for k, v in table.state.items()}
    if optimizer.name == "adagrad":
        state["sum"].fill_(optimizer.initial_accumulator_value)
    for lr in (optimizer.lr, optimizer.lr / 2):
        reference.apply_gradients(
            weight, state, optimizer.name, indices, summed, lr=lr, betas=optimizer.betas, eps=optimizer.eps
        )
    torch.testing.assert_close(table.weight, weight, rtol=1e-5, atol=1e-6)
    for name in state:
        torch.testing.assert_close(table.state[name], state[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.name)
def test_apply_gradients_at_equals_apply_gradients(optimizer: OptimizerConfig) -> None:
    one, two = _table(optimizer), _table(optimizer)
    ids = torch.tensor([1, 2, 3, 1])
    grads = torch.randn(4, 20)
    one.apply_gradients(ids, grads)
    two.apply_gradients_at(two.hash(ids), grads)
    _assert_bitwise_equal(_snapshot(one), _snapshot(two))


def _run_updates(optimizer: OptimizerConfig, memory_size: int, threads: int) -> tuple[Table, torch.Tensor]:
    """Three updates (apply_gradients, apply_gradients_at, apply_gradients) and a lookup at ``threads``."""
    table = _table(optimizer, embedding_dim=64, memory_size=memory_size, chunk_size=16)
    gen = torch.Generator().manual_seed(11)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in range(3):
            ids = torch.randint(-50_000, 50_000, (2048,), generator=gen)
            grads = torch.randn(2048, 64, generator=gen)
            if step == 1:
                table.apply_gradients_at(table.hash(ids), grads, lr=optimizer.lr / 3)
            else:
                table.apply_gradients(ids, grads)
        rows = table.lookup(torch.randint(-50_000, 50_000, (4096,), generator=gen))
    finally:
        torch.set_num_threads(previous)
    return table, rows


# 200_000 locations take the coalesce's dense scratch, 10**7 the sort of chunk starts
@pytest.mark.parametrize("memory_size", [200_000, 10_000_000])
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.name)
def test_updates_are_bitwise_identical_at_any_kernel_thread_count(
    optimizer: OptimizerConfig, memory_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replicas running with different thread counts must hold the same bits: the coalesce sums each
    location's gradients in a fixed order and the optimizer steps are per location, so 1 and 2 kernel
    threads agree exactly (the parallel step and lookup compilations really run at 2 threads)."""
    if numba.config.NUMBA_NUM_THREADS < 2:  # type: ignore[attr-defined]
        pytest.skip("numba has one thread on this machine")
    step_kernel = {
        "sgd": _jit._sgd_kernel,
        "adagrad": _jit._adagrad_kernel,
        "adam": _jit._adam_kernel,
    }
    parallel_calls: list[str] = []
    lookup_kernel = _jit._lookup_kernel.for_chunk(16)  # the table's chunk size
    for name, pair in (("step", step_kernel[optimizer.name]), ("lookup", lookup_kernel)):
        original = pair.parallel

        def counted(*args: object, _original: object = original, _name: str = name) -> object:
            parallel_calls.append(_name)
            return _original(*args)  # type: ignore[operator]

        monkeypatch.setattr(pair, "parallel", counted)
    one, rows_one = _run_updates(optimizer, memory_size, threads=1)
    assert not parallel_calls
    two, rows_two = _run_updates(optimizer, memory_size, threads=2)
    assert parallel_calls.count("step") == 3 and parallel_calls.count("lookup") == 1
    _assert_bitwise_equal(_snapshot(one), _snapshot(two))
    assert torch.equal(_bits(rows_one), _bits(rows_two))


_GOOD_IDS = torch.tensor([1, 2, 3])
_GOOD_GRADS = torch.ones(3, 20)


@pytest.mark.parametrize(
    ("ids", "grads", "lr"),
    [
        (torch.tensor([1.0, 2.0, 3.0]), _GOOD_GRADS, None),  # float ids
        (torch.tensor([1, 2, 3], dtype=torch.int32), _GOOD_GRADS, None),  # int32 ids
        (torch.tensor([[1, 2, 3]]), _GOOD_GRADS, None),  # 2-D ids
        (_GOOD_IDS, torch.ones(2, 20), None),  # N mismatch
        (_GOOD_IDS, torch.ones(3, 21), None),  # d mismatch
        (_GOOD_IDS, torch.ones(3, 20, dtype=torch.float64), None),
        (_GOOD_IDS, torch.ones(3, 20).index_fill(1, torch.tensor([7]), float("nan")), None),
        (_GOOD_IDS, torch.ones(3, 20).index_fill(0, torch.tensor([2]), float("inf")), None),
        (_GOOD_IDS, torch.ones(3, 20).index_fill(0, torch.tensor([0]), float("-inf")), None),
        (_GOOD_IDS, _GOOD_GRADS, 0.0),
        (_GOOD_IDS, _GOOD_GRADS, -0.1),
        (_GOOD_IDS, _GOOD_GRADS, float("nan")),
        (_GOOD_IDS, _GOOD_GRADS, float("inf")),
        (_GOOD_IDS, _GOOD_GRADS, "0.1"),
        ([1, 2, 3], _GOOD_GRADS, None),  # not a tensor
    ],
)
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.name)
def test_bad_update_raises_and_changes_nothing(ids, grads, lr, optimizer: OptimizerConfig) -> None:
    table = _table(optimizer)
    table.apply_gradients(_GOOD_IDS, _GOOD_GRADS)  # non-trivial state first
    before = _snapshot(table)
    with pytest.raises(InvalidInputError):
        table.apply_gradients(ids, grads, lr)
    _assert_bitwise_equal(before, _snapshot(table))


@pytest.mark.parametrize(
    "offsets",
    [
        torch.full((3, 3), -1, dtype=torch.int64),  # before the array
        torch.full((3, 3), 3000 - 8 + 1, dtype=torch.int64),  # a block would run past the end
        torch.zeros(3, 2, dtype=torch.int64),  # wrong number of chunks
        torch.zeros(3, 3, dtype=torch.int32),
        torch.zeros(2, 3, dtype=torch.int64),  # N differs from grads
    ],
)
def test_bad_offsets_raise_and_change_nothing(offsets: torch.Tensor) -> None:
    table = _table(OptimizerConfig("adam"))
    before = _snapshot(table)
    with pytest.raises(InvalidInputError):
        table.apply_gradients_at(offsets, _GOOD_GRADS)
    _assert_bitwise_equal(before, _snapshot(table))
    if offsets.shape[0] == 3:  # (2, 3) is only wrong next to three gradient rows
        with pytest.raises(InvalidInputError):
            table.gather(offsets)


@pytest.mark.parametrize("num_ids", [3, SMALL_BATCH_MAX_IDS + 1])
def test_sparse_inputs_raise_invalid_input_and_change_nothing(num_ids: int) -> None:
    # torch's and numpy's own errors (TypeError, NotImplementedError, RuntimeError) used to escape here,
    # on the small-batch path and the general one alike.
    table = _table(OptimizerConfig("adam"))
    table.apply_gradients(_GOOD_IDS, _GOOD_GRADS)
    before = _snapshot(table)
    ids = torch.arange(num_ids)
    grads = torch.ones(num_ids, 20)
    offsets = table.hash(ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch calls sparse CSR support beta
        sparse_grads = [grads.to_sparse(), grads.to_sparse_csr()]
    for bad_grads in sparse_grads:
        with pytest.raises(InvalidInputError, match="grads must be a dense tensor"):
            table.apply_gradients(ids, bad_grads)
        with pytest.raises(InvalidInputError, match="grads must be a dense tensor"):
            table.apply_gradients_at(offsets, bad_grads)
    with pytest.raises(InvalidInputError, match="ids must be a dense tensor"):
        table.apply_gradients(ids.to_sparse(), grads)
    with pytest.raises(InvalidInputError, match="dense 2-D int64"):
        table.apply_gradients_at(offsets.to_sparse(), grads)
    _assert_bitwise_equal(before, _snapshot(table))
    for read in (table.lookup, table.hash):
        with pytest.raises(InvalidInputError, match="ids must be a dense tensor"):
            read(ids.to_sparse())


def test_bad_reads_raise() -> None:
    table = _table()
    with pytest.raises(InvalidInputError):
        table.lookup(torch.tensor([1.5]))
    with pytest.raises(InvalidInputError):
        table.hash(torch.tensor([[1]]))
    with pytest.raises(InvalidInputError):
        table.lookup_bag(_GOOD_IDS, torch.tensor([0]), mode="max")
    with pytest.raises(InvalidInputError):
        table.lookup_bag(_GOOD_IDS, torch.tensor([1]))  # first bag must start at 0


# ---------------------------------------------------------------------------------- checkpoints

configs = st.builds(
    TableConfig,
    num_embeddings=st.integers(1, 10**12),
    embedding_dim=st.integers(1, 50),
    memory_size=st.integers(40, 3000),
    chunk_size=st.integers(1, 40),
    seed=st.integers(0, 2**32 - 1),
    val_offset=st.integers(INT64_MIN, INT64_MAX),
    hash=st.sampled_from(["paper", "fast"]),
    init_scale=st.floats(0.0, 10.0),
    random_numbers=st.one_of(
        st.none(),
        st.tuples(st.integers(1, 2**62), *[st.integers(INT64_MIN, INT64_MAX)] * 10),
    ),
)
optimizers = st.builds(
    OptimizerConfig,
    name=st.sampled_from(["sgd", "adagrad", "adam"]),
    lr=st.floats(1e-6, 1.0),
    betas=st.tuples(st.floats(0.0, 0.99), st.floats(0.0, 0.999)),
    eps=st.floats(1e-12, 1e-3),
    initial_accumulator_value=st.floats(0.0, 1.0),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, optimizer=optimizers, updates=st.integers(0, 3))
def test_checkpoint_round_trip_is_bitwise(
    config: TableConfig, optimizer: OptimizerConfig, updates: int
) -> None:
    table = Table(config, optimizer)
    gen = torch.Generator().manual_seed(updates)
    for _ in range(updates):
        ids = torch.randint(-50, 50, (10,), generator=gen)
        table.apply_gradients(ids, torch.randn(10, config.embedding_dim, generator=gen))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "table.safetensors"
        table.save(path)
        table.save(path)  # overwriting an existing checkpoint is the normal case
        loaded = Table.load(path)
        assert os.listdir(tmp) == ["table.safetensors"]  # no temp file left behind
    assert loaded.config == table.config
    assert loaded.optimizer == table.optimizer
    assert loaded.metadata() == table.metadata()
    assert torch.equal(loaded.random_numbers, table.random_numbers)
    _assert_bitwise_equal(_snapshot(table), _snapshot(loaded))
    ids = torch.tensor([0, 1, INT64_MIN, INT64_MAX])
    assert torch.equal(_bits(loaded.lookup(ids)), _bits(table.lookup(ids)))
    # The loaded table owns writable memory of its own.
    loaded.weight.add_(1.0)
    assert not torch.equal(loaded.weight, table.weight)


def test_metadata_names_the_table() -> None:
    table = _table(OptimizerConfig("adam"), hash="fast", seed=5)
    metadata = table.metadata()
    assert metadata["format"] == "robez-table" and metadata["format_version"] == "1"
    config = json.loads(metadata["config"])
    assert config["hash"] == "fast" and config["seed"] == 5 and config["chunk_size"] == 8
    assert config["memory_size"] == 3000 and config["embedding_dim"] == 20 and config["val_offset"] == 3
    assert json.loads(metadata["random_numbers"])[0] == PAPER_PRIME
    assert json.loads(metadata["optimizer"])["name"] == "adam"
    assert set(table.tensors()) == {"weight", "state.exp_avg", "state.exp_avg_sq", "state.step"}


def test_save_failure_leaves_nothing(tmp_path: Path) -> None:
    table = _table()
    with pytest.raises(OSError):
        table.save(tmp_path / "missing-dir" / "t.safetensors")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    table = _table(OptimizerConfig("adagrad"))
    table.apply_gradients(_GOOD_IDS, _GOOD_GRADS)
    path = tmp_path / "t.safetensors"
    table.save(path)
    return path


def _rewrite(path: Path, edit_tensors=None, edit_metadata=None) -> None:
    """Re-save a checkpoint with its tensors or metadata edited (a valid safetensors file)."""
    with safe_open(str(path), framework="pt") as f:
        metadata = dict(f.metadata())
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    if edit_tensors:
        edit_tensors(tensors)
    if edit_metadata:
        edit_metadata(metadata)
    save_file(tensors, str(path), metadata=metadata)


def test_load_missing_file_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError):
        Table.load(tmp_path / "nope.safetensors")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: p.write_bytes(b""), "not a readable safetensors"),
        (lambda p: p.write_bytes(b"\x00" * 64), "not a readable safetensors"),
        (lambda p: p.write_bytes(os.urandom(1000)), "not a readable safetensors"),
        (lambda p: p.write_bytes(p.read_bytes()[:-100]), "not a readable safetensors"),
        (lambda p: p.write_bytes(p.read_bytes()[:50]), "not a readable safetensors"),
        (lambda p: p.write_bytes(p.read_bytes()[:-1] + bytes([p.read_bytes()[-1] ^ 1])), "checksum"),
        (
            lambda p: _rewrite(p, edit_tensors=lambda t: t["weight"].__setitem__(17, 0.5)),
            "checksum",
        ),
        (lambda p: _rewrite(p, edit_tensors=lambda t: t.pop("state.sum")), "expected tensors"),
        (
            lambda p: _rewrite(p, edit_tensors=lambda t: t.__setitem__("extra", torch.zeros(1))),
            "expected tensors",
        ),
        (
            lambda p: _rewrite(p, edit_tensors=lambda t: t.__setitem__("weight", torch.zeros(2999))),
            "tensor 'weight'",
        ),
        (
            lambda p: _rewrite(p, edit_metadata=lambda m: m.__setitem__("format", "other")),
            "not a robez table",
        ),
        (
            lambda p: _rewrite(p, edit_metadata=lambda m: m.__setitem__("format_version", "99")),
            "format_version",
        ),
        (lambda p: _rewrite(p, edit_metadata=lambda m: m.pop("config")), "invalid metadata"),
        (lambda p: _rewrite(p, edit_metadata=lambda m: m.__setitem__("config", "{")), "invalid metadata"),
        (
            lambda p: _rewrite(
                p,
                edit_metadata=lambda m: m.__setitem__(
                    "config", m["config"].replace('"memory_size": 3000', '"memory_size": 2')
                ),
            ),
            "invalid metadata",
        ),
        (
            lambda p: _rewrite(
                p,
                edit_metadata=lambda m: m.__setitem__("optimizer", m["optimizer"].replace("adagrad", "adam")),
            ),
            "expected tensors",
        ),
        (
            lambda p: _rewrite(
                p,
                edit_metadata=lambda m: m.__setitem__("random_numbers", json.dumps([PAPER_PRIME] + [1] * 10)),
            ),
            "random_numbers",
        ),
    ],
)
def test_corrupt_checkpoint_is_corruption_error(checkpoint: Path, damage, message: str) -> None:
    damage(checkpoint)
    with pytest.raises(CorruptionError, match=message):
        Table.load(checkpoint)


def test_plain_safetensors_file_is_not_a_table(tmp_path: Path) -> None:
    path = tmp_path / "plain.safetensors"
    save_file({"weight": torch.zeros(10)}, str(path))
    with pytest.raises(CorruptionError, match="not a robez table"):
        Table.load(path)


# ---------------------------------------------------------------------------------- modules


def test_from_module_and_to_module_share_the_array() -> None:
    module = RobezEmbedding(100, 12, 400, chunk_size=5, val_offset=9, hash="fast", seed=12)
    table = Table.from_module(module, OptimizerConfig("sgd", lr=1.0))
    ids = torch.arange(-10, 10)
    assert torch.equal(table.lookup(ids), module(ids).detach())
    table.apply_gradients(ids, torch.ones(20, 12))
    assert torch.equal(table.lookup(ids), module(ids).detach())  # the module sees the update
    back = table.to_module()
    assert back.weight.data_ptr() == table.weight.data_ptr()
    assert back.config == table.config
    assert torch.equal(back(ids).detach(), table.lookup(ids))


# ------------------------------------------------------------------------- the paper's state_dict


class PaperRobezEmbedding(nn.Module):
    """A stand-in for the paper's module: the same parameter names and the same index arithmetic.

    The paper keeps ``weight`` as a shared Parameter and the constants and helpers as non-trainable
    Parameters; ``helper_Eidx_base`` is built by a float division cast back to int64.
    """

    def __init__(
        self, embedding_dim: int, weight: nn.Parameter, val_offset: int, chunk_size: int, random_numbers
    ) -> None:
        super().__init__()
        self.val_offset, self.chunk_size = val_offset, chunk_size
        self.weight = weight
        self.weights_size = weight.numel()
        self.random_numbers = nn.Parameter(
            torch.tensor(random_numbers, dtype=torch.int64), requires_grad=False
        )
        j = np.arange(embedding_dim)
        self.helper_Eidx_base = nn.Parameter(torch.LongTensor(j / chunk_size), requires_grad=False)
        self.helper_Eidx_offset = nn.Parameter(torch.LongTensor(j % chunk_size), requires_grad=False)
        self.helper_E1sR = nn.Parameter(
            torch.LongTensor(np.ones(embedding_dim) * int(random_numbers[3])), requires_grad=False
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        p, a, b = self.random_numbers[0], self.random_numbers[1], self.random_numbers[2]
        hashed = (
            ((ids.view(-1, 1) + self.val_offset) * self.helper_E1sR + self.helper_Eidx_base * b + a) % p
        ) % (self.weights_size - self.chunk_size + 1) + self.helper_Eidx_offset
        return self.weight[hashed]


def _paper_module(d: int, z: int, m: int, val_offset: int = 0, seed: int = 1024) -> PaperRobezEmbedding:
    draws = np.random.RandomState(seed).randint(0, PAPER_PRIME, 10)
    weight = nn.Parameter(
        torch.empty(m).uniform_(-0.001, 0.001, generator=torch.Generator().manual_seed(seed))
    )
    return PaperRobezEmbedding(d, weight, val_offset, z, [PAPER_PRIME, *draws.tolist()])


@pytest.mark.parametrize(("d", "z", "m"), [(100, 32, 262144), (7, 3, 50), (64, 1, 1000), (33, 32, 32)])
def test_import_paper_state_dict_reads_the_same_rows(d: int, z: int, m: int) -> None:
    paper = _paper_module(d, z, m, val_offset=1000, seed=4321)  # constants not from the default seed
    table = import_paper_state_dict(paper.state_dict(), val_offset=1000, num_embeddings=10**6)
    assert table.config.chunk_size == z and table.config.embedding_dim == d and table.config.memory_size == m
    assert table.config.num_embeddings == 10**6
    assert table.random_numbers.tolist() == paper.random_numbers.tolist()
    gen = torch.Generator().manual_seed(0)
    ids = torch.cat(
        [torch.randint(0, 10**6, (200,), generator=gen), torch.randint(INT64_MIN, INT64_MAX, (50,))]
    )
    with torch.no_grad():
        expected = paper(ids)
    assert torch.equal(table.lookup(ids), expected)
    assert torch.equal(table.to_module(backend="reference")(ids).detach(), expected)
    # The table owns a copy: training it leaves the paper's module alone.
    table.apply_gradients(ids[:3], torch.ones(3, d))
    assert torch.equal(paper(ids).detach(), expected)


@pytest.mark.parametrize("init_scale", [-1.0, float("nan"), float("inf"), 1.8e38, 3.9891452584725284e307])
def test_an_init_scale_a_float32_array_cannot_be_drawn_from_is_a_config_error(init_scale: float) -> None:
    with pytest.raises(ConfigError, match="init_scale"):
        TableConfig(num_embeddings=10, embedding_dim=4, memory_size=8, chunk_size=4, init_scale=init_scale)


def test_the_largest_init_scale_still_draws_a_finite_array() -> None:
    config = TableConfig(
        num_embeddings=10, embedding_dim=4, memory_size=64, chunk_size=4, init_scale=MAX_INIT_SCALE
    )
    assert bool(torch.isfinite(Table(config).weight).all())


def test_import_single_chunk_needs_chunk_size() -> None:
    paper = _paper_module(d=16, z=32, m=500)
    with pytest.raises(ConfigError, match="chunk_size"):
        import_paper_state_dict(paper.state_dict())
    with pytest.raises(ConfigError):
        import_paper_state_dict(paper.state_dict(), chunk_size=8)  # helpers say Z >= 16
    table = import_paper_state_dict(paper.state_dict(), chunk_size=32)
    ids = torch.arange(100)
    assert torch.equal(table.lookup(ids), paper(ids).detach())


def test_import_rejects_contradicting_chunk_size() -> None:
    paper = _paper_module(d=40, z=8, m=500)
    with pytest.raises(ConfigError, match="disagrees"):
        import_paper_state_dict(paper.state_dict(), chunk_size=16)
    assert import_paper_state_dict(paper.state_dict(), chunk_size=8).config.chunk_size == 8


def _edited(name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    state = dict(_paper_module(d=40, z=8, m=500).state_dict())
    state[name] = value
    return state


@pytest.mark.parametrize(
    "state_dict",
    [
        _edited("helper_E1sR", torch.ones(40, dtype=torch.int64)),
        _edited("helper_Eidx_base", torch.zeros(40, dtype=torch.int64)),
        _edited("helper_Eidx_offset", torch.arange(40) % 7),
        _edited("helper_Eidx_offset", torch.arange(41) % 8),
        _edited("helper_Eidx_base", torch.arange(40, dtype=torch.int32) // 8),
        _edited("random_numbers", torch.arange(10)),
        _edited("random_numbers", torch.zeros(11, dtype=torch.int64)),
        _edited("weight", torch.zeros(500, dtype=torch.float64)),
        _edited("weight", torch.zeros(5)),  # fewer values than one chunk
    ],
)
def test_import_inconsistent_state_dict_is_corruption(state_dict: dict[str, torch.Tensor]) -> None:
    with pytest.raises(CorruptionError):
        import_paper_state_dict(state_dict)


def test_import_missing_key_is_config_error() -> None:
    state = dict(_paper_module(d=40, z=8, m=500).state_dict())
    del state["helper_E1sR"]
    with pytest.raises(ConfigError, match="helper_E1sR"):
        import_paper_state_dict(state)


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_prepare_check_apply_is_apply_gradients_at_and_refuses_overflow(name: str) -> None:
    config = TableConfig(num_embeddings=100, embedding_dim=8, memory_size=64, chunk_size=4)
    optimizer = OptimizerConfig(name=name, lr=0.05, max_lr=3e38)  # type: ignore[arg-type]
    split, fused = Table(config, optimizer), Table(config, optimizer)
    generator = torch.Generator().manual_seed(2)
    for _ in range(3):
        ids = torch.randint(0, 100, (6,), generator=generator)
        grads = torch.randn(6, 8, generator=generator)
        step = split.prepare_step(split.hash(ids), grads, 0.1)
        split.check_step(step)
        split.apply_step(step)
        fused.apply_gradients_at(fused.hash(ids), grads, 0.1)
    for key, tensor in fused.tensors().items():
        assert torch.equal(split.tensors()[key], tensor), key

    before = {key: tensor.clone() for key, tensor in split.tensors().items()}
    overflowing = split.prepare_step(split.hash(torch.tensor([3])), torch.full((1, 8), 1e30), 1e10)
    with pytest.raises(InvalidInputError, match="non-finite"):
        split.check_step(overflowing)
    for key, tensor in before.items():
        assert torch.equal(split.tensors()[key], tensor), key
    with pytest.raises(InvalidInputError, match="max_lr"):
        Table(config, OptimizerConfig(name=name)).prepare_step(  # type: ignore[arg-type]
            split.hash(torch.tensor([3])), torch.ones(1, 8), 1e39
        )


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_a_checked_step_in_one_pass_is_check_then_apply_and_a_refused_one_changes_nothing(
    name: str, threads: int
) -> None:
    """``apply_checked_step`` (the dry run and the step in one pass, issue 37): the same bits as
    ``check_step`` + ``apply_step``; refused, when one location of many overflows, with every value
    (those it wrote before and after that one) and Adam's step count as they were."""
    if threads > numba.config.NUMBA_NUM_THREADS:  # type: ignore[attr-defined]
        pytest.skip("numba has one thread on this machine")
    config = TableConfig(num_embeddings=5000, embedding_dim=16, memory_size=200_000, chunk_size=8)
    optimizer = OptimizerConfig(name=name, lr=0.05, max_lr=3e38)  # type: ignore[arg-type]
    split, one_pass = Table(config, optimizer), Table(config, optimizer)
    generator = torch.Generator().manual_seed(5)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(3):
            ids = torch.randint(0, 5000, (4 * SMALL_BATCH_MAX_IDS,), generator=generator)
            grads = torch.randn(ids.numel(), 16, generator=generator)
            step = split.prepare_step(split.hash(ids), grads, 0.1)
            split.check_step(step)
            split.apply_step(step)
            one_pass.apply_checked_step(one_pass.prepare_step(one_pass.hash(ids), grads, 0.1))
        _assert_bitwise_equal(_snapshot(split), _snapshot(one_pass))

        before = _snapshot(one_pass)
        grads = torch.full((ids.numel(), 16), 1e-3)
        grads[ids.numel() // 2] = 1e30  # one row of many: lr x grad (sgd) or grad^2 (adagrad, adam) overflows
        refused = one_pass.prepare_step(one_pass.hash(ids), grads, 1e10)
        with pytest.raises(InvalidInputError, match="non-finite"):
            one_pass.apply_checked_step(refused)
    finally:
        torch.set_num_threads(previous)
    _assert_bitwise_equal(before, _snapshot(one_pass))


# ------------------------------------------------------------------------- small-batch fast path


def _general_path_update(table: Table, ids: torch.Tensor, grads: torch.Tensor, lr: float | None) -> None:
    """The general path by hand: public kernels, as ``Table._apply`` runs them for big batches."""
    c = table.config
    offsets = kernels.chunk_offsets(
        ids, c.num_chunks, c.chunk_size, c.memory_size, table.random_numbers, c.val_offset, c.hash
    )
    optim.fused_update(table.optimizer, table.weight, table.state, offsets, grads, c.chunk_size, lr)


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.name)
@pytest.mark.parametrize("memory_size", [3000, 200_000], ids=["dense-coalesce", "sorted-coalesce"])
@pytest.mark.parametrize("hash", ["paper", "fast"])
def test_small_batches_are_bit_identical_to_the_general_path(
    optimizer: OptimizerConfig, memory_size: int, hash: str
) -> None:
    fast = _table(optimizer, memory_size=memory_size, hash=hash)
    general = _table(optimizer, memory_size=memory_size, hash=hash)
    generator = torch.Generator().manual_seed(7)
    for step, size in enumerate([1, 3, 8, 8, SMALL_BATCH_MAX_IDS]):
        ids = torch.randint(-50, 50, (size,), generator=generator)  # duplicates included
        grads = torch.randn(size, 20, generator=generator)
        lr = None if step % 2 else 0.03
        if step == 3:  # ids hashed first, then applied at offsets
            fast.apply_gradients_at(fast.hash(ids), grads, lr)
        elif step == 1:  # the service's path: prepared, checked, applied (``TableStore.apply_update``)
            prepared = fast.prepare_step(fast.hash(ids), grads, lr, offsets_from_hash=True)
            fast.check_step(prepared)
            fast.apply_step(prepared)
        else:
            fast.apply_gradients(ids, grads, lr)
        _general_path_update(general, ids, grads, lr)
        _assert_bitwise_equal(_snapshot(general), _snapshot(fast))
        c = general.config
        rows = kernels.lookup(
            general.weight, ids, c.embedding_dim, c.chunk_size, general.random_numbers, c.val_offset, c.hash
        )
        assert torch.equal(_bits(fast.lookup(ids)), _bits(rows))
        assert torch.equal(_bits(fast.gather(fast.hash(ids))), _bits(rows))
        assert torch.equal(_bits(fast.lookup_timed(ids)[0]), _bits(rows))
    many = torch.randint(-(2**62), 2**62, (SMALL_BATCH_MAX_IDS + 100,), generator=generator)
    assert torch.equal(_bits(fast.lookup_timed(many)[0]), _bits(fast.lookup(many)))  # the general path


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.name)
@pytest.mark.parametrize("hash", ["paper", "fast"])
def test_a_checked_small_update_is_the_three_part_step(optimizer: OptimizerConfig, hash: str) -> None:
    checked = _table(optimizer, memory_size=200_000, hash=hash)
    parts = _table(optimizer, memory_size=200_000, hash=hash)
    generator = torch.Generator().manual_seed(11)
    for size in [1, 2, 8, 8, 33, SMALL_BATCH_MAX_IDS]:
        ids = torch.randint(-50, 50, (size,), generator=generator)  # duplicates included
        grads = torch.randn(size, 20, generator=generator)
        if size % 2:  # the service's numpy arrays, or tensors
            timings = checked.try_checked_update(ids.numpy(), grads.numpy(), 0.03)
        else:
            timings = checked.try_checked_update(ids, grads, 0.03)
        assert timings is not None and min(timings) >= 0
        step = parts.prepare_step(parts.hash(ids), grads, 0.03, offsets_from_hash=True)
        parts.check_step(step)
        parts.apply_step(step)
        _assert_bitwise_equal(_snapshot(parts), _snapshot(checked))


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.name)
def test_a_checked_small_update_leaves_to_the_general_path_what_it_must_refuse(
    optimizer: OptimizerConfig,
) -> None:
    table = _table(optimizer, memory_size=200_000)
    ids = torch.tensor([3, 4])
    nan_grads = torch.ones(2, 20)
    nan_grads[1, 7] = float("nan")
    inf_grads = torch.ones(2, 20)
    inf_grads[0, 19] = float("-inf")
    declined = {
        "a NaN gradient": (ids, nan_grads, 0.03),
        "an infinite gradient": (ids, inf_grads, 0.03),
        "a step that overflows": (ids, torch.full((2, 20), 3e38), 1000.0),
        "an lr over max_lr": (ids, torch.ones(2, 20), 2000.0),
        "too many ids": (
            torch.arange(SMALL_BATCH_MAX_IDS + 1),
            torch.ones(SMALL_BATCH_MAX_IDS + 1, 20),
            0.03,
        ),
        "no ids": (torch.zeros(0, dtype=torch.int64), torch.ones(0, 20), 0.03),
        "rows of the wrong width": (ids, torch.ones(2, 19), 0.03),
        "a row too few": (ids, torch.ones(1, 20), 0.03),
        "float64 gradients": (ids, torch.ones(2, 20, dtype=torch.float64), 0.03),
        "bfloat16 gradients": (ids, torch.ones(2, 20, dtype=torch.bfloat16), 0.03),
        "float64 gradients in an array": (ids.numpy(), np.ones((2, 20)), 0.03),
        "strided gradients in an array": (ids.numpy(), np.ones((2, 40), dtype=np.float32)[:, ::2], 0.03),
        "int32 ids in an array": (ids.numpy().astype(np.int32), np.ones((2, 20), dtype=np.float32), 0.03),
        "a NaN gradient in an array": (ids.numpy(), nan_grads.numpy(), 0.03),
    }
    before = _snapshot(table)
    for case, (case_ids, grads, lr) in declined.items():
        assert table.try_checked_update(case_ids, grads, lr) is None, case
        _assert_bitwise_equal(before, _snapshot(table))
    # Where the general path coalesces through its dense scratch, it takes the update itself.
    dense = _table(optimizer, memory_size=3000)
    many = torch.arange(SMALL_BATCH_MAX_IDS)
    assert dense.try_checked_update(many, torch.ones(SMALL_BATCH_MAX_IDS, 20), 0.03) is None
    assert dense.try_checked_update(ids, torch.ones(2, 20), 0.03) is not None


@pytest.mark.parametrize("num_ids", [1, 5, SMALL_BATCH_MAX_IDS, SMALL_BATCH_MAX_IDS + 1, 300])
def test_lookup_timed_of_a_numpy_array_gives_the_tensor_paths_rows_as_an_array(num_ids: int) -> None:
    table = _table()
    ids = torch.randint(-(2**62), 2**62, (num_ids,), generator=torch.Generator().manual_seed(num_ids))
    rows, hash_seconds, lookup_seconds = table.lookup_timed(ids.numpy())
    assert type(rows) is np.ndarray and rows.dtype == np.float32 and min(hash_seconds, lookup_seconds) >= 0
    np.testing.assert_array_equal(rows.view(np.uint8), _bits(table.lookup(ids)).numpy())
    strided = np.repeat(ids.numpy(), 2)[::2]  # not contiguous: the general path
    np.testing.assert_array_equal(table.lookup_timed(strided)[0], rows)
    for bad in [ids.numpy().astype(np.float64), ids.numpy().reshape(1, -1), ids.numpy().astype(np.int32)]:
        with pytest.raises(InvalidInputError, match="1-D int64"):
            table.lookup_timed(bad)


@pytest.mark.parametrize("num_ids", [2, SMALL_BATCH_MAX_IDS + 1])
def test_only_lookup_timed_takes_numpy_ids_small_batches_or_not(num_ids: int) -> None:
    table = _table()
    ids = np.arange(num_ids, dtype=np.int64)
    for call in (table.lookup, table.hash, lambda ids: table.apply_gradients(ids, torch.ones(num_ids, 20))):
        with pytest.raises(InvalidInputError, match=r"torch\.Tensor"):
            call(ids)
    assert type(table.lookup_timed(ids)[0]) is np.ndarray


def test_small_path_follows_a_replaced_weight() -> None:
    table = _table()
    ids = torch.tensor([4, 5])
    table.lookup(ids)  # prepares the small path over the first array
    table.weight = torch.zeros_like(table.weight)
    assert torch.equal(table.lookup(ids), torch.zeros(2, 20))


def test_save_streams_the_safetensors_format(tmp_path: Path) -> None:
    """``save`` writes the tensors' memory as it is (``begin_save``) and the checksums afterwards
    (``finish``): safetensors reads the file, with the same tensors and metadata; a file written by
    safetensors' own ``save_file`` loads too; ``discard`` leaves nothing."""
    table = _table(OptimizerConfig("adam"))
    table.apply_gradients(_GOOD_IDS, _GOOD_GRADS)
    path = tmp_path / "t.safetensors"
    pending = table.begin_save(path)
    assert not path.exists() and pending.tmp.exists()
    assert pending.finish() == path
    assert [p.name for p in tmp_path.iterdir()] == ["t.safetensors"]
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
        assert set(f.keys()) == set(table.tensors())
        for name, tensor in table.tensors().items():
            assert torch.equal(f.get_tensor(name), tensor)
    assert {k: v for k, v in metadata.items() if k != "checksums"} == table.metadata()
    tensors = {name: t.clone() for name, t in table.tensors().items()}
    save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata=metadata)
    for loaded in (Table.load(path), Table.load(tmp_path / "theirs.safetensors")):
        assert all(torch.equal(loaded.tensors()[k], v) for k, v in table.tensors().items())
    table.begin_save(tmp_path / "other.safetensors").discard()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.safetensors", "theirs.safetensors"]


# Written by service/wal/image.py (the journal's own writer until it was folded into Table.begin_write):
# the same format, but the tensors in name order, where Table.save puts int64 state.step first.
OLD_SNAPSHOT = Path(__file__).parent / "data" / "adam-by-name-order.safetensors"


def _old_snapshot_table() -> Table:
    table = Table(TableConfig(100, 8, memory_size=64, chunk_size=8, seed=3), OptimizerConfig("adam", lr=0.05))
    table.state["exp_avg"].copy_(torch.arange(64, dtype=torch.float32))
    table.state["exp_avg_sq"].copy_(torch.arange(64, dtype=torch.float32) * 0.5)
    table.state["step"].fill_(7)
    return table


def test_a_snapshot_in_the_old_journal_writers_tensor_order_still_loads(tmp_path: Path) -> None:
    expected = _old_snapshot_table()
    loaded = Table.load(OLD_SNAPSHOT)  # checksums checked
    for name, tensor in expected.tensors().items():
        assert torch.equal(loaded.tensors()[name], tensor), name
    # Saved again, it is Table.save's layout (state.step first): a different file, the same table.
    loaded.save(tmp_path / "again.safetensors")
    again = (tmp_path / "again.safetensors").read_bytes()
    assert again != OLD_SNAPSHOT.read_bytes()
    assert torch.equal(Table.load(tmp_path / "again.safetensors").state["step"], expected.state["step"])
    damaged = bytearray(OLD_SNAPSHOT.read_bytes())
    damaged[-1] ^= 1  # in weight, the last tensor of this order
    (tmp_path / "damaged.safetensors").write_bytes(damaged)
    with pytest.raises(CorruptionError, match="checksum mismatch in tensor 'weight'"):
        Table.load(tmp_path / "damaged.safetensors")


def test_begin_leaves_the_tensors_bytes_to_the_caller_at_their_spans(tmp_path: Path) -> None:
    """``CheckpointWriter.begin``: header and space only; the tensors filled at ``spans()`` (as a live
    snapshot does through a mapping of the file), then ``finish`` makes the bytes ``save`` makes."""
    table = _old_snapshot_table()
    table.save(tmp_path / "saved.safetensors")
    fd = os.open(tmp_path / "begun.safetensors", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        writer = CheckpointWriter.begin(fd, table.tensors(), table.metadata())
        spans = writer.spans()
        assert os.fstat(fd).st_size == max(start + nbytes for start, nbytes in spans.values())
        for name, tensor in table.tensors().items():
            start, nbytes = spans[name]
            assert nbytes == tensor.nbytes
            os.pwrite(fd, tensor.reshape(-1).view(torch.uint8).numpy().tobytes(), start)
        writer.finish(fd, durable=False)
    finally:
        os.close(fd)
    assert (tmp_path / "begun.safetensors").read_bytes() == (tmp_path / "saved.safetensors").read_bytes()


def test_begin_write_into_an_open_file_makes_the_bytes_save_makes(tmp_path: Path) -> None:
    table = _old_snapshot_table()
    table.save(tmp_path / "saved.safetensors")
    fd = os.open(tmp_path / "written.safetensors", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        writer = table.begin_write(fd)
        pieces: list[int] = []
        writer.finish(fd, durable=False, each_piece=lambda piece: pieces.append(len(piece)))
    finally:
        os.close(fd)
    written = (tmp_path / "written.safetensors").read_bytes()
    assert written == (tmp_path / "saved.safetensors").read_bytes()
    assert sum(pieces) == table.weight.nbytes + sum(t.nbytes for t in table.state.values())
    # Read back with verify=False, the header then every piece is the whole file, in order.
    checkpoint = CheckpointFile.open(tmp_path / "written.safetensors")
    seen = bytearray(checkpoint.header)
    tensors = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in checkpoint.layout.items()}
    checkpoint.read_into(tensors, verify=False, each_piece=seen.extend)
    assert bytes(seen) == written and torch.equal(tensors["weight"], table.weight)
