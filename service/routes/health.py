"""Liveness, readiness and the Prometheus scrape endpoint."""

from __future__ import annotations

import os
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from ..auth import PrivateAccess
from ..codec import JSONBytesResponse, RawResponse
from ..http.fastpath import FastRoute
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
    return RawResponse(_liveness_body.get(), b"application/json", [])


@router.get(
    "/readyz",
    summary="Readiness: 200 once this worker has its tables mapped (a replica: caught up with the log), "
    "else 503; with writes=true also 503 "
    "while the data directory is full, or (a replica) while it cannot get a write acknowledged by the "
    "replicated log (lookups are still served)",
)
async def readyz(
    request: Request,
    writes: Annotated[
        bool,
        Query(
            description="check writes too: 503 while updates are refused for lack of disk space, or while "
            "a replica's last write check was not acknowledged by the log (no connection, no quorum, its "
            "NATS server hung)"
        ),
    ] = False,
) -> Response:
    store = getattr(request.app.state, "store", None)
    if store is None:
        return JSONBytesResponse({"status": "starting"}, status_code=503)
    readiness = request.app.state.writes.readiness()
    if readiness.catching_up is not None:
        return JSONBytesResponse(
            {"status": "catching up", "replication": readiness.catching_up}, status_code=503
        )
    body: dict[str, Any] = {
        "status": "ready",
        "tables": len(store.names()),
        "writable": True,
        **readiness.extra,
    }
    problem = readiness.write_problem
    if problem is not None:
        body.update(writable=False, write_problem=problem)
        if writes:
            return JSONBytesResponse({**body, "status": "read-only"}, status_code=503)
    return JSONBytesResponse(body)


@router.get("/metrics", summary="Prometheus metrics (text format), summed over all workers")
async def metrics(request: Request, metrics: MetricsDep, _: PrivateAccess) -> Response:
    store = getattr(request.app.state, "store", None)  # None while the worker starts
    body, content_type = metrics.render(store.names() if store is not None else None)
    return Response(body, media_type=content_type)


fast_routes = [FastRoute.of(router, "GET", "/healthz", _healthz_fast)]
