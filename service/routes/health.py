"""Liveness, readiness and the Prometheus scrape endpoint."""

from __future__ import annotations

import os
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from ..codec import JSONBytesResponse
from .deps import MetricsDep

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness; reports the answering worker's pid")
async def healthz() -> dict[str, Any]:
    return {"status": "ok", "pid": os.getpid()}


@router.get("/readyz", summary="Readiness: 200 once this worker has its tables mapped, else 503")
async def readyz(request: Request) -> Response:
    store = getattr(request.app.state, "store", None)
    if store is None:
        return JSONBytesResponse({"status": "starting"}, status_code=503)
    return JSONBytesResponse({"status": "ready", "tables": len(store.names())})


@router.get("/metrics", summary="Prometheus metrics (text format), summed over all workers")
async def metrics(metrics: MetricsDep) -> Response:
    body, content_type = metrics.render()
    return Response(body, media_type=content_type)
