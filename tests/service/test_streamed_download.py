"""The checkpoint download is sent while it is made (service/log/stream_copy.py): its first byte goes
at once, not after a whole copy; it is bitwise the table at the version it names while other workers
push beside it; a full disk ends the download, never an update. Tables of a few MB, made slow by the
test hook ``Faults.slow_seconds`` (a pause per 16 MiB sent), not by size."""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from robez_core.errors import BusyError
from robez_core.table import Table
from service.app import create_app
from service.faults import Faults
from service.log import granules
from service.log.journal import NullJournal
from service.log.stream_copy import SIDE_FILE_PREFIX, CheckpointStream, StreamAborted
from service.routes.durability import open_stream
from service.store import TableStore
from service.wal.files import remove_creation_leftovers

from .conftest import make_settings, store_of
from .threaded_server import ThreadedServer

BIG = {"num_embeddings": 100_000, "embedding_dim": 16, "memory_size": 1 << 22, "chunk_size": 16}
SLOW_SECONDS = 0.5  # per 16 MiB piece: adam's three tensors of 16 MiB take >= 1.5 s to send
# Pushes of 64 ids go through the compiled small path (hashed in the call), of 200 through a prepared step.
SIZES = (64, 200)


class _Server(ThreadedServer):
    """A server without tables, its store at hand."""

    def __init__(self, tmp_path: Path, **settings: Any) -> None:
        super().__init__(
            create_app(make_settings(tmp_path, default_table=False, **settings), faults=Faults())
        )
        self.store: TableStore = self.app.state.store
        self.settings = self.app.state.settings


@pytest.fixture
def server(tmp_path: Path) -> Iterator[_Server]:
    running = _Server(tmp_path)
    try:
        response = httpx.post(
            f"{running.url}/v1/tables", json={"name": "big", "config": BIG, "optimizer": {"name": "adam"}}
        )
        assert response.status_code == 201, response.text
        yield running
    finally:
        running.stop()


class _Pushes:
    """Pushes to "big" through several workers' stores (each its own mapping of the array and of its
    record of granules), on a few hundred overlapping ids, each kept with the version it made;
    ``oracle(version)`` replays them on a private copy of the table as it was at the start."""

    def __init__(self, stores: list[TableStore], seed: int) -> None:
        self.stores = stores
        self.generator = torch.Generator().manual_seed(seed)
        self.lock = threading.Lock()
        self.pushed: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        for store in stores:  # the first push of a store may load compiled kernels: before the measure
            self.push(store, 64)
        table = stores[0].table("big")
        self.start = {key: tensor.clone() for key, tensor in table.tensors().items()}
        self.start_version = stores[0].version("big")
        self.config, self.optimizer = table.config, table.optimizer

    def push(self, store: TableStore, size: int) -> None:
        with self.lock:
            ids = torch.randint(0, 300, (size,), generator=self.generator)
            grads = torch.randn(size, BIG["embedding_dim"], generator=self.generator)
        version = store.update("big", ids, grads).version
        with self.lock:
            self.pushed.append((version, ids, grads))

    def run(self, until: threading.Event) -> list[threading.Thread]:
        """A thread per store pushing, both sizes in turn, until ``until`` is set."""

        def loop(store: TableStore) -> None:
            count = 0
            while not until.is_set() and count < 100_000:
                self.push(store, SIZES[count % len(SIZES)])
                count += 1

        threads = [threading.Thread(target=loop, args=(store,)) for store in self.stores]
        for thread in threads:
            thread.start()
        return threads

    def oracle(self, version: int) -> Table:
        weight = self.start["weight"].clone()
        state = {key[len("state.") :]: t.clone() for key, t in self.start.items() if key != "weight"}
        table = Table(self.config, self.optimizer, weight=weight, state=state)
        for pushed_version, ids, grads in sorted(self.pushed, key=lambda pushed: pushed[0]):
            if self.start_version < pushed_version <= version:
                table.apply_gradients(ids, grads)
        return table


def _load(data: bytes, tmp_path: Path) -> Table:
    path = tmp_path / "downloaded.safetensors"
    path.write_bytes(data)
    try:
        return Table.load(path)  # checksums checked
    finally:
        path.unlink()


def _equal(a: Table, b: Table) -> bool:
    return all(torch.equal(tensor, b.tensors()[key]) for key, tensor in a.tensors().items())


