"""Dependencies shared by the route modules: the store, the metrics, running work off the event loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import anyio.to_thread
from fastapi import Depends, Path, Request
from starlette.requests import ClientDisconnect

from ..codec import OCTET_STREAM
from ..metrics import Metrics
from ..store import TableStore

T = TypeVar("T")


async def get_store(request: Request) -> TableStore:
    store: TableStore = request.app.state.store
    return store


async def get_metrics(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


StoreDep = Annotated[TableStore, Depends(get_store)]
# A table name in the path; invalid names are simply not found (404), nothing touches the filesystem.
TableNameParam = Annotated[str, Path(description="table name", examples=["demo"])]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]


# Lookups with bodies up to this size run on the event loop: their kernel time (a few microseconds for a
# few hundred ids) is far below the cost of a hop to a worker thread and back (~0.1-0.3 ms of CPU).
INLINE_MAX_BODY_BYTES = 16 * 1024


async def compute(request: Request, work: Callable[[], T], *, inline: bool = False) -> T:
    """Run decoding + kernels in a worker thread, at most ``COMPUTE_SLOTS`` (service/app.py) at once per
    worker, so the event loop keeps accepting (and, when saturated, refusing) requests meanwhile.
    ``inline=True`` runs ``work`` on the event loop instead: only for small, lock-free work (see
    ``INLINE_MAX_BODY_BYTES``)."""
    if inline:
        return work()
    result: T = await anyio.to_thread.run_sync(work, limiter=request.app.state.compute_limiter)
    return result


async def read_body(request: Request) -> bytes:
    """The whole request body: the one place the data routes (lookups, updates, inference) read one,
    on the fast path and through FastAPI alike. Raises ``ClientDisconnect`` if the client goes away."""
    chunks: list[bytes] = []
    receive = request.receive
    while True:
        message = await receive()
        if message["type"] == "http.request":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        elif message["type"] == "http.disconnect":
            raise ClientDisconnect()
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


_OCTET_STREAM_BYTES = OCTET_STREAM.encode()


def _media_type(value: bytes | None) -> bytes:
    return value.split(b";", 1)[0].strip().lower() if value else b""


def raw_headers(request: Request) -> dict[bytes, bytes]:
    """The request's headers by lower-case name as the ASGI server gave them (the hot routes read a few
    of them; Starlette's ``request.headers`` scans the whole list for each one). A repeated header gives
    its first value, as ``request.headers.get`` does (and the body limits read)."""
    return dict(reversed(request.scope["headers"]))


def is_binary(request: Request, headers: dict[bytes, bytes] | None = None) -> bool:
    """The body is ``application/octet-stream`` (``headers``: ``raw_headers(request)`` if already read)."""
    headers = raw_headers(request) if headers is None else headers
    return _media_type(headers.get(b"content-type")) == _OCTET_STREAM_BYTES


def wants_binary(request: Request, headers: dict[bytes, bytes] | None = None) -> bool:
    """Binary response when the request was binary or ``Accept`` asks only for octet-stream."""
    headers = raw_headers(request) if headers is None else headers
    return is_binary(request, headers) or _media_type(headers.get(b"accept")) == _OCTET_STREAM_BYTES


def body_doc(json_schema_ref: str, binary_description: str | None = None) -> dict[str, Any]:
    """OpenAPI for a body read by hand: the JSON model by reference, and raw octets if described."""
    content: dict[str, Any] = {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{json_schema_ref}"}}
    }
    if binary_description is not None:
        content[OCTET_STREAM] = {
            "schema": {"type": "string", "format": "binary"},
            "description": binary_description,
        }
    return {"requestBody": {"required": True, "content": content}}
