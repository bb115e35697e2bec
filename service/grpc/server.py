"""gRPC ``inference.GRPCInferenceService`` (KServe's Open Inference Protocol v2, as Triton serves it).

Every worker runs a ``grpc.aio`` server on its own event loop beside uvicorn's, bound to
``host:grpc_port`` with ``SO_REUSEPORT`` (the kernel spreads connections over the workers, as it does
nothing for HTTP, where the workers share one listening socket). The messages are Triton's
(``tritonclient.grpc.service_pb2``): its service is KServe's ``grpc_predict_v2.proto`` (package
``inference``, same names, same fields) plus methods robez does not serve (UNIMPLEMENTED), so reusing its
generated code keeps one copy of those descriptors in a process that also holds the official client.

A call goes through what an HTTP request goes through, transport aside:

- the read key (``auth.check_read_access``) from the metadata ``authorization: Bearer <key>``, for the
  model and repository methods (as ``/v2/models/...``), before any of the message is read;
- the body's bounds: the message is read by the servicer itself (``InferenceServicer.handler``), with
  room for it among the worker's ``max_body_bytes_held`` and within ``body_timeout_s``; until then gRPC
  holds at most its first ``_LOOKAHEAD_BYTES``;
- the admission (``service/http/admission.py``: ``refusal``, ``admit``, ``release``): the message's size
  against ``max_body_bytes``, the worker's ``max_in_flight`` and ``max_body_bytes_held``;
- the inference (``wire.parse_request``, then ``oip.inference_from`` and ``oip.infer``: the REST route's
  checks and lookup); model configuration, statistics and repository index from ``oip`` too;
- errors: the HTTP status of the one error table (``errors.py``), sent as the gRPC code mapped from it
  (``GRPC_CODE_BY_STATUS``) with the same message;
- metrics: ``robez_requests`` / ``robez_request_duration_seconds`` with endpoint the gRPC method's path
  (``/inference.GRPCInferenceService/ModelInfer``), method ``GRPC``, the table and the HTTP status the
  answer corresponds to (200, 404, 422, ...), so one query covers both transports.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import anyio.to_thread
import grpc
from fastapi import FastAPI
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc.model_config_pb2 import ModelConfig

from robez_core.allocator import trim_free_memory
from robez_core.errors import BusyError, InvalidInputError, NotFoundError, RobezError

from .. import tracing
from ..auth import check_read_access
from ..codec import rows_view
from ..config import Settings
from ..errors import grpc_code_for, status_for
from ..http.admission import ANSWER_CHECKED_BYTES, CLIENT_CLOSED_REQUEST, Admission
from ..oip import (
    EMBEDDINGS,
    PLATFORM,
    SERVER_METADATA,
    Inference,
    TensorInput,
    checked_type,
    infer,
    inference_from,
    model_config,
    model_metadata,
    model_statistics,
    repository_index,
    served_version,
    shown,
)
from ..routes.lookup import BINARY_INLINE_MAX_BODY_BYTES
from ..store import LookupResult, TableStore
from ..tls import server_credentials
from .wire import CONTENTS_FIELDS, WireRequest, decode_int64s, fp32_values, parse_request

logger = logging.getLogger("robez.grpc")

SERVICE = "inference.GRPCInferenceService"
# Headroom over max_body_bytes before gRPC itself refuses a message (RESOURCE_EXHAUSTED, in its own
# words): up to it, robez refuses it naming the limit, as HTTP's 413 does.
_RECEIVE_HEADROOM_BYTES = 1 << 20
_MAX_MESSAGE_BYTES = (1 << 31) - 1
_CONTENTS_FIELD = {"INT64": 3, "FP32": 6}  # the InferTensorContents field of each datatype taken
_RAW_OUTPUT_TAG = bytes([6 << 3 | 2])  # ModelInferResponse.raw_output_contents, length-delimited
_SMALL_VARINTS = [bytes((value,)) for value in range(0x80)]
_HEADS_KEPT = 256  # answer heads without an id, by (table, version, rows, dimension): a few bytes each
_GRACE_S = 5.0
# A call's message is taken from the connection only once the servicer reads it: until then gRPC holds at
# most this much of it (flow control; the bandwidth probe that would widen the window is off).
_LOOKAHEAD_BYTES = 64 * 1024
_MAX_CONCURRENT_STREAMS = 100  # per connection, as Envoy's and nginx's defaults
_ROOM_POLL_S = 0.005
_TRIM_AFTER_BYTES = 8 << 20
_MAX_MESSAGE_CHARS = 1024  # of any error message (grpc-message is a header)

# A method's handler: the request message's bytes -> (the response message, the table label).
_Handler = Callable[[bytes], Awaitable[tuple[Any, str]]]


def _check_input_parameters(name: str, parameters: dict[str, Any], raw: memoryview | None) -> None:
    """An input's parameters: ``binary_data_size``, which Triton's and KServe's clients send with raw
    contents, must be the length of its ``raw_input_contents``; no other is taken."""
    unknown = set(parameters) - {"binary_data_size"}
    if unknown:
        raise InvalidInputError(
            f"input {shown(name)}: unknown parameters {[shown(key) for key in sorted(unknown)[:8]]}; "
            "the only one is binary_data_size (with raw_input_contents)"
        )
    if "binary_data_size" in parameters:
        size = parameters["binary_data_size"]
        if raw is None:
            raise InvalidInputError(f"input {shown(name)}: binary_data_size without raw_input_contents")
        if type(size) is not int or size != len(raw):
            raise InvalidInputError(
                f"input {shown(name)}: binary_data_size is {shown(size)}, "
                f"its raw_input_contents {len(raw)} bytes"
            )


def _tensors(request: WireRequest, max_ids: int) -> list[TensorInput]:
    """The request's inputs: raw (``raw_input_contents``, one per input, in order: views of the message)
    or typed contents (``int64_contents`` decoded into an array, refused past ``max_ids`` first;
    ``fp32_contents`` as the raw little-endian bytes they are)."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidInputError(
            f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs: give every input "
            "raw, or none"
        )
    tensors = []
    for position, tensor in enumerate(request.inputs):
        name, datatype, shape = tensor.name, tensor.datatype, tensor.shape
        _check_input_parameters(name, tensor.parameters, raw[position] if raw else None)
        if raw:
            if tensor.contents:
                raise InvalidInputError(f"input {shown(name)} has both contents and raw_input_contents")
            tensors.append(TensorInput(name, datatype, shape, raw=raw[position]))
            continue
        checked_type(name, datatype, shape)  # a datatype robez does not take is refused by name first
        number = _CONTENTS_FIELD[datatype]
        given = sorted(tensor.contents)
        if given and given != [number]:
            raise InvalidInputError(
                f"input {shown(name)} ({datatype}) carries its values in {CONTENTS_FIELDS[number]}, got "
                f"{[CONTENTS_FIELDS.get(field, field) for field in given]}"
            )
        values = tensor.contents.get(number)
        if values is None:
            tensors.append(TensorInput(name, datatype, shape))  # no data: refused as such
        elif datatype == "INT64":
            array = decode_int64s(values, max_ids, f"input {shown(name)}")
            tensors.append(TensorInput(name, datatype, shape, data=array))
        else:
            tensors.append(
                TensorInput(name, datatype, shape, raw=fp32_values(values, f"input {shown(name)}"))
            )
    return tensors


