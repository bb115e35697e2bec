"""Gradient pushes for online training (JSON or binary)."""

from __future__ import annotations

import time
from typing import Annotated

import anyio
from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from ..auth import WriteAccess, require_write_key
from ..codec import (
    SHAPE_HEADER,
    VERSION_HEADER,
    JSONBytesResponse,
    UpdateResponse,
    decode_update_binary,
    decode_update_json,
    update_json,
)
from ..fastpath import FastRoute
from ..metrics import Metrics, server_timing
from ..store import TableStore, UpdateResult
from .deps import INLINE_MAX_BODY_BYTES, TableNameParam, body_doc, compute, is_binary, read_body

router = APIRouter(prefix="/v1", tags=["update"])

_BINARY_UPDATE = (
    f"{SHAPE_HEADER}: n,d; body = n little-endian int64 ids then n*d little-endian float32 gradients"
)


@router.post(
    "/tables/{name}/update",
    response_model=UpdateResponse,
    openapi_extra=body_doc("UpdateRequest", _BINARY_UPDATE),
    summary="Apply the table's optimizer to the gradients of looked-up rows",
)
async def update(
    name: TableNameParam,
    request: Request,
    _: WriteAccess,
    lr: Annotated[float | None, Query(gt=0, description="overrides the table's lr for this update")] = None,
) -> Response:
    return await apply_update(request, name, lr)


async def apply_update(request: Request, name: str, lr: float | None = None) -> Response:
    """``POST /v1/tables/{name}/update`` once access is granted (FastAPI's endpoint and the fast path)."""
    start = time.perf_counter()
    store: TableStore = request.app.state.store
    metrics: Metrics = request.app.state.metrics
    body = await read_body(request)
    binary = is_binary(request)
    shape_header = request.headers.get(SHAPE_HEADER)

    def work(blocking: bool) -> tuple[UpdateResult, int] | None:
        if binary:
            ids, grads = decode_update_binary(body, shape_header)
            body_lr = None
        else:
            ids, grads, body_lr = decode_update_json(body, store.table(name).config.embedding_dim)
        return store.apply_update(name, ids, grads, lr if lr is not None else body_lr, blocking=blocking)

    # A small push runs on the event loop when the table's lock is free at once and the journal writes
    # nothing (the hop to a worker thread and back costs more than its whole work); otherwise it waits
    # for the lock in a worker thread.
    inline = len(body) <= INLINE_MAX_BODY_BYTES and store.journal_is_memory_only()
    done = work(False) if inline else None
    if done is None:
        done = await compute(request, lambda: work(True))
    assert done is not None
    result, ticket = done
    if ticket > 0:
        # Wait for the flush outside the compute slots, so concurrent updates share one group commit.
        await anyio.to_thread.run_sync(store.journal.wait_durable, ticket)
    request.state.table = name
    stages = metrics.stages(name)
    stages.hash_seconds.observe(result.hash_seconds)
    stages.update_apply_seconds.observe(result.apply_seconds)
    total = time.perf_counter() - start
    headers = {
        "Server-Timing": server_timing(hash=result.hash_seconds, apply=result.apply_seconds, total=total),
        VERSION_HEADER: str(result.version),
    }
    return JSONBytesResponse(update_json(name, result, total), headers=headers)


async def _update_fast(request: Request, name: str) -> Response:
    await require_write_key(request)
    return await apply_update(request, name)


# With a query string (?lr=...) the request goes through FastAPI, which validates the parameter.
fast_routes = [FastRoute.of(router, "POST", "/v1/tables/{name}/update", _update_fast, query=False)]
