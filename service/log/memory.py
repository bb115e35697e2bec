"""``MemoryLog``: a ``Journal`` kept in memory, so the store's logic (propose, apply, replay, repair,
multi-table entries) is tested without files or NATS.

It keeps, per table, a snapshot (a private copy of the table at a version) and the records appended
after it, in order; ``load_into`` replays them through ``entry.apply_record`` as the write-ahead log does.
Nothing is durable: a process that ends takes it along. A test may share one instance between stores
(``TableStore.fill`` from it: a restart).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import numpy as np

from robez_core.config import OptimizerConfig, TableConfig
from robez_core.errors import CorruptionError
from robez_core.table import Table

from .entry import UpdateRecord, apply_record
from .journal import LogMark, snapshot_under_lock


@dataclass
class _Kept:
    """One table: its snapshot (a private copy) at ``version``, and the records after it."""

    snapshot: Table
    version: int
    records: list[UpdateRecord] = field(default_factory=list)


def _copy(table: Table) -> Table:
    copy = Table(table.config, table.optimizer)
    targets = copy.tensors()
    for key, tensor in table.tensors().items():
        targets[key].copy_(tensor.reshape(targets[key].shape))
    return copy


class MemoryLog:
    """A ``Journal`` in memory (see the module's docstring); every method is thread-safe.

    Args:
        fail_append_after: testing only: the append after this many succeeds raises ``OSError`` (a full
            disk); None never.
    """

    def __init__(self, fail_append_after: int | None = None) -> None:
        self._tables: dict[str, _Kept] = {}
        self._lock = threading.Lock()
        self.fail_append_after = fail_append_after
        self.appended = 0

    def records(self, name: str) -> list[UpdateRecord]:
        """The records of ``name`` after its snapshot, in order (a copy of the list)."""
        with self._lock:
            return list(self._tables[name].records)

    def load(self, name: str) -> tuple[Table, int] | None:
        with self._lock:
            kept = self._tables.get(name)
            if kept is None:
                return None
            table = _copy(kept.snapshot)
            records = list(kept.records)
            version = kept.version
        for record in records:
            apply_record(table, record.ids, record.grads, record.lr, logged_as=(name, record.version))
            version = record.version
        return table, version

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._tables)

    def load_into(self, name: str, table: Table) -> int | None:
        loaded = self.load(name)
        if loaded is None:
            return None
        targets = table.tensors()
        for key, tensor in loaded[0].tensors().items():
            targets[key].copy_(tensor.reshape(targets[key].shape))
        return loaded[1]

    def stored_spec(self, name: str) -> tuple[TableConfig, OptimizerConfig] | None:
        with self._lock:
            kept = self._tables.get(name)
            return None if kept is None else (kept.snapshot.config, kept.snapshot.optimizer)

    def create(self, name: str, table: Table, version: int) -> None:
        copy = _copy(table)
        with self._lock:
            self._tables[name] = _Kept(copy, version)

    def append(self, record: UpdateRecord) -> int:
        with self._lock:
            if self.fail_append_after is not None and self.appended >= self.fail_append_after:
                raise OSError(28, "no space left (MemoryLog.fail_append_after)")
            kept = self._tables[record.table]
            last = kept.records[-1].version if kept.records else kept.version
            if record.version != last + 1:
                raise CorruptionError(
                    f"table {record.table!r}: record of version {record.version} after {last}"
                )
            kept.records.append(record)
            self.appended += 1
        return 0

    def wait_durable(self, ticket: int) -> None:
        pass

    def snapshot(self, name: str, table: Table, version: int) -> None:
        copy = _copy(table)
        with self._lock:
            self._tables[name] = _Kept(copy, version)

    def snapshot_live(
        self,
        name: str,
        exclusive: Callable[[], AbstractContextManager[tuple[Table, int]]],
        due: Callable[[str, int], bool] | None = None,
    ) -> int | None:
        return snapshot_under_lock(self, name, exclusive, due)

    def log_mark(self, name: str, version: int, since: LogMark | None = None) -> LogMark | None:
        return None  # copies are made whole under the lock

    def updated_ids(self, name: str, since: LogMark, until: LogMark) -> list[np.ndarray] | None:
        return None

    def recover(self, name: str, version: int) -> Table | None:
        with self._lock:
            kept = self._tables[name]
            if version < kept.version:
                raise CorruptionError(f"table {name!r}: cannot recover {version}, snapshot at {kept.version}")
            kept.records = [record for record in kept.records if record.version <= version]
            reached = kept.records[-1].version if kept.records else kept.version
            if reached != version:
                raise CorruptionError(f"table {name!r}: holds versions up to {reached}, not {version}")
        loaded = self.load(name)
        assert loaded is not None
        return loaded[0]

    def drop(self, name: str) -> None:
        with self._lock:
            self._tables.pop(name, None)

    def write_problem(self) -> str | None:
        return None

    def close(self) -> None:
        pass
