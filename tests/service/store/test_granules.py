"""The record of the granules changed while copies run (service/log/granules.py): every apply path marks
what it changes, through any worker's mapping, and only while a copy runs; copies running at once each
take only their own marks; a dead copy's bit is taken back."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from robez_core.checkpoint import CheckpointWriter
from robez_core.config import OptimizerConfig, TableConfig
from robez_core.table import Table
from service.config import Settings, TableSpec
from service.log import granules, live_copy
from service.log.entry import UpdatePart, UpdateRecord
from service.log.journal import NullJournal
from service.shm import SharedDirectory
from service.store import TableStore

CONFIG = TableConfig(num_embeddings=5000, embedding_dim=8, memory_size=(1 << 14) + 40, chunk_size=4)
ADAM = OptimizerConfig.from_dict({"name": "adam", "lr": 0.05})


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
    table = Table(TableConfig(num_embeddings=10, embedding_dim=4, memory_size=m, chunk_size=4))
    assert not record.active()
    first = record.begin()
    record.mark_chunks(np.array([0, 130]), 4, table)  # granules 0 and 2
    second = record.begin()
    assert first is not None and second is not None and first != second
    record.mark_positions(np.array([64 * 5 + 3]), table)  # granule 5
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


@pytest.mark.parametrize("how", ["patch", "write"])
def test_a_file_target_patched_where_updates_touched_holds_the_table(tmp_path: Path, how: str) -> None:
    """``FileTarget`` (the checkpoint download's and a replica snapshot's copy, written with pwrite):
    filled, then patched in runs of adjacent granules and the tail, the file loads bitwise as the table."""
    table = Table(CONFIG, ADAM)
    generator = torch.Generator().manual_seed(4)
    table.apply_gradients(torch.arange(300), torch.randn(300, 8, generator=generator))
    path = tmp_path / "copy.safetensors"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        writer = CheckpointWriter.begin(fd, table.tensors(), table.metadata())
        target = live_copy.FileTarget(fd, writer, table.tensors())
        target.fill(table, pause=lambda: None)
        every = torch.arange(5000)
        reach = table.hash(every) + CONFIG.chunk_size - 1
        tail = every[(reach >= CONFIG.memory_size - 40).any(dim=1)][:1]  # an id whose chunk is in the tail
        ids = torch.cat([torch.arange(40), tail])  # adjacent granules (runs) and the tail
        table.apply_gradients(ids, torch.randn(ids.numel(), 8, generator=generator))
        marks = live_copy.touched(table, [ids.numpy()])
        assert marks[-1] and 1 < np.count_nonzero(marks) < marks.size / 2
        assert (np.diff(np.flatnonzero(marks)) == 1).any()  # a run of adjacent granules: one pwrite
        if how == "patch":
            target.patch(table, marks)
            target.write([])  # what a patch kept in memory, if anything (the copy's last write)
        else:
            target.write(live_copy.gather(table, marks))
        writer.finish(fd, durable=False)
    finally:
        os.close(fd)
    loaded = Table.load(path)  # checksums checked
    for key, tensor in table.tensors().items():
        assert torch.equal(loaded.tensors()[key].view(torch.uint8), tensor.view(torch.uint8)), key


def test_a_stream_saves_each_granule_once_before_it_changes_and_only_if_not_sent(tmp_path: Path) -> None:
    """A stream's bit (``begin_stream``): an update about to change a granule appends its contents in
    every (m,) tensor to the side file once, unless the stream sent it in every tensor already (its
    cursor); a copy beside it is marked as before; a repair ends the stream's saves (``REPAIRED``)."""
    m = 64 * 10
    table = Table(
        TableConfig(num_embeddings=10, embedding_dim=4, memory_size=m, chunk_size=4),
        OptimizerConfig(name="adam"),
    )
    tensors = granules.granule_tensors(table)
    assert [key for key, _ in tensors] == ["state.exp_avg", "state.exp_avg_sq", "weight"]
    for index, (_key, source) in enumerate(tensors):
        source[:] = np.arange(m, dtype=np.float32) + 1000 * index
    record = granules.GranuleMarks(np.zeros(granules.record_bytes(m), dtype=np.uint8))
    side = tmp_path / "side"
    side.touch()
    stream = record.begin_stream(str(side))
    copy = record.begin()
    assert stream is not None and copy is not None
    record.sent(stream, 2 * 10 + 5)  # granules 0-4 sent in all three tensors (the last is "weight")
    record.mark_positions(np.array([64 * 2 + 1, 64 * 7 + 3, 64 * 7 + 9]), table)  # granules 2 and 7
    record.mark_positions(np.array([64 * 7]), table)  # 7 again: saved already
    data = side.read_bytes()
    assert record.saved_end(stream) == len(data) == 8 + 8 + 3 * 64 * 4
    assert np.frombuffer(data[:16], dtype=np.int64).tolist() == [1, 7]
    rows = np.frombuffer(data[16:], dtype=np.float32).reshape(3, 64)
    for index, (_key, source) in enumerate(tensors):
        assert np.array_equal(rows[index], source[64 * 7 : 64 * 8])
    assert np.flatnonzero(record.take(copy)).tolist() == [2, 7]  # the copy's marks, as before
    assert record.failure(stream) == 0 and record.save_times(stream)[0] == 1
    record.mark_all()
    assert record.failure(stream) == granules.REPAIRED
    record.end(stream)
    assert record.holds(copy) and not record.holds(stream)


