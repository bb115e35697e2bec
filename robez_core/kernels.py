"""Fused CPU kernels for ROBE-Z tables (numba): hash + gather, bags, scatter, coalesce, optimizer steps.

This is the only compiled code of the project. Every kernel here agrees with the pure-torch reference in
``hashing.py`` bit for bit on forward (same int64 wrap-around, same floor mod) and within float tolerance
on gradients and optimizer updates; ``tests/core/test_kernels.py`` checks both.

Why the kernels are fast (32768 ids, d = 100, Z = 32, 1 thread, on the 2-core dev box):

- one hash per (id, chunk) instead of one per value, and no (N, d) int64 index tensor: each chunk's
  ``chunk_size`` contiguous floats are copied straight from ``weight`` into the output row with explicit
  AVX-512 moves (gather 0.65 -> 0.52 ms), and large batches with streaming stores that skip the
  read-for-ownership of every output line (cold gather 0.93 -> 0.59 ms);
- the paper hash reduces ``mod P`` and ``mod (m - Z + 1)`` with float64 reciprocals and exact integer
  corrections instead of 64-bit divisions; that is branch-free, so ids are hashed 128 at a time, chunk
  by chunk, and LLVM runs eight lanes per instruction (hashing 0.31 -> 0.14 ms). Any P outside
  [2**16, 2**52) (constants imported from elsewhere) takes a generic loop with integer divisions;
- that "float64" formulation needs AVX-512 DQ (int64 <-> float64 conversions, 64-bit multiplies in
  vector registers); without it (AVX2: Zen 2/3, older Xeons) LLVM ran it one lane at a time. The
  paper hash (2**16 <= P < 2**31) therefore takes "split32": one reduction per id of ``key mod P`` from
  its two 32-bit halves (int32 -> float64 conversions, quotient rounded by a magic-number add, ``q * P``
  as two 32 x 32 -> 64 multiplies), then per chunk only ``(key mod P) + (chunk term mod P)``. In a
  block where no int64 key sum can wrap (every key at least max |chunk term| inside the int64 limits:
  all but astronomically rare blocks) that sum and the second mod run in float64 (values below 2**32,
  exact), and rows of 4 chunk offsets are stored whole; a block with a key near the limits takes a
  loop that corrects by ``2**64 mod P`` where the sum wrapped. 32768 ids x 4 chunks, side by side
  (2026-11-23): AVX2 (emulated, see below) 0.53 ms float64, 0.18 split32 before the float64 chunk
  pass, 0.11 with it; AVX-512 0.10-0.12 float64, 0.08 split32, so split32 is used on both and float64
  takes P in [2**31, 2**52). Both are bit-exact; the tests force each on any CPU;
- tables bigger than the caches get the chunks of the row four ahead prefetched (m = 10**8:
  gather 4.7 -> 2.3 ms, dense backward 4.0 -> 2.4 ms), and the dense backward does so from an array
  the size of a core's L2, which training has evicted by then (see ``_PREFETCH_WRITE_MIN_BYTES``);
  a gather from a smaller table that reads many times its size first reads the table once in order,
  so that its random chunk reads find it in cache (see ``_WARM_TABLE_RATIO``);
- outputs are allocated by numpy (huge pages) rather than ``torch.empty``, large ones (rows, the dense
  backward's (m,) gradient) from the pool of ``buffers.py``, which hands a batch nobody holds any more
  to the next call, and the coalesce's dense scratch is reused per thread, because fresh multi-megabyte
  buffers page-fault on every call;
- the backward prefetches the (N, d) output gradients it streams through ``_STREAM_AHEAD_FLOATS``
  ahead, so reading them overlaps the adds at random places of the array (scatter 0.70 -> 0.54 ms);
- the row loops of the gather, the lookup and the dense backward are compiled once per common chunk
  size (1, 2, 4, ..., 64), so every chunk is a fixed run of vector moves instead of three run-time
  length loops (training share 8% faster; see ``_SPECIALISED_CHUNK_SIZES``), and a strided id column
  (``pairs[:, 0]``) is hashed where it lies instead of being copied first;
- one thread runs a serial compilation of each kernel; more threads split ids with ``prange``, the dense
  backward uses private per-thread arrays (or range partitions when m is large), and every kernel
  releases the GIL (``nogil=True``).

Wrap-around: numba gives signed int64 arithmetic LLVM's "no signed wrap" flag (overflow is undefined
behaviour to the optimiser), so the hash's wrapping multiply-adds are done in uint64, which wraps by
definition and yields the same two's-complement bits as torch's int64 arithmetic.

Compilation is cached on disk (``cache=True``): the first process compiles each signature once (about
7 s for a lookup) and writes the result to ``__pycache__`` next to this file; when that directory is not
writable (a system-wide install), numba uses the user's cache directory (``~/.cache/numba``), and the
``NUMBA_CACHE_DIR`` environment variable overrides both (e.g. a volume in a container whose image was
built read-only). Later processes load the machine code instead:
about 0.3 s for the first kernel, 20 ms for each further one. The cache is invalidated by a change of
this file (its modification time and size) or of the CPU model, which then recompiles once. A chunk
size in ``_SPECIALISED_CHUNK_SIZES`` has compilations of its own, made (or loaded) on its first use.

AVX2 on an AVX-512 machine: ``NUMBA_CPU_NAME=znver2`` with ``NUMBA_CPU_FEATURES`` set to the host's
features minus every AVX-512 one makes numba compile for a Zen 2 (the generated code then has no zmm
register: checked with ``inspect_asm``); ``python -m robez_core.bench --emulate-avx2`` sets that up and
holds torch to its AVX2 kernels too. With ``split32`` (before its float64 chunk pass) the AVX2 build
ran, side by side on the dev box (1 thread, p10 of 150 calls, 32768 ids, d = 100): hash 0.19 ms
(AVX-512: 0.10), gather 0.43-0.46
(0.41), lookup 0.61-0.65 (0.51-0.54), dense scatter 0.65-0.77 (0.58-0.61), coalesce 1.2-1.3 (1.1).

Determinism: the coalesce runs serially in a fixed order and the optimizer steps touch each location
once, so ``Table.apply_gradients`` / ``apply_gradients_at`` and the lookups give the same bits at any
thread count (replicas may run different counts; ``tests/core/test_table.py`` checks 1 vs 2). The
module-level dense ``scatter_grad`` at several threads (``RobezEmbedding``'s dense backward) sums
per-thread partial arrays, so its float sums are grouped differently from the serial one's.

Threads: every public function sets numba's thread count to ``torch.get_num_threads()`` (capped at
numba's pool size), so ``torch.set_num_threads(1)`` makes the kernels single-threaded too.

All functions take and return CPU torch tensors; numba works on zero-copy ``.numpy()`` views, so
``weight`` and optimizer state are updated in place (they may live in shared memory).
"""

