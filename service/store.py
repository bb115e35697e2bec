"""Tables in shared memory, shared by every worker process of one server.

Layout of one server's shared directory (``<shm_dir>/robez-<server id>/``, tmpfs by default)::

    owner.pid              pid of the ``robez serve`` process that owns (and removes) the directory
    registry.json          {"tables": {name: {uid, array, config, optimizer}}, "arrays": {id: {...}}}
    registry.lock          flock: create / delete / registry reads
    generation             int64 (1,): bumped after every registry change, polled by every request
    arrays/<id>.weight     float32 (m,)        one per array; tables created with share_array_with
    arrays/<id>.state.<k>  optimizer state     point at the same array (and its optimizer state)
    arrays/<id>.lock       flock: serialises updates of the array across workers and threads
    tables/<uid>.counters  int64 (2,): [version, deleted]

Every worker maps the same files (``torch.from_file(..., shared=True)``, MAP_SHARED), so a table's memory
is held once whatever the worker count, and an update written through one worker's mapping is what every
other worker reads next.

Consistency: updates of an array are serialised by its lock; lookups never take it. A lookup running
while an update is applied may read a row with some values from before and some from after that update
(values are float32 stores, never torn); every lookup that starts after an update's response was sent
sees the whole update, since the update finished writing before it responded. A lookup reports the table
version read before it gathered: its rows include at least that many updates.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from robez_core.config import OptimizerConfig, TableConfig
from robez_core.errors import (
    ConfigError,
    ConflictError,
    CorruptionError,
    InvalidInputError,
    LimitExceededError,
    NotFoundError,
)
from robez_core.table import Table

from .config import Settings, TableSpec, demo_table_spec, load_tables_file
from .journal import Journal, NullJournal, UpdateRecord

logger = logging.getLogger("robez.store")

TABLE_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
Pooling = Literal["none", "sum", "mean"]
POOLINGS: tuple[str, ...] = ("none", "sum", "mean")
_VERSION, _DELETED = 0, 1
_DIR_PREFIX = "robez-"


def validate_table_name(name: str) -> str:
    """Table names become registry keys and WAL file names: letters, digits, '_' and '-', at most 64."""
    if not isinstance(name, str) or not TABLE_NAME_PATTERN.fullmatch(name):
        raise InvalidInputError(
            f"invalid table name {name!r}: use 1-64 letters, digits, '_' or '-', "
            "starting with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class Limits:
    """Request and capacity limits (see ``Settings``); exceeding one raises ``LimitExceededError``."""

    max_ids_per_request: int
    max_values_per_request: int
    max_tables: int
    max_embedding_dim: int
    max_memory_size: int
    max_total_memory_bytes: int

    @classmethod
    def from_settings(cls, settings: Settings) -> Limits:
        return cls(
            max_ids_per_request=settings.max_ids_per_request,
            max_values_per_request=settings.max_values_per_request,
            max_tables=settings.max_tables,
            max_embedding_dim=settings.max_embedding_dim,
            max_memory_size=settings.max_memory_size,
            max_total_memory_bytes=settings.max_total_memory_bytes,
        )

    def check_request(self, num_ids: int, embedding_dim: int) -> None:
        """A lookup or update of ``num_ids`` rows of ``embedding_dim`` values."""
        if num_ids > self.max_ids_per_request:
            raise LimitExceededError(
                f"{num_ids} ids in one request; the limit is max_ids_per_request={self.max_ids_per_request}"
            )
        if num_ids * embedding_dim > self.max_values_per_request:
            raise LimitExceededError(
                f"{num_ids} rows x {embedding_dim} values = {num_ids * embedding_dim} values in one request; "
                f"the limit is max_values_per_request={self.max_values_per_request}"
            )


@dataclass(frozen=True)
class TableInfo:
    """What ``GET /v1/tables/{name}`` reports about a table."""

    name: str
    config: TableConfig
    optimizer: OptimizerConfig
    version: int
    array: str
    array_tables: tuple[str, ...]  # every table reading this array (itself included)
    memory_bytes: int  # the array and its optimizer state


@dataclass(frozen=True)
class LookupResult:
    """Rows (n, d) float32 (or pooled bags (B, d)), the version read before gathering, stage times (s)."""

    rows: Tensor
    version: int
    hash_seconds: float
    lookup_seconds: float


@dataclass(frozen=True)
class LookupRequestItem:
    """One table's part of a multi-table lookup (arguments as ``TableStore.lookup``)."""

    table: str
    ids: Tensor
    offsets: Tensor | None = None
    pooling: Pooling = "none"
    per_sample_weights: Tensor | None = None


