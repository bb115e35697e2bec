"""The one reader of the machine's facts, on fake /proc files and on this machine."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from robez_core import hostinfo

CPUINFO = """processor\t: 0
model name\t: Test CPU @ 2.00GHz
flags\t\t: fpu sse4_2 avx avx2 fma avx512f bmi2

processor\t: 1
model name\t: Other CPU
flags\t\t: fpu
"""


@pytest.fixture
def fake_proc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    hostinfo._first_processor.cache_clear()
    monkeypatch.setattr(hostinfo, "CPUINFO", tmp_path / "cpuinfo")
    monkeypatch.setattr(hostinfo, "MEMINFO", tmp_path / "meminfo")
    yield tmp_path
    hostinfo._first_processor.cache_clear()


def test_reads_the_first_processor(fake_proc: Path) -> None:
    (fake_proc / "cpuinfo").write_text(CPUINFO)
    (fake_proc / "meminfo").write_text("MemTotal:       16777216 kB\nMemFree: 1 kB\n")
    assert hostinfo.cpu_model() == "Test CPU @ 2.00GHz"
    assert hostinfo.vector_extensions() == "avx avx2 avx512f fma sse4_2"
    assert hostinfo.listed_flags(("avx512f", "neon", "avx2")) == ["avx512f", "avx2"]
    assert hostinfo.memory_gib() == 16.0


def test_arm_features_count_as_flags(fake_proc: Path) -> None:
    (fake_proc / "cpuinfo").write_text("processor\t: 0\nFeatures\t: fp asimd sve crc32\n")
    assert hostinfo.vector_extensions() == "asimd sve"
    assert hostinfo.cpu_model()  # no model name: the platform's answer


def test_unreadable_proc_says_unknown(fake_proc: Path) -> None:
    assert hostinfo.cpu_flags() is None and hostinfo.listed_flags(("avx2",)) is None
    assert hostinfo.vector_extensions() == "unknown"
    assert math.isnan(hostinfo.memory_gib())


def test_machine_facts_on_this_machine() -> None:
    facts = hostinfo.machine_facts()
    assert facts["cpu"] and facts["fused kernels compiled for"] and facts["malloc"]
    assert int(facts["logical cpus"]) == hostinfo.logical_cpus() >= hostinfo.usable_cpus() >= 1
    assert len(hostinfo.load_average()) == 3
