"""Server management helpers: the tables file, process-tree CPU accounting, affinity, free ports."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

from loadtest.server import (
    MAIN_TABLE,
    MULTI_TABLES,
    TABLE_CONFIG,
    _children,
    affinity,
    free_loopback_port,
    machine_busy_seconds,
    tables_toml,
    tree_cpu_seconds,
)
from service.config import load_tables_file


def test_tables_file_is_what_the_server_parses(tmp_path: Path) -> None:
    path = tmp_path / "tables.toml"
    path.write_text(tables_toml())
    specs = load_tables_file(path)
    assert list(specs) == list(MULTI_TABLES) and MAIN_TABLE in specs
    for number, name in enumerate(MULTI_TABLES):
        config = specs[name].config
        assert (config.embedding_dim, config.chunk_size, config.memory_size) == (
            TABLE_CONFIG["embedding_dim"],
            TABLE_CONFIG["chunk_size"],
            TABLE_CONFIG["memory_size"],
        )
        assert config.seed == 1024 + number  # distinct tables, not four views of one
    assert tomllib.loads(tables_toml())["tables"][MAIN_TABLE]["optimizer"]["name"] == "sgd"


def test_process_tree_includes_children() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in _children(os.getpid())
        assert tree_cpu_seconds(os.getpid()) >= tree_cpu_seconds(child.pid) >= 0.0
    finally:
        child.kill()
        child.wait()
    assert tree_cpu_seconds(child.pid) == 0.0  # gone: counts nothing, raises nothing


def test_machine_busy_seconds_only_grows() -> None:
    first = machine_busy_seconds()
    sum(range(100_000))
    assert machine_busy_seconds() >= first > 0


def test_affinity_is_restored() -> None:
    before = os.sched_getaffinity(0)
    with affinity((min(before),)):
        assert os.sched_getaffinity(0) == {min(before)}
    assert os.sched_getaffinity(0) == before


def test_free_loopback_port_can_be_bound() -> None:
    port = free_loopback_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
