"""Durability endpoints in-process: snapshot, load (robez checkpoints and the paper's state_dict), export,
recovery across app restarts, periodic and shutdown snapshots."""

from __future__ import annotations

import errno
import io
import json
import logging
import pickle
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from torch import Tensor

from robez_core import reference
from robez_core.checkpoint import CheckpointWriter
from robez_core.hashing import PAPER_PRIME
from robez_core.table import Table
from service import cli
from service.app import create_app
from service.config import Settings
from service.store.journal import UpdateRecord
from service.wal import LOG_FILE, LOG_HEADER_SIZE, SnapshotScheduler, WalJournal

DIM, MEMORY, CHUNK = 8, 512, 4
TABLE: dict[str, Any] = {
    "name": "t",
    "config": {"num_embeddings": 10_000, "embedding_dim": DIM, "memory_size": MEMORY, "chunk_size": CHUNK},
    "optimizer": {"name": "adagrad", "lr": 0.1},
}


def _settings(tmp_path: Path, *, data_dir: bool = True, **overrides: Any) -> Settings:
    return Settings(
        data_dir=tmp_path / "data" if data_dir else None,
        shm_dir=tmp_path / "shm",
        default_table=False,
        **overrides,
    )


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    (tmp_path / "shm").mkdir()
    return _settings(tmp_path)


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as test_client:
        yield test_client


def _create(client: TestClient, table: dict[str, Any] = TABLE) -> None:
    response = client.post("/v1/tables", json=table)
    assert response.status_code == 201, response.text


def _push(client: TestClient, seed: int, name: str = "t", num_ids: int = 5) -> int:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (num_ids,), generator=generator)
    grads = torch.randn(num_ids, DIM, generator=generator)
    response = client.post(f"/v1/tables/{name}/update", json={"ids": ids.tolist(), "grads": grads.tolist()})
    assert response.status_code == 200, response.text
    return int(response.json()["version"])


def _rows(client: TestClient, ids: list[int], name: str = "t") -> Tensor:
    response = client.post(f"/v1/tables/{name}/lookup", json={"ids": ids})
    assert response.status_code == 200, response.text
    return torch.tensor(response.json()["embeddings"], dtype=torch.float32)


def _export(client: TestClient, name: str = "t") -> tuple[bytes, int]:
    response = client.get(f"/v1/tables/{name}/checkpoint")
    assert response.status_code == 200, response.text
    return response.content, int(response.headers["X-Robez-Version"])


def _table_from(data: bytes, tmp_path: Path) -> Table:
    path = tmp_path / "downloaded.safetensors"
    path.write_bytes(data)
    return Table.load(path)


PROBE = list(range(0, 1000, 7))


def test_updates_survive_a_restart(settings: Settings) -> None:
    """Graceful shutdown snapshots; with it switched off the log alone brings the updates back."""
    for on_shutdown in (True, False):
        settings = settings.model_copy(update={"snapshot_on_shutdown": on_shutdown})
        name = f"t{int(on_shutdown)}"
        with TestClient(create_app(settings)) as client:
            _create(client, {**TABLE, "name": name})
            for seed in range(4):
                _push(client, seed, name)
            before = _rows(client, PROBE, name)
        log = settings.data_dir / name / LOG_FILE  # type: ignore[operator]
        assert (log.stat().st_size == LOG_HEADER_SIZE) == on_shutdown
        with TestClient(create_app(settings)) as client:
            info = client.get(f"/v1/tables/{name}").json()
            assert info["version"] == 4
            assert torch.equal(_rows(client, PROBE, name), before)


def test_snapshot_endpoint_empties_the_log(client: TestClient, settings: Settings) -> None:
    _create(client)
    for seed in range(3):
        _push(client, seed)
    response = client.post("/v1/tables/t/snapshot")
    assert response.status_code == 200, response.text
    assert response.json()["version"] == 3 and response.json()["snapshot_bytes"] > MEMORY * 4
    assert (settings.data_dir / "t" / LOG_FILE).stat().st_size == LOG_HEADER_SIZE  # type: ignore[operator]
    assert client.post("/v1/tables/nope/snapshot").status_code == 404


