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


def test_a_worker_sets_the_output_pool_from_its_settings() -> None:
    """``ROBEZ_OUTPUT_POOL_MB`` (default 0: off) caps robez_core.buffers in each worker at start-up."""
    code = (
        "from fastapi.testclient import TestClient\n"
        "from robez_core import buffers\n"
        "from service.app import create_app\n"
        "from service.config import Settings\n"
        "for mb in (0, 3):\n"
        "    with TestClient(create_app(Settings(_env_file=None, output_pool_mb=mb))):\n"
        "        print(buffers.max_bytes(), end=' ')\n"
    )
    assert _in_child(code).split() == ["0", str(3 << 20)]
