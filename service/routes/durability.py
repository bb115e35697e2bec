"""Durability endpoints: snapshot a table, load (import) a checkpoint into it, export its checkpoint.

Also owns this worker's ``SnapshotScheduler`` (periodic snapshots, and one at graceful shutdown) through
the router's lifespan, which FastAPI nests inside the app's: the store exists while it runs.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, FastAPI, Query, Request
from starlette.responses import Response, StreamingResponse

from robez_core.config import OptimizerConfig, OptimizerName
from robez_core.errors import ConflictError
from robez_core.table import Table

from ..auth import WriteAccess
from ..codec import OCTET_STREAM, VERSION_HEADER, TableInfoResponse, table_info_json
from ..log.stream_copy import CheckpointStream, StreamAborted
from ..store import TableStore
from ..store.writes import WritePath
from ..uploads import check_upload, spooled_path
from ..wal import (
    CheckpointFormat,
    SnapshotScheduler,
    WalJournal,
    read_checkpoint,
)
from .deps import StoreDep, compute
from .update import IDEMPOTENCY_HEADER

logger = logging.getLogger("robez.durability")


@asynccontextmanager
async def _snapshots(app: FastAPI) -> AsyncIterator[None]:
    store: TableStore | None = getattr(app.state, "store", None)
    journal = store.journal if store is not None else None
    if store is None or not isinstance(journal, WalJournal):
        yield
        return
    scheduler = SnapshotScheduler(store, journal)
    scheduler.start()
    try:
        yield
    finally:
        final = app.state.settings.snapshot_on_shutdown
        taken = scheduler.stop(final_snapshot=final)
        if taken:
            logger.info("snapshots at shutdown: %s", ", ".join(taken))


router = APIRouter(prefix="/v1/tables", tags=["durability"], lifespan=_snapshots)


def _wal(store: TableStore) -> WalJournal:
    if not isinstance(store.journal, WalJournal):
        raise ConflictError("this server has no data directory (--data-dir): tables live in memory only")
    return store.journal


@router.post("/{name}/snapshot", summary="Write a snapshot of the table now and start an empty log")
async def snapshot(name: str, request: Request, store: StoreDep, _: WriteAccess) -> dict[str, Any]:
    journal = _wal(store)
    version = await compute(request, lambda: store.snapshot(name))
    request.state.table = name
    path = journal.snapshot_path(name)
    return {"table": name, "version": version, "snapshot_bytes": path.stat().st_size if path else 0}


_LOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            OCTET_STREAM: {
                "schema": {"type": "string", "format": "binary"},
                "description": "a robez checkpoint (safetensors, as GET .../checkpoint returns) or a "
                "torch.save file of the paper's RobezEmbedding state_dict (read with weights_only=True)",
            }
        },
    }
}


@router.post(
    "/{name}/load",
    response_model=TableInfoResponse,
    openapi_extra=_LOAD_BODY,
    summary="Replace the table's array (and optimizer state) with a checkpoint; creates the table if new",
)
async def load(
    name: str,
    request: Request,
    store: StoreDep,
    _: WriteAccess,
    format: Annotated[CheckpointFormat, Query(description="auto: torch.save files are paper")] = "auto",
    num_embeddings: Annotated[int | None, Query(ge=1, description="paper: the module's n")] = None,
    chunk_size: Annotated[int | None, Query(ge=1, description="paper: Z when d <= Z")] = None,
    val_offset: Annotated[int, Query(description="paper: the module's val_offset")] = 0,
    prefix: Annotated[str | None, Query(max_length=200, description="paper: key prefix")] = None,
    optimizer: Annotated[OptimizerName | None, Query(description="paper, new table: its optimizer")] = None,
    lr: Annotated[float | None, Query(gt=0, description="paper, new table: the optimizer's lr")] = None,
) -> dict[str, Any]:
    default_optimizer = OptimizerConfig()
    new_optimizer = OptimizerConfig(
        name=optimizer or default_optimizer.name, lr=lr if lr is not None else default_optimizer.lr
    )
    # The body is in a temporary file (never whole in memory), open until this request ends.
    upload = spooled_path(request.scope)

    def read() -> tuple[Table, str]:
        check_upload(upload, format, prefix)  # before anything in it is loaded
        return read_checkpoint(
            upload,
            format=format,
            num_embeddings=num_embeddings,
            chunk_size=chunk_size,
            val_offset=val_offset,
            prefix=prefix,
            optimizer=new_optimizer,
            max_tensor_bytes=store.limits.max_checkpoint_bytes(),
        )

    request.state.table = name
    writes: WritePath = request.app.state.writes
    key = request.headers.get(IDEMPOTENCY_HEADER)
    await writes.load(name, read, key, partial(compute, request))
    return table_info_json(store.info(name))


@router.get(
    "/{name}/checkpoint",
    responses={200: {"content": {OCTET_STREAM: {"schema": {"type": "string", "format": "binary"}}}}},
    summary="Download the table as a robez checkpoint (safetensors), at the version it begins at",
)
async def checkpoint(
    name: str,
    request: Request,
    store: StoreDep,
    _: WriteAccess,
    version: Annotated[
        int | None,
        Query(ge=0, description="replicas: the table as it was at this version, while the log keeps it"),
    ] = None,
) -> Response:
    if version is not None and version != store.version(name):
        writes: WritePath = request.app.state.writes
        table = await writes.table_at(name, version)
        data = await compute(request, lambda: _checkpoint_bytes(table))
        request.state.table = name
        headers = {
            VERSION_HEADER: str(version),
            "Content-Disposition": f'attachment; filename="{name}-v{version}.safetensors"',
        }
        return Response(data, media_type=OCTET_STREAM, headers=headers)
    stream = await compute(request, lambda: open_stream(store, name, request.app.state.settings.data_dir))
    request.state.table = name
    headers = {
        VERSION_HEADER: str(stream.version),
        "Content-Length": str(stream.size),
        "Content-Disposition": f'attachment; filename="{name}-v{stream.version}.safetensors"',
    }
    return StreamingResponse(_body(name, stream), media_type=OCTET_STREAM, headers=headers)


def open_stream(store: TableStore, name: str, data_dir: Path | None) -> CheckpointStream:
    """The table's download, begun: its version fixed, its first byte ready (log/stream_copy.py: sent
    while updates go on, copy-on-write; the saved granules spill into ``data_dir``, or the system's
    temporary directory without one)."""
    return CheckpointStream(
        name,
        partial(store.exclusive, name),
        partial(store.marks_of, name),
        None if data_dir is None else str(data_dir),
        store.faults,
    )


async def _body(name: str, stream: CheckpointStream) -> AsyncIterator[bytes]:
    """``stream.chunks()``, each made on a thread; a download cut short (the headers went: the client
    sees a short body) is logged with why. However it ends (a client gone mid-way cancels this), the
    stream is closed at once: its bit of the array's record freed, its side file removed (a thread's
    ``next`` is not cancelled: the close waits for it)."""
    chunks = stream.chunks()
    try:
        while True:
            chunk = await anyio.to_thread.run_sync(next, chunks, None)
            if chunk is None:
                return
            yield chunk
    except StreamAborted as error:
        logger.warning("download of table %r at version %d cut short: %s", name, stream.version, error)
        raise
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(stream.close)


def _checkpoint_bytes(table: Table) -> bytes:
    """``table`` as a robez checkpoint (safetensors), in memory."""
    with tempfile.TemporaryDirectory(prefix="robez-load-") as tmp:
        path = os.path.join(tmp, "checkpoint.safetensors")
        table.save(path)
        with open(path, "rb") as handle:
            return handle.read()
