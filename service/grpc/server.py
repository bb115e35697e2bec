"""gRPC ``inference.GRPCInferenceService`` (KServe's Open Inference Protocol v2, as Triton serves it).

Every worker runs a ``grpc.aio`` server on its own event loop beside uvicorn's, bound to
``host:grpc_port`` with ``SO_REUSEPORT`` (the kernel spreads connections over the workers, as it does
nothing for HTTP, where the workers share one listening socket). The messages are Triton's
(``tritonclient.grpc.service_pb2``): its service is KServe's ``grpc_predict_v2.proto`` (package
``inference``, same names, same fields) plus methods robez does not serve (UNIMPLEMENTED), so reusing its
generated code keeps one copy of those descriptors in a process that also holds the official client.

A call goes through what an HTTP request goes through, transport aside:

- the admission (``service/http/admission.py``: ``refusal``, ``admit``, ``release``): the message's size
  against ``max_body_bytes``, the worker's ``max_in_flight`` and ``max_body_bytes_held``;
- the read key (``auth.check_read_access``) from the metadata ``authorization: Bearer <key>``, for model
  metadata, readiness and inference (as ``/v2/models/...``);
- the inference (``oip.inference_from`` and ``oip.infer``: the REST route's checks and lookup);
- errors: the HTTP status of the one error table (``errors.py``), sent as the gRPC code mapped from it
  (``GRPC_CODE_BY_STATUS``) with the same message;
- metrics: ``robez_requests`` / ``robez_request_duration_seconds`` with endpoint the gRPC method's path
  (``/inference.GRPCInferenceService/ModelInfer``), method ``GRPC``, the table and the HTTP status the
  answer corresponds to (200, 404, 422, ...), so one query covers both transports.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio.to_thread
import grpc
from fastapi import FastAPI
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

from robez_core.errors import BusyError, InvalidInputError, RobezError

from .. import tracing
from ..auth import check_read_access
from ..config import Settings
from ..errors import grpc_code_for, status_for
from ..oip import (
    EMBEDDINGS,
    PLATFORM,
    SERVER_METADATA,
    Inference,
    TensorInput,
    infer,
    inference_from,
    model_metadata,
)
from ..routes.deps import INLINE_MAX_BODY_BYTES
from ..store import LookupResult, TableStore
from ..tls import server_credentials

logger = logging.getLogger("robez.grpc")

SERVICE = "inference.GRPCInferenceService"
# Headroom over max_body_bytes before gRPC itself refuses a message (RESOURCE_EXHAUSTED, in its own
# words): up to it, robez refuses it naming the limit, as HTTP's 413 does.
_RECEIVE_HEADROOM_BYTES = 1 << 20
_MAX_MESSAGE_BYTES = (1 << 31) - 1
_CONTENTS_FIELD = {"INT64": "int64_contents", "FP32": "fp32_contents"}
_GRACE_S = 5.0

# A method's handler: the request message's bytes -> (the response message, the table label).
_Handler = Callable[[bytes, grpc.aio.ServicerContext], Awaitable[tuple[Any, str]]]


def _parameters(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """A protobuf ``map<string, InferParameter>`` as plain values (bool, int, str, float)."""
    values: dict[str, Any] = {}
    for key, parameter in parameters.items():
        which = parameter.WhichOneof("parameter_choice")
        values[key] = None if which is None else getattr(parameter, which)
    return values


def _tensors(request: Any) -> list[TensorInput]:
    """The request's inputs: raw (``raw_input_contents``, one per input, in order) or typed contents."""
    raw: Sequence[bytes] = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidInputError(
            f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs: give every input "
            "raw, or none"
        )
    tensors = []
    for position, tensor in enumerate(request.inputs):
        if tensor.parameters:
            raise InvalidInputError(f"input {tensor.name!r}: unknown parameters {sorted(tensor.parameters)}")
        given = [field.name for field, _ in tensor.contents.ListFields()]
        if raw:
            if given:
                raise InvalidInputError(f"input {tensor.name!r} has both contents and raw_input_contents")
            tensors.append(TensorInput(tensor.name, tensor.datatype, list(tensor.shape), raw=raw[position]))
            continue
        field = _CONTENTS_FIELD.get(tensor.datatype)
        if given and given != [field]:
            raise InvalidInputError(
                f"input {tensor.name!r} ({tensor.datatype}) carries its values in {field}, got {given}"
            )
        data = list(getattr(tensor.contents, field)) if field is not None else []
        tensors.append(TensorInput(tensor.name, tensor.datatype, list(tensor.shape), data=data))
    return tensors


