"""Small file-system helpers (every durable step is write, fsync, rename, fsync the folder), the
data directory's locks and table names."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from robez_core.checkpoint import fsync_dir
from robez_core.errors import ConflictError, InvalidInputError

if TYPE_CHECKING:
    from robez_core.table import Table


from ..log.stream_copy import SIDE_FILE_PREFIX
from .records import crc32

logger = logging.getLogger("robez.wal")


def sync_data(fd: int) -> None:
    # fdatasync also flushes the file size, which is all an appended log needs.
    if hasattr(os, "fdatasync"):
        os.fdatasync(fd)
    else:  # pragma: no cover - macOS
        os.fsync(fd)


def write_file_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: temp file, fsync, rename, fsync the folder."""
    os.replace(write_temp_file(path, data), path)
    fsync_dir(path.parent)


def open_private(path: Path) -> BinaryIO:
    """``path`` created (or truncated) for writing, readable by its owner only (0600): a table's data is
    nobody else's business, like its snapshots (whatever the umask)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
    return os.fdopen(fd, "wb")


def write_temp_file(path: Path, data: bytes) -> Path:
    """``data`` in a fsynced temporary file beside ``path``, to be renamed over it; removed on failure (a
    full disk must not keep the space of a half-written file)."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open_private(tmp) as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def file_crc(path: Path, chunk_bytes: int = 1 << 24) -> tuple[int, int]:
    """CRC32 and size of a file, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            crc = crc32(chunk, crc)
            size += len(chunk)
    return crc, size


def table_bytes(table: Table) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in table.tensors().values())


def write_all(fd: int, buffers: list[Any]) -> None:
    total = sum(memoryview(b).nbytes for b in buffers)
    written = os.writev(fd, buffers)
    if written != total:  # a short writev (rare on regular files): finish with one joined write
        rest = b"".join(buffers)[written:]
        view = memoryview(rest)
        while view:
            view = view[os.write(fd, view) :]


def lock_data_dir(data_dir: Path, exclusive: bool) -> int | None:
    """flock the data directory's lock file: shared for servers (all their workers), exclusive for an
    offline tool, so ``robez import`` cannot rewrite tables under a running server."""
    fd = os.open(data_dir / ".robez.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = "a server or another tool" if exclusive else "an offline tool (robez import / snapshot)"
        raise ConflictError(f"the data directory {data_dir} is in use by {holder}") from None
    return fd


SERVER_LOCK_FILE = ".robez-serve.lock"
CREATING_PREFIX = ".creating-"  # a table being created is written here, then renamed into place


def remove_creation_leftovers(data_dir: Path) -> None:
    """Remove the staging folders of creates that a crash interrupted (nothing in them was committed),
    and the side files of downloads a kill cut off (log/stream_copy.py). Only while nothing else holds
    the data directory: the caller holds its exclusive lock."""
    for leftover in data_dir.iterdir():
        if leftover.is_dir() and leftover.name.startswith(CREATING_PREFIX):
            shutil.rmtree(leftover, ignore_errors=True)
        elif leftover.is_file() and leftover.name.startswith(SIDE_FILE_PREFIX):
            leftover.unlink(missing_ok=True)


class ServerLock:
    """The data directory held by one ``robez serve`` for its lifetime (taken by the parent process,
    before it loads the tables; its workers are its children and take only the shared lock).

    Two locks: ``.robez-serve.lock`` exclusively, so a second server on the same directory fails at once
    instead of interleaving its appends with ours; and ``.robez.lock`` shared, like the workers, so no
    offline tool can run from start-up until the last worker has stopped. Both are flocks: the kernel
    drops them when the process dies, however it dies.

    Raises ``ConflictError`` (naming the other server's pid) when the directory is taken.

    When no process at all holds the directory (no worker of an earlier server is still alive, no tool
    runs), start-up also removes what a create killed half-way left (``.creating-*`` folders), which
    would otherwise take disk space until an offline tool opened the directory.
    """

    def __init__(self, data_dir: str | os.PathLike[str]) -> None:
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.data_dir / SERVER_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConflictError(
                f"the data directory {self.data_dir} is in use by another robez serve (pid {holder}); "
                "one server per data directory"
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            self._remove_leftovers_if_free()
            self._shared_fd = lock_data_dir(self.data_dir, exclusive=False)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd

    def _remove_leftovers_if_free(self) -> None:
        try:
            exclusive_fd = lock_data_dir(self.data_dir, exclusive=True)
        except ConflictError:
            return  # a worker that outlived its server, or a tool: its create may be under way
        try:
            remove_creation_leftovers(self.data_dir)
        finally:
            if exclusive_fd is not None:
                os.close(exclusive_fd)

    def release(self) -> None:
        if self._fd is not None:
            if self._shared_fd is not None:
                os.close(self._shared_fd)
            os.close(self._fd)
            self._fd = None


def validate_table_name(name: str) -> None:
    """Refuse names that could leave the data directory or collide with our temporary folders."""
    if (
        not name
        or name.startswith(".")
        or "/" in name
        or "\\" in name
        or "\x00" in name
        or name != name.strip()
        or len(name) > 200
    ):
        raise InvalidInputError(f"table name {name!r} cannot be stored in the data directory")