def decode_request(request: WireRequest, max_ids: int) -> Inference:
    """A ``ModelInferRequest`` (its wire fields) as an ``Inference``: the REST request's checks
    (``oip.inference_from``). The answer is raw (``raw_output_contents``) when the inputs were, unless a
    parameter says otherwise."""
    return inference_from(
        _tensors(request, max_ids),
        request.parameters,
        request.outputs,
        request.id or None,
        request.model_version or None,
        binary_by_default=bool(request.raw_input_contents),
    )


def encode_response(name: str, request_id: str | None, inference: Inference, result: LookupResult) -> bytes:
    """The serialized ``ModelInferResponse`` of an inference: the rows as raw bytes or as ``fp32_contents``.
    A raw answer is written by hand, byte for byte what the generated code writes (``_raw_head``), and
    its rows appended once as field ``raw_output_contents``, where the generated code would copy them
    three times (bytes, the field, the message)."""
    rows = result.rows
    if not inference.binary_output:
        response = pb.ModelInferResponse(
            model_name=name, model_version=str(result.version), id=request_id or ""
        )
        output = response.outputs.add(name=EMBEDDINGS, datatype="FP32", shape=[int(n) for n in rows.shape])
        output.contents.fp32_contents.extend(rows.reshape(-1).tolist())
        message: bytes = response.SerializeToString()
        return message
    data = rows_view(rows)
    count, dim = int(rows.shape[0]), int(rows.shape[1])
    if request_id:
        head = _raw_head(name, result.version, request_id, count, dim)
    else:  # the usual answer (clients send no id): its head depends on the table, version and shape only
        head = _raw_head_without_id(name, result.version, count, dim)
    return b"".join((head, _RAW_OUTPUT_TAG, _varint(data.nbytes), data))


