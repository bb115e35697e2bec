"""Table checkpoints: safetensors files (never pickle), written and read piece by piece.

A checkpoint holds ``weight`` and ``state.<name>`` tensors, with the configuration in the header's
string metadata:

=================  ==========================================================================
``format``         ``"robez-table"``
``format_version`` ``"1"`` (``Table.save``, snapshots) or ``"2"`` (a streamed download)
``config``         JSON of ``TableConfig`` (hash, seed, chunk_size Z, memory_size m, embedding_dim d,
                   val_offset, num_embeddings, init_scale, random_numbers or null)
``random_numbers`` JSON list of the 11 hash constants actually used ``[P, r0..r9]``
``optimizer``      JSON of ``OptimizerConfig``
``checksums``      version 1: JSON ``{tensor name: blake2b-128 hex of its bytes}``; safetensors has no
                   checksum of its own, and a flipped bit in an array must not be served
``checksummed``    version 2: JSON list of the tensor names whose digests the ``checksums`` tensor holds,
                   in its order (the tensors' file order)
=================  ==========================================================================

Version 2 (``StreamedCheckpoint``) is for a file sent while it is made: its header must go first, and a
digest is known only once its tensor's bytes went. So the digests are not in the header but in a last
tensor, ``checksums`` (uint8, 16 bytes of blake2b-128 per tensor of ``checksummed``): still a plain
safetensors file any reader opens. ``CheckpointFile`` reads both versions.

``CheckpointWriter`` writes one into an open file, ``PendingCheckpoint`` into a temp file moved into place,
``CheckpointFile`` reads one into tensors the caller allocated; ``Table.save`` / ``Table.load`` use them.
The tensors' memory is written and read as it is: no copy of a table is ever made.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import mmap
import os
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import optim
from .config import OptimizerConfig, TableConfig
from .errors import ConfigError, CorruptionError, NotFoundError
from .hashing import paper_random_numbers

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "READ_AHEAD_BYTES",
    "STATE_PREFIX",
    "CheckpointFile",
    "CheckpointWriter",
    "PendingCheckpoint",
    "StreamedCheckpoint",
    "fsync_dir",
    "read_ahead",
]

FORMAT_NAME = "robez-table"
FORMAT_VERSION = 1  # what Table.save and snapshots write
STREAMED_FORMAT_VERSION = 2  # a download written front to back: the digests in a last tensor
CHECKSUMS_TENSOR = "checksums"  # version 2: that tensor
DIGEST_BYTES = 16  # blake2b-128
STATE_PREFIX = "state."  # a state tensor ``name`` is stored as ``state.<name>``


def fsync_dir(directory: Path) -> None:
    """Make a rename or unlink inside ``directory`` durable (POSIX: fsync the folder itself)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- checkpoint files, streamed

# safetensors' dtype names of the tensors a checkpoint holds.
_DTYPES: dict[torch.dtype, str] = {torch.float32: "F32", torch.int64: "I64", torch.uint8: "U8"}
_DTYPE_OF_NAME = {name: dtype for dtype, name in _DTYPES.items()}
_PIECE_BYTES = 4 << 20  # read or written per system call: a few MiB, never a copy of a whole tensor
# How far ahead of the reader the kernel is asked to fetch (``read_ahead``): enough requests in flight
# for the disk to stream while this process checksums and copies; 3-4x faster cold reads than the
# kernel's own sequential read-ahead (docs/benchmarks/big-tables-*.md).
READ_AHEAD_BYTES = 64 << 20
_BLANK_CHECKSUM = "0" * 32  # blake2b-128 hex: the real checksums have this length, so the header's too


def _byte_view(tensor: Tensor) -> memoryview:
    """The tensor's own memory as bytes (no copy; contiguous tensors only)."""
    return tensor.detach().reshape(-1).view(torch.uint8).numpy().data


# One tensor of a checkpoint file, in file order: (name, safetensors dtype, shape, bytes).
_Entry = tuple[str, str, list[int], int]


def _file_order(tensors: Mapping[str, Tensor]) -> list[_Entry]:
    """The tensors in the order safetensors' ``save_file`` lays them out: by alignment (larger items
    first), then by name."""
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    return [
        (name, _DTYPES[t.dtype], list(t.shape), t.numel() * t.element_size())
        for name in order
        for t in [tensors[name]]
    ]