from __future__ import annotations

import math
import platform
import threading
import types
from collections.abc import Callable
from typing import Any, Literal

import numba
import numpy as np
import torch
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import njit, prange
from numba import types as numba_types
from numba.core import codegen as numba_codegen
from numba.extending import intrinsic

from . import buffers
from .errors import ConfigError, InvalidInputError
from .hashing import FMIX_C1, FMIX_C2, HASH_NAMES, MAX_FAST_RANGE, NUM_RANDOM_NUMBERS

__all__ = [
    "adagrad_step",
    "adam_step",
    "chunk_offsets",
    "coalesce_grad",
    "compile_target",
    "fits_int32_offsets",
    "gather",
    "lookup",
    "lookup_bag",
    "scatter_grad",
    "set_kernel_threads",
    "sgd_step",
]

BagMode = Literal["sum", "mean"]

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
# Batches of rows at least this big are written with streaming (non-temporal) stores: bigger than L2,
# and a large share of L3, so caching them would only evict the table. Still so with the per-chunk-size
# compilations (2026-11-23, training loop, paired steps against the same code with plain stores): the
# share took 0.875-0.880x the time, and the whole pair-model step 0.989x (the model then reads the rows
# from memory rather than cache, which costs it less than the stores save).
_STREAMING_MIN_BYTES = 4 << 20
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
# A parallel dense backward gives each thread a private (m,) copy while they all fit in this many floats
# (64 MB); past that, threads split the array into ranges and bucket the chunks by range.
_PRIVATE_SCATTER_MAX_FLOATS = 16 << 20
_SCRATCH_MAX_BYTES = 64 << 20
_thread_scratch = threading.local()
_PREFETCH_ROWS = 4  # how far ahead the row loops prefetch the table (measured best of 4 and 16)
# Prefetching pays once the table misses the caches. Reads: past L2 (below that it cost 5-15% on a
# lookup repeated over a hot table, m = 262144: 0.73 -> 0.83 ms). The dense backward's writes: from
# the size of a core's L2 (1 MB on Zen 4/5; Zen 2/3 have 512 KB), because in training the array is not
# in cache when the backward runs: the forward's rows and the backward's output gradients (13 MB each
# for 32768 x 100) have streamed through since. In the training loop (2 lookups, backward, torch Adam;
# ``python -m robez_core.bench_share --prefetch [--emulate-avx2]``, 2026-11-23, 1 thread, 88 paired
# steps, dev VM under load), no write prefetch was 2.8% (AVX-512) / 3.6% (emulated AVX2) slower than
# prefetch from 1 MB at m = 262144 and 23% / 17% slower at m = 2621440; a scatter alone on a hot
# 1 MB array was no slower with it. At m = 65536 (256 KB) it gained 1% in the loop but cost 13% alone
# (0.45 -> 0.51 ms), at m = 8192 25%. The old 64 MB threshold was set from the scatter alone.
# Read prefetch at any size gained another 2-3% in that loop at m = 262144 but made a lookup repeated
# over a hot table up to 9% slower (emulated AVX2), so reads keep their threshold.
_PREFETCH_READ_MIN_BYTES = 4 << 20
_PREFETCH_WRITE_MIN_BYTES = 1 << 20
# Below the read-prefetch size, a gather that reads at least this many times the table's bytes first
# reads the whole table once in order (``_warm_kernel``): in training the table is out of the caches
# when the forward runs (the backward and the optimizer streamed megabytes through since), and the
# gather's random chunk reads then wait on one miss after another, while a sequential pass is streamed
# by the hardware prefetcher. Stepped in turn in the training loop (2 lookups, backward, torch Adam, m =
# 262144, 1 thread, 2026-11-23, dev VM; ``python -m robez_core.bench_share --prefetch [--emulate-avx2]``),
# the share was 9.1% (AVX-512) / 5.3% (emulated AVX2) slower without the pass, and 8.3% / 3.5% slower with
# read prefetch in its place; a lookup repeated over a hot table was 3.3-3.5% slower with it (0.51 ->
# 0.53 ms). At m = 2621440 (10 MB, prefetched instead) a pass gained 1-3% in the loop and cost 19% hot.
# Prefetching the table while the ids are hashed instead (a share of its lines per block of ids, so the
# pass overlaps the hash's arithmetic) gained 0.6% of the share (median of 8 paired runs, 0.98-1.03):
# not kept.
_WARM_TABLE_RATIO = 8
# The backward streams through the (N, d) output gradients while it adds them at random places of the
# array; the hardware prefetcher alone left that read and the adds one after the other (read 0.34 ms +
# adds 0.38 ms = scatter 0.70 ms for 32768 x 100, m = 262144). Prefetching the gradient stream this far
# ahead overlaps them: 0.64 ms at 400 floats ahead, 0.60 at 800, 0.54-0.58 from 1600 to 6400.
# Prefetching that stream with the non-temporal hint (prefetchnta, to keep it from evicting the array
# from L2) gained nothing in the training loop (2026-11-23, paired: 1.007-1.008x the time).
_STREAM_AHEAD_FLOATS = 2048
# The row loops (gather, lookup, dense backward) copy or add a row as d // Z whole chunks and a shorter
# last one. Compiled for one chunk size, those lengths are constants and LLVM unrolls each chunk into a
# few vector moves; for a run-time Z every chunk ran three length loops (16, 4, 1 floats at a time).
# Measured 2026-11-23 (1 thread, 32768 ids, d = 100, Z = 32, m = 262144), against the previous kernels
# loaded side by side in one process: hot, gather 0.43-0.45 -> 0.40 ms, lookup 0.55 -> 0.45, dense
# backward 0.55 -> 0.42-0.45; in the training loop (2 lookups, backward, Adam(fused=True), paired steps,
# with the strided-ids change of ``chunk_offsets``) the share took 0.917-0.924x the time on AVX-512 and
# 0.927x on emulated AVX2, and the trained arrays were bitwise equal. These sizes (the paper's Z range
# and its double) get their own compilations (``_KernelPair.for_chunk``); any other Z runs the generic
# one, which reads Z at run time (``_CHUNK = 0``).
_SPECIALISED_CHUNK_SIZES = frozenset((1, 2, 4, 8, 16, 32, 64))
_CHUNK = 0
# Ids hashed together, chunk by chunk, so each inner loop is a vectorised pass over the block. Blocks of
# 512 ids (for 4 chunks an id) hashed 32768 ids 20% faster in a loop over the same batch (0.077 -> 0.061
# ms; each vectorised loop has a set-up and a tail), but 5% slower in the training loop (0.105 -> 0.111
# ms, timed inside the same paired steps; the share did not gain): not kept. Hoisting the constants a
# block derives from the hash's (reciprocals, 2**64 mod P, each chunk term mod P) out of the block loop
# made no difference either: LLVM already does.
_HASH_BLOCK = 128
_HASH_BLOCK_U = np.uint64(_HASH_BLOCK)
_HASH_GROUP = 16  # blocks per parallel work item of the hash: shares one scratch, still 16 items at 32768
_BAG_GROUP = 64
# Below this many values touched a kernel runs in the calling thread. Measured at 2 threads on the dev VM
# (service `demo` table, d=64): a 1-id hash + gather took 74 us parallel vs 40 us serial, 512 ids were
# still faster serial, 4096 ids faster parallel (gather 119 -> 83 us).
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
# values to clear and sum (8 ids x 2 chunks: 2.7 -> 0.6 us for the whole coalesce).
_INSERTION_SORT_MAX_KEYS = 64


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
    """

    def __init__(self, py_func: Callable[..., Any], chunk_size: int = 0) -> None:
        self._py_func = py_func
        self.chunk_size = chunk_size
        source = _renamed(py_func, f"_z{chunk_size}", {"_CHUNK": chunk_size}) if chunk_size else py_func
        self.serial = njit(cache=True, nogil=True, error_model="numpy")(_renamed(source, "_serial"))
        self.parallel = njit(parallel=True, cache=True, nogil=True, error_model="numpy")(source)
        self.__doc__ = py_func.__doc__
        self._specialised: dict[int, _KernelPair] = {}

    def __call__(self, *args: Any, work: int | None = None) -> Any:
        """Run serially at one thread or when ``work`` (values touched) is below
        ``_PARALLEL_MIN_WORK``: waking the other threads costs more than a small batch's whole kernel."""
        serial = numba.get_num_threads() == 1 or (work is not None and work < _PARALLEL_MIN_WORK)
        return (self.serial if serial else self.parallel)(*args)

    def for_chunk(self, chunk_size: int) -> _KernelPair:
        """The pair compiled for ``chunk_size`` when it is one of ``_SPECIALISED_CHUNK_SIZES``, else this
        (generic) one; callers pass the same ``chunk_size`` to the kernel itself."""
        if self.chunk_size or chunk_size not in _SPECIALISED_CHUNK_SIZES:
            return self
        pair = self._specialised.get(chunk_size)
        if pair is None:
            pair = self._specialised[chunk_size] = _KernelPair(self._py_func, chunk_size)
        return pair


