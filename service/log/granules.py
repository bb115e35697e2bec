"""Which granules of an array its updates changed while copies of it run: a record in shared memory.

Where no log says which rows changed during a lock-free copy (no data directory, a replica), the copy
(``live_copy.consistent_copy``) learns it from this record instead: one byte per granule of the array's
(m,) tensors (``GRANULE`` values: 64, 256 bytes of float32), in a file every worker maps beside the array
(``arrays/<id>.granules``, service/shm.py), after a small header::

    int64 active       one bit per copy running (at most ``SLOTS`` at once)
    int64 owner[SLOTS] the pid of the process running the copy of each bit (0: free)
    uint8 marks[G]     G = ceil(m / GRANULE): bit k set = the granule changed since copy k last took it

Every change of the array is made under its update lock, and so is every read and write of this record:
the one apply path (``entry.apply_record``) marks the granules an update's chunks cover while ``active``
is non-zero (one shared read per update otherwise); a repair marks every granule. A copy takes a bit
(``begin``), and in each round, under the lock, takes its marks and clears them (``take``), then copies
those granules again. One bit per copy rather than a count: two copies running at once each clear only
their own marks. A copy whose process died leaves its bit set, which costs marking only; the bit is
taken back by the next ``begin`` or repair (``reclaim``: the owner's pid is gone).

A streamed checkpoint download (``log/stream_copy.py``) takes a bit too, as a *stream* (``begin_stream``):
it sends the table as it was at the version V it began at, front to back, while updates go on, so before
an update changes a granule the stream has not yet sent, the apply path saves that granule's contents at V
once (copy-on-write): every (m,) tensor's 256 bytes of it (``granule_tensors``' order), appended as a
record to the stream's side file (on disk, never in this memory: its path is in the header). The bit of
the granule marks it saved. The header holds, per stream slot::

    int64 streams           one bit per slot that is a stream
    int64 cursor[SLOTS]     the stream sent every (tensor t, granule g) with t * G + g below it
    int64 end[SLOTS]        the side file's length (records end there)
    int64 failed[SLOTS]     non-zero: no granule is saved any more (an errno, or REPAIRED)
    int64 serial[SLOTS]     changes with every ``begin_stream`` (each process's open side file checked)
    int64 saves[SLOTS][3]   the updates that saved granules: count, nanoseconds in all, the most in one
    uint8 path[SLOTS][256]  the side file

A record is ``int64 n, int64 granule[n]``, then each (m,) tensor's n granules (the last granule zero
padded). A save that fails (a full disk) sets ``failed``: the update goes on, the stream ends with an
error at its next block. An update pays, while no copy runs, the one shared read it paid before.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from contextlib import suppress
from typing import TYPE_CHECKING

import numpy as np

from robez_core.checkpoint import pwrite_fully
from robez_core.hostinfo import process_alive

if TYPE_CHECKING:
    from robez_core.table import Table

logger = logging.getLogger("robez.store")

# Positions are patched in granules of this many values (256 bytes of float32).
GRANULE = 64
SLOTS = 8
PATH_BYTES = 256
_INT64S = 2 + 8 * SLOTS  # active, owner[], streams, cursor[], end[], failed[], serial[], saves[][3]
HEADER_BYTES = 8 * _INT64S + SLOTS * PATH_BYTES
# ``failed`` of a stream whose table a repair rewrote (not an errno).
REPAIRED = -1
# A save appends records of at most this many granules (its temporaries: ~3 MiB for adam).
_RECORD_GRANULES = 1 << 12


def granule_count(memory_size: int) -> int:
    """Granules of an (m,) tensor, the last one partial where m is not a multiple of GRANULE."""
    return -(-memory_size // GRANULE)


def record_bytes(memory_size: int) -> int:
    """The size of the record of an array of ``memory_size`` values."""
    return HEADER_BYTES + granule_count(memory_size)


def granule_tensors(table: Table) -> list[tuple[str, np.ndarray]]:
    """The table's (m,) tensors (weight and the optimizer state of its length), flat, in checkpoint file
    order (itemsize descending, then name): the order of a stream's cursor and of a side record."""
    m = table.config.memory_size
    tensors = {key: t for key, t in table.tensors().items() if t.dim() == 1 and t.numel() == m}
    order = sorted(tensors, key=lambda key: (-tensors[key].element_size(), key))
    return [(key, tensors[key].detach().numpy()) for key in order]


def granule_rows(source: np.ndarray, granules: np.ndarray) -> np.ndarray:
    """The (n, GRANULE) values of ``granules`` of the flat ``source`` (a copy; the last one zero padded
    where the length is not a multiple of GRANULE)."""
    whole = source.size // GRANULE
    body = source[: whole * GRANULE].reshape(whole, GRANULE)
    if whole * GRANULE == source.size:
        return body[granules]
    rows = np.zeros((granules.size, GRANULE), dtype=source.dtype)
    full = granules < whole
    rows[full] = body[granules[full]]
    rows[~full, : source.size - whole * GRANULE] = source[whole * GRANULE :]
    return rows


