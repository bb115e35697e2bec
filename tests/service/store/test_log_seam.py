"""The store as a state machine over the log seam (``service/log/``), tested over the in-memory log: one
validation before proposing, one version bump per entry, replay equal to live, a forged entry skipped
alike everywhere, multi-table entries all or nothing."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from robez_core.config import OptimizerConfig, TableConfig
from robez_core.errors import InvalidInputError, LimitExceededError
from service.config import Settings, TableSpec
from service.log.journal import NullJournal
from service.log.memory import MemoryLog
from service.shm import SharedDirectory
from service.store import TableStore, UpdatePart
from service.store.journal import SkippedRecord, UpdateRecord

CONFIG = TableConfig(num_embeddings=100, embedding_dim=8, memory_size=1024, chunk_size=4)
WIDE = TableConfig(num_embeddings=50, embedding_dim=4, memory_size=512, chunk_size=2, seed=3)


def _directory(settings: Settings, tag: str) -> SharedDirectory:
    return SharedDirectory.create(settings.shm_dir.parent / f"shm-{tag}")


@pytest.fixture
def log() -> MemoryLog:
    return MemoryLog()


@pytest.fixture
def store(settings: Settings, log: MemoryLog) -> Iterator[TableStore]:
    directory = _directory(settings, "a")
    made = TableStore(directory, settings, log)
    made.create("a", TableSpec(CONFIG, OptimizerConfig("adam", lr=0.05)))
    made.create("b", TableSpec(WIDE, OptimizerConfig("adagrad", lr=0.1)))
    yield made
    made.close()
    directory.remove()


def _state(store: TableStore, name: str) -> dict[str, torch.Tensor]:
    return {key: tensor.clone() for key, tensor in store.table(name).tensors().items()}


def _equal(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> bool:
    return left.keys() == right.keys() and all(
        torch.equal(left[key].view(torch.int32), right[key].view(torch.int32)) for key in left
    )


def _parts(generator: torch.Generator, lr: float | None = None) -> list[UpdatePart]:
    return [
        UpdatePart(
            "a", torch.randint(0, 100, (12,), generator=generator), torch.randn(12, 8, generator=generator)
        ),
        UpdatePart(
            "b", torch.randint(0, 50, (5,), generator=generator), torch.randn(5, 4, generator=generator), lr
        ),
    ]


def test_a_multi_table_push_is_one_entry_with_one_bump_per_table(store: TableStore, log: MemoryLog) -> None:
    generator = torch.Generator().manual_seed(1)
    results = store.update_many(_parts(generator), idempotency_key="k1")
    assert [result.version for result in results] == [1, 1]
    assert (store.version("a"), store.version("b")) == (1, 1)
    (record_a,), (record_b,) = log.records("a"), log.records("b")
    assert record_a.group is not None and record_a.group == record_b.group  # one entry, two parts
    assert record_a.group.parts == (("a", 1), ("b", 1))
    # A single-table push is an entry of one part: one record, no group, one bump.
    assert store.update("b", torch.tensor([1, 1]), torch.ones(2, 4)).version == 2
    assert log.records("b")[-1].group is None and store.version("b") == 2


def test_tables_sharing_an_array_take_its_lock_once(settings: Settings) -> None:
    # "a" and "c" share one array, so one lock (no data directory: sharing needs it): a push of both
    # must neither deadlock nor bump twice.
    directory = _directory(settings, "shared")
    store = TableStore(directory, settings, NullJournal())
    try:
        store.create("a", TableSpec(CONFIG, OptimizerConfig("adam", lr=0.05)))
        store.create("c", TableSpec(CONFIG, OptimizerConfig("adam", lr=0.05), share_array_with="a"))
        before = _state(store, "a")
        results = store.update_many(
            [
                UpdatePart("c", torch.tensor([3]), torch.ones(1, 8)),
                UpdatePart("a", torch.tensor([4]), torch.ones(1, 8)),
            ]
        )
        assert [result.version for result in results] == [1, 1]
        assert (store.version("a"), store.version("c")) == (1, 1)
        assert not _equal(before, _state(store, "a"))
    finally:
        store.close()
        directory.remove()


def test_a_non_finite_gradient_in_one_table_applies_nothing(store: TableStore, log: MemoryLog) -> None:
    generator = torch.Generator().manual_seed(2)
    parts = _parts(generator)
    bad = parts[1].grads.clone()
    bad[2, 1] = float("nan")
    parts[1] = UpdatePart("b", parts[1].ids, bad)
    before = {name: _state(store, name) for name in ("a", "b")}
    with pytest.raises(InvalidInputError, match="NaN"):
        store.update_many(parts)
    assert (store.version("a"), store.version("b")) == (0, 0)
    assert all(_equal(before[name], _state(store, name)) for name in before)
    assert log.records("a") == [] and log.records("b") == []  # never proposed


def test_bad_multi_table_requests_are_refused_before_anything_changes(
    store: TableStore, log: MemoryLog
) -> None:
    part = UpdatePart("a", torch.tensor([1]), torch.ones(1, 8))
    with pytest.raises(InvalidInputError, match="more than once"):
        store.update_many([part, part])
    with pytest.raises(InvalidInputError, match="at least one"):
        store.update_many([])
    with pytest.raises(InvalidInputError, match=r"shape|dim"):  # gradients of the wrong width in "b"
        store.update_many([part, UpdatePart("b", torch.tensor([5]), torch.ones(1, 8))])
    store.limits = dataclasses.replace(store.limits, max_ids_per_request=3)
    with pytest.raises(LimitExceededError):  # the limit applies to the sum of the parts
        store.update_many([part, UpdatePart("b", torch.tensor([1, 2, 3]), torch.ones(3, 4))])
    assert (store.version("a"), store.version("b")) == (0, 0) and log.records("a") == []


def test_a_failed_append_in_the_middle_takes_back_the_parts_before_it(
    store: TableStore, log: MemoryLog
) -> None:
    before = {name: _state(store, name) for name in ("a", "b")}
    log.fail_append_after = log.appended + 1  # the first part is appended, the second fails
    with pytest.raises(OSError):
        store.update_many(_parts(torch.Generator().manual_seed(3)))
    log.fail_append_after = None
    assert log.records("a") == [] and log.records("b") == []
    assert (store.version("a"), store.version("b")) == (0, 0)
    assert all(_equal(before[name], _state(store, name)) for name in before)
    assert store.update("a", torch.tensor([1]), torch.ones(1, 8)).version == 1  # the table goes on


def test_replay_equals_live_bitwise(store: TableStore, log: MemoryLog, settings: Settings) -> None:
    generator = torch.Generator().manual_seed(4)
    for step in range(6):
        if step % 2:
            store.update_many(_parts(generator, lr=0.05))
        else:
            store.update(
                "a",
                torch.randint(0, 100, (40,), generator=generator),
                torch.randn(40, 8, generator=generator),
            )
            store.update("b", torch.tensor([7]), torch.randn(1, 4, generator=generator))  # the small path
        if step == 3:
            store.snapshot("b")  # replay from a snapshot and the records after it
    live = {name: (_state(store, name), store.version(name)) for name in ("a", "b")}
    directory = _directory(settings, "replayed")
    try:
        TableStore.fill(directory, settings, log)  # a restart: the tables from the log alone
        replayed = TableStore(directory, settings, NullJournal())
        for name, (state, version) in live.items():
            assert replayed.version(name) == version, name
            assert _equal(state, _state(replayed, name)), name
        replayed.close()
    finally:
        directory.remove()


def test_a_forged_entry_is_skipped_alike_everywhere(settings: Settings) -> None:
    """Entries of a replicated log can be written by anyone: one that fails a check is an empty version
    on every replica (the same version, the same bytes), and the table goes on."""
    replicas = []
    for tag in ("r1", "r2"):
        directory = _directory(settings, tag)
        replica = TableStore(directory, settings, NullJournal())
        replica.create("a", TableSpec(CONFIG, OptimizerConfig("adam", lr=0.05)))
        replicas.append((directory, replica))
    nan = torch.ones(2, 8)
    nan[1, 3] = float("nan")
    entries = [
        UpdateRecord("a", 1, torch.tensor([1, 2]), torch.ones(2, 8), 0.05),
        UpdateRecord("a", 2, torch.tensor([1, 2]), nan, 0.05),  # non-finite gradients
        UpdateRecord("a", 3, torch.tensor([1, 2], dtype=torch.int32), torch.ones(2, 8), 0.05),  # not int64
        UpdateRecord("a", 4, torch.tensor([1]), torch.ones(1, 8), float("inf")),  # lr not finite
        UpdateRecord("a", 5, torch.tensor([5]), torch.ones(1, 8), 0.05),
    ]
    outcomes = [[replica.apply(entry) for entry in entries] for _, replica in replicas]
    for outcome in outcomes:
        assert [type(each).__name__ for each in outcome] == [
            "UpdateResult",
            "SkippedRecord",
            "SkippedRecord",
            "SkippedRecord",
            "UpdateResult",
        ]
        assert [each.reason for each in outcome if isinstance(each, SkippedRecord)] == [
            "bad_grads",
            "bad_ids",
            "bad_lr",
        ]
    assert replicas[0][1].apply(entries[2]) is None  # a replayed entry: nothing
    assert [replica.version("a") for _, replica in replicas] == [5, 5]
    assert replicas[0][1].checksum("a") == replicas[1][1].checksum("a")
    for directory, replica in replicas:
        replica.close()
        directory.remove()
