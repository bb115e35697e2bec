"""The Open Inference Protocol v2 (KServe / Triton REST) beside ``/v1``: health, metadata, inference, and
Triton's model configuration, statistics and repository index extensions.

Every table is a model (see ``service/oip.py`` for its tensors). Auth, limits and the error body are
those of ``/v1`` (``{"error": ..., "error_type": ...}``, which carries the protocol's ``error``);
every successful answer carries ``Server-Timing``.
"""

from __future__ import annotations

import time
from typing import Annotated

import orjson
from fastapi import APIRouter, Path, Request
from starlette.responses import Response

from robez_core.errors import InvalidInputError, RobezError

from ..auth import PrivateAccess, ReadAccess, require_read_key
from ..codec import OCTET_STREAM, VERSION_HEADER, JSONBytesResponse, RawResponse
from ..http.fastpath import FastRoute
from ..metrics import Metrics, lookup_server_timing, server_timing, set_table_label
from ..oip import (
    HEADER_LENGTH,
    SERVER_METADATA,
    Inference,
    InferResponse,
    ModelMetadata,
    ServerMetadata,
    decode_infer,
    encode_infer,
    model_config,
    model_metadata,
    model_statistics,
    repository_index,
    served_version,
)
from ..oip import (
    infer as run_inference,
)
from ..store import LookupResult, TableStore
from .deps import INLINE_MAX_BODY_BYTES, TableNameParam, body_doc, compute, raw_headers, read_body
from .lookup import BINARY_INLINE_MAX_BODY_BYTES

router = APIRouter(prefix="/v2", tags=["inference protocol v2"])
_JSON, _OCTET_STREAM = b"application/json", OCTET_STREAM.encode()
_VERSION, _HEADER_LENGTH = VERSION_HEADER.lower().encode(), HEADER_LENGTH.lower().encode()

_BINARY_INFER = (
    f"binary tensor data extension: the JSON header ({HEADER_LENGTH}: its length in bytes), then the "
    "little-endian bytes of every input with parameters.binary_data_size, in order"
)
_BINARY_RESPONSE = {
    "content": {OCTET_STREAM: {"schema": {"type": "string", "format": "binary"}}},
    "description": f"the JSON header ({HEADER_LENGTH}), then the outputs asked for as binary_data",
}


def _timed(payload: object, start: float, status_code: int = 200) -> Response:
    headers = {"Server-Timing": server_timing(total=time.perf_counter() - start)}
    return JSONBytesResponse(payload, status_code=status_code, headers=headers)


@router.get("/health/live", summary="Liveness (protocol v2)")
async def live() -> Response:
    return _timed({"live": True}, time.perf_counter())


@router.get("/health/ready", summary="Readiness (protocol v2): 200 once the tables are mapped, else 503")
async def ready(request: Request) -> Response:
    start = time.perf_counter()
    if getattr(request.app.state, "store", None) is None:
        return _timed({"ready": False}, start, status_code=503)
    return _timed({"ready": True}, start)


@router.get("", response_model=ServerMetadata, summary="Server metadata (protocol v2)")
async def server_metadata(_: PrivateAccess) -> Response:
    return _timed(SERVER_METADATA, time.perf_counter())


VersionParam = Annotated[str, Path(description="model version: the table's current version", examples=["0"])]


def _metadata(request: Request, name: str, version: str | None) -> Response:
    start = time.perf_counter()
    store: TableStore = request.app.state.store
    served = served_version(store, name, version)
    request.state.table = name
    return _timed(model_metadata(name, store.table(name).config.embedding_dim, served), start)


# Before /models/{name}, which would take "stats" for a table's name.
@router.get("/models/stats", summary="Inference statistics of every table (Triton's statistics extension)")
async def all_stats(request: Request, _: ReadAccess) -> Response:
    return _stats(request, None, None)


@router.get("/models/{name}", response_model=ModelMetadata, summary="A table as a model: inputs, output")
async def model(name: TableNameParam, request: Request, _: ReadAccess) -> Response:
    return _metadata(request, name, None)


@router.get("/models/{name}/versions/{version}", response_model=ModelMetadata, summary="The same, if served")
async def model_version(
    name: TableNameParam, version: VersionParam, request: Request, _: ReadAccess
) -> Response:
    return _metadata(request, name, version)


def _ready(request: Request, name: str, version: str | None) -> Response:
    start = time.perf_counter()
    served_version(request.app.state.store, name, version)
    request.state.table = name
    return _timed({"name": name, "ready": True}, start)


@router.get("/models/{name}/ready", summary="Whether the table exists and is served (200) or not (404)")
async def model_ready(name: TableNameParam, request: Request, _: ReadAccess) -> Response:
    return _ready(request, name, None)


@router.get(
    "/models/{name}/versions/{version}/ready", summary="Whether it serves that version (200) or not (404)"
)
async def model_version_ready(
    name: TableNameParam, version: VersionParam, request: Request, _: ReadAccess
) -> Response:
    return _ready(request, name, version)