def chunk_granules(offsets: np.ndarray, chunk_size: int) -> np.ndarray:
    """The granules (sorted, once each) the chunks at ``offsets`` (flat starts) cover."""
    first = offsets // GRANULE
    last = (offsets + (chunk_size - 1)) // GRANULE
    steps = [np.minimum(first + step, last) for step in range((chunk_size - 1) // GRANULE + 2)]
    return np.unique(np.concatenate(steps))


def mark_chunks(marks: np.ndarray, offsets: np.ndarray, chunk_size: int, bits: int = 1) -> None:
    """Set ``bits`` in the byte of every granule a chunk at one of ``offsets`` (flat chunk starts, each
    covering ``[o, o + chunk_size)``) touches."""
    first = offsets // GRANULE
    last = (offsets + (chunk_size - 1)) // GRANULE
    for step in range((chunk_size - 1) // GRANULE + 2):  # granules one chunk can touch, at most
        at = np.minimum(first + step, last)
        if bits == 1:
            marks[at] = 1
        else:
            marks[at] |= bits


class GranuleMarks:
    """One array's record (see the module docstring), over ``raw``: the uint8 mapping of its file.
    Every method is called with the array's update lock held."""

    def __init__(self, raw: np.ndarray) -> None:
        header = raw[: 8 * _INT64S].view(np.int64)
        self._active = header[:1]
        self._owners = header[1 : 1 + SLOTS]
        self._streams = header[1 + SLOTS : 2 + SLOTS]
        self._cursor, self._end, self._failed, self._serial = (
            header[2 + SLOTS * k : 2 + SLOTS * (k + 1)] for k in range(1, 5)
        )
        self._saves = header[2 + 5 * SLOTS : 2 + 8 * SLOTS].reshape(SLOTS, 3)
        self._paths = raw[8 * _INT64S : HEADER_BYTES].reshape(SLOTS, PATH_BYTES)
        self.marks = raw[HEADER_BYTES:]
        self._side: dict[int, tuple[int, int]] = {}  # slot -> (serial, fd): this process's side files

    def active(self) -> bool:
        """A copy runs (the apply path's one read per update)."""
        return bool(self._active[0])

    def _bits(self) -> tuple[int, int]:
        """(the bits of the copies running, those of the streams)."""
        active = int(self._active[0])
        streams = int(self._streams[0]) & active
        return active & ~streams, streams

    def mark_positions(self, locations: np.ndarray, table: Table) -> None:
        """An update of ``table`` is about to change the array positions ``locations`` (a prepared
        step's): their granules marked for the copies, saved for the streams."""
        copies, streams = self._bits()
        granules = locations // GRANULE
        if copies:
            self.marks[granules] |= np.uint8(copies)
        if streams:
            self._save(table, np.unique(granules), streams)

    def mark_chunks(self, offsets: np.ndarray, chunk_size: int, table: Table) -> None:
        """An update of ``table`` is about to change the chunks at ``offsets`` (flat): ``mark_positions``."""
        copies, streams = self._bits()
        if copies:
            mark_chunks(self.marks, offsets, chunk_size, copies)
        if streams:
            self._save(table, chunk_granules(offsets, chunk_size), streams)

    def mark_all(self) -> None:
        """Every granule changed (a repair rewrote the array): the streams cannot send their version."""
        copies, streams = self._bits()
        self.marks |= np.uint8(copies)
        for slot in _slots(streams):
            self._failed[slot] = REPAIRED

    def _save(self, table: Table, granules: np.ndarray, streams: int) -> None:
        """Append to each stream's side file the contents of ``granules`` (sorted, unique) not saved yet
        and not wholly sent; a failure stops that stream's saves (``failed``), never the update."""
        tensors = [source for _key, source in granule_tensors(table)]
        count = self.marks.size
        for slot in _slots(streams):
            if self._failed[slot]:
                continue
            started = time.perf_counter_ns()
            bit = np.uint8(1 << slot)
            need = granules[(self.marks[granules] & bit) == 0]
            need = need[(len(tensors) - 1) * count + need >= self._cursor[slot]]  # a tensor's unsent
            try:
                fd = self._side_file(slot) if need.size else -1
                for start in range(0, need.size, _RECORD_GRANULES):
                    part = need[start : start + _RECORD_GRANULES]
                    pieces = [np.array([part.size], dtype=np.int64), part.astype(np.int64)]
                    pieces += [granule_rows(source, part) for source in tensors]
                    record = np.concatenate([piece.view(np.uint8).reshape(-1) for piece in pieces])
                    pwrite_fully(fd, record.data, int(self._end[slot]))
                    self._end[slot] += record.size
                    self.marks[part] |= bit
            except OSError as error:
                self._failed[slot] = error.errno or errno.EIO
                logger.warning("a download's copy-on-write save failed (the download ends): %s", error)
            if need.size:
                took = time.perf_counter_ns() - started
                self._saves[slot] += (1, took, 0)
                self._saves[slot, 2] = max(int(self._saves[slot, 2]), took)

    def _side_file(self, slot: int) -> int:
        """This process's descriptor of the side file of the stream in ``slot``."""
        serial = int(self._serial[slot])
        known = self._side.get(slot)
        if known is not None and known[0] == serial:
            return known[1]
        if known is not None:
            os.close(known[1])
            del self._side[slot]
        fd = os.open(self.side_path(slot), os.O_WRONLY)
        self._side[slot] = (serial, fd)
        return fd

    def __del__(self) -> None:
        """This process's side files closed with the record (a table dropped, say)."""
        for _serial, fd in getattr(self, "_side", {}).values():
            with suppress(OSError):
                os.close(fd)

    def side_path(self, slot: int) -> str:
        """The side file of the stream in ``slot``."""
        return bytes(self._paths[slot]).rstrip(b"\0").decode()

    def reclaim(self) -> None:
        """Free the bits of copies whose process is gone (killed mid-copy); a stream's side file goes."""
        for slot in range(SLOTS):
            pid = int(self._owners[slot])
            if pid and not process_alive(pid):
                if int(self._streams[0]) & (1 << slot):
                    with suppress(OSError):
                        os.unlink(self.side_path(slot))
                self.end(slot)

    def begin(self) -> int | None:
        """Start a copy: a free bit (its marks cleared: what changes from now on), or None when
        ``SLOTS`` copies run already."""
        self.reclaim()
        active = int(self._active[0])
        slot = next((slot for slot in range(SLOTS) if not active & (1 << slot)), None)
        if slot is None:
            return None
        self.marks &= np.uint8(0xFF ^ (1 << slot))
        self._owners[slot] = os.getpid()
        self._active[0] = active | (1 << slot)
        return slot

    def begin_stream(self, side_path: str) -> int | None:
        """Start a stream (``begin``) whose granules are saved into the empty file ``side_path``."""
        encoded = side_path.encode()
        if len(encoded) >= PATH_BYTES:
            raise OSError(errno.ENAMETOOLONG, f"side file path over {PATH_BYTES - 1} bytes: {side_path}")
        slot = self.begin()
        if slot is None:
            return None
        self._cursor[slot] = self._end[slot] = self._failed[slot] = 0
        self._saves[slot] = 0
        self._serial[slot] += 1
        self._paths[slot] = 0
        self._paths[slot, : len(encoded)] = np.frombuffer(encoded, dtype=np.uint8)
        self._streams[0] = int(self._streams[0]) | (1 << slot)
        return slot

    def sent(self, slot: int, cursor: int) -> None:
        """The stream of ``slot`` sent every (tensor t, granule g) with t * G + g below ``cursor``."""
        self._cursor[slot] = cursor

    def saved_end(self, slot: int) -> int:
        """Where the records of the stream of ``slot`` end in its side file."""
        return int(self._end[slot])

    def save_times(self, slot: int) -> tuple[int, float, float]:
        """The updates that saved granules for the stream of ``slot``: (count, seconds in all, the most
        seconds one took)."""
        count, total, most = (int(value) for value in self._saves[slot])
        return count, total / 1e9, most / 1e9

    def failure(self, slot: int) -> int:
        """Why the stream of ``slot`` cannot go on: an errno, ``REPAIRED``, or 0 (it can)."""
        return int(self._failed[slot])

    def holds(self, slot: int) -> bool:
        """The bit is still this process's (nothing took it back)."""
        return bool(int(self._active[0]) & (1 << slot)) and int(self._owners[slot]) == os.getpid()

    def take(self, slot: int) -> np.ndarray:
        """The granules changed since the copy's last ``take`` (or ``begin``): a byte per granule, 1
        where changed (``live_copy.touched``'s form); they are cleared."""
        bit = np.uint8(1 << slot)
        taken = (self.marks & bit).astype(bool).view(np.uint8)
        self.marks &= ~bit
        return taken

    def end(self, slot: int) -> None:
        """The copy of ``slot`` is over: its bit freed."""
        self._owners[slot] = 0
        self._streams[0] = int(self._streams[0]) & ~(1 << slot)
        self._active[0] = int(self._active[0]) & ~(1 << slot)


def _slots(bits: int) -> list[int]:
    return [slot for slot in range(SLOTS) if bits & (1 << slot)]