def test_export_then_load_restores_the_rows(client: TestClient, tmp_path: Path) -> None:
    _create(client)
    _push(client, 1)
    saved, version = _export(client)
    assert version == 1
    saved_rows = _rows(client, PROBE)
    exported = _table_from(saved, tmp_path)
    assert torch.equal(exported.lookup(torch.tensor(PROBE)), saved_rows)
    for seed in range(2, 5):
        _push(client, seed)
    assert not torch.equal(_rows(client, PROBE), saved_rows)
    response = client.post(
        "/v1/tables/t/load", content=saved, headers={"Content-Type": "application/octet-stream"}
    )
    assert response.status_code == 200, response.text
    assert response.json()["version"] == 0
    assert torch.equal(_rows(client, PROBE), saved_rows)
    again, _ = _export(client)
    assert torch.equal(_table_from(again, tmp_path).state["sum"], exported.state["sum"])  # adagrad state too


def test_load_creates_a_missing_table_and_survives_restart(settings: Settings, tmp_path: Path) -> None:
    with TestClient(create_app(settings)) as client:
        _create(client)
        _push(client, 7)
        saved, _ = _export(client)
        rows = _rows(client, PROBE)
        response = client.post("/v1/tables/copy/load", content=saved)
        assert response.status_code == 200, response.text
        assert response.json()["optimizer"]["name"] == "adagrad"
        assert torch.equal(_rows(client, PROBE, "copy"), rows)
        _push(client, 8, "copy")
        copy_rows = _rows(client, PROBE, "copy")
    with TestClient(create_app(settings)) as client:
        assert client.get("/v1/tables/copy").json()["version"] == 1
        assert torch.equal(_rows(client, PROBE, "copy"), copy_rows)


def test_load_rejects_bad_and_mismatched_checkpoints(client: TestClient) -> None:
    _create(client)
    _create(client, {**TABLE, "name": "wide", "config": {**TABLE["config"], "embedding_dim": DIM * 2}})
    wide, _ = _export(client, "wide")
    before = _rows(client, PROBE)
    assert client.post("/v1/tables/t/load", content=wide).status_code == 409
    assert client.post("/v1/tables/t/load", content=b"garbage" * 10).status_code == 422
    assert client.post("/v1/tables/t/load", content=wide[:-5]).status_code == 422
    assert client.post("/v1/tables/t/load?format=paper", content=wide).status_code == 422
    assert torch.equal(_rows(client, PROBE), before)
    assert client.get("/v1/tables/t").json()["version"] == 0


class _Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("unpickled!",))


def test_load_never_unpickles_arbitrary_objects(
    client: TestClient, capsys: pytest.CaptureFixture[str]
) -> None:
    _create(client)
    buffer = io.BytesIO()
    torch.save({"weight": torch.zeros(MEMORY), "evil": _Boom()}, buffer)
    response = client.post("/v1/tables/t/load", content=buffer.getvalue())
    assert response.status_code == 422, response.text
    legacy = pickle.dumps({"weight": _Boom()}, protocol=2)
    assert client.post("/v1/tables/t/load?format=paper", content=legacy).status_code == 422
    assert "unpickled!" not in capsys.readouterr().out


def _paper_state_dict(
    embedding_dim: int, chunk_size: int, memory_size: int, seed: int
) -> OrderedDict[str, Tensor]:
    """What the paper's RobezEmbedding.state_dict() holds, built the way its __init__ builds it."""
    random_numbers = np.concatenate(
        [np.array([PAPER_PRIME]), np.random.RandomState(seed).randint(0, PAPER_PRIME, (10,))]
    )
    weight = torch.from_numpy(
        np.random.RandomState(seed + 1).uniform(-0.001, 0.001, memory_size).astype(np.float32)
    )
    j = torch.arange(embedding_dim, dtype=torch.int64)
    return OrderedDict(
        weight=weight,
        random_numbers=torch.from_numpy(random_numbers.astype(np.int64)),
        helper_Eidx_base=j // chunk_size,
        helper_Eidx_offset=j % chunk_size,
        helper_E1sR=torch.full((embedding_dim,), int(random_numbers[3]), dtype=torch.int64),
    )


