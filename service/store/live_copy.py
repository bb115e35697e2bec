"""A copy of a table's whole state at one version, taken while its updates go on (pre-copy + patch).

A snapshot (``WalJournal.snapshot_live``) and a checksum (``TableStore.checksum``) both need the state
exactly as it was at one version. Copying it under the table's update lock stalls every push for the
length of the copy (seconds for gigabytes). Every optimizer here is sparse: an update changes only the
positions its ids' chunks cover (``table.hash(ids)``: offsets ``o``, each covering ``[o, o + Z)`` of the
weight and of every state tensor of the weight's length), plus the small tensors (adam's ``step``); and
every update is logged, with its version, before it is applied. So ``consistent_copy``:

1. under the lock: notes the version V0 and where the log stands (``Journal.updated_ids``);
2. without the lock: copies every tensor from the live shared array into the target (torn reads are
   fine: every position an update changed after V0 is copied again below);
3. while many updates came in (up to ``_ROUNDS`` times): notes V_k under the lock, then, without it,
   copies again the granules the updates V_{k-1}+1..V_k touched;
4. under the lock at V1: copies the granules of the updates since the last note, and the small tensors
   whole. The target is then bitwise the state at V1; the lock was held for the rows changed during the
   last round, not for the table.

Where the journal cannot say which ids changed (no data directory: ``NullJournal``; the log replaced by
another worker's snapshot or a load, or an unfinished update cut off it by a repair), the copy is made
under the lock, as a whole. A test can make the lock-free copy slow (``faults.slow_down`` after each
piece) without a big table.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import TypeVar

import numpy as np
import torch

from robez_core.errors import ConflictError, InvalidInputError
from robez_core.table import Table

from .. import faults
from .journal import Journal, LogMark

logger = logging.getLogger("robez.store")

T = TypeVar("T")

# Positions are patched in granules of this many values (256 bytes of float32).
GRANULE = 64
# The lock-free copy goes in pieces of this many bytes (a test's pause after each: faults.slow_down).
_PIECE_BYTES = 1 << 24
# At most this many lock-free patch rounds; one more is taken only while the last one patched more than
# _SMALL_PATCH granules (the rest are patched under the lock).
_ROUNDS = 2
_SMALL_PATCH = 4096


def consistent_copy(
    name: str,
    journal: Journal,
    exclusive: Callable[[], AbstractContextManager[tuple[Table, int]]],
    targets: Mapping[str, np.ndarray],
    finish: Callable[[Table, int, LogMark | None], T],
) -> T:
    """Fill ``targets`` (name -> a contiguous numpy array of each of ``Table.tensors()``' shape and
    dtype: private memory, or a mapping of a snapshot file) with the table's state at one version V;
    ``finish(table, V, mark)`` is called under the update lock at V, the copy complete (``mark``: the
    journal's note of its log at V, None where the copy was made whole under the lock), and its result
    returned. The lock is held for the rows changed since the last lock-free round (see the module
    docstring); the longest hold is logged (info). Raises ``ConflictError`` if the table was replaced by
    one of another layout meanwhile."""
    holds: list[float] = []

    @contextmanager
    def locked() -> Iterator[tuple[Table, int]]:
        with exclusive() as held:
            start = time.perf_counter()
            try:
                yield held
            finally:
                holds.append(time.perf_counter() - start)

    started = time.perf_counter()
    result, version, how = _copy(name, journal, locked, targets, finish)
    logger.info(
        "table %r: state copied at version %d in %.2f s (%s); the update lock held at most %.1f ms",
        name,
        version,
        time.perf_counter() - started,
        how,
        1000 * max(holds),
    )
    return result


def _copy(
    name: str,
    journal: Journal,
    exclusive: Callable[[], AbstractContextManager[tuple[Table, int]]],
    targets: Mapping[str, np.ndarray],
    finish: Callable[[Table, int, LogMark | None], T],
) -> tuple[T, int, str]:
    """``consistent_copy``: (finish's result, the version copied, how it was copied)."""
    with exclusive() as (table, version):
        noted = journal.updated_ids(name, version)
        if noted is None:
            _copy_whole(table, targets, slow=False)
            return finish(table, version, None), version, "whole, under the lock: no log"
        mark = noted[0]
        source = _arrays(table, targets)
    _copy_whole(table, targets, slow=True)
    for round_ in range(_ROUNDS + 1):
        with exclusive() as (now, version):
            changed = None if _arrays(now, targets) != source else journal.updated_ids(name, version, mark)
            if changed is None:
                # Replaced, or the log cannot say what changed: the whole copy, under the lock.
                _copy_whole(now, targets, slow=False)
                how = "whole, under the lock: the log could not say what changed during the copy"
                return finish(now, version, None), version, how
            updates = version - mark.version
            mark, ids = changed
            marks = _touched(now, ids)
            patched = int(np.count_nonzero(marks))
            if round_ == _ROUNDS or patched <= _SMALL_PATCH:
                _patch(now, targets, marks)
                how = (
                    f"lock-free, {round_} lock-free patch round(s), then {patched} granules of "
                    f"{updates} update(s) under the lock"
                )
                return finish(now, version, mark), version, how
        _patch(table, targets, marks)  # lock-free: what changes meanwhile is in the next round's ids
    raise AssertionError("unreachable")  # pragma: no cover


def _arrays(table: Table, targets: Mapping[str, np.ndarray]) -> dict[str, int]:
    """The table's tensors by address, checked against ``targets``' layout."""
    tensors = table.tensors()
    for key, tensor in tensors.items():
        target = targets.get(key)
        if target is None or target.shape != tuple(tensor.shape) or target.dtype != _dtype(tensor):
            raise ConflictError(f"table of another layout than its copy ({key!r}): replaced meanwhile?")
    return {key: tensor.data_ptr() for key, tensor in tensors.items()}


def _dtype(tensor: torch.Tensor) -> np.dtype:
    return torch.empty(0, dtype=tensor.dtype).numpy().dtype


def _copy_whole(table: Table, targets: Mapping[str, np.ndarray], *, slow: bool) -> None:
    """Every tensor copied into its target, in pieces (``slow``: pausing after each when a test asks)."""
    for key, tensor in table.tensors().items():
        source = tensor.detach().reshape(-1).numpy()
        target = targets[key].reshape(-1)
        step = max(1, _PIECE_BYTES // source.itemsize)
        for start in range(0, source.size, step):
            np.copyto(target[start : start + step], source[start : start + step])
            if slow:
                faults.slow_down()


def _touched(table: Table, ids: list[np.ndarray]) -> np.ndarray:
    """A byte per granule of the table's (m,) tensors: 1 where one of the updates of ``ids`` changed a
    position (each chunk offset ``o`` covers ``[o, o + Z)``)."""
    config = table.config
    m, z = config.memory_size, config.chunk_size
    marks = np.zeros(-(-m // GRANULE), dtype=np.uint8)
    spread = (z - 1) // GRANULE + 2  # granules one chunk can touch, at most
    for update_ids in ids:
        if update_ids.size == 0:
            continue
        try:
            offsets = table.hash(torch.from_numpy(np.ascontiguousarray(update_ids, dtype=np.int64)))
        except InvalidInputError:
            continue  # an update refused as a whole changed nothing
        first = offsets.numpy().reshape(-1) // GRANULE
        last = (offsets.numpy().reshape(-1) + (z - 1)) // GRANULE
        for step in range(spread):
            marks[np.minimum(first + step, last)] = 1
    return marks


def _patch(table: Table, targets: Mapping[str, np.ndarray], marks: np.ndarray) -> None:
    """Copy the marked granules of each (m,) tensor from the table into its target, and every other
    tensor (adam's step) whole."""
    m = table.config.memory_size
    whole = m // GRANULE
    picked = np.flatnonzero(marks[:whole])
    for key, tensor in table.tensors().items():
        source = tensor.detach().reshape(-1).numpy()
        target = targets[key].reshape(-1)
        if source.size != m:
            np.copyto(target, source)
            continue
        if picked.size:
            target[: whole * GRANULE].reshape(whole, GRANULE)[picked] = source[: whole * GRANULE].reshape(
                whole, GRANULE
            )[picked]
        if whole * GRANULE < m and marks[whole:].any():
            np.copyto(target[whole * GRANULE :], source[whole * GRANULE :])