def _parallel_kernel(py_func: Callable[..., Any]) -> _KernelPair:
    return _KernelPair(py_func)


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
    AVX-512 moves (the gather got 20% faster).
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
    (read-for-ownership) and evicts the table; streaming stores skip both. A cold 32768 x 100 gather went
    from 0.93 to 0.59 ms. Callers end with :func:`_store_fence`.
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
    at once. Gather of 32768 x 100: 0.57 -> 0.50 ms at m = 262144, 3.6 -> 2.3 ms at m = 10**8.
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
            # x / range is an integer, one less: one correction. (AVX2 emulated, 32768 ids x 4 chunks:
            # 0.18 -> 0.13 ms side by side, 0.11 with rows of 4 chunks stored whole.)
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


@_parallel_kernel
def _chunk_offsets_kernel(ids, val_offset, num_chunks, mode, random_numbers, range_size, out):
    num_ids = ids.shape[0]
    flat = out.reshape(-1)
    num_blocks = (num_ids + _HASH_BLOCK - 1) // _HASH_BLOCK
    # One scratch per group of blocks, not per block (256 allocations for 32768 ids): 0.085 -> 0.071 ms
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


@_parallel_kernel
def _gather_kernel(weight, offsets, embedding_dim, chunk_size, streaming, prefetch, out):
    # A row is d // Z whole chunks, then a shorter last one: constant lengths in a compilation for one
    # chunk size (``_CHUNK``). The row loops are written out in each kernel: a helper taking the arrays
    # kept numba's reference counting in the loop (gather 0.42 -> 9.4 ms).
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


@_parallel_kernel
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


@_parallel_kernel
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


def _warm_table(weight_np: np.ndarray, gathered_bytes: int) -> None:
    """Stream a table below the read-prefetch size through the caches before a gather that reads at
    least ``_WARM_TABLE_RATIO`` times its bytes (see ``_WARM_TABLE_RATIO``)."""
    if weight_np.nbytes < _PREFETCH_READ_MIN_BYTES and weight_np.nbytes * _WARM_TABLE_RATIO <= gathered_bytes:
        _warm_kernel(weight_np)


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


