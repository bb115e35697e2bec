"""A snapshot file's bytes, written from and read into a table's own (shared) memory.

The file is the format ``Table.save`` writes (safetensors: an 8-byte header length, a JSON header with the
checkpoint metadata and each tensor's offsets, then the tensors' bytes) so ``Table.load`` and every
checkpoint reader still read it. What differs is how it is written and read:

- ``write_image`` copies the arrays straight into the file (the page cache) with no private copy and no
  hashing: the only part of a snapshot that must see the table unchanged, so the part done under the
  table's update lock. The header's per-tensor checksums are left as zeros of the right length;
  ``finish_image``, run without the lock, reads the file back, hashes it and writes the real header (same
  length), then fsyncs. Until then the file is in no ``meta.json``, so a crash leaves only a stray file.
- ``read_image`` reads a committed file into tensors the caller allocated (the table's shared arrays),
  checking the crc32 that ``meta.json`` records and every tensor's checksum, with no private copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from robez_core.config import OptimizerConfig, TableConfig
from robez_core.errors import CorruptionError
from robez_core.table import Table

from .. import faults
from .records import _crc

_LENGTH = struct.Struct("<Q")
_DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.int64: "I64", torch.int32: "I32"}
_CHECKSUM_PLACEHOLDER = "0" * 32  # blake2b digest_size=16, hex: the real ones have this length
# Bytes copied per write or read call: large enough for disk speed, small enough that a view of the
# shared array costs nothing to keep.
PIECE_BYTES = 1 << 26


def _tensor_checksum() -> Any:
    return hashlib.blake2b(digest_size=16)  # what robez_core.table's checksums are


@dataclass(frozen=True)
class ImageLayout:
    """What ``write_image`` wrote: the header's length, its tensor entries, and where each tensor's bytes
    lie after the header, as (name, start, end) in file order."""

    header_length: int
    entries: dict[str, Any]
    spans: list[tuple[str, int, int]]

    @property
    def data_start(self) -> int:
        return _LENGTH.size + self.header_length


def _layout(tensors: Mapping[str, Tensor]) -> tuple[dict[str, Any], list[tuple[str, int, int]]]:
    """The safetensors header entries of ``tensors`` (stored in name order) and their spans."""
    entries: dict[str, Any] = {}
    spans: list[tuple[str, int, int]] = []
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name]
        nbytes = tensor.numel() * tensor.element_size()
        entries[name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        spans.append((name, offset, offset + nbytes))
        offset += nbytes
    return entries, spans


def _header(metadata: Mapping[str, str], entries: Mapping[str, Any], length: int | None = None) -> bytes:
    """The safetensors header: padded with spaces to a multiple of 8 bytes (as safetensors writes it),
    or to exactly ``length`` (the placeholder header it replaces; refused if longer, rather than shifting
    the data)."""
    text = json.dumps({"__metadata__": dict(metadata), **entries}, separators=(",", ":")).encode()
    if length is None:
        return text + b" " * (-(len(text) + _LENGTH.size) % 8)
    if len(text) > length:
        raise CorruptionError("snapshot header grew while its checksums were filled in")
    return text + b" " * (length - len(text))


def _metadata(table: Table, checksums: Mapping[str, str]) -> dict[str, str]:
    metadata = table.metadata()
    metadata["checksums"] = json.dumps(dict(checksums), sort_keys=True)
    return metadata


def _bytes_view(tensor: Tensor) -> memoryview:
    """The tensor's own bytes (no copy), as a flat memoryview."""
    return tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().data.cast("B")


def write_image(fd: int, table: Table) -> ImageLayout:
    """Write ``table`` to the empty file ``fd``: the header with placeholder checksums, then each tensor's
    bytes copied from its memory in pieces. The caller keeps the table unchanged meanwhile (it holds the
    update lock); nothing is hashed or fsynced here (``finish_image`` does both)."""
    tensors = table.tensors()
    entries, spans = _layout(tensors)
    header = _header(_metadata(table, dict.fromkeys(tensors, _CHECKSUM_PLACEHOLDER)), entries)
    _pwrite_all(fd, _LENGTH.pack(len(header)) + header, 0)
    position = _LENGTH.size + len(header)
    for name, _start, _end in spans:
        view = _bytes_view(tensors[name])
        for piece_start in range(0, len(view), PIECE_BYTES):
            piece = view[piece_start : piece_start + PIECE_BYTES]
            _pwrite_all(fd, piece, position)
            position += len(piece)
    return ImageLayout(len(header), entries, spans)


def finish_image(
    fd: int, table_metadata: Mapping[str, str], layout: ImageLayout, *, durable: bool = True
) -> tuple[int, int]:
    """Hash each tensor of the image ``write_image`` wrote (read back from the file), write the header
    with the real checksums, fsync; returns (crc32, size) of the whole file, for ``meta.json``
    (``durable=False``, a temporary file: neither the fsync nor the crc32, which is then 0).

    ``table_metadata``: ``Table.metadata()`` of the table written (config, optimizer; no checksums)."""
    checksums: dict[str, str] = {}
    start = layout.data_start
    for name, begin, end in layout.spans:
        digest = _tensor_checksum()
        if end > begin:  # robez_core.table hashes nothing for an empty tensor
            for piece in _read_pieces(fd, start + begin, start + end):
                digest.update(piece)
                faults.slow_down()
        checksums[name] = digest.hexdigest()
    metadata = dict(table_metadata)
    metadata["checksums"] = json.dumps(checksums, sort_keys=True)
    header = _header(metadata, layout.entries, layout.header_length)
    _pwrite_all(fd, _LENGTH.pack(len(header)) + header, 0)
    if not durable:
        return 0, os.fstat(fd).st_size
    os.fsync(fd)
    crc = 0
    size = 0
    for piece in _read_pieces(fd, 0, os.fstat(fd).st_size):
        crc = _crc(piece, crc)
        size += len(piece)
    return crc, size