def test_paper_state_dict_gives_the_reference_rows(client: TestClient) -> None:
    state_dict = _paper_state_dict(DIM, CHUNK, MEMORY, seed=123)
    buffer = io.BytesIO()
    torch.save({f"emb_l.0.{key}": value for key, value in state_dict.items()}, buffer)  # inside a model
    response = client.post(
        "/v1/tables/paper/load?num_embeddings=5000&optimizer=sgd&lr=0.5", content=buffer.getvalue()
    )
    assert response.status_code == 200, response.text
    info = response.json()
    assert info["config"]["chunk_size"] == CHUNK and info["config"]["num_embeddings"] == 5000
    assert (info["optimizer"]["name"], info["optimizer"]["lr"]) == ("sgd", 0.5)
    ids = torch.tensor([0, 1, 2, 4999, 123456789, -5, 2**62], dtype=torch.int64)
    expected = reference.lookup(state_dict["weight"], ids, DIM, CHUNK, state_dict["random_numbers"])
    got = _rows(client, ids.tolist(), "paper")
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


def test_paper_state_dict_into_an_existing_table_keeps_its_optimizer(client: TestClient) -> None:
    _create(client, {**TABLE, "config": {**TABLE["config"], "seed": 77}})
    state_dict = _paper_state_dict(DIM, CHUNK, MEMORY, seed=77)  # same constants as seed 77
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    response = client.post("/v1/tables/t/load", content=buffer.getvalue())
    assert response.status_code == 200, response.text
    assert response.json()["optimizer"]["name"] == "adagrad" and response.json()["config"]["seed"] == 77
    expected = reference.lookup(
        state_dict["weight"], torch.tensor(PROBE), DIM, CHUNK, state_dict["random_numbers"]
    )
    assert torch.equal(_rows(client, PROBE), expected)
    other = _paper_state_dict(DIM, CHUNK, MEMORY, seed=78)  # other hash constants: not this table's array
    buffer = io.BytesIO()
    torch.save(other, buffer)
    assert client.post("/v1/tables/t/load", content=buffer.getvalue()).status_code == 409


def test_without_a_data_dir_export_works_and_snapshot_is_refused(tmp_path: Path) -> None:
    (tmp_path / "shm").mkdir()
    with TestClient(create_app(_settings(tmp_path, data_dir=False))) as client:
        _create(client)
        _push(client, 3)
        assert client.post("/v1/tables/t/snapshot").status_code == 409
        saved, version = _export(client)
        assert version == 1
        assert torch.equal(_table_from(saved, tmp_path).lookup(torch.tensor(PROBE)), _rows(client, PROBE))


def test_writes_need_the_key(tmp_path: Path) -> None:
    (tmp_path / "shm").mkdir()
    with TestClient(create_app(_settings(tmp_path, api_key="k"))) as client:
        auth = {"Authorization": "Bearer k"}
        assert client.post("/v1/tables", json=TABLE, headers=auth).status_code == 201
        assert client.post("/v1/tables/t/snapshot").status_code == 401
        assert client.get("/v1/tables/t/checkpoint").status_code == 401
        assert client.post("/v1/tables/t/load", content=b"x").status_code == 401
        assert client.post("/v1/tables/t/snapshot", headers=auth).status_code == 200


def test_periodic_snapshots_follow_the_policy(tmp_path: Path) -> None:
    (tmp_path / "shm").mkdir()
    settings = _settings(tmp_path, snapshot_every_updates=3)
    with TestClient(create_app(settings)) as client:
        _create(client)
        store = client.app.state.store  # type: ignore[attr-defined]
        journal = store.journal
        assert isinstance(journal, WalJournal)
        scheduler = SnapshotScheduler(store, journal)
        _push(client, 1)
        _push(client, 2)
        assert scheduler.run_once() == [] and journal.snapshot_version("t") == 0
        _push(client, 3)
        assert scheduler.run_once() == ["t"] and journal.snapshot_version("t") == 3
        assert scheduler.run_once() == []
        meta = json.loads((tmp_path / "data" / "t" / "meta.json").read_text())
        assert meta["version"] == 3 and meta["generation"] == 2


