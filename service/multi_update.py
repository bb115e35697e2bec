"""``update_many``: one training step's pushes to several tables, all-or-nothing (``POST /v1/update``).

Interim, until the store's own multi-table apply lands (issue 36's log seam): every part is checked
first (limits, lr, ids, gradients, the step leaving the values finite), then the parts are applied one
table after another through the store's one apply path, and the route answers once all are durable.
So bad input in any table changes nothing anywhere. What it does not give yet: each table's part is
its own log record, so a crash between two parts replays the first without the second (the push was
not acknowledged, so no acknowledged update is lost), and a concurrent push to the same table between
the check and the apply could make a later part's step refuse after earlier parts were applied.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from robez_core.errors import InvalidInputError, LimitExceededError

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
    lrs = []
    for item, (ids, grads) in zip(items, tensors, strict=True):
        try:
            lrs.append(store.validate_update(item.table, ids, grads, item.lr))
        except InvalidInputError as error:
            raise InvalidInputError(f"table {item.table!r}: {error}") from error
    results, last_ticket = [], 0
    for item, (ids, grads), lr in zip(items, tensors, lrs, strict=True):
        done = store.apply_update(item.table, ids, grads, lr)
        assert done is not None  # blocking
        result, ticket = done
        results.append(result)
        last_ticket = max(last_ticket, ticket)
    if last_ticket > 0:
        store.journal.wait_durable(last_ticket)
    return results


def _tensor(values: np.ndarray | Tensor) -> Tensor:
    return values if isinstance(values, Tensor) else torch.from_numpy(values)
