"""Multi-table entries on the write-ahead log: one record per table, each naming the entry's parts
(record format 2), replayed together with the format-1 records every log written before them holds;
a kill -9 in the middle of a multi-table push leaves all of it or none."""

from __future__ import annotations

import signal
import textwrap
from pathlib import Path

import torch

from robez_core.config import OptimizerConfig, TableConfig
from robez_core.table import Table
from service.faults import FAULT_FILE_VARIABLE, GROUP_APPENDED, UPDATE_APPENDED
from service.log.entry import EntryGroup, UpdateRecord, apply_record
from service.wal import LOG_FILE, LOG_HEADER_SIZE, WalJournal, scan_log

from .forked import ForkedPython

CONFIG_A = TableConfig(num_embeddings=100, embedding_dim=8, memory_size=1024, chunk_size=4)
CONFIG_B = TableConfig(num_embeddings=50, embedding_dim=4, memory_size=512, chunk_size=2, seed=3)
OPTIMIZER = OptimizerConfig("adagrad", lr=0.1)


def _record(table: str, version: int, dim: int, seed: int, group: EntryGroup | None = None) -> UpdateRecord:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (6,), generator=generator)
    return UpdateRecord(table, version, ids, torch.randn(6, dim, generator=generator), 0.1, group)


def _expected(config: TableConfig, records: list[UpdateRecord]) -> Table:
    table = Table(config, OPTIMIZER)
    for record in records:
        apply_record(table, record.ids, record.grads, record.lr)
    return table


def _same(left: Table, right: Table) -> bool:
    ours, theirs = left.tensors(), right.tensors()
    return ours.keys() == theirs.keys() and all(torch.equal(ours[key], theirs[key]) for key in ours)


def _journal_with_tables(data_dir: Path) -> WalJournal:
    journal = WalJournal(data_dir)
    journal.create("a", Table(CONFIG_A, OPTIMIZER), 0)
    journal.create("b", Table(CONFIG_B, OPTIMIZER), 0)
    return journal


def test_old_records_and_entries_of_several_tables_replay_together(tmp_path: Path) -> None:
    journal = _journal_with_tables(tmp_path)
    single = [_record("a", 1, 8, 1), _record("a", 2, 8, 2)]  # format 1: what every older log holds
    for record in single:
        journal.append(record)
    group = EntryGroup.new([("a", 3), ("b", 1)])
    grouped = [_record("a", 3, 8, 3, group), _record("b", 1, 4, 4, group)]
    for record in grouped:
        journal.append(record)
    after = _record("b", 2, 4, 5)
    journal.append(after)
    journal.close()
    log_bytes = (tmp_path / "a" / LOG_FILE).read_bytes()
    scan = scan_log(log_bytes)
    assert [span.extra > 0 for span in scan.records] == [False, False, True]
    assert log_bytes[LOG_HEADER_SIZE + 4 : LOG_HEADER_SIZE + 6] == b"\x01\x00"  # format 1, unchanged

    reopened = WalJournal(tmp_path)
    loaded_a, loaded_b = reopened.load("a"), reopened.load("b")
    assert loaded_a is not None and loaded_b is not None
    assert loaded_a[1] == 3 and loaded_b[1] == 2
    assert _same(loaded_a[0], _expected(CONFIG_A, [*single, grouped[0]]))
    assert _same(loaded_b[0], _expected(CONFIG_B, [grouped[1], after]))
    reopened.close()


