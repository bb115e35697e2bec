"""``update_many``: one training step's pushes to several tables, all-or-nothing (``POST /v1/update``).

Interim, until the store's own multi-table apply lands (issue 36's log seam): every part is checked
first (limits, lr, ids, gradients, the step leaving the values finite), then applied, so bad input in
any table changes nothing anywhere.

Tables that share one array (``share_array_with``: a whole model's tables in one ROBE-Z array, possible
only without a data directory) get **one** coalesced step of all their parts, in request order
(``robez_core.collection.prepare_shared_step``): the step a local ``RobezEmbeddingBagCollection`` makes,
so a remote collection trains the array bit for bit as the local one. Tables with their own array are
applied one after another through the store's one apply path. What it does not give yet: each table's
part is its own log record, so a crash between two parts replays the first without the second (the push
was not acknowledged, so no acknowledged update is lost).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from robez_core.collection import prepare_shared_step
from robez_core.errors import InvalidInputError, LimitExceededError
from robez_core.optim import PreparedStep

from .store import TableStore, UpdateResult


@dataclass(frozen=True)
class TableUpdateItem:
    """One table's part of a multi-table push: ids int64 (n,), grads float32 (n, d), lr (None: the
    table's)."""

    table: str
    ids: np.ndarray | Tensor
    grads: np.ndarray | Tensor
    lr: float | None = None


def update_many(store: TableStore, items: list[TableUpdateItem]) -> list[UpdateResult]:
    """Apply every part, or none (see the module's docstring for what a crash does); one result per
    part, in order. The request limits apply to the parts' sum, as for ``lookup_many``."""
    names = [item.table for item in items]
    if len(set(names)) != len(names):
        raise InvalidInputError("a table appears twice in one multi-table update; send it once")
    total_ids = total_values = 0
    for item in items:
        num_ids = int(item.ids.shape[0])
        total_ids += num_ids
        total_values += num_ids * store.table(item.table).config.embedding_dim  # NotFoundError first
    store.limits.check_request(total_ids, 0)
    if total_values > store.limits.max_values_per_request:
        raise LimitExceededError(
            f"{total_values} values in one request; the limit is "
            f"max_values_per_request={store.limits.max_values_per_request}"
        )
    tensors = [(_tensor(item.ids), _tensor(item.grads)) for item in items]
    groups: dict[str, list[int]] = {}  # array -> the parts over it, in request order
    for index, name in enumerate(names):
        groups.setdefault(store.info(name).array, []).append(index)
    # Every check before anything changes: a shared group's one step is prepared (hashed, coalesced,
    # its inputs checked) here, outside the lock, as the store does for one table.
    prepared: dict[int, PreparedStep] = {}
    for group in groups.values():
        for index in group if len(group) == 1 else ():
            try:
                store.validate_update(names[index], *tensors[index], items[index].lr)
            except InvalidInputError as error:
                raise InvalidInputError(f"table {names[index]!r}: {error}") from error
        if len(group) > 1:
            prepared[group[0]] = _prepare_shared(store, group, names, items, tensors)
    results: list[UpdateResult | None] = [None] * len(items)
    last_ticket = 0
    for group in groups.values():
        if len(group) > 1:
            shared = _apply_shared(store, group, names, prepared[group[0]])
            for index, result in zip(group, shared, strict=True):
                results[index] = result
            continue
        (index,) = group
        done = store.apply_update(names[index], *tensors[index], items[index].lr)
        assert done is not None  # blocking
        results[index], ticket = done
        last_ticket = max(last_ticket, ticket)
    if last_ticket > 0:
        store.journal.wait_durable(last_ticket)
    return [result for result in results if result is not None]


def _prepare_shared(
    store: TableStore,
    group: list[int],
    names: list[str],
    items: list[TableUpdateItem],
    tensors: list[tuple[Tensor, Tensor]],
) -> PreparedStep:
    """The one coalesced step of the parts ``group`` over one array (``prepare_shared_step``: ids and
    gradients checked, hashed, coalesced in request order); the parts must resolve to one lr."""
    tables = [store.table(names[i]) for i in group]
    lrs = set()
    for i, table in zip(group, tables, strict=True):
        lr = items[i].lr
        lrs.add(table.optimizer.lr if lr is None else float(lr))
    if len(lrs) > 1:
        raise InvalidInputError(
            f"tables {[names[i] for i in group]} share one array: their parts need one lr"
        )
    for i, table in zip(group, tables, strict=True):
        store.limits.check_request(int(tensors[i][0].shape[0]), table.config.embedding_dim)
    try:
        return prepare_shared_step(
            tables, [tensors[i][0] for i in group], [tensors[i][1] for i in group], lrs.pop()
        )
    except InvalidInputError as error:
        raise InvalidInputError(f"tables {[names[i] for i in group]}: {error}") from error


def _apply_shared(
    store: TableStore, group: list[int], names: list[str], step: PreparedStep
) -> list[UpdateResult]:
    """Apply the prepared step of the parts ``group`` (tables over one array, which share one update
    lock), checked under the lock; each table's version moves by one. Only without a journal: the store
    refuses shared arrays with one, so no log ever replays this step."""
    with store.registry.locked(names[group[0]]) as held:
        entries = [held] + [store.registry.entry(names[i]) for i in group[1:]]
        if any(entry.lock is not held.lock for entry in entries):
            raise InvalidInputError(f"tables {[names[i] for i in group]} do not share one update lock")
        start = time.perf_counter()
        held.table.check_step(step)
        versions = [entry.version + 1 for entry in entries]
        for entry, version in zip(entries, versions, strict=True):
            entry.set_pending(version)
        held.table.apply_step(step)
        for entry, version in zip(entries, versions, strict=True):
            entry.set_version(version)
            entry.set_pending(0)
        seconds = (time.perf_counter() - start) / len(group)
    return [UpdateResult(version, 0.0, seconds) for version in versions]


def _tensor(values: np.ndarray | Tensor) -> Tensor:
    return values if isinstance(values, Tensor) else torch.from_numpy(values)
