"""Checks of an uploaded checkpoint made before anything in it is loaded (``POST /v1/tables/{name}/load``).

A torch.save file is a zip whose ``data.pkl`` names each tensor's storage (a ``data/<key>`` member), dtype,
shape and strides; ``torch.load`` allocates every storage at its declared size before a caller can look at
the keys, so a 1 MB deflated zip declaring 1 GiB of tensors grew the worker by 1 GiB before it was refused
as "not a ROBE-Z state_dict". ``check_paper_upload`` reads ``data.pkl`` with an unpickler that knows only
the few names a state_dict uses and records each storage instead of loading it, then checks the keys,
dtypes and shapes the paper import needs, and that each storage is in the file at the size ``data.pkl``
gives it (the size the limits were checked on), stored uncompressed as torch.save writes it. Only a file
that passes reaches ``torch.load``: what it then allocates is what the table will hold.

The upload itself is never held in memory: ``RequestBodyMiddleware`` writes the body of a route that
``spools`` to an anonymous temporary file (under the data directory, or the system's temp directory
without one; gone when closed, however the request ends, a killed worker included), and the route reads it
from ``spooled_path``: the checks above read the zip's central directory and ``data.pkl`` from it,
``torch.load`` memory-maps it, safetensors reads it from the file.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch
from starlette.types import Scope

from robez_core.errors import InvalidInputError

from .wal.checkpoints import CheckpointSource, checkpoint_format, open_zip, source_head, source_size

# Where the middleware leaves a spooled body in the request's ASGI scope: the open temporary file.
SPOOLED_BODY_KEY = "robez.spooled_body"


def spools(scope: Scope) -> bool:
    """Whether the request's body goes to a temporary file rather than memory: checkpoint uploads
    (``POST /v1/tables/{name}/load``), which may be as large as ``max_body_bytes``."""
    path: str = scope["path"]
    return scope["method"] == "POST" and path.startswith("/v1/tables/") and path.endswith("/load")


def spooled_path(scope: Scope) -> str:
    """A path to the request's spooled body (``spools``), valid in this process until the request ends:
    the file is anonymous (``O_TMPFILE``, or unlinked at once), reachable through its descriptor."""
    handle: BinaryIO = scope[SPOOLED_BODY_KEY]
    return f"/proc/self/fd/{handle.fileno()}"


# data.pkl of a state_dict is ~100 bytes per tensor; a larger one is not a module's state_dict.
MAX_PICKLE_BYTES = 16 << 20
# The paper module's keys (robez_core.table's _PAPER_KEYS): dtype, and the length when fixed.
_PAPER_TENSORS: dict[str, tuple[torch.dtype, int | None]] = {
    "weight": (torch.float32, None),
    "random_numbers": (torch.int64, 11),
    "helper_Eidx_base": (torch.int64, None),
    "helper_Eidx_offset": (torch.int64, None),
    "helper_E1sR": (torch.int64, None),
}
_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}  # fmt: skip


@dataclass(frozen=True)
class StorageRef:
    """A storage as ``data.pkl`` names it: the member ``data/<key>`` holding ``numel`` values of ``dtype``."""

    key: str
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True)
class TensorRef:
    """A tensor as ``data.pkl`` declares it, nothing allocated: a view of ``storage``."""

    storage: StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype


class _StorageType:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


def _rebuild_tensor(storage: StorageRef, offset: int, shape: Any, stride: Any, *_: Any) -> TensorRef:
    if not isinstance(storage, StorageRef):
        raise InvalidInputError("a tensor in the file is not backed by a storage")
    return TensorRef(storage, int(offset), tuple(int(n) for n in shape), tuple(int(n) for n in stride))


class _RecordingUnpickler(pickle.Unpickler):
    """Unpickles a state_dict's ``data.pkl`` into ``TensorRef`` s: tensors and storages are recorded,
    every other global is refused (stricter than ``weights_only``; nothing is imported or called)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor"):
            return _rebuild_tensor
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        raise InvalidInputError(f"the file holds {module}.{name}, which is not part of a state_dict")

    def persistent_load(self, pid: Any) -> StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise InvalidInputError("the file names a storage in a form torch.save does not write")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType) or not isinstance(numel, int) or numel < 0:
            raise InvalidInputError("the file names a storage of an unknown type")
        return StorageRef(str(key), storage_type.dtype, numel)


