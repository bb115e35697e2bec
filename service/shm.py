"""The shared memory behind ``TableStore``: the files one server's workers all map, and the locks and
counters in them.

Layout of one server's shared directory (``<shm_dir>/robez-<server id>/``, tmpfs by default)::

    owner.pid              pid of the ``robez serve`` process that owns (and removes) the directory
    registry.json          {"tables": {name: {uid, array, lock, config, optimizer}}, "arrays": {id: {...}}}
    registry.lock          flock: create / delete / load / registry reads
    generation             int64 (1,): bumped after every registry change, polled by every request
    arrays/<id>.weight     float32 (m,)        one per array; tables created with share_array_with
    arrays/<id>.state.<k>  optimizer state     point at the same array (and its optimizer state)
    arrays/<id>.granules   uint8               the granules updates changed while copies of the array
                                               run (service/log/granules.py)
    locks/<id>.lock        flock: the update lock of a table (shared by the tables sharing its array);
                           it outlives the arrays a load switches the table between
    tables/<uid>.counters  int64 (5,): [version, state, pending, overwrites, target] (state: live,
                           deleted, replaced by a load; pending: the version an update under way will
                           produce, else 0; overwrites: odd while the array is restored in place)

Every worker maps the same files (``torch.from_file(..., shared=True)``, MAP_SHARED), so a table's memory
is held once whatever the worker count, and an update written through one worker's mapping is what every
other worker reads next.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from robez_core.config import OptimizerConfig, TableConfig
from robez_core.errors import CorruptionError, LimitExceededError
from robez_core.hostinfo import process_alive
from robez_core.table import Table

from .log.granules import GranuleMarks, record_bytes

VERSION, STATE, PENDING = 0, 1, 2  # indices of a table's counters
# counters[OVERWRITES]: odd while the array is overwritten in place (service/store/inplace.py), or left
# torn by an overwrite that died; lookups and updates refuse it then. counters[TARGET]: the version that
# overwrite writes (the repair rebuilds it from the data directory).
OVERWRITES, TARGET = 3, 4
NUM_COUNTERS = 5
# counters[PENDING]: 0, or what the holder of the table's lock is doing, which the next holder finds if
# that worker died (service/store/repair.py's docstring): the version an update will produce, or one of these.
EXCLUSIVE = -1  # a snapshot (or another exclusive holder) runs
LOADING = -2  # a load (``TableStore.restore``)
DELETING = -3  # a delete
OVERWRITING = -4  # a restore into the table's own array (``TableStore.restore_from_file``)
LIVE, DELETED, REPLACED = 0, 1, 2  # counters[STATE]
DIR_PREFIX = "robez-"


class FileLock:
    """Exclusive across processes (flock) and across this process's threads (flock alone would let two
    threads sharing the descriptor both in)."""

    def __init__(self, path: Path) -> None:
        self._thread_lock = threading.Lock()
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    def acquire(self, blocking: bool = True) -> bool:
        """Take the lock; with ``blocking=False`` False at once (not taken) when another thread or
        process has it. A True must be followed by ``release``."""
        if not self._thread_lock.acquire(blocking):
            return False
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process has it
            self._thread_lock.release()
            return False
        except BaseException:
            self._thread_lock.release()
            raise
        return True

    def release(self) -> None:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()

    @contextmanager
    def hold(self, blocking: bool = True) -> Iterator[bool]:
        """Holds the lock inside the block; with ``blocking=False`` yields False (not held) at once
        when another thread or process has it."""
        if not self.acquire(blocking):
            yield False
            return
        try:
            yield True
        finally:
            self.release()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        # Arrays dropped by a registry sync are closed here, once no in-flight update still holds them.
        self.close()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptionError(f"unknown dtype {name!r} in the registry")
    return dtype


def shape_numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


@dataclass
class SharedArray:
    """One array (weight + optimizer state) mapped from the shared directory."""

    array_id: str
    tensors: dict[str, Tensor]  # "weight", "state.<name>" as Table.tensors() names them
    marks: GranuleMarks  # the granules changed while copies run (arrays/<id>.granules)

    @property
    def weight(self) -> Tensor:
        return self.tensors["weight"]

    @property
    def state(self) -> dict[str, Tensor]:
        return {key.removeprefix("state."): t for key, t in self.tensors.items() if key.startswith("state.")}


@dataclass
class TableEntry:
    """A table as one worker sees it: the core Table over shared tensors, plus its shared counters."""

    name: str
    uid: str
    table: Table
    array: SharedArray
    lock: FileLock  # the table's update lock, the same object for every entry of this table
    counters: Tensor  # int64 (5,) [version, state, pending, overwrites, target], shared
    # the same memory as numpy: reading one value this way costs ~0.1 us instead of ~2 us
    _counters_np: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._counters_np = self.counters.numpy()

    @property
    def version(self) -> int:
        return int(self._counters_np[VERSION])

    def set_version(self, version: int) -> None:
        self._counters_np[VERSION] = version

    @property
    def state(self) -> int:
        """``LIVE``, ``DELETED`` or ``REPLACED``."""
        return int(self._counters_np[STATE])

    @property
    def pending(self) -> int:
        """The version an update under way will produce, or EXCLUSIVE, LOADING, DELETING; else 0."""
        return int(self._counters_np[PENDING])

    def set_pending(self, version: int) -> None:
        self._counters_np[PENDING] = version

    @property
    def overwrites(self) -> int:
        """Odd while the array is overwritten in place or was left torn (``inplace.py``); lookups read
        it before and after they gather."""
        return int(self._counters_np[OVERWRITES])

    @property
    def marks(self) -> GranuleMarks:
        """The record of the granules updates change while copies of the table's array run."""
        return self.array.marks


