"""Gradient pushes for online training (JSON or binary)."""

from __future__ import annotations

import time
from functools import partial
from typing import Annotated

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from ..auth import WriteAccess, require_write_key
from ..codec import (
    SHAPE_HEADER,
    VERSION_HEADER,
    RawResponse,
    UpdateResponse,
    decode_update_binary,
    decode_update_json,
    json_bytes,
    update_json,
)
from ..http.fastpath import FastRoute
from ..metrics import Metrics, server_timing, set_table_label, update_server_timing
from ..store import TableStore, UpdatePart
from ..store.writes import WritePath
from .deps import (
    INLINE_MAX_BODY_BYTES,
    TableNameParam,
    body_doc,
    compute,
    is_binary,
    raw_headers,
    read_body,
)

router = APIRouter(prefix="/v1", tags=["update"])

# Replicated mode: a retry with the same key (to any replica, within ROBEZ_NATS_DEDUP_WINDOW_S) is applied
# once and answered with the first attempt's version (docs/replication.md).
IDEMPOTENCY_HEADER = "Idempotency-Key"
REPLICA_HEADER = "X-Robez-Replica"

_SHAPE = SHAPE_HEADER.lower().encode()
_VERSION = VERSION_HEADER.lower().encode()
_IDEMPOTENCY = IDEMPOTENCY_HEADER.lower().encode()
_REPLICA = REPLICA_HEADER.lower().encode()
_JSON = b"application/json"

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
    state = request.app.state
    store: TableStore = state.store
    metrics: Metrics = state.metrics
    body = await read_body(request)
    headers = raw_headers(request)
    binary = is_binary(request, headers)
    shape = headers.get(_SHAPE)
    shape_header = shape.decode("latin-1") if shape is not None else None

    def decode() -> list[UpdatePart]:
        if binary:
            ids, grads = decode_update_binary(body, shape_header)
            return [UpdatePart(name, ids, grads, lr)]
        ids, grads, body_lr = decode_update_json(body, store.table(name).config.embedding_dim)
        return [UpdatePart(name, ids, grads, lr if lr is not None else body_lr)]

    idempotency_key = headers.get(_IDEMPOTENCY)
    key = idempotency_key.decode("latin-1") if idempotency_key is not None else None
    writes: WritePath = state.writes
    written = await writes.update(
        decode, key, partial(compute, request), small=len(body) <= INLINE_MAX_BODY_BYTES
    )
    (result,) = written.results
    set_table_label(request, name)
    total = time.perf_counter() - start
    if written.stages is None:
        table_stages = metrics.stages(name)
        table_stages.hash_seconds.observe(result.hash_seconds)
        table_stages.update_apply_seconds.observe(result.apply_seconds)
        timing = update_server_timing(result.hash_seconds, result.apply_seconds, total)
    else:
        timing = server_timing(**written.stages, total=total).encode("latin-1")
    response_headers = [(b"server-timing", timing), (_VERSION, b"%d" % result.version)]
    if written.replica is not None:  # tells clients that a resent Idempotency-Key is applied once here
        response_headers.append((_REPLICA, written.replica.encode("latin-1")))
    return RawResponse(json_bytes(update_json(name, result, total)), _JSON, response_headers)


async def _update_fast(request: Request, name: str) -> Response:
    await require_write_key(request)
    return await apply_update(request, name)


# With a query string (?lr=...) the request goes through FastAPI, which validates the parameter.
fast_routes = [FastRoute.of(router, "POST", "/v1/tables/{name}/update", _update_fast, query=False)]
