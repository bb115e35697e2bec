"""Checkpoints in and out: reading a robez or paper checkpoint, aligning it with a table, and the
offline tools (``robez import`` / ``robez snapshot``) that lock the data directory against servers."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import tempfile
import zipfile
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

import torch

from robez_core.config import OptimizerConfig, TableConfig
from robez_core.errors import ConflictError, CorruptionError, InvalidInputError, NotFoundError

from ..errors import PayloadTooLargeError

if TYPE_CHECKING:
    from robez_core.table import Table


from .journal import WalJournal

logger = logging.getLogger("robez.wal")


CheckpointFormat = Literal["auto", "robez", "paper"]
CHECKPOINT_FORMATS: tuple[str, ...] = ("auto", "robez", "paper")
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's default (zip) format
_PICKLE_PROTOCOL_2 = b"\x80\x02"  # torch.save's legacy format


# A checkpoint to read: its bytes, or the path of a file holding them (an upload spooled to disk, read
# without being held in memory: zip and safetensors headers are read from it, tensors memory-mapped).
CheckpointSource = bytes | str | os.PathLike[str]
# safetensors refuses larger headers; reading one is bounded by this.
_MAX_SAFETENSORS_HEADER = 100_000_000


def source_head(source: CheckpointSource, size: int) -> bytes:
    """The first ``size`` bytes of ``source`` (fewer when it is shorter)."""
    if isinstance(source, bytes):
        return source[:size]
    with open(source, "rb") as handle:
        return handle.read(size)


def source_size(source: CheckpointSource) -> int:
    return len(source) if isinstance(source, bytes) else os.path.getsize(source)


def open_zip(source: CheckpointSource) -> zipfile.ZipFile:
    """``source`` as a zip archive (only its central directory is read); ``InvalidInputError`` if it is
    not one."""
    try:
        return zipfile.ZipFile(io.BytesIO(source) if isinstance(source, bytes) else source)
    except (zipfile.BadZipFile, OSError, ValueError) as error:
        raise InvalidInputError(f"not a readable torch.save (zip) file: {error}") from error


def checkpoint_format(data: CheckpointSource) -> str:
    """``"paper"`` for a torch.save file (zip or legacy), ``"robez"`` otherwise (safetensors)."""
    return "paper" if source_head(data, 4).startswith((_ZIP_MAGIC, _PICKLE_PROTOCOL_2)) else "robez"


# safetensors dtype names -> bytes per element (the ones robez and torch write).
_SAFETENSORS_ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1
}  # fmt: skip


def declared_tensor_bytes(data: CheckpointSource, kind: str) -> int:
    """The bytes the tensors of a checkpoint will take once loaded, as the file declares them, read
    without decompressing or allocating anything: a torch.save zip's central directory (each member's
    uncompressed size: a small deflated member may declare gigabytes), a safetensors header (shape x
    dtype). Raises ``InvalidInputError`` for a legacy (non-zip) torch.save file, whose storage sizes
    only unpickling tells, and for a header that cannot be read."""
    if kind == "paper":
        if not source_head(data, 4).startswith(_ZIP_MAGIC):
            raise InvalidInputError(
                "a legacy (non-zip) torch.save file cannot be size-checked before loading; save it again "
                "with torch.save's default (zip) format, or use robez import (offline)"
            )
        with open_zip(data) as archive:
            return sum(member.file_size for member in archive.infolist())
    size = source_size(data)
    if size < 8:
        return size  # the loader says what is wrong with it
    header_size = int.from_bytes(source_head(data, 8), "little")
    if header_size > size - 8 or header_size > _MAX_SAFETENSORS_HEADER:
        raise InvalidInputError("not a valid robez checkpoint: its safetensors header is cut short")
    try:
        header = json.loads(source_head(data, 8 + header_size)[8:])
        return sum(
            math.prod(int(dim) for dim in entry["shape"]) * _SAFETENSORS_ITEMSIZE.get(entry["dtype"], 8)
            for key, entry in header.items()
            if key != "__metadata__"
        )
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        raise InvalidInputError(f"not a valid robez checkpoint: unreadable header ({error})") from error


def _check_declared_size(data: CheckpointSource, kind: str, max_tensor_bytes: tuple[int, str]) -> None:
    declared = declared_tensor_bytes(data, kind)
    limit, made_of = max_tensor_bytes
    if declared > limit:
        raise PayloadTooLargeError(
            f"the checkpoint declares {declared} bytes of tensors; the limit is {limit} bytes ({made_of})"
        )


def _paper_state_dict(data: CheckpointSource, prefix: str | None) -> dict[str, torch.Tensor]:
    """The paper module's entries from a torch.save file, read with ``weights_only=True`` (tensors and
    plain containers only; no arbitrary objects are unpickled). ``prefix`` picks one module out of a
    whole model's state_dict (e.g. ``"emb_l.0."``); None finds it when there is exactly one. A file is
    memory-mapped: its tensors take memory only as far as they are read."""
    try:
        if isinstance(data, bytes):
            loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        else:
            loaded = torch.load(data, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # unpickling errors come in many types; none may reach the client as 500
        raise InvalidInputError(
            f"not a state_dict torch.load(weights_only=True) can read: {error}"
        ) from error
    if not isinstance(loaded, Mapping) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise InvalidInputError("the file must hold a state_dict: a mapping of names to tensors")
    if prefix is None:
        prefixes = {key[: -len("random_numbers")] for key in loaded if str(key).endswith("random_numbers")}
        if len(prefixes) != 1:
            raise InvalidInputError(
                f"the state_dict holds {len(prefixes)} ROBE-Z modules ({sorted(prefixes)}); pass prefix="
            )
        prefix = prefixes.pop()
    return {str(key)[len(prefix) :]: value for key, value in loaded.items() if str(key).startswith(prefix)}


def read_checkpoint(
    data: CheckpointSource,
    *,
    format: CheckpointFormat = "auto",
    num_embeddings: int | None = None,
    chunk_size: int | None = None,
    val_offset: int = 0,
    prefix: str | None = None,
    optimizer: OptimizerConfig | None = None,
    max_tensor_bytes: tuple[int, str] | None = None,
) -> tuple[Table, str]:
    """A private ``Table`` from checkpoint bytes (or the path of a file holding them: nothing is read
    into memory but what the table keeps), and the format it was read as.

    ``robez``: a file written by ``Table.save`` (checksums verified). ``paper``: the paper's
    ``RobezEmbedding`` state_dict (``weight``, ``random_numbers``, ``helper_*``) via
    ``import_paper_state_dict`` with ``num_embeddings`` / ``chunk_size`` / ``val_offset`` / ``optimizer``
    (which a state_dict does not hold). Bad input raises ``InvalidInputError`` or ``ConfigError``.
    ``max_tensor_bytes``: (limit, how it is made, for the message): a file declaring more tensor bytes is
    refused (``PayloadTooLargeError``) before anything is decompressed or allocated.
    """
    from robez_core.table import import_paper_state_dict

    if format not in CHECKPOINT_FORMATS:
        raise InvalidInputError(f"format must be one of {CHECKPOINT_FORMATS}, got {format!r}")
    kind = checkpoint_format(data) if format == "auto" else format
    if max_tensor_bytes is not None:
        _check_declared_size(data, kind, max_tensor_bytes)
    if kind == "paper":
        state_dict = _paper_state_dict(data, prefix)
        try:
            table = import_paper_state_dict(
                state_dict,
                num_embeddings=num_embeddings,
                chunk_size=chunk_size,
                val_offset=val_offset,
                optimizer=optimizer,
            )
        except CorruptionError as error:
            raise InvalidInputError(f"the state_dict is not a valid ROBE-Z module: {error}") from error
        return table, kind
    if not isinstance(data, bytes):
        return _load_robez(os.fspath(data)), kind
    # safetensors reads from a file; the upload only lives as long as this call.
    with tempfile.NamedTemporaryFile(prefix="robez-import-", suffix=".safetensors") as handle:
        handle.write(data)
        handle.flush()
        return _load_robez(handle.name), kind


def _load_robez(path: str) -> Table:
    from robez_core.table import Table

    try:
        return Table.load(path)
    except CorruptionError as error:
        reason = str(error).replace(path, "(the upload)")  # no server paths in the answer
        raise InvalidInputError(f"not a valid robez checkpoint: {reason}") from error


def _shape(config: TableConfig) -> str:
    return (
        f"m={config.memory_size}, d={config.embedding_dim}, Z={config.chunk_size}, hash={config.hash}, "
        f"val_offset={config.val_offset}"
    )


def align_checkpoint(imported: Table, existing: Table, *, keep_optimizer_state: bool) -> Table:
    """``imported`` in the form of ``existing``'s config, ready to overwrite it in place.

    The array must be interchangeable: same memory_size, embedding_dim, chunk_size, hash, val_offset and
    hash constants (``ConflictError`` otherwise; a table of another shape is a new table: delete, then
    load). The existing table's reporting fields (num_embeddings, seed or explicit constants) are kept.
    With ``keep_optimizer_state`` (a robez checkpoint) the optimizer must match and its state is taken
    over; otherwise (a paper state_dict, which has none) the table's optimizer starts from fresh state.
    """
    from robez_core.table import Table

    mine, theirs = existing.config, imported.config
    same_array = (mine.memory_size, mine.embedding_dim, mine.chunk_size, mine.hash, mine.val_offset) == (
        theirs.memory_size,
        theirs.embedding_dim,
        theirs.chunk_size,
        theirs.hash,
        theirs.val_offset,
    ) and torch.equal(existing.random_numbers, imported.random_numbers)
    if not same_array:
        raise ConflictError(
            f"the checkpoint's array ({_shape(theirs)}) does not match the table's ({_shape(mine)}) or its "
            "hash constants differ; delete the table first to load a different one"
        )
    if not keep_optimizer_state:
        return Table(mine, existing.optimizer, weight=imported.weight)
    if imported.optimizer != existing.optimizer:
        raise ConflictError(
            f"the checkpoint's optimizer {imported.optimizer.to_dict()} differs from the table's "
            f"{existing.optimizer.to_dict()}; delete the table first to load it with another optimizer"
        )
    return Table(mine, existing.optimizer, weight=imported.weight, state=imported.state)


# ---------------------------------------------------------------------------------------------------------
# Offline tools (``robez import`` / ``robez snapshot``): the data directory locked against servers


def import_offline(
    data_dir: str | os.PathLike[str],
    name: str,
    data: bytes,
    *,
    replace: bool = False,
    format: CheckpointFormat = "auto",
    num_embeddings: int | None = None,
    chunk_size: int | None = None,
    val_offset: int = 0,
    prefix: str | None = None,
    optimizer: OptimizerConfig | None = None,
) -> tuple[Table, str]:
    """Write checkpoint bytes as table ``name`` at version 0 (a new snapshot generation, empty log).

    An existing table is replaced only with ``replace`` (its shape may change: nothing is mapped). A paper
    state_dict carries no optimizer: ``optimizer`` if given, else the existing table's, else the default.
    Returns the table written and the format read.
    """
    from robez_core.table import Table

    journal = WalJournal(data_dir, exclusive=True)
    try:
        existing = journal.snapshot_path(name)
        if existing is not None and not replace:
            raise ConflictError(
                f"table {name!r} already exists in {data_dir}; pass --replace to overwrite it"
            )
        if optimizer is None and existing is not None:
            optimizer = Table.load(existing).optimizer
        table, kind = read_checkpoint(
            data,
            format=format,
            num_embeddings=num_embeddings,
            chunk_size=chunk_size,
            val_offset=val_offset,
            prefix=prefix,
            optimizer=optimizer,
        )
        if existing is None:
            journal.create(name, table, 0)
        else:
            journal.snapshot(name, table, 0)
        return table, kind
    finally:
        journal.close()


def snapshot_offline(
    data_dir: str | os.PathLike[str], names: list[str] | None = None, *, salvage: bool = False
) -> list[tuple[str, int, int]]:
    """Replay each table's log into a fresh snapshot (compaction; also a full check of every file).

    Returns (name, version, updates replayed) per table; raises ``CorruptionError`` on damage, unless
    ``salvage``, which keeps the updates before a damaged record and gives up the rest.
    """
    journal = WalJournal(data_dir, exclusive=True)
    done: list[tuple[str, int, int]] = []
    try:
        if salvage:
            for name in journal.damaged():
                if names is None or name in names:
                    aside = journal.set_aside(name)
                    logger.warning(
                        "skipped table %r: its folder has no meta.json, so it cannot be loaded; set aside as "
                        "%s with every file in it",
                        name,
                        aside,
                    )
        for name in names if names is not None else journal.names():
            before = journal.snapshot_version(name)
            loaded = journal.load(name, salvage=salvage)
            if loaded is None or before is None:
                raise NotFoundError(f"no table {name!r} in {data_dir}")
            table, version = loaded
            journal.snapshot(name, table, version)
            done.append((name, version, version - before))
    finally:
        journal.close()
    return done
