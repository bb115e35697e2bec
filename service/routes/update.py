"""Gradient pushes for online training (JSON or binary)."""

from __future__ import annotations

import time
from typing import Annotated

import anyio
from fastapi import APIRouter, Query, Request
from starlette.responses import Response
from torch import Tensor

from ..auth import WriteAccess
from ..codec import (
    SHAPE_HEADER,
    VERSION_HEADER,
    JSONBytesResponse,
    UpdateResponse,
    decode_update_binary,
    decode_update_json,
    update_json,
)
from ..metrics import server_timing
from ..store import UpdateResult
from .deps import MetricsDep, StoreDep, TableNameParam, body_doc, compute, is_binary

router = APIRouter(prefix="/v1", tags=["update"])

# Replicated mode: a retry with the same key (to any replica, within ROBEZ_NATS_DEDUP_WINDOW_S) is applied
# once and answered with the first attempt's version (docs/replication.md).
IDEMPOTENCY_HEADER = "Idempotency-Key"
REPLICA_HEADER = "X-Robez-Replica"

_BINARY_UPDATE = (
    f"{SHAPE_HEADER}: n,d; body = n little-endian int64 ids then n*d little-endian float32 gradients"
)


@router.post(
    "/tables/{name}/update",
    response_model=UpdateResponse,
    openapi_extra=body_doc("UpdateRequest", _BINARY_UPDATE),
    summary="Apply the table's optimizer to the gradients of looked-up rows",
)
async def update(
    name: TableNameParam,
    request: Request,
    store: StoreDep,
    metrics: MetricsDep,
    _: WriteAccess,
    lr: Annotated[float | None, Query(gt=0, description="overrides the table's lr for this update")] = None,
) -> Response:
    start = time.perf_counter()
    body = await request.body()
    binary = is_binary(request)
    shape_header = request.headers.get(SHAPE_HEADER)

    def decode() -> tuple[Tensor, Tensor, float | None]:
        if binary:
            ids, grads = decode_update_binary(body, shape_header)
            return ids, grads, lr
        ids, grads, body_lr = decode_update_json(body, store.table(name).config.embedding_dim)
        return ids, grads, lr if lr is not None else body_lr

    replica = request.app.state.replica
    if replica is not None:
        # Replicated: validate, append to the log, answer once this replica applied it.
        def validate() -> tuple[Tensor, Tensor, float]:
            ids, grads, wanted_lr = decode()
            return ids, grads, store.validate_update(name, ids, grads, wanted_lr)

        ids, grads, applied_lr = await compute(request, validate)
        key = request.headers.get(IDEMPOTENCY_HEADER)
        logged = await replica.update(name, ids, grads, applied_lr, key)
        # The applier hashes and applies (and records those times); here: the log's ack, then the wait.
        result = UpdateResult(logged.version, 0.0, logged.apply_wait_seconds)
        stages = {"publish": logged.publish_seconds, "apply_wait": logged.apply_wait_seconds}
    else:

        def work() -> tuple[UpdateResult, int]:
            return store.apply_update(name, *decode())

        result, ticket = await compute(request, work)
        # Wait for the flush outside the compute slots, so concurrent updates share one group commit.
        await anyio.to_thread.run_sync(store.journal.wait_durable, ticket)
        metrics.hash_seconds.labels(name).observe(result.hash_seconds)
        metrics.update_apply_seconds.labels(name).observe(result.apply_seconds)
        stages = {"hash": result.hash_seconds, "apply": result.apply_seconds}
    request.state.table = name
    total = time.perf_counter() - start
    headers = {
        "Server-Timing": server_timing(**stages, total=total),
        VERSION_HEADER: str(result.version),
    }
    if replica is not None:  # tells clients that a resent Idempotency-Key is applied once here
        headers[REPLICA_HEADER] = replica.name
    return JSONBytesResponse(update_json(name, result, total), headers=headers)
