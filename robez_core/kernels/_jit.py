"""The compiled code of the kernels (numba): every ``@njit`` function and LLVM intrinsic, and the constants
they read, in this one file, because numba's on-disk cache only notices changes to the file of the
function it compiled. Nothing here checks its arguments: the checked, torch-facing API is
``robez_core.kernels``, the thread and compile-target runtime ``runtime.py``, and callers that prepare
their arguments once call the serial compilations through ``serial.py``.

Every kernel here agrees with the pure-torch reference in ``hashing.py`` bit for bit on forward (same
int64 wrap-around, same floor mod) and within float tolerance on gradients and optimizer updates;
``tests/core/test_kernels.py`` checks both.

Why the kernels are fast (the figures: docs/benchmarks/kernel-constants.md#why-the-kernels-are-fast):

- one hash per (id, chunk) instead of one per value, and no (N, d) int64 index tensor: each chunk's
  ``chunk_size`` contiguous floats are copied straight from ``weight`` into the output row with explicit
  AVX-512 moves, and large batches with streaming stores that skip the read-for-ownership of every
  output line;
- the paper hash reduces ``mod P`` and ``mod (m - Z + 1)`` with float64 reciprocals and exact integer
  corrections instead of 64-bit divisions; that is branch-free, so ids are hashed 128 at a time, chunk
  by chunk, and LLVM runs eight lanes per instruction. Any P outside [2**16, 2**52) (constants imported
  from elsewhere) takes a generic loop with integer divisions;
- that "float64" formulation needs AVX-512 DQ (int64 <-> float64 conversions, 64-bit multiplies in
  vector registers); without it (AVX2: Zen 2/3, older Xeons) LLVM ran it one lane at a time. The
  paper hash (2**16 <= P < 2**31) therefore takes "split32": one reduction per id of ``key mod P`` from
  its two 32-bit halves (int32 -> float64 conversions, quotient rounded by a magic-number add, ``q * P``
  as two 32 x 32 -> 64 multiplies), then per chunk only ``(key mod P) + (chunk term mod P)``. In a
  block where no int64 key sum can wrap (every key at least max |chunk term| inside the int64 limits:
  all but astronomically rare blocks) that sum and the second mod run in float64 (values below 2**32,
  exact), and rows of 4 chunk offsets are stored whole; a block with a key near the limits takes a
  loop that corrects by ``2**64 mod P`` where the sum wrapped. split32 was ahead on AVX2 and AVX-512
  alike, so it is used on both and float64 takes P in [2**31, 2**52) (``runtime._PAPER_FORMULATION``).
  Both are bit-exact; the tests force each on any CPU;
- tables bigger than the caches get the chunks of the row four ahead prefetched, and the dense backward
  does so from an array the size of a core's L2, which training has evicted by then (see
  ``robez_core.kernels._PREFETCH_WRITE_MIN_BYTES``); a gather from a smaller table that reads many times
  its size first reads the table once in order (``_warm_kernel``), so that its random chunk reads find
  it in cache;
- the backward prefetches the (N, d) output gradients it streams through ``_STREAM_AHEAD_FLOATS``
  ahead, so reading them overlaps the adds at random places of the array;
- the row loops of the gather, the lookup and the dense backward are compiled once per common chunk
  size (1, 2, 4, ..., 64), so every chunk is a fixed run of vector moves instead of three run-time
  length loops (see ``_SPECIALISED_CHUNK_SIZES``), and a strided id column (``pairs[:, 0]``) is hashed
  where it lies instead of being copied first;
- one thread runs a serial compilation of each kernel; more threads split ids with ``prange`` (the
  lookups, the hash, the gather and some optimizer steps by running that serial compilation on one
  contiguous part per thread, so numba compiles their loops once: ``_split_kernel``), the dense backward
  uses private per-thread arrays (or range partitions when m is large), and every kernel releases the
  GIL (``nogil=True``).

Wrap-around: numba gives signed int64 arithmetic LLVM's "no signed wrap" flag (overflow is undefined
behaviour to the optimiser), so the hash's wrapping multiply-adds are done in uint64, which wraps by
definition and yields the same two's-complement bits as torch's int64 arithmetic.

Compilation is cached on disk (``cache=True``): the first process compiles each signature once (seconds
for a lookup) and writes the result to ``__pycache__`` next to this file; when that directory is not
writable (a system-wide install), numba uses the user's cache directory (``~/.cache/numba``), and the
``NUMBA_CACHE_DIR`` environment variable overrides both (e.g. a volume in a container whose image was
built read-only). Later processes load the machine code instead, in a fraction of a second
(docs/benchmarks/kernel-constants.md#compilation-cache). The cache is invalidated by a change of this
file (its modification time and size) or of the CPU model, which then recompiles once. A chunk size in
``_SPECIALISED_CHUNK_SIZES`` has compilations of its own, made (or loaded) on its first use.

AVX2 on an AVX-512 machine: ``NUMBA_CPU_NAME=znver2`` with ``NUMBA_CPU_FEATURES`` set to the host's
features minus every AVX-512 one makes numba compile for a Zen 2 (the generated code then has no zmm
register: checked with ``inspect_asm``); the kernel benchmarks' ``--emulate-avx2`` sets that up and
holds torch to its AVX2 kernels too (docs/benchmarks/kernel-constants.md#avx2-emulated).
"""

from __future__ import annotations

import platform
import types
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba import types as numba_types
from numba.extending import intrinsic

from ..hashing import FMIX_C1, FMIX_C2

_MODE_PAPER_FLOAT = 0  # paper hash, 2**16 <= P < 2**52 (the paper's P): branch-free float reduction
_MODE_PAPER_GENERIC = 1  # paper hash with any other P (imported constants): two integer divisions
_MODE_FAST = 2
_MODE_PAPER_SPLIT = 3  # paper hash, 2**16 <= P < 2**31 (the paper's P): 32-bit halves, AVX2-friendly
_FLOAT_PRIME_RANGE = (1 << 16, 1 << 52)
_SPLIT_PRIME_RANGE = (1 << 16, 1 << 31)
# Adding 1.5 * 2**52 to a float64 of magnitude below 2**51 rounds it to an integer that sits in the low
# mantissa bits: bits(q + magic) - bits(magic) is round(q) as an int64, without a float -> int64 convert.
_ROUND_MAGIC = 6755399441055744.0
_ROUND_MAGIC_BITS = np.int64(0x4338000000000000)
_LOW32 = np.uint64(0xFFFFFFFF)
_INT64_MAX = np.int64(np.iinfo(np.int64).max)
_INT64_MIN = np.int64(np.iinfo(np.int64).min)
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
# How many rows ahead the row loops prefetch the table (docs/benchmarks/kernel-constants.md#_prefetch_rows).
_PREFETCH_ROWS = 4
# The backward prefetches the (N, d) output gradients it streams through this far ahead, so reading them
# overlaps its adds at random places of the array (docs/benchmarks/kernel-constants.md#_stream_ahead_floats).
_STREAM_AHEAD_FLOATS = 2048
# The sparse optimizer steps ask for the cache lines of the location this many ahead, at every eighth
# location: their sorted runs of Z land at random places of arrays bigger than the caches and the TLB
# (docs/benchmarks/kernel-constants.md#_step_prefetch_ahead). 0 turns it off.
_STEP_PREFETCH_AHEAD = 64
# The row loops (gather, lookup, dense backward) copy or add a row as d // Z whole chunks and a shorter
# last one. Compiled for one chunk size, those lengths are constants and LLVM unrolls each chunk into a
# few vector moves, where a run-time Z runs three length loops. These sizes (the paper's Z range and its
# double) get their own compilations (``_KernelPair.for_chunk``); any other Z runs the generic one, which
# reads Z at run time (``_CHUNK = 0``). (docs/benchmarks/kernel-constants.md#_specialised_chunk_sizes)
_SPECIALISED_CHUNK_SIZES = frozenset((1, 2, 4, 8, 16, 32, 64))
_CHUNK = 0
# Ids hashed together, chunk by chunk, so each inner loop is a vectorised pass over the block; bigger
# blocks won alone and lost in training (docs/benchmarks/kernel-constants.md#_hash_block).
_HASH_BLOCK = 128
_HASH_BLOCK_U = np.uint64(_HASH_BLOCK)
# Blocks per parallel work item of the hash: they share one scratch (still 16 items at 32768 ids;
# docs/benchmarks/kernel-constants.md#_hash_group).
_HASH_GROUP = 16
_BAG_GROUP = 64
# Below this many values touched a kernel runs in the calling thread: waking the other threads costs more
# than a small batch's whole kernel (docs/benchmarks/kernel-constants.md#_parallel_min_work).
_PARALLEL_MIN_WORK = 1 << 16
_FMIX_C1 = np.uint64(FMIX_C1 & 0xFFFFFFFFFFFFFFFF)
_FMIX_C2 = np.uint64(FMIX_C2 & 0xFFFFFFFFFFFFFFFF)
_SHIFT_33 = np.uint64(33)
_SHIFT_32 = np.uint64(32)
# Above this many array locations per gradient value the coalesce switches from a dense (m,) scratch
# buffer to sorting chunk starts: the dense buffer costs O(m) to clear and scan, the sort O(NC log NC).
_DENSE_COALESCE_FACTOR = 4
_RADIX_BITS = 11
_RADIX_BUCKETS = 1 << _RADIX_BITS
# Up to this many keys an insertion sort beats the radix passes, whose bucket counts alone are 2 x 2048
# values to clear and sum (docs/benchmarks/kernel-constants.md#_insertion_sort_max_keys).
_INSERTION_SORT_MAX_KEYS = 64
# The coalesce sorts each chunk start packed with its position (one uint64 per chunk, one array moved per
# pass) on the start's bits only, in as few passes of at most this many bits as the largest start needs
# (two for m < 2**26: a DLRM push's 53k chunks sorted in 0.24 ms, against 0.46 ms for three passes of
# 11 bits over separate keys and positions), and then reads the starts in order instead of at random
# (docs/benchmarks/dlrm-apply-2026-11-28.md).
_SORT_DIGIT_BITS = 13
# The sorted coalesce reads each chunk's gradient at a random place of the (N, d) rows: it prefetches
# the one this many chunks ahead (docs/benchmarks/dlrm-apply-2026-11-28.md).
_COALESCE_PREFETCH_AHEAD = 16


def _renamed(py_func: Callable[..., Any], suffix: str, constants: dict[str, Any] | None = None) -> Any:
    """A copy of ``py_func`` named ``name + suffix``. numba keys a function's on-disk cache index on its
    qualified name, not on its flags or globals, so each compilation of one function needs a name of its
    own. ``constants`` replace module globals in the copy only (numba compiles globals as constants)."""
    namespace = py_func.__globals__ if not constants else {**py_func.__globals__, **constants}
    copy = types.FunctionType(py_func.__code__, namespace, py_func.__name__ + suffix, py_func.__defaults__)
    copy.__qualname__ = py_func.__qualname__ + suffix
    return copy


