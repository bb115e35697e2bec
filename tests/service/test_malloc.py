from __future__ import annotations

import platform

import pytest

from service.malloc import MAX_MMAP_THRESHOLD, keep_freed_memory


def test_zero_keeps_the_allocator_defaults() -> None:
    assert keep_freed_memory(0) is False


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's")
def test_glibc_takes_the_thresholds() -> None:
    # values over glibc's cap are clamped to it rather than refused
    assert keep_freed_memory(MAX_MMAP_THRESHOLD * 4) is True
    assert keep_freed_memory(MAX_MMAP_THRESHOLD) is True
