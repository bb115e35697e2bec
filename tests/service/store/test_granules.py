"""The record of the granules changed while copies run (service/log/granules.py): every apply path marks
what it changes, through any worker's mapping, and only while a copy runs; copies running at once each
take only their own marks; a dead copy's bit is taken back."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from robez_core.config import OptimizerConfig, TableConfig
from robez_core.table import Table
from service.config import Settings, TableSpec
from service.log import granules, live_copy
from service.log.entry import UpdatePart, UpdateRecord
from service.log.journal import NullJournal
from service.shm import SharedDirectory
from service.store import TableStore

from ..conftest import make_settings

CONFIG = TableConfig(num_embeddings=5000, embedding_dim=8, memory_size=(1 << 14) + 40, chunk_size=4)
ADAM = OptimizerConfig.from_dict({"name": "adam", "lr": 0.05})


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return make_settings(tmp_path, default_table=False)


@pytest.fixture
def directory(settings: Settings) -> Iterator[SharedDirectory]:
    prepared = TableStore.prepare(settings, NullJournal())
    yield prepared
    prepared.remove()


def _changed(before: dict[str, np.ndarray], table: Table) -> np.ndarray:
    """A byte per granule: 1 where a value of an (m,) tensor differs from ``before``."""
    m = table.config.memory_size
    changed = np.zeros(granules.granule_count(m), dtype=bool)
    for key, tensor in table.tensors().items():
        now = tensor.detach().reshape(-1).numpy()
        if now.size != m:
            continue
        differs = now.view(np.uint8).reshape(m, -1) != before[key].view(np.uint8).reshape(m, -1)
        padded = np.zeros(changed.size * granules.GRANULE, dtype=bool)
        padded[:m] = differs.any(axis=1)
        changed |= padded.reshape(-1, granules.GRANULE).any(axis=1)
    return changed.view(np.uint8)


def test_every_apply_path_marks_the_granules_it_changes_while_a_copy_runs(
    settings: Settings, directory: SharedDirectory
) -> None:
    copier = TableStore(directory, settings, NullJournal())  # the worker that copies
    pusher = TableStore(directory, settings, NullJournal())  # another one, which pushes
    try:
        copier.create("t", TableSpec(CONFIG, ADAM))
        copier.create("u", TableSpec(CONFIG, ADAM, share_array_with="t"))
        table = copier.table("t")
        generator = torch.Generator().manual_seed(3)

        def grads(count: int) -> torch.Tensor:
            return torch.randn(count, 8, generator=generator)

        def ids(count: int) -> torch.Tensor:
            return torch.randint(0, 5000, (count,), generator=generator)

        small, prepared, of_t, of_u, logged = ids(10), ids(200), ids(30), ids(30), ids(40)
        pushes: list[tuple[str, Callable[[], object], list[tuple[Table, torch.Tensor]]]] = [
            # a small batch, hashed inside the compiled step
            ("small", lambda: pusher.update("t", small, grads(10)), [(table, small)]),
            # a prepared step, checked in the pass that applies it
            ("prepared", lambda: pusher.update("t", prepared, grads(200)), [(table, prepared)]),
            # one coalesced step of two tables over one array
            (
                "shared",
                lambda: pusher.update_many(
                    [UpdatePart("t", of_t, grads(30)), UpdatePart("u", of_u, grads(30))]
                ),
                [(table, of_t), (copier.table("u"), of_u)],
            ),
            # the replicated log's entry (a replica's applier)
            (
                "replicated",
                lambda: pusher.apply(UpdateRecord("t", pusher.version("t") + 1, logged, grads(40), 0.05)),
                [(table, logged)],
            ),
        ]
        marks = copier.registry.entry("t").marks
        for what, push, touched_by in pushes:
            with copier.exclusive("t"):
                slot = marks.begin()
            assert slot is not None
            before = {key: t.detach().reshape(-1).numpy().copy() for key, t in table.tensors().items()}
            push()
            with copier.exclusive("t"):
                taken = marks.take(slot)
                marks.end(slot)
            changed = _changed(before, table)
            touched = np.zeros_like(taken)
            for on, its_ids in touched_by:
                touched |= live_copy.touched(on, [its_ids.numpy()])
            assert changed.any(), what
            assert not (changed & ~taken).any(), what  # every granule changed is marked
            assert not (taken & ~touched).any(), what  # and only those the update's chunks cover
        # No copy running: nothing is marked.
        marks.marks[:] = 0
        pusher.update("t", small, grads(10))
        pusher.update("t", prepared, grads(200))
        assert not marks.marks.any()
    finally:
        copier.close()
        pusher.close()


def test_copies_take_only_their_own_marks_and_a_dead_copy_s_bit_is_taken_back() -> None:
    m = 1000
    raw = np.zeros(granules.record_bytes(m), dtype=np.uint8)
    record = granules.GranuleMarks(raw)
    assert not record.active()
    first = record.begin()
    record.mark_chunks(np.array([0, 130]), 4)  # granules 0 and 2
    second = record.begin()
    assert first is not None and second is not None and first != second
    record.mark_positions(np.array([64 * 5 + 3]))  # granule 5
    assert np.flatnonzero(record.take(first)).tolist() == [0, 2, 5]
    assert np.flatnonzero(record.take(first)).tolist() == []  # taken: cleared
    assert np.flatnonzero(record.take(second)).tolist() == [5]  # only what changed since it began
    record.mark_all()
    assert record.take(second).all() and record.take(first).all()
    record.end(first)
    assert record.active() and record.holds(second) and not record.holds(first)
    # A copy whose process died leaves its bit: the next begin takes it back.
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True
    )
    for _ in range(granules.SLOTS - 1):
        assert record.begin() is not None
    assert record.begin() is None  # every bit taken
    raw[8 : granules.HEADER_BYTES].view(np.int64)[second] = int(dead.stdout)
    assert record.begin() == second  # the dead one's