_OUTPUT_NAME_TYPE = b"\x0a\x0aembeddings\x12\x04FP32"  # InferOutputTensor: name, datatype


def _raw_head(name: str, version: int, request_id: str | None, count: int, dim: int) -> bytes:
    """A ``ModelInferResponse`` of one output ``embeddings`` (FP32, [count, dim]) without its contents, as
    ``SerializeToString`` writes it: fields in order of number, empty strings left out."""
    shape = _varint(count) + _varint(dim)
    output = _OUTPUT_NAME_TYPE + b"\x1a" + _varint(len(shape)) + shape
    parts = [_text(1, name), _text(2, str(version))]
    if request_id:
        parts.append(_text(3, request_id))
    parts += (b"\x2a", _varint(len(output)), output)
    return b"".join(parts)


@functools.lru_cache(maxsize=_HEADS_KEPT)
def _raw_head_without_id(name: str, version: int, count: int, dim: int) -> bytes:
    return _raw_head(name, version, None, count, dim)


def _text(number: int, text: str) -> bytes:
    """A length-delimited string field (left out when empty, as proto3 does)."""
    if not text:
        return b""
    encoded = text.encode()
    return bytes((number << 3 | 2,)) + _varint(len(encoded)) + encoded


def _varint(value: int) -> bytes:
    if value < 0x80:
        return _SMALL_VARINTS[value]
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


