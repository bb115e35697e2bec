"""The test hooks (service/faults.py): one ``Faults`` object per process, read from the environment only
at the composition roots and handed to what needs it."""

from __future__ import annotations

import ast
from pathlib import Path

from service.faults import (
    FAULT_FILE_VARIABLE,
    NO_FAULTS,
    SLOW_VARIABLE,
    SNAPSHOT_CHUNK_DELAY_VARIABLE,
    UPDATE_APPENDED,
    Faults,
)

SERVICE = Path(__file__).resolve().parents[2] / "service"
# Where a process starts: the uvicorn factory of each worker and ``robez serve`` itself.
COMPOSITION_ROOTS = {"app.py", "cli.py"}


def test_the_environment_names_the_hooks(tmp_path: Path) -> None:
    fault = tmp_path / "die"
    faults = Faults.from_environment(
        {FAULT_FILE_VARIABLE: str(fault), SLOW_VARIABLE: "0.25", SNAPSHOT_CHUNK_DELAY_VARIABLE: "x"}
    )
    assert faults == Faults(die_file=fault, slow_seconds=0.25, snapshot_chunk_delay_s=0.0)
    assert faults.can_die and not Faults.from_environment({}).can_die
    assert Faults.from_environment({}) == NO_FAULTS == Faults()


def test_a_fault_file_fires_once_at_the_point_it_names(tmp_path: Path) -> None:
    fault = tmp_path / "die"
    faults = Faults(die_file=fault)
    assert not faults.armed(UPDATE_APPENDED)  # no file: nothing fires
    fault.write_text("load:durable")
    assert not faults.armed(UPDATE_APPENDED) and fault.exists()  # another point's file stays
    assert faults.armed("load:durable") and not fault.exists()  # removed by the one that fires
    assert not faults.armed("load:durable")
    fault.write_text("")  # empty: the update fault
    assert faults.armed(UPDATE_APPENDED)
    assert not NO_FAULTS.armed(UPDATE_APPENDED)


def test_only_the_composition_roots_read_the_hooks_from_the_environment() -> None:
    """Every other product module takes a ``Faults`` (or the ``NO_FAULTS`` default) as an argument."""
    readers: list[str] = []
    for path in sorted(SERVICE.rglob("*.py")):
        relative = path.relative_to(SERVICE).as_posix()
        if relative == "faults.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            reads = isinstance(node, ast.Attribute) and node.attr == "from_environment"
            if reads and relative not in COMPOSITION_ROOTS:
                readers.append(f"{relative}:{node.lineno}")
            if isinstance(node, ast.ImportFrom) and node.module and node.module.endswith("faults"):
                for alias in node.names:
                    if alias.name.endswith("_VARIABLE") or alias.name[0].islower():
                        readers.append(f"{relative}:{node.lineno} imports {alias.name}")
            if isinstance(node, ast.Constant) and str(node.value).startswith("ROBEZ_FAULT_"):
                readers.append(f"{relative}:{node.lineno}")
    assert readers == []
