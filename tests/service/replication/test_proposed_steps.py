"""One validation per push: the step a replica prepared when it validated a push is applied as it is
when its own applier applies that very entry (not hashed nor coalesced again); an entry with other bytes
(forged, another replica's) goes through every check; the tables end bitwise equal either way (in memory:
no NATS, no server process)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import service.log.entry as entry_module
from robez_core.config import OptimizerConfig, TableConfig
from robez_core.table import Table
from service.config import Settings, TableSpec
from service.log.entry import Proposed
from service.log.journal import NullJournal
from service.metrics import Metrics
from service.replication.applier import Applier
from service.replication.log import CatalogEntry, LogEntry
from service.replication.proposed import ProposedSteps
from service.replication.records import decode_entry, encode_update
from service.shm import SharedDirectory
from service.store import TableStore, UpdatePart
from service.store.journal import SkippedRecord, UpdateRecord

from ..conftest import make_settings
from .conftest import ADAM, SMALL, push_grads

ENTRY = CatalogEntry("t", SMALL, ADAM, "inc")
SPEC = TableSpec(TableConfig(**SMALL), OptimizerConfig(**ADAM))  # type: ignore[arg-type]
# 16 ids: the small path; 100: the general one (over SMALL_BATCH_MAX_IDS).
ROWS = (16, 100)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return make_settings(tmp_path, default_table=False)


@pytest.fixture
def stores(settings: Settings) -> Iterator[list[TableStore]]:
    """Two replicas' stores of table "t": the proposer and another."""
    made = []
    for tag in ("proposer", "other"):
        directory = SharedDirectory.create(settings.shm_dir.parent / f"shm-{tag}")
        store = TableStore(directory, settings, NullJournal())
        store.create(ENTRY.name, SPEC)
        made.append((directory, store))
    yield [store for _, store in made]
    for directory, store in made:
        store.close()
        directory.remove()


class _Prepares:
    """Counts the updates applied by preparing them (hash + coalesce, either path)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        prepare, checked = entry_module.prepare, Table.try_checked_update

        def counted_prepare(*args: object, **kwargs: object) -> object:
            self.count += 1
            return prepare(*args, **kwargs)  # type: ignore[arg-type]

        def counted_checked(table: Table, *args: object) -> object:
            self.count += 1
            return checked(table, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(entry_module, "prepare", counted_prepare)
        monkeypatch.setattr(Table, "try_checked_update", counted_checked)


def _validated(store: TableStore, seed: int, rows: int) -> tuple[bytes, dict[str, str], Proposed]:
    """A push validated on ``store`` as ``ReplicatedWrites`` does: the entry's bytes and its step."""
    ids, grads = push_grads(seed, rows)
    ((lr, proposed),) = store.validate_many([UpdatePart(ENTRY.name, ids, grads, None)])
    payload, headers = encode_update(ids, grads, lr)
    return payload, headers, proposed


def _state(store: TableStore) -> dict[str, torch.Tensor]:
    return {key: tensor.clone() for key, tensor in store.table(ENTRY.name).tensors().items()}


def _assert_bitwise_equal(left: TableStore, right: TableStore) -> None:
    a, b = _state(left), _state(right)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key].view(torch.int32), b[key].view(torch.int32)), key


