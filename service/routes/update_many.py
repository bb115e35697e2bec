"""Multi-table gradient pushes: every table's ids and gradients of one training step in one request
(JSON or binary), applied all-or-nothing, the answer carrying each table's version; optionally with a
lookup part (the next batch's ids), checked before the push and read after it, answered as
``POST /v1/lookup`` answers: a training step in one request."""

from __future__ import annotations

import time
from functools import partial
from typing import Annotated

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from ..auth import WriteAccess, require_write_key
from ..codec import (
    LOOKUP_HEADER,
    LOOKUP_VERSION_HEADER,
    OCTET_STREAM,
    SHAPES_HEADER,
    TABLES_HEADER,
    VERSION_HEADER,
    MultiUpdateResponse,
    RawResponse,
    decode_multi_update_binary,
    decode_multi_update_json,
    json_bytes,
    lookup_json,
    milliseconds,
    multi_rows_binary,
    split_lookup_part,
    update_json,
)
from ..http.fastpath import FastRoute
from ..metrics import Metrics, server_timing
from ..store import LookupRequestItem, LookupResult, TableStore, UpdatePart
from ..store.writes import WritePath
from .deps import body_doc, compute, is_binary, raw_headers, read_body, wants_binary
from .lookup import observe_lookup
from .update import IDEMPOTENCY_HEADER, REPLICA_HEADER

router = APIRouter(prefix="/v1", tags=["update"])

_BINARY_MULTI_UPDATE = (
    f"{TABLES_HEADER}: name=n,... and {SHAPES_HEADER}: n,d;... in body order; body = each table's n "
    "little-endian int64 ids then n*d little-endian float32 gradients, in that order. Optional lookup "
    f"part: {LOOKUP_HEADER}: name=n,... and the ids of those tables (little-endian int64, in that order) "
    "after the push's parts; they are read once the push is applied and the response is then their "
    f"rows in that order (float32), {SHAPES_HEADER}: n,d;... of the rows, {VERSION_HEADER}: the push's "
    f"versions, {LOOKUP_VERSION_HEADER}: the versions the rows were read at"
)
_BINARY_RESPONSE = {"content": {OCTET_STREAM: {"schema": {"type": "string", "format": "binary"}}}}
_IDEMPOTENCY = IDEMPOTENCY_HEADER.lower().encode()
_REPLICA = REPLICA_HEADER.lower().encode()
_TABLES = TABLES_HEADER.lower().encode()
_SHAPES = SHAPES_HEADER.lower().encode()
_VERSION = VERSION_HEADER.lower().encode()
_LOOKUP = LOOKUP_HEADER.lower().encode()
_LOOKUP_VERSION = LOOKUP_VERSION_HEADER.lower().encode()
_JSON = b"application/json"
_OCTET_STREAM = OCTET_STREAM.encode()


@router.post(
    "/update",
    response_model=MultiUpdateResponse,
    responses={200: _BINARY_RESPONSE},
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
    lookups: list[LookupRequestItem] = []  # the lookup part, once decoded and checked

    def decode() -> list[UpdatePart]:
        decode_start = time.perf_counter()
        if binary:
            tables, shapes, lookup = headers.get(_TABLES), headers.get(_SHAPES), headers.get(_LOOKUP)
            push_body, lookup_ids = split_lookup_part(
                body, lookup.decode("latin-1") if lookup is not None else None
            )
            parts = decode_multi_update_binary(
                push_body,
                tables.decode("latin-1") if tables is not None else None,
                shapes.decode("latin-1") if shapes is not None else None,
            )
            items = [LookupRequestItem(name, ids) for name, ids in lookup_ids]
        else:
            parts, json_lookups = decode_multi_update_json(
                body, lambda name: store.table(name).config.embedding_dim
            )
            items = [LookupRequestItem(item.table, *item.inputs()) for item in json_lookups]
        if items:  # a bad lookup part is refused before the push is applied (limits as /v1/lookup's)
            store.lookup_many(items, check_only=True)
        lookups[:] = items
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
    # Read-your-writes: the push is applied here (a replica: by this replica) before its lookup part.
    read_back: list[LookupResult] = (
        await compute(request, lambda: store.lookup_many(lookups)) if lookups else []
    )
    hash_seconds = sum(result.hash_seconds for result in results)
    apply_seconds = sum(result.apply_seconds for result in results)
    total = time.perf_counter() - start
    lookup_stages = {}
    if read_back:
        lookup_stages = {
            "lookup_hash": sum(result.hash_seconds for result in read_back),
            "lookup": sum(result.lookup_seconds for result in read_back),
        }
        for item, part in zip(lookups, read_back, strict=True):
            observe_lookup(metrics, item.table, part)
    if written.stages is None:
        for name, result in zip(names, results, strict=True):
            stages = metrics.stages(name)
            stages.hash_seconds.observe(result.hash_seconds)
            stages.update_apply_seconds.observe(result.apply_seconds)
        # read: the body's bytes arriving; decode: parsing them; hash + apply: the store's step (what the
        # rest of total is: the hops to and from the worker thread, the lock, the answer); lookup_hash +
        # lookup: the lookup part's
        timing = server_timing(
            read=read,
            decode=sum(decoded),
            hash=hash_seconds,
            apply=apply_seconds,
            **lookup_stages,
            total=total,
        ).encode("latin-1")
    else:
        timing = server_timing(**written.stages, **lookup_stages, total=total).encode("latin-1")
    response_headers = [
        (b"server-timing", timing),
        (_VERSION, ",".join(str(result.version) for result in results).encode("latin-1")),
    ]
    if written.replica is not None:  # tells clients that a resent Idempotency-Key is applied once here
        response_headers.append((_REPLICA, written.replica.encode("latin-1")))
    if read_back and wants_binary(request, headers):  # the rows as POST /v1/lookup answers them
        shapes, rows = multi_rows_binary([r.rows for r in read_back])
        response_headers.append((_SHAPES, shapes.encode("latin-1")))
        versions = ",".join(str(result.version) for result in read_back)
        response_headers.append((_LOOKUP_VERSION, versions.encode("latin-1")))
        return RawResponse(rows, _OCTET_STREAM, response_headers)
    payload: dict[str, object] = {
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
    if read_back:
        payload["lookups"] = [
            lookup_json(item.table, result, result.hash_seconds + result.lookup_seconds)
            for item, result in zip(lookups, read_back, strict=True)
        ]
    return RawResponse(json_bytes(payload), _JSON, response_headers)


async def _update_many_fast(request: Request, _: str) -> Response:
    await require_write_key(request)
    return await apply_update_many(request)


# With a query string (?lr=...) the request goes through FastAPI, which validates the parameter.
fast_routes = [FastRoute.of(router, "POST", "/v1/update", _update_many_fast, query=False)]
