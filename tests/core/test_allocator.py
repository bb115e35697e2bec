"""The opt-in glibc malloc tuning: bounds of its values, and that glibc takes them (in a child process,
so the test process keeps glibc's defaults)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from robez_core.allocator import (
    MAX_KEEP_MB,
    MAX_MMAP_THRESHOLD_MB,
    MallocTuning,
    malloc_setting,
    trim_free_memory,
)
from robez_core.errors import ConfigError

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.mark.parametrize(
    "values",
    [
        {"mmap_threshold_mb": 0},
        {"mmap_threshold_mb": MAX_MMAP_THRESHOLD_MB + 1},
        {"trim_threshold_mb": -1},
        {"top_pad_mb": MAX_KEEP_MB + 1},
    ],
)
def test_out_of_bounds_values_are_refused(values: dict[str, int]):
    with pytest.raises(ConfigError):
        MallocTuning(**values)


def test_report_names_the_defaults_before_any_tuning():
    assert malloc_setting() in ("glibc defaults", "the platform's defaults (not glibc)")


@pytest.mark.skipif(not GLIBC, reason="mallopt with these parameters is glibc's")
def test_glibc_takes_the_tuning_and_the_report_names_it():
    code = (
        "from robez_core.allocator import MallocTuning, malloc_setting, tune_malloc\n"
        "assert tune_malloc(MallocTuning(mmap_threshold_mb=16, trim_threshold_mb=128, top_pad_mb=8))\n"
        "print(malloc_setting())\n"
    )
    output = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert "mmap threshold 16 MiB, trim threshold 128 MiB, top pad 8 MiB" in output.stdout


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_a_trim_starts_no_process(monkeypatch: pytest.MonkeyPatch):
    """glibc is looked up once: a trim after each refused request starts no ``ldconfig`` (before: one
    child per trim, ~5 ms, and the server's process tree read 480 MiB more while it ran, CI 2026-11-28)."""
    trim_free_memory()

    def no_process(*args: object, **kwargs: object) -> None:
        raise AssertionError("a process started")

    monkeypatch.setattr(subprocess.Popen, "__init__", no_process)
    for _ in range(3):
        trim_free_memory()
