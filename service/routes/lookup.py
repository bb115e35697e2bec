"""Lookups: one table (JSON or binary) and several tables in one request (JSON or binary)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.responses import Response

from ..auth import ReadAccess, require_read_key
from ..codec import (
    OCTET_STREAM,
    SHAPE_HEADER,
    SHAPES_HEADER,
    TABLES_HEADER,
    VERSION_HEADER,
    LookupResponse,
    MultiLookupResponse,
    RawResponse,
    decode_ids,
    decode_lookup_json,
    decode_multi_lookup_json,
    json_bytes,
    lookup_json,
    lookup_timing,
    multi_rows_binary,
    parse_tables_header,
    rows_view,
    split_ids,
)
from ..consistency import MIN_VERSION_HEADER, parse_min_versions, wait_min_versions
from ..http.fastpath import FastRoute
from ..metrics import Metrics, lookup_server_timing, set_table_label
from ..store import LookupRequestItem, LookupResult, TableStore
from .deps import (
    INLINE_MAX_BODY_BYTES,
    TableNameParam,
    body_doc,
    compute,
    is_binary,
    raw_headers,
    read_body,
    wants_binary,
)

router = APIRouter(prefix="/v1", tags=["lookup"])

_BINARY_LOOKUP = "n little-endian int64 ids; the response is n*d little-endian float32, X-Robez-Shape: n,d"
_BINARY_MULTI = (
    "the ids of every table named in X-Robez-Tables (name=n,...), in that order, little-endian int64; the "
    "response is each table's rows in that order, X-Robez-Shapes: n,d;n,d;..."
)
# Binary one-table lookups up to this many bytes of ids (8192 ids) run on the event loop too: decoding
# is a copy, and their hash + gather (~0.1 ms for 4096 ids) is cheaper than the hop to a worker thread
# and back, which the profile of 4096-id lookups showed as the largest cost after the socket write.
BINARY_INLINE_MAX_BODY_BYTES = 64 * 1024
_OCTET_STREAM = OCTET_STREAM.encode()
_JSON = b"application/json"
_MIN_VERSION = MIN_VERSION_HEADER.lower().encode()
_SHAPE = SHAPE_HEADER.lower().encode()
_SHAPES = SHAPES_HEADER.lower().encode()
_VERSION = VERSION_HEADER.lower().encode()
_BINARY_RESPONSE = {"content": {OCTET_STREAM: {"schema": {"type": "string", "format": "binary"}}}}


def observe_lookup(metrics: Metrics, table: str, result: LookupResult) -> None:
    """A lookup's stages in its table's histograms (``/v1/lookup`` and a push's lookup part)."""
    stages = metrics.stages(table)
    stages.hash_seconds.observe(result.hash_seconds)
    stages.lookup_seconds.observe(result.lookup_seconds)


@router.post(
    "/tables/{name}/lookup",
    response_model=LookupResponse,
    responses={200: _BINARY_RESPONSE},
    openapi_extra=body_doc("LookupRequest", _BINARY_LOOKUP),
    summary="Rows (or pooled bags) of ids from one table",
)
async def lookup(name: TableNameParam, request: Request, _: ReadAccess) -> Response:
    return await lookup_one(request, name)


async def lookup_one(request: Request, name: str) -> Response:
    """``POST /v1/tables/{name}/lookup`` once access is granted (FastAPI's endpoint and the fast path)."""
    start = time.perf_counter()
    state = request.app.state
    store: TableStore = state.store
    headers = raw_headers(request)
    min_version = headers.get(_MIN_VERSION)
    if min_version is not None:
        await wait_min_versions(request, store, parse_min_versions(min_version.decode("latin-1"), name))
    body = await read_body(request)
    if is_binary(request, headers):
        inline = len(body) <= BINARY_INLINE_MAX_BODY_BYTES
        result = await compute(request, lambda: store.lookup(name, decode_ids(body)), inline=inline)
    else:

        def work() -> LookupResult:
            parsed = decode_lookup_json(body)
            return store.lookup(name, *parsed.inputs())

        result = await compute(request, work, inline=len(body) <= INLINE_MAX_BODY_BYTES)
    set_table_label(request, name)
    observe_lookup(state.metrics, name, result)
    total = time.perf_counter() - start
    response_headers = [
        (b"server-timing", lookup_server_timing(result.hash_seconds, result.lookup_seconds, total)),
        (_VERSION, b"%d" % result.version),
    ]
    if wants_binary(request, headers):
        rows = result.rows
        response_headers.append((_SHAPE, b"%d,%d" % (rows.shape[0], rows.shape[1])))
        return RawResponse(rows_view(rows), _OCTET_STREAM, response_headers)
    return RawResponse(json_bytes(lookup_json(name, result, total)), _JSON, response_headers)


@router.post(
    "/lookup",
    response_model=MultiLookupResponse,
    responses={200: _BINARY_RESPONSE},
    openapi_extra=body_doc("MultiLookupRequest", _BINARY_MULTI),
    summary="Rows from several tables in one request",
)
async def lookup_many(request: Request, _: ReadAccess) -> Response:
    return await lookup_several(request)


async def lookup_several(request: Request, _: str = "") -> Response:
    """``POST /v1/lookup`` once access is granted (FastAPI's endpoint and the fast path)."""
    start = time.perf_counter()
    store: TableStore = request.app.state.store
    metrics: Metrics = request.app.state.metrics
    await wait_min_versions(request, store, parse_min_versions(request.headers.get(MIN_VERSION_HEADER)))
    body = await read_body(request)
    small = len(body) <= INLINE_MAX_BODY_BYTES
    if is_binary(request):
        tables = parse_tables_header(request.headers.get(TABLES_HEADER))

        def work() -> list[LookupResult]:
            ids = split_ids(body, [count for _, count in tables])
            return store.lookup_many(
                [LookupRequestItem(name, t) for (name, _), t in zip(tables, ids, strict=True)]
            )

        names = [name for name, _ in tables]
    else:
        parsed = await compute(request, lambda: decode_multi_lookup_json(body), inline=small)
        names = [item.table for item in parsed.lookups]

        def work() -> list[LookupResult]:
            return store.lookup_many(
                [LookupRequestItem(item.table, *item.inputs()) for item in parsed.lookups]
            )

    results = await compute(request, work, inline=small)
    for name, result in zip(names, results, strict=True):
        observe_lookup(metrics, name, result)
    total = time.perf_counter() - start
    hash_seconds = sum(result.hash_seconds for result in results)
    lookup_seconds = sum(result.lookup_seconds for result in results)
    response_headers = [
        (b"server-timing", lookup_server_timing(hash_seconds, lookup_seconds, total)),
    ]
    if wants_binary(request):
        shapes, rows = multi_rows_binary([r.rows for r in results])
        versions = ",".join(str(result.version) for result in results)
        response_headers.append((_SHAPES, shapes.encode("latin-1")))
        response_headers.append((_VERSION, versions.encode("latin-1")))
        return RawResponse(rows, _OCTET_STREAM, response_headers)
    payload = {
        "results": [
            lookup_json(name, result, result.hash_seconds + result.lookup_seconds)
            for name, result in zip(names, results, strict=True)
        ],
        "timing": lookup_timing(hash_seconds, lookup_seconds, total),
    }
    return RawResponse(json_bytes(payload), _JSON, response_headers)


async def _lookup_fast(request: Request, name: str) -> Response:
    await require_read_key(request)
    return await lookup_one(request, name)


async def _lookup_many_fast(request: Request, _: str) -> Response:
    await require_read_key(request)
    return await lookup_several(request)


fast_routes = [
    FastRoute.of(router, "POST", "/v1/tables/{name}/lookup", _lookup_fast),
    FastRoute.of(router, "POST", "/v1/lookup", _lookup_many_fast),
]
