"""The allocator tuning a server worker applies (robez_core.allocator.keep_freed_buffers): each check in a
child process, so this test process keeps glibc's defaults."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest


def _in_child(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout


def test_zero_keeps_the_allocator_defaults() -> None:
    out = _in_child(
        "from robez_core.allocator import keep_freed_buffers, malloc_setting\n"
        "print(keep_freed_buffers(0), malloc_setting())"
    )
    assert out.startswith("False") and "defaults" in out


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's")
def test_glibc_takes_the_thresholds_clamped_to_its_cap() -> None:
    out = _in_child(
        "from robez_core.allocator import keep_freed_buffers, malloc_setting\n"
        "print(keep_freed_buffers(1000), malloc_setting())"
    )
    assert out.startswith("True") and "mmap threshold 32 MiB, trim threshold 64 MiB, top pad 0 MiB" in out
