"""Liveness, readiness and the Prometheus scrape endpoint."""

from __future__ import annotations

import os
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from ..codec import JSONBytesResponse
from ..fastpath import FastRoute
from .deps import MetricsDep

router = APIRouter(tags=["health"])


def _liveness() -> dict[str, Any]:
    return {"status": "ok", "pid": os.getpid()}


@router.get("/healthz", summary="Liveness; reports the answering worker's pid")
async def healthz() -> dict[str, Any]:
    return _liveness()


class _LivenessBody:
    """``/healthz``'s body, rendered once per worker process (the pid is all that varies)."""

    def __init__(self) -> None:
        self._pid = -1
        self._body = b""

    def get(self) -> bytes:
        if self._pid != os.getpid():
            self._body = orjson.dumps(_liveness())
            self._pid = os.getpid()
        return self._body


_liveness_body = _LivenessBody()


async def _healthz_fast(request: Request, _: str) -> Response:
    # FastAPI renders the dict above as compact JSON: the same bytes and headers.
    return Response(_liveness_body.get(), media_type="application/json")


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


fast_routes = [FastRoute.of(router, "GET", "/healthz", _healthz_fast)]
