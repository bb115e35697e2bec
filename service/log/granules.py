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
"""

from __future__ import annotations

import os

import numpy as np

from robez_core.hostinfo import process_alive

# Positions are patched in granules of this many values (256 bytes of float32).
GRANULE = 64
SLOTS = 8
HEADER_BYTES = 8 * (1 + SLOTS)


def granule_count(memory_size: int) -> int:
    """Granules of an (m,) tensor, the last one partial where m is not a multiple of GRANULE."""
    return -(-memory_size // GRANULE)


def record_bytes(memory_size: int) -> int:
    """The size of the record of an array of ``memory_size`` values."""
    return HEADER_BYTES + granule_count(memory_size)


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
        header = raw[:HEADER_BYTES].view(np.int64)
        self._active = header[:1]
        self._owners = header[1:]
        self.marks = raw[HEADER_BYTES:]

    def active(self) -> bool:
        """A copy runs (the apply path's one read per update)."""
        return bool(self._active[0])

    def mark_positions(self, locations: np.ndarray) -> None:
        """Mark the granules of the array positions ``locations`` (a prepared step's)."""
        self.marks[locations // GRANULE] |= np.uint8(self._active[0])

    def mark_chunks(self, offsets: np.ndarray, chunk_size: int) -> None:
        """Mark the granules the chunks at ``offsets`` (flat) cover."""
        mark_chunks(self.marks, offsets, chunk_size, int(self._active[0]))

    def mark_all(self) -> None:
        """Every granule changed (a repair rewrote the array)."""
        self.marks |= np.uint8(self._active[0])

    def reclaim(self) -> None:
        """Free the bits of copies whose process is gone (killed mid-copy)."""
        for slot in range(SLOTS):
            pid = int(self._owners[slot])
            if pid and not process_alive(pid):
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
        self._active[0] = int(self._active[0]) & ~(1 << slot)