def test_a_periodic_snapshot_on_a_full_disk_warns_once_without_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "shm").mkdir()
    with TestClient(create_app(_settings(tmp_path, snapshot_every_updates=1))) as client:
        _create(client)
        _push(client, 1)
        store = client.app.state.store  # type: ignore[attr-defined]
        scheduler = SnapshotScheduler(store, store.journal)

        def disk_full(cls: type, fd: int, tensors: Any, metadata: Any) -> None:
            raise OSError(28, "No space left on device")

        # The scheduler's snapshot file is allocated by CheckpointWriter.begin (journal.snapshot_live).
        monkeypatch.setattr(CheckpointWriter, "begin", classmethod(disk_full))
        with caplog.at_level("WARNING", logger="robez.wal"):
            assert scheduler.run_once() == [] and scheduler.run_once() == []
        monkeypatch.undo()
        warnings = [r for r in caplog.records if r.name == "robez.wal"]
        assert len(warnings) == 1 and warnings[0].exc_info is None
        assert "no space left" in warnings[0].getMessage()
        assert scheduler.run_once() == ["t"]  # space back: the next check takes it


def test_a_failing_snapshot_check_says_what_failed_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Out of file descriptors, the policy check cannot read meta.json: one line naming the stage and the
    error (no traceback), not one per check; one line when it works again."""
    (tmp_path / "shm").mkdir()
    # No periodic policy, so the app runs no scheduler thread of its own; this one checks "has updates".
    settings = _settings(tmp_path, snapshot_every_updates=0, snapshot_every_seconds=0)
    with TestClient(create_app(settings)) as client:
        _create(client)
        store = client.app.state.store  # type: ignore[attr-defined]
        scheduler = SnapshotScheduler(store, store.journal)
        due = store.journal.has_pending
        _push(client, 1)
        real_read_bytes = Path.read_bytes

        def no_descriptors(path: Path) -> bytes:
            if path.name == "meta.json":
                raise OSError(errno.EMFILE, "Too many open files", str(path))
            return real_read_bytes(path)

        monkeypatch.setattr(Path, "read_bytes", no_descriptors)
        with caplog.at_level(logging.INFO, logger="robez.wal"):
            assert scheduler.run_once(due) == [] and scheduler.run_once(due) == []
            monkeypatch.undo()
            assert scheduler.run_once(due) == ["t"]
    failures = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(failures) == 1 and failures[0].exc_info is None
    message = failures[0].getMessage()
    assert "reading meta.json" in message and "Too many open files" in message, message
    assert any("working again" in r.getMessage() for r in caplog.records)


def test_cli_import_and_snapshot_offline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data_dir = tmp_path / "data"
    state_dict = _paper_state_dict(DIM, CHUNK, MEMORY, seed=5)
    checkpoint = tmp_path / "paper.pt"
    torch.save(state_dict, checkpoint)
    args = ["import", str(checkpoint), "--data-dir", str(data_dir), "--table", "p", "--optimizer", "adam"]
    assert cli.main(args) == 0
    assert "paper checkpoint" in capsys.readouterr().out
    assert cli.main(args) == 2  # exists; --replace needed
    assert "--replace" in capsys.readouterr().err

    journal = WalJournal(data_dir)
    loaded = journal.load("p")
    assert loaded is not None
    table, version = loaded
    assert version == 0 and table.optimizer.name == "adam"
    probe = torch.tensor(PROBE)
    expected = reference.lookup(state_dict["weight"], probe, DIM, CHUNK, state_dict["random_numbers"])
    assert torch.equal(table.lookup(probe), expected)
    for step in range(1, 4):  # what a server would have logged
        ids, grads = probe[:5] + step, torch.full((5, DIM), 0.5)
        journal.append(UpdateRecord("p", step, ids, grads, 0.01))
        table.apply_gradients(ids, grads, 0.01)
    assert cli.main(["snapshot", "--data-dir", str(data_dir)]) == 2  # a server (this journal) holds it
    assert "in use" in capsys.readouterr().err
    journal.close()

    assert cli.main(["snapshot", "--data-dir", str(data_dir), "--table", "p"]) == 0
    assert "version 3 (3 logged updates" in capsys.readouterr().out
    assert (data_dir / "p" / LOG_FILE).stat().st_size == LOG_HEADER_SIZE
    journal = WalJournal(data_dir)
    reloaded = journal.load("p")
    journal.close()
    assert reloaded is not None and reloaded[1] == 3
    assert torch.equal(reloaded[0].weight, table.weight)
    assert torch.equal(reloaded[0].state["exp_avg"], table.state["exp_avg"])

    assert cli.main([*args, "--replace", "--chunk-size", "99"]) == 2  # contradicts the helpers
    assert "chunk_size" in capsys.readouterr().err


def _table_files(settings: Settings, name: str = "t") -> dict[str, bytes]:
    folder = settings.data_dir / name  # type: ignore[operator]
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def test_a_load_whose_snapshot_fails_leaves_the_table_as_it_was(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loaded table must be durable before it is served: with the disk full while its snapshot is
    written, the old table stays served and its files stay as they were, so later updates are logged
    against the right snapshot and a restart gives the rows the server served."""
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        _create(client)
        _create(client, {**TABLE, "name": "src"})
        _push(client, 11, "src")
        saved, _ = _export(client, "src")
        for seed in range(2):
            _push(client, seed)  # t: version 2, logged against its version-0 snapshot
        rows, files = _rows(client, PROBE), _table_files(settings)

        def disk_full(table: Table, fd: int) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(Table, "begin_write", disk_full)  # the load's snapshot
        response = client.post("/v1/tables/t/load", content=saved)
        monkeypatch.undo()
        assert response.status_code == 507, response.text  # a full disk: StorageFullError
        assert client.get("/v1/tables/t").json()["version"] == 2
        assert torch.equal(_rows(client, PROBE), rows)
        assert _table_files(settings) == files
        assert _push(client, 5) == 3
        rows = _rows(client, PROBE)
    with TestClient(create_app(settings)) as client:
        assert client.get("/v1/tables/t").json()["version"] == 3
        assert torch.equal(_rows(client, PROBE), rows)


