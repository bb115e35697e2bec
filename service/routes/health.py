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


@router.get(
    "/readyz",
    summary="Readiness: 200 once the tables are mapped (a replica: caught up with the log), else 503",
)
async def readyz(request: Request) -> Response:
    store = getattr(request.app.state, "store", None)
    if store is None:
        return JSONBytesResponse({"status": "starting"}, status_code=503)
    replica = getattr(request.app.state, "replica", None)
    if replica is not None and not replica.ready():
        # Replicated: not ready until it has applied the log as it stood when the replica started.
        status = replica.status()
        tables = status.tables if status is not None else {}
        return JSONBytesResponse({"status": "catching up", "replication": tables}, status_code=503)
    return JSONBytesResponse({"status": "ready", "tables": len(store.names())})


@router.get("/metrics", summary="Prometheus metrics (text format), summed over all workers")
async def metrics(metrics: MetricsDep) -> Response:
    body, content_type = metrics.render()
    return Response(body, media_type=content_type)