@njit(cache=True, nogil=True, error_model="numpy")
def _coalesce_sorted_kernel(grad_rows, offsets, embedding_dim, chunk_size):
    # Sort chunk starts; overlapping or touching chunks merge into runs that cover a contiguous range,
    # so the output is the union of those ranges, each filled from a small zeroed segment.
    num_chunks = offsets.shape[1]
    flat_offsets = offsets.reshape(-1)
    order = _radix_argsort(flat_offsets)
    grads = grad_rows.reshape(-1)
    total = 0
    run_end = np.int64(-1)
    for k in range(order.shape[0]):
        idx = order[k]
        length = min(chunk_size, embedding_dim - (idx % num_chunks) * chunk_size)
        dst = flat_offsets[idx]
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
    for k in range(order.shape[0]):
        idx = order[k]
        n = idx // num_chunks
        start = (idx % num_chunks) * chunk_size
        length = min(chunk_size, embedding_dim - start)
        dst = flat_offsets[idx]
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


@_parallel_kernel
def _sgd_kernel(weight, locations, values, lr):
    for k in prange(locations.shape[0]):
        weight[locations[k]] -= lr * values[k]


@_parallel_kernel
def _adagrad_kernel(weight, state_sum, locations, values, lr, eps):
    for k in prange(locations.shape[0]):
        i = locations[k]
        g = values[k]
        s = state_sum[i] + g * g
        state_sum[i] = s
        weight[i] -= lr * (g / (np.sqrt(s) + eps))


@_parallel_kernel
def _adam_kernel(weight, exp_avg, exp_avg_sq, locations, values, beta1, beta2, eps, step_size):
    one_minus_beta1 = np.float32(1.0) - beta1
    one_minus_beta2 = np.float32(1.0) - beta2
    for k in prange(locations.shape[0]):
        i = locations[k]
        g = values[k]
        m = exp_avg[i] + (g - exp_avg[i]) * one_minus_beta1
        v = exp_avg_sq[i] + (g * g - exp_avg_sq[i]) * one_minus_beta2
        exp_avg[i] = m
        exp_avg_sq[i] = v
        weight[i] -= step_size * (m / (np.sqrt(v) + eps))


# Dry runs of the three steps above: the same float32 arithmetic, nothing written; they count the touched
# locations whose gradient, new weight or new optimizer state would not be finite.


@_parallel_kernel
def _sgd_nonfinite_kernel(weight, locations, values, lr):
    bad = 0
    for k in prange(locations.shape[0]):
        g = values[k]
        w = weight[locations[k]] - lr * g
        if not (np.isfinite(g) and np.isfinite(w)):
            bad += 1
    return bad


@_parallel_kernel
def _adagrad_nonfinite_kernel(weight, state_sum, locations, values, lr, eps):
    bad = 0
    for k in prange(locations.shape[0]):
        i = locations[k]
        g = values[k]
        s = state_sum[i] + g * g
        w = weight[i] - lr * (g / (np.sqrt(s) + eps))
        if not (np.isfinite(g) and np.isfinite(s) and np.isfinite(w)):
            bad += 1
    return bad


@_parallel_kernel
def _adam_nonfinite_kernel(weight, exp_avg, exp_avg_sq, locations, values, beta1, beta2, eps, step_size):
    one_minus_beta1 = np.float32(1.0) - beta1
    one_minus_beta2 = np.float32(1.0) - beta2
    bad = 0
    for k in prange(locations.shape[0]):
        i = locations[k]
        g = values[k]
        m = exp_avg[i] + (g - exp_avg[i]) * one_minus_beta1
        v = exp_avg_sq[i] + (g * g - exp_avg_sq[i]) * one_minus_beta2
        w = weight[i] - step_size * (m / (np.sqrt(v) + eps))
        if not (np.isfinite(g) and np.isfinite(m) and np.isfinite(v) and np.isfinite(w)):
            bad += 1
    return bad


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
# public API (torch in, torch out)


def _start_numba_threads() -> None:
    """Start numba's thread pool now, keeping torch's thread count.

    Both use the process's OpenMP runtime, and numba's first start resets its thread count to every core:
    a ``torch.set_num_threads(1)`` made before the first kernel call would silently become ``cpu_count``.
    """
    torch_threads = torch.get_num_threads()
    numba.get_num_threads()  # starts the threading layer
    if torch.get_num_threads() != torch_threads:
        torch.set_num_threads(torch_threads)


_start_numba_threads()


def _target_features() -> set[str]:
    """The CPU features numba compiles for: the host's, or ``NUMBA_CPU_FEATURES`` when set."""
    features = numba.config.CPU_FEATURES or numba_codegen.get_host_cpu_features()  # type: ignore[attr-defined]
    return {item[1:] for item in features.split(",") if item.startswith("+")}


_VECTOR_PREFIXES = ("sse", "ssse", "avx", "fma", "f16c", "neon", "sve", "asimd")


def compile_target() -> dict[str, str]:
    """What the kernels are compiled for: ``cpu`` (numba's target CPU name, ``NUMBA_CPU_NAME`` when set),
    ``vector_extensions`` (its enabled SIMD features), ``paper_hash`` (the formulation chosen for it)
    and whether ``emulated`` (numba told to target another CPU than the host's)."""
    vector = sorted(f for f in _target_features() if f.startswith(_VECTOR_PREFIXES))
    emulated = numba.config.CPU_NAME is not None or numba.config.CPU_FEATURES is not None  # type: ignore[attr-defined]
    return {
        "cpu": numba.config.CPU_NAME or llvm_binding.get_host_cpu_name(),  # type: ignore[attr-defined]
        "vector_extensions": " ".join(vector),
        "paper_hash": _PAPER_FORMULATION,
        "emulated": "yes" if emulated else "no",
    }