def test_the_download_s_first_byte_goes_before_its_copy_is_made(server: _Server, tmp_path: Path) -> None:
    """The state is sent as it is read (slowed: a pause per 16 MiB); the header and the first block
    arrive within one pause. (Main copied the whole state into a file first, then sent it: its first
    byte came after every pause.)"""
    server.store.faults.slow_seconds = SLOW_SECONDS
    started = time.monotonic()
    with httpx.stream("GET", f"{server.url}/v1/tables/big/checkpoint", timeout=60) as response:
        assert response.status_code == 200
        chunks = response.iter_raw()
        first = next(chunks)
        first_byte = time.monotonic() - started
        body = first + b"".join(chunks)
    total = time.monotonic() - started
    server.store.faults.slow_seconds = 0.0
    assert len(body) == int(response.headers["Content-Length"])
    assert first_byte < SLOW_SECONDS, (first_byte, total)
    assert total >= 3 * SLOW_SECONDS, total  # the three tensors' pauses came after it
    version = int(response.headers["X-Robez-Version"])
    assert version == server.store.version("big")  # nothing pushed: the table as it is
    assert _equal(_load(body, tmp_path), server.store.table("big"))
    assert not server.store.registry.entry("big").marks.active()  # the stream ended its bit


def test_a_client_gone_mid_download_ends_its_stream_at_once(server: _Server) -> None:
    """The stream's bit (updates save granules while it is set) and side file go when the client does,
    not when the abandoned iterator is collected."""
    record = server.store.registry.entry("big").marks
    server.store.faults.slow_seconds = SLOW_SECONDS
    try:
        with httpx.stream("GET", f"{server.url}/v1/tables/big/checkpoint", timeout=60) as response:
            next(response.iter_raw())
            assert record.active()
        deadline = time.monotonic() + 2 * SLOW_SECONDS  # the rest of the stream: 3 pauses
        while record.active() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not record.active()
    finally:
        server.store.faults.slow_seconds = 0.0


@pytest.mark.parametrize("spill_dir", [False, True])
def test_the_download_is_its_version_bitwise_while_several_workers_push(
    server: _Server, tmp_path: Path, spill_dir: bool
) -> None:
    """Three workers push (the compiled small path and prepared steps) while the download is sent: every
    granule an update changes before the stream sent it is saved first (copy-on-write, granules.py),
    so the file is exactly the table at the version the response names, and every hold of the update
    lock is short (one per block, to move the stream's cursor)."""
    store = server.store
    others = [TableStore(store.directory, server.settings, NullJournal()) for _ in range(2)]
    spill = tmp_path / "spill" if spill_dir else None  # a data dir's, or the system's temporary one
    if spill is not None:
        spill.mkdir()
    try:
        pushes = _Pushes([store, *others], seed=5)
        stop = threading.Event()
        threads = pushes.run(stop)
        try:
            deadline = time.monotonic() + 30
            while store.version("big") < pushes.start_version + 5 and time.monotonic() < deadline:
                time.sleep(0.01)
            store.faults.slow_seconds = SLOW_SECONDS / 2
            stream = open_stream(store, "big", spill)
            chunks = []
            for chunk in stream.chunks():
                chunks.append(chunk)
                time.sleep(0.02)  # a slow client: more pushes land between blocks
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=60)
            store.faults.slow_seconds = 0.0
        version = stream.version
        assert version >= pushes.start_version + 5, (version, pushes.start_version)
        assert store.version("big") >= version + 20  # pushed while it was sent
        assert max(stream.lock_holds) < SLOW_SECONDS / 4, stream.lock_holds
        assert _equal(_load(b"".join(chunks), tmp_path), pushes.oracle(version))
        assert not store.registry.entry("big").marks.active()
        if spill is not None:
            assert list(spill.iterdir()) == []  # the side file went with the stream
    finally:
        for other in others:
            other.close()