@dataclass(frozen=True)
class UpdateResult:
    """The version the update produced and its stage times in seconds."""

    version: int
    hash_seconds: float
    apply_seconds: float


class _FileLock:
    """Exclusive across processes (flock) and across this process's threads (flock alone would let two
    threads sharing the descriptor both in)."""

    def __init__(self, path: Path) -> None:
        self._thread_lock = threading.Lock()
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    @contextmanager
    def hold(self) -> Iterator[None]:
        with self._thread_lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        # Arrays dropped by a registry sync are closed here, once no in-flight update still holds them.
        self.close()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptionError(f"unknown dtype {name!r} in the registry")
    return dtype


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


@dataclass
class _SharedArray:
    """One array (weight + optimizer state) mapped from the shared directory, and its update lock."""

    array_id: str
    tensors: dict[str, Tensor]  # "weight", "state.<name>" as Table.tensors() names them
    lock: _FileLock

    @property
    def weight(self) -> Tensor:
        return self.tensors["weight"]

    @property
    def state(self) -> dict[str, Tensor]:
        return {key.removeprefix("state."): t for key, t in self.tensors.items() if key.startswith("state.")}


@dataclass
class _Entry:
    """A table as one worker sees it: the core Table over shared tensors, plus its shared counters."""

    name: str
    uid: str
    table: Table
    array: _SharedArray
    counters: Tensor  # int64 (2,) [version, deleted], shared

    @property
    def version(self) -> int:
        return int(self.counters[_VERSION])

    @property
    def deleted(self) -> bool:
        return bool(self.counters[_DELETED])


@dataclass
class _Registry:
    tables: dict[str, dict[str, Any]] = field(default_factory=dict)
    arrays: dict[str, dict[str, Any]] = field(default_factory=dict)

    def array_tables(self, array_id: str) -> tuple[str, ...]:
        return tuple(name for name, record in self.tables.items() if record["array"] == array_id)

    def total_bytes(self) -> int:
        return sum(int(record["nbytes"]) for record in self.arrays.values())


def _array_layout(
    config: TableConfig, optimizer: OptimizerConfig
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    layout: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
        "weight": ((config.memory_size,), torch.float32)
    }
    for key, (shape, dtype) in Table.state_layout(optimizer, config.memory_size).items():
        layout[f"state.{key}"] = (tuple(shape), dtype)
    return layout