def set_kernel_threads() -> int:
    """Make numba use ``torch.get_num_threads()`` threads (capped at numba's pool); returns the count."""
    threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)
    return threads


# The paper hash's mod P for 2**16 <= P < 2**31: "split32" (32-bit halves, exact corrections, then the
# per-chunk reduction in float64) or "float64" (int64 <-> float64 conversions and 64-bit multiplies,
# which only AVX-512 DQ + VL has in vector registers). Since split32 reduces each chunk in float64 where
# no key sum of the block wraps, it is ahead on both kinds of CPU: the "hashing alone" row of
# ``python -m robez_core.bench --quick --no-report`` (1 thread, dev box, 2026-11-23, two runs each) went
# from 0.111 / 0.108 ms (float64) to 0.079 / 0.085 ms (split32) on AVX-512, and with --emulate-avx2 from
# 0.200 ms (split32 without the float64 chunk pass) to 0.120 ms. float64 still takes a P in
# [2**31, 2**52). Tests set it to force either path on any CPU.
_PAPER_FORMULATION = "split32"


def _check_shape(memory_size: int, chunk_size: int, embedding_dim: int, hash: str) -> int:
    """Validate a table shape; returns the hash range ``memory_size - chunk_size + 1``."""
    if chunk_size < 1 or embedding_dim < 1:
        raise ConfigError(f"chunk_size and embedding_dim must be >= 1, got {chunk_size}, {embedding_dim}")
    if hash not in HASH_NAMES:
        raise ConfigError(f"unknown hash {hash!r}; expected one of {HASH_NAMES}")
    range_size = memory_size - chunk_size + 1
    if range_size < 1:
        raise ConfigError(f"memory_size ({memory_size}) must be >= chunk_size ({chunk_size})")
    if hash == "fast" and range_size > MAX_FAST_RANGE:
        raise ConfigError(f"hash='fast' needs memory_size - chunk_size + 1 <= 2**32, got {range_size}")
    return range_size


def _hash_setup(
    hash: str, random_numbers: torch.Tensor, memory_size: int, chunk_size: int, embedding_dim: int = 1
) -> tuple[int, np.ndarray, int]:
    """(kernel hash mode, constants as numpy int64 (11,), range size) for a validated table shape."""
    range_size = _check_shape(memory_size, chunk_size, embedding_dim, hash)
    if random_numbers.dtype != torch.int64 or tuple(random_numbers.shape) != (NUM_RANDOM_NUMBERS,):
        raise ConfigError(f"random_numbers must be int64 ({NUM_RANDOM_NUMBERS},)")
    constants = random_numbers.contiguous().numpy()
    prime = int(constants[0])
    if prime <= 0:
        raise ConfigError("random_numbers[0] is the modulus P and must be positive")
    if hash == "fast":
        return _MODE_FAST, constants, range_size
    if _PAPER_FORMULATION == "split32" and _SPLIT_PRIME_RANGE[0] <= prime < _SPLIT_PRIME_RANGE[1]:
        return _MODE_PAPER_SPLIT, constants, range_size
    if _FLOAT_PRIME_RANGE[0] <= prime < _FLOAT_PRIME_RANGE[1]:
        return _MODE_PAPER_FLOAT, constants, range_size
    return _MODE_PAPER_GENERIC, constants, range_size


def _ids_np(ids: torch.Tensor, strided: bool = False) -> np.ndarray:
    """A numpy view of 1-D int64 ``ids``; contiguous unless ``strided`` lets a strided view through."""
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise InvalidInputError(
            f"ids must be a 1-D int64 tensor, got {ids.dtype} of shape {tuple(ids.shape)}"
        )
    return ids.numpy() if strided else ids.contiguous().numpy()


def _weight_np(weight: torch.Tensor) -> np.ndarray:
    if weight.dtype != torch.float32 or weight.dim() != 1 or not weight.is_contiguous():
        raise ConfigError("weight must be a contiguous 1-D float32 tensor")
    return weight.detach().numpy()


def _wrap_int64(value: int) -> int:
    """Python int -> the int64 with the same low 64 bits (val_offset is added with wrap-around)."""
    return ((int(value) + (1 << 63)) % (1 << 64)) - (1 << 63)