def declared_tensors(data: CheckpointSource) -> tuple[dict[str, TensorRef], dict[str, zipfile.ZipInfo]]:
    """The tensors a torch.save (zip) file (its bytes or its path) declares, by key, and its storage
    members by storage key; nothing is loaded but ``data.pkl``. Raises ``InvalidInputError`` for a file
    torch.save did not write."""
    with open_zip(data) as archive:
        members = archive.infolist()
        pickles = [member for member in members if member.filename.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise InvalidInputError("not a torch.save (zip) file: it must hold exactly one data.pkl")
        root = pickles[0].filename[: -len("data.pkl")]
        if pickles[0].file_size > MAX_PICKLE_BYTES:
            raise InvalidInputError(
                f"data.pkl declares {pickles[0].file_size} bytes; a state_dict's is under {MAX_PICKLE_BYTES}"
            )
        try:
            with archive.open(pickles[0]) as handle:
                loaded = _RecordingUnpickler(io.BytesIO(handle.read(MAX_PICKLE_BYTES + 1))).load()
        except InvalidInputError:
            raise
        except Exception as error:  # a damaged pickle fails in many ways; none may answer 500
            raise InvalidInputError(f"not a state_dict torch.load can read: {error}") from error
        storages = {
            member.filename[len(root) + len("data/") :]: member
            for member in members
            if member.filename.startswith(root + "data/")
        }
    if not isinstance(loaded, dict) or not all(isinstance(v, TensorRef) for v in loaded.values()):
        raise InvalidInputError("the file must hold a state_dict: a mapping of names to tensors")
    return {str(key): value for key, value in loaded.items()}, storages


def _check_storage(key: str, tensor: TensorRef, storages: dict[str, zipfile.ZipInfo], size: int) -> None:
    member = storages.get(tensor.storage.key)
    itemsize = torch.empty((), dtype=tensor.dtype).element_size()
    expected = tensor.storage.numel * itemsize
    if member is None:
        raise InvalidInputError(f"{key}: its storage data/{tensor.storage.key} is not in the file")
    # torch.save stores every storage as is; a compressed one is a file remade to be small on the wire
    # and large once inflated (and could not be memory-mapped): refused before anything is inflated.
    if member.compress_type != zipfile.ZIP_STORED:
        raise InvalidInputError(
            f"{key}: its storage is compressed in the zip; torch.save stores storages uncompressed"
        )
    # The central directory's size is what unpacking allocates (and what the limits were checked on).
    if member.file_size != expected:
        raise InvalidInputError(
            f"{key}: its storage holds {member.file_size} bytes in the zip, {expected} in data.pkl"
        )
    if member.header_offset + member.compress_size > size:
        raise InvalidInputError(f"{key}: its storage runs past the end of the file")
    extent = tensor.offset + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride, strict=False)) + 1
    if any(n == 0 for n in tensor.shape):
        extent = 0
    if tensor.offset < 0 or extent > tensor.storage.numel:
        raise InvalidInputError(f"{key}: its shape reaches past its storage")


def check_paper_upload(data: CheckpointSource, prefix: str | None) -> None:
    """Refuse (``InvalidInputError``) a torch.save file that is not a paper ``RobezEmbedding`` state_dict
    before any tensor in it is loaded: the module's five keys (under ``prefix``, or the one prefix that has
    them), their dtypes and 1-D shapes (``weight`` float32 (m,), ``random_numbers`` int64 (11,), the
    helpers int64 (d,) of one length), and every storage of the file present at its declared size.
    The values themselves are checked by ``robez_core.table.import_paper_state_dict`` once loaded."""
    tensors, storages = declared_tensors(data)
    for key, tensor in tensors.items():
        _check_storage(key, tensor, storages, source_size(data))
    if prefix is None:
        prefixes = {key[: -len("random_numbers")] for key in tensors if key.endswith("random_numbers")}
        if len(prefixes) != 1:
            raise InvalidInputError(
                f"the state_dict holds {len(prefixes)} ROBE-Z modules ({sorted(prefixes)}); pass prefix="
            )
        prefix = prefixes.pop()
    missing = [key for key in _PAPER_TENSORS if prefix + key not in tensors]
    if missing:
        raise InvalidInputError(
            f"not a paper ROBE-Z state_dict: missing {missing} (expected keys {list(_PAPER_TENSORS)})"
        )
    lengths = set()
    for key, (dtype, length) in _PAPER_TENSORS.items():
        tensor = tensors[prefix + key]
        if tensor.dtype != dtype or len(tensor.shape) != 1 or tensor.shape[0] == 0:
            raise InvalidInputError(
                f"{key} must be {dtype} 1-D, got {tensor.dtype} {tensor.shape} (not a ROBE-Z state_dict)"
            )
        if length is not None and tensor.shape[0] != length:
            raise InvalidInputError(f"{key} must hold {length} values, got {tensor.shape[0]}")
        if key.startswith("helper_"):
            lengths.add(tensor.shape[0])
    if len(lengths) != 1:
        raise InvalidInputError("helper_Eidx_base, helper_Eidx_offset and helper_E1sR differ in length")


def check_upload(data: CheckpointSource, format: str, prefix: str | None) -> None:
    """The checks made before an uploaded checkpoint (``format``: auto, robez or paper) is loaded: a
    torch.save zip goes through ``check_paper_upload``. A legacy (non-zip) torch.save file, a robez
    checkpoint (safetensors: its header is checked against the file as it is read) and the size limits
    are ``read_checkpoint``'s."""
    kind = checkpoint_format(data) if format == "auto" else format
    if kind == "paper" and source_head(data, 4) == b"PK\x03\x04":
        check_paper_upload(data, prefix)