class InferenceServicer:
    """The served methods of ``GRPCInferenceService`` over the app's store, admission and settings."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.settings: Settings = app.state.settings
        # What one message may hold while it arrives: gRPC refuses a longer declared length itself.
        self.max_message_bytes = receive_limit(self.settings)
        self.reading_bytes = min(self.max_message_bytes, self.settings.max_body_bytes_held)
        self._loop: asyncio.AbstractEventLoop | None = None

    def methods(self) -> dict[str, tuple[_Handler, bool]]:
        """Every served method by name: its handler (the request message's bytes -> the response and the
        table label) and whether it needs the read key. Both engines serve these through ``run``."""
        return {
            "ServerLive": (self._server_live, False),
            "ServerReady": (self._server_ready, False),
            "ServerMetadata": (self._server_metadata, False),
            "ModelReady": (self._model_ready, True),
            "ModelMetadata": (self._model_metadata, True),
            "ModelInfer": (self._model_infer, True),
            "ModelConfig": (self._model_config, True),
            "ModelStatistics": (self._model_statistics, True),
            "RepositoryIndex": (self._repository_index, True),
        }

    def handler(self) -> grpc.GenericRpcHandler:
        """The generic handler of every served method for ``grpc.aio``. Each is served as a call with a
        request *stream* (of the one message unary clients send): the servicer reads the message itself, once
        the read key and the worker's room for it are checked, and within ``body_timeout_s``; until then gRPC
        holds at most its first ``_LOOKAHEAD_BYTES`` (the server's flow-control window, ``start_grpc``)."""
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                name: grpc.stream_unary_rpc_method_handler(self._unary(name, handler, read_key))
                for name, (handler, read_key) in self.methods().items()
            },
        )

    def _unary(
        self, name: str, handler: _Handler, read_key: bool
    ) -> Callable[[Any, grpc.aio.ServicerContext], Any]:
        async def call(_: Any, context: grpc.aio.ServicerContext) -> bytes:
            async def read(timeout_s: float) -> bytes | None:
                body = await self._read(context, timeout_s)
                return body if isinstance(body, bytes) else None  # grpc.aio.EOF: no message

            response, code, message = await self.run(
                name, handler, read_key, context.invocation_metadata() or (), read
            )
            if code is grpc.StatusCode.OK and len(response) > ANSWER_CHECKED_BYTES:
                # Held in the worker's room until gRPC is done with the call (its message taken by the
                # peer's windows): a peer that takes no answer cannot make the worker hold more than that.
                admission = self.app.state.admission
                size = len(response)
                if not admission.answer_fits(size):
                    admission.metrics.rejected_total.labels("bodies_held").inc()
                    code, message = grpc.StatusCode.RESOURCE_EXHAUSTED, admission.bodies_held_message()
                else:
                    admission.hold_answers(size)
                    context.add_done_callback(lambda _: admission.hold_answers(-size))
            if code is not grpc.StatusCode.OK:
                await context.abort(code, message)
            return response

        return call

    async def run(
        self,
        name: str,
        handler: _Handler,
        read_key: bool,
        metadata: Iterable[tuple[str, str | bytes]],
        read: Callable[[float], Awaitable[bytes | None]],
    ) -> tuple[bytes, grpc.StatusCode, str]:
        """One call of method ``name``, whatever the engine: the read key from ``metadata``, room for the
        message held, the message read (``read(timeout_s)``: its bytes, None without one, TimeoutError past
        ``timeout_s``), the admission, the handler, metrics and trace. Returns the serialized response, or
        the gRPC code and message of the error (the code OK with the response)."""
        path = f"/{SERVICE}/{name}"
        timeout_s = self.settings.body_timeout_s
        start = time.perf_counter()
        state = self.app.state
        admission = state.admission
        slot, held, reading, table, status = False, 0, 0, "", 200
        body: bytes | None = b""
        trace = None
        if tracing.TRACER is not None:
            trace = tracing.start_request(
                path[1:],
                _trace_carrier(metadata),
                {"rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": name},
            )
        try:
            if read_key:  # before a byte of the message is taken from the connection
                self._check_read(metadata)
            if admission.hold(self.reading_bytes):  # room now (else wait for it, same deadline)
                reading = self.reading_bytes
            else:
                reading = await self._room_to_read(admission, start + timeout_s)
            body = await read(start + timeout_s - time.perf_counter())
            admission.release(False, reading)
            reading = 0
            if body is None:  # the client sent no message
                raise InvalidInputError("the call carries no request message")
            size = len(body)
            refused = admission.refusal(path, size)
            if refused is not None:
                raise refused
            slot, held = admission.admit(path, size), size
            response, table = await handler(body)
            if isinstance(response, bytes):  # serialized already (ModelInfer)
                return response, grpc.StatusCode.OK, ""
            serialized: bytes = response.SerializeToString()
            return serialized, grpc.StatusCode.OK, ""
        except asyncio.CancelledError:  # the client cancelled, reset or ran out of its deadline
            status = CLIENT_CLOSED_REQUEST  # as HTTP counts a request whose client left
            raise
        except Exception as exc:
            if isinstance(exc, _TableError):  # a failed call on a table: counted under it
                store = getattr(state, "store", None)
                table = exc.table if store is not None and exc.table in store.names() else ""
                exc = exc.error
            code, status, message = _status(exc, path, timeout_s)
            if status == 408:
                admission.metrics.rejected_total.labels("body_timeout").inc()
            return b"", code, message
        finally:
            admission.release(slot, held + reading)
            state.metrics.observe_request(path, "GRPC", table, status, time.perf_counter() - start)
            if status >= 400 and (status == 408 or held >= _TRIM_AFTER_BYTES):
                # The message's buffers, freed by gRPC and us, back to the system (glibc keeps them).
                body = b""
                await anyio.to_thread.run_sync(trim_free_memory)
            if trace is not None:
                code = grpc.StatusCode[grpc_code_for(status)] if status >= 400 else grpc.StatusCode.OK
                attributes = {"rpc.grpc.status_code": code.value[0], tracing.TABLE: table}
                tracing.end_request(trace, None, attributes, status >= 500)

    async def _read(self, context: grpc.aio.ServicerContext, timeout_s: float) -> Any:
        """The call's message, or TimeoutError once ``timeout_s`` has passed (its read cancelled).

        ``asyncio.timeout`` does the same at about twice the cost per call on this path (a profile of
        1-id calls: 4.5% of the worker's busy time): it looks the running loop up three times, each a
        ``getpid`` system call on Python 3.11; the loop here is the servicer's, looked up once."""
        loop = self._loop
        if loop is None:  # the first call: the loop the gRPC server (and every call of it) runs on
            loop = self._loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        assert task is not None  # grpc.aio runs every handler in a task of its own
        cancelling = task.cancelling()
        expiry = _Expiry(task)
        timer = loop.call_later(timeout_s, expiry)
        try:
            return await context.read()
        except asyncio.CancelledError:
            # Ours only when our timer fired and no other cancellation is pending (as asyncio.timeout).
            if expiry.fired and task.uncancel() <= cancelling:
                raise TimeoutError from None
            raise
        finally:
            timer.cancel()

    async def _room_to_read(self, admission: Admission, deadline: float) -> int:
        """Hold room for a message about to be read (``reading_bytes``, as much as it may hold while it
        arrives) among the bodies the worker holds; waits for room until ``deadline`` (then TimeoutError),
        as calls whose messages are in read and free theirs. Returns the bytes held."""
        while not admission.hold(self.reading_bytes):
            if time.perf_counter() >= deadline:
                raise TimeoutError
            await asyncio.sleep(_ROOM_POLL_S)
        return self.reading_bytes

    def _store(self) -> TableStore:
        store: TableStore | None = getattr(self.app.state, "store", None)
        if store is None:  # only between a worker's start and its tables being mapped, or at its stop
            raise BusyError("the tables are not ready")
        return store

    def _check_read(self, metadata: Iterable[tuple[str, str | bytes]]) -> None:
        if self.settings.read_api_key is None:  # every call may read (check_read_access's first rule)
            return
        authorization = None
        for key, value in metadata:
            if key == "authorization":
                authorization = value if isinstance(value, str) else value.decode("latin-1")
                break
        check_read_access(self.settings, authorization)

    async def _server_live(self, body: bytes) -> tuple[Any, str]:
        return pb.ServerLiveResponse(live=True), ""

    async def _server_ready(self, body: bytes) -> tuple[Any, str]:
        return pb.ServerReadyResponse(ready=getattr(self.app.state, "store", None) is not None), ""

    async def _server_metadata(self, body: bytes) -> tuple[Any, str]:
        return pb.ServerMetadataResponse(**SERVER_METADATA), ""

    async def _model_ready(self, body: bytes) -> tuple[Any, str]:
        request = pb.ModelReadyRequest.FromString(body)
        try:
            served_version(self._store(), request.name, request.version)
        except NotFoundError:  # an unknown table, or a version it does not serve: HTTP's 404, Triton's False
            return pb.ModelReadyResponse(ready=False), ""
        return pb.ModelReadyResponse(ready=True), request.name

    async def _model_metadata(self, body: bytes) -> tuple[Any, str]:
        request = pb.ModelMetadataRequest.FromString(body)
        store = self._store()
        served = served_version(store, request.name, request.version)
        metadata = model_metadata(request.name, store.table(request.name).config.embedding_dim, served)
        response = pb.ModelMetadataResponse(
            name=request.name, versions=metadata["versions"], platform=PLATFORM
        )
        for kind in ("inputs", "outputs"):
            for tensor in metadata[kind]:
                getattr(response, kind).add(**tensor)
        return response, request.name

    async def _model_config(self, body: bytes) -> tuple[Any, str]:
        request = pb.ModelConfigRequest.FromString(body)
        store = self._store()
        served_version(store, request.name, request.version)
        config = model_config(request.name, store.table(request.name).config.embedding_dim)
        return pb.ModelConfigResponse(config=json_format.ParseDict(config, ModelConfig())), request.name

    async def _model_statistics(self, body: bytes) -> tuple[Any, str]:
        request = pb.ModelStatisticsRequest.FromString(body)
        store = self._store()
        if request.name:
            versions = {request.name: served_version(store, request.name, request.version)}
        else:
            versions = {entry["name"]: int(entry["version"]) for entry in repository_index(store)}
        stats = model_statistics(self.app.state.metrics.samples(), versions)
        response = json_format.ParseDict({"model_stats": stats}, pb.ModelStatisticsResponse())
        return response, request.name

    async def _repository_index(self, body: bytes) -> tuple[Any, str]:
        pb.RepositoryIndexRequest.FromString(body)  # every table is ready: the filter changes nothing
        response = pb.RepositoryIndexResponse()
        for entry in repository_index(self._store()):
            response.models.add(**entry)
        return response, ""

    async def _model_infer(self, body: bytes) -> tuple[Any, str]:
        store, metrics = self._store(), self.app.state.metrics
        max_ids = self.settings.max_ids_per_request

        def work() -> tuple[str, Inference, LookupResult]:
            # Parsed here, off the event loop when the message is large (as a REST body is decoded).
            request = parse_request(body)
            name = request.model_name
            try:
                return (name, *infer(store, metrics, name, lambda: decode_request(request, max_ids)))
            except RobezError as exc:
                raise _TableError(name, exc) from exc

        if len(body) <= BINARY_INLINE_MAX_BODY_BYTES:  # decoded as /v1's binary bodies are: inline
            name, inference, result = work()
        else:
            name, inference, result = await anyio.to_thread.run_sync(
                work, limiter=self.app.state.compute_limiter
            )
        return encode_response(name, inference.request_id, inference, result), name


