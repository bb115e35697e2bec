"""Multiprocess metric values whose series can be removed: the files of a dropped table's series shrink.

prometheus_client's multiprocess mode keeps each worker's samples in memory-mapped files
(``<type>_<pid>.db`` in ``PROMETHEUS_MULTIPROC_DIR``) that only grow: a series, once written, stays in
its file for the worker's life, so create/drop churn of tables grew the files and used up the cap on
table labels (issue 39). ``FileValues`` is a value class of the same file format, read by the same
``MultiProcessCollector``, that also keeps the list of its values by table; ``forget`` rewrites this
worker's files without the series of the tables named (to a temporary name, then renamed over the old
file, so a scrape through another worker reads either the old file or the new one, never neither) and
drops those values.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from prometheus_client import values
from prometheus_client.mmap_dict import MmapedDict, mmap_key


class FileValues:
    """The value classes of one directory, for ``prometheus_client.values.ValueClass`` (one per process:
    prometheus_client reads that global when a series is created).

    Args:
        directory: where this worker writes its ``<type>_<pid>.db`` files.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._files: dict[str, MmapedDict] = {}
        self._values: list[Any] = []
        owner = self

        class FileValue:
            """One float of one series, in this worker's file for its metric type."""

            _multiprocess = True

            def __init__(
                self,
                typ: str,
                metric_name: str,
                name: str,
                labelnames: list[str],
                labelvalues: list[str],
                help_text: str,
                multiprocess_mode: str = "",
                **kwargs: Any,
            ) -> None:
                self.prefix = f"{typ}_{multiprocess_mode}" if typ == "gauge" else typ
                self.table = labelvalues[list(labelnames).index("table")] if "table" in labelnames else None
                self.key = mmap_key(metric_name, name, labelnames, labelvalues, help_text)
                with owner._lock:
                    owner._check_pid()
                    self.file = owner._file(self.prefix)
                    self.value, self.timestamp = self.file.read_value(self.key)
                    owner._values.append(self)

            def inc(self, amount: float) -> None:
                with owner._lock:
                    owner._check_pid()
                    self.value += amount
                    self.timestamp = 0.0
                    self.file.write_value(self.key, self.value, self.timestamp)

            def set(self, value: float, timestamp: float | None = None) -> None:
                with owner._lock:
                    owner._check_pid()
                    self.value = value
                    self.timestamp = timestamp or 0.0
                    self.file.write_value(self.key, self.value, self.timestamp)

            def set_exemplar(self, exemplar: Any) -> None:
                return  # as prometheus_client's: no exemplars in multiprocess mode

            def get(self) -> float:
                with owner._lock:
                    return float(self.value)

            def get_exemplar(self) -> None:
                return None

        self.value_class = FileValue

    def install(self) -> None:
        """Make series created from now on in this process use these files."""
        values.ValueClass = self.value_class

    def _path(self, prefix: str) -> Path:
        return self.directory / f"{prefix}_{self._pid}.db"

    def _file(self, prefix: str) -> MmapedDict:
        """The open file of ``prefix``. Lock held."""
        file = self._files.get(prefix)
        if file is None:
            file = self._files[prefix] = MmapedDict(str(self._path(prefix)))
        return file

    def _check_pid(self) -> None:
        """After a fork, the child writes files of its own, starting from the values it inherited (as
        prometheus_client's values do). Lock held."""
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        for file in self._files.values():
            file.close()
        self._files.clear()
        for value in self._values:
            value.file = self._file(value.prefix)
            value.value, value.timestamp = value.file.read_value(value.key)

    def forget(self, tables: set[str]) -> int:
        """Remove the series labelled with any of ``tables`` from this worker's files (and their values:
        the metrics' children of those tables must be removed too, ``remove_by_labels``). Returns how
        many values went."""
        with self._lock:
            self._check_pid()
            gone = [value for value in self._values if value.table in tables]
            if not gone:
                return 0
            kept = [value for value in self._values if value.table not in tables]
            for prefix, old in list(self._files.items()):
                path = self._path(prefix)
                staging = path.with_suffix(".compacting")  # not *.db: no scrape reads it
                staging.unlink(missing_ok=True)
                new = MmapedDict(str(staging))
                for value in kept:
                    if value.file is old:
                        new.write_value(value.key, value.value, value.timestamp)
                new.close()
                os.replace(staging, path)
                old.close()
                reopened = self._files[prefix] = MmapedDict(str(path))
                for value in kept:
                    if value.file is old:
                        value.file = reopened
            self._values = kept
            return len(gone)