class _KernelPair:
    """A kernel compiled twice: serial for one thread, ``parallel=True`` otherwise.

    At one thread the serial copy skips the parallel-region launch (about 1 us a call, which matters for
    the service's small lookups) and is guaranteed to run in the calling thread, as
    ``torch.set_num_threads(1)`` promises.

    A kernel that reads the global ``_CHUNK`` (its row loops, see ``_gather_kernel``) is also compiled per
    chunk size in ``_SPECIALISED_CHUNK_SIZES``: ``for_chunk(Z)`` gives the pair whose copies see
    ``_CHUNK = Z``, compiled (or loaded from the cache) on first use.

    With ``parts`` (a kernel whose rows, bags or locations are independent: see ``_split_kernel``) the
    parallel copy is ``parts`` compiled with ``parallel=True``: a ``prange`` over one contiguous part per
    thread that calls the serial compilation on the part's slices. numba's passes then run once over the
    kernel's loops instead of twice (the parallel copy of a lookup compiled in a quarter of the time:
    docs/benchmarks/kernel-compile-2026-11-28.md), the serial machine code is untouched, and the results
    are the serial ones bit for bit. Such a parallel copy takes one more argument, the number of parts
    (``__call__`` passes ``numba.get_num_threads()``, which compiled code must not call: numba cannot
    cache a function that does, nor one that holds the serial dispatcher in a closure, "uses dynamic
    globals"); it reaches the serial dispatcher as the global ``_serial_part`` of its copy (``_renamed``).
    """

    def __init__(
        self,
        py_func: Callable[..., Any],
        chunk_size: int = 0,
        parts: Callable[..., Any] | None = None,
    ) -> None:
        self._py_func = py_func
        self._parts = parts
        self.chunk_size = chunk_size
        suffix = f"_z{chunk_size}" if chunk_size else ""
        source = _renamed(py_func, suffix, {"_CHUNK": chunk_size}) if chunk_size else py_func
        self.serial = njit(cache=True, nogil=True, error_model="numpy")(_renamed(source, "_serial"))
        if parts is not None:
            source = _renamed(parts, suffix, {"_serial_part": self.serial})
        self.parallel = njit(parallel=True, cache=True, nogil=True, error_model="numpy")(source)
        self.__doc__ = py_func.__doc__
        self._specialised: dict[int, _KernelPair] = {}

    def __call__(self, *args: Any, work: int | None = None) -> Any:
        """Run serially at one thread or when ``work`` (values touched) is below
        ``_PARALLEL_MIN_WORK``: waking the other threads costs more than a small batch's whole kernel."""
        threads = numba.get_num_threads()
        if threads == 1 or (work is not None and work < _PARALLEL_MIN_WORK):
            return self.serial(*args)
        if self._parts is None:
            return self.parallel(*args)
        return self.parallel(*args, threads)

    def for_chunk(self, chunk_size: int) -> _KernelPair:
        """The pair compiled for ``chunk_size`` when it is one of ``_SPECIALISED_CHUNK_SIZES``, else this
        (generic) one; callers pass the same ``chunk_size`` to the kernel itself."""
        if self.chunk_size or chunk_size not in _SPECIALISED_CHUNK_SIZES:
            return self
        pair = self._specialised.get(chunk_size)
        if pair is None:
            pair = self._specialised[chunk_size] = _KernelPair(self._py_func, chunk_size, self._parts)
        return pair


def _parallel_kernel(py_func: Callable[..., Any]) -> _KernelPair:
    return _KernelPair(py_func)


def _split_kernel(parts: Callable[..., Any]) -> Callable[[Callable[..., Any]], _KernelPair]:
    """A ``_KernelPair`` whose parallel copy is ``parts``: a function of the kernel's arguments and a
    number of parts that runs ``_serial_part`` (the kernel's serial compilation) on each part's
    ``_part_bounds`` slices in a ``prange``.
    Valid only where the parts' outputs are disjoint and each row's result does not depend on the others
    (then the parallel copy gives the serial bits)."""
    return lambda py_func: _KernelPair(py_func, parts=parts)


# The global a ``parts`` function calls: each ``_KernelPair`` compiles a copy of it that sees its own
# serial dispatcher here (``_renamed``).
_serial_part: Any = None


# --------------------------------------------------------------------------------------------------
# scalar and vector helpers (inline="always": numba splices them into the loops, so LLVM sees one body)
#
# Positions are uint64: numba wraps negative int64 indices (``a[-1]``), and that per-access sign check
# keeps LLVM from vectorising the loops.


def _float_vector_pointer(
    context: Any, builder: Any, array_type: Any, array: Any, position: Any, width: int
) -> Any:
    array_struct = context.make_array(array_type)(context, builder, array)
    element = builder.gep(array_struct.data, [position])
    return builder.bitcast(element, ir.VectorType(ir.FloatType(), width).as_pointer())


def _is_float32_array(array_type: Any) -> bool:
    return isinstance(array_type, numba_types.Array) and array_type.dtype == numba_types.float32


def _make_vector_copy(width: int) -> Any:
    """An intrinsic ``(dst, d, src, s)``: ``dst[d:d+width] = src[s:s+width]``, one unaligned vector
    load and store.

    LLVM's own vectorisation of a runtime-length copy runs 64 floats per iteration and then a scalar
    remainder, so a 32-float chunk never reached its vector body; explicit vectors copy a chunk in two
    AVX-512 moves (docs/benchmarks/kernel-constants.md#why-the-kernels-are-fast).
    """

    @intrinsic
    def vector_copy(typingctx, dst, dst_position, src, src_position):
        if not (_is_float32_array(dst) and _is_float32_array(src)):
            return None
        signature = numba_types.void(dst, numba_types.uint64, src, numba_types.uint64)

        def codegen(context, builder, sig, args):
            dst_ptr = _float_vector_pointer(context, builder, sig.args[0], args[0], args[1], width)
            src_ptr = _float_vector_pointer(context, builder, sig.args[2], args[2], args[3], width)
            builder.store(builder.load(src_ptr, align=4), dst_ptr, align=4)
            return context.get_dummy_value()

        return signature, codegen

    return vector_copy


def _make_vector_add_scaled(width: int) -> Any:
    """An intrinsic ``(dst, d, src, s, scale)``: ``dst[d:d+width] += scale * src[s:s+width]``."""

    @intrinsic
    def vector_add_scaled(typingctx, dst, dst_position, src, src_position, scale):
        if not (_is_float32_array(dst) and _is_float32_array(src)) or scale != numba_types.float32:
            return None
        signature = numba_types.void(dst, numba_types.uint64, src, numba_types.uint64, numba_types.float32)

        def codegen(context, builder, sig, args):
            dst_ptr = _float_vector_pointer(context, builder, sig.args[0], args[0], args[1], width)
            src_ptr = _float_vector_pointer(context, builder, sig.args[2], args[2], args[3], width)
            vector_type = ir.VectorType(ir.FloatType(), width)
            scale_vector = ir.Constant(vector_type, ir.Undefined)
            for lane in range(width):
                scale_vector = builder.insert_element(
                    scale_vector, args[4], ir.Constant(ir.IntType(32), lane)
                )
            product = builder.fmul(scale_vector, builder.load(src_ptr, align=4))
            builder.store(builder.fadd(builder.load(dst_ptr, align=4), product), dst_ptr, align=4)
            return context.get_dummy_value()

        return signature, codegen

    return vector_add_scaled


@intrinsic
def _streaming_copy_4_intrinsic(typingctx, dst, dst_position, src, src_position):
    """``dst[d:d+4] = src[s:s+4]`` with a non-temporal store; ``dst`` + d must be 16-byte aligned.

    Writing a large batch of rows through the cache first reads every destination line from memory
    (read-for-ownership) and evicts the table; streaming stores skip both
    (docs/benchmarks/kernel-constants.md#_streaming_min_bytes). Callers end with :func:`_store_fence`.
    """
    if not (_is_float32_array(dst) and _is_float32_array(src)):
        return None
    signature = numba_types.void(dst, numba_types.uint64, src, numba_types.uint64)

    def codegen(context, builder, sig, args):
        dst_ptr = _float_vector_pointer(context, builder, sig.args[0], args[0], args[1], 4)
        src_ptr = _float_vector_pointer(context, builder, sig.args[2], args[2], args[3], 4)
        store = builder.store(builder.load(src_ptr, align=4), dst_ptr, align=16)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def _store_fence_intrinsic(typingctx):
    """``sfence``: streaming stores are weakly ordered; make them visible before the block counts as done."""
    signature = numba_types.void()

    def codegen(context, builder, sig, args):
        if _X86:
            fence_type = ir.FunctionType(ir.VoidType(), [])
            builder.call(builder.module.declare_intrinsic("llvm.x86.sse.sfence", fnty=fence_type), [])
        else:
            builder.fence("seq_cst")
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def _float64_bits_intrinsic(typingctx, value):
    """The bits of a float64 as an int64 (a register move; numba has no scalar ``view``)."""
    if value != numba_types.float64:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(64))

    return numba_types.int64(numba_types.float64), codegen


def _make_prefetch(for_write: bool) -> Any:
    """An intrinsic ``(array, position)``: ask the CPU to start loading that element's cache line."""

    @intrinsic
    def prefetch(typingctx, array, position):
        if not isinstance(array, numba_types.Array):
            return None
        signature = numba_types.void(array, numba_types.uint64)

        def codegen(context, builder, sig, args):
            array_struct = context.make_array(sig.args[0])(context, builder, args[0])
            byte_pointer = ir.IntType(8).as_pointer()
            address = builder.bitcast(builder.gep(array_struct.data, [args[1]]), byte_pointer)
            int32 = ir.IntType(32)
            function_type = ir.FunctionType(ir.VoidType(), [byte_pointer, int32, int32, int32])
            intrinsic_function = builder.module.declare_intrinsic(
                "llvm.prefetch", [byte_pointer], function_type
            )
            # (address, read 0 / write 1, locality 3 = keep in all cache levels, data cache)
            flags = [ir.Constant(int32, int(for_write)), ir.Constant(int32, 3), ir.Constant(int32, 1)]
            builder.call(intrinsic_function, [address, *flags])
            return context.get_dummy_value()

        return signature, codegen

    return prefetch


_prefetch_read = _make_prefetch(for_write=False)
_prefetch_write = _make_prefetch(for_write=True)
# Plain aliases typed Any: mypy reads an intrinsic's Python signature (with typingctx) as its call signature.
_streaming_copy_4: Any = _streaming_copy_4_intrinsic
_store_fence: Any = _store_fence_intrinsic
_float64_bits: Any = _float64_bits_intrinsic
_copy_16 = _make_vector_copy(16)
_copy_4 = _make_vector_copy(4)
_add_scaled_16 = _make_vector_add_scaled(16)
_add_scaled_4 = _make_vector_add_scaled(4)
_U1, _U4, _U16 = np.uint64(1), np.uint64(4), np.uint64(16)
_NO_LOCATION = np.uint64(0xFFFFFFFFFFFFFFFF)


@njit(inline="always", cache=True, nogil=True, error_model="numpy")
def _copy(dst, dst_pos, src, src_pos, length):
    d0 = np.uint64(dst_pos)
    s0 = np.uint64(src_pos)
    count = np.uint64(length)
    j = np.uint64(0)
    while j + _U16 <= count:
        _copy_16(dst, d0 + j, src, s0 + j)
        j += _U16
    while j + _U4 <= count:
        _copy_4(dst, d0 + j, src, s0 + j)
        j += _U4
    while j < count:
        dst[d0 + j] = src[s0 + j]
        j += _U1


@njit(inline="always", cache=True, nogil=True, error_model="numpy")
def _copy_chunk(dst, dst_pos, src, src_pos, length, streaming):
    """``_copy``, or with ``streaming`` non-temporal 4-float stores (``dst_pos`` and ``length`` multiples
    of 4 and ``dst`` 16-byte aligned, which the caller checked)."""
    if streaming:
        d0 = np.uint64(dst_pos)
        s0 = np.uint64(src_pos)
        count = np.uint64(length)
        j = np.uint64(0)
        while j < count:
            _streaming_copy_4(dst, d0 + j, src, s0 + j)
            j += _U4
    else:
        _copy(dst, dst_pos, src, src_pos, length)


