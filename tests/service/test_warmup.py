"""Start-up leaves nothing to the first requests: every kernel path compiled (or loaded from numba's cache)
before the worker is ready, and the start-up objects frozen out of the collector's full passes without
keeping a deleted table's mapping alive."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from robez_core.table import Table
from service.routes import tables as tables_routes

from .conftest import store_of
from .forked import ForkedPython

# In a process that has run no kernel yet (a fork of one that only imported robez, ``forked.py``) at two
# kernel threads: the compiled signatures of every numba dispatcher of robez_core after the start-up
# warm-up, then after requests of every size class; they must not grow.
_CHECK = """
import sys, numba, torch
from numba.core.registry import CPUDispatcher
from service.config import Settings
from service.store import TableStore
from service.store.journal import NullJournal
from service.warmup import warm_kernels, warm_kind
from service.config import TableSpec
from robez_core.config import OptimizerConfig, TableConfig

def compiled():
    counts = {}
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("robez_core"):
            for name in dir(module):
                for copy in ("", "serial", "parallel"):
                    kernel = getattr(module, name)
                    dispatcher = getattr(kernel, copy, None) if copy else kernel
                    if isinstance(dispatcher, CPUDispatcher):
                        counts[f"{module_name}.{name}.{copy}"] = len(dispatcher.signatures)
    return counts

torch.set_num_threads(2)
numba.set_num_threads(2)
settings = Settings(_env_file=None, shm_dir=SHM, threads_per_worker=2)
store = TableStore(TableStore.prepare(settings, NullJournal()), settings, NullJournal())
store.warm_up()
WARM
TABLE = "demo"
LATER
after_start = compiled()
for size in (1, 10, 64, 65, 300, 4096, 50_000, 262_144):
    ids = torch.randint(0, 10**9, (size,), dtype=torch.int64)
    store.lookup(TABLE, ids.numpy())
    store.lookup(TABLE, ids, torch.tensor([0]), "mean")
    if size <= 65_536:
        store.update(TABLE, ids, torch.zeros(size, store.table(TABLE).config.embedding_dim))
grown = {name: (count, after_start.get(name, 0)) for name, count in compiled().items()
         if count > after_start.get(name, 0)}
print("compiled by requests:", grown)
store.close()
"""


# A table of another kind (dimension, chunk size, optimizer) created after the start, as through the API.
_LATER = """
TABLE = "later"
spec = TableSpec(TableConfig(10**9, 24, memory_size=1 << 18, chunk_size=8), OptimizerConfig(name="adagrad"))
store.create(TABLE, spec)
"""


def _compiled_by_requests(forks: ForkedPython, tmp_path: Path, warm: str, later: str = "") -> str:
    code = _CHECK.replace("SHM", repr(str(tmp_path / "shm"))).replace("WARM", warm).replace("LATER", later)
    out = forks.run(code, [], timeout_s=600)
    assert "compiled by requests:" in out.stdout, out.stdout + out.stderr[-3000:]
    return out.stdout


def test_no_request_compiles_a_kernel_after_start_up(tmp_path: Path, forked_python: ForkedPython) -> None:
    """After ``warm_kernels`` (what a worker runs before it is ready), lookups, bag lookups and pushes
    of every size up to the limits compile nothing (loading from numba's cache counts as compiling: a
    request would pay for it too). ``TableStore.warm_up`` alone leaves the parallel copies to requests."""
    assert "compiled by requests: {}" in _compiled_by_requests(forked_python, tmp_path, "warm_kernels(store)")
    assert "compiled by requests: {}" not in _compiled_by_requests(forked_python, tmp_path, "")


def test_a_table_of_a_new_kind_is_warmed_by_its_create_not_its_first_requests(
    tmp_path: Path, forked_python: ForkedPython
) -> None:
    """A table created after the start with a kind the start-up did not warm (``POST /v1/tables``, a
    replica's bootstrap from its log: both call ``warm_kind``): after ``warm_kind``, its requests of every
    size compile nothing; without it they did (a replica's first push of a new kind waited 3.2 s for
    its kernels in a fresh clone)."""
    warmed = _LATER + "warm_kind(store.table(TABLE))\n"
    warm = "warm_kernels(store)"
    assert "compiled by requests: {}" in _compiled_by_requests(forked_python, tmp_path, warm, warmed)
    assert "compiled by requests: {}" not in _compiled_by_requests(forked_python, tmp_path, warm, _LATER)


def test_the_create_route_warms_the_new_tables_kind(
    client_factory: Callable[..., TestClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    warmed: list[tuple[int, int]] = []

    def record(table: Table) -> bool:
        warmed.append((table.config.embedding_dim, table.config.chunk_size))
        return True

    monkeypatch.setattr(tables_routes, "warm_kind", record)
    client = client_factory()
    config = {"num_embeddings": 1000, "embedding_dim": 8, "memory_size": 4096, "chunk_size": 4}
    assert client.post("/v1/tables", json={"name": "fresh", "config": config}).status_code == 201
    assert warmed == [(8, 4)]


def test_start_up_objects_are_frozen_and_a_deleted_table_is_unmapped(
    client_factory: Callable[..., TestClient], tmp_path: Path
) -> None:
    client = client_factory(write_api_key="w" * 32)
    # Made by the start-up, so frozen by it, not by tests/conftest.py (which froze what the test found):
    # gc.get_objects() lists what full collections walk, the frozen objects left out.
    store = store_of(client)
    assert gc.is_tracked(store) and not any(candidate is store for candidate in gc.get_objects())
    shm = str(tmp_path / "shm")

    def mapped() -> int:
        return sum(shm in line for line in Path("/proc/self/maps").read_text().splitlines())

    before = mapped()
    assert before > 0
    reply = client.delete("/v1/tables/demo", headers={"Authorization": "Bearer " + "w" * 32})
    assert reply.status_code in (200, 204), reply.text
    gc.collect()
    assert mapped() < before, "a frozen start-up object still holds the deleted table's mapping"