def test_the_proposed_step_is_applied_as_it_is_and_gives_the_same_bits(
    stores: list[TableStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    proposer, other = stores
    prepares = _Prepares(monkeypatch)
    for position, rows in enumerate(ROWS * 2, start=1):
        payload, headers, proposed = _validated(proposer, position, rows)
        record = decode_entry(ENTRY.name, position, payload, headers)
        assert isinstance(record, UpdateRecord)
        before = prepares.count
        mine = proposer.apply(record, proposed)
        assert prepares.count == before  # neither hashed nor coalesced again
        theirs = other.apply(record)  # another replica: every check
        assert prepares.count > before
        assert mine is not None and theirs is not None and mine.version == theirs.version == position
    _assert_bitwise_equal(proposer, other)


def test_a_proposed_step_of_another_table_or_lr_is_not_used(
    stores: list[TableStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    proposer, other = stores
    payload, headers, proposed = _validated(proposer, 1, ROWS[1])
    record = decode_entry(ENTRY.name, 1, payload, headers)
    assert isinstance(record, UpdateRecord)
    prepares = _Prepares(monkeypatch)
    # Prepared on the other store's table object (another incarnation, say): prepared again.
    other.apply(record, proposed)
    assert prepares.count > 0
    counted = prepares.count
    # The same entry with another lr than the step's: prepared again, at the entry's lr.
    other_lr = UpdateRecord(ENTRY.name, 1, record.ids, record.grads, record.lr / 2)
    proposer.apply(other_lr, proposed)
    assert prepares.count > counted
    assert not torch.equal(_state(proposer)["weight"], _state(other)["weight"])  # lr differed


@pytest.mark.parametrize("rows", ROWS)
def test_a_proposed_step_is_still_checked_at_the_entrys_version(stores: list[TableStore], rows: int) -> None:
    """The step was fine on the table as it was when proposed; the entry is applied where it would
    make a value non-finite: skipped, as on a replica that prepares it itself, and the table is as it
    was, bit for bit (the general path checks in the pass that applies: what it wrote is put back)."""
    proposer, other = stores
    ids = torch.arange(rows) * 7919
    grads = torch.ones(rows, SMALL["embedding_dim"])
    ((lr, proposed),) = proposer.validate_many([UpdatePart(ENTRY.name, ids, grads, None)])
    payload, headers = encode_update(ids, grads, lr)
    # Meanwhile the table changed (here: by hand) so that the step would leave a non-finite value, at
    # the last location it touches only: every other one is written first.
    last = int(proposed.step.locations[-1])
    for store in stores:
        store.table(ENTRY.name).weight[last] = float("inf")
    before = _state(proposer)
    record = decode_entry(ENTRY.name, 1, payload, headers)
    assert isinstance(record, UpdateRecord)
    mine, theirs = proposer.apply(record, proposed), other.apply(record)
    assert isinstance(mine, SkippedRecord) and isinstance(theirs, SkippedRecord)
    assert mine.reason == theirs.reason == "non_finite_step"
    after = _state(proposer)
    assert all(torch.equal(before[name], after[name]) for name in before)
    _assert_bitwise_equal(proposer, other)


def test_the_applier_uses_its_own_steps_and_checks_a_forged_entry(
    tmp_path: Path, settings: Settings, stores: list[TableStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    proposer, other = stores
    applier = Applier(proposer, settings, Metrics(), None, tmp_path / "replication.json")  # type: ignore[arg-type]
    taken: list[tuple[LogEntry, UpdateRecord | SkippedRecord]] = []
    for position in range(1, 5):
        payload, headers, proposed = _validated(proposer, position, ROWS[position % 2])
        applier.proposed.put(ENTRY.name, payload, headers, proposed)
        if position == 3:  # forged: the same headers (and key) with other bytes in the log
            forged = bytearray(payload)
            forged[-1] ^= 0x01
            payload = bytes(forged)
        record = decode_entry(ENTRY.name, position, payload, headers)
        assert isinstance(record, UpdateRecord)
        taken.append((LogEntry(position, payload, headers, 0.0, 4 - position), record))
    prepares = _Prepares(monkeypatch)
    asyncio.run(applier._apply_updates(ENTRY, list(taken)))
    assert prepares.count == 2  # only the forged entry (100 ids: tried on the small path, then prepared)
    assert len(applier.proposed) == 1  # the forged entry's step was not taken (dropped in time)
    for _, record in taken:
        other.apply(record)
    assert proposer.version(ENTRY.name) == other.version(ENTRY.name) == 4
    _assert_bitwise_equal(proposer, other)


def test_kept_steps_are_bounded_in_count_and_age(stores: list[TableStore]) -> None:
    proposer = stores[0]
    payload, headers, proposed = _validated(proposer, 1, ROWS[0])
    kept = ProposedSteps(max_entries=3, max_age_s=60.0)
    for _ in range(5):
        kept.put(ENTRY.name, payload, headers, proposed)
    assert len(kept) == 3
    assert kept.take("another table", payload, headers) is None
    assert kept.take(ENTRY.name, payload, headers) is proposed and len(kept) == 2
    token = kept.put(ENTRY.name, payload, headers, proposed)
    kept.discard(token)
    assert len(kept) == 2
    small = ProposedSteps(max_entries=3, max_age_s=60.0, max_bytes=2 * len(payload))
    for _ in range(3):
        small.put(ENTRY.name, payload, headers, proposed)
    assert len(small) == 2
    aging = ProposedSteps(max_entries=3, max_age_s=0.0)
    aging.put(ENTRY.name, payload, headers, proposed)
    time.sleep(0.001)  # past its (zero) age
    assert aging.take(ENTRY.name, payload, headers) is None and len(aging) == 0