@njit(inline="always", cache=True, nogil=True, error_model="numpy")
def _prefetch_chunk(array, position, length, for_write):
    """Prefetch every cache line of ``array[position:position + length]`` (a chunk spans two or three).

    Chunk reads (and the backward's read-modify-writes) land at random places of the table; the loops
    below prefetch the chunks of the row ``_PREFETCH_ROWS`` ahead, so several misses are in flight
    at once (docs/benchmarks/kernel-constants.md#_prefetch_rows).
    """
    first = np.uint64(position)
    last = first + np.uint64(length) - _U1
    k = first
    while k < last:
        if for_write:
            _prefetch_write(array, k)
        else:
            _prefetch_read(array, k)
        k += _U16
    if for_write:
        _prefetch_write(array, last)
    else:
        _prefetch_read(array, last)


@njit(inline="always", cache=True, nogil=True, error_model="numpy")
def _step_ahead(locations, k, distance):
    """The location a sparse step at ``k`` prefetches: the one ``distance`` ahead (the caller's
    ``_STEP_PREFETCH_AHEAD``, a compile-time constant; 0: none), at every eighth location, as uint64;
    ``_NO_LOCATION`` when none."""
    ahead = k + distance
    if distance == 0 or (k & 7) != 0 or ahead >= locations.shape[0]:
        return _NO_LOCATION
    return np.uint64(locations[ahead])