def read_header(path: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """(metadata, tensor entries) of a safetensors file, reading only its header."""
    with open(path, "rb") as handle:
        head = handle.read(_LENGTH.size)
        if len(head) != _LENGTH.size:
            raise CorruptionError(f"snapshot {path} is too short for a header")
        (length,) = _LENGTH.unpack(head)
        if length > 100 * 1024 * 1024:
            raise CorruptionError(f"snapshot {path} has an implausible header length {length}")
        try:
            entries = json.loads(handle.read(length))
        except ValueError as error:
            raise CorruptionError(f"snapshot {path} has an unreadable header: {error}") from error
    if not isinstance(entries, dict):
        raise CorruptionError(f"snapshot {path} has an unreadable header")
    metadata = entries.pop("__metadata__", None) or {}
    return metadata, entries


def stored_spec(path: Path) -> tuple[TableConfig, OptimizerConfig]:
    """The config and optimizer of the table a snapshot holds, from its header alone."""
    metadata, _entries = read_header(path)
    try:
        return (
            TableConfig.from_dict(json.loads(metadata["config"])),
            OptimizerConfig.from_dict(json.loads(metadata["optimizer"])),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise CorruptionError(f"snapshot {path}: invalid metadata ({error})") from error


def read_image(path: Path, tensors: Mapping[str, Tensor]) -> tuple[dict[str, str], int, int]:
    """Read the snapshot at ``path`` into ``tensors`` (allocated by the caller, the layout of the table the
    header names), piece by piece straight into their memory; returns (metadata, crc32, size) of the file.

    Raises ``CorruptionError`` when the header's tensors are not exactly ``tensors`` (names, dtypes,
    shapes) or lie elsewhere than one after another."""
    metadata, entries = read_header(path)
    if set(entries) != set(tensors):
        raise CorruptionError(f"snapshot {path}: tensors {sorted(entries)}, expected {sorted(tensors)}")
    with open(path, "rb") as handle:
        fd = handle.fileno()
        (length,) = _LENGTH.unpack(os.pread(fd, _LENGTH.size, 0))
        data_start = _LENGTH.size + length
        crc = _crc(os.pread(fd, data_start, 0))
        position = 0
        for name, entry in sorted(entries.items(), key=lambda item: item[1]["data_offsets"][0]):
            tensor = tensors[name]
            begin, end = entry["data_offsets"]
            expected = tensor.numel() * tensor.element_size()
            if (
                begin != position
                or end - begin != expected
                or entry["dtype"] != _DTYPES.get(tensor.dtype)
                or list(entry["shape"]) != list(tensor.shape)
            ):
                raise CorruptionError(f"snapshot {path}: tensor {name!r} is not laid out as the table's")
            view = _bytes_view(tensor)
            for piece_start in range(0, expected, PIECE_BYTES):
                piece = view[piece_start : piece_start + PIECE_BYTES]
                got = os.preadv(fd, [piece], data_start + begin + piece_start)
                if got != len(piece):
                    raise CorruptionError(f"snapshot {path} is cut short in tensor {name!r}")
                crc = _crc(piece, crc)
            position = end
        size = os.fstat(fd).st_size
        if size != data_start + position:
            raise CorruptionError(f"snapshot {path}: {size - data_start - position} bytes after the tensors")
    return metadata, crc, size


def check_checksums(path: Path, metadata: Mapping[str, str], tensors: Mapping[str, Tensor]) -> None:
    """The per-tensor checksums of the header against the tensors ``read_image`` filled."""
    try:
        checksums = json.loads(metadata["checksums"])
    except (KeyError, TypeError, ValueError) as error:
        raise CorruptionError(f"snapshot {path}: invalid checksums ({error})") from error
    for name, tensor in tensors.items():
        digest = _tensor_checksum()
        if tensor.numel():
            view = _bytes_view(tensor)
            for piece_start in range(0, len(view), PIECE_BYTES):
                digest.update(view[piece_start : piece_start + PIECE_BYTES])
        if checksums.get(name) != digest.hexdigest():
            raise CorruptionError(f"snapshot {path}: checksum mismatch in tensor {name!r}")


def _read_pieces(fd: int, begin: int, end: int) -> Any:
    buffer = bytearray(min(PIECE_BYTES, max(0, end - begin)))
    view = memoryview(buffer)
    position = begin
    while position < end:
        want = min(len(buffer), end - position)
        got = os.preadv(fd, [view[:want]], position)
        if got <= 0:
            raise CorruptionError(f"file cut short at byte {position} while reading it back")
        yield view[:got]
        position += got


def _pwrite_all(fd: int, data: Any, position: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, position)
        view = view[written:]
        position += written
