"""The FastAPI application: ``create_app(settings)``; ``create_app_from_env`` is uvicorn's factory.

Start-up (lifespan): set this worker's kernel threads, open the journal, attach to the shared tables
prepared by ``robez serve`` (the directory it names in ``WORKER_SHM_VARIABLE``, not a setting) or, in a
single in-process app (tests, embedding), prepare them here and remove them on shutdown.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import torch
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from robez_core import buffers
from robez_core.allocator import keep_freed_buffers

from . import codec, tracing, uploads
from . import oip as oip_codec
from .auth import PrivateAccess
from .config import Settings
from .errors import install_error_handlers
from .faults import NO_FAULTS, Faults
from .http.admission import Admission
from .http.direct import LIFESPAN_DIRECT_KEY, DirectAnswers
from .http.fastpath import FastPathMiddleware, FastRoutes
from .http.middleware import InFlightLimitMiddleware, RequestBodyMiddleware, RequestMetricsMiddleware
from .http.protocol import LIFESPAN_ADMISSION_KEY, LIFESPAN_METRICS_KEY
from .log.journal import Journal, NullJournal
from .logfilters import drop_tls_eof_notice, limit_client_input_logs
from .metrics import Metrics
from .replication.replica import Replica, local_settings
from .replication.writes import ReplicatedWrites
from .routes import checksum, durability, health, lookup, oip, tables, update, update_many
from .shm import SharedDirectory
from .store import TableStore
from .store.writes import LocalWrites
from .wal import WalJournal
from .warmup import freeze_startup_objects, thaw, warm_kernels

logger = logging.getLogger("robez.app")

API_VERSION = "1"
# Bodies read by hand (JSON or binary) are described by these models in the OpenAPI schema.
_HAND_READ_MODELS: tuple[type[Any], ...] = (
    codec.CreateTableRequest,
    codec.LookupRequest,
    codec.MultiLookupRequest,
    codec.UpdateRequest,
    oip_codec.InferRequest,
)


def open_journal(settings: Settings, faults: Faults = NO_FAULTS) -> Journal:
    """``WalJournal`` when a data directory is set, else the in-memory ``NullJournal``."""
    if settings.data_dir is None:
        return NullJournal()
    journal: Journal = WalJournal.from_settings(settings, faults)
    return journal


# Requests computing at once in one worker (each with the worker's kernel threads): two, so a lookup never
# waits behind one long push, and no more, so N requests never share the cores N ways.
COMPUTE_SLOTS = 2
# ``robez serve`` hands each worker the shared directory it prepared in this variable (an internal value
# between the CLI and its workers, not a setting).
WORKER_SHM_VARIABLE = "ROBEZ_WORKER_SHM_PATH"


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
    settings: Settings = app.state.settings
    shm_path: Path | None = app.state.shm_path
    faults: Faults = app.state.faults
    torch.set_num_threads(settings.kernel_threads())
    keep_freed_buffers(settings.malloc_mmap_threshold_mb)
    # robez_core.buffers keeps large kernel outputs for reuse (a training process's 13 MB batches); a
    # worker's freed outputs are reused through the fixed malloc thresholds already, so a pool would only
    # keep more memory resident: off in a worker.
    buffers.set_max_bytes(0)
    tracing.configure(settings)  # this worker's tracer, when OTEL_* ask for one
    limit_client_input_logs()  # lines a client's input causes: rate-limited, client text cut short
    drop_tls_eof_notice()  # asyncio's, at every close of a TLS NATS connection
    replicated = settings.nats_url is not None
    # A replica's journal is the replicated log (service/replication/), not a local one.
    journal = NullJournal() if replicated else open_journal(settings, faults)
    owned: SharedDirectory | None = None
    try:
        directory = SharedDirectory(shm_path) if shm_path is not None else None
        if directory is None:
            local = local_settings(settings) if replicated else settings
            directory = owned = await anyio.to_thread.run_sync(TableStore.prepare, local, journal, faults)
        store = TableStore(directory, settings, journal, faults)
        await anyio.to_thread.run_sync(store.warm_up)
        # every kernel path, before /readyz says ready
        await anyio.to_thread.run_sync(warm_kernels, store, app.state.metrics)
        app.state.compute_limiter = anyio.CapacityLimiter(COMPUTE_SLOTS)
        app.state.store = store
        app.state.writes = LocalWrites(store)
        app.state.metrics.live_tables = lambda: store.registry.entries  # dropped tables' series go
        if replicated:
            app.state.replica = Replica(store, settings, app.state.metrics)
            app.state.writes = ReplicatedWrites(store, app.state.replica)
            await app.state.replica.start()
        grpc_server: Any = None  # a grpc.aio.Server or a FramesServer when --grpc-port is set
        logger.info("serving tables %s with %d kernel threads", store.names(), settings.kernel_threads())
        try:
            if settings.grpc_port is not None:
                if settings.grpc_engine == "frames":
                    from .grpc.engine import start_frames  # grpc is imported only when it is served

                    grpc_server, app.state.grpc_port = await start_frames(app, settings)
                    app.state.grpc_frames = grpc_server  # its connections, for tests and diagnostics
                else:
                    from .grpc.server import start_grpc

                    grpc_server, app.state.grpc_port = await start_grpc(app, settings)
            # uvicorn hands the lifespan state to each connection (service/http/protocol.py counts there and
            # answers hot routes directly).
            state: dict[str, Any] = {
                LIFESPAN_METRICS_KEY: app.state.metrics,
                LIFESPAN_ADMISSION_KEY: app.state.admission,
            }
            if settings.direct_answers:
                state[LIFESPAN_DIRECT_KEY] = app.state.direct
            freeze_startup_objects()
            yield state
        finally:
            thaw()
            if grpc_server is not None:
                from .grpc.server import stop_grpc

                await stop_grpc(grpc_server, settings.shutdown_grace_s)
            if app.state.replica is not None:
                await app.state.replica.stop()
                app.state.replica = None
            del app.state.store, app.state.writes
            store.close()
    finally:
        journal.close()
        if owned is not None:
            owned.remove()
        tracing.shutdown()
        if owned is None:
            # A worker of ``robez serve`` (the CLI owns its tables) exits next. The interpreter's last
            # collections would walk every object torch, numba and the app made, seconds of CPU on a busy
            # host per stop; nothing of them needs the cycle collector any more.
            gc.freeze()


def _openapi(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in _HAND_READ_MODELS:
            model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            for name, definition in model_schema.pop("$defs", {}).items():
                components.setdefault(name, definition)
            components[model.__name__] = model_schema
        app.openapi_schema = schema
    return app.openapi_schema


def create_app(
    settings: Settings | None = None, *, shm_path: Path | None = None, faults: Faults = NO_FAULTS
) -> FastAPI:
    """The robez HTTP API over ``settings`` (default: read from ``ROBEZ_*``). Tables are attached (or
    prepared) when the app starts, i.e. inside ``with TestClient(app)`` or under uvicorn: attached to the
    shared directory ``shm_path`` when given (a worker of ``robez serve``), else prepared here.
    ``faults``: testing only, the fault hooks handed to the store and the journal (service/faults.py)."""
    settings = settings if settings is not None else Settings()
    # Private: FastAPI's own docs routes (which take no dependency) are replaced by guarded ones below.
    docs = {"docs_url": None, "redoc_url": None, "openapi_url": None} if settings.private_endpoints else {}
    app = FastAPI(
        title="robez",
        version=API_VERSION,
        description="ROBE-Z compressed embedding tables: batched lookups and gradient-push training.",
        lifespan=_lifespan,
        # robez reports its own Prometheus metrics and configures no OpenTelemetry provider; FastAPI's
        # native telemetry would still look for one on every request (~5 us).
        telemetry={"tracing": False, "metrics": False, "logs": False},
        **docs,  # type: ignore[arg-type]
    )
    app.state.settings = settings
    app.state.shm_path = shm_path
    app.state.faults = faults
    # Set at start-up: the write path routes call (LocalWrites, or ReplicatedWrites with --nats) and,
    # in replicated mode, this worker's Replica (its life cycle; routes go through the write path).
    app.state.replica = None
    metrics_dir = shm_path / "metrics" if shm_path is not None and settings.workers > 1 else None
    metrics = Metrics(metrics_dir, settings.max_metric_tables)
    app.state.metrics = metrics
    install_error_handlers(app)
    for module in (health, tables, lookup, update, update_many, durability, checksum, oip):
        app.include_router(module.router)
    # Added innermost first: metrics see every answer, including the 503s, 413s and 408s below them; a
    # request takes an in-flight slot only once its whole body has arrived; the fast path (the hot routes
    # without FastAPI's per-request machinery) sits under all of them.
    fast_routes = FastRoutes(
        [
            *health.fast_routes,
            *lookup.fast_routes,
            *update.fast_routes,
            *update_many.fast_routes,
            *oip.fast_routes,
        ]
    )
    # One admission (limits, in-flight, body bytes, metrics) for the stack and the direct answers.
    admission = Admission.from_settings(settings, metrics)
    app.state.admission = admission
    app.add_middleware(FastPathMiddleware, routes=fast_routes)
    app.add_middleware(InFlightLimitMiddleware, admission=admission)
    app.add_middleware(
        RequestBodyMiddleware,
        admission=admission,
        spools=uploads.spools,
        spool_key=uploads.SPOOLED_BODY_KEY,
        spool_dir=settings.data_dir,  # uploads on the data's disk, not a small /tmp
    )
    app.add_middleware(RequestMetricsMiddleware, admission=admission)
    # The same hot routes and admission for the requests connections answer themselves.
    app.state.direct = DirectAnswers(app, fast_routes, admission)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    if settings.private_endpoints:
        _add_private_docs(app)
    return app


def _add_private_docs(app: FastAPI) -> None:
    """``/openapi.json`` and ``/docs`` behind the read key (``private_endpoints``)."""
    from fastapi.openapi.docs import get_swagger_ui_html
    from fastapi.responses import HTMLResponse, JSONResponse

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(_: PrivateAccess) -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs(_: PrivateAccess) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="robez")


def create_app_from_env() -> FastAPI:
    """uvicorn factory (``service.app:create_app_from_env``), a composition root: settings from
    ``ROBEZ_*``, the shared directory ``robez serve`` prepared from ``WORKER_SHM_VARIABLE``, the test
    hooks from ``ROBEZ_FAULT_*``."""
    shm_path = os.environ.get(WORKER_SHM_VARIABLE)
    return create_app(
        Settings(), shm_path=Path(shm_path) if shm_path else None, faults=Faults.from_environment()
    )