def test_a_full_disk_ends_the_download_and_never_an_update(
    server: _Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save into the side file that fails (no space left) stops the saves and ends the download with
    an error at its next block; the update that met it, and every one after, succeeds."""
    store = server.store
    stream = open_stream(store, "big", None)
    chunks = stream.chunks()
    next(chunks)  # the header

    def full(*_args: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(granules, "pwrite_fully", full)
    pushes = _Pushes([store], seed=7)  # pushes, each with the disk full
    for size in SIZES:
        pushes.push(store, size)
    with pytest.raises(StreamAborted, match="No space left on device"):
        list(chunks)
    assert not store.registry.entry("big").marks.active()
    pushes.push(store, 64)  # updates go on


def test_a_download_beyond_the_record_s_slots_is_refused_busy(server: _Server) -> None:
    streams: list[CheckpointStream] = []
    try:
        for _ in range(granules.SLOTS):
            streams.append(open_stream(server.store, "big", None))
        with pytest.raises(BusyError):
            open_stream(server.store, "big", None)
        response = httpx.get(f"{server.url}/v1/tables/big/checkpoint", timeout=60)
        assert response.status_code == 503, response.text
    finally:
        for stream in streams:
            stream.close()
    assert not server.store.registry.entry("big").marks.active()


def test_a_table_of_a_partial_last_granule_streams_exactly(
    client_factory: Callable[..., TestClient], tmp_path: Path
) -> None:
    """m not a multiple of the granule (its last one saved zero padded, sent cut), pushes on every id
    between the chunks (each block one whole tensor here): the file is the table at its version."""
    config = {"num_embeddings": 2000, "embedding_dim": 8, "memory_size": (1 << 12) + 40, "chunk_size": 4}
    client = client_factory(default_table=False)
    created = {"name": "big", "config": config, "optimizer": {"name": "adam"}}
    response = client.post("/v1/tables", json=created)
    assert response.status_code == 201, response.text
    store = store_of(client)
    generator = torch.Generator().manual_seed(9)
    pushed: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    start = {key: tensor.clone() for key, tensor in store.table("big").tensors().items()}
    start_version = store.version("big")
    stream = open_stream(store, "big", tmp_path)
    chunks = []
    for chunk in stream.chunks():
        chunks.append(chunk)
        for size in SIZES:  # every id, in one push or in several: every granule changes
            ids = torch.randperm(2000, generator=generator)[: size * 10]
            grads = torch.randn(ids.numel(), 8, generator=generator)
            pushed.append((store.update("big", ids, grads).version, ids, grads))
    table = store.table("big")
    oracle = Table(
        table.config,
        table.optimizer,
        weight=start["weight"].clone(),
        state={key[len("state.") :]: t.clone() for key, t in start.items() if key != "weight"},
    )
    assert stream.version == start_version
    loaded = _load(b"".join(chunks), tmp_path)
    assert _equal(loaded, oracle)  # the version it began at, though every granule changed meanwhile
    assert not _equal(loaded, table)
    for _version, ids, grads in pushed:
        oracle.apply_gradients(ids, grads)
    assert _equal(table, oracle)


def test_a_load_during_a_download_ends_it_with_why(
    client_factory: Callable[..., TestClient], tmp_path: Path
) -> None:
    """The table switched to another array mid-way: the download cannot send its version any more and
    ends with an error at its next block (the headers went: the client sees a short body)."""
    config = {"num_embeddings": 2000, "embedding_dim": 8, "memory_size": 1 << 16, "chunk_size": 4}
    client = client_factory(default_table=False)
    created = {"name": "big", "config": config, "optimizer": {"name": "adam"}}
    assert client.post("/v1/tables", json=created).status_code == 201
    saved = client.get("/v1/tables/big/checkpoint")
    assert saved.status_code == 200
    spill = tmp_path / "spill"
    spill.mkdir()
    stream = open_stream(store_of(client), "big", spill)
    chunks = stream.chunks()
    next(chunks)  # the header
    loaded = client.post("/v1/tables/big/load", content=saved.content)
    assert loaded.status_code == 200, loaded.text
    with pytest.raises(StreamAborted, match="a load"):
        list(chunks)
    assert list(spill.iterdir()) == []  # its side file went


def test_a_side_file_a_kill_left_in_the_data_dir_goes_at_the_next_start(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    left = data_dir / f"{SIDE_FILE_PREFIX}x1y2.saved"
    left.write_bytes(b"saved granules")
    kept = data_dir / "notes.saved"
    kept.write_bytes(b"not ours")
    remove_creation_leftovers(data_dir)
    assert not left.exists() and kept.exists()
