"""Damage is never silent (issue 28): a table folder without its meta.json stops the start with a message
naming it and the salvage command, ``robez snapshot --salvage`` reports the table it skips (and keeps its
files), and a create never deletes an existing table's files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from robez_core.config import OptimizerConfig, TableConfig
from robez_core.errors import CorruptionError
from robez_core.table import Table
from service.store.journal import UpdateRecord
from service.wal import LOG_FILE, META_FILE, WalJournal

from .subprocess_server import free_port

REPO = Path(__file__).resolve().parents[2]


def _table() -> Table:
    config = TableConfig(num_embeddings=100, embedding_dim=4, memory_size=64, chunk_size=2)
    return Table(config, OptimizerConfig(name="sgd", lr=0.1))


def _data_dir_with_a_damaged_table(data_dir: Path) -> bytes:
    """Tables ``t`` (3 logged updates, then its meta.json lost) and ``u``; returns t's log bytes."""
    journal = WalJournal(data_dir)
    try:
        for name in ("t", "u"):
            journal.create(name, _table(), 0)
        for version in (1, 2, 3):
            ids = torch.tensor([1, 2])
            journal.append(UpdateRecord("t", version, ids, torch.ones(2, 4), 0.1))
    finally:
        journal.close()
    (data_dir / "t" / META_FILE).unlink()
    (data_dir / "lost+found").mkdir()  # a dedicated volume's: not a table
    return (data_dir / "t" / LOG_FILE).read_bytes()


def _robez(*args: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("ROBEZ_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "service", *args], env=env, capture_output=True, text=True, timeout=180
    )


def test_create_never_deletes_an_existing_tables_files(tmp_path: Path) -> None:
    log = _data_dir_with_a_damaged_table(tmp_path)
    journal = WalJournal(tmp_path)
    try:
        with pytest.raises(CorruptionError, match="--salvage"):
            journal.create("t", _table(), 0)
    finally:
        journal.close()
    assert (tmp_path / "t" / LOG_FILE).read_bytes() == log


@pytest.mark.slow
def test_a_table_without_meta_json_stops_the_start_and_salvage_sets_it_aside(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    log = _data_dir_with_a_damaged_table(data_dir)
    shm = tmp_path / "shm"
    serve = _robez("serve", "--data-dir", str(data_dir), "--port", str(free_port()), "--log-level", "warning")
    # (ROBEZ_SHM_DIR is not needed: the start stops before any table is placed in shared memory.)
    assert serve.returncode != 0
    assert (
        str(data_dir / "t") in serve.stderr
        and f"robez snapshot --data-dir {data_dir} --salvage" in serve.stderr
    )
    assert not shm.exists()

    salvage = _robez("snapshot", "--data-dir", str(data_dir), "--salvage")
    assert salvage.returncode == 0, salvage.stderr
    assert "skipped table 't'" in salvage.stderr
    assert "u: snapshot at version 0" in salvage.stdout
    (aside,) = data_dir.glob(".damaged-t-*")
    assert (aside / LOG_FILE).read_bytes() == log  # every file kept
    assert not (data_dir / "t").exists()
    journal = WalJournal(data_dir)
    try:
        assert journal.names() == ["u"]
    finally:
        journal.close()
