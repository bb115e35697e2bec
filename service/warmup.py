"""Every compiled kernel a worker's tables can use, compiled (or loaded from numba's disk cache) before the
worker says it is ready, so no request pays for it (a fresh clone's first push took 5.4 s; numba
compiles a kernel on its first call with each signature, serial and ``prange`` copies apart).

``TableStore.warm_up`` loads the one-id paths; ``warm_kernels`` adds the batch sizes that pick the other
paths: the parallel copies (past ``_PARALLEL_MIN_WORK`` values, when the worker runs several kernel
threads), the bag lookups (sum, mean, weighted), and the update's small-batch step, sorted and dense
coalesces, and the one-pass checked step of a push without a data directory. Lookups read the real
tables; updates run on a private table of each kind (same dimension, chunk size, hash and optimizer), so
nothing shared changes. ``warm_kind`` runs the private part once per kind of table and process: a table
created later (``POST /v1/tables``, or a replica's bootstrap from its log) has its kind warmed by that
create or bootstrap, not by its first push or lookup. A table of more than 2^31 values takes the
64-bit-offset updates, which compile on its first push (such a table would need its twin in memory).

``python -m service.warmup`` runs it once for the demo table's kind: the container image's build runs it,
so the image ships numba's cache (``NUMBA_CACHE_DIR``) warm for a machine of the build's CPU.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

import torch
import torch.nn.functional as F

from robez_core.config import TableConfig
from robez_core.table import Table

from .config import demo_table_spec
from .log.entry import apply_record, prepare
from .metrics import Metrics
from .store import TableStore

logger = logging.getLogger("robez.warmup")

# Batch sizes (ids) that take each path: one id, the small-batch step (<= 64 ids), a sorted coalesce, the
# dense coalesce, and 65,536 ids: past the parallel threshold (_PARALLEL_MIN_WORK values) for every kernel
# whatever the table's dimension (the lookups' chunk offsets count ids x chunks).
_LOOKUP_SIZES = (1, 256, 4096)
_UPDATE_SIZES = (1, 64, 512, 8192)
_PARALLEL_SIZE = 1 << 16  # only at several kernel threads: at one, every kernel runs its serial copy
_BAG_SIZE = 8


def _sizes(sizes: tuple[int, ...]) -> tuple[int, ...]:
    return (*sizes, _PARALLEL_SIZE) if torch.get_num_threads() > 1 else sizes


# The kinds of table (dimension, chunk size, hash, optimizer) this process has warmed: numba keeps
# what it compiled or loaded for the process's life.
_WARMED: set[tuple[int, int, Any, Any]] = set()


def warm_kind(table: Table) -> bool:
    """Every update path and the fused lookups for ``table``'s kind, on a private table (nothing shared
    changes), unless this process did it already; True if it ran."""
    config = table.config
    return _warm_once((config.embedding_dim, config.chunk_size, config.hash, table.optimizer))


def _warm_once(kind: tuple[int, int, Any, Any]) -> bool:
    """``_warm_private`` of ``kind`` unless this process did it already; True if it ran."""
    if kind in _WARMED:
        return False
    _warm_private(*kind)
    _WARMED.add(kind)
    return True


def _warm_private(embedding_dim: int, chunk_size: int, hash_name: Any, optimizer: Any) -> None:
    """Updates (and lookups) of a private table of this kind, at every batch size of ``_UPDATE_SIZES``
    (and the fused lookup at every size of ``_LOOKUP_SIZES``)."""
    memory_size = 1 << 20  # room for more touched locations than the parallel threshold (4 MiB)
    config = TableConfig(
        1 << 20, embedding_dim, memory_size=memory_size, chunk_size=chunk_size, hash=hash_name
    )
    private = Table(config, optimizer)
    generator = torch.Generator().manual_seed(0)
    for size in _sizes(_UPDATE_SIZES):
        ids = torch.randint(0, 1 << 20, (size,), generator=generator, dtype=torch.int64)
        grads = torch.zeros(size, embedding_dim)
        private.gather(private.hash(ids))
        private.lookup_timed(ids)
        private.apply_gradients(ids, grads)
        apply_record(private, ids, grads, private.optimizer.lr)
        # and the one-pass checked step of a push without a data directory (``check_in_step``)
        step, _ = prepare(private, ids, grads, private.optimizer.lr)
        apply_record(private, ids, grads, private.optimizer.lr, step=step, check_in_step=True)


def warm_kernels(store: TableStore, metrics: Metrics | None = None) -> float:
    """Run every kernel path of ``store``'s tables once (module docstring), and create each table's stage
    histograms in ``metrics`` (in multiprocess mode a new series grows the worker's metric files: the
    first lookup would pay for it); returns the seconds taken."""
    start = time.perf_counter()
    kinds = set()
    for name in store.names():
        if metrics is not None:
            metrics.stages(name)
        table = store.table(name)
        config = table.config
        kinds.add((config.embedding_dim, config.chunk_size, config.hash, table.optimizer))
        for size in _sizes(_LOOKUP_SIZES):  # through the table: the store's limits may be smaller
            ids = torch.arange(size, dtype=torch.int64)
            table.lookup_timed(ids.numpy())
            rows, _, _ = table.lookup_timed(ids)
            offsets = torch.arange(0, size, _BAG_SIZE, dtype=torch.int64)
            positions = torch.arange(size, dtype=torch.int64)
            for mode in ("sum", "mean"):  # the store pools bags with torch's embedding_bag
                F.embedding_bag(positions, rows, offsets, mode=mode)
            F.embedding_bag(positions, rows, offsets, mode="sum", per_sample_weights=torch.ones(size))
    if not kinds:  # no table yet: the default kind, which the first table created most likely has
        demo = demo_table_spec()
        kinds.add((demo.config.embedding_dim, demo.config.chunk_size, demo.config.hash, demo.optimizer))
    for kind in kinds:
        _warm_once(kind)
    seconds = time.perf_counter() - start
    logger.info("kernels warm for %d table kind(s) in %.1f s", len(kinds), seconds)
    return seconds


def freeze_startup_objects() -> None:
    """Move every object alive after start-up (imports, settings, the tables' mappings) out of the
    collector's reach (``gc.freeze``): a full collection no longer walks the ~300k of them, a stall of
    every request of the worker (~120 ms, once in ~7,500 requests). ``thaw`` undoes it at the stop."""
    gc.collect()
    gc.freeze()


def thaw() -> None:
    gc.unfreeze()


def main() -> None:
    """Compile (or load) the demo kind's kernels at 1 and at several threads: the image build's step."""
    logging.basicConfig(level=logging.INFO)
    demo = demo_table_spec()
    config = demo.config
    for threads in (1, 2):
        torch.set_num_threads(threads)
        _warm_private(config.embedding_dim, config.chunk_size, config.hash, demo.optimizer)
        table = Table(
            TableConfig(1 << 20, config.embedding_dim, memory_size=1 << 16, chunk_size=config.chunk_size)
        )
        for size in _sizes(_LOOKUP_SIZES):
            ids = torch.arange(size, dtype=torch.int64)
            table.lookup_timed(ids.numpy())
            table.lookup_timed(ids)


if __name__ == "__main__":
    main()