def _layout_bytes(layout: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    return sum(
        _numel(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in layout.values()
    )


class SharedDirectory:
    """The files of one server's shared memory; see the module docstring for the layout."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.arrays_dir = path / "arrays"
        self.tables_dir = path / "tables"
        self.registry_path = path / "registry.json"

    @classmethod
    def create(cls, shm_dir: Path) -> SharedDirectory:
        """A new, empty directory owned by this process; stale ones of dead servers are removed first."""
        shm_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_directories(shm_dir)
        path = shm_dir / f"{_DIR_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        path.mkdir(mode=0o700)
        directory = cls(path)
        directory.arrays_dir.mkdir()
        directory.tables_dir.mkdir()
        (path / "owner.pid").write_text(str(os.getpid()))
        directory.allocate("generation", 1, torch.int64).zero_()
        directory.write_registry(_Registry())
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

    def read_registry(self) -> _Registry:
        data = json.loads(self.registry_path.read_text())
        return _Registry(tables=data["tables"], arrays=data["arrays"])

    def write_registry(self, registry: _Registry) -> None:
        tmp = self.registry_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"tables": registry.tables, "arrays": registry.arrays}))
        os.replace(tmp, self.registry_path)


def remove_stale_directories(shm_dir: Path) -> list[Path]:
    """Remove shared directories whose owning server died without cleaning up (e.g. SIGKILL)."""
    removed = []
    for path in shm_dir.glob(f"{_DIR_PREFIX}*"):
        try:
            pid = int((path / "owner.pid").read_text())
        except (OSError, ValueError):
            continue  # not ours, or still being created
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        except PermissionError:
            pass  # alive, another user's
    return removed


class TableStore:
    """The tables of one server as one worker sees them; every method is safe to call from many threads.

    Args:
        directory: the prepared shared directory (``TableStore.prepare`` or ``SharedDirectory.create``).
        settings: limits and journal settings.
        journal: where updates and table lifecycle events are made durable (``NullJournal``: nowhere).
    """

    def __init__(self, directory: SharedDirectory, settings: Settings, journal: Journal) -> None:
        self.directory = directory
        self.limits = Limits.from_settings(settings)
        self.journal = journal
        self._generation = directory.map("generation", 1, torch.int64)
        self._registry_lock = _FileLock(directory.path / "registry.lock")
        self._sync_lock = threading.Lock()
        self._seen_generation = -1
        self._entries: dict[str, _Entry] = {}
        self._arrays: dict[str, _SharedArray] = {}
        self._registry = _Registry()
        self.refresh()

    # -- start-up ---------------------------------------------------------------------------------

    @classmethod
    def prepare(cls, settings: Settings, journal: Journal) -> SharedDirectory:
        """Create the shared directory and fill it: tables from the data directory, then the tables file,
        then (if neither named any and ``default_table``) the ``demo`` table. Called once, by the process
        that starts the workers; the workers attach with ``TableStore(directory, ...)``."""
        directory = SharedDirectory.create(settings.shm_dir)
        try:
            store = cls(directory, settings, journal)
            try:
                store._load_initial_tables(settings)
            finally:
                store.close()
        except BaseException:
            directory.remove()
            raise
        return directory

    def _load_initial_tables(self, settings: Settings) -> None:
        specs = load_tables_file(settings.config) if settings.config is not None else {}
        for name in self.journal.names():
            loaded = self.journal.load(validate_table_name(name))
            if loaded is None:
                continue
            table, version = loaded
            spec = specs.get(name)
            if spec is not None and (spec.config, spec.optimizer) != (table.config, table.optimizer):
                raise ConfigError(
                    f"table {name!r} in the data directory has a different config than the tables file; "
                    "delete the table (DELETE /v1/tables/{name}) or change the file"
                )
            self._install(name, TableSpec(table.config, table.optimizer), source=table, version=version)
            logger.info("loaded table %s at version %d from the data directory", name, version)
        for name, spec in specs.items():
            if name not in self._registry.tables:
                self.create(name, spec)
        if not self._registry.tables and settings.config is None and settings.default_table:
            self.create("demo", demo_table_spec())

    # -- registry ---------------------------------------------------------------------------------

    def refresh(self) -> None:
        """Map tables created and drop tables deleted by any worker since this worker last looked."""
        generation = int(self._generation[0])
        if generation == self._seen_generation:
            return
        with self._sync_lock, self._registry_lock.hold():
            self._sync(self.directory.read_registry(), int(self._generation[0]))

    def _sync(self, registry: _Registry, generation: int) -> None:
        arrays = {aid: a for aid, a in self._arrays.items() if aid in registry.arrays}
        entries: dict[str, _Entry] = {}
        for name, record in registry.tables.items():
            current = self._entries.get(name)
            if current is not None and current.uid == record["uid"]:
                entries[name] = current
                continue
            array_id = record["array"]
            if array_id not in arrays:
                arrays[array_id] = self._map_array(array_id, registry.arrays[array_id])
            array = arrays[array_id]
            config = TableConfig.from_dict(record["config"])
            optimizer = OptimizerConfig.from_dict(record["optimizer"])
            table = Table(config, optimizer, weight=array.weight, state=array.state)
            counters = self.directory.map(f"tables/{record['uid']}.counters", 2, torch.int64)
            entries[name] = _Entry(name, record["uid"], table, array, counters)
        self._arrays, self._entries, self._registry = arrays, entries, registry
        self._seen_generation = generation

    def _map_array(self, array_id: str, record: dict[str, Any]) -> _SharedArray:
        tensors = {
            key: self.directory.map(
                f"arrays/{array_id}.{key}", _numel(tuple(shape)), _dtype_from_name(dtype)
            ).view(tuple(shape))
            for key, (shape, dtype) in record["layout"].items()
        }
        return _SharedArray(array_id, tensors, _FileLock(self.directory.arrays_dir / f"{array_id}.lock"))

    def _publish(self, registry: _Registry) -> None:
        """Write the registry and bump the generation; caller holds the registry lock."""
        self.directory.write_registry(registry)
        generation = int(self._generation[0]) + 1
        self._generation[0] = generation
        with self._sync_lock:
            self._sync(registry, generation)

    def _entry(self, name: str) -> _Entry:
        self.refresh()
        entry = self._entries.get(name)
        if entry is None:
            raise NotFoundError(f"no table named {name!r}")
        return entry

    # -- tables -----------------------------------------------------------------------------------

    def names(self) -> list[str]:
        self.refresh()
        return sorted(self._entries)

    def table(self, name: str) -> Table:
        """The core Table (over shared memory) named ``name``."""
        return self._entry(name).table

    def version(self, name: str) -> int:
        return self._entry(name).version

    def info(self, name: str) -> TableInfo:
        entry = self._entry(name)
        registry = self._registry
        array_record = registry.arrays.get(entry.array.array_id, {})
        return TableInfo(
            name=name,
            config=entry.table.config,
            optimizer=entry.table.optimizer,
            version=entry.version,
            array=entry.array.array_id,
            array_tables=registry.array_tables(entry.array.array_id),
            memory_bytes=int(array_record.get("nbytes", 0)),
        )

    def create(self, name: str, spec: TableSpec) -> TableInfo:
        """Create a table (new zero-version array, or sharing ``spec.share_array_with``'s array)."""
        validate_table_name(name)
        config, optimizer = spec.config, spec.optimizer
        if config.embedding_dim > self.limits.max_embedding_dim:
            raise LimitExceededError(
                f"embedding_dim {config.embedding_dim} is over the limit "
                f"max_embedding_dim={self.limits.max_embedding_dim}"
            )
        if config.memory_size > self.limits.max_memory_size:
            raise LimitExceededError(
                f"memory_size {config.memory_size} is over the limit "
                f"max_memory_size={self.limits.max_memory_size}"
            )
        with self._registry_lock.hold():
            registry = self.directory.read_registry()
            if name in registry.tables:
                raise ConflictError(f"table {name!r} already exists")
            if len(registry.tables) >= self.limits.max_tables:
                raise LimitExceededError(f"there are already max_tables={self.limits.max_tables} tables")
            if spec.share_array_with is not None:
                array_id = self._shared_array_id(registry, spec)
                self._register(registry, name, config, optimizer, array_id, version=0)
        if spec.share_array_with is not None:
            return self.info(name)
        return self._install(name, spec, source=None, version=0)

    def _shared_array_id(self, registry: _Registry, spec: TableSpec) -> str:
        source_name = spec.share_array_with
        source = registry.tables.get(source_name or "")
        if source is None:
            raise NotFoundError(f"share_array_with: no table named {source_name!r}")
        if not isinstance(self.journal, NullJournal):
            raise ConfigError(
                "share_array_with is not available with a data directory: the write-ahead log is per table"
            )
        source_config = TableConfig.from_dict(source["config"])
        if spec.config.memory_size != source_config.memory_size:
            raise ConfigError(
                f"share_array_with={source_name!r}: memory_size must be the shared array's "
                f"{source_config.memory_size}, got {spec.config.memory_size}"
            )
        if spec.optimizer != OptimizerConfig.from_dict(source["optimizer"]):
            raise ConfigError(
                f"share_array_with={source_name!r}: the optimizer must be the shared array's "
                f"({source['optimizer']}); its state is shared too"
            )
        return str(source["array"])

    def _install(self, name: str, spec: TableSpec, *, source: Table | None, version: int) -> TableInfo:
        """Allocate a new array for ``name``, fill it from ``source`` (or a freshly initialised Table),
        journal its creation when it is new, then publish it."""
        if spec.share_array_with is not None:
            raise ConfigError("a table with its own array cannot also share one")
        layout = _array_layout(spec.config, spec.optimizer)
        nbytes = _layout_bytes(layout)
        with self._registry_lock.hold():
            registry = self.directory.read_registry()
            if name in registry.tables:
                raise ConflictError(f"table {name!r} already exists")
            if len(registry.tables) >= self.limits.max_tables:
                raise LimitExceededError(f"there are already max_tables={self.limits.max_tables} tables")
            total = registry.total_bytes() + nbytes
            if total > self.limits.max_total_memory_bytes:
                raise LimitExceededError(
                    f"the table needs {nbytes} bytes; with the {registry.total_bytes()} bytes in use "
                    f"that is over the limit max_total_memory_bytes={self.limits.max_total_memory_bytes}"
                )
            array_id = secrets.token_hex(8)
            journaled = False
            try:
                tensors: dict[str, Tensor] = {}
                for key, (shape, dtype) in layout.items():
                    tensors[key] = self.directory.allocate(
                        f"arrays/{array_id}.{key}", _numel(shape), dtype
                    ).view(shape)
                # The core initialises a new array (seeded) or brings a loaded one; both are copied into
                # shared memory once, so the private copy lives only for this call.
                fresh = source if source is not None else Table(spec.config, spec.optimizer)
                for key, tensor in fresh.tensors().items():
                    tensors[key].copy_(tensor.reshape(tensors[key].shape))
                del fresh
                registry.arrays[array_id] = {
                    "layout": {
                        key: [list(shape), _dtype_name(dtype)] for key, (shape, dtype) in layout.items()
                    },
                    "nbytes": nbytes,
                }
                if source is None:
                    shared = Table(
                        spec.config,
                        spec.optimizer,
                        weight=tensors["weight"],
                        state={k.removeprefix("state."): t for k, t in tensors.items() if k != "weight"},
                    )
                    self.journal.create(name, shared, version)
                    journaled = True
                self._register(registry, name, spec.config, spec.optimizer, array_id, version=version)
            except BaseException:
                registry.arrays.pop(array_id, None)
                for key in layout:
                    (self.directory.arrays_dir / f"{array_id}.{key}").unlink(missing_ok=True)
                if journaled:
                    # Otherwise the table, never served, would come back from the data directory at the
                    # next start: a failed create must change nothing.
                    self._drop_quietly(name)
                raise
        return self.info(name)

    def _drop_quietly(self, name: str) -> None:
        """Roll back a ``journal.create``; a failure here is logged, the caller's error is what counts."""
        try:
            self.journal.drop(name)
        except Exception:
            logger.exception("could not remove table %r from the journal after a failed create", name)

    def _register(
        self,
        registry: _Registry,
        name: str,
        config: TableConfig,
        optimizer: OptimizerConfig,
        array_id: str,
        *,
        version: int,
    ) -> None:
        uid = secrets.token_hex(8)
        counters = self.directory.allocate(f"tables/{uid}.counters", 2, torch.int64)
        counters[_VERSION] = version
        registry.tables[name] = {
            "uid": uid,
            "array": array_id,
            "config": config.to_dict(),
            "optimizer": optimizer.to_dict(),
        }
        self._publish(registry)

    def delete(self, name: str) -> None:
        """Remove a table; its array goes when no other table reads it. In-flight lookups in other
        workers keep their mapping until they finish (unlinked files live while mapped)."""
        with self._registry_lock.hold():
            registry = self.directory.read_registry()
            record = registry.tables.get(name)
            if record is None:
                raise NotFoundError(f"no table named {name!r}")
            with self._sync_lock:
                self._sync(registry, int(self._generation[0]))
            entry = self._entries[name]
            with entry.array.lock.hold():
                entry.counters[_DELETED] = 1  # updates waiting on the lock see this and answer 404
                self.journal.drop(name)
                del registry.tables[name]
                array_id = record["array"]
                orphan = not registry.array_tables(array_id)
                if orphan:
                    layout = registry.arrays.pop(array_id)["layout"]
                self._publish(registry)
            (self.directory.tables_dir / f"{record['uid']}.counters").unlink(missing_ok=True)
            if orphan:
                for key in layout:
                    (self.directory.arrays_dir / f"{array_id}.{key}").unlink(missing_ok=True)
                (self.directory.arrays_dir / f"{array_id}.lock").unlink(missing_ok=True)

    # -- data path --------------------------------------------------------------------------------

    def lookup(
        self,
        name: str,
        ids: Tensor,
        offsets: Tensor | None = None,
        pooling: Pooling = "none",
        per_sample_weights: Tensor | None = None,
    ) -> LookupResult:
        """Rows of ``ids`` (int64 (n,)) -> float32 (n, d); with ``pooling`` sum/mean, bags delimited by
        ``offsets`` (int64 (B,), nn.EmbeddingBag style; None = one bag) -> (B, d). Never takes a lock."""
        entry = self._entry(name)
        table = entry.table
        self.limits.check_request(
            int(ids.shape[0]) if ids.dim() == 1 else int(ids.numel()), table.config.embedding_dim
        )
        table.validate_ids(ids)
        bag_offsets, weights = _validate_pooling(ids, offsets, pooling, per_sample_weights)
        version = entry.version
        start = time.perf_counter()
        chunk_offsets = table.hash(ids)
        hashed = time.perf_counter()
        rows = table.gather(chunk_offsets)
        if pooling != "none":
            assert bag_offsets is not None
            positions = torch.arange(rows.shape[0], dtype=torch.int64)
            rows = F.embedding_bag(positions, rows, bag_offsets, mode=pooling, per_sample_weights=weights)
        done = time.perf_counter()
        return LookupResult(rows, version, hashed - start, done - hashed)

    def lookup_many(self, items: list[LookupRequestItem]) -> list[LookupResult]:
        """Several lookups in one request; the request limits apply to their sum. All tables are
        resolved and the limits checked before any lookup runs."""
        total_ids = total_values = 0
        for item in items:
            num_ids = max(1, int(item.ids.numel()))  # an empty lookup still costs a table resolution
            total_ids += num_ids
            total_values += num_ids * self._entry(item.table).table.config.embedding_dim
        self.limits.check_request(total_ids, 0)
        if total_values > self.limits.max_values_per_request:
            raise LimitExceededError(
                f"{total_values} values in one request; the limit is "
                f"max_values_per_request={self.limits.max_values_per_request}"
            )
        return [
            self.lookup(item.table, item.ids, item.offsets, item.pooling, item.per_sample_weights)
            for item in items
        ]

    def update(self, name: str, ids: Tensor, grads: Tensor, lr: float | None = None) -> UpdateResult:
        """Apply the table's optimizer to the gradients ``grads`` (float32 (n, d)) of the rows of ``ids``
        (int64 (n,)); duplicates are summed. Journalled before it is applied; nothing changes on error."""
        entry = self._entry(name)
        table = entry.table
        self.limits.check_request(int(ids.numel()), table.config.embedding_dim)
        table.validate_grads(ids, grads)
        applied_lr = table.optimizer.lr if lr is None else float(lr)
        if not (applied_lr > 0 and applied_lr != float("inf")):
            raise InvalidInputError(f"lr must be a positive finite number, got {lr}")
        start = time.perf_counter()
        # Hashing reads only the config, so it runs outside the lock.
        chunk_offsets = table.hash(ids)
        hashed = time.perf_counter()
        with entry.array.lock.hold():
            if entry.deleted:
                raise NotFoundError(f"no table named {name!r}")
            version = entry.version + 1
            self.journal.append(UpdateRecord(name, version, ids, grads, applied_lr))
            apply_start = time.perf_counter()
            table.apply_gradients_at(chunk_offsets, grads, applied_lr)
            applied = time.perf_counter()
            entry.counters[_VERSION] = version
        return UpdateResult(version, hashed - start, applied - apply_start)

    def warm_up(self) -> None:
        """Load the compiled kernels now (numba's on-disk cache), so a worker's first lookup or update is
        not the one that pays for it. Lookups read the real tables; updates run on a tiny private table
        of the same kind (same hash, chunk size and optimizer), so nothing shared changes."""
        probe = torch.zeros(1, dtype=torch.int64)
        kinds = set()
        for entry in list(self._entries.values()):
            table = entry.table
            table.gather(table.hash(probe))
            config = table.config
            kinds.add((config.embedding_dim, config.chunk_size, config.hash, table.optimizer))
        for embedding_dim, chunk_size, hash_name, optimizer in kinds:
            tiny = TableConfig(
                1, embedding_dim, memory_size=2 * chunk_size, chunk_size=chunk_size, hash=hash_name
            )
            Table(tiny, optimizer).apply_gradients(probe, torch.zeros(1, embedding_dim))

    # -- durability hooks for the snapshot / load endpoints -----------------------------------------

    @contextmanager
    def exclusive(self, name: str) -> Iterator[tuple[Table, int]]:
        """Hold the table's update lock: yields (table, version) with no update running or starting."""
        entry = self._entry(name)
        with entry.array.lock.hold():
            if entry.deleted:
                raise NotFoundError(f"no table named {name!r}")
            yield entry.table, entry.version

    def snapshot(self, name: str) -> int:
        """Journal a snapshot of the table at its current version (no update in between); returns it."""
        with self.exclusive(name) as (table, version):
            self.journal.snapshot(name, table, version)
            return version

    def restore(self, name: str, source: Table, version: int) -> None:
        """Replace the table's array and optimizer state with ``source`` (same config and optimizer) at
        ``version``. ``source`` is made durable first (a snapshot, which starts an empty log): if that fails
        the table is left as it was, in memory and on disk. Lookups concurrent with this see the same
        mixes as with updates."""
        with self.exclusive(name) as (table, _):
            if (source.config, source.optimizer) != (table.config, table.optimizer):
                raise ConflictError(f"the checkpoint's config or optimizer differs from table {name!r}'s")
            self.journal.snapshot(name, source, version)
            targets = table.tensors()
            for key, tensor in source.tensors().items():
                targets[key].copy_(tensor.reshape(targets[key].shape))
            self._entries[name].counters[_VERSION] = version

    def close(self) -> None:
        """Release this worker's locks and mappings (the shared directory stays; its owner removes it)."""
        with self._sync_lock:
            for array in self._arrays.values():
                array.lock.close()
            self._arrays, self._entries = {}, {}
        self._registry_lock.close()


def _validate_pooling(
    ids: Tensor, offsets: Tensor | None, pooling: str, per_sample_weights: Tensor | None
) -> tuple[Tensor | None, Tensor | None]:
    """Checks nn.EmbeddingBag-style bags; returns (offsets, per_sample_weights) ready for pooling."""
    if pooling not in POOLINGS:
        raise InvalidInputError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    num_ids = int(ids.shape[0])
    if pooling == "none":
        if offsets is not None or per_sample_weights is not None:
            raise InvalidInputError("offsets and per_sample_weights need pooling 'sum' or 'mean'")
        return None, None
    if offsets is None:
        offsets = torch.zeros(1, dtype=torch.int64)
    if offsets.dtype != torch.int64 or offsets.dim() != 1:
        raise InvalidInputError("offsets must be a 1-D list of int64 bag starts")
    if offsets.numel() > 0:
        if int(offsets[0]) != 0:
            raise InvalidInputError(f"offsets[0] must be 0, got {int(offsets[0])}")
        if bool((offsets[1:] < offsets[:-1]).any()) or int(offsets[-1]) > num_ids:
            raise InvalidInputError(f"offsets must be non-decreasing and at most len(ids) = {num_ids}")
    if per_sample_weights is not None:
        if pooling != "sum":
            raise InvalidInputError("per_sample_weights need pooling 'sum' (as in nn.EmbeddingBag)")
        if per_sample_weights.dim() != 1 or int(per_sample_weights.shape[0]) != num_ids:
            raise InvalidInputError(f"per_sample_weights must have one weight per id ({num_ids})")
        per_sample_weights = per_sample_weights.to(torch.float32)
        if not bool(torch.isfinite(per_sample_weights).all()):
            raise InvalidInputError("per_sample_weights must be finite (no NaN or Inf)")
    return offsets, per_sample_weights
