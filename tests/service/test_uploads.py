"""Uploaded checkpoints are checked before anything in them is loaded (service/uploads.py): a small
deflated zip declaring hundreds of MiB of tensors is refused without the worker allocating them, and an
upload is never whole in the worker's memory (it streams to an anonymous temporary file under the data
directory, which torch.load memory-maps)."""

from __future__ import annotations

import io
import os
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from robez_core.errors import InvalidInputError
from robez_core.hashing import PAPER_PRIME
from service.app import create_app
from service.config import Settings
from service.uploads import check_paper_upload

BINARY = {"Content-Type": "application/octet-stream"}
DECLARED_MIB = 256  # under the default limits (3 GiB), well over the 64 MiB a refusal may cost


def _status_kib(field: str) -> int:
    match = re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text())
    assert match is not None
    return int(match.group(1))


def _deflated(source: Path, target: Path) -> None:
    """``source`` (a torch.save zip) with every member deflated, copied in chunks: what a zip bomb looks
    like (a small upload whose central directory declares each member's full size)."""
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as out:
        for member in src.infolist():
            with src.open(member) as reader, out.open(member.filename, "w", force_zip64=True) as writer:
                shutil.copyfileobj(reader, writer, 1 << 20)


@pytest.fixture(scope="module")
def bomb(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A paper state_dict of the right keys, dtypes and shapes declaring a 256 MiB ``weight``, whose
    ``helper_E1sR`` is wrong (only loading it tells), deflated to a few hundred KiB."""
    folder = tmp_path_factory.mktemp("bomb")
    plain = folder / "plain.pt"
    state_dict = _paper(memory=DECLARED_MIB << 18)  # float32: 4 bytes a value
    state_dict["helper_E1sR"] = torch.zeros(8, dtype=torch.int64)
    torch.save(state_dict, plain)
    del state_dict
    _deflated(plain, folder / "bomb.pt")
    plain.unlink()
    return (folder / "bomb.pt").read_bytes()


def _settings(tmp_path: Path) -> Settings:
    (tmp_path / "shm").mkdir(exist_ok=True)
    return Settings(data_dir=tmp_path / "data", shm_dir=tmp_path / "shm", default_table=False)


def test_a_refused_upload_declaring_256_mib_costs_under_64_mib(tmp_path: Path, bomb: bytes) -> None:
    """The bomb is refused before anything in it is inflated (422: torch.save stores storages
    uncompressed), nothing is created, and the process's peak memory while it is refused grows by less
    than 64 MiB (torch.load would inflate the whole 256 MiB storage before its values could be checked)."""
    assert len(bomb) < 2 << 20
    with TestClient(create_app(_settings(tmp_path))) as client:
        Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from now
        before = _status_kib("VmRSS")
        response = client.post("/v1/tables/t/load?chunk_size=4", content=bomb, headers=BINARY)
        grown_mib = (_status_kib("VmHWM") - before) / 1024
        assert response.status_code == 422, response.text
        assert "weight: its storage is compressed in the zip" in response.json()["error"]
        assert grown_mib < 64, f"refusing the upload took {grown_mib:.0f} MiB"
        assert client.get("/v1/tables/t").status_code == 404
        assert not (tmp_path / "data" / "t").exists()


def _upload_files(directory: Path) -> list[str]:
    """This process's open files in ``directory`` that have no name (an anonymous temporary file shows
    as ``#<inode> (deleted)``)."""
    found = []
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith(f"{directory}/") and target.endswith(" (deleted)"):
            found.append(target)
    return found


def test_an_upload_streams_to_an_anonymous_file_and_is_never_whole_in_memory(tmp_path: Path) -> None:
    """A 32 MiB stored state_dict of the right shapes whose values are wrong (helper_E1sR), sent in
    64 KiB chunks as a connection delivers them: while it arrives it is in an open, nameless file under
    the data directory; it is refused (422) with the process's peak memory grown by under 16 MiB (held
    whole it took 32 MiB, and torch.load's copy 32 more); afterwards no file is left open or named."""
    state_dict = _paper(memory=8 << 20)
    state_dict["helper_E1sR"] = torch.zeros(8, dtype=torch.int64)
    body = _saved(state_dict)
    del state_dict
    data_dir = tmp_path / "data"
    chunk = 64 << 10
    during: list[list[str]] = []

    async def call(app: Any) -> list[dict[str, Any]]:
        offsets = iter(range(0, len(body), chunk))
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            offset = next(offsets, None)
            if offset is None:
                return {"type": "http.disconnect"}
            if offset == len(body) // 2 // chunk * chunk:
                during.append(_upload_files(data_dir))
                during.append([entry.name for entry in data_dir.iterdir() if "upload" in entry.name])
            end = offset + chunk
            return {"type": "http.request", "body": body[offset:end], "more_body": end < len(body)}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        headers = [
            (b"content-type", b"application/octet-stream"),
            (b"content-length", str(len(body)).encode()),
        ]
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": "/v1/tables/t/load", "raw_path": b"/v1/tables/t/load",
            "query_string": b"chunk_size=4", "root_path": "", "headers": headers,
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
        }  # fmt: skip
        await app(scope, receive, send)
        return sent

    app = create_app(_settings(tmp_path))
    with TestClient(app) as client:
        assert client.portal is not None
        Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from now
        before = _status_kib("VmRSS")
        sent = client.portal.call(call, app)
        grown_mib = (_status_kib("VmHWM") - before) / 1024
        assert sent[0]["status"] == 422, sent
        assert b"helper_E1sR must repeat" in sent[1]["body"]
        assert grown_mib < 16, (
            f"receiving and refusing a {len(body) >> 20} MiB upload took {grown_mib:.0f} MiB"
        )
        assert len(during[0]) == 1, during  # open, nameless
        assert during[1] == [], during
        assert _upload_files(data_dir) == []
        assert client.get("/v1/tables/t").status_code == 404


