"""Small holes a hostile probe found (issue 28): header integers in non-ASCII digits, data files readable
by others, a replica's data directory on a dedicated volume (lost+found)."""

from __future__ import annotations

import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from robez_core.config import OptimizerConfig, TableConfig
from robez_core.errors import ConfigError, InvalidInputError
from robez_core.table import Table
from service.codec import parse_shape, parse_tables_header
from service.oip import decode_infer
from service.replication.localsnap import check_replica_dir
from service.store.journal import UpdateRecord
from service.wal import LOG_FILE, META_FILE, WalJournal


@pytest.mark.parametrize(
    ("parse", "value"),
    [
        (parse_shape, "\xb2,64"),
        (parse_shape, "1,\xb9"),
        (parse_tables_header, "demo=\xb2"),
        (lambda value: decode_infer(b"{}", value), "\xb2"),
    ],
)
def test_latin1_digits_in_header_integers_are_invalid_input(parse: Callable[[str], Any], value: str) -> None:
    # What Starlette makes of the header bytes b"\xb2" (latin-1): "²", which str.isdigit() takes and int()
    # refuses with a ValueError: these were 500s with tracebacks.
    assert value[-1].isdigit()
    with pytest.raises(InvalidInputError):
        parse(value)


def test_data_files_are_private(tmp_path: Path) -> None:
    journal = WalJournal(tmp_path)
    config = TableConfig(num_embeddings=100, embedding_dim=4, memory_size=64, chunk_size=2)
    try:
        journal.create("t", Table(config, OptimizerConfig()), 0)
        journal.append(UpdateRecord("t", 1, torch.tensor([1]), torch.ones(1, 4), 0.1))
        loaded = journal.load("t")
        assert loaded is not None
        journal.snapshot("t", *loaded)
    finally:
        journal.close()
    files = [tmp_path / "t" / LOG_FILE, tmp_path / "t" / META_FILE, *(tmp_path / "t").glob("snapshot*")]
    assert len(files) >= 3
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_a_replica_data_dir_may_hold_lost_found_and_dot_files(tmp_path: Path) -> None:
    (tmp_path / "lost+found").mkdir()
    (tmp_path / ".snapshot").mkdir()
    (tmp_path / ".DS_Store").write_bytes(b"")
    check_replica_dir(tmp_path)  # no ConfigError
    (tmp_path / "t").mkdir()  # a single server's table: still refused
    with pytest.raises(ConfigError, match="single server"):
        check_replica_dir(tmp_path)