def test_a_file_targets_rounds_of_few_granules_go_to_memory_and_are_written_under_the_last_ones(
    tmp_path: Path,
) -> None:
    """A lock-free round that rewrote the 64 KiB blocks around its granules cost about a whole rewrite of
    the file however few they were, so under a pusher the rounds mostly never shrank and the last read up
    to 41k granules under the lock at 2^26 (docs/benchmarks/replica-copies-2026-11-28.md). A round of few
    granules (a quarter of the table's at most) is read into memory and leaves the file alone; the copy's
    final write puts them in the file, older rounds first, the last round's on top; a round of many
    writes the file at once, the rounds kept before it first."""
    table = Table(CONFIG, ADAM)
    generator = torch.Generator().manual_seed(5)
    table.apply_gradients(torch.arange(300), torch.randn(300, 8, generator=generator))
    m = CONFIG.memory_size
    values: list[dict[str, np.ndarray]] = []

    def change() -> None:  # every value of every tensor changes; only the marked granules are taken
        values.append({key: t.detach().reshape(-1).numpy().copy() for key, t in table.tensors().items()})
        for tensor in table.tensors().values():
            tensor.detach().add_(1)

    def marked(*indexes: int) -> np.ndarray:
        marks = np.zeros(granules.granule_count(m), dtype=np.uint8)
        marks[list(indexes)] = 1
        return marks

    path = tmp_path / "copy.safetensors"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    last = granules.granule_count(m) - 1  # the partial last granule
    try:
        writer = CheckpointWriter.begin(fd, table.tensors(), table.metadata())
        target = live_copy.FileTarget(fd, writer, table.tensors())
        target.fill(table, pause=lambda: None)
        filled = path.read_bytes()
        change()
        target.patch(table, marked(0, 1, 7, 100, 101, last))
        assert path.read_bytes() == filled  # read into memory, not written yet
        change()
        target.patch(table, marked(7, 200))
        assert path.read_bytes() == filled
        change()
        target.write(live_copy.gather(table, marked(1, 150)))  # the last round's, read under the lock
        writer.finish(fd, durable=False)
    finally:
        os.close(fd)
    loaded = Table.load(path)
    now = {key: t.detach().reshape(-1).numpy() for key, t in table.tensors().items()}
    # Which state each granule must hold: the fill's, else that of the last round that took it.
    expected_from = {0: 1, 100: 1, 101: 1, last: 1, 7: 2, 200: 2, 1: 3, 150: 3}
    states = [*values[1:], now]  # after the first change, the second, now
    for key, written in loaded.tensors().items():
        written_values = written.reshape(-1).numpy()
        if now[key].size != m:  # adam's step: whole, as the last round read it
            assert np.array_equal(written_values, now[key]), key
            continue
        expected = values[0][key].copy()
        for granule, state in expected_from.items():
            span = slice(granule * granules.GRANULE, min(m, (granule + 1) * granules.GRANULE))
            expected[span] = states[state - 1][key][span]
        assert np.array_equal(written_values, expected), key


def test_a_file_targets_round_of_too_many_granules_writes_them_and_the_kept_ones_to_the_file(
    tmp_path: Path,
) -> None:
    """More granules than a quarter of the table's, with those kept: written to the file in the round (the
    memory a copy keeps stays under 0.25 x the state), the kept granules with them, from the live table."""
    config = TableConfig(num_embeddings=5000, embedding_dim=8, memory_size=(1 << 16) + 40, chunk_size=4)
    table = Table(config, ADAM)  # 1,025 granules: several blocks of the file's writes
    path = tmp_path / "copy.safetensors"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    m = config.memory_size
    try:
        writer = CheckpointWriter.begin(fd, table.tensors(), table.metadata())
        target = live_copy.FileTarget(fd, writer, table.tensors())
        target.fill(table, pause=lambda: None)
        filled = path.read_bytes()
        few = np.zeros(granules.granule_count(m), dtype=np.uint8)
        few[3] = 1
        three = slice(3 * granules.GRANULE, 4 * granules.GRANULE)
        for tensor in table.tensors().values():  # granule 3 changes, and is taken alone
            flat = tensor.detach().reshape(-1)
            (flat[three] if flat.numel() == m else flat).add_(1)
        target.patch(table, few)
        assert path.read_bytes() == filled
        for tensor in table.tensors().values():  # granules 256 on change again (granule 3 does not)
            flat = tensor.detach().reshape(-1)
            (flat[256 * granules.GRANULE :] if flat.numel() == m else flat).add_(1)
        many = np.zeros_like(few)
        many[256:] = 1  # more than a quarter of the granules, none in granule 3's 64 KiB block
        target.patch(table, many)
        assert path.read_bytes() != filled
        target.write(live_copy.gather(table, np.zeros_like(few)))
        writer.finish(fd, durable=False)
    finally:
        os.close(fd)
    loaded = Table.load(path)
    for key, tensor in table.tensors().items():
        assert torch.equal(loaded.tensors()[key].view(torch.uint8), tensor.view(torch.uint8)), key
