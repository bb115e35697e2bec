"""Fixtures of the store's in-memory tests: settings without the default table, and a prepared shared
directory (removed after the test)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from service.config import Settings
from service.log.journal import NullJournal
from service.shm import SharedDirectory
from service.store import TableStore

from ..conftest import make_settings


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return make_settings(tmp_path, default_table=False)


@pytest.fixture
def directory(settings: Settings) -> Iterator[SharedDirectory]:
    prepared = TableStore.prepare(settings, NullJournal())
    yield prepared
    prepared.remove()