def _config(request: Request, name: str, version: str | None) -> Response:
    start = time.perf_counter()
    store: TableStore = request.app.state.store
    served_version(store, name, version)
    request.state.table = name
    return _timed(model_config(name, store.table(name).config.embedding_dim), start)


@router.get(
    "/models/{name}/config", summary="The table in Triton's model configuration (perf_analyzer reads it)"
)
async def config(name: TableNameParam, request: Request, _: ReadAccess) -> Response:
    return _config(request, name, None)


@router.get("/models/{name}/versions/{version}/config", summary="The same, if it serves that version")
async def version_config(
    name: TableNameParam, version: VersionParam, request: Request, _: ReadAccess
) -> Response:
    return _config(request, name, version)


def _stats(request: Request, name: str | None, version: str | None) -> Response:
    start = time.perf_counter()
    store: TableStore = request.app.state.store
    metrics: Metrics = request.app.state.metrics
    if name is None:
        versions = {entry["name"]: int(entry["version"]) for entry in repository_index(store)}
    else:
        versions = {name: served_version(store, name, version)}
        request.state.table = name
    return _timed({"model_stats": model_statistics(metrics.samples(), versions)}, start)


@router.get("/models/{name}/stats", summary="Inference statistics of a table, over every worker")
async def stats(name: TableNameParam, request: Request, _: ReadAccess) -> Response:
    return _stats(request, name, None)


@router.get("/models/{name}/versions/{version}/stats", summary="The same, if it serves that version")
async def version_stats(
    name: TableNameParam, version: VersionParam, request: Request, _: ReadAccess
) -> Response:
    return _stats(request, name, version)


@router.post("/repository/index", summary="Every table as a model (Triton's model repository extension)")
async def index(request: Request, _: ReadAccess) -> Response:
    start = time.perf_counter()
    body = await request.body()
    if body.strip():
        try:
            ready = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise InvalidInputError('the body must be JSON: {} or {"ready": true|false}') from None
        if not isinstance(ready, dict) or set(ready) - {"ready"}:
            raise InvalidInputError('the body may hold only {"ready": true|false}')
    return _timed(repository_index(request.app.state.store), start)  # every table is ready


@router.post(
    "/models/{name}/infer",
    response_model=InferResponse,
    responses={200: _BINARY_RESPONSE},
    openapi_extra=body_doc("InferRequest", _BINARY_INFER),
    summary="Rows (or pooled bags) of the input ids: the output embeddings",
)
async def infer(name: TableNameParam, request: Request, _: ReadAccess) -> Response:
    return await infer_one(request, name)


@router.post(
    "/models/{name}/versions/{version}/infer",
    response_model=InferResponse,
    responses={200: _BINARY_RESPONSE},
    openapi_extra=body_doc("InferRequest", _BINARY_INFER),
    summary="The same, if the table serves that version (404 if not)",
)
async def infer_version(
    name: TableNameParam, version: VersionParam, request: Request, _: ReadAccess
) -> Response:
    return await infer_one(request, name, version)


async def infer_one(request: Request, name: str, version: str | None = None) -> Response:
    """``POST /v2/models/{name}/infer`` once access is granted (FastAPI's endpoint and the fast path)."""
    start = time.perf_counter()
    store: TableStore = request.app.state.store
    metrics: Metrics = request.app.state.metrics
    body = await read_body(request)
    raw_length = raw_headers(request).get(_HEADER_LENGTH)
    header_length = None if raw_length is None else raw_length.decode("latin-1")

    def work() -> tuple[Inference, LookupResult]:
        return run_inference(store, metrics, name, lambda: decode_infer(body, header_length, name, version))

    # Binary tensor data decodes as /v1's binary body does (a copy): inline up to /v1's binary bound.
    inline_max = INLINE_MAX_BODY_BYTES if header_length is None else BINARY_INLINE_MAX_BODY_BYTES
    try:
        inference, result = await compute(request, work, inline=len(body) <= inline_max)
    except RobezError:
        if name in store.names():  # a failure on a table is its statistics' "fail"; other names no label
            request.state.table = name
        raise
    set_table_label(request, name)
    content, json_length = encode_infer(name, inference, result)
    total = time.perf_counter() - start
    headers = [
        (b"server-timing", lookup_server_timing(result.hash_seconds, result.lookup_seconds, total)),
        (_VERSION, b"%d" % result.version),
    ]
    if json_length is None:
        return RawResponse(content, _JSON, headers)
    headers.append((_HEADER_LENGTH, b"%d" % json_length))
    return RawResponse(content, _OCTET_STREAM, headers)


async def _infer_fast(request: Request, name: str) -> Response:
    await require_read_key(request)
    return await infer_one(request, name)


async def _live_fast(request: Request, _: str) -> Response:
    return await live()


async def _ready_fast(request: Request, _: str) -> Response:
    return await ready(request)


fast_routes = [
    FastRoute.of(router, "POST", "/v2/models/{name}/infer", _infer_fast),
    FastRoute.of(router, "GET", "/v2/health/live", _live_fast),
    FastRoute.of(router, "GET", "/v2/health/ready", _ready_fast),
]
