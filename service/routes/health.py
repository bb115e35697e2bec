"""Liveness, readiness and the Prometheus scrape endpoint."""

from __future__ import annotations

import os
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from ..codec import JSONBytesResponse
from .deps import MetricsDep

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness; reports the answering worker's pid")
async def healthz() -> dict[str, Any]:
    return {"status": "ok", "pid": os.getpid()}


@router.get(
    "/readyz",
    summary="Readiness: 200 once this worker has its tables mapped, else 503; with writes=true also 503 "
    "while the data directory is full (lookups are still served)",
)
async def readyz(
    request: Request,
    writes: Annotated[
        bool, Query(description="check writes too: 503 while updates are refused for lack of disk space")
    ] = False,
) -> Response:
    store = getattr(request.app.state, "store", None)
    if store is None:
        return JSONBytesResponse({"status": "starting"}, status_code=503)
    body: dict[str, Any] = {"status": "ready", "tables": len(store.names()), "writable": True}
    problem = store.journal.write_problem()
    if problem is not None:
        body.update(writable=False, write_problem=problem)
        if writes:
            return JSONBytesResponse({**body, "status": "read-only"}, status_code=503)
    return JSONBytesResponse(body)


@router.get("/metrics", summary="Prometheus metrics (text format), summed over all workers")
async def metrics(metrics: MetricsDep) -> Response:
    body, content_type = metrics.render()
    return Response(body, media_type=content_type)
