"""Gradient pushes for online training (JSON or binary)."""

from __future__ import annotations

import time
from typing import Annotated

import anyio
from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from ..auth import WriteAccess
from ..codec import (
    SHAPE_HEADER,
    VERSION_HEADER,
    JSONBytesResponse,
    UpdateResponse,
    decode_update_binary,
    decode_update_json,
    update_json,
)
from ..metrics import server_timing
from ..store import UpdateResult
from .deps import MetricsDep, StoreDep, TableNameParam, body_doc, compute, is_binary

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
    store: StoreDep,
    metrics: MetricsDep,
    _: WriteAccess,
    lr: Annotated[float | None, Query(gt=0, description="overrides the table's lr for this update")] = None,
) -> Response:
    start = time.perf_counter()
    body = await request.body()
    binary = is_binary(request)
    shape_header = request.headers.get(SHAPE_HEADER)

    def work() -> tuple[UpdateResult, int]:
        if binary:
            ids, grads = decode_update_binary(body, shape_header)
            body_lr = None
        else:
            ids, grads, body_lr = decode_update_json(body, store.table(name).config.embedding_dim)
        return store.apply_update(name, ids, grads, lr if lr is not None else body_lr)

    result, ticket = await compute(request, work)
    # Wait for the flush outside the compute slots, so concurrent updates share one group commit.
    await anyio.to_thread.run_sync(store.journal.wait_durable, ticket)
    request.state.table = name
    metrics.hash_seconds.labels(name).observe(result.hash_seconds)
    metrics.update_apply_seconds.labels(name).observe(result.apply_seconds)
    total = time.perf_counter() - start
    headers = {
        "Server-Timing": server_timing(hash=result.hash_seconds, apply=result.apply_seconds, total=total),
        VERSION_HEADER: str(result.version),
    }
    return JSONBytesResponse(update_json(name, result, total), headers=headers)