def decode_request(request: Any) -> Inference:
    """A ``ModelInferRequest`` as an ``Inference``: the REST request's checks (``oip.inference_from``).
    The answer is raw (``raw_output_contents``) when the inputs were, unless a parameter says otherwise."""
    if request.model_version:
        raise InvalidInputError(
            f"model_version {request.model_version!r}: a table has one version served; leave it empty"
        )
    outputs = [(output.name, _parameters(output.parameters)) for output in request.outputs]
    return inference_from(
        _tensors(request),
        _parameters(request.parameters),
        outputs,
        request.id or None,
        binary_by_default=bool(request.raw_input_contents),
    )


def encode_response(name: str, request_id: str | None, inference: Inference, result: LookupResult) -> Any:
    """The ``ModelInferResponse`` of an inference: the rows as raw bytes or as ``fp32_contents``."""
    rows = result.rows
    response = pb.ModelInferResponse(model_name=name, model_version=str(result.version), id=request_id or "")
    output = response.outputs.add(name=EMBEDDINGS, datatype="FP32", shape=[int(n) for n in rows.shape])
    if inference.binary_output:
        response.raw_output_contents.append(rows.astype("<f4", copy=False).tobytes())
    else:
        output.contents.fp32_contents.extend(rows.reshape(-1).tolist())
    return response


class InferenceServicer:
    """The served methods of ``GRPCInferenceService`` over the app's store, admission and settings."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.settings: Settings = app.state.settings

    def handler(self) -> grpc.GenericRpcHandler:
        """The generic handler of every served method (messages are parsed here, so their size is known
        before parsing, as a body's is)."""
        methods: dict[str, _Handler] = {
            "ServerLive": self._server_live,
            "ServerReady": self._server_ready,
            "ServerMetadata": self._server_metadata,
            "ModelReady": self._model_ready,
            "ModelMetadata": self._model_metadata,
            "ModelInfer": self._model_infer,
        }
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {name: grpc.unary_unary_rpc_method_handler(self._unary(name, h)) for name, h in methods.items()},
        )

    def _unary(self, name: str, handler: _Handler) -> Callable[[bytes, grpc.aio.ServicerContext], Any]:
        path = f"/{SERVICE}/{name}"

        async def call(body: bytes, context: grpc.aio.ServicerContext) -> bytes:
            start = time.perf_counter()
            state = self.app.state
            admission = state.admission
            size = len(body)
            slot, held, table, status = False, 0, "", 200
            trace = None
            if tracing.TRACER is not None:
                trace = tracing.start_request(
                    path[1:],
                    _trace_carrier(context),
                    {"rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": name},
                )
            try:
                refused = admission.refusal(path, size)
                if refused is not None:
                    raise refused
                slot, held = admission.admit(path, size), size
                response, table = await handler(body, context)
                serialized: bytes = response.SerializeToString()
                return serialized
            except Exception as exc:
                status, message = _status(exc, path)
                await context.abort(grpc.StatusCode[grpc_code_for(status)], message)
                raise  # abort raises; never reached
            finally:
                admission.release(slot, held)
                state.metrics.observe_request(path, "GRPC", table, status, time.perf_counter() - start)
                if trace is not None:
                    code = grpc.StatusCode[grpc_code_for(status)] if status >= 400 else grpc.StatusCode.OK
                    attributes = {"rpc.grpc.status_code": code.value[0], tracing.TABLE: table}
                    tracing.end_request(trace, None, attributes, status >= 500)

        return call

    def _store(self) -> TableStore:
        store: TableStore | None = getattr(self.app.state, "store", None)
        if store is None:  # only between a worker's start and its tables being mapped, or at its stop
            raise BusyError("the tables are not ready")
        return store

    def _check_read(self, context: grpc.aio.ServicerContext) -> None:
        authorization = None
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                authorization = value if isinstance(value, str) else value.decode("latin-1")
                break
        check_read_access(self.settings, authorization)

    async def _server_live(self, body: bytes, context: grpc.aio.ServicerContext) -> tuple[Any, str]:
        return pb.ServerLiveResponse(live=True), ""

    async def _server_ready(self, body: bytes, context: grpc.aio.ServicerContext) -> tuple[Any, str]:
        return pb.ServerReadyResponse(ready=getattr(self.app.state, "store", None) is not None), ""

    async def _server_metadata(self, body: bytes, context: grpc.aio.ServicerContext) -> tuple[Any, str]:
        return pb.ServerMetadataResponse(**SERVER_METADATA), ""

    async def _model_ready(self, body: bytes, context: grpc.aio.ServicerContext) -> tuple[Any, str]:
        request = pb.ModelReadyRequest.FromString(body)
        self._check_read(context)
        self._store().table(request.name)  # NotFoundError: as GET /v2/models/{name}/ready's 404
        return pb.ModelReadyResponse(ready=True), request.name

    async def _model_metadata(self, body: bytes, context: grpc.aio.ServicerContext) -> tuple[Any, str]:
        request = pb.ModelMetadataRequest.FromString(body)
        self._check_read(context)
        config = self._store().table(request.name).config
        metadata = model_metadata(request.name, config.embedding_dim)
        response = pb.ModelMetadataResponse(name=request.name, platform=PLATFORM)
        for kind in ("inputs", "outputs"):
            for tensor in metadata[kind]:
                getattr(response, kind).add(**tensor)
        return response, request.name

    async def _model_infer(self, body: bytes, context: grpc.aio.ServicerContext) -> tuple[Any, str]:
        self._check_read(context)
        store, metrics = self._store(), self.app.state.metrics

        def work() -> tuple[str, Inference, LookupResult]:
            # Parsed here, off the event loop when the message is large (as a REST body is decoded).
            request = pb.ModelInferRequest.FromString(body)
            name = request.model_name
            return (name, *infer(store, metrics, name, lambda: decode_request(request)))

        if len(body) <= INLINE_MAX_BODY_BYTES:
            name, inference, result = work()
        else:
            name, inference, result = await anyio.to_thread.run_sync(
                work, limiter=self.app.state.compute_limiter
            )
        return encode_response(name, inference.request_id, inference, result), name


