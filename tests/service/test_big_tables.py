"""One server with big tables (issue 27): a bad tables file changes nothing; checksums and snapshots do
not block pushes; a restart's memory is bounded by the table. Tables of a few MB, made slow by the test
hook ``ROBEZ_FAULT_SLOW_SECONDS`` (service/faults.py), not by size."""

from __future__ import annotations

from pathlib import Path

import pytest

from robez_core.errors import LimitExceededError
from service.config import Settings
from service.store import TableStore
from service.wal import WalJournal

from .conftest import make_settings


def _tables_file(path: Path, count: int, memory_size: int = 1024) -> Path:
    path.write_text(
        "".join(
            f"[tables.x{index}]\nnum_embeddings = 100\nembedding_dim = 8\nmemory_size = {memory_size}\n"
            for index in range(count)
        )
    )
    return path


def _prepare(settings: Settings) -> None:
    journal = WalJournal.from_settings(settings)
    try:
        TableStore.prepare(settings, journal).remove()
    finally:
        journal.close()


def _tree(directory: Path) -> list[str]:
    return sorted(
        str(path.relative_to(directory)) for path in directory.rglob("*") if ".lock" not in path.name
    )


def test_a_tables_file_over_max_tables_changes_nothing(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    (tmp_path / "shm").mkdir()
    _prepare(make_settings(tmp_path, data_dir=data_dir, config=_tables_file(tmp_path / "two.toml", 2)))
    before = _tree(data_dir)
    too_many = _tables_file(tmp_path / "tables.toml", 65)
    with pytest.raises(LimitExceededError) as refused:
        _prepare(make_settings(tmp_path, data_dir=data_dir, config=too_many))
    message = str(refused.value)
    assert "'x64'" in message and str(too_many) in message and "max_tables=64" in message, message
    assert _tree(data_dir) == before  # x2..x63 were not written
    assert not list((tmp_path / "shm").iterdir())
    _prepare(make_settings(tmp_path, data_dir=data_dir, config=_tables_file(too_many, 64)))
    assert len([path for path in data_dir.iterdir() if not path.name.startswith(".")]) == 64


def test_the_total_limit_counts_the_tables_already_in_the_data_dir(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    (tmp_path / "shm").mkdir()
    table_bytes = (1 << 16) * 4  # memory_size 1 << 16 float32, sgd
    limit = {"max_total_memory_bytes": 2 * table_bytes + 10}
    _prepare(
        make_settings(tmp_path, data_dir=data_dir, config=_tables_file(tmp_path / "one.toml", 2, 1 << 16))
    )
    before = _tree(data_dir)
    three = _tables_file(tmp_path / "three.toml", 3, 1 << 16)
    with pytest.raises(LimitExceededError) as refused:
        _prepare(make_settings(tmp_path, data_dir=data_dir, config=three, **limit))
    assert "'x2'" in str(refused.value) and "max_total_memory_bytes" in str(refused.value)
    assert _tree(data_dir) == before