BINARY = {"Content-Type": "application/octet-stream"}


def _deflated(torch_zip: bytes) -> bytes:
    """The same torch.save archive with every member deflated: what a zip bomb looks like (tiny upload,
    each member declaring its full size in the central directory)."""
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(torch_zip)) as source, zipfile.ZipFile(out, "w") as target:
        for member in source.infolist():
            target.writestr(member.filename, source.read(member), compress_type=zipfile.ZIP_DEFLATED)
    return out.getvalue()


def test_a_checkpoint_declaring_more_than_the_limits_is_refused_before_it_is_unpacked(tmp_path: Path) -> None:
    """A paper state_dict whose array (4M floats, 16 MiB) is over the tables' limit (max_memory_size 1M:
    3 x 4 MiB + 1 MiB): 413 naming the limit, read from the zip's central directory, before torch.load
    reads anything. The same file as a few KiB of deflated zeros is refused before anything is inflated,
    as is a deflated one within the limit: torch.save stores storages uncompressed (and only those can be
    memory-mapped), a compressed one is a file remade to grow once unpacked."""
    big = 4 * 1024 * 1024
    state_dict = _paper_state_dict(DIM, CHUNK, 64, seed=5)
    state_dict["weight"] = torch.zeros(big)
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    bomb = _deflated(buffer.getvalue())
    assert len(bomb) < big // 100
    with TestClient(create_app(_settings(tmp_path, max_memory_size=1 << 20))) as client:
        load = f"/v1/tables/new/load?num_embeddings=1000&chunk_size={CHUNK}"
        response = client.post(load, content=buffer.getvalue(), headers=BINARY)
        assert response.status_code == 413, response.text
        assert "max_memory_size=1048576" in response.json()["error"]
        state_dict["weight"] = torch.zeros(64)
        small = io.BytesIO()
        torch.save(state_dict, small)
        for body in (bomb, _deflated(small.getvalue())):
            response = client.post(load, content=body, headers=BINARY)
            assert response.status_code == 422, response.text
            assert "its storage is compressed in the zip" in response.json()["error"]
        assert client.get("/v1/tables/new").status_code == 404
        # Within the limit, as torch.save wrote it, it loads.
        response = client.post(load, content=small.getvalue(), headers=BINARY)
        assert response.status_code == 200, response.text