def _paper(dim: int = 8, chunk: int = 4, memory: int = 64) -> dict[str, torch.Tensor]:
    random_numbers = np.concatenate(
        [np.array([PAPER_PRIME]), np.random.RandomState(1).randint(0, PAPER_PRIME, (10,))]
    )
    j = torch.arange(dim, dtype=torch.int64)
    return {
        "weight": torch.zeros(memory),
        "random_numbers": torch.from_numpy(random_numbers.astype(np.int64)),
        "helper_Eidx_base": j // chunk,
        "helper_Eidx_offset": j % chunk,
        "helper_E1sR": torch.full((dim,), int(random_numbers[3]), dtype=torch.int64),
    }


def _saved(state_dict: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda sd: sd.update(weight=torch.zeros(64, dtype=torch.float64)), "weight must be torch.float32"),
        (lambda sd: sd.update(weight=torch.zeros(8, 8)), "weight must be torch.float32 1-D"),
        (lambda sd: sd.update(random_numbers=torch.zeros(12, dtype=torch.int64)), "must hold 11 values"),
        (lambda sd: sd.update(helper_E1sR=torch.zeros(7, dtype=torch.int64)), "differ in length"),
        (lambda sd: sd.pop("helper_Eidx_base"), "missing ['helper_Eidx_base']"),
        (lambda sd: sd.update(extra=torch.nn.Linear(2, 2)), "not part of a state_dict"),
    ],
)
def test_what_the_paper_import_cannot_use_is_named_before_loading(change: Any, message: str) -> None:
    state_dict = _paper()
    check_paper_upload(_saved(state_dict), None)  # the unchanged one passes
    change(state_dict)
    with pytest.raises(InvalidInputError) as caught:
        check_paper_upload(_saved(state_dict), None)
    assert message in str(caught.value)


def test_a_storage_whose_zip_size_contradicts_data_pkl_is_refused() -> None:
    """The zip's central directory (what the size limit read) and data.pkl must agree: a member swapped
    for a shorter one is refused before torch.load reads it."""
    source = _saved(_paper())
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(source)) as src, zipfile.ZipFile(out, "w") as target:
        for member in src.infolist():
            data = src.read(member)
            target.writestr(member.filename, data[:8] if member.filename.endswith("data/0") else data)
    with pytest.raises(InvalidInputError, match="in the zip"):
        check_paper_upload(out.getvalue(), None)
