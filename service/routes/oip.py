"""The Open Inference Protocol v2 (KServe / Triton REST) beside ``/v1``: health, metadata, inference.

Every table is a model (see ``service/oip.py`` for its tensors). Auth, limits and the error body are
those of ``/v1`` (``{"error": ..., "error_type": ...}``, which carries the protocol's ``error``);
every successful answer carries ``Server-Timing``.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.responses import Response

from ..auth import PrivateAccess, ReadAccess, require_read_key
from ..codec import OCTET_STREAM, VERSION_HEADER, JSONBytesResponse
from ..http.fastpath import FastRoute
from ..metrics import Metrics, server_timing
from ..oip import (
    HEADER_LENGTH,
    SERVER_METADATA,
    Inference,
    InferResponse,
    ModelMetadata,
    ServerMetadata,
    decode_infer,
    encode_infer,
    model_metadata,
)
from ..oip import (
    infer as run_inference,
)
from ..store import LookupResult, TableStore
from .deps import INLINE_MAX_BODY_BYTES, TableNameParam, body_doc, compute, read_body

router = APIRouter(prefix="/v2", tags=["inference protocol v2"])

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


@router.get("/models/{name}", response_model=ModelMetadata, summary="A table as a model: inputs, output")
async def model(name: TableNameParam, request: Request, _: ReadAccess) -> Response:
    start = time.perf_counter()
    store: TableStore = request.app.state.store
    config = store.table(name).config
    request.state.table = name
    return _timed(model_metadata(name, config.embedding_dim), start)


@router.get("/models/{name}/ready", summary="Whether the table exists and is served (200) or not (404)")
async def model_ready(name: TableNameParam, request: Request, _: ReadAccess) -> Response:
    start = time.perf_counter()
    store: TableStore = request.app.state.store
    store.table(name)
    request.state.table = name
    return _timed({"name": name, "ready": True}, start)


@router.post(
    "/models/{name}/infer",
    response_model=InferResponse,
    responses={200: _BINARY_RESPONSE},
    openapi_extra=body_doc("InferRequest", _BINARY_INFER),
    summary="Rows (or pooled bags) of the input ids: the output embeddings",
)
async def infer(name: TableNameParam, request: Request, _: ReadAccess) -> Response:
    return await infer_one(request, name)


async def infer_one(request: Request, name: str) -> Response:
    """``POST /v2/models/{name}/infer`` once access is granted (FastAPI's endpoint and the fast path)."""
    start = time.perf_counter()
    store: TableStore = request.app.state.store
    metrics: Metrics = request.app.state.metrics
    body = await read_body(request)
    header_length = request.headers.get(HEADER_LENGTH)

    def work() -> tuple[Inference, LookupResult]:
        return run_inference(store, metrics, name, lambda: decode_infer(body, header_length))

    inference, result = await compute(request, work, inline=len(body) <= INLINE_MAX_BODY_BYTES)
    request.state.table = name
    content, json_length = encode_infer(name, inference, result)
    total = time.perf_counter() - start
    headers = {
        "Server-Timing": server_timing(hash=result.hash_seconds, lookup=result.lookup_seconds, total=total),
        VERSION_HEADER: str(result.version),
    }
    if json_length is None:
        return Response(content, media_type="application/json", headers=headers)
    headers[HEADER_LENGTH] = str(json_length)
    return Response(content, media_type=OCTET_STREAM, headers=headers)


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
