"""What goes through the log, and the one deterministic step that applies it to a table.

A push is one **entry** of one or more **parts** (``UpdatePart``: one table's ids, gradients and lr).
Once validated and given versions, each part is an ``UpdateRecord``; the parts of a multi-table entry
carry the same ``EntryGroup`` (a random key and every part's (table, version)), so a log that keeps one
record per table can tell an entry whose parts were not all written (``service/wal/``: a kill -9 in the
middle of a multi-table push) and drop it whole.

``apply_record`` is the one place an update reaches a table's array: live pushes
(``TableStore.propose``), records replayed from the write-ahead log (``WalJournal``), entries of the
replicated log (``TableStore.apply``) and a replica's private rebuild all come here. It reads no registry
and bumps no version: the caller (the store, under the table's lock, or a replay into a table not yet
served) moves the version. Logs import this module, never the store (``service/store/``).
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from contextlib import suppress
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from robez_core.errors import InvalidInputError
from robez_core.optim import PreparedStep
from robez_core.table import Table

from ..errors import RefusedUpdateError
from .granules import GranuleMarks

logger = logging.getLogger("robez.store")


class UpdatePart(NamedTuple):
    """One table's share of a push, as a caller hands it to ``TableStore.update_many`` (a named tuple:
    made for every push on the hot path, where a dataclass costs a microsecond more).

    Attributes:
        table: table name.
        ids: int64 (N,) ids (duplicates allowed: summed); a tensor or a numpy array.
        grads: float32 (N, d) gradients of their rows; a tensor or a numpy array.
        lr: the learning rate, None for the table's own.
    """

    table: str
    ids: Tensor | np.ndarray
    grads: Tensor | np.ndarray
    lr: float | None = None


@dataclass(frozen=True)
class EntryGroup:
    """The parts of one multi-table entry, named in each of its records.

    Attributes:
        key: 16 random bytes, the same in every part's record (tells this entry from another that
            happens to produce the same versions, e.g. after a cut log was appended to again).
        parts: (table, version) of every part, in the order they were written.
    """

    key: bytes
    parts: tuple[tuple[str, int], ...]

    @classmethod
    def new(cls, parts: list[tuple[str, int]]) -> EntryGroup:
        return cls(secrets.token_bytes(16), tuple(parts))


@dataclass(frozen=True)
class UpdateRecord:
    """One gradient push to one table, as it is logged before it is applied.

    Attributes:
        table: table name.
        version: the table version this update produces (previous version + 1).
        ids: int64 (N,) ids, as sent (duplicates not yet summed).
        grads: float32 (N, d) gradients of the looked-up rows.
        lr: the learning rate actually applied (the request's override or the table's lr).
        group: the multi-table entry this record is a part of (None: a single-table push).
    """

    table: str
    version: int
    ids: Tensor
    grads: Tensor
    lr: float
    group: EntryGroup | None = None


class Proposed(NamedTuple):
    """A push's step as the process that proposed it prepared it (``prepare``: hashed and coalesced,
    its inputs checked) on ``table``, kept so that applying that very entry here does not prepare it
    again (``apply_logged_record``). Whoever keeps it matches it to the entry's exact bytes.

    Attributes:
        table: the table object it was prepared on (a step applies only to that one: same config).
        step: the coalesced step.
    """

    table: Table
    step: PreparedStep


@dataclass(frozen=True)
class SkippedRecord:
    """A logged entry that fails a check: applied as an empty version (the table's version moves to
    ``version``, its arrays stay as they were), alike wherever the log is applied.

    Attributes:
        table: table name.
        version: the version (log position) the entry would have produced.
        reason: the check it failed, one of ``service.errors.SKIP_REASONS``.
        detail: that check's message.
    """

    table: str
    version: int
    reason: str
    detail: str


def apply_record(
    table: Table,
    ids: Tensor | np.ndarray,
    grads: Tensor | np.ndarray,
    lr: float,
    *,
    step: PreparedStep | None = None,
    logged_as: tuple[str, int] | None = None,
    checked_when_logged: bool = False,
    check_in_step: bool = False,
    marks: GranuleMarks | None = None,
) -> tuple[float, float] | SkippedRecord:
    """Apply one update to ``table`` (see the module's docstring); the caller holds the table's update
    lock (or owns a table nobody serves) and moves its version.

    Args:
        table: the table to change.
        ids: int64 (N,) ids, as sent (duplicates not yet summed); a tensor or a numpy array.
        grads: float32 (N, d) gradients of their rows; a tensor or a numpy array.
        lr: the learning rate to apply, resolved (the request's or the table's).
        step: ``table.prepare_step`` of this very update. Without ``logged_as``: already checked
            (``check_step``) under the lock, only applied (the live path with a journal checks before it
            appends, so a refused update never reaches the log). With: prepared when this process
            proposed the entry (``Proposed``), so it is not hashed nor coalesced again; the lr and
            ``check_step`` (it reads the array, at this version) are still checked.
        logged_as: (table name, version) of the log record this update is. Every check is then made
            here (the lr too) and an update that fails one (``RefusedUpdateError``: bad lr, ids or
            gradients, or a step that would leave a non-finite value) is skipped with one warning and a
            ``SkippedRecord`` returned: the log holds it, so every replica and every replay skips it
            alike, and the version still advances. Without (a live push, not logged yet, its lr checked
            by the caller) it is refused with the error.
        checked_when_logged: the record is from this server's own write-ahead log, whose records all
            passed ``check_step`` before they were appended: the replay applies the same step to the
            same bytes, so the check (a third of a replay's time) is not made again. The inputs' own
            checks still are.
        check_in_step: with ``step`` and without ``logged_as``: ``step`` was not checked; it is checked
            in the same pass that applies it (``Table.apply_checked_step``: the same bits, one read of
            each touched location instead of two) and refused (``RefusedUpdateError``) with nothing
            changed. For a push of one step that no log holds (the store without a data directory).
            Every other path that checks (a logged entry, a push prepared here) checks in the pass that
            applies too; a reader without the update lock may then see, for a moment, finite values of
            a step that ends refused or skipped (docs/api.md).
        marks: the record of the granules changed while copies of the table's array run
            (``granules.py``; the served tables', None for a private one): while a copy runs, the
            granules the update's positions cover are marked in it, before they change (a streamed
            download's saved first); one shared read otherwise.

    Returns (seconds hashing, seconds coalescing, checking and stepping), or the ``SkippedRecord``.
    """
    copying = marks is not None and marks.active()
    if step is not None and logged_as is None:
        start = time.perf_counter()
        if copying:
            _mark(marks, step, table)
        if not check_in_step:
            table.apply_step(step)
            return 0.0, time.perf_counter() - start
        try:
            table.apply_checked_step(step)
        except InvalidInputError as error:
            raise RefusedUpdateError(str(error), "non_finite_step") from error
        return 0.0, time.perf_counter() - start
    start = time.perf_counter()
    hash_seconds = 0.0
    try:
        if logged_as is not None:
            check_lr(table, lr)
        if step is None:
            # A small batch is hashed, checked and applied in two compiled calls; None: the general path.
            if copying:  # hashed inside the compiled call: hashed before it too, only while a copy runs
                assert marks is not None  # (before: a stream saves what the update is about to change)
                with suppress(InvalidInputError):  # refused below, as a whole, by the call itself
                    offsets = table.hash(as_tensor(ids)).numpy().reshape(-1)
                    marks.mark_chunks(offsets, table.config.chunk_size, table)
            timings = table.try_checked_update(ids, grads, lr)
            if timings is not None:
                return timings
            start = time.perf_counter()
            step, hash_seconds = prepare(table, as_tensor(ids), as_tensor(grads), lr)
        if copying:  # a refused step leaves its marks: a granule copied again for nothing
            _mark(marks, step, table)
        if checked_when_logged:
            table.apply_step(step)
        else:
            # Checked in the pass that applies it (one read of each touched location, the same bits as
            # ``check_step`` then ``apply_step``); refused with every value as it was.
            try:
                table.apply_checked_step(step)
            except InvalidInputError as error:
                raise RefusedUpdateError(str(error), "non_finite_step") from error
    except RefusedUpdateError as error:
        if logged_as is None:
            raise
        return skipped(SkippedRecord(*logged_as, error.reason, str(error)))
    return hash_seconds, time.perf_counter() - start


def _mark(marks: GranuleMarks | None, step: PreparedStep, table: Table) -> None:
    """The granules of the positions ``step`` is about to change marked in ``marks`` (a copy runs)."""
    assert marks is not None
    marks.mark_positions(step.locations.numpy(), table)


def apply_logged_record(
    table: Table,
    record: UpdateRecord | SkippedRecord,
    proposed: Proposed | None = None,
    marks: GranuleMarks | None = None,
) -> tuple[float, float] | SkippedRecord:
    """One entry of a log applied to ``table`` (served, under its lock, or a private rebuild):
    ``apply_record`` with every check, or nothing for an entry that could not even be decoded.
    ``proposed``: the step this process prepared from the entry's very bytes when it proposed it, used
    (not hashed nor coalesced again) if it was prepared on this table with this lr; the checks that
    read the array are made all the same, so the outcome is the same bits either way. ``marks``: see
    ``apply_record``."""
    if isinstance(record, SkippedRecord):
        return skipped(record)
    step = None
    if proposed is not None and proposed.table is table and proposed.step.lr == record.lr:
        step = proposed.step
    return apply_record(
        table,
        record.ids,
        record.grads,
        record.lr,
        step=step,
        logged_as=(record.table, record.version),
        marks=marks,
    )


def skipped(record: SkippedRecord) -> SkippedRecord:
    """Log the one warning a skipped entry gets wherever it is applied; returns it."""
    logger.warning(
        "table %r: log entry %d applied as an empty version (%s): %s",
        record.table,
        record.version,
        record.reason,
        record.detail,
    )
    return record


def check_lr(table: Table, lr: float) -> None:
    """The lr of an update, resolved: positive, finite and at most the table's ``max_lr``."""
    if not (isinstance(lr, float | int) and lr > 0 and math.isfinite(lr)):
        raise RefusedUpdateError(f"lr must be a positive finite number, got {lr}", "bad_lr")
    if lr > table.optimizer.max_lr:
        raise RefusedUpdateError(
            f"lr {lr:g} is over this table's max_lr={table.optimizer.max_lr:g} (its optimizer config)",
            "bad_lr",
        )


def prepare(table: Table, ids: Tensor, grads: Tensor, lr: float) -> tuple[PreparedStep, float]:
    """``hash`` (it checks the ids) and ``prepare_step`` (the gradients: finite, one row of d per id; lr
    <= the table's max_lr) of an update: the checks that read only the table's config, so they need no
    lock. Returns the coalesced step and the seconds hashing took. ``RefusedUpdateError`` names the
    check that failed."""
    start = time.perf_counter()
    try:
        chunk_offsets = table.hash(ids)
    except InvalidInputError as error:
        raise RefusedUpdateError(str(error), "bad_ids") from error
    hash_seconds = time.perf_counter() - start
    try:
        step = table.prepare_step(chunk_offsets, grads, lr, offsets_from_hash=True)
    except InvalidInputError as error:
        raise RefusedUpdateError(str(error), "bad_grads") from error
    return step, hash_seconds


def check_step(table: Table, step: PreparedStep) -> None:
    """``table.check_step`` (under the update lock): the step leaves every value it touches finite."""
    try:
        table.check_step(step)
    except InvalidInputError as error:
        raise RefusedUpdateError(str(error), "non_finite_step") from error


def as_tensor(values: Tensor | np.ndarray) -> Tensor:
    """``values`` as a tensor (a numpy array is wrapped, not copied)."""
    return torch.from_numpy(values) if isinstance(values, np.ndarray) else values