class _Expiry:
    """The timer callback of a read: cancels the reading task and says it did."""

    __slots__ = ("fired", "task")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task, self.fired = task, False

    def __call__(self) -> None:
        self.fired = True
        self.task.cancel()


class CallRefused(Exception):
    """A call refused by its engine for what only the transport sees (a compressed message, a malformed
    frame of the message): its gRPC code, the HTTP status it is counted under, and its message."""

    def __init__(self, code: grpc.StatusCode, status: int, message: str) -> None:
        super().__init__(message)
        self.code, self.status = code, status


class _TableError(Exception):
    """An inference of table ``table`` failed with ``error`` (its metrics carry the table's label)."""

    def __init__(self, table: str, error: Exception) -> None:
        super().__init__(str(error))
        self.table, self.error = table, error


def _trace_carrier(metadata: Iterable[tuple[str, str | bytes]]) -> dict[str, str]:
    """The W3C trace headers among a call's metadata."""
    return {
        key: value if isinstance(value, str) else value.decode("latin-1")
        for key, value in metadata
        if key in (tracing.TRACEPARENT, tracing.TRACESTATE)
    }


def _status(exc: Exception, path: str, timeout_s: float) -> tuple[grpc.StatusCode, int, str]:
    """The gRPC code, the HTTP status an error answers with (the one table) and its message (at most
    ``_MAX_MESSAGE_CHARS``: it travels in a header, and may quote the client)."""
    if isinstance(exc, TimeoutError):
        message = f"the request message did not arrive within body_timeout_s={timeout_s:g}"
        return grpc.StatusCode.DEADLINE_EXCEEDED, 408, message
    if isinstance(exc, CallRefused):
        return exc.code, exc.status, str(exc)[:_MAX_MESSAGE_CHARS]
    if isinstance(exc, RobezError):
        status = status_for(exc)
        message = str(exc)
        if status >= 500:
            logger.error("%s on %s: %s", type(exc).__name__, path, message[:_MAX_MESSAGE_CHARS])
    elif isinstance(exc, DecodeError):
        status, message = 422, f"invalid request message: {exc}"
    else:
        logger.exception("unexpected error on %s", path, exc_info=exc)
        status, message = 500, "internal server error"
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[: _MAX_MESSAGE_CHARS - 3] + "..."
    return grpc.StatusCode[grpc_code_for(status)], status, message


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def receive_limit(settings: Settings) -> int:
    """The longest message gRPC takes (it refuses a longer declared length before reading it)."""
    return min(settings.max_body_bytes + _RECEIVE_HEADROOM_BYTES, _MAX_MESSAGE_BYTES)


