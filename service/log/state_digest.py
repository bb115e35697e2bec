"""A table's checksum at one version with no copy of its state (``TableStore.checksum``).

The digest is defined over granules (``granules.GRANULE`` values, 256 bytes of float32), the pieces a
lock-free copy patches: every tensor of the weight's length (m values: the weight, adam's and adagrad's
moments) is cut into its m // GRANULE whole granules, each hashed to 64 bits (``granule_hashes``), and
its tail (the m % GRANULE values after them) kept as bytes; every other tensor (adam's step) is kept as
bytes. The digest is sha256 over, for each tensor by name (sorted): the name, then the granule hashes
(little-endian uint64) and the tail's bytes, or the tensor's bytes (``table_digest``).

So a checksum needs no copy of the state (``StateDigest``, a ``live_copy.CopyTarget``): the granules are
hashed straight from the live table without the update lock, and the granules the updates logged
meanwhile touched hashed again (``consistent_copy``'s rounds; the last one's read under the lock); what
it holds is 8 bytes per granule (1/32 of a float32 tensor) plus the small tensors. Where the journal
keeps no log to say what changed (no data directory, a replica), the same rounds take the changed
granules from the array's record of them (``granules.py``).

The granule hash: the granule's 8-byte words each multiplied by its own odd 64-bit constant, folded
(xor of the high half into the low), multiplied by one more, and summed (mod 2^64). Not a cryptographic
hash (replicas compare digests to find a divergence, not to resist an adversary): any change of one
word changes it, and two different granules collide with a probability near 2^-64.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping

import numpy as np

from robez_core.table import Table

from .live_copy import GRANULE, PIECE_BYTES, Gathered

# The granules of one vectorised hash call (1 MiB of float32: the temporaries stay small).
_HASH_GRANULES = 4096
_MASK = (1 << 64) - 1


def _splitmix64(seed: int, count: int) -> list[int]:
    """``count`` 64-bit numbers of the splitmix64 sequence from ``seed`` (fixed here: the digest must
    not depend on a library's random generator)."""
    out = []
    for _ in range(count):
        seed = (seed + 0x9E3779B97F4A7C15) & _MASK
        z = seed
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        out.append(z ^ (z >> 31))
    return out


# One multiplier per 8-byte word of a granule (GRANULE values of at most 8 bytes), then the final one.
_CONSTANTS = _splitmix64(0x726F62657A, GRANULE + 1)
_WORD_MULTIPLIERS = np.array([value | 1 for value in _CONSTANTS[:GRANULE]], dtype=np.uint64)
_MIX = np.uint64(_CONSTANTS[GRANULE] | 1)
_SHIFT = np.uint64(32)


def granule_hashes(values: np.ndarray) -> np.ndarray:
    """The 64-bit hash of each granule of ``values`` (a contiguous 1-d array of a multiple of GRANULE
    values, any dtype): (len // GRANULE,) uint64."""
    words = np.ascontiguousarray(values).view(np.uint8).view("<u8").reshape(values.size // GRANULE, -1)
    mixed = words * _WORD_MULTIPLIERS[: words.shape[1]]
    mixed ^= mixed >> _SHIFT
    mixed *= _MIX
    return mixed.sum(axis=1, dtype=np.uint64)


def _hash_range(source: np.ndarray, hashes: np.ndarray, start: int, stop: int) -> None:
    """``hashes[start:stop]`` from granules ``start..stop`` of ``source`` (flat), in calls of
    ``_HASH_GRANULES``."""
    for first in range(start, stop, _HASH_GRANULES):
        last = min(stop, first + _HASH_GRANULES)
        hashes[first:last] = granule_hashes(source[first * GRANULE : last * GRANULE])


def _flat(table: Table) -> dict[str, np.ndarray]:
    return {key: tensor.detach().reshape(-1).numpy() for key, tensor in table.tensors().items()}


def _digest(parts: Mapping[str, tuple[np.ndarray | None, np.ndarray]]) -> str:
    """sha256 over each tensor by name: the name, its granule hashes (or nothing), then its bytes."""
    digest = hashlib.sha256()
    for key, (hashes, rest) in sorted(parts.items()):
        digest.update(key.encode())
        if hashes is not None:
            digest.update(hashes.astype("<u8", copy=False).data)
        digest.update(np.ascontiguousarray(rest).view(np.uint8).data)
    return digest.hexdigest()


def table_digest(tensors: Mapping[str, np.ndarray], memory_size: int) -> str:
    """The checksum of a table's state (``tensors``: name -> its values, flat or not; ``memory_size``:
    the table's m), as the module docstring defines it, computed in one go."""
    parts: dict[str, tuple[np.ndarray | None, np.ndarray]] = {}
    for key, array in tensors.items():
        flat = np.ascontiguousarray(array).reshape(-1)
        if flat.size != memory_size:
            parts[key] = (None, flat)
            continue
        whole = memory_size // GRANULE
        hashes = np.empty(whole, dtype=np.uint64)
        _hash_range(flat, hashes, 0, whole)
        parts[key] = (hashes, flat[whole * GRANULE :])
    return _digest(parts)


class StateDigest:
    """A ``live_copy.CopyTarget`` that keeps the granule hashes of the table's state, not the state:
    ``consistent_copy`` fills it, ``hexdigest`` gives the digest of the version it was filled at."""

    def __init__(self, table: Table) -> None:
        self.memory_size = table.config.memory_size
        self._layout = {key: (tuple(array.shape), array.dtype) for key, array in table_arrays(table).items()}
        whole = self.memory_size // GRANULE
        # name -> (granule hashes, or None for a small tensor; the tail or the small tensor's values)
        self._parts: dict[str, tuple[np.ndarray | None, np.ndarray]] = {}
        for key, (shape, dtype) in self._layout.items():
            size = int(np.prod(shape, dtype=np.int64))
            if size == self.memory_size:
                tail = np.empty(size - whole * GRANULE, dtype=dtype)
                self._parts[key] = (np.empty(whole, dtype=np.uint64), tail)
            else:
                self._parts[key] = (None, np.empty(size, dtype=dtype))

    def layout(self) -> Mapping[str, tuple[tuple[int, ...], np.dtype]]:
        return self._layout

    def fill(self, table: Table, *, pause: Callable[[], None] | None) -> None:
        """Hash every granule of ``table``: without the lock, or under it (``pause`` None) where the log
        cannot say what changed; no copy either way (hashing runs at about the speed of a copy)."""
        whole = self.memory_size // GRANULE
        for key, source in _flat(table).items():
            hashes, rest = self._parts[key]
            if hashes is None:
                np.copyto(rest, source)
                continue
            step = max(1, PIECE_BYTES // (GRANULE * source.itemsize))
            for start in range(0, whole, step):
                _hash_range(source, hashes, start, min(whole, start + step))
                if pause is not None:
                    pause()
            np.copyto(rest, source[whole * GRANULE :])

    def patch(self, table: Table, marks: np.ndarray) -> None:
        whole = self.memory_size // GRANULE
        picked = np.flatnonzero(marks[:whole])
        tail_marked = bool(marks[whole:].any())
        for key, source in _flat(table).items():
            hashes, rest = self._parts[key]
            if hashes is None:
                np.copyto(rest, source)
                continue
            granules = source[: whole * GRANULE].reshape(whole, GRANULE)
            for first in range(0, picked.size, _HASH_GRANULES):
                chosen = picked[first : first + _HASH_GRANULES]
                hashes[chosen] = granule_hashes(granules[chosen].reshape(-1))  # fancy indexing: a copy
            if tail_marked:
                np.copyto(rest, source[whole * GRANULE :])

    def write(self, gathered: Gathered) -> None:
        for key, picked, values, tail in gathered:
            hashes, rest = self._parts[key]
            if picked is None or hashes is None:
                np.copyto(rest, values.reshape(-1))
                continue
            if picked.size:
                hashes[picked] = granule_hashes(values.reshape(-1))
            if tail is not None:
                np.copyto(rest, tail)

    def hexdigest(self) -> str:
        """The digest of the state filled in."""
        return _digest(self._parts)


def table_arrays(table: Table) -> dict[str, np.ndarray]:
    """The table's tensors as numpy arrays (the live memory, no copy)."""
    return {key: tensor.detach().numpy() for key, tensor in table.tensors().items()}


def digest_of_table(table: Table) -> str:
    """``table_digest`` of a (private or live, unchanging) table: what its checksum answers."""
    return table_digest(table_arrays(table), table.config.memory_size)
