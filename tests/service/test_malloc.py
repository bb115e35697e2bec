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


def test_a_worker_keeps_no_output_pool() -> None:
    """A worker turns robez_core.buffers' pool off at start-up (a training process keeps one): its freed
    outputs are reused through the fixed malloc thresholds."""
    code = (
        "from fastapi.testclient import TestClient\n"
        "from robez_core import buffers\n"
        "from service.app import create_app\n"
        "from service.config import Settings\n"
        "print(buffers.max_bytes() > 0, end=' ')\n"
        "with TestClient(create_app(Settings(_env_file=None))):\n"
        "    print(buffers.max_bytes(), end=' ')\n"
    )
    assert _in_child(code).split() == ["True", "0"]