async def start_grpc(app: FastAPI, settings: Settings) -> tuple[Any, int]:
    """Start this worker's gRPC server on ``settings.host:settings.grpc_port`` (SO_REUSEPORT); returns it
    and the port bound (the one asked for, or the one the OS chose for 0). Raises if it cannot bind."""
    assert settings.grpc_port is not None
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 1),
            ("grpc.max_receive_message_length", receive_limit(settings)),
            ("grpc.max_send_message_length", -1),
            ("grpc.http2.bdp_probe", 0),
            ("grpc.http2.lookahead_bytes", _LOOKAHEAD_BYTES),
            ("grpc.max_concurrent_streams", _MAX_CONCURRENT_STREAMS),
            # keepalive: grpcio's defaults unless configured, the frames engine's too (keepalive.py)
            ("grpc.keepalive_time_ms", round(settings.grpc_keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", round(settings.grpc_keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", int(settings.grpc_keepalive_permit_without_calls)),
            ("grpc.http2.min_ping_interval_without_data_ms", round(settings.grpc_min_ping_interval_s * 1000)),
            ("grpc.http2.max_ping_strikes", settings.grpc_max_ping_strikes),
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


async def stop_grpc(server: Any, grace_s: float = _GRACE_S) -> None:
    """Stop taking calls and give the calls under way ``grace_s`` seconds to finish (the server's
    ``shutdown_grace_s``), then cancel them."""
    await server.stop(grace_s)
