"""A checkpoint download sent while it is made: the table at one version, its first byte at once.

``consistent_copy`` (live_copy.py) makes a whole copy before anything of it can go: the checkpoint format
put every tensor's checksum in its header, known only after the copy. A streamed download is a version-2
checkpoint instead (robez_core/checkpoint.py ``StreamedCheckpoint``: the digests in a last tensor), so
its header goes first and the state follows front to back, at the version V it began at, while updates
go on (copy-on-write at granule level, the array's record of granules: granules.py):

1. under the update lock, briefly: note V, take a stream bit of the record (``begin_stream``: from now on
   the apply path saves, once, every granule an update is about to change that the stream has not sent
   yet, into the stream's side file, before it changes), copy the small tensors (adam's ``step``);
2. send the header; then each (m,) tensor in blocks of ``BLOCK_GRANULES`` granules: copy the block from
   the live array without the lock (torn where an update runs meanwhile), then, under the lock, move the
   record's cursor past the block (updates no longer save it) and note where the side file ends; after
   the lock, replace every granule of the block that the side file holds (saved before an update
   changed it) by its saved contents. A granule that is not saved was not changed between V and that
   lock, so the lock-free copy, made before it, read its contents at V; one that changed was saved with
   its contents at V, before it changed. The block is then exactly V's;
3. send the digests; end the bit (under the lock) and remove the side file.

The lock is held to begin and, per block, to move the cursor: never for a copy. Memory: a block, the
index of saved granules (16 bytes per granule: 1/48 of adam's state) and a save's temporaries; the side
file holds what updates changed before it was sent (at most the whole state): it is written with
``pwrite`` and read with ``pread``, never mapped, so it is page cache, not this process's memory. It lies
in the data directory if there is one, else in the system's temporary directory. A save that fails (a full
disk) ends the download with an error at its next block (``StreamAborted``), never the update; so do a
repair or a load of the table meanwhile, and its deletion. A test can slow the stream down
(``Faults.slow_down_per_piece``, once per ``SLOW_PIECE_BYTES`` sent, without the lock).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, suppress

import numpy as np

from robez_core.checkpoint import StreamedCheckpoint
from robez_core.errors import BusyError, ConflictError, RobezError
from robez_core.table import Table

from ..faults import Faults
from .granules import GRANULE, REPAIRED, SLOTS, GranuleMarks, granule_count, granule_tensors

logger = logging.getLogger("robez.store")

# Granules per block: 4 MiB of float32, sent as one chunk; the lock is taken once per block.
BLOCK_GRANULES = 1 << 14
# The side files' names (``<spill dir>/.robez-download-*.saved``); a start removes any a kill left.
SIDE_FILE_PREFIX = ".robez-download-"


class StreamAborted(RobezError):
    """The download cannot go on at its version (a full disk, a repair, a load): sent, it is cut short."""


class CheckpointStream:
    """One download (module docstring): ``version`` and ``size`` known at once, ``chunks()`` the file."""

    def __init__(
        self,
        name: str,
        exclusive: Callable[[], AbstractContextManager[tuple[Table, int]]],
        marks_of: Callable[[Table], GranuleMarks | None],
        spill_dir: str | None,
        faults: Faults,
    ) -> None:
        self._name = name
        self._started = time.perf_counter()
        self._exclusive = exclusive
        self._faults = faults
        try:
            fd, path = tempfile.mkstemp(prefix=SIDE_FILE_PREFIX, suffix=".saved", dir=spill_dir)
        except OSError as error:
            raise BusyError(f"the download's copy-on-write store cannot be created: {error}") from error
        self._fd, self._path = fd, path
        try:
            with exclusive() as (table, version):
                held = time.perf_counter()  # (from the lock taken: the wait for it is not a hold)
                record = marks_of(table)
                if record is None:  # pragma: no cover - the table is its own under the lock
                    raise ConflictError("the table was replaced while its download began")
                slot = record.begin_stream(path)
                if slot is None:
                    raise BusyError(f"{SLOTS} copies of this table run already; try again when one ended")
                tensors = table.tensors()
                self._addresses = {key: t.data_ptr() for key, t in tensors.items()}
                self._streamed = granule_tensors(table)
                big = {key for key, _ in self._streamed}
                self._small = {key: t.detach().numpy().copy() for key, t in tensors.items() if key not in big}
                self.checkpoint = StreamedCheckpoint(tensors, table.metadata())
            self.lock_holds = [time.perf_counter() - held]  # seconds of each hold of the lock
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        self.version = version
        self.size = self.checkpoint.size
        self._table, self._record, self._slot = table, record, slot
        self._granules = granule_count(table.config.memory_size)
        self._saved = _SavedGranules(fd, self._granules, [source.itemsize for _, source in self._streamed])
        self._sent = False
        self._ended = False

    def chunks(self) -> Iterator[bytes]:
        """The checkpoint's bytes, header first; the stream's bit and side file end with it (or when the
        iterator is closed)."""
        try:
            yield self.checkpoint.header
            order = [key for key, _ in self._streamed]
            for key in self.checkpoint.order:
                if key in self._small:
                    data = self._small[key].tobytes()
                    self.checkpoint.update(key, data)
                    yield data
                    continue
                yield from self._tensor(order.index(key))
            yield self.checkpoint.trailer()
            self._sent = True
        finally:
            self.close()

    def _tensor(self, index: int) -> Iterator[bytes]:
        key, source = self._streamed[index]
        m = source.size
        rows = np.empty((BLOCK_GRANULES, GRANULE), dtype=source.dtype)  # the last granule padded
        buffer = rows.reshape(-1)
        for first in range(0, self._granules, BLOCK_GRANULES):
            last = min(self._granules, first + BLOCK_GRANULES)
            low, high = first * GRANULE, min(m, last * GRANULE)
            block = buffer[: high - low]
            np.copyto(block, source[low:high])  # without the lock: torn where an update runs
            self._faults.slow_down_per_piece(low * source.itemsize, high * source.itemsize)
            with self._exclusive() as (now, _version):
                held = time.perf_counter()
                self._check(now)
                self._record.sent(self._slot, index * self._granules + last)
                end = self._record.saved_end(self._slot)
                self.lock_holds.append(time.perf_counter() - held)
            self._saved.read(end)
            self._saved.patch(rows, index, first, last)
            data = block.tobytes()
            self.checkpoint.update(key, data)
            yield data

    def _check(self, table: Table) -> None:
        """Under the lock: the stream can still send its version's bytes (``StreamAborted`` if not)."""
        if {key: t.data_ptr() for key, t in table.tensors().items()} != self._addresses:
            raise StreamAborted("the table was replaced (a load) during the download: download it again")
        if not self._record.holds(self._slot):
            raise StreamAborted("the download's copy-on-write record was taken back: download it again")
        failure = self._record.failure(self._slot)
        if failure == REPAIRED:
            raise StreamAborted("the table was rewritten (a repair, a load) during the download: try again")
        if failure:
            raise StreamAborted(
                f"the download's copy-on-write store ({os.path.dirname(self._path)}) could not be written "
                f"({os.strerror(failure)}): the download is cut short; the updates went on"
            )

    def close(self) -> None:
        """End the stream: its bit freed (under the lock), its side file emptied and removed."""
        if self._ended:
            return
        self._ended = True
        saves = (0, 0.0, 0.0)
        with suppress(RobezError), self._exclusive():
            if self._record.holds(self._slot):
                saves = self._record.save_times(self._slot)
                self._record.end(self._slot)
        with suppress(OSError):
            os.ftruncate(self._fd, 0)  # the space goes now, whoever still has the file open
        os.close(self._fd)
        with suppress(OSError):
            os.unlink(self._path)
        logger.info(
            "table %r: state copied at version %d in %.2f s (streamed%s: %d blocks, %d granules saved in "
            "%.1f MiB of side file by %d updates, each %.2f ms on average and %.2f ms at most, under their "
            "lock); the update lock held at most %.1f ms",
            self._name,
            self.version,
            time.perf_counter() - self._started,
            "" if self._sent else ", not to the end",
            len(self.lock_holds) - 1,
            self._saved.granules,
            self._saved.bytes / (1 << 20),
            saves[0],
            1000 * saves[1] / max(1, saves[0]),
            1000 * saves[2],
            1000 * max(self.lock_holds),
        )


