"""Checkpoint format version 2 (``StreamedCheckpoint``: the digests in a last tensor, so the header can
be sent first): any safetensors reader opens it, ``Table.load`` reads it and version 1 alike, and a
damaged one is refused."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from robez_core.checkpoint import CHECKSUMS_TENSOR, CheckpointFile, StreamedCheckpoint
from robez_core.config import OptimizerConfig, TableConfig
from robez_core.errors import CorruptionError
from robez_core.table import Table

CONFIG = TableConfig(num_embeddings=500, embedding_dim=8, memory_size=3000, chunk_size=4)


def _trained() -> Table:
    table = Table(CONFIG, OptimizerConfig(name="adam", lr=0.01))
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        table.apply_gradients(torch.randint(0, 500, (32,), generator=generator), torch.randn(32, 8))
    return table


def _streamed(table: Table, path: Path) -> bytes:
    """``table`` written as a download writes it: header, tensors in order (each fed to ``update``),
    then the digests."""
    checkpoint = StreamedCheckpoint(table.tensors(), table.metadata())
    parts = [checkpoint.header]
    for name in checkpoint.order:
        data = table.tensors()[name].detach().numpy().tobytes()
        checkpoint.update(name, data)
        parts.append(data)
    parts.append(checkpoint.trailer())
    path.write_bytes(b"".join(parts))
    assert path.stat().st_size == checkpoint.size  # known before the first byte
    return path.read_bytes()


def _same(a: Table, b: Table) -> bool:
    return a.tensors().keys() == b.tensors().keys() and all(
        torch.equal(a.tensors()[k], b.tensors()[k]) for k in a.tensors()
    )


def test_a_streamed_checkpoint_is_safetensors_and_loads_bitwise(tmp_path: Path) -> None:
    table = _trained()
    path = tmp_path / "v2.safetensors"
    _streamed(table, path)
    with safe_open(str(path), framework="pt") as reader:  # any safetensors reader opens it
        assert reader.metadata()["format_version"] == "2"
        assert set(reader.keys()) == {*table.tensors(), CHECKSUMS_TENSOR}
        for name, tensor in table.tensors().items():
            assert torch.equal(reader.get_tensor(name), tensor)
    assert CheckpointFile.open(path).format_version == 2
    assert _same(Table.load(path), table)
    # Version 1 (Table.save, snapshots) still loads, through the same reader.
    table.save(tmp_path / "v1.safetensors")
    assert CheckpointFile.open(tmp_path / "v1.safetensors").format_version == 1
    assert _same(Table.load(tmp_path / "v1.safetensors"), table)


def _header(data: bytes) -> tuple[int, dict[str, Any]]:
    length = int.from_bytes(data[:8], "little")
    return length, json.loads(data[8 : 8 + length])


def _with_header(data: bytes, edit: Callable[[dict[str, Any]], object]) -> bytes:
    length, header = _header(data)
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (length - len(text))
    assert len(text) == length
    return data[:8] + text + data[8 + length :]


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :]


def _tensor_byte(data: bytes, name: str) -> int:
    length, header = _header(data)
    return 8 + length + header[name]["data_offsets"][0] + 5


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: _flip(d, _tensor_byte(d, "weight")), "checksum mismatch in tensor 'weight'"),
        (lambda d: _flip(d, _tensor_byte(d, "state.exp_avg_sq")), "checksum mismatch"),
        (lambda d: _flip(d, len(d) - 1), "checksum mismatch"),  # the digests themselves
        (lambda d: d[:-1], "not a readable safetensors"),
        (
            lambda d: _with_header(d, lambda h: h["__metadata__"].__setitem__("checksummed", '["weight"]')),
            "checksummed names",
        ),
        (lambda d: _with_header(d, lambda h: h["__metadata__"].pop("checksummed")), "invalid metadata"),
        (
            lambda d: _with_header(d, lambda h: h["__metadata__"].__setitem__("format_version", "3")),
            "format_version",
        ),
    ],
)
def test_a_damaged_streamed_checkpoint_is_refused(
    tmp_path: Path, damage: Callable[[bytes], bytes], message: str
) -> None:
    path = tmp_path / "v2.safetensors"
    path.write_bytes(damage(_streamed(_trained(), path)))
    with pytest.raises(CorruptionError, match=message):
        Table.load(path)


def test_a_file_read_unverified_is_seen_whole_by_its_reader(tmp_path: Path) -> None:
    """``read_into(verify=False, each_piece=...)``: the header and the pieces are the whole file, the
    digests of version 2 too (a caller that checks the file's bytes its own way sees every one)."""
    path = tmp_path / "v2.safetensors"
    data = _streamed(_trained(), path)
    checkpoint = CheckpointFile.open(path)
    pieces = [checkpoint.header]
    tensors = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in checkpoint.layout.items()}
    checkpoint.read_into(tensors, verify=False, each_piece=lambda piece: pieces.append(bytes(piece)))
    assert b"".join(pieces) == data


def test_a_streamed_checkpoint_is_verified_and_mapped_as_version_1_is(tmp_path: Path) -> None:
    """What a restore in place asks of a file (``service/store/inplace.py``): ``verify`` checks every
    tensor against the version-2 digests and ``mapped`` gives the table's tensors, not the digests."""
    table = _trained()
    path = tmp_path / "v2.safetensors"
    data = _streamed(table, path)
    checkpoint = CheckpointFile.open(path)
    checkpoint.verify()
    mapped = checkpoint.mapped()
    assert mapped.keys() == table.tensors().keys()
    assert all(torch.equal(mapped[name], tensor) for name, tensor in table.tensors().items())
    flipped = bytearray(data)
    flipped[len(checkpoint.header) + 5] ^= 1  # a bit of the first tensor
    path.write_bytes(bytes(flipped))
    with pytest.raises(CorruptionError, match="checksum mismatch"):
        CheckpointFile.open(path).verify()