def _trace_carrier(context: grpc.aio.ServicerContext) -> dict[str, str]:
    """The W3C trace headers among a call's metadata."""
    return {
        key: value if isinstance(value, str) else value.decode("latin-1")
        for key, value in context.invocation_metadata() or ()
        if key in (tracing.TRACEPARENT, tracing.TRACESTATE)
    }


def _status(exc: Exception, path: str) -> tuple[int, str]:
    """The HTTP status an error answers with (the one table) and its message."""
    if isinstance(exc, RobezError):
        status = status_for(exc)
        if status >= 500:
            logger.error("%s on %s: %s", type(exc).__name__, path, exc)
        return status, str(exc)
    if isinstance(exc, DecodeError):
        return 422, f"invalid request message: {exc}"
    logger.exception("unexpected error on %s", path, exc_info=exc)
    return 500, "internal server error"


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def start_grpc(app: FastAPI, settings: Settings) -> tuple[grpc.aio.Server, int]:
    """Start this worker's gRPC server on ``settings.host:settings.grpc_port`` (SO_REUSEPORT); returns it
    and the port bound (the one asked for, or the one the OS chose for 0). Raises if it cannot bind."""
    assert settings.grpc_port is not None
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 1),
            (
                "grpc.max_receive_message_length",
                min(settings.max_body_bytes + _RECEIVE_HEADROOM_BYTES, _MAX_MESSAGE_BYTES),
            ),
            ("grpc.max_send_message_length", -1),
        ]
    )
    server.add_generic_rpc_handlers((InferenceServicer(app).handler(),))
    # One TLS policy for every port (docs/security.md): the HTTP port's certificate, and client
    # certificates required when it requires them; plaintext only when HTTP is plaintext too.
    address = _address(settings.host, settings.grpc_port)
    tls = server_credentials(settings)
    if tls is None:
        port = server.add_insecure_port(address)
    else:
        credentials = grpc.ssl_server_credentials(
            [(tls.private_key, tls.certificate_chain)],
            root_certificates=tls.client_ca,
            require_client_auth=tls.client_ca is not None,
        )
        port = server.add_secure_port(address, credentials)
    await server.start()
    logger.info(
        "gRPC inference protocol on %s (%s)",
        _address(settings.host, port),
        "plaintext" if tls is None else "TLS" if tls.client_ca is None else "mutual TLS",
    )
    return server, port


async def stop_grpc(server: grpc.aio.Server, grace_s: float = _GRACE_S) -> None:
    """Stop taking calls and give the calls under way ``grace_s`` seconds to finish (the server's
    ``shutdown_grace_s``), then cancel them."""
    await server.stop(grace_s)