def _num_chunks(embedding_dim: int, chunk_size: int) -> int:
    return -(-embedding_dim // chunk_size)


def chunk_offsets(
    ids: torch.Tensor,
    num_chunks: int,
    chunk_size: int,
    memory_size: int,
    random_numbers: torch.Tensor,
    val_offset: int = 0,
    hash: str = "paper",
    dtype: torch.dtype = torch.int64,
) -> torch.Tensor:
    """Start offset of every chunk of every id: int64 (N, num_chunks) in ``[0, memory_size - chunk_size]``.

    Bit-exact with ``hashing.reference_chunk_offsets``. ``ids`` is int64 (N,); any int64 value is valid.
    ``dtype=torch.int32`` gives the same offsets as int32 (for ``gather`` and ``scatter_grad``; only
    when ``memory_size - chunk_size < 2**31``): half the bytes to write, keep and read back.
    """
    hash_mode, constants, range_size = _hash_setup(hash, random_numbers, memory_size, chunk_size)
    if dtype not in _OFFSET_DTYPES:
        raise ConfigError(f"offsets dtype must be torch.int64 or torch.int32, got {dtype}")
    if dtype == torch.int32 and not fits_int32_offsets(memory_size, chunk_size):
        raise ConfigError(f"int32 offsets need memory_size - chunk_size < 2**31 (m = {memory_size})")
    # A strided column (``pairs[:, 0]``) is hashed where it lies: the kernel reads each id once, and a
    # copy cost the training share 2-3.5% (paired, 2026-11-23), mostly the caches it went through.
    ids_np = _ids_np(ids, strided=True)
    out = _empty((ids_np.shape[0], num_chunks), _OFFSET_DTYPES[dtype])
    if ids_np.shape[0] and num_chunks:
        set_kernel_threads()
        _chunk_offsets_kernel(
            ids_np,
            np.int64(_wrap_int64(val_offset)),
            num_chunks,
            hash_mode,
            constants,
            range_size,
            out.numpy(),
            work=ids_np.shape[0] * num_chunks,
        )
    return out


# Chunk offsets may be int32 where every one fits: the training forward keeps them for the backward, and
# int32 halves what the hash writes and the gather and the backward read back (1 MB -> 0.5 MB for 32768
# ids x 4 chunks). In the training loop (2026-11-23, 1 thread, d = 100, Z = 32, m = 262144, paired steps)
# the share took 0.966x (AVX-512) / 0.974x (emulated AVX2) the time with int32 offsets when both arms
# called the kernels directly, and 0.979-0.984x through ``RobezEmbedding`` against the int64 version
# loaded side by side (three runs, two CPU kinds; trained arrays bitwise equal).
_OFFSET_DTYPES = {torch.int64: np.int64, torch.int32: np.int32}


def fits_int32_offsets(memory_size: int, chunk_size: int) -> bool:
    """Whether every chunk offset of an array of ``memory_size`` floats fits an int32."""
    return memory_size - chunk_size < 1 << 31


def _empty(shape: tuple[int, ...], dtype: type) -> torch.Tensor:
    """A new uninitialised CPU tensor whose memory numpy allocated, from ``buffers``' pool when large.

    glibc serves a multi-megabyte ``torch.empty`` with a fresh ``mmap`` every call, so writing a batch of
    rows first takes thousands of page faults (+0.3 ms on the 13 MB of a 32768 x 100 lookup, half the
    gather). numpy asks the kernel for transparent huge pages on large arrays, which makes those faults
    500x fewer, and the pool hands a freed batch's memory to the next one, so that whether it faults does
    not depend on what else the process allocated before (see ``buffers.py``). ``torch.from_numpy``
    shares the memory; the tensor behaves like any other.
    """
    return torch.from_numpy(buffers.empty(shape, dtype))


def _streaming(out: torch.Tensor, embedding_dim: int, chunk_size: int) -> bool:
    """Stream rows past the cache when the batch outgrows it and every chunk lands 16-byte aligned."""
    return (
        out.numel() * 4 >= _STREAMING_MIN_BYTES
        and embedding_dim % 4 == 0
        and chunk_size % 4 == 0
        and out.data_ptr() % 16 == 0
    )


def _out_rows(out: torch.Tensor | None, num_rows: int, embedding_dim: int) -> torch.Tensor:
    if out is None:
        return _empty((num_rows, embedding_dim), np.float32)
    if out.dtype != torch.float32 or tuple(out.shape) != (num_rows, embedding_dim) or not out.is_contiguous():
        raise ConfigError(f"out must be a contiguous float32 tensor of shape ({num_rows}, {embedding_dim})")
    return out


def gather(
    weight: torch.Tensor,
    offsets: torch.Tensor,
    embedding_dim: int,
    chunk_size: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows from chunk offsets: float32 (N, embedding_dim); ``offsets`` int64 or int32 (N, ceil(d / Z)).

    Offsets are trusted to lie in ``[0, len(weight) - chunk_size]`` (as ``chunk_offsets`` makes them).
    """
    weight_np = _weight_np(weight)
    if offsets.dtype not in _OFFSET_DTYPES or offsets.dim() != 2:
        raise InvalidInputError("offsets must be a 2-D int64 or int32 tensor")
    if offsets.shape[1] != _num_chunks(embedding_dim, chunk_size):
        raise InvalidInputError(f"offsets must have {_num_chunks(embedding_dim, chunk_size)} columns")
    result = _out_rows(out, offsets.shape[0], embedding_dim)
    if offsets.shape[0]:
        set_kernel_threads()
        _warm_table(weight_np, result.numel() * 4)
        _gather_kernel.for_chunk(chunk_size)(
            weight_np,
            offsets.contiguous().numpy(),
            embedding_dim,
            chunk_size,
            _streaming(result, embedding_dim, chunk_size),
            weight_np.nbytes >= _PREFETCH_READ_MIN_BYTES,
            result.numpy(),
            work=result.numel(),
        )
    return result


def lookup(
    weight: torch.Tensor,
    ids: torch.Tensor,
    embedding_dim: int,
    chunk_size: int,
    random_numbers: torch.Tensor,
    val_offset: int = 0,
    hash: str = "paper",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused hash + gather: float32 (N, embedding_dim) rows of int64 ``ids`` (N,) from ``weight`` (m,)."""
    hash_mode, constants, _ = _hash_setup(hash, random_numbers, weight.shape[0], chunk_size, embedding_dim)
    weight_np = _weight_np(weight)
    ids_np = _ids_np(ids)
    result = _out_rows(out, ids_np.shape[0], embedding_dim)
    if ids_np.shape[0]:
        set_kernel_threads()
        _warm_table(weight_np, result.numel() * 4)
        _lookup_kernel.for_chunk(chunk_size)(
            weight_np,
            ids_np,
            np.int64(_wrap_int64(val_offset)),
            embedding_dim,
            chunk_size,
            hash_mode,
            constants,
            _streaming(result, embedding_dim, chunk_size),
            weight_np.nbytes >= _PREFETCH_READ_MIN_BYTES,
            result.numpy(),
            work=result.numel(),
        )
    return result


def lookup_bag(
    weight: torch.Tensor,
    ids: torch.Tensor,
    bag_offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    mode: BagMode,
    embedding_dim: int,
    chunk_size: int,
    random_numbers: torch.Tensor,
    val_offset: int = 0,
    hash: str = "paper",
) -> torch.Tensor:
    """Fused pooled lookup: float32 (B, embedding_dim), like ``F.embedding_bag(..., offsets=bag_offsets)``.

    ``bag_offsets`` int64 (B,) are the start of each bag in ``ids`` (N,) (non-decreasing, first 0, last
    <= N; a bag runs to the next start or to N). ``per_sample_weights`` float32 (N,) scales each row
    before pooling (``mode="sum"`` only, as in torch). Empty bags give zeros.
    """
    hash_mode, constants, _ = _hash_setup(hash, random_numbers, weight.shape[0], chunk_size, embedding_dim)
    if mode not in ("sum", "mean"):
        raise ConfigError(f"mode must be 'sum' or 'mean', got {mode!r}")
    weight_np = _weight_np(weight)
    ids_np = _ids_np(ids)
    if bag_offsets.dtype != torch.int64 or bag_offsets.dim() != 1:
        raise InvalidInputError("bag offsets must be a 1-D int64 tensor")
    offsets_np = bag_offsets.contiguous().numpy()
    if offsets_np.shape[0] and (
        offsets_np[0] != 0 or offsets_np[-1] > ids_np.shape[0] or np.any(np.diff(offsets_np) < 0)
    ):
        raise InvalidInputError("bag offsets must start at 0, be non-decreasing and not exceed len(ids)")
    if per_sample_weights is None:
        weights_np = np.empty(0, dtype=np.float32)
    else:
        if mode != "sum":
            raise InvalidInputError("per_sample_weights is only supported with mode='sum'")
        if per_sample_weights.dtype != torch.float32 or tuple(per_sample_weights.shape) != tuple(ids.shape):
            raise InvalidInputError("per_sample_weights must be float32 with the shape of ids")
        weights_np = per_sample_weights.detach().contiguous().numpy()
    out = _empty((offsets_np.shape[0], embedding_dim), np.float32)
    if offsets_np.shape[0]:
        set_kernel_threads()
        _lookup_bag_kernel(
            weight_np,
            ids_np,
            offsets_np,
            weights_np,
            per_sample_weights is not None,
            mode == "mean",
            np.int64(_wrap_int64(val_offset)),
            embedding_dim,
            chunk_size,
            hash_mode,
            constants,
            weight_np.nbytes >= _PREFETCH_READ_MIN_BYTES,
            out.numpy(),
            work=ids_np.shape[0] * embedding_dim,
        )
    return out


def _scratch(name: str, size: int, dtype: type) -> np.ndarray:
    """A 1-D scratch array of at least ``size`` elements (contents undefined), kept per thread.

    A fresh multi-megabyte buffer per call costs page faults: glibc hands freed memory back to the kernel,
    and on this VM that made a 262144-location coalesce 3.6 ms instead of 1.3 ms. Buffers up to
    ``_SCRATCH_MAX_BYTES`` are kept for the next call of the same thread (kernels run without the GIL,
    so threads must not share them); bigger ones are allocated each time.
    """
    nbytes = size * np.dtype(dtype).itemsize
    if nbytes > _SCRATCH_MAX_BYTES:
        return np.empty(size, dtype=dtype)
    buffers: dict[str, np.ndarray] | None = getattr(_thread_scratch, "buffers", None)
    if buffers is None:
        buffers = _thread_scratch.buffers = {}
    buffer = buffers.get(name)
    if buffer is None or buffer.shape[0] < size or buffer.dtype != dtype:
        buffer = buffers[name] = np.empty(size, dtype=dtype)
    return buffer


def _grad_inputs(
    grad_rows: torch.Tensor, offsets: torch.Tensor, chunk_size: int, keep_int32: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """numpy views for a backward kernel; offsets as int64 unless ``keep_int32`` lets int32 ones through."""
    if grad_rows.dim() != 2 or offsets.dim() != 2 or grad_rows.shape[0] != offsets.shape[0]:
        raise InvalidInputError("grad_rows (N, d) and offsets (N, C) must have the same N")
    if offsets.shape[1] != _num_chunks(grad_rows.shape[1], chunk_size):
        raise InvalidInputError("offsets must have ceil(d / chunk_size) columns")
    grads = grad_rows.detach().to(torch.float32).contiguous().numpy()
    keep = keep_int32 and offsets.dtype == torch.int32
    return grads, (offsets if keep else offsets.to(torch.int64)).contiguous().numpy()


def scatter_grad(grad_rows: torch.Tensor, offsets: torch.Tensor, chunk_size: int, out: torch.Tensor) -> None:
    """Dense backward, in place: ``out[offsets[n, c] + j] += grad_rows[n, c * Z + j]``; out float32 (m,).
    ``offsets`` int64 or int32 (as ``chunk_offsets(..., dtype=torch.int32)`` gives them)."""
    grads, offsets_np = _grad_inputs(grad_rows, offsets, chunk_size, keep_int32=True)
    if out.dtype != torch.float32 or out.dim() != 1 or not out.is_contiguous():
        raise ConfigError("out must be a contiguous 1-D float32 tensor")
    if grads.shape[0] == 0:
        return
    threads = set_kernel_threads()
    out_np = out.detach().numpy()
    memory_size = out.shape[0]
    if threads == 1 or grads.shape[0] < 256:
        prefetch = out_np.nbytes >= _PREFETCH_WRITE_MIN_BYTES
        kernel = _scatter_serial_kernel.for_chunk(chunk_size).serial
        kernel(grads, offsets_np, grads.shape[1], chunk_size, prefetch, out_np)
    elif memory_size * threads <= _PRIVATE_SCATTER_MAX_FLOATS:
        kernel = _scatter_private_kernel.for_chunk(chunk_size).parallel
        kernel(grads, offsets_np, grads.shape[1], chunk_size, out_np, threads)
    else:
        _scatter_partitioned_kernel(grads, offsets_np, grads.shape[1], chunk_size, out_np, threads)


def coalesce_grad(
    grad_rows: torch.Tensor, offsets: torch.Tensor, chunk_size: int, memory_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse backward: sorted unique locations int64 (K,) and their summed gradients float32 (K,).

    Uses a dense (m,) scratch buffer when ``memory_size`` is small next to the number of gradient values,
    and a sort of the chunk starts otherwise, so a huge array never costs O(m) memory or time.
    """
    grads, offsets_np = _grad_inputs(grad_rows, offsets, chunk_size)
    if grads.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.float32)
    if memory_size <= _DENSE_COALESCE_FACTOR * grads.size:
        values_dense = _scratch("coalesce.values", memory_size, np.float32)
        coverage = _scratch("coalesce.coverage", memory_size + 1, np.int32)
        locations, values = _coalesce_dense_kernel(
            grads, offsets_np, grads.shape[1], chunk_size, memory_size, values_dense, coverage
        )
    else:
        locations, values = _coalesce_sorted_kernel(grads, offsets_np, grads.shape[1], chunk_size)
    return torch.from_numpy(locations), torch.from_numpy(values)


def _step_inputs(
    weight: torch.Tensor, locations: torch.Tensor, values: torch.Tensor
) -> tuple[np.ndarray, ...]:
    if (
        locations.dtype != torch.int64
        or locations.dim() != 1
        or tuple(values.shape) != tuple(locations.shape)
    ):
        raise InvalidInputError("locations must be int64 (K,) and values (K,)")
    return (
        _weight_np(weight),
        locations.contiguous().numpy(),
        values.detach().to(torch.float32).contiguous().numpy(),
    )


def _state_np(state: torch.Tensor, weight: torch.Tensor, name: str) -> np.ndarray:
    if state.dtype != torch.float32 or state.shape != weight.shape or not state.is_contiguous():
        raise ConfigError(f"{name} must be a contiguous float32 tensor shaped like weight")
    return state.detach().numpy()


def sgd_step(weight: torch.Tensor, locations: torch.Tensor, values: torch.Tensor, lr: float) -> None:
    """In place ``weight[loc] -= lr * g`` (like ``torch.optim.SGD``); ``locations`` must be unique."""
    weight_np, loc_np, val_np = _step_inputs(weight, locations, values)
    set_kernel_threads()
    _sgd_kernel(weight_np, loc_np, val_np, np.float32(lr), work=loc_np.shape[0])


def sgd_nonfinite(weight: torch.Tensor, locations: torch.Tensor, values: torch.Tensor, lr: float) -> int:
    """How many of ``locations`` ``sgd_step`` would leave non-finite (or have a non-finite gradient);
    reads only, so a caller can refuse the step before changing anything."""
    weight_np, loc_np, val_np = _step_inputs(weight, locations, values)
    set_kernel_threads()
    return int(_sgd_nonfinite_kernel(weight_np, loc_np, val_np, np.float32(lr), work=loc_np.shape[0]))


def adagrad_nonfinite(
    weight: torch.Tensor,
    state_sum: torch.Tensor,
    locations: torch.Tensor,
    values: torch.Tensor,
    lr: float,
    eps: float,
) -> int:
    """As ``sgd_nonfinite`` for ``adagrad_step`` (its weight and its ``state_sum``)."""
    weight_np, loc_np, val_np = _step_inputs(weight, locations, values)
    set_kernel_threads()
    state_np = _state_np(state_sum, weight, "state_sum")
    work = loc_np.shape[0]
    return int(
        _adagrad_nonfinite_kernel(
            weight_np, state_np, loc_np, val_np, np.float32(lr), np.float32(eps), work=work
        )
    )


def adam_nonfinite(
    weight: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    locations: torch.Tensor,
    values: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
) -> int:
    """As ``sgd_nonfinite`` for ``adam_step`` (its weight and both moments) taken as step ``step``."""
    step_size = adam_step_size(lr, beta1, beta2, step)
    weight_np, loc_np, val_np = _step_inputs(weight, locations, values)
    set_kernel_threads()
    return int(
        _adam_nonfinite_kernel(
            weight_np,
            _state_np(exp_avg, weight, "exp_avg"),
            _state_np(exp_avg_sq, weight, "exp_avg_sq"),
            loc_np,
            val_np,
            np.float32(beta1),
            np.float32(beta2),
            np.float32(eps),
            np.float32(step_size),
            work=loc_np.shape[0],
        )
    )


def adam_step_size(lr: float, beta1: float, beta2: float, step: int) -> float:
    """The bias-corrected step size of Adam step number ``step`` (1 for the first update), in float64: the
    one formula every Adam path (``adam_step``, ``adam_nonfinite``, the small-batch step) must share to stay
    bit-identical."""
    if step < 1:
        raise ConfigError(f"step must be >= 1, got {step}")
    return lr * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)


def adagrad_step(
    weight: torch.Tensor,
    state_sum: torch.Tensor,
    locations: torch.Tensor,
    values: torch.Tensor,
    lr: float,
    eps: float,
) -> None:
    """In place Adagrad (``torch.optim.Adagrad``, lr_decay=0): ``sum += g*g; w -= lr*g / (sqrt(sum)+eps)``.

    ``state_sum`` float32 (m,) starts at the initial accumulator value; ``locations`` must be unique.
    """
    weight_np, loc_np, val_np = _step_inputs(weight, locations, values)
    set_kernel_threads()
    _adagrad_kernel(
        weight_np,
        _state_np(state_sum, weight, "state_sum"),
        loc_np,
        val_np,
        np.float32(lr),
        np.float32(eps),
        work=loc_np.shape[0],
    )


def adam_step(
    weight: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    locations: torch.Tensor,
    values: torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
) -> None:
    """In place lazy Adam, as ``torch.optim.SparseAdam``: only ``locations`` (unique) are touched.

    ``step`` is the step number being taken (1 for the first update); the bias corrections use it.
    """
    step_size = adam_step_size(lr, beta1, beta2, step)
    weight_np, loc_np, val_np = _step_inputs(weight, locations, values)
    set_kernel_threads()
    _adam_kernel(
        weight_np,
        _state_np(exp_avg, weight, "exp_avg"),
        _state_np(exp_avg_sq, weight, "exp_avg_sq"),
        loc_np,
        val_np,
        np.float32(beta1),
        np.float32(beta2),
        np.float32(eps),
        np.float32(step_size),
        work=loc_np.shape[0],
    )