@dataclass
class Registry:
    tables: dict[str, dict[str, Any]] = field(default_factory=dict)
    arrays: dict[str, dict[str, Any]] = field(default_factory=dict)

    def array_tables(self, array_id: str) -> tuple[str, ...]:
        return tuple(name for name, record in self.tables.items() if record["array"] == array_id)

    def lock_in_use(self, lock_id: str) -> bool:
        return any(record["lock"] == lock_id for record in self.tables.values())

    def total_bytes(self) -> int:
        return sum(int(record["nbytes"]) for record in self.arrays.values())


def array_layout(
    config: TableConfig, optimizer: OptimizerConfig
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    layout: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
        "weight": ((config.memory_size,), torch.float32)
    }
    for key, (shape, dtype) in Table.state_layout(optimizer, config.memory_size).items():
        layout[f"state.{key}"] = (tuple(shape), dtype)
    return layout


def layout_bytes(layout: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    return sum(
        shape_numel(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in layout.values()
    )


class SharedDirectory:
    """The files of one server's shared memory; see the module docstring for the layout."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.arrays_dir = path / "arrays"
        self.tables_dir = path / "tables"
        self.locks_dir = path / "locks"
        self.registry_path = path / "registry.json"

    @classmethod
    def create(cls, shm_dir: Path) -> SharedDirectory:
        """A new, empty directory owned by this process; stale ones of dead servers are removed first."""
        shm_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_directories(shm_dir)
        path = shm_dir / f"{DIR_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        path.mkdir(mode=0o700)
        directory = cls(path)
        directory.arrays_dir.mkdir()
        directory.tables_dir.mkdir()
        directory.locks_dir.mkdir()
        (path / "owner.pid").write_text(str(os.getpid()))
        directory.allocate("generation", 1, torch.int64).zero_()
        directory.write_registry(Registry())
        return directory

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def allocate(self, relative: str, numel: int, dtype: torch.dtype) -> Tensor:
        """A new zero-filled shared file of ``numel`` values; space is reserved now, so a full tmpfs is a
        LimitExceededError here rather than a SIGBUS on first write."""
        path = self.path / relative
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise LimitExceededError(
                f"cannot reserve {nbytes} bytes of shared memory in {self.path}: {exc}"
            ) from exc
        os.close(fd)
        return self.map(relative, numel, dtype)

    def map(self, relative: str, numel: int, dtype: torch.dtype) -> Tensor:
        path = self.path / relative
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        try:
            size = path.stat().st_size
        except FileNotFoundError as exc:
            raise CorruptionError(f"shared file {relative} is missing") from exc
        if size != nbytes:  # torch.from_file would silently grow a short file
            raise CorruptionError(f"shared file {relative} has {size} bytes, expected {nbytes}")
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        return torch.from_file(str(path), shared=True, size=numel, dtype=dtype)

    def allocate_marks(self, array_id: str, memory_size: int) -> GranuleMarks:
        """A new record of changed granules for the array ``array_id`` (``GranuleMarks``)."""
        return GranuleMarks(
            self.allocate(f"arrays/{array_id}.granules", record_bytes(memory_size), torch.uint8).numpy()
        )

    def map_marks(self, array_id: str, memory_size: int) -> GranuleMarks:
        """The record of changed granules of the array ``array_id``, as ``allocate_marks`` made it."""
        return GranuleMarks(
            self.map(f"arrays/{array_id}.granules", record_bytes(memory_size), torch.uint8).numpy()
        )

    def read_registry(self) -> Registry:
        data = json.loads(self.registry_path.read_text())
        return Registry(tables=data["tables"], arrays=data["arrays"])

    def write_registry(self, registry: Registry) -> None:
        tmp = self.registry_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"tables": registry.tables, "arrays": registry.arrays}))
        os.replace(tmp, self.registry_path)


def remove_stale_directories(shm_dir: Path) -> list[Path]:
    """Remove shared directories whose owning server died without cleaning up (e.g. SIGKILL)."""
    removed = []
    for path in shm_dir.glob(f"{DIR_PREFIX}*"):
        try:
            pid = int((path / "owner.pid").read_text())
        except (OSError, ValueError):
            continue  # not ours, or still being created
        if not process_alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
