"""A copy of a table's whole state at one version, taken while its updates go on (pre-copy + patch).

A snapshot (``WalJournal.snapshot_live``) and a checksum (``TableStore.checksum``) both need the state
exactly as it was at one version. Copying it under the table's update lock stalls every push for the
length of the copy (seconds for gigabytes). Every optimizer here is sparse: an update changes only the
positions its ids' chunks cover (``table.hash(ids)``: offsets ``o``, each covering ``[o, o + Z)`` of the
weight and of every state tensor of the weight's length), plus the small tensors (adam's ``step``); and
every update is logged, with its version, before it is applied. So ``consistent_copy``:

1. under the lock: notes the version V0 and where the log ends (``Journal.log_mark``: no record read);
2. without the lock: copies every tensor from the live shared array into the target (torn reads are
   fine: every position an update changed after V0 is copied again below);
3. while many updates came in (up to ``_ROUNDS`` times): notes V_k and the log's end under the lock,
   then, without it, reads the ids of the updates V_{k-1}+1..V_k from the log (``Journal.updated_ids``),
   hashes them and copies again the granules they touched;
4. under the lock at V1 (once the last round saw at most ``_FEW_UPDATES`` updates): reads the ids of the
   updates since the last note, and the granules they touched and the small tensors whole into private
   memory; after the lock, writes them into the target (a write into a snapshot file's page may wait
   for that page's writeback to the disk: never under the lock). The target is then bitwise the state
   at V1; the lock was held to read the few updates logged during the last round and their rows, never
   for work that grows with the updates made during the copy.

What the copy is written into is a ``CopyTarget``: arrays (``ArrayTarget``: private memory, or the
mapping of a snapshot file), or a checksum's granule digests (``state_digest.StateDigest``: no copy of
the state at all; docs/durability.md "Checksum").

Where no log says which ids changed (no data directory: ``NullJournal``; a replica, whose log is the
replicated one), the rounds are the same with the granules taken from the array's record of changed
granules instead (``granules.py``, the ``granules`` argument; ``_copy_marked``): under the lock at the
start a bit of it is taken and its marks cleared, and from then on every update marks in it the granules
it changes (``entry.apply_record``); each round takes (copies and clears) those marks under the lock and
copies their granules again without it; the last round's (at most ``_FEW_GRANULES``, or after the
fifth) are read under the lock; the bit is freed at the end. Where neither can say (no record given,
``granules.SLOTS`` copies of the array running already, the log replaced by another worker's snapshot
or a load, or an unfinished update cut off it by a repair), the copy is made under the lock, as a whole.
A test can make the lock-free copy slow (``Faults.slow_down`` after each piece, the ``faults`` argument)
without a big table.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, suppress
from typing import Protocol, TypeVar

import numpy as np
import torch

from robez_core.checkpoint import CheckpointWriter, pwrite_fully
from robez_core.errors import ConflictError, InvalidInputError, RobezError
from robez_core.table import Table

from ..faults import NO_FAULTS, Faults
from .granules import GRANULE, SLOTS, GranuleMarks, granule_count, mark_chunks
from .journal import Journal, LogMark

logger = logging.getLogger("robez.store")

T = TypeVar("T")

# The lock-free copy goes in pieces of this many bytes (a test's pause after each: Faults.slow_down).
PIECE_BYTES = 1 << 24
# At most this many lock-free patch rounds; the last, locked round comes earlier once a round ends with at
# most _FEW_UPDATES updates logged since the one before (their ids are read and hashed, and their granules
# gathered, under the lock). At 2**28 under a pusher at full speed five rounds left the rows of 3-5
# updates to the locked one (two left ~110: 0.3-0.5 s of lock).
_ROUNDS = 5
_FEW_UPDATES = 8
# Without a log (the changed granules taken from the array's record, granules.py), the last round comes
# once a round ends with at most this many granules changed (2 MiB of float32 per (m,) tensor).
_FEW_GRANULES = 1 << 13
# The ids of the updates a round patches are hashed this many at a time (the offsets and marks' temporaries:
# a few bytes per id each, bounded whatever the updates made during the copy).
_HASH_BATCH_IDS = 1 << 16
# A lock-free patch of a checkpoint file (``FileTarget``) writes again every block of this many granules
# holding a marked one (64 KiB of float32)...
_BLOCK_GRANULES = 256
# ... unless the granules of its rounds so far come to at most this many, and a quarter of the table's:
# then they are read into private memory (at most 0.25 x the state, 48 MiB at 2^26 adam) and written to the
# file after the lock, before the last round's.
_STAGED_GRANULES = 1 << 16


Gathered = list[tuple[str, np.ndarray | None, np.ndarray, np.ndarray | None]]


class CopyTarget(Protocol):
    """What ``consistent_copy`` writes the state into."""

    def layout(self) -> Mapping[str, tuple[tuple[int, ...], np.dtype]]:
        """Each tensor's (shape, dtype) the target was made for (checked against the table's)."""
        ...

    def fill(self, table: Table, *, pause: Callable[[], None] | None) -> None:
        """Take every tensor of ``table`` whole: without the lock (``pause`` after each piece of
        ``PIECE_BYTES``: the test hook) or, ``pause`` None, under it (the log could not say what changed)."""
        ...

    def patch(self, table: Table, marks: np.ndarray) -> None:
        """Take again, without the lock, the granules ``marks`` (``touched``) names and the small tensors
        (a target may keep them in memory until ``write``, which is always called last)."""
        ...

    def write(self, gathered: Gathered) -> None:
        """Take what ``gather`` read under the lock (the last round's granules and the small tensors)."""
        ...


class ArrayTarget:
    """A ``CopyTarget`` of arrays: name -> a contiguous numpy array of each of ``Table.tensors()``' shape
    and dtype (private memory, or a mapping of a snapshot file)."""

    def __init__(self, arrays: Mapping[str, np.ndarray]) -> None:
        self.arrays = arrays

    def layout(self) -> Mapping[str, tuple[tuple[int, ...], np.dtype]]:
        return {key: (array.shape, array.dtype) for key, array in self.arrays.items()}

    def fill(self, table: Table, *, pause: Callable[[], None] | None) -> None:
        _copy_whole(table, self.arrays, pause=pause)

    def patch(self, table: Table, marks: np.ndarray) -> None:
        self.write(gather(table, marks))

    def write(self, gathered: Gathered) -> None:
        _scatter(self.arrays, gathered)


class FileTarget:
    """A ``CopyTarget`` of a checkpoint file (``CheckpointWriter.begin``: header written, space
    allocated), written with ``pwrite`` from the live table, never mapped: the file's pages are never in
    this process's memory figures (main wrote it so, under the lock). The fill writes each tensor in
    pieces; a lock-free patch writes again every block of ``_BLOCK_GRANULES`` granules holding a marked
    one (adjacent blocks in one call: a round costs at most a fill, whatever the marks; one call per
    granule did not converge at 2^26 under a pusher). But such a round costs about a whole rewrite of the
    file (0.2 s at 768 MiB) even for 15k granules, so under a pusher the rounds mostly never shrank and
    the last read up to 41k granules under the lock (99 ms; docs/benchmarks/replica-copies-2026-11-28.md):
    rounds whose granules come to at most ``_STAGED_GRANULES`` (and a quarter of the table's) are read
    into private memory instead, and written after the lock, before the last round's granules (gathered
    under the lock), each in runs of adjacent ones; a round that would keep more is written in blocks
    with the kept granules, from the live table (writing back the kept values one run at a time cost
    1.1-1.4 s for 60k granules)."""

    def __init__(self, fd: int, writer: CheckpointWriter, tensors: Mapping[str, torch.Tensor]) -> None:
        self._fd = fd
        self._starts = {key: start for key, (start, _nbytes) in writer.spans().items()}
        self._layout = {key: (tuple(tensor.shape), _dtype(tensor)) for key, tensor in tensors.items()}
        self._staged: list[Gathered] = []  # rounds read into memory, not yet written (oldest first)
        self._staged_marks: np.ndarray | None = None  # their granules, a byte each

    def layout(self) -> Mapping[str, tuple[tuple[int, ...], np.dtype]]:
        return self._layout

    def fill(self, table: Table, *, pause: Callable[[], None] | None) -> None:
        for key, tensor in table.tensors().items():
            source = tensor.detach().reshape(-1).numpy().view(np.uint8)
            for start in range(0, source.size, PIECE_BYTES):
                _pwrite(self._fd, source[start : start + PIECE_BYTES], self._starts[key] + start)
                if pause is not None:
                    pause()

    def patch(self, table: Table, marks: np.ndarray) -> None:
        m = table.config.memory_size
        staged = marks if self._staged_marks is None else self._staged_marks | marks
        if int(np.count_nonzero(staged)) <= min(_STAGED_GRANULES, granule_count(m) // 4):
            # Few: read into memory at memory speed, so the round ends at once and the next takes few.
            self._staged.append(gather(table, marks))
            self._staged_marks = staged
            return
        # Too many to keep: the kept granules are written with this round's, from the live table (their
        # values there are the same or newer; a newer one is in a later round's marks), in blocks.
        marks = staged
        self._staged, self._staged_marks = [], None
        padded = np.zeros(-(-marks.size // _BLOCK_GRANULES) * _BLOCK_GRANULES, dtype=bool)
        padded[: marks.size] = marks.astype(bool)
        dirty = np.flatnonzero(padded.reshape(-1, _BLOCK_GRANULES).any(axis=1))
        block = _BLOCK_GRANULES * GRANULE  # values
        for key, tensor in table.tensors().items():
            source = tensor.detach().reshape(-1).numpy()
            if source.size != m:  # adam's step: whole
                _pwrite(self._fd, source.view(np.uint8), self._starts[key])
                continue
            for i, j in _runs(dirty):
                low, high = int(dirty[i]) * block, min(m, (int(dirty[j - 1]) + 1) * block)
                _pwrite(self._fd, source[low:high].view(np.uint8), self._starts[key] + low * source.itemsize)

    def write(self, gathered: Gathered) -> None:
        self._write_staged()  # older: the last round's go on top
        self._write(gathered)

    def _write_staged(self) -> None:
        for staged in self._staged:
            self._write(staged)
        self._staged, self._staged_marks = [], None

    def _write(self, gathered: Gathered) -> None:
        for key, picked, values, tail in gathered:
            start = self._starts[key]
            if picked is None:
                _pwrite(self._fd, values.view(np.uint8).reshape(-1), start)
                continue
            granule_bytes = GRANULE * values.itemsize
            for i, j in _runs(picked):
                _pwrite(
                    self._fd, values[i:j].view(np.uint8).reshape(-1), start + int(picked[i]) * granule_bytes
                )
            if tail is not None:
                size = int(np.prod(self._layout[key][0]))
                _pwrite(self._fd, tail.view(np.uint8), start + (size - tail.size) * tail.itemsize)


def _runs(indices: np.ndarray) -> list[tuple[int, int]]:
    """(i, j) for each run of consecutive values ``indices[i:j]`` of the sorted ``indices``."""
    breaks = (np.flatnonzero(np.diff(indices) != 1) + 1).tolist()
    return list(zip([0, *breaks], [*breaks, int(indices.size)], strict=True)) if indices.size else []


def _pwrite(fd: int, data: np.ndarray, position: int) -> None:
    """All of ``data`` (contiguous bytes) written at ``position`` of ``fd``."""
    pwrite_fully(fd, np.ascontiguousarray(data).data.cast("B"), position)


def consistent_copy(
    name: str,
    journal: Journal,
    exclusive: Callable[[], AbstractContextManager[tuple[Table, int]]],
    targets: Mapping[str, np.ndarray] | CopyTarget,
    finish: Callable[[Table, int, LogMark | None], T],
    faults: Faults = NO_FAULTS,
    granules: Callable[[Table], GranuleMarks | None] | None = None,
) -> T:
    """Fill ``targets`` (name -> a contiguous numpy array of each of ``Table.tensors()``' shape and
    dtype: private memory, or a mapping of a snapshot file; or any ``CopyTarget``) with the table's
    state at one version V;
    ``finish(table, V, mark)`` is called under the update lock at V, the copy complete (``mark``: the
    journal's note of its log at V, None where the copy was made whole under the lock), and its result
    returned. The lock is held for the rows changed since the last lock-free round (see the module
    docstring); the longest hold is logged (info). Raises ``ConflictError`` if the table was replaced by
    one of another layout meanwhile. ``faults``: testing only, a pause after each piece of the lock-free
    copy. ``granules``: called under the lock with the table held, the record of changed granules of its
    array (``granules.GranuleMarks``), used where the journal keeps no log (see the module docstring);
    None (or it returns None): such a copy is made whole under the lock."""
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
    target = ArrayTarget(targets) if isinstance(targets, Mapping) else targets
    result, version, how = _copy(name, journal, locked, target, finish, faults, granules)
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
    targets: CopyTarget,
    finish: Callable[[Table, int, LogMark | None], T],
    faults: Faults,
    granules: Callable[[Table], GranuleMarks | None] | None,
) -> tuple[T, int, str]:
    """``consistent_copy``: (finish's result, the version copied, how it was copied)."""

    def whole(now: Table, version: int, why: str) -> tuple[T, int, str]:
        """The copy made whole, the lock held (the log cannot say what changed)."""
        targets.fill(now, pause=None)
        return finish(now, version, None), version, f"whole, under the lock: {why}"

    with exclusive() as (table, version):
        mark = journal.log_mark(name, version)
        source = _arrays(table, targets)
        if mark is None:
            record = None if granules is None else granules(table)
            slot = None if record is None else record.begin()
            if record is None or slot is None:
                return whole(table, version, "no log" if record is None else f"{SLOTS} copies run already")
    if mark is None:
        assert record is not None and slot is not None
        return _copy_marked(record, slot, exclusive, (table, source), targets, finish, faults)
    targets.fill(table, pause=faults.slow_down)
    cannot_tell = "the log could not say what changed during the copy"
    for round_ in range(_ROUNDS + 1):
        with exclusive() as (now, version):
            until = None if _arrays(now, targets) != source else journal.log_mark(name, version, mark)
            if until is None:  # replaced, or the log swapped or cut meanwhile
                return whole(now, version, cannot_tell)
            updates = version - mark.version
            if round_ == _ROUNDS or updates <= _FEW_UPDATES:
                # The last round: the few updates since the last note are read and their granules
                # gathered into private memory under the lock; written into the target after it (a
                # snapshot file's page being written back to the disk makes a write to it wait:
                # measured at 2**28, 0.9 s under the lock for 14k granules written into the mapping).
                ids = journal.updated_ids(name, mark, until)
                if ids is None:
                    return whole(now, version, cannot_tell)
                marks = touched(now, ids)
                gathered = gather(now, marks)
                result = finish(now, version, until)
                how = (
                    f"lock-free, {round_} lock-free patch round(s), then {int(np.count_nonzero(marks))} "
                    f"granules of {updates} update(s) read under the lock"
                )
                break
        # Lock-free: which ids the updates between the two notes changed (read from the log, hashed),
        # and their granules copied again; what changes meanwhile is in the next round.
        ids = journal.updated_ids(name, mark, until)
        if ids is None:
            with exclusive() as (now, version):
                return whole(now, version, cannot_tell)
        targets.patch(table, touched(table, ids))
        mark = until
    else:  # pragma: no cover
        raise AssertionError("unreachable")
    targets.write(gathered)
    return result, version, how


def _copy_marked(
    record: GranuleMarks,
    slot: int,
    exclusive: Callable[[], AbstractContextManager[tuple[Table, int]]],
    started: tuple[Table, dict[str, int]],
    targets: CopyTarget,
    finish: Callable[[Table, int, LogMark | None], T],
    faults: Faults,
) -> tuple[T, int, str]:
    """``_copy`` where no log says what changed: the same rounds, the granules changed meanwhile taken
    from the array's record (``granules.py``: ``slot``, begun under the lock at the copy's start, marks
    every granule an update changes from then on), not from the log. ``started``: the table and its
    tensors' addresses at the start (a load switches the table to other arrays, with another record: the
    copy is then made whole under the lock). The slot is ended under the lock, whatever happens."""
    table, source = started
    ended = False
    rounds: list[str] = []  # each lock-free round's granules and seconds (the log line's)
    try:
        began = time.perf_counter()
        targets.fill(table, pause=faults.slow_down)
        rounds.append(f"fill {time.perf_counter() - began:.2f} s")
        for round_ in range(_ROUNDS + 1):
            with exclusive() as (now, version):
                if _arrays(now, targets) != source or not record.holds(slot):
                    record.end(slot)
                    ended = True
                    targets.fill(now, pause=None)
                    why = "the table was replaced during the copy"
                    return finish(now, version, None), version, f"whole, under the lock: {why}"
                marks = record.take(slot)
                changed = int(np.count_nonzero(marks))
                if round_ == _ROUNDS or changed <= _FEW_GRANULES:
                    # The last round: the few granules changed since the last take gathered under the
                    # lock, written into the target after it (as ``_copy``'s).
                    record.end(slot)
                    ended = True
                    gathered = gather(now, marks)
                    result = finish(now, version, None)
                    how = (
                        f"lock-free, {round_} lock-free patch round(s) [{'; '.join(rounds)}], then {changed} "
                        "granules read under the lock (no log: the array's record of changed granules)"
                    )
                    break
            began = time.perf_counter()
            targets.patch(table, marks)  # lock-free: what changes meanwhile is in the next take
            rounds.append(f"{changed} granules {time.perf_counter() - began:.2f} s")
        else:  # pragma: no cover
            raise AssertionError("unreachable")
    finally:
        if not ended:
            with suppress(RobezError), exclusive():
                record.end(slot)
    targets.write(gathered)
    return result, version, how


def _arrays(table: Table, targets: CopyTarget) -> dict[str, int]:
    """The table's tensors by address, checked against ``targets``' layout."""
    tensors = table.tensors()
    layout = targets.layout()
    for key, tensor in tensors.items():
        target = layout.get(key)
        if target is None or target != (tuple(tensor.shape), _dtype(tensor)):
            raise ConflictError(f"table of another layout than its copy ({key!r}): replaced meanwhile?")
    return {key: tensor.data_ptr() for key, tensor in tensors.items()}


def _dtype(tensor: torch.Tensor) -> np.dtype:
    return torch.empty(0, dtype=tensor.dtype).numpy().dtype


def _copy_whole(table: Table, targets: Mapping[str, np.ndarray], *, pause: Callable[[], None] | None) -> None:
    """Every tensor copied into its target, in pieces (``pause``: called after each; a test's hook)."""
    for key, tensor in table.tensors().items():
        source = tensor.detach().reshape(-1).numpy()
        target = targets[key].reshape(-1)
        step = max(1, PIECE_BYTES // source.itemsize)
        for start in range(0, source.size, step):
            np.copyto(target[start : start + step], source[start : start + step])
            if pause is not None:
                pause()


def touched(table: Table, ids: list[np.ndarray]) -> np.ndarray:
    """A byte per granule of the table's (m,) tensors: 1 where one of the updates of ``ids`` changed a
    position (each chunk offset ``o`` covers ``[o, o + Z)``)."""
    marks = np.zeros(granule_count(table.config.memory_size), dtype=np.uint8)
    for offsets in _hashed(table, ids):
        mark_chunks(marks, offsets, table.config.chunk_size)
    return marks


def _hashed(table: Table, ids: list[np.ndarray]) -> Iterator[np.ndarray]:
    """The chunk offsets (flat) of every update of ``ids``: in one call to the hash for the updates of
    each ``_HASH_BATCH_IDS`` ids (a lock-free round may patch thousands of updates; batches keep the
    temporaries small), each update alone where one of a batch is refused (an update refused as a whole
    changed nothing)."""
    batch: list[np.ndarray] = []
    count = 0
    for index, update_ids in enumerate(ids):
        batch.append(update_ids)
        count += update_ids.size
        if count >= _HASH_BATCH_IDS or index == len(ids) - 1:
            try:
                yield _hash(table, np.concatenate(batch))
            except InvalidInputError:
                for one in batch:
                    with suppress(InvalidInputError):
                        yield _hash(table, one)
            batch, count = [], 0


def _hash(table: Table, ids: np.ndarray) -> np.ndarray:
    return table.hash(torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))).numpy().reshape(-1)


def gather(table: Table, marks: np.ndarray) -> Gathered:
    """Private copies of the marked granules of each (m,) tensor of the table (key, granule indexes,
    their values, the tail past the last whole granule if marked) and of every other tensor (adam's
    step) whole (key, None, values, None)."""
    m = table.config.memory_size
    whole = m // GRANULE
    picked = np.flatnonzero(marks[:whole])
    gathered: Gathered = []
    for key, tensor in table.tensors().items():
        source = tensor.detach().reshape(-1).numpy()
        if source.size != m:
            gathered.append((key, None, source.copy(), None))
            continue
        rows = source[: whole * GRANULE].reshape(whole, GRANULE)[picked]  # fancy indexing: a copy
        tail = source[whole * GRANULE :].copy() if whole * GRANULE < m and marks[whole:].any() else None
        gathered.append((key, picked, rows, tail))
    return gathered


def _scatter(targets: Mapping[str, np.ndarray], gathered: Gathered) -> None:
    """Write what ``gather`` read into ``targets``."""
    for key, picked, values, tail in gathered:
        target = targets[key].reshape(-1)
        if picked is None:
            np.copyto(target, values)
            continue
        whole = target.size // GRANULE
        if picked.size:
            target[: whole * GRANULE].reshape(whole, GRANULE)[picked] = values
        if tail is not None:
            np.copyto(target[target.size - tail.size :], tail)