@njit(inline="always", cache=True, nogil=True, error_model="numpy")
def _part_bounds(count, unit, parts, part):
    """``(lo, hi)``: part ``part`` of ``parts`` contiguous runs of ``count`` rows, each made of whole runs
    of ``unit`` rows (the last row's run may be short), as even as whole runs allow; empty parts when
    there are more parts than runs. The ``parts`` functions' split (see ``_split_kernel``)."""
    units = (count + unit - 1) // unit
    p = np.int64(part)
    return min(count, units * p // parts * unit), min(count, units * (p + 1) // parts * unit)


@njit(inline="always", cache=True, nogil=True, error_model="numpy")
def _add_scaled(dst, dst_pos, src, src_pos, length, scale):
    d0 = np.uint64(dst_pos)
    s0 = np.uint64(src_pos)
    count = np.uint64(length)
    j = np.uint64(0)
    while j + _U16 <= count:
        _add_scaled_16(dst, d0 + j, src, s0 + j, scale)
        j += _U16
    while j + _U4 <= count:
        _add_scaled_4(dst, d0 + j, src, s0 + j, scale)
        j += _U4
    while j < count:
        dst[d0 + j] += scale * src[s0 + j]
        j += _U1


@njit(inline="always", cache=True, nogil=True, error_model="numpy")
def _add(dst, dst_pos, src, src_pos, length):
    _add_scaled(dst, dst_pos, src, src_pos, length, np.float32(1.0))


@njit(inline="always", cache=True, nogil=True, error_model="numpy")
def _paper_float_offset(h, prime, inv_prime, range_size, inv_range):
    """``(h mod P) mod range`` (floor mods) of the uint64 bit pattern ``h`` read as int64, for
    2**16 <= P < 2**52, branch-free.

    The float quotient of ``h / P`` is within 0.05 of the true one (|h/P| < 2**47, relative error
    < 2**-51), so its truncation is off by at most two and ``h - q * P`` (computed in uint64: the true
    value is small, so wrapping arithmetic gets it exactly) needs at most two corrections.
    ``x < P < 2**52`` is exact in float64, so the second reduction is off by at most one. Every step is a
    plain vector instruction (int64 <-> float64 conversion, multiply, compare), so LLVM runs eight ids per
    AVX-512 step.
    """
    q = np.int64(np.float64(np.int64(h)) * inv_prime)
    x = np.int64(h - np.uint64(q) * np.uint64(prime))  # |x| < 3P: the signed steps below cannot overflow
    x += prime * np.int64(x < 0)
    x += prime * np.int64(x < 0)
    x -= prime * np.int64(x >= prime)
    q = np.int64(np.float64(x) * inv_range)
    r = x - q * range_size
    r += range_size * np.int64(r < 0)
    r -= range_size * np.int64(r >= range_size)
    return r


@njit(inline="always", cache=True, nogil=True, error_model="numpy")
def _split_mod_prime(h, prime, prime_low, inv_prime):
    """``h mod P`` (floor mod) of the uint64 bit pattern ``h`` read as int64, for 2**16 <= P < 2**31,
    with only the vector instructions AVX2 has.

    AVX2 has no int64 <-> float64 conversion and no 64-bit multiply, so ``_paper_float_offset`` runs
    scalar there. Here ``h`` is split into its signed high half and its low half, each converted from
    32 bits; ``f = hi * 2**32 + 2 * (lo >> 1)`` is within 2**10 + 1 of ``h``, so ``f / P`` is within
    0.1 of the true quotient (|h/P| < 2**47). The quotient is rounded to an integer by the magic-number
    addition (no float -> int64 conversion) and ``x = h - q * P`` computed in uint64 is exact, in
    (-0.6 P, 0.6 P): one correction puts it in [0, P). ``prime_low`` is P as a uint64 with a known-zero
    high half, so ``q * P`` is two 32 x 32 -> 64 multiplies (``vpmuludq``).
    """
    s = np.int64(h)
    high = np.float64(np.int32(s >> np.int64(32)))
    low_half = np.float64(np.int32((h & _LOW32) >> _U1))
    f = high * 4294967296.0 + low_half * 2.0
    q = _float64_bits(f * inv_prime + _ROUND_MAGIC) - _ROUND_MAGIC_BITS
    x = np.int64(h - np.uint64(q) * prime_low)
    return x + prime if x < 0 else x


@njit(inline="always", cache=True, nogil=True, error_model="numpy")
def _small_mod(x, range_small, inv_range_small):
    """``x mod range`` for 0 <= x < 2**31 in float64 (exact: every value stays below 2**53), as int64.

    ``range_small`` is ``min(range, P)``: ``x < P``, so ``x mod range == x mod min(range, P)``, and the
    divisor fits 31 bits too. The floor of the float quotient is off by at most one: one correction
    each way. Conversions are int32 <-> float64, which AVX2 has.
    """
    xf = np.float64(np.int32(x))
    rf = xf - np.floor(xf * inv_range_small) * range_small
    rf = rf + range_small if rf < 0.0 else rf
    rf = rf - range_small if rf >= range_small else rf
    return np.int64(np.int32(rf))


@njit(inline="always", cache=True, nogil=True, error_model="numpy")
def _fast_offset(h, range_size_u):
    u = h
    u ^= u >> _SHIFT_33
    u *= _FMIX_C1
    u ^= u >> _SHIFT_33
    u *= _FMIX_C2
    u ^= u >> _SHIFT_33
    return np.int64(((u >> _SHIFT_32) * range_size_u) >> _SHIFT_32)


@njit(inline="always", cache=True, nogil=True, error_model="numpy")
def _store_columns4(columns4, n, out, out_pos):
    """``out[out_pos + 4 j + c] = columns4[c * _HASH_BLOCK + j]`` for j < n, c < 4: with the stride a
    constant LLVM stores the rows as vectors (a 4 x 4 transpose) instead of one element at a time."""
    for j in range(n):
        position = out_pos + np.uint64(j) * _U4
        out[position] = np.int64(columns4[j])
        out[position + _U1] = np.int64(columns4[_HASH_BLOCK_U + j])
        out[position + np.uint64(2)] = np.int64(columns4[np.uint64(2) * _HASH_BLOCK_U + j])
        out[position + np.uint64(3)] = np.int64(columns4[np.uint64(3) * _HASH_BLOCK_U + j])


@njit(inline="always", cache=True, nogil=True, error_model="numpy")
def _hash_block(
    ids, begin, count, val_offset, num_chunks, mode, random_numbers, range_size, scratch, out, out_pos
):
    """Chunk offsets of ``ids[begin:begin + count]`` into ``out[out_pos + j * num_chunks + c]``.

    ``count <= _HASH_BLOCK``; ``scratch`` is uint64 (4, _HASH_BLOCK). Chunks are the outer loop and ids
    the inner one, so each inner loop is a straight vectorisable pass over the block.

    The key arithmetic (``(x + val_offset) * R[3] + c * R[2] + R[1]``) runs on uint64: numba marks signed
    integer arithmetic "no signed wrap" for LLVM, which makes an int64 overflow undefined behaviour,
    whereas unsigned arithmetic wraps by definition, and two's complement gives the same bits.
    """
    prime = random_numbers[0]
    r1 = np.uint64(random_numbers[1])
    r2 = np.uint64(random_numbers[2])
    multiplier = np.uint64(random_numbers[3] | 1 if mode == _MODE_FAST else random_numbers[3])
    offset_u = np.uint64(val_offset)
    inv_prime = 1.0 / prime
    inv_range = 1.0 / range_size
    range_size_u = np.uint64(range_size)
    prime_low = np.uint64(prime) & _LOW32
    range_small = np.float64(min(range_size, prime))
    inv_range_small = 1.0 / range_small
    key_terms = scratch[0]
    column = scratch[1]
    first = np.uint64(begin)
    n = np.uint64(count)
    for j in range(n):
        key_terms[j] = (np.uint64(ids[first + j]) + offset_u) * multiplier
    key_mods = scratch[2]
    wrap_mod = np.int64(0)  # 2**64 mod P
    key_modf = scratch[3].view(np.float64)
    columns4 = scratch[1:3].reshape(-1).view(np.int32)  # four int32 columns of _HASH_BLOCK
    no_wrap = False
    if mode == _MODE_PAPER_SPLIT:
        key_min = _INT64_MAX
        key_max = _INT64_MIN
        for j in range(n):
            key_mod = _split_mod_prime(key_terms[j], prime, prime_low, inv_prime)
            key_mods[j] = np.uint64(key_mod)
            key_modf[j] = np.float64(np.int32(key_mod))
            key_signed = np.int64(key_terms[j])
            key_min = min(key_min, key_signed)
            key_max = max(key_max, key_signed)
        prime_u = np.uint64(prime)
        wrap_mod = np.int64(((np.uint64(1) << np.uint64(63)) % prime_u * np.uint64(2)) % prime_u)
        # No K + T of this block wraps when every K lies in [INT64_MIN - min T, INT64_MAX - max T]
        # (T over the chunks, clamped at 0): true for any block but the rare one with a key within
        # max |T| of the int64 limits, which takes the loop with per-id wrap corrections below.
        term_min = np.int64(0)
        term_max = np.int64(0)
        for c in range(num_chunks):
            term = np.int64(np.uint64(c) * r2 + r1)
            term_min = min(term_min, term)
            term_max = max(term_max, term)
        no_wrap = bool(key_min >= _INT64_MIN - term_min and key_max <= _INT64_MAX - term_max)
    prime_f = np.float64(prime)
    stride = np.uint64(num_chunks)
    for c in range(num_chunks):
        chunk_term = np.uint64(c) * r2 + r1
        if mode == _MODE_PAPER_SPLIT and no_wrap:
            # No wrap in this block: h mod P = ((K mod P) + (T mod P)) mod P, all in float64 (values
            # below 2**32, exact), four lanes per AVX2 instruction and no 64-bit integer compare. The
            # sum is below 2P: one subtraction of P. Then mod range_small: x * (1 / range) is within
            # 2**-20 / range of x / range (x < 2**31), so its floor is the true quotient or, only where
            # x / range is an integer, one less: one correction.
            # (docs/benchmarks/kernel-constants.md#_paper_formulation)
            chunk_mod_f = np.float64(np.int64(chunk_term) % prime)
            for j in range(n):
                xf = key_modf[j] + chunk_mod_f
                xf = xf - prime_f if xf >= prime_f else xf
                rf = xf - np.floor(xf * inv_range_small) * range_small
                rf = rf - range_small if rf >= range_small else rf
                columns4[np.uint64(c % 4) * _HASH_BLOCK_U + j] = np.int32(rf)
            if c % 4 == 3 and num_chunks == 4:
                _store_columns4(columns4, n, out, np.uint64(out_pos))
            elif num_chunks != 4:
                base = np.uint64(out_pos) + np.uint64(c)
                first_column = np.uint64(c % 4) * _HASH_BLOCK_U
                for j in range(n):
                    out[base + j * stride] = np.int64(columns4[first_column + j])
            continue
        if mode == _MODE_PAPER_FLOAT:
            for j in range(n):
                column[j] = np.uint64(
                    _paper_float_offset(key_terms[j] + chunk_term, prime, inv_prime, range_size, inv_range)
                )
        elif mode == _MODE_PAPER_SPLIT:
            # h = K + T wrapped, so h mod P = (K mod P) + (T mod P), minus 2**64 mod P where the int64
            # sum wrapped upwards (plus it where it wrapped downwards): one full reduction per id
            # above, an add and three compares per chunk here. The sum wrapped iff it moved the
            # wrong way: (h < K) differs from (T < 0).
            chunk_signed = np.int64(chunk_term)
            chunk_mod = chunk_signed % prime
            negative = chunk_signed < 0
            wrap_fix = wrap_mod if negative else (prime - wrap_mod) % prime
            # two copies of the loop, so the wrap test is a single compare
            if negative:
                for j in range(n):
                    wrapped = np.int64(key_terms[j] + chunk_term) > np.int64(key_terms[j])
                    x = np.int64(key_mods[j]) + chunk_mod + (wrap_fix if wrapped else 0)
                    x = x - prime if x >= prime else x
                    x = x - prime if x >= prime else x
                    column[j] = np.uint64(_small_mod(x, range_small, inv_range_small))
            else:
                for j in range(n):
                    wrapped = np.int64(key_terms[j] + chunk_term) < np.int64(key_terms[j])
                    x = np.int64(key_mods[j]) + chunk_mod + (wrap_fix if wrapped else 0)
                    x = x - prime if x >= prime else x
                    x = x - prime if x >= prime else x
                    column[j] = np.uint64(_small_mod(x, range_small, inv_range_small))
        elif mode == _MODE_FAST:
            for j in range(n):
                column[j] = np.uint64(_fast_offset(key_terms[j] + chunk_term, range_size_u))
        else:
            for j in range(n):
                # floor mods of the int64 reading of the wrapped key; neither can overflow (P > 0)
                column[j] = np.uint64((np.int64(key_terms[j] + chunk_term) % prime) % range_size)
        base = np.uint64(out_pos) + np.uint64(c)
        for j in range(n):
            out[base + j * stride] = np.int64(column[j])


# --------------------------------------------------------------------------------------------------
# forward


def _chunk_offsets_parts(ids, val_offset, num_chunks, mode, random_numbers, range_size, out, parts):
    # The parallel copy of the kernel below (_split_kernel): each thread hashes whole blocks of its ids.
    num_ids = ids.shape[0]
    for part in prange(parts):
        lo, hi = _part_bounds(num_ids, _HASH_BLOCK, parts, part)
        _serial_part(ids[lo:hi], val_offset, num_chunks, mode, random_numbers, range_size, out[lo:hi])


@_split_kernel(_chunk_offsets_parts)
def _chunk_offsets_kernel(ids, val_offset, num_chunks, mode, random_numbers, range_size, out):
    num_ids = ids.shape[0]
    flat = out.reshape(-1)
    num_blocks = (num_ids + _HASH_BLOCK - 1) // _HASH_BLOCK
    # One scratch per group of blocks, not per block (256 allocations for 32768 ids): see _HASH_GROUP
    for group in prange((num_blocks + _HASH_GROUP - 1) // _HASH_GROUP):
        scratch = np.empty((4, _HASH_BLOCK), dtype=np.uint64)
        for block in range(group * _HASH_GROUP, min(num_blocks, (group + 1) * _HASH_GROUP)):
            begin = block * _HASH_BLOCK
            count = min(_HASH_BLOCK, num_ids - begin)
            _hash_block(
                ids,
                begin,
                count,
                val_offset,
                num_chunks,
                mode,
                random_numbers,
                range_size,
                scratch,
                flat,
                begin * num_chunks,
            )


def _gather_parts(weight, offsets, embedding_dim, chunk_size, streaming, prefetch, out, parts):
    # The parallel copy of the kernel below (_split_kernel): each thread copies its rows.
    for part in prange(parts):
        lo, hi = _part_bounds(offsets.shape[0], _HASH_BLOCK, parts, part)
        _serial_part(weight, offsets[lo:hi], embedding_dim, chunk_size, streaming, prefetch, out[lo:hi])


@_split_kernel(_gather_parts)
def _gather_kernel(weight, offsets, embedding_dim, chunk_size, streaming, prefetch, out):
    # A row is d // Z whole chunks, then a shorter last one: constant lengths in a compilation for one
    # chunk size (``_CHUNK``). The row loops are written out in each kernel: a helper taking the arrays
    # kept numba's reference counting in the loop (docs/benchmarks/kernel-constants.md#_chunk).
    chunk = _CHUNK if _CHUNK else chunk_size
    whole = embedding_dim // chunk
    rest = embedding_dim - whole * chunk
    num_rows, num_chunks = offsets.shape
    flat = out.reshape(-1)
    for block in prange((num_rows + _HASH_BLOCK - 1) // _HASH_BLOCK):
        begin = block * _HASH_BLOCK
        for n in range(begin, min(begin + _HASH_BLOCK, num_rows)):
            if prefetch and n + _PREFETCH_ROWS < num_rows:
                for c in range(num_chunks):
                    length = min(chunk, embedding_dim - c * chunk)
                    _prefetch_chunk(weight, offsets[n + _PREFETCH_ROWS, c], length, False)
            base = n * embedding_dim
            for c in range(whole):
                _copy_chunk(flat, base + c * chunk, weight, offsets[n, c], chunk, streaming)
            if rest:
                _copy_chunk(flat, base + whole * chunk, weight, offsets[n, whole], rest, streaming)
        if streaming:
            _store_fence()


def _lookup_parts(
    weight, ids, val_offset, embedding_dim, chunk_size, mode, random_numbers, streaming, prefetch, out, parts
):
    # The parallel copy of the kernel below (_split_kernel): each thread hashes and copies whole blocks
    # of its ids' rows.
    num_ids = ids.shape[0]
    for part in prange(parts):
        lo, hi = _part_bounds(num_ids, _HASH_BLOCK, parts, part)
        _serial_part(
            weight,
            ids[lo:hi],
            val_offset,
            embedding_dim,
            chunk_size,
            mode,
            random_numbers,
            streaming,
            prefetch,
            out[lo:hi],
        )


@_split_kernel(_lookup_parts)
def _lookup_kernel(
    weight, ids, val_offset, embedding_dim, chunk_size, mode, random_numbers, streaming, prefetch, out
):
    chunk = _CHUNK if _CHUNK else chunk_size  # see _gather_kernel
    whole = embedding_dim // chunk
    rest = embedding_dim - whole * chunk
    num_chunks = (embedding_dim + chunk - 1) // chunk
    range_size = weight.shape[0] - chunk + 1
    num_ids = ids.shape[0]
    flat = out.reshape(-1)
    num_blocks = (num_ids + _HASH_BLOCK - 1) // _HASH_BLOCK
    for group in prange((num_blocks + _HASH_GROUP - 1) // _HASH_GROUP):
        scratch = np.empty((4, _HASH_BLOCK), dtype=np.uint64)
        offsets = np.empty(_HASH_BLOCK * num_chunks, dtype=np.int64)
        for block in range(group * _HASH_GROUP, min(num_blocks, (group + 1) * _HASH_GROUP)):
            begin = block * _HASH_BLOCK
            count = min(_HASH_BLOCK, num_ids - begin)
            _hash_block(
                ids,
                begin,
                count,
                val_offset,
                num_chunks,
                mode,
                random_numbers,
                range_size,
                scratch,
                offsets,
                0,
            )
            for j in range(count):
                if prefetch and j + _PREFETCH_ROWS < count:
                    for c in range(num_chunks):
                        length = min(chunk, embedding_dim - c * chunk)
                        ahead = offsets[(j + _PREFETCH_ROWS) * num_chunks + c]
                        _prefetch_chunk(weight, ahead, length, False)
                base = (begin + j) * embedding_dim
                first = j * num_chunks
                for c in range(whole):
                    _copy_chunk(flat, base + c * chunk, weight, offsets[first + c], chunk, streaming)
                if rest:
                    _copy_chunk(flat, base + whole * chunk, weight, offsets[first + whole], rest, streaming)
        if streaming:
            _store_fence()


def _lookup_bag_parts(
    weight,
    ids,
    bag_offsets,
    per_sample_weights,
    has_weights,
    mean,
    val_offset,
    embedding_dim,
    chunk_size,
    mode,
    random_numbers,
    prefetch,
    out,
    parts,
):
    # The parallel copy of the kernel below (_split_kernel): each thread pools its bags. Their ids are
    # found through the offsets, so a part keeps ``ids`` from 0 (and ``per_sample_weights`` whole) and
    # ends it where the next part's first bag starts: its last bag runs to the end of its ids.
    num_bags = bag_offsets.shape[0]
    for part in prange(parts):
        lo, hi = _part_bounds(num_bags, 1, parts, part)
        end = bag_offsets[hi] if hi < num_bags else ids.shape[0]
        _serial_part(
            weight,
            ids[:end],
            bag_offsets[lo:hi],
            per_sample_weights,
            has_weights,
            mean,
            val_offset,
            embedding_dim,
            chunk_size,
            mode,
            random_numbers,
            prefetch,
            out[lo:hi],
        )


@_split_kernel(_lookup_bag_parts)
def _lookup_bag_kernel(
    weight,
    ids,
    bag_offsets,
    per_sample_weights,
    has_weights,
    mean,
    val_offset,
    embedding_dim,
    chunk_size,
    mode,
    random_numbers,
    prefetch,
    out,
):
    num_chunks = (embedding_dim + chunk_size - 1) // chunk_size
    range_size = weight.shape[0] - chunk_size + 1
    num_bags = bag_offsets.shape[0]
    num_ids = ids.shape[0]
    flat = out.reshape(-1)
    # Bags are taken a group at a time so the hashing scratch is allocated per group, not per bag.
    for group in prange((num_bags + _BAG_GROUP - 1) // _BAG_GROUP):
        scratch = np.empty((4, _HASH_BLOCK), dtype=np.uint64)
        offsets = np.empty(_HASH_BLOCK * num_chunks, dtype=np.int64)
        for b in range(group * _BAG_GROUP, min(num_bags, (group + 1) * _BAG_GROUP)):
            begin = bag_offsets[b]
            end = bag_offsets[b + 1] if b + 1 < num_bags else num_ids
            base = b * embedding_dim
            for j in range(embedding_dim):
                flat[base + j] = 0.0
            for block_begin in range(begin, end, _HASH_BLOCK):
                count = min(_HASH_BLOCK, end - block_begin)
                _hash_block(
                    ids,
                    block_begin,
                    count,
                    val_offset,
                    num_chunks,
                    mode,
                    random_numbers,
                    range_size,
                    scratch,
                    offsets,
                    0,
                )
                for j in range(count):
                    if prefetch and j + _PREFETCH_ROWS < count:
                        for c in range(num_chunks):
                            length = min(chunk_size, embedding_dim - c * chunk_size)
                            ahead = offsets[(j + _PREFETCH_ROWS) * num_chunks + c]
                            _prefetch_chunk(weight, ahead, length, False)
                    scale = per_sample_weights[block_begin + j] if has_weights else np.float32(1.0)
                    for c in range(num_chunks):
                        start = c * chunk_size
                        src = offsets[j * num_chunks + c]
                        _add_scaled(
                            flat, base + start, weight, src, min(chunk_size, embedding_dim - start), scale
                        )
            if mean and end > begin:
                inv_count = np.float32(1.0) / np.float32(end - begin)
                for j in range(embedding_dim):
                    flat[base + j] *= inv_count


@njit(cache=True, nogil=True, error_model="numpy")
def _warm_kernel(weight):
    """Read one float of every cache line of ``weight`` in order; returns their sum so that the loads
    are not optimised away (the caller drops it)."""
    total = np.float32(0.0)
    position = np.uint64(0)
    size = np.uint64(weight.shape[0])
    while position < size:
        total += weight[position]
        position += _U16
    return total


# --------------------------------------------------------------------------------------------------
# backward


@njit(inline="always", cache=True, nogil=True, error_model="numpy")
def _prefetch_stream(array, next_position, end_position):
    """Prefetch ``array[next_position:end_position]`` line by line (16 floats a line); returns the new
    ``next_position``. Callers stream through ``array`` and keep ``end_position`` ``_STREAM_AHEAD_FLOATS``
    ahead of their reads."""
    position = np.uint64(next_position)
    end = min(np.uint64(end_position), np.uint64(array.shape[0]))
    while position < end:
        _prefetch_read(array, position)
        position += _U16
    return position


@_parallel_kernel
def _scatter_serial_kernel(grad_rows, offsets, embedding_dim, chunk_size, prefetch, out):
    # One thread only: called through ``.serial``. Row loops as in ``_gather_kernel``, same chunk order.
    chunk = _CHUNK if _CHUNK else chunk_size
    whole = embedding_dim // chunk
    rest = embedding_dim - whole * chunk
    num_rows, num_chunks = offsets.shape
    grads = grad_rows.reshape(-1)
    streamed = np.uint64(0)
    for n in range(num_rows):
        streamed = _prefetch_stream(grads, streamed, (n + 1) * embedding_dim + _STREAM_AHEAD_FLOATS)
        if prefetch and n + _PREFETCH_ROWS < num_rows:
            for c in range(num_chunks):
                length = min(chunk, embedding_dim - c * chunk)
                _prefetch_chunk(out, offsets[n + _PREFETCH_ROWS, c], length, True)
        base = n * embedding_dim
        for c in range(whole):
            _add(out, offsets[n, c], grads, base + c * chunk, chunk)
        if rest:
            _add(out, offsets[n, whole], grads, base + whole * chunk, rest)


@_parallel_kernel
def _scatter_private_kernel(grad_rows, offsets, embedding_dim, chunk_size, out, num_parts):
    # Small arrays: each part adds its share of rows into a private copy of ``out``, then the copies are
    # summed location by location. No two threads write one location and the sum order is fixed.
    # Called through ``.parallel``.
    chunk = _CHUNK if _CHUNK else chunk_size  # row loops as in _gather_kernel
    whole = embedding_dim // chunk
    rest = embedding_dim - whole * chunk
    memory_size = out.shape[0]
    num_rows = offsets.shape[0]
    grads = grad_rows.reshape(-1)
    partial = np.zeros((num_parts, memory_size), dtype=np.float32)
    for part in prange(num_parts):
        mine = partial[part]
        first_row = num_rows * part // num_parts
        streamed = np.uint64(first_row * embedding_dim)
        for n in range(first_row, num_rows * (part + 1) // num_parts):
            streamed = _prefetch_stream(grads, streamed, (n + 1) * embedding_dim + _STREAM_AHEAD_FLOATS)
            base = n * embedding_dim
            for c in range(whole):
                _add(mine, offsets[n, c], grads, base + c * chunk, chunk)
            if rest:
                _add(mine, offsets[n, whole], grads, base + whole * chunk, rest)
    block = 4096
    for first in prange((memory_size + block - 1) // block):
        for i in range(first * block, min(memory_size, (first + 1) * block)):
            total = out[i]
            for part in range(num_parts):
                total += partial[part, i]
            out[i] = total


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _scatter_partitioned_kernel(grad_rows, offsets, embedding_dim, chunk_size, out, num_parts):
    # Large arrays: part p owns locations [m * p / P, m * (p + 1) / P). Chunks are bucketed by the parts
    # they touch (a chunk on a boundary goes to both, clipped), then each part adds its own bucket.
    memory_size = out.shape[0]
    num_rows, num_chunks = offsets.shape
    grads = grad_rows.reshape(-1)
    counts = np.zeros(num_parts + 1, dtype=np.int64)
    for n in range(num_rows):
        for c in range(num_chunks):
            dst = offsets[n, c]
            length = min(chunk_size, embedding_dim - c * chunk_size)
            for part in range(
                dst * num_parts // memory_size, (dst + length - 1) * num_parts // memory_size + 1
            ):
                counts[part + 1] += 1
    for part in range(num_parts):
        counts[part + 1] += counts[part]
    bucket = np.empty(counts[num_parts], dtype=np.int64)
    fill = counts[:num_parts].copy()
    for n in range(num_rows):
        for c in range(num_chunks):
            dst = offsets[n, c]
            length = min(chunk_size, embedding_dim - c * chunk_size)
            for part in range(
                dst * num_parts // memory_size, (dst + length - 1) * num_parts // memory_size + 1
            ):
                bucket[fill[part]] = n * num_chunks + c
                fill[part] += 1
    for part in prange(num_parts):
        lo = memory_size * part // num_parts
        hi = memory_size * (part + 1) // num_parts
        for k in range(counts[part], counts[part + 1]):
            n = bucket[k] // num_chunks
            c = bucket[k] % num_chunks
            start = c * chunk_size
            dst = offsets[n, c]
            j_begin = max(0, lo - dst)
            j_end = min(min(chunk_size, embedding_dim - start), hi - dst)
            if j_end > j_begin:
                _add(out, dst + j_begin, grads, n * embedding_dim + start + j_begin, j_end - j_begin)


@njit(cache=True, nogil=True, error_model="numpy")
def _coalesce_dense_kernel(
    grad_rows, offsets, embedding_dim, chunk_size, memory_size, values_dense, coverage
):
    # values_dense (>= m,) float32 and coverage (>= m + 1,) int32 are scratch, possibly reused: zero them.
    # A location is touched iff some chunk covers it: mark +1 at chunk start, -1 past its end, prefix-sum.
    values_dense[:memory_size] = 0.0
    coverage[: memory_size + 1] = 0
    num_rows, num_chunks = offsets.shape
    grads = grad_rows.reshape(-1)
    streamed = np.uint64(0)
    for n in range(num_rows):
        streamed = _prefetch_stream(grads, streamed, (n + 1) * embedding_dim + _STREAM_AHEAD_FLOATS)
        for c in range(num_chunks):
            start = c * chunk_size
            length = min(chunk_size, embedding_dim - start)
            dst = offsets[n, c]
            _add(values_dense, dst, grads, n * embedding_dim + start, length)
            coverage[dst] += 1
            coverage[dst + length] -= 1
    count = 0
    depth = 0
    for i in range(memory_size):
        depth += coverage[i]
        count += depth > 0
    locations = np.empty(count, dtype=np.int64)
    values = np.empty(count, dtype=np.float32)
    k = 0
    depth = 0
    for i in range(memory_size):
        depth += coverage[i]
        if depth > 0:
            locations[k] = i
            values[k] = values_dense[i]
            k += 1
    return locations, values


@njit(cache=True, nogil=True, error_model="numpy")
def _radix_argsort(keys):
    """Stable argsort of non-negative int64 ``keys``: LSD radix, 11 bits a pass, only as many passes as
    the largest key needs (three for m < 2**33), several times faster than ``np.argsort`` here; an
    insertion sort for a few keys."""
    n = keys.shape[0]
    order = np.arange(n)
    if n <= _INSERTION_SORT_MAX_KEYS:  # stable too: an equal key never moves past another
        for i in range(1, n):
            item = order[i]
            key = keys[item]
            j = i - 1
            while j >= 0 and keys[order[j]] > key:
                order[j + 1] = order[j]
                j -= 1
            order[j + 1] = item
        return order
    max_key = keys.max()
    current_keys = keys.copy()
    next_keys = np.empty_like(keys)
    next_order = np.empty_like(order)
    counts = np.empty(_RADIX_BUCKETS, dtype=np.int64)
    shift = np.uint64(0)
    mask = np.uint64(_RADIX_BUCKETS - 1)
    while shift < np.uint64(64) and (np.uint64(max_key) >> shift) > np.uint64(0):
        counts[:] = 0
        for i in range(n):
            counts[(np.uint64(current_keys[i]) >> shift) & mask] += 1
        total = 0
        for b in range(_RADIX_BUCKETS):
            count = counts[b]
            counts[b] = total
            total += count
        for i in range(n):
            bucket = (np.uint64(current_keys[i]) >> shift) & mask
            position = counts[bucket]
            counts[bucket] = position + 1
            next_keys[position] = current_keys[i]
            next_order[position] = order[i]
        current_keys, next_keys = next_keys, current_keys
        order, next_order = next_order, order
        shift += np.uint64(_RADIX_BITS)
    return order


@njit(inline="always", cache=True, nogil=True, error_model="numpy")
def _bit_length(value):
    """Bits of a non-negative int64 (0 for 0)."""
    bits = 0
    x = np.uint64(value)
    while x > np.uint64(0):
        x >>= np.uint64(1)
        bits += 1
    return bits


@njit(cache=True, nogil=True, error_model="numpy")
def _sorted_chunk_starts(keys):
    """``(keys[order], order)`` with ``order`` the stable argsort of non-negative int64 ``keys``
    (``_radix_argsort``'s, bit for bit): each key packed with its position into one uint64 and LSD
    radix-sorted on the key's bits only (``_SORT_DIGIT_BITS`` a pass), positions already in order, so
    ties keep it. Keys too wide to pack with their positions, and a few keys, take ``_radix_argsort``."""
    n = keys.shape[0]
    index_bits = _bit_length(n - 1)
    key_bits = _bit_length(keys.max()) if n > _INSERTION_SORT_MAX_KEYS else 0
    if n <= _INSERTION_SORT_MAX_KEYS or index_bits + key_bits > 64:
        order = _radix_argsort(keys)
        sorted_keys = np.empty(n, dtype=np.int64)
        for k in range(n):
            sorted_keys[k] = keys[order[k]]
        return sorted_keys, order
    shift = np.uint64(index_bits)
    packed = np.empty(n, dtype=np.uint64)
    for i in range(n):
        packed[i] = (np.uint64(keys[i]) << shift) | np.uint64(i)
    spare = np.empty(n, dtype=np.uint64)
    passes = (key_bits + _SORT_DIGIT_BITS - 1) // _SORT_DIGIT_BITS
    digit_bits = (key_bits + passes - 1) // passes if passes else 1
    counts = np.empty(1 << digit_bits, dtype=np.int64)
    mask = np.uint64((1 << digit_bits) - 1)
    for _ in range(passes):
        counts[:] = 0
        for i in range(n):
            counts[(packed[i] >> shift) & mask] += 1
        total = 0
        for b in range(counts.shape[0]):
            count = counts[b]
            counts[b] = total
            total += count
        for i in range(n):
            value = packed[i]
            bucket = (value >> shift) & mask
            position = counts[bucket]
            counts[bucket] = position + 1
            spare[position] = value
        packed, spare = spare, packed
        shift += np.uint64(digit_bits)
    index_mask = (np.uint64(1) << np.uint64(index_bits)) - np.uint64(1)
    sorted_keys = np.empty(n, dtype=np.int64)
    order = np.empty(n, dtype=np.int64)
    for k in range(n):
        value = packed[k]
        sorted_keys[k] = np.int64(value >> np.uint64(index_bits))
        order[k] = np.int64(value & index_mask)
    return sorted_keys, order


@njit(cache=True, nogil=True, error_model="numpy")
def _coalesce_sorted_kernel(grad_rows, offsets, embedding_dim, chunk_size):
    # Sort chunk starts; overlapping or touching chunks merge into runs that cover a contiguous range,
    # so the output is the union of those ranges, each filled from a small zeroed segment.
    num_chunks = offsets.shape[1]
    flat_offsets = offsets.reshape(-1)
    starts, order = _sorted_chunk_starts(flat_offsets)
    grads = grad_rows.reshape(-1)
    count = order.shape[0]
    total = 0
    run_end = np.int64(-1)
    for k in range(count):
        length = min(chunk_size, embedding_dim - (order[k] % num_chunks) * chunk_size)
        dst = starts[k]
        end = dst + length
        if dst > run_end:
            total += length
            run_end = end
        elif end > run_end:
            total += end - run_end
            run_end = end
    locations = np.empty(total, dtype=np.int64)
    values = np.zeros(total, dtype=np.float32)
    base = 0  # output index of the current run's first location
    run_start = np.int64(0)
    run_end = np.int64(-1)
    filled = 0
    for k in range(count):
        if k + _COALESCE_PREFETCH_AHEAD < count:
            ahead = order[k + _COALESCE_PREFETCH_AHEAD]
            _prefetch_read(
                grads, np.uint64((ahead // num_chunks) * embedding_dim + (ahead % num_chunks) * chunk_size)
            )
        idx = order[k]
        n = idx // num_chunks
        start = (idx % num_chunks) * chunk_size
        length = min(chunk_size, embedding_dim - start)
        dst = starts[k]
        end = dst + length
        if dst > run_end:
            base = filled
            run_start = dst
            run_end = dst
        if end > run_end:
            for j in range(end - run_end):
                locations[filled + j] = run_end + j
            filled += end - run_end
            run_end = end
        _add(values, base + (dst - run_start), grads, n * embedding_dim + start, length)
    return locations, values


# --------------------------------------------------------------------------------------------------
# optimizer steps (locations are unique, so the loops run in parallel without races)


# The optimizers' float32 arithmetic at one location, shared by the steps, their dry runs and the checked
# steps below (inlined: the same machine code as written out in each), so that the three agree bit for bit.


@njit(inline="always", cache=True, nogil=True, error_model="numpy")
def _sgd_new(w, g, lr):
    return w - lr * g


@njit(inline="always", cache=True, nogil=True, error_model="numpy")
def _adagrad_new(w, s, g, lr, eps):
    """(new weight, new sum)."""
    s = s + g * g
    return w - lr * (g / (np.sqrt(s) + eps)), s


@njit(inline="always", cache=True, nogil=True, error_model="numpy")
def _adam_new(w, m, v, g, one_minus_beta1, one_minus_beta2, eps, step_size):
    """(new weight, new exp_avg, new exp_avg_sq)."""
    m = m + (g - m) * one_minus_beta1
    v = v + (g * g - v) * one_minus_beta2
    return w - step_size * (m / (np.sqrt(v) + eps)), m, v


# The parallel copies of the sgd and adagrad steps and of the checked adam step (_split_kernel): each
# thread steps its run of the (unique) locations; runs of whole eighths keep the serial prefetch pattern.
# The adam step, the dry runs, the sgd and adagrad checked steps and the restore keep ``prange`` copies
# of their own: the adam step and its dry run measured 5-10% slower split at 2 threads, the others were
# not measured (docs/benchmarks/kernel-compile-2026-11-28.md).
_STEP_PART_UNIT = 8


def _sgd_parts(weight, locations, values, lr, parts):
    for part in prange(parts):
        lo, hi = _part_bounds(locations.shape[0], _STEP_PART_UNIT, parts, part)
        _serial_part(weight, locations[lo:hi], values[lo:hi], lr)


def _adagrad_parts(weight, state_sum, locations, values, lr, eps, parts):
    for part in prange(parts):
        lo, hi = _part_bounds(locations.shape[0], _STEP_PART_UNIT, parts, part)
        _serial_part(weight, state_sum, locations[lo:hi], values[lo:hi], lr, eps)


@_split_kernel(_sgd_parts)
def _sgd_kernel(weight, locations, values, lr):
    for k in prange(locations.shape[0]):
        ahead = _step_ahead(locations, k, _STEP_PREFETCH_AHEAD)
        if ahead != _NO_LOCATION:
            _prefetch_write(weight, ahead)
        i = locations[k]
        weight[i] = _sgd_new(weight[i], values[k], lr)


@_split_kernel(_adagrad_parts)
def _adagrad_kernel(weight, state_sum, locations, values, lr, eps):
    for k in prange(locations.shape[0]):
        ahead = _step_ahead(locations, k, _STEP_PREFETCH_AHEAD)
        if ahead != _NO_LOCATION:
            _prefetch_write(weight, ahead)
            _prefetch_write(state_sum, ahead)
        i = locations[k]
        weight[i], state_sum[i] = _adagrad_new(weight[i], state_sum[i], values[k], lr, eps)


@_parallel_kernel
def _adam_kernel(weight, exp_avg, exp_avg_sq, locations, values, beta1, beta2, eps, step_size):
    one_minus_beta1 = np.float32(1.0) - beta1
    one_minus_beta2 = np.float32(1.0) - beta2
    for k in prange(locations.shape[0]):
        ahead = _step_ahead(locations, k, _STEP_PREFETCH_AHEAD)
        if ahead != _NO_LOCATION:
            _prefetch_write(weight, ahead)
            _prefetch_write(exp_avg, ahead)
            _prefetch_write(exp_avg_sq, ahead)
        i = locations[k]
        weight[i], exp_avg[i], exp_avg_sq[i] = _adam_new(
            weight[i], exp_avg[i], exp_avg_sq[i], values[k], one_minus_beta1, one_minus_beta2, eps, step_size
        )


# Dry runs of the three steps above: the same float32 arithmetic, nothing written; they count the touched
# locations whose gradient, new weight or new optimizer state would not be finite.


@_parallel_kernel
def _sgd_nonfinite_kernel(weight, locations, values, lr):
    bad = 0
    for k in prange(locations.shape[0]):
        ahead = _step_ahead(locations, k, _STEP_PREFETCH_AHEAD)
        if ahead != _NO_LOCATION:
            _prefetch_read(weight, ahead)
        g = values[k]
        w = _sgd_new(weight[locations[k]], g, lr)
        if not (np.isfinite(g) and np.isfinite(w)):
            bad += 1
    return bad


@_parallel_kernel
def _adagrad_nonfinite_kernel(weight, state_sum, locations, values, lr, eps):
    bad = 0
    for k in prange(locations.shape[0]):
        ahead = _step_ahead(locations, k, _STEP_PREFETCH_AHEAD)
        if ahead != _NO_LOCATION:
            _prefetch_read(weight, ahead)
            _prefetch_read(state_sum, ahead)
        i = locations[k]
        g = values[k]
        w, s = _adagrad_new(weight[i], state_sum[i], g, lr, eps)
        if not (np.isfinite(g) and np.isfinite(s) and np.isfinite(w)):
            bad += 1
    return bad


@_parallel_kernel
def _adam_nonfinite_kernel(weight, exp_avg, exp_avg_sq, locations, values, beta1, beta2, eps, step_size):
    one_minus_beta1 = np.float32(1.0) - beta1
    one_minus_beta2 = np.float32(1.0) - beta2
    bad = 0
    for k in prange(locations.shape[0]):
        ahead = _step_ahead(locations, k, _STEP_PREFETCH_AHEAD)
        if ahead != _NO_LOCATION:
            _prefetch_read(weight, ahead)
            _prefetch_read(exp_avg, ahead)
            _prefetch_read(exp_avg_sq, ahead)
        i = locations[k]
        g = values[k]
        w, m, v = _adam_new(
            weight[i], exp_avg[i], exp_avg_sq[i], g, one_minus_beta1, one_minus_beta2, eps, step_size
        )
        if not (np.isfinite(g) and np.isfinite(m) and np.isfinite(v) and np.isfinite(w)):
            bad += 1
    return bad


# A step and its dry run in one pass (``kernels.checked_step``): each touched location is read once, its
# old values kept in ``undo_*`` (one slot per location), and written only where every new value is
# finite; the caller puts the kept values back (``_restore_kernel``) when any location counted bad. The
# arithmetic is the step's above, so an accepted step leaves the same bits. Half the random reads of a
# dry run then a step: on a large array those reads miss the TLB (docs/benchmarks/dlrm-server-*.md).


def _adam_checked_parts(
    weight,
    exp_avg,
    exp_avg_sq,
    locations,
    values,
    beta1,
    beta2,
    eps,
    step_size,
    undo_weight,
    undo_avg,
    undo_sq,
    parts,
):
    bad = 0
    for part in prange(parts):
        lo, hi = _part_bounds(locations.shape[0], _STEP_PART_UNIT, parts, part)
        bad += _serial_part(
            weight,
            exp_avg,
            exp_avg_sq,
            locations[lo:hi],
            values[lo:hi],
            beta1,
            beta2,
            eps,
            step_size,
            undo_weight[lo:hi],
            undo_avg[lo:hi],
            undo_sq[lo:hi],
        )
    return bad


@_parallel_kernel
def _sgd_checked_kernel(weight, locations, values, lr, undo_weight):
    bad = 0
    for k in prange(locations.shape[0]):
        ahead = _step_ahead(locations, k, _STEP_PREFETCH_AHEAD)
        if ahead != _NO_LOCATION:
            _prefetch_write(weight, ahead)
        i = locations[k]
        g = values[k]
        old = weight[i]
        undo_weight[k] = old
        w = _sgd_new(old, g, lr)
        if np.isfinite(g) and np.isfinite(w):
            weight[i] = w
        else:
            bad += 1
    return bad


@_parallel_kernel
def _adagrad_checked_kernel(weight, state_sum, locations, values, lr, eps, undo_weight, undo_sum):
    bad = 0
    for k in prange(locations.shape[0]):
        ahead = _step_ahead(locations, k, _STEP_PREFETCH_AHEAD)
        if ahead != _NO_LOCATION:
            _prefetch_write(weight, ahead)
            _prefetch_write(state_sum, ahead)
        i = locations[k]
        g = values[k]
        old_weight = weight[i]
        old_sum = state_sum[i]
        undo_weight[k] = old_weight
        undo_sum[k] = old_sum
        w, s = _adagrad_new(old_weight, old_sum, g, lr, eps)
        if np.isfinite(g) and np.isfinite(s) and np.isfinite(w):
            state_sum[i] = s
            weight[i] = w
        else:
            bad += 1
    return bad


@_split_kernel(_adam_checked_parts)
def _adam_checked_kernel(
    weight,
    exp_avg,
    exp_avg_sq,
    locations,
    values,
    beta1,
    beta2,
    eps,
    step_size,
    undo_weight,
    undo_avg,
    undo_sq,
):
    one_minus_beta1 = np.float32(1.0) - beta1
    one_minus_beta2 = np.float32(1.0) - beta2
    bad = 0
    for k in prange(locations.shape[0]):
        ahead = _step_ahead(locations, k, _STEP_PREFETCH_AHEAD)
        if ahead != _NO_LOCATION:
            _prefetch_write(weight, ahead)
            _prefetch_write(exp_avg, ahead)
            _prefetch_write(exp_avg_sq, ahead)
        i = locations[k]
        g = values[k]
        old_avg = exp_avg[i]
        old_sq = exp_avg_sq[i]
        old_weight = weight[i]
        undo_weight[k] = old_weight
        undo_avg[k] = old_avg
        undo_sq[k] = old_sq
        w, m, v = _adam_new(old_weight, old_avg, old_sq, g, one_minus_beta1, one_minus_beta2, eps, step_size)
        if np.isfinite(g) and np.isfinite(m) and np.isfinite(v) and np.isfinite(w):
            exp_avg[i] = m
            exp_avg_sq[i] = v
            weight[i] = w
        else:
            bad += 1
    return bad


@_parallel_kernel
def _restore_kernel(array, locations, kept):
    for k in prange(locations.shape[0]):
        array[locations[k]] = kept[k]


# Their serial copies under module names, so that compiled code (``_checked_step_kernel``) can call them.
_sgd_serial = _sgd_kernel.serial
_adagrad_serial = _adagrad_kernel.serial
_adam_serial = _adam_kernel.serial
_sgd_nonfinite_serial = _sgd_nonfinite_kernel.serial
_adagrad_nonfinite_serial = _adagrad_nonfinite_kernel.serial
_adam_nonfinite_serial = _adam_nonfinite_kernel.serial


# A small update in one call (``small.SmallPath.checked_step``): the coalescing, the dry run and the
# step above, in that order. ``optimizer`` is an ``OPTIMIZER_CODES`` value; ``scalars`` float32
# [lr, eps, beta1, beta2, Adam's step size]; ``first`` / ``second`` the optimizer's state arrays (adagrad:
# sum, sum; adam: exp_avg, exp_avg_sq; sgd: unused). False, nothing written, when the dry run counts a
# non-finite value. It lives here, beside what it calls: numba's cache only notices changes to the file
# of the function it compiled.
OPTIMIZER_CODES = {"sgd": 0, "adagrad": 1, "adam": 2}


@njit(cache=True, nogil=True, error_model="numpy")
def _checked_step_kernel(
    offsets, grads, embedding_dim, chunk_size, optimizer, scalars, weight, first, second
):
    locations, values = _coalesce_sorted_kernel(grads, offsets, embedding_dim, chunk_size)
    lr = scalars[0]
    eps = scalars[1]
    if optimizer == 0:
        if _sgd_nonfinite_serial(weight, locations, values, lr) != 0:
            return False
        _sgd_serial(weight, locations, values, lr)
    elif optimizer == 1:
        if _adagrad_nonfinite_serial(weight, first, locations, values, lr, eps) != 0:
            return False
        _adagrad_serial(weight, first, locations, values, lr, eps)
    else:
        beta1 = scalars[2]
        beta2 = scalars[3]
        step_size = scalars[4]
        if _adam_nonfinite_serial(weight, first, second, locations, values, beta1, beta2, eps, step_size):
            return False
        _adam_serial(weight, first, second, locations, values, beta1, beta2, eps, step_size)
    return True


# --------------------------------------------------------------------------------------------------
# collections: many features over one shared array in one call (table-batched, as FBGEMM's TBE)
#
# A collection's input is jagged and key-major, like a torchrec ``KeyedJaggedTensor``: F features of B
# bags each, bag g = f * B + b holding ``ids[bag_bounds[g]:bag_bounds[g + 1]]``. Feature f has its own
# embedding dim ``feature_dims[f]``, ``val_offset``, pooling and output columns ``[feature_columns[f],
# + feature_dims[f])`` of the (B, sum of dims) output. Every chunk of every id has one slot in a flat
# chunk array, feature by feature, id by id, chunk by chunk: id n of feature f owns
# ``chunk_base[f] + (n - bag_bounds[f * B]) * C_f + c``. That order is the one a table-by-table
# concatenation of the features' (offsets, grad rows) has, so the coalesced gradient below is the same
# bits as ``_coalesce_*_kernel`` of that concatenation (one Table update of the shared array).

# Bags hashed and pooled together per work item: the group's ids are hashed a block at a time first, so
# one-id bags (the usual categorical feature) still get whole hash blocks and rows prefetched ahead.
_COLLECTION_BAG_GROUP = 256
# Rows prefetched ahead by the collection's forward: a pooled row of one id is a single short add, so the
# gather's 4 rows ahead hide too little of a miss (docs/benchmarks/dlrm-2026-11-27.md).
_COLLECTION_PREFETCH_ROWS = 16


@_parallel_kernel
def _collection_forward_kernel(
    weight,
    ids,
    bag_bounds,
    batch_size,
    feature_val_offsets,
    feature_dims,
    feature_columns,
    feature_mean,
    chunk_base,
    chunk_size,
    mode,
    random_numbers,
    prefetch,
    out,
    chunk_offsets,
):
    # Pools exactly as ``_lookup_bag_kernel`` does (zero, add each row in order with scale 1, then times
    # float32(1) / count for a non-empty mean bag), so each feature's output is the per-feature module's,
    # bit for bit; the hashed offsets are kept in ``chunk_offsets`` for the backward.
    range_size = weight.shape[0] - chunk_size + 1
    num_features = feature_dims.shape[0]
    width = out.shape[1]
    flat = out.reshape(-1)
    groups_per_feature = (batch_size + _COLLECTION_BAG_GROUP - 1) // _COLLECTION_BAG_GROUP
    for item in prange(num_features * groups_per_feature):
        f = item // groups_per_feature
        first_bag = (item - f * groups_per_feature) * _COLLECTION_BAG_GROUP
        last_bag = min(batch_size, first_bag + _COLLECTION_BAG_GROUP)
        embedding_dim = feature_dims[f]
        num_chunks = (embedding_dim + chunk_size - 1) // chunk_size
        feature_first = bag_bounds[f * batch_size]
        id_begin = bag_bounds[f * batch_size + first_bag]
        id_end = bag_bounds[f * batch_size + last_bag]
        chunks_begin = chunk_base[f] + (id_begin - feature_first) * num_chunks
        scratch = np.empty((4, _HASH_BLOCK), dtype=np.uint64)
        for block_begin in range(id_begin, id_end, _HASH_BLOCK):
            _hash_block(
                ids,
                block_begin,
                min(_HASH_BLOCK, id_end - block_begin),
                feature_val_offsets[f],
                num_chunks,
                mode,
                random_numbers,
                range_size,
                scratch,
                chunk_offsets,
                chunk_base[f] + (block_begin - feature_first) * num_chunks,
            )
        chunks_end = chunks_begin + (id_end - id_begin) * num_chunks
        ahead_chunks = _COLLECTION_PREFETCH_ROWS * num_chunks
        column = feature_columns[f]
        for b in range(first_bag, last_bag):
            g = f * batch_size + b
            begin = bag_bounds[g]
            end = bag_bounds[g + 1]
            base = b * width + column
            for j in range(embedding_dim):
                flat[base + j] = 0.0
            for n in range(begin, end):
                k = chunk_base[f] + (n - feature_first) * num_chunks
                if prefetch and k + ahead_chunks < chunks_end:
                    for c in range(num_chunks):
                        length = min(chunk_size, embedding_dim - c * chunk_size)
                        _prefetch_chunk(weight, chunk_offsets[k + ahead_chunks + c], length, False)
                for c in range(num_chunks):
                    start = c * chunk_size
                    _add_scaled(
                        flat,
                        base + start,
                        weight,
                        chunk_offsets[k + c],
                        min(chunk_size, embedding_dim - start),
                        np.float32(1.0),
                    )
            if feature_mean[f] and end > begin:
                inv_count = np.float32(1.0) / np.float32(end - begin)
                for j in range(embedding_dim):
                    flat[base + j] *= inv_count


@njit(cache=True, nogil=True, error_model="numpy")
def _collection_first_bad_id(ids, bag_bounds, batch_size, feature_num_embeddings):
    """Index of the first id outside ``[0, num_embeddings)`` of its feature, or -1."""
    for f in range(feature_num_embeddings.shape[0]):
        limit = feature_num_embeddings[f]
        for n in range(bag_bounds[f * batch_size], bag_bounds[(f + 1) * batch_size]):
            if ids[n] < 0 or ids[n] >= limit:
                return n
    return -1


@njit(cache=True, nogil=True, error_model="numpy")
def _collection_chunk_sources(
    bag_bounds, batch_size, feature_dims, feature_columns, feature_mean, chunk_base, chunk_size, width
):
    """Where each chunk's gradient comes from: (position in the flat (B, width) output gradient, length,
    divisor: the bag's length for a mean bag, else 1), one entry per slot of the flat chunk array."""
    total = chunk_base[chunk_base.shape[0] - 1]
    sources = np.empty(total, dtype=np.int64)
    lengths = np.empty(total, dtype=np.int64)
    divisors = np.empty(total, dtype=np.float32)
    for f in range(feature_dims.shape[0]):
        embedding_dim = feature_dims[f]
        num_chunks = (embedding_dim + chunk_size - 1) // chunk_size
        feature_first = bag_bounds[f * batch_size]
        for b in range(batch_size):
            g = f * batch_size + b
            begin = bag_bounds[g]
            end = bag_bounds[g + 1]
            divisor = np.float32(end - begin) if feature_mean[f] else np.float32(1.0)
            for n in range(begin, end):
                k = chunk_base[f] + (n - feature_first) * num_chunks
                for c in range(num_chunks):
                    sources[k + c] = b * width + feature_columns[f] + c * chunk_size
                    lengths[k + c] = min(chunk_size, embedding_dim - c * chunk_size)
                    divisors[k + c] = divisor
    return sources, lengths, divisors


@njit(cache=True, nogil=True, error_model="numpy")
def _row_chunk_sources(table_rows, table_dims, chunk_size):
    """Where each chunk of several tables' gradient rows comes from, the tables' (N_t, d_t) rows laid
    out one after the other in one flat array: (position, length), one entry per chunk, table by table,
    row by row (the order ``_collection_chunk_sources`` gives a collection's chunks)."""
    total = 0
    for t in range(table_rows.shape[0]):
        total += table_rows[t] * ((table_dims[t] + chunk_size - 1) // chunk_size)
    sources = np.empty(total, dtype=np.int64)
    lengths = np.empty(total, dtype=np.int64)
    k = 0
    position = 0
    for t in range(table_rows.shape[0]):
        embedding_dim = table_dims[t]
        num_chunks = (embedding_dim + chunk_size - 1) // chunk_size
        for _ in range(table_rows[t]):
            for c in range(num_chunks):
                sources[k] = position + c * chunk_size
                lengths[k] = min(chunk_size, embedding_dim - c * chunk_size)
                k += 1
            position += embedding_dim
    return sources, lengths


@njit(inline="always", cache=True, nogil=True, error_model="numpy")
def _add_divided(dst, dst_pos, src, src_pos, length, divisor):
    """``dst[d:d+length] += src[s:s+length] / divisor``; a plain add when ``divisor`` is 1 (x / 1 == x)."""
    if divisor == np.float32(1.0):
        _add(dst, dst_pos, src, src_pos, length)
    else:
        for j in range(length):
            dst[dst_pos + j] += src[src_pos + j] / divisor


@njit(cache=True, nogil=True, error_model="numpy")
def _coalesce_chunks_kernel(
    grads, keys, sources, lengths, divisors, memory_size, dense, values_dense, coverage
):
    """Coalesce chunks given one by one: chunk k adds ``grads[sources[k]:+lengths[k]] / divisors[k]`` at
    array location ``keys[k]``. The same two variants as ``_coalesce_dense_kernel`` (``dense``: scratch
    of m, chunks in their order) and ``_coalesce_sorted_kernel`` (chunks in stable order of their start),
    with the same sums in the same order: for chunks laid out row by row they give the same bits."""
    num = keys.shape[0]
    if dense:
        values_dense[:memory_size] = 0.0
        coverage[: memory_size + 1] = 0
        for k in range(num):
            dst = keys[k]
            length = lengths[k]
            _add_divided(values_dense, dst, grads, sources[k], length, divisors[k])
            coverage[dst] += 1
            coverage[dst + length] -= 1
        count = 0
        depth = 0
        for i in range(memory_size):
            depth += coverage[i]
            count += depth > 0
        locations = np.empty(count, dtype=np.int64)
        values = np.empty(count, dtype=np.float32)
        k = 0
        depth = 0
        for i in range(memory_size):
            depth += coverage[i]
            if depth > 0:
                locations[k] = i
                values[k] = values_dense[i]
                k += 1
        return locations, values
    starts, order = _sorted_chunk_starts(keys)
    total = 0
    run_end = np.int64(-1)
    for k in range(num):
        idx = order[k]
        dst = starts[k]
        end = dst + lengths[idx]
        if dst > run_end:
            total += lengths[idx]
            run_end = end
        elif end > run_end:
            total += end - run_end
            run_end = end
    locations = np.empty(total, dtype=np.int64)
    values = np.zeros(total, dtype=np.float32)
    base = 0
    run_start = np.int64(0)
    run_end = np.int64(-1)
    filled = 0
    for k in range(num):
        if k + _COALESCE_PREFETCH_AHEAD < num:
            _prefetch_read(grads, np.uint64(sources[order[k + _COALESCE_PREFETCH_AHEAD]]))
        idx = order[k]
        dst = starts[k]
        end = dst + lengths[idx]
        if dst > run_end:
            base = filled
            run_start = dst
            run_end = dst
        if end > run_end:
            for j in range(end - run_end):
                locations[filled + j] = run_end + j
            filled += end - run_end
            run_end = end
        _add_divided(values, base + (dst - run_start), grads, sources[idx], lengths[idx], divisors[idx])
    return locations, values


# A server's push of several tables over one array, hashed, checked and coalesced in one call (the
# service's ``prepare_shared_step``): the statuses it returns besides the step.
TABLES_OK = 0
TABLES_NON_FINITE = 1  # a gradient is NaN or infinite
TABLES_OUT_OF_RANGE = 2  # a chunk start lies past m - Z (a table's own Z smaller than the step's)


@njit(cache=True, nogil=True, error_model="numpy")
def _coalesce_tables_kernel(
    ids,
    id_bounds,
    val_offsets,
    num_chunks,
    modes,
    constants,
    range_sizes,
    table_dims,
    grads,
    chunk_size,
    memory_size,
    dense,
    values_dense,
    coverage,
):
    """Table t's ids ``ids[id_bounds[t]:id_bounds[t + 1]]`` hashed with its ``val_offsets[t]``,
    ``num_chunks[t]``, hash ``modes[t]``, ``constants[t]`` and ``range_sizes[t]`` exactly as
    ``_chunk_offsets_kernel`` hashes them (the same blocks of ``_HASH_BLOCK`` ids from the table's first),
    every table's (N_t, d_t) rows laid out one after the other in ``grads``, then coalesced by
    ``_coalesce_chunks_kernel`` (chunk size ``chunk_size``): the same bits as hashing each table and
    coalescing the concatenation (``coalesce_chunk_rows``). Returns (locations, values, status):
    ``TABLES_OK``, or, with empty arrays, ``TABLES_NON_FINITE`` when a gradient is NaN or infinite (checked
    first) or ``TABLES_OUT_OF_RANGE`` when a chunk start lies past ``memory_size - chunk_size``."""
    bits = grads.view(np.uint32)
    exponent = np.uint32(0x7F800000)
    non_finite = np.uint32(0)
    for i in range(bits.shape[0]):  # all exponent bits set: NaN or infinity (an OR, so it vectorises)
        non_finite |= np.uint32((bits[i] & exponent) == exponent)
    if non_finite:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float32), TABLES_NON_FINITE
    num_tables = table_dims.shape[0]
    table_rows = np.empty(num_tables, dtype=np.int64)
    chunk_bounds = np.empty(num_tables + 1, dtype=np.int64)
    chunk_bounds[0] = 0
    for t in range(num_tables):
        table_rows[t] = id_bounds[t + 1] - id_bounds[t]
        chunk_bounds[t + 1] = chunk_bounds[t] + table_rows[t] * num_chunks[t]
    keys = np.empty(chunk_bounds[num_tables], dtype=np.int64)
    scratch = np.empty((4, _HASH_BLOCK), dtype=np.uint64)
    for t in range(num_tables):
        table_ids = ids[id_bounds[t] : id_bounds[t + 1]]
        table_keys = keys[chunk_bounds[t] : chunk_bounds[t + 1]]
        for begin in range(0, table_rows[t], _HASH_BLOCK):
            _hash_block(
                table_ids,
                begin,
                min(_HASH_BLOCK, table_rows[t] - begin),
                val_offsets[t],
                num_chunks[t],
                modes[t],
                constants[t],
                range_sizes[t],
                scratch,
                table_keys,
                begin * num_chunks[t],
            )
    limit = memory_size - chunk_size
    for k in range(keys.shape[0]):
        if keys[k] > limit:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float32), TABLES_OUT_OF_RANGE
    sources, lengths = _row_chunk_sources(table_rows, table_dims, chunk_size)
    locations, values = _coalesce_chunks_kernel(
        grads,
        keys,
        sources,
        lengths,
        np.ones(keys.shape[0], dtype=np.float32),
        memory_size,
        dense,
        values_dense,
        coverage,
    )
    return locations, values, TABLES_OK


@njit(cache=True, nogil=True, error_model="numpy")
def _collection_coalesce_kernel(
    grad_output,
    bag_bounds,
    batch_size,
    feature_dims,
    feature_columns,
    feature_mean,
    chunk_base,
    chunk_size,
    chunk_offsets,
    memory_size,
    dense,
    values_dense,
    coverage,
):
    """The sparse backward of ``_collection_forward_kernel``: sorted unique locations and their summed
    gradients, every feature's chunks at once, from the (B, width) output gradient itself (no (N, d)
    per-id gradient is built)."""
    sources, lengths, divisors = _collection_chunk_sources(
        bag_bounds,
        batch_size,
        feature_dims,
        feature_columns,
        feature_mean,
        chunk_base,
        chunk_size,
        grad_output.shape[1],
    )
    return _coalesce_chunks_kernel(
        grad_output.reshape(-1),
        chunk_offsets,
        sources,
        lengths,
        divisors,
        memory_size,
        dense,
        values_dense,
        coverage,
    )


@njit(cache=True, nogil=True, error_model="numpy")
def _collection_scatter_kernel(
    grad_output,
    bag_bounds,
    batch_size,
    feature_dims,
    feature_columns,
    feature_mean,
    chunk_base,
    chunk_size,
    chunk_offsets,
    prefetch,
    out,
):
    """The dense backward of ``_collection_forward_kernel``, serial, in place: ``out[location] +=`` every
    chunk's gradient, feature by feature, id by id (one thread, so the sums are grouped as the serial
    ``_scatter_serial_kernel``'s of the concatenated rows)."""
    grads = grad_output.reshape(-1)
    width = grad_output.shape[1]
    for f in range(feature_dims.shape[0]):
        embedding_dim = feature_dims[f]
        num_chunks = (embedding_dim + chunk_size - 1) // chunk_size
        feature_first = bag_bounds[f * batch_size]
        chunks_end = chunk_base[f + 1]
        ahead_chunks = _PREFETCH_ROWS * num_chunks
        for b in range(batch_size):
            g = f * batch_size + b
            begin = bag_bounds[g]
            end = bag_bounds[g + 1]
            divisor = np.float32(end - begin) if feature_mean[f] else np.float32(1.0)
            for n in range(begin, end):
                k = chunk_base[f] + (n - feature_first) * num_chunks
                if prefetch and k + ahead_chunks < chunks_end:
                    for c in range(num_chunks):
                        length = min(chunk_size, embedding_dim - c * chunk_size)
                        _prefetch_chunk(out, chunk_offsets[k + ahead_chunks + c], length, True)
                for c in range(num_chunks):
                    start = c * chunk_size
                    _add_divided(
                        out,
                        chunk_offsets[k + c],
                        grads,
                        b * width + feature_columns[f] + start,
                        min(chunk_size, embedding_dim - start),
                        divisor,
                    )


@njit(cache=True, nogil=True, error_model="numpy")
def _distinct_by_table_kernel(
    ids, feature_starts, feature_tables, feature_limits, num_tables, keys, tags, bits
):
    """Every table's distinct ids in one pass over a batch's ids (feature f's are
    ``ids[feature_starts[f]:feature_starts[f + 1]]``, read by table ``feature_tables[f]``), by linear
    probing of (table, id) in ``keys`` / ``tags`` (2**bits slots, at least twice the ids; tags all 0 on
    entry, and again on return). Returns (distinct ids grouped by table, each table's in order of first
    appearance; each id's index into them; where each table's start (T + 1,); the index of the first id
    outside its feature's ``[0, feature_limits[f])``, or -1)."""
    n = ids.shape[0]
    mask = keys.shape[0] - 1
    shift = np.uint64(64 - bits)
    counts = np.zeros(num_tables, dtype=np.int64)
    firsts = np.empty(n, dtype=np.int64)  # where each distinct (table, id) sits in keys / tags
    inverse = np.empty(n, dtype=np.int64)  # first: the tag (table << 40 | index in table + 1)
    bad = -1
    found = 0
    for f in range(feature_tables.shape[0]):
        table = feature_tables[f]
        salt = np.uint64(table) * np.uint64(0xC2B2AE3D27D4EB4F)
        for i in range(feature_starts[f], feature_starts[f + 1]):
            ident = ids[i]
            if bad < 0 and (ident < 0 or ident >= feature_limits[f]):
                bad = i
            slot = np.int64(((np.uint64(ident) ^ salt) * np.uint64(0x9E3779B97F4A7C15)) >> shift)
            while True:
                tag = tags[slot]
                if tag == 0:
                    counts[table] += 1
                    tag = (table << 40) | counts[table]
                    keys[slot] = ident
                    tags[slot] = tag
                    firsts[found] = slot
                    found += 1
                    break
                if keys[slot] == ident and (tag >> 40) == table:
                    break
                slot = (slot + 1) & mask
            inverse[i] = tag
    starts = np.zeros(num_tables + 1, dtype=np.int64)
    for t in range(num_tables):
        starts[t + 1] = starts[t] + counts[t]
    distinct = np.empty(found, dtype=np.int64)
    for k in range(found):
        slot = firsts[k]
        tag = tags[slot]
        distinct[starts[tag >> 40] + (tag & 0xFFFFFFFFFF) - 1] = keys[slot]
        tags[slot] = 0
    for i in range(n):
        tag = inverse[i]
        inverse[i] = starts[tag >> 40] + (tag & 0xFFFFFFFFFF) - 1
    return distinct, inverse, starts, bad
