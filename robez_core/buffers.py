"""Reused output buffers: a large kernel output goes back into service once nobody holds it.

A training step's lookups return fresh (N, d) batches of rows (13 MB for 32768 x 100) and drop the
previous step's. Whether glibc serves the next one from memory it kept or from pages it must fault in
and zero again depends on everything else the process allocated before (its mmap and trim thresholds
move with every large free): trained on its own, the fused pair model's gathers took hundreds of faults
on most calls and ran 2-4x slower than the same gathers after a reference run had raised those
thresholds. This pool makes that independent of the process's history.

How it knows a buffer is free: an output is a ``torch.from_numpy`` view of a pooled numpy array, and a
tensor made that way holds a reference to the array until its storage dies, whatever views, reshapes or
``.numpy()`` arrays were made of it. So an array that only the pool references is free, and the
interpreter's reference count says so exactly (``sys.getrefcount``); nothing is handed out twice and
nothing is freed early. Taking a buffer happens under a lock, so kernels called from several threads
never share one.

Only outputs of at least ``MIN_POOLED_BYTES`` are pooled (smaller ones fault rarely: glibc's heap
keeps them; the 1 MB dense gradient of a 262144-float array is pooled, and a batch's 13 MB of rows), and
the pool holds at most ``max_bytes`` in all (``set_max_bytes``; 0 turns it off). Up to that much memory
stays resident after the last call, as a caching allocator's does; ``clear()`` hands it back.
"""

from __future__ import annotations

import math
import sys
import threading

import numpy as np

__all__ = ["MIN_POOLED_BYTES", "clear", "empty", "max_bytes", "pooled_bytes", "set_max_bytes", "zeros"]

MIN_POOLED_BYTES = 1 << 20
# Two lookups' rows of the step being run and of the step before (4 x 13 MB for 32768 x 100), with room.
DEFAULT_MAX_BYTES = 128 << 20

_lock = threading.Lock()
_buffers: list[np.ndarray] = []
_max_bytes = DEFAULT_MAX_BYTES


def _references(buffers: list[np.ndarray], index: int) -> int:
    return sys.getrefcount(buffers[index])


# What ``_references`` reads for an array that only its list holds (2 on CPython 3.11: the list and
# getrefcount's argument), probed rather than assumed: interpreters differ in the temporary references
# they count. A buffer is idle at exactly this count and in use above it.
_IDLE_REFERENCES = _references([np.empty(1)], 0)


def _is_idle(index: int) -> bool:
    return _references(_buffers, index) == _IDLE_REFERENCES


def empty(shape: tuple[int, ...], dtype: type | np.dtype) -> np.ndarray:
    """An uninitialised C-contiguous array of ``shape`` and ``dtype``, from the pool when it is large.

    The caller must keep the returned array (or a tensor made with ``torch.from_numpy``) for as long as
    it uses the memory, as with ``np.empty``.
    """
    dtype = np.dtype(dtype)
    nbytes = int(math.prod(shape)) * dtype.itemsize  # np.prod took 4.6 us a call, this 0.2
    if nbytes < MIN_POOLED_BYTES or nbytes > _max_bytes:
        return np.empty(shape, dtype=dtype)
    with _lock:
        idle_other = None
        for index in range(len(_buffers)):
            if _is_idle(index):
                if _buffers[index].nbytes == nbytes:
                    return _buffers[index].view(dtype).reshape(shape)
                idle_other = index
        held = sum(buffer.nbytes for buffer in _buffers)
        if held + nbytes > _max_bytes and idle_other is not None:
            held -= _buffers.pop(idle_other).nbytes  # a size no longer asked for makes room
        buffer = np.empty(nbytes, dtype=np.uint8)
        if held + nbytes <= _max_bytes:
            _buffers.append(buffer)
        return buffer.view(dtype).reshape(shape)


def zeros(shape: tuple[int, ...], dtype: type | np.dtype) -> np.ndarray:
    """``empty`` filled with zeros: a memset of memory already mapped instead of fresh zeroed pages."""
    array = empty(shape, dtype)
    array.fill(0)
    return array


def set_max_bytes(limit: int) -> None:
    """Cap the pooled memory at ``limit`` bytes (0: pool nothing); idle buffers beyond it are dropped."""
    global _max_bytes
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    with _lock:
        _max_bytes = int(limit)
        held = sum(buffer.nbytes for buffer in _buffers)
        index = len(_buffers) - 1
        while held > _max_bytes and index >= 0:
            if _is_idle(index):
                held -= _buffers.pop(index).nbytes
            index -= 1


def max_bytes() -> int:
    return _max_bytes


def pooled_bytes() -> int:
    """Bytes the pool holds, in use or idle."""
    with _lock:
        return sum(buffer.nbytes for buffer in _buffers)


def clear() -> None:
    """Drop every idle buffer (buffers still in use leave the pool and are freed with their last user)."""
    with _lock:
        _buffers.clear()