def test_a_part_whose_other_parts_were_never_written_is_cut(tmp_path: Path) -> None:
    journal = _journal_with_tables(tmp_path)
    first = _record("a", 1, 8, 1)
    journal.append(first)
    # A complete entry, then one whose part for "b" was never written (the server died in between).
    complete = EntryGroup.new([("a", 2), ("b", 1)])
    journal.append(_record("a", 2, 8, 2, complete))
    journal.append(_record("b", 1, 4, 3, complete))
    journal.snapshot(
        "b", _expected(CONFIG_B, [_record("b", 1, 4, 3, complete)]), 1
    )  # "b"'s part: in its snapshot
    torn = EntryGroup.new([("a", 3), ("b", 2)])
    journal.append(_record("a", 3, 8, 4, torn))
    journal.close()

    reopened = WalJournal(tmp_path)
    loaded = reopened.load("a")
    assert loaded is not None and loaded[1] == 2  # the complete entry kept, the torn one cut
    assert _same(loaded[0], _expected(CONFIG_A, [first, _record("a", 2, 8, 2, complete)]))
    assert len(scan_log((tmp_path / "a" / LOG_FILE).read_bytes()).records) == 2  # cut off the file too
    loaded_b = reopened.load("b")
    assert loaded_b is not None and loaded_b[1] == 1
    # The table goes on from the cut: the next record is version 3 again.
    reopened.append(_record("a", 3, 8, 9))
    reopened.close()


_PUSHER = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import torch

    from robez_core.config import OptimizerConfig, TableConfig
    from service.config import Settings, TableSpec
    from service.faults import Faults
    from service.shm import SharedDirectory
    from service.store import TableStore, UpdatePart
    from service.wal import WalJournal

    data_dir, shm_dir, fault = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    settings = Settings(_env_file=None, shm_dir=shm_dir, data_dir=data_dir, default_table=False)
    faults = Faults.from_environment()  # this script is its process's composition root
    journal = WalJournal.from_settings(settings, faults)
    directory = SharedDirectory.create(shm_dir)
    store = TableStore(directory, settings, journal, faults)
    optimizer = OptimizerConfig("adagrad", lr=0.1)
    store.create("a", TableSpec(TableConfig(100, 8, memory_size=1024, chunk_size=4), optimizer))
    store.create("b", TableSpec(TableConfig(50, 4, memory_size=512, chunk_size=2, seed=3), optimizer))
    def push(sign: float) -> object:
        return store.update_many(
            [UpdatePart("a", torch.arange(6), sign * torch.ones(6, 8)),
             UpdatePart("b", torch.arange(3), sign * torch.ones(3, 4))]
        )

    print(push(1.0), flush=True)  # acknowledged
    Path(fault).write_text(sys.argv[4])
    push(-1.0)
    print("survived", flush=True)
    """
)


def _kill_in_the_middle(tmp_path: Path, forks: ForkedPython, point: str) -> tuple[int, int]:
    """Run a store on a real data directory (a process of its own: a fork, ``forked.py``) that
    acknowledges one two-table push and dies (SIGKILL) at ``point`` of the next; returns the versions of
    "a" and "b" a restart loads."""
    data_dir, fault = tmp_path / "data", tmp_path / "die-now"
    argv = [str(data_dir), str(tmp_path / "shm"), str(fault), point]
    done = forks.run(_PUSHER, argv, env={FAULT_FILE_VARIABLE: str(fault)}, timeout_s=120)
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
    assert "survived" not in done.stdout and not fault.exists()
    journal = WalJournal(data_dir)
    loaded_a, loaded_b = journal.load("a"), journal.load("b")
    journal.close()
    assert loaded_a is not None and loaded_b is not None
    return loaded_a[1], loaded_b[1]


def test_kill_9_after_the_first_part_is_logged_keeps_none_of_the_push(
    tmp_path: Path, forked_python: ForkedPython
) -> None:
    assert _kill_in_the_middle(tmp_path, forked_python, GROUP_APPENDED) == (1, 1)


def test_kill_9_after_every_part_is_logged_keeps_all_of_the_push(
    tmp_path: Path, forked_python: ForkedPython
) -> None:
    # update:appended: every part logged, half of the first applied, then SIGKILL before any bump.
    assert _kill_in_the_middle(tmp_path, forked_python, UPDATE_APPENDED) == (2, 2)