class _SavedGranules:
    """The stream's index of its side file (granules.py's records): for each granule saved, the record
    and its place in it."""

    def __init__(self, fd: int, granules: int, itemsizes: list[int]) -> None:
        self._fd = fd
        self._itemsizes = itemsizes
        self._record_at = np.full(granules, -1, dtype=np.int64)  # where its record's values begin
        self._record_size = np.zeros(granules, dtype=np.int32)  # that record's granule count
        self._place = np.zeros(granules, dtype=np.int32)  # its index in the record
        self._read_to = 0
        self.granules = 0  # saved, so far

    @property
    def bytes(self) -> int:
        """The side file's bytes indexed so far."""
        return self._read_to

    def read(self, end: int) -> None:
        """Index the records written up to ``end`` (noted under the lock: each is whole)."""
        while self._read_to < end:
            count = int.from_bytes(_pread(self._fd, 8, self._read_to), "little")
            granules = np.frombuffer(_pread(self._fd, 8 * count, self._read_to + 8), dtype=np.int64)
            values = self._read_to + 8 + 8 * count
            self._record_at[granules] = values
            self._record_size[granules] = count
            self._place[granules] = np.arange(count, dtype=np.int32)
            self.granules += count
            self._read_to = values + count * GRANULE * sum(self._itemsizes)

    def patch(self, rows: np.ndarray, index: int, first: int, last: int) -> None:
        """Put into ``rows`` ((BLOCK_GRANULES, GRANULE): the block's granules ``first..last`` of the
        ``index``-th streamed tensor, the last one padded) the saved contents of those of its granules the
        side file holds. A record's granules are sorted, so those of one record inside the block lie
        side by side in it: one read per record (not per granule: 3-4x slower at 2^26 under a pusher)."""
        picked = np.flatnonzero(self._record_at[first:last] >= 0) + first
        if not picked.size:
            return
        granule_bytes = GRANULE * self._itemsizes[index]
        before = sum(self._itemsizes[:index]) * GRANULE  # bytes per granule of the tensors ahead of it
        records = self._record_at[picked]
        order = np.argsort(records, kind="stable")  # by record; granule order (= place order) kept
        picked, records = picked[order], records[order]
        starts = np.flatnonzero(np.diff(records, prepend=-1))
        flat = rows.reshape(rows.shape[0], -1).view(np.uint8)
        for begin, end in zip(starts, [*starts[1:], picked.size], strict=True):
            granules = picked[begin:end]
            places = self._place[granules].astype(np.int64)
            low, high = int(places.min()), int(places.max()) + 1  # side by side: see above
            at = int(records[begin]) + int(self._record_size[granules[0]]) * before + low * granule_bytes
            data = np.frombuffer(_pread(self._fd, (high - low) * granule_bytes, at), dtype=np.uint8)
            flat[granules - first] = data.reshape(high - low, granule_bytes)[places - low]


def _pread(fd: int, size: int, position: int) -> bytes:
    """Exactly ``size`` bytes at ``position`` of ``fd`` (``OSError`` if the file is shorter)."""
    data = os.pread(fd, size, position)
    while len(data) < size:
        more = os.pread(fd, size - len(data), position + len(data))
        if not more:
            raise OSError(f"side file shorter than its records ({position + len(data)} < {position + size})")
        data += more
    return data