def _safetensors_header(entries: list[_Entry], metadata: Mapping[str, str]) -> bytes:
    """The header block: 8-byte little-endian length, then the JSON padded with spaces to 8 bytes."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


class CheckpointWriter:
    """A checkpoint written into an open file (``Table.begin_write``): the header with blank checksums and
    the tensors' bytes are in the file; ``finish`` completes it in place. The file is the caller's (a temp
    file it renames later, an unlinked one it streams): nothing here names, renames or closes it."""

    def __init__(self, entries: list[_Entry], metadata: dict[str, str], data_start: int) -> None:
        self._entries = entries
        self._metadata = metadata
        self._data_start = data_start  # the header's length: where the tensors' bytes begin

    @classmethod
    def write(cls, fd: int, tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> CheckpointWriter:
        """Write ``tensors`` (their own memory, piece by piece: no copy) and a header with blank checksums
        at the start of the empty file ``fd``; nothing hashed or fsynced. Raises ``OSError``."""
        writer = cls._write_header(fd, tensors, metadata)
        for name, (start, _nbytes) in writer.spans().items():
            pwrite_fully(fd, _byte_view(tensors[name]), start)
        return writer

    @classmethod
    def begin(cls, fd: int, tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> CheckpointWriter:
        """``write`` without the tensors' bytes: the header (checksums blank) at the start of the empty file
        ``fd``, and the file's space allocated to its whole size (``posix_fallocate``: a full file system
        is an ``OSError`` here, not a fault in whoever fills it through a mapping). Only the tensors'
        names, shapes and dtypes are read; the caller fills each one's bytes at ``spans()`` before
        ``finish``. Raises ``OSError``."""
        writer = cls._write_header(fd, tensors, metadata)
        size = writer._data_start + sum(nbytes for *_, nbytes in writer._entries)
        os.posix_fallocate(fd, 0, size)
        return writer

    @classmethod
    def _write_header(
        cls, fd: int, tensors: Mapping[str, Tensor], metadata: Mapping[str, str]
    ) -> CheckpointWriter:
        for name, tensor in tensors.items():
            if not tensor.is_contiguous() or tensor.device.type != "cpu" or tensor.dtype not in _DTYPES:
                raise ConfigError(f"tensor {name!r} cannot be saved: {tensor.dtype} on {tensor.device}")
        blank = {**metadata, "checksums": json.dumps(dict.fromkeys(sorted(tensors), _BLANK_CHECKSUM))}
        entries = _file_order(tensors)
        header = _safetensors_header(entries, blank)
        pwrite_fully(fd, memoryview(header), 0)
        return cls(entries, dict(metadata), len(header))

    def spans(self) -> dict[str, tuple[int, int]]:
        """Where each tensor's bytes lie in the file: name -> (byte offset, byte count), in file order."""
        spans: dict[str, tuple[int, int]] = {}
        position = self._data_start
        for name, _dtype, _shape, nbytes in self._entries:
            spans[name] = (position, nbytes)
            position += nbytes
        return spans

    def finish(
        self, fd: int, *, durable: bool = True, each_piece: Callable[[memoryview], None] | None = None
    ) -> None:
        """Checksum each tensor from the file ``fd`` (opened for reading and writing; read back piece by
        piece), write the final header over the blank one (same length) and, ``durable``, fsync the file.
        Needs no lock: it reads only the file. ``each_piece`` is called with every piece read (a test's
        pause, say). Raises ``OSError``."""
        checksums = {}
        buffer = memoryview(bytearray(_PIECE_BYTES))
        position = self._data_start
        for name, _, _, nbytes in self._entries:
            digest = hashlib.blake2b(digest_size=16)
            end = position + nbytes
            while position < end:
                got = os.preadv(fd, [buffer[: min(end - position, _PIECE_BYTES)]], position)
                if not got:
                    raise OSError(errno.EIO, f"checkpoint file {fd} is shorter than written")
                digest.update(buffer[:got])
                if each_piece is not None:
                    each_piece(buffer[:got])
                position += got
            checksums[name] = digest.hexdigest()
        metadata = {**self._metadata, "checksums": json.dumps(checksums, sort_keys=True)}
        header = _safetensors_header(self._entries, metadata)
        if len(header) != self._data_start:  # the checksums have the blanks' length
            raise OSError(errno.EIO, "checkpoint header changed size")  # pragma: no cover
        pwrite_fully(fd, memoryview(header), 0)
        if durable:
            os.fsync(fd)


