"""A multi-table push on a replica (``ReplicatedWrites.update``): its parts are published without waiting
for one another's acks (pipelined), and the answer comes only once every part has settled (in memory: a
recording stand-in for the replica's log round trips, a real ``TableStore`` validating)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from torch import Tensor

from robez_core.config import OptimizerConfig, TableConfig
from robez_core.errors import BusyError
from service.config import TableSpec
from service.errors import UpdateTooLargeError
from service.log.entry import Proposed
from service.log.journal import NullJournal
from service.replication.records import update_too_large
from service.replication.replica import ReplicatedUpdate
from service.replication.writes import ReplicatedWrites
from service.shm import SharedDirectory
from service.store import TableStore, UpdatePart

from ..conftest import make_settings
from .conftest import ADAM, SMALL, push_grads

TABLES = ("a", "b", "c")
T = TypeVar("T")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TableStore]:
    settings = make_settings(tmp_path, default_table=False)
    directory = SharedDirectory.create(settings.shm_dir)
    made = TableStore(directory, settings, NullJournal())
    for name in TABLES:
        made.create(name, TableSpec(TableConfig(**SMALL), OptimizerConfig(**ADAM)))  # type: ignore[arg-type]
    yield made
    made.close()
    directory.remove()


class _Log:
    """Stands in for ``Replica.update`` (publish, quorum ack, wait for the apply): records how many
    parts were in flight at once; a part waits (at most ``hold_s``) until ``together`` parts are."""

    name = "replica"

    def __init__(
        self, together: int, hold_s: float, fail: str | None = None, too_large: str | None = None
    ) -> None:
        self.together = together
        self.hold_s = hold_s
        self.fail = fail
        self.too_large = too_large
        self.in_flight = 0
        self.most_in_flight = 0
        self.keys: list[str | None] = []
        self.settled: list[str] = []
        self._all_in = asyncio.Event()

    async def check_size(self, name: str, ids: Tensor, grads: Tensor, lr: float, key: str | None) -> None:
        if name == self.too_large:
            raise update_too_large(name, int(ids.numel()), int(grads.shape[1]), 2000, 1000, 200)

    async def update(
        self, name: str, ids: Tensor, grads: Tensor, lr: float, key: str | None, proposed: Proposed | None
    ) -> ReplicatedUpdate:
        assert proposed is not None  # the step validated once is handed on
        self.keys.append(key)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        if self.in_flight >= self.together:
            self._all_in.set()
        try:
            if name == self.fail:
                raise BusyError(f"no ack for {name!r}")
            if name == self.too_large:  # the log refuses it (what ``Replica.update`` checks too)
                raise update_too_large(name, int(ids.numel()), int(grads.shape[1]), 2000, 1000, 200)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._all_in.wait(), self.hold_s)
            return ReplicatedUpdate(TABLES.index(name) + 10, 0.001, 0.0005, duplicate=False)
        finally:
            self.in_flight -= 1
            self.settled.append(name)


async def _offload(function: Callable[[], T]) -> T:
    return function()


def _decode() -> list[UpdatePart]:
    return [UpdatePart(name, *push_grads(seed), None) for seed, name in enumerate(TABLES)]


def _update(store: TableStore, log: _Log, key: str | None) -> Any:
    writes = ReplicatedWrites(store, log)  # type: ignore[arg-type]
    return asyncio.run(writes.update(_decode, key, _offload, small=False))


def test_the_parts_of_a_multi_table_push_are_in_flight_together(store: TableStore) -> None:
    # Published one after another, each part would wait for the previous one's ack: one in flight.
    log = _Log(together=len(TABLES), hold_s=1.0)
    written = _update(store, log, "k1")
    assert log.most_in_flight == len(TABLES)
    assert sorted(log.keys) == sorted(f"k1/{name}" for name in TABLES)  # each part its own key
    assert [result.version for result in written.results] == [10, 11, 12]  # in the request's order
    # The parts overlap: a stage is the longest part's, not the sum.
    assert written.stages == {"publish": 0.001, "apply_wait": 0.0005}
    assert all(store.version(name) == 0 for name in TABLES)  # validation changed nothing


def test_a_failed_part_is_answered_only_once_every_part_has_settled(store: TableStore) -> None:
    log = _Log(together=len(TABLES), hold_s=0.2, fail="b")
    with pytest.raises(BusyError, match="no ack for 'b'"):
        _update(store, log, "k2")
    # The other parts were published too and had finished when the error was answered: nothing of the
    # request is still on its way to the log behind the client's back (its retry stores what is missing).
    assert sorted(log.settled) == sorted(TABLES)
    assert log.in_flight == 0


def test_a_part_over_the_log_limit_is_refused_before_any_part_is_published(store: TableStore) -> None:
    # The client answers a 413 by splitting the push under new keys ({key}.0, ...): a part stored under
    # the old key would then be stored, and applied, a second time.
    log = _Log(together=len(TABLES), hold_s=0.2, too_large="c")
    with pytest.raises(UpdateTooLargeError):
        _update(store, log, "k4")
    assert log.keys == []


def test_a_one_table_push_keeps_the_request_key(store: TableStore) -> None:
    log = _Log(together=1, hold_s=0.0)
    writes = ReplicatedWrites(store, log)  # type: ignore[arg-type]

    def decode() -> list[UpdatePart]:
        return [UpdatePart("a", *push_grads(3), None)]

    written = asyncio.run(writes.update(decode, "k3", _offload, small=True))
    assert log.keys == ["k3"]
    assert [result.version for result in written.results] == [10]
