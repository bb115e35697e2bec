"""Multi-table gradient pushes: every table's ids and gradients of one training step in one request
(JSON or binary), applied all-or-nothing, the answer carrying each table's version."""

from __future__ import annotations

import time
from functools import partial
from typing import Annotated

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from ..auth import WriteAccess, require_write_key
from ..codec import (
    SHAPES_HEADER,
    TABLES_HEADER,
    VERSION_HEADER,
    MultiUpdateResponse,
    RawResponse,
    decode_multi_update_binary,
    decode_multi_update_json,
    json_bytes,
    milliseconds,
    update_json,
)
from ..http.fastpath import FastRoute
from ..metrics import Metrics, server_timing
from ..store import TableStore, UpdatePart
from ..store.writes import WritePath
from .deps import body_doc, compute, is_binary, raw_headers, read_body
from .update import IDEMPOTENCY_HEADER, REPLICA_HEADER

router = APIRouter(prefix="/v1", tags=["update"])

_BINARY_MULTI_UPDATE = (
    f"{TABLES_HEADER}: name=n,... and {SHAPES_HEADER}: n,d;... in body order; body = each table's n "
    "little-endian int64 ids then n*d little-endian float32 gradients, in that order"
)
_IDEMPOTENCY = IDEMPOTENCY_HEADER.lower().encode()
_REPLICA = REPLICA_HEADER.lower().encode()
_TABLES = TABLES_HEADER.lower().encode()
_SHAPES = SHAPES_HEADER.lower().encode()
_VERSION = VERSION_HEADER.lower().encode()
_JSON = b"application/json"


@router.post(
    "/update",
    response_model=MultiUpdateResponse,
    openapi_extra=body_doc("MultiUpdateRequest", _BINARY_MULTI_UPDATE),
    summary="Apply the optimizers of several tables to one step's gradients, all or nothing",
)
async def update_several(
    request: Request,
    _: WriteAccess,
    lr: Annotated[float | None, Query(gt=0, description="overrides every table's lr for this push")] = None,
) -> Response:
    return await apply_update_many(request, lr)


async def apply_update_many(request: Request, lr: float | None = None) -> Response:
    """``POST /v1/update`` once access is granted (FastAPI's endpoint and the fast path)."""
    start = time.perf_counter()
    state = request.app.state
    store: TableStore = state.store
    metrics: Metrics = state.metrics
    body = await read_body(request)
    read = time.perf_counter() - start
    headers = raw_headers(request)
    binary = is_binary(request, headers)

    names: list[str] = []  # the parts' tables, in order, once decoded
    decoded: list[float] = []  # the seconds decoding took (in the worker thread)

    def decode() -> list[UpdatePart]:
        decode_start = time.perf_counter()
        if binary:
            tables, shapes = headers.get(_TABLES), headers.get(_SHAPES)
            parts = decode_multi_update_binary(
                body,
                tables.decode("latin-1") if tables is not None else None,
                shapes.decode("latin-1") if shapes is not None else None,
            )
        else:
            parts = decode_multi_update_json(body, lambda name: store.table(name).config.embedding_dim)
        names[:] = [name for name, _, _, _ in parts]
        decoded.append(time.perf_counter() - decode_start)
        return [
            UpdatePart(name, ids, grads, lr if lr is not None else part_lr)
            for name, ids, grads, part_lr in parts
        ]

    idempotency_key = headers.get(_IDEMPOTENCY)
    key = idempotency_key.decode("latin-1") if idempotency_key is not None else None
    writes: WritePath = state.writes
    # Never inline: a multi-table push is a training step's worth of rows.
    written = await writes.update(decode, key, partial(compute, request), small=False)
    results = written.results
    hash_seconds = sum(result.hash_seconds for result in results)
    apply_seconds = sum(result.apply_seconds for result in results)
    total = time.perf_counter() - start
    if written.stages is None:
        for name, result in zip(names, results, strict=True):
            stages = metrics.stages(name)
            stages.hash_seconds.observe(result.hash_seconds)
            stages.update_apply_seconds.observe(result.apply_seconds)
        # read: the body's bytes arriving; decode: parsing them; hash + apply: the store's step (what the
        # rest of total is: the hops to and from the worker thread, the lock, the answer)
        timing = server_timing(
            read=read, decode=sum(decoded), hash=hash_seconds, apply=apply_seconds, total=total
        ).encode("latin-1")
    else:
        timing = server_timing(**written.stages, total=total).encode("latin-1")
    response_headers = [
        (b"server-timing", timing),
        (_VERSION, ",".join(str(result.version) for result in results).encode("latin-1")),
    ]
    if written.replica is not None:  # tells clients that a resent Idempotency-Key is applied once here
        response_headers.append((_REPLICA, written.replica.encode("latin-1")))
    payload = {
        "results": [
            update_json(name, result, result.hash_seconds + result.apply_seconds)
            for name, result in zip(names, results, strict=True)
        ],
        "timing": {
            "hash_ms": milliseconds(hash_seconds),
            "apply_ms": milliseconds(apply_seconds),
            "total_ms": milliseconds(total),
        },
    }
    return RawResponse(json_bytes(payload), _JSON, response_headers)


async def _update_many_fast(request: Request, _: str) -> Response:
    await require_write_key(request)
    return await apply_update_many(request)


# With a query string (?lr=...) the request goes through FastAPI, which validates the parameter.
fast_routes = [FastRoute.of(router, "POST", "/v1/update", _update_many_fast, query=False)]