class PendingCheckpoint:
    """A checkpoint written by ``Table.begin_save``: the tensors are in a temp file beside ``path``, the
    header's checksums still blank. ``finish`` completes it, ``discard`` removes it."""

    def __init__(self, path: Path, tmp: Path, writer: CheckpointWriter):
        self.path = path
        self.tmp = tmp
        self._writer = writer
        self._done = False

    @classmethod
    def write(
        cls, path: Path, tensors: Mapping[str, Tensor], metadata: Mapping[str, str]
    ) -> PendingCheckpoint:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                writer = CheckpointWriter.write(fd, tensors, metadata)
            finally:
                os.close(fd)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return cls(path, tmp, writer)

    def finish(self, durable: bool = True) -> Path:
        """Checksum each tensor from the file (read back piece by piece), write the final header over the
        blank one, and move the file to ``path`` (``durable``: fsync it and its folder, as ``save`` does).
        Needs no lock: it reads only the file. Raises ``OSError`` (the temp file removed)."""
        try:
            fd = os.open(self.tmp, os.O_RDWR)
            try:
                self._writer.finish(fd, durable=durable)
            finally:
                os.close(fd)
            os.replace(self.tmp, self.path)
        except BaseException:
            self.discard()
            raise
        self._done = True
        if durable:
            fsync_dir(self.path.parent)
        return self.path

    def discard(self) -> None:
        """Remove the temp file (a checkpoint not wanted after all, or one that failed)."""
        if not self._done:
            self.tmp.unlink(missing_ok=True)


