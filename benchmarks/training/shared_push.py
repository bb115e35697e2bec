"""A server's apply of a DLRM push alone, in process (issue 37): ``TableStore.update_many`` of 26 tables over
one shared array in ``/dev/shm`` (the benchmark's tables: ``benchmarks/training/dlrm.py``, Adagrad, no data
directory, 1 kernel thread, the server's malloc tuning), each push decoded from its binary body as the
route decodes it. Prints the medians (ms) of the decode and of ``update_many`` (hash, check, coalesce,
checked step) after the first 12 pushes, and a digest of the array and its state at the end (two
checkouts that apply the same pushes must print the same). Run it from several checkouts with
``PYTHONPATH`` to compare them (``docs/benchmarks/dlrm-apply-2026-11-28.md``):

    flock /tmp/robez-bench.lock python -m benchmarks.training.shared_push --rounds 5
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numba
import numpy as np
import torch

from benchmarks.training.dlrm import Settings as DlrmSettings
from benchmarks.training.dlrm import SyntheticCriteo
from robez_core import OptimizerConfig, TableConfig
from robez_core.allocator import keep_freed_buffers
from service.codec import decode_multi_update_binary
from service.config import Settings, TableSpec
from service.log.entry import UpdatePart
from service.store.journal import NullJournal
from service.store.tables import TableStore

PUSHES = 12


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--rounds", type=int, default=5, help=f"passes over {PUSHES} pushes (the first untimed)"
    )
    args = parser.parse_args()
    keep_freed_buffers(32)  # as a server worker (service.config malloc_mmap_threshold_mb)
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    dlrm = DlrmSettings()
    shm = tempfile.mkdtemp(dir="/dev/shm", prefix="robez-shared-push-")
    try:
        settings = Settings(_env_file=None, shm_dir=Path(shm), threads_per_worker=1, default_table=False)  # type: ignore[call-arg]
        store = TableStore(TableStore.prepare(settings, NullJournal()), settings, NullJournal())
        first: str | None = None
        offset = 0
        for f, n in enumerate(dlrm.cardinalities):
            config = TableConfig(
                n, 16, memory_size=dlrm.memory_size, chunk_size=32, seed=1, val_offset=offset, init_scale=0.01
            )
            offset += n
            store.create(f"t{f}", TableSpec(config, OptimizerConfig("adagrad", lr=0.05), first))
            first = first or f"t{f}"
        data = SyntheticCriteo(dlrm)
        rows = dlrm.batch_size
        tables = ",".join(f"t{f}={rows}" for f in range(26))
        shapes = ";".join(f"{rows},16" for f in range(26))
        bodies = []
        for index in range(PUSHES):
            ids = data.batch(index).values.numpy()
            grads = np.random.default_rng(index).standard_normal((26 * rows, 16)).astype(np.float32) * 0.01
            bodies.append(
                b"".join(
                    ids[f * rows : (f + 1) * rows].astype("<i8").tobytes()
                    + grads[f * rows : (f + 1) * rows].astype("<f4").tobytes()
                    for f in range(26)
                )
            )
        applied, decoded = [], []
        for _ in range(args.rounds):
            for body in bodies:
                start = time.perf_counter()
                parts = [
                    UpdatePart(n, i, g) for n, i, g, _ in decode_multi_update_binary(body, tables, shapes)
                ]
                middle = time.perf_counter()
                store.update_many(parts)
                applied.append((time.perf_counter() - middle) * 1e3)
                decoded.append((middle - start) * 1e3)
        applied, decoded = applied[PUSHES:], decoded[PUSHES:]
        print(f"decode median {statistics.median(decoded):.2f} min {min(decoded):.2f} ms")
        median, fastest = statistics.median(applied), min(applied)
        print(f"update_many median {median:.2f} min {fastest:.2f} ms (n={len(applied)})")
        table = store.table("t0")
        digests = [
            hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16] for t in (table.weight, table.state["sum"])
        ]
        print("digest", *digests)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