class StreamedCheckpoint:
    """A version-2 checkpoint sent front to back, never whole in a file (a download): ``header`` first,
    then each tensor's bytes in ``order`` (file order; each piece passed to ``update`` as it goes), then
    ``trailer()``: the digests, the bytes of the last tensor (``checksums``). ``size``: the whole file's
    bytes, known before the first is sent. Only the tensors' names, shapes and dtypes are read here."""

    def __init__(self, tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> None:
        entries = _file_order(tensors)
        self.order = [name for name, *_ in entries]
        self.nbytes = {name: nbytes for name, _dtype, _shape, nbytes in entries}
        trailer = DIGEST_BYTES * len(entries)
        meta = {
            **{key: value for key, value in metadata.items() if key != "checksums"},
            "format_version": str(STREAMED_FORMAT_VERSION),
            "checksummed": json.dumps(self.order),
        }
        self.header = _safetensors_header([*entries, (CHECKSUMS_TENSOR, "U8", [trailer], trailer)], meta)
        self.size = len(self.header) + sum(self.nbytes.values()) + trailer
        self._digests = {name: hashlib.blake2b(digest_size=DIGEST_BYTES) for name in self.order}
        self._left = dict(self.nbytes)

    def update(self, name: str, piece: bytes | memoryview) -> None:
        """The next bytes of tensor ``name`` as sent."""
        self._digests[name].update(piece)
        self._left[name] -= memoryview(piece).nbytes

    def trailer(self) -> bytes:
        """The ``checksums`` tensor's bytes: each tensor's blake2b-128, in ``order``; every byte of every
        tensor must have been passed to ``update`` (``ValueError`` otherwise)."""
        short = {name: left for name, left in self._left.items() if left}
        if short:
            raise ValueError(f"tensors not wholly sent (bytes missing): {short}")
        return b"".join(self._digests[name].digest() for name in self.order)


def pwrite_fully(fd: int, view: memoryview, position: int) -> int:
    """Write ``view`` at ``position`` in pieces; returns the position after it."""
    for start in range(0, view.nbytes, _PIECE_BYTES):
        piece = view[start : start + _PIECE_BYTES]
        while piece.nbytes:
            written = os.pwrite(fd, piece, position)
            piece = piece[written:]
            position += written
    return position


class CheckpointFile:
    """A robez checkpoint file opened for a streamed read: its header parsed and checked (format,
    version, config, constants, tensor names, shapes and dtypes), no tensor read yet. ``read_into``
    fills tensors the caller allocated (in shared memory, say) and checks the checksums on the way, so a
    table is loaded with no second copy of it.

    Raises ``NotFoundError`` when ``path`` does not exist and ``CorruptionError`` when it is not a valid
    robez checkpoint (see ``Table.load``)."""

    def __init__(
        self,
        path: Path,
        config: TableConfig,
        optimizer: OptimizerConfig,
        layout: dict[str, tuple[tuple[int, ...], torch.dtype]],
        spans: dict[str, tuple[int, int]],
        checksums: dict[str, str],
        header: bytes = b"",
        format_version: int = FORMAT_VERSION,
    ) -> None:
        self.path = path
        self.config = config
        self.optimizer = optimizer
        self.layout = layout  # tensor name -> (shape, dtype), as Table.tensors() names them
        self._spans = dict(
            sorted(spans.items(), key=lambda item: item[1])
        )  # name -> (start, end), file order
        self._checksums = checksums
        self.header = header  # the file's first bytes: length and JSON header, up to the tensors
        self.format_version = format_version  # 2: the digests are the last tensor's bytes (checksums)

    @property
    def nbytes(self) -> int:
        return sum(end - start for start, end in self._spans.values())

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> CheckpointFile:
        path = Path(path)
        if not path.is_file():
            raise NotFoundError(f"checkpoint {str(path)!r} does not exist")
        where = str(path)

        def unreadable(reason: str) -> CorruptionError:
            return CorruptionError(f"checkpoint {where!r} is not a readable safetensors file: {reason}")

        try:
            with open(path, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                head = handle.read(8)
                if len(head) != 8:
                    raise unreadable("no header")
                length = int.from_bytes(head, "little")
                if length > min(size - 8, 100 << 20):
                    raise unreadable(f"header of {length} bytes in a file of {size}")
                text = handle.read(length)
                header = json.loads(text)
        except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise unreadable(str(exc)) from exc
        if not isinstance(header, dict):
            raise unreadable("the header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        spans: dict[str, tuple[int, int]] = {}
        try:
            for name, entry in header.items():
                dtype = _DTYPE_OF_NAME.get(entry["dtype"])
                shape = tuple(int(n) for n in entry["shape"])
                start, end = (int(n) for n in entry["data_offsets"])
                if dtype is None:
                    raise unreadable(f"tensor {name!r} has dtype {entry['dtype']!r}")
                if min(shape, default=0) < 0 or end - start != math.prod(shape) * _itemsize(dtype):
                    raise unreadable(f"tensor {name!r}: its offsets do not match its shape")
                specs[name] = (shape, dtype)
                spans[name] = (8 + length + start, 8 + length + end)
        except (KeyError, TypeError, ValueError) as exc:
            raise unreadable(f"bad tensor entry: {exc}") from exc
        # The data must be exactly the tensors, back to back: no gap, no overlap, nothing after.
        position = 8 + length
        for start, end in sorted(spans.values()):
            if start != position:
                raise unreadable("tensor data overlaps or leaves gaps")
            position = end
        if position != size:
            raise unreadable(f"the tensors end at byte {position}, the file at {size}")
        if not isinstance(metadata, dict):
            raise unreadable("__metadata__ is not an object")
        config, optimizer, layout, checksums = _checkpoint_layout(where, metadata, specs)
        if isinstance(checksums, dict):
            return cls(path, config, optimizer, layout, spans, checksums, head + text)
        start, end = spans[CHECKSUMS_TENSOR]  # version 2: the digests are that tensor's bytes
        try:
            with open(path, "rb") as handle:
                digests = os.pread(handle.fileno(), end - start, start)
        except OSError as exc:
            raise unreadable(str(exc)) from exc
        if len(digests) != end - start:
            raise unreadable("the checksums tensor is cut short")
        by_name = {
            name: digests[index * DIGEST_BYTES : (index + 1) * DIGEST_BYTES].hex()
            for index, name in enumerate(checksums)
        }
        return cls(path, config, optimizer, layout, spans, by_name, head + text, STREAMED_FORMAT_VERSION)

    def read_into(
        self,
        tensors: Mapping[str, Tensor],
        *,
        verify: bool = True,
        each_piece: Callable[[memoryview], None] | None = None,
    ) -> None:
        """Fill ``tensors`` (one per name of ``layout``, of its shape and dtype, contiguous: the caller's
        memory) from the file piece by piece in file order, checking each checksum; ``CorruptionError``
        on a mismatch (the tensors then hold whatever was read), ``OSError`` if the file cannot be read.

        ``verify=False`` skips the checksums, for a caller that checks the file's bytes its own way:
        ``each_piece`` sees every piece read, so ``header`` then the pieces are the whole file (a
        version-2 file's ``checksums`` tensor too, read for it alone)."""
        where = str(self.path)
        with open(self.path, "rb", buffering=0) as handle:
            ahead = read_ahead(handle.fileno(), 0, 0)
            for name, (start, end) in self._spans.items():
                if name not in self.layout:  # version 2's digests: already read by ``open``
                    if each_piece is not None:
                        each_piece(memoryview(os.pread(handle.fileno(), end - start, start)))
                    continue
                view = _byte_view(tensors[name])
                if view.nbytes != end - start:
                    raise ConfigError(
                        f"tensor {name!r} has {view.nbytes} bytes, the checkpoint {end - start}"
                    )
                digest = hashlib.blake2b(digest_size=16) if verify else None
                handle.seek(start)
                done = 0
                while done < view.nbytes:
                    piece = view[done : done + _PIECE_BYTES]
                    got = handle.readinto(piece)
                    if not got:
                        raise CorruptionError(f"checkpoint {where!r} ended inside tensor {name!r}")
                    ahead = read_ahead(handle.fileno(), start + done + got, ahead)
                    if digest is not None:
                        digest.update(piece[:got])
                    if each_piece is not None:
                        each_piece(piece[:got])
                    done += got
                if digest is not None and digest.hexdigest() != self._checksums[name]:
                    raise CorruptionError(f"checkpoint {where!r}: checksum mismatch in tensor {name!r}")

    def verify(self) -> None:
        """Read the whole file once, piece by piece into one small buffer, and check every tensor's
        checksum: ``CorruptionError`` on a mismatch, ``OSError`` if it cannot be read. For a caller about
        to overwrite memory it cannot get back (a restore in place) with what ``read_into`` will read."""
        where = str(self.path)
        buffer = memoryview(bytearray(_PIECE_BYTES))
        with open(self.path, "rb", buffering=0) as handle:
            ahead = read_ahead(handle.fileno(), 0, 0)
            for name, (start, end) in self._spans.items():
                if name not in self.layout:  # version 2's digests: what is checked against
                    continue
                digest = hashlib.blake2b(digest_size=16)
                position = start
                while position < end:
                    got = os.preadv(handle.fileno(), [buffer[: min(end - position, _PIECE_BYTES)]], position)
                    if not got:
                        raise CorruptionError(f"checkpoint {where!r} ended inside tensor {name!r}")
                    digest.update(buffer[:got])
                    position += got
                    ahead = read_ahead(handle.fileno(), position, ahead)
                if digest.hexdigest() != self._checksums[name]:
                    raise CorruptionError(f"checkpoint {where!r}: checksum mismatch in tensor {name!r}")

    def mapped(self) -> dict[str, Tensor]:
        """The file's tensors (``layout``'s names) over a private copy-on-write mapping of it: memory of
        the page cache, none of this process's own unless written (never: the caller only reads them,
        e.g. to write them elsewhere). The mapping lives as long as the tensors do."""
        with open(self.path, "rb") as handle:
            mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        tensors = {}
        for name, (start, end) in self._spans.items():
            if name not in self.layout:  # version 2's digests
                continue
            shape, dtype = self.layout[name]
            count = (end - start) // _itemsize(dtype)
            tensors[name] = torch.frombuffer(mapping, dtype=dtype, count=count, offset=start).view(shape)
        return tensors


def read_ahead(fd: int, position: int, asked: int) -> int:
    """Ask the kernel to fetch the file ``fd`` up to ``READ_AHEAD_BYTES`` past ``position`` (a reader's
    place), from ``asked`` (what was already asked for) on, in the background; returns the new end
    asked for. Pass the result back in at the next position. A hint: where the kernel cannot
    (``posix_fadvise`` missing), nothing happens."""
    target = position + READ_AHEAD_BYTES
    if target - asked < READ_AHEAD_BYTES // 4:  # ask in steps of a quarter window, not every piece
        return asked
    start = max(asked, position)
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, start, target - start, os.POSIX_FADV_WILLNEED)
        except OSError:
            return target
    return target


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _checkpoint_layout(
    where: str, metadata: Mapping[str, str], specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
) -> tuple[
    TableConfig, OptimizerConfig, dict[str, tuple[tuple[int, ...], torch.dtype]], dict[str, str] | list[str]
]:
    """Check a checkpoint's metadata and tensors (``specs``: name -> (shape, dtype)) against each other:
    (config, optimizer, the layout the table needs, the checksums: version 1's by name, or version 2's
    order of the digests in its ``checksums`` tensor); ``CorruptionError`` if they differ."""

    def bad(reason: str) -> CorruptionError:
        return CorruptionError(f"checkpoint {where!r}: {reason}")

    if metadata.get("format") != FORMAT_NAME:
        raise bad(f"not a robez table (format={metadata.get('format')!r})")
    version = metadata.get("format_version")
    if version not in (str(FORMAT_VERSION), str(STREAMED_FORMAT_VERSION)):
        raise bad(
            f"unsupported format_version {version!r} (expected {FORMAT_VERSION} or {STREAMED_FORMAT_VERSION})"
        )
    streamed = version == str(STREAMED_FORMAT_VERSION)
    try:
        config = TableConfig.from_dict(json.loads(metadata["config"]))
        optimizer = OptimizerConfig.from_dict(json.loads(metadata["optimizer"]))
        random_numbers = json.loads(metadata["random_numbers"])
        checksums = json.loads(metadata["checksummed" if streamed else "checksums"])
    except (KeyError, TypeError, ValueError) as exc:  # ConfigError is a ValueError
        raise bad(f"invalid metadata: {exc}") from exc
    expected_rn = (
        paper_random_numbers(config.seed).tolist()
        if config.random_numbers is None
        else list(config.random_numbers)
    )
    if random_numbers != expected_rn:
        raise bad("random_numbers disagree with the config's seed / constants")
    layout: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
        "weight": ((config.memory_size,), torch.float32)
    }
    layout.update({STATE_PREFIX + k: v for k, v in optim.state_layout(optimizer, config.memory_size).items()})
    tensors = dict(specs)
    digests = tensors.pop(CHECKSUMS_TENSOR, None) if streamed else None
    if set(tensors) != set(layout):
        raise bad(f"expected tensors {sorted(layout)}, found {sorted(specs)}")
    if streamed:
        if digests != ((DIGEST_BYTES * len(layout),), torch.uint8):
            size = DIGEST_BYTES * len(layout)
            raise bad(f"tensor {CHECKSUMS_TENSOR!r} is {digests}, expected uint8 ({size},)")
        named = isinstance(checksums, list) and len(checksums) == len(set(map(str, checksums)))
        if not named or set(checksums) != set(layout):
            raise bad(f"checksummed names {checksums!r}, expected each of {sorted(layout)} once")
    elif not isinstance(checksums, dict) or set(checksums) != set(layout):
        raise bad(f"expected tensors {sorted(layout)} and their checksums, found {checksums!r:.300}")
    for name, (shape, dtype) in layout.items():
        if tensors[name] != (shape, dtype):
            found_shape, found_dtype = tensors[name]
            raise bad(f"tensor {name!r} is {found_dtype} {found_shape}, expected {dtype} {shape}")
    if streamed:
        return config, optimizer, layout, [str(name) for name in checksums]
    return config, optimizer, layout, {name: str(value) for name, value in checksums.items()}
