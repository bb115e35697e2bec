"""The Open Inference Protocol v2 (KServe / Triton) over robez tables: decoding, the inference, encoding.

The protocol's rules live here once, for both transports: ``inference_from`` checks a request's tensors,
parameters and outputs however they arrived, ``infer`` runs it; ``decode_infer`` / ``encode_infer`` are
the REST body's (``routes/oip.py``), ``service/grpc/`` has the protobuf's.

A table is a model. Its inference takes the input ``ids`` (INT64, shape [N]) and gives the output
``embeddings`` (FP32, shape [N, d]); with the request parameter ``pooling`` ("sum" | "mean") and the
optional input ``offsets`` (INT64, [B]) it gives pooled bags [B, d], with ``per_sample_weights`` (FP32,
[N]) as in ``/v1`` lookups.

Tensors travel as JSON (``data``: a flat row-major list) or, with the binary tensor data extension,
as raw little-endian bytes after the JSON header: the request then carries
``Inference-Header-Content-Length: <bytes of the JSON header>`` and each binary input says its size in
``parameters.binary_data_size``; an output is returned as bytes when the request asks for it
(``outputs[].parameters.binary_data`` or the request parameter ``binary_data_output``), and the
response carries the same header.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch import Tensor

from robez_core.errors import InvalidInputError, NotFoundError

from .codec import is_count, rows_view
from .errors import summarize_validation_errors
from .metrics import Metrics
from .store import LookupResult, Pooling, TableStore

HEADER_LENGTH = "Inference-Header-Content-Length"
IDS, OFFSETS, WEIGHTS, EMBEDDINGS = "ids", "offsets", "per_sample_weights", "embeddings"
_INPUT_TYPES = {IDS: "INT64", OFFSETS: "INT64", WEIGHTS: "FP32"}
_DTYPES: dict[str, np.dtype[Any]] = {"INT64": np.dtype("<i8"), "FP32": np.dtype("<f4")}
_POOLINGS: tuple[str, ...] = ("none", "sum", "mean")
_REQUEST_PARAMETERS = frozenset({"pooling", "binary_data_output"})
# Triton's request parameters that mean nothing for a table, accepted and ignored: a unary call has no
# final empty response to ask for; nothing queues, so nothing has a queue priority or timeout.
IGNORED_REQUEST_PARAMETERS = frozenset({"triton_enable_empty_final_response", "priority", "timeout"})
SERVER_METADATA = {
    "name": "robez",
    "version": "1",
    "extensions": ["binary_tensor_data", "statistics", "model_configuration"],
}
PLATFORM = "robez"
OPTIONAL_INPUTS = (
    f"{OFFSETS} INT64 [B] and {WEIGHTS} FP32 [n], with the request parameter pooling (sum | mean): "
    "bags of rows pooled, as /v1 lookups"
)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InferTensor(_Model):
    """One input tensor: ``data`` (flat, row-major) or, in binary mode, ``parameters.binary_data_size``."""

    name: str = Field(examples=["ids"])
    shape: list[int] = Field(examples=[[3]])
    datatype: str = Field(examples=["INT64"])
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = Field(default=None, examples=[[1, 2, 3]])


class InferRequestedOutput(_Model):
    name: str = Field(examples=["embeddings"])
    parameters: dict[str, Any] | None = None


class InferRequest(_Model):
    """``POST /v2/models/{table}/infer``; parameters: ``pooling`` ("none" | "sum" | "mean"),
    ``binary_data_output`` (bool)."""

    model_name: str | None = None  # official clients (kserve) repeat the path's; checked against it
    model_version: str | None = None
    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[InferTensor]
    outputs: list[InferRequestedOutput] | None = None


class InferOutputTensor(_Model):
    name: str
    datatype: str
    shape: list[int]
    parameters: dict[str, Any] | None = None
    data: list[float] | None = None


class InferResponse(_Model):
    model_name: str
    model_version: str
    id: str | None = None
    outputs: list[InferOutputTensor]


class TensorMetadata(_Model):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(_Model):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class ServerMetadata(_Model):
    name: str
    version: str
    extensions: list[str]


@dataclass(frozen=True)
class Inference:
    """A decoded infer request: the lookup to run and how to answer."""

    ids: np.ndarray
    offsets: Tensor | None
    pooling: Pooling
    per_sample_weights: Tensor | None
    request_id: str | None
    binary_output: bool
    version: str | None = None  # the model version asked for; None: the one served


def model_metadata(name: str, embedding_dim: int, version: int) -> dict[str, Any]:
    """``GET /v2/models/{name}``: the input and output of a table of dimension ``embedding_dim``, and the
    one version it serves. Only the required input is listed: tools that fill every listed input with
    generated data (perf_analyzer, which takes no empty shape) would send random offsets otherwise; the
    optional ones are named in the model configuration's ``parameters`` (``OPTIONAL_INPUTS``)."""
    return {
        "name": name,
        "versions": [str(version)],
        "platform": PLATFORM,
        "inputs": [{"name": IDS, "datatype": "INT64", "shape": [-1]}],
        "outputs": [{"name": EMBEDDINGS, "datatype": "FP32", "shape": [-1, embedding_dim]}],
    }


def _not_served(name: str, asked: str, served: int) -> str:
    return (
        f"model {shown(name)} version {shown(asked)} is not served: a table serves its current version, "
        f"{served} (leave the version empty for it)"
    )


def served_version(store: TableStore, name: str, version: str | None) -> int:
    """The version table ``name`` serves, once ``version`` (None or "": any) is checked to be it. A table
    serves one version, its current one (the ``model_version`` of every answer, ``X-Robez-Version`` of
    ``/v1``); any other is not found (404, NOT_FOUND), on both transports, for every call."""
    served = store.version(name)  # NotFoundError for an unknown table
    if version and version != str(served):
        raise NotFoundError(_not_served(name, version, served))
    return served


def model_config(name: str, embedding_dim: int) -> dict[str, Any]:
    """``GET /v2/models/{name}/config``: the table in Triton's model configuration (its JSON form, and
    the ``ModelConfig`` protobuf's fields): what tools such as perf_analyzer read to make inputs. No
    batch dimension (``max_batch_size`` 0): ``ids`` is [-1], ``embeddings`` [-1, d] (rows, or pooled
    bags); the optional inputs are described in ``parameters`` (as in the metadata, not listed)."""

    def tensor(tensor_name: str, data_type: str, dims: list[int]) -> dict[str, Any]:
        return {"name": tensor_name, "data_type": data_type, "dims": dims, "optional": False}

    return {
        "name": name,
        "platform": PLATFORM,
        "backend": PLATFORM,
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": 0,
        "input": [tensor(IDS, "TYPE_INT64", [-1])],
        "output": [{"name": EMBEDDINGS, "data_type": "TYPE_FP32", "dims": [-1, embedding_dim]}],
        "parameters": {
            "embedding_dim": {"string_value": str(embedding_dim)},
            "optional_inputs": {"string_value": OPTIONAL_INPUTS},
        },
    }


def repository_index(store: TableStore) -> list[dict[str, Any]]:
    """``POST /v2/repository/index``: every table as a model, with the version it serves."""
    index = []
    for name in store.names():
        try:
            version = store.version(name)
        except NotFoundError:  # deleted meanwhile
            continue
        index.append({"name": name, "version": str(version), "state": "READY", "reason": ""})
    return index


# The endpoints whose requests infer one table: their counts and times are its statistics.
INFER_ENDPOINTS = frozenset(
    {"/v2/models/{name}/infer", "/inference.GRPCInferenceService/ModelInfer", "/v1/tables/{name}/lookup"}
)


def model_statistics(
    samples: Iterable[tuple[str, Mapping[str, str], float]], versions: Mapping[str, int]
) -> list[dict[str, Any]]:
    """Triton's ``model_stats`` of the tables in ``versions`` (name -> version served), from the metrics'
    ``samples`` (name, labels, value; summed over every worker): requests of ``INFER_ENDPOINTS`` by
    outcome (``success``, ``fail``: status 400 or more), hashing as ``compute_input``, the gather as
    ``compute_infer`` (both over every lookup of the table, ``/v1/lookup``'s of several tables too), the
    rest of the request's time in the app (decoding, encoding) as ``compute_output``, every compute stage
    and ``queue`` counted as the successes; ``queue`` takes no time (a request is run when admitted, or
    refused). Durations in ns."""
    totals: dict[tuple[str, str], list[float]] = {}

    def add(table: str, key: str, field: int, value: float) -> None:
        totals.setdefault((table, key), [0.0, 0.0])[field] += value

    for name, labels, value in samples:
        table = labels.get("table", "")
        if table not in versions:
            continue
        if name.startswith("robez_request_duration_seconds_"):
            if labels.get("endpoint") not in INFER_ENDPOINTS:
                continue
            key = "fail" if int(labels.get("status", "0")) >= 400 else "success"
        elif name.startswith("robez_hash_seconds_"):
            key = "compute_input"
        elif name.startswith("robez_lookup_seconds_"):
            key = "compute_infer"
        else:
            continue
        if name.endswith("_count"):
            add(table, key, 0, value)
        elif name.endswith("_sum"):
            add(table, key, 1, value)

    def duration(table: str, key: str) -> dict[str, int]:
        count, seconds = totals.get((table, key), (0.0, 0.0))
        return {"count": int(count), "ns": int(seconds * 1e9)}

    stats = []
    for table, version in sorted(versions.items()):
        success = duration(table, "success")
        count = success["count"]
        # One count for the three compute stages, as clients require (perf_analyzer refuses others).
        compute_input = {"count": count, "ns": duration(table, "compute_input")["ns"]}
        compute_infer = {"count": count, "ns": duration(table, "compute_infer")["ns"]}
        rest = success["ns"] - compute_input["ns"] - compute_infer["ns"]
        stats.append(
            {
                "name": table,
                "version": str(version),
                "last_inference": 0,
                "inference_count": success["count"],
                "execution_count": success["count"],
                "inference_stats": {
                    "success": success,
                    "fail": duration(table, "fail"),
                    "queue": {"count": success["count"], "ns": 0},
                    "compute_input": compute_input,
                    "compute_infer": compute_infer,
                    "compute_output": {"count": success["count"], "ns": max(rest, 0)},
                    "cache_hit": {"count": 0, "ns": 0},
                    "cache_miss": {"count": 0, "ns": 0},
                },
                "batch_stats": [],
            }
        )
    return stats


MAX_ECHO_CHARS = 64


def shown(text: Any) -> str:
    """Client text as an error message quotes it: its repr, cut to ``MAX_ECHO_CHARS`` characters (a
    message may travel in a header, and a name may be a megabyte)."""
    if not isinstance(text, str):
        text = repr(text)
        return text if len(text) <= MAX_ECHO_CHARS else f"{text[:MAX_ECHO_CHARS]}... ({len(text)} characters)"
    if len(text) <= MAX_ECHO_CHARS:
        return repr(text)
    return f"{text[:MAX_ECHO_CHARS]!r}... ({len(text)} characters)"


def _flag(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidInputError(f"{what} must be true or false, got {shown(value)}")
    return value


@dataclass(frozen=True)
class TensorInput:
    """One input tensor as a transport hands it over: its values either as ``raw`` little-endian bytes
    (HTTP's binary tensor data, gRPC's ``raw_input_contents``) or as ``data``, a flat row-major sequence
    (JSON's ``data``; gRPC's typed ``contents``, already an array)."""

    name: str
    datatype: str
    shape: Sequence[int]
    data: Sequence[Any] | np.ndarray | None = None
    raw: bytes | memoryview | None = None


def checked_type(name: str, datatype: str, shape: Sequence[int]) -> tuple[str, int]:
    """The input's datatype and element count, after the checks every transport shares."""
    expected = _INPUT_TYPES.get(name)
    if expected is None:
        raise InvalidInputError(
            f"unknown input {shown(name)}; the inputs are {', '.join(sorted(_INPUT_TYPES))}"
        )
    if datatype != expected:
        raise InvalidInputError(f"input {shown(name)} must be {expected}, got {shown(datatype)}")
    if len(shape) != 1 or shape[0] < 0:
        raise InvalidInputError(f"input {shown(name)} must have shape [n], got {shown(list(shape))}")
    return expected, int(shape[0])


def _values(tensor: TensorInput) -> np.ndarray:
    """The tensor's values (1-D, little-endian), checked against its name, datatype and shape."""
    name = tensor.name
    expected, count = checked_type(name, tensor.datatype, tensor.shape)
    dtype = _DTYPES[expected]
    if tensor.raw is not None:
        size = len(tensor.raw)
        if size != count * dtype.itemsize:
            raise InvalidInputError(
                f"input {shown(name)}: {size} bytes of raw data, but shape [{count}] of {expected} is "
                f"{count * dtype.itemsize} ({count} x {dtype.itemsize} bytes)"
            )
        return np.frombuffer(tensor.raw, dtype=dtype, count=count)
    data = tensor.data
    if data is None:
        raise InvalidInputError(f"input {shown(name)} needs data (or binary data)")
    if isinstance(data, np.ndarray):  # decoded by the transport (gRPC's int64_contents)
        if data.shape != (count,):
            raise InvalidInputError(f"input {shown(name)}: shape [{count}] but {data.size} values")
        return data.astype(dtype, copy=False)
    if len(data) != count:
        raise InvalidInputError(f"input {shown(name)}: shape [{count}] but {len(data)} values (flat)")
    if expected == "INT64":
        if not all(type(value) is int for value in data):
            raise InvalidInputError(f"input {shown(name)}: INT64 data must be a flat list of integers")
        try:
            return np.array(data, dtype=np.int64)
        except OverflowError:
            raise InvalidInputError(f"input {shown(name)}: a value is outside the int64 range") from None
    if not all(type(value) in (int, float) for value in data):
        raise InvalidInputError(f"input {shown(name)}: FP32 data must be a flat list of numbers")
    with np.errstate(over="ignore"):  # beyond float32's range: Inf, which the lookup rejects
        return np.array(data, dtype=np.float64).astype(np.float32)


def inference_from(
    tensors: Sequence[TensorInput],
    parameters: Mapping[str, Any],
    outputs: Sequence[tuple[str, Mapping[str, Any]]],
    request_id: str | None,
    version: str | None = None,
    *,
    binary_by_default: bool = False,
) -> Inference:
    """An infer request from its parts, checked the same way whatever transport carried it: the inputs,
    the request ``parameters``, the outputs asked for (name, parameters) and the request id.
    ``version``: the model version asked for (None or "": the one served; ``served_version``).
    ``binary_by_default``: the answer is binary unless a parameter says otherwise (gRPC with raw inputs)."""
    pooling: Pooling = "none"
    binary_output = binary_by_default
    if parameters:
        unknown = set(parameters) - _REQUEST_PARAMETERS - IGNORED_REQUEST_PARAMETERS
        if unknown:
            raise InvalidInputError(
                f"unknown request parameters {[shown(key) for key in sorted(unknown)[:8]]}; "
                f"known: {sorted(_REQUEST_PARAMETERS)}"
            )
        pooling = parameters.get("pooling", "none")
        if pooling not in _POOLINGS:
            raise InvalidInputError(f"parameter pooling must be one of {_POOLINGS}, got {shown(pooling)}")
        if "binary_data_output" in parameters:
            binary_output = _flag(parameters["binary_data_output"], "parameter binary_data_output")
    for output_name, output_parameters in outputs:
        if output_name != EMBEDDINGS:
            raise InvalidInputError(f"unknown output {shown(output_name)}; the output is {EMBEDDINGS!r}")
        if output_parameters and set(output_parameters) - {"binary_data"}:
            raise InvalidInputError(f"output {EMBEDDINGS!r}: the only parameter is binary_data")
        if "binary_data" in output_parameters:
            binary_output = _flag(output_parameters["binary_data"], "output parameter binary_data")
    arrays: dict[str, np.ndarray] = {}
    for tensor in tensors:
        if tensor.name in arrays:
            raise InvalidInputError(f"input {shown(tensor.name)} is given twice")
        arrays[tensor.name] = _values(tensor)
    if IDS not in arrays:
        raise InvalidInputError(f"the input {IDS!r} (INT64, shape [n]) is required")
    # An optional input sent empty is an input not sent: tools that fill every input of the metadata
    # (perf_analyzer: --shape offsets:0 --shape per_sample_weights:0) can leave them out that way.
    offsets, weights = arrays.get(OFFSETS), arrays.get(WEIGHTS)
    if offsets is not None and offsets.size == 0:
        offsets = None
    if weights is not None and weights.size == 0:
        weights = None
    return Inference(
        ids=arrays[IDS].astype(np.int64),  # a writable array of its own, as /v1 decodes (torch takes it)
        offsets=None if offsets is None else torch.from_numpy(offsets.astype(np.int64)),
        pooling=pooling,
        per_sample_weights=None if weights is None else torch.from_numpy(weights.astype(np.float32)),
        request_id=request_id,
        binary_output=binary_output,
        version=version or None,
    )


def _json_tensor(
    name: str,
    datatype: str,
    shape: list[int],
    parameters: dict[str, Any] | None,
    data: list[Any] | None,
    binary: memoryview,
    position: int,
) -> tuple[TensorInput, int]:
    """A JSON input as a ``TensorInput`` (its raw bytes sliced from ``binary`` at ``position`` when it
    says ``binary_data_size``), and the position after its bytes."""
    size = None
    if parameters:
        if len(parameters) > 1 or "binary_data_size" not in parameters:
            unknown = set(parameters) - {"binary_data_size"}
            raise InvalidInputError(
                f"input {shown(name)}: unknown parameters {[shown(key) for key in sorted(unknown)[:8]]}"
            )
        size = parameters["binary_data_size"]
    if size is None:
        return TensorInput(name, datatype, shape, data=data), position
    expected, count = checked_type(name, datatype, shape)
    itemsize = _DTYPES[expected].itemsize
    if data is not None:
        raise InvalidInputError(f"input {shown(name)} has both data and binary_data_size")
    if type(size) is not int or size != count * itemsize:
        raise InvalidInputError(
            f"input {shown(name)}: binary_data_size must be {count * itemsize} "
            f"({count} x {itemsize} bytes), got {shown(size)}"
        )
    if position + size > len(binary):
        raise InvalidInputError(
            f"input {shown(name)}: the body holds {len(binary) - position} more bytes, not {size}"
        )
    raw = binary[position : position + size]
    return TensorInput(name, datatype, shape, raw=raw), position + size


_REQUEST_KEYS = frozenset({"model_name", "model_version", "id", "parameters", "inputs", "outputs"})
_TENSOR_KEYS = frozenset({"name", "shape", "datatype", "parameters", "data"})
_OUTPUT_KEYS = frozenset({"name", "parameters"})


def _none_or(value: Any, kind: type) -> bool:
    return value is None or type(value) is kind


def _plain_request(request: Any) -> bool:
    """Whether parsed JSON is an ``InferRequest`` exactly as its model would take it, no value coerced:
    then its fields are read from the dicts as they are (a tenth of the model's cost for a small request);
    anything else (a coercion, an error to word) goes through the model."""
    if type(request) is not dict or not request.keys() <= _REQUEST_KEYS:
        return False
    get = request.get
    if not (
        _none_or(get("model_name"), str)
        and _none_or(get("model_version"), str)
        and _none_or(get("id"), str)
        and _none_or(get("parameters"), dict)
    ):
        return False
    inputs = get("inputs")
    if type(inputs) is not list:
        return False
    for tensor in inputs:
        if type(tensor) is not dict or not tensor.keys() <= _TENSOR_KEYS:
            return False
        shape = tensor.get("shape")
        if (
            type(tensor.get("name")) is not str
            or type(tensor.get("datatype")) is not str
            or type(shape) is not list
            or not all(type(dim) is int for dim in shape)
            or not _none_or(tensor.get("parameters"), dict)
            or not _none_or(tensor.get("data"), list)
        ):
            return False
    outputs = get("outputs")
    if outputs is None:
        return True
    if type(outputs) is not list:
        return False
    return all(
        type(output) is dict
        and output.keys() <= _OUTPUT_KEYS
        and type(output.get("name")) is str
        and _none_or(output.get("parameters"), dict)
        for output in outputs
    )


def parsed_request(json_part: bytes) -> dict[str, Any]:
    """The JSON header as plain dicts and lists, checked as ``InferRequest`` checks it: by hand when it is
    plain (``_plain_request``), else through the model (its coercions, its error messages)."""
    try:
        parsed = orjson.loads(json_part)
    except orjson.JSONDecodeError:
        parsed = None
    if _plain_request(parsed):
        return parsed
    try:
        request = InferRequest.model_validate_json(json_part)
    except ValidationError as exc:
        raise InvalidInputError(summarize_validation_errors(list(exc.errors()))) from exc
    return request.model_dump()


def decode_infer(
    body: bytes, header_length: str | None, name: str | None = None, version: str | None = None
) -> Inference:
    """An infer request for model ``name`` (``version``: the path's, if it names one; None: no path to
    check the body's ``model_name`` / ``model_version`` against) from its HTTP body (and
    ``Inference-Header-Content-Length`` in binary mode)."""
    if header_length is None:
        json_part, binary = body, memoryview(b"")
    else:
        if not is_count(header_length.strip()) or int(header_length) > len(body):
            raise InvalidInputError(
                f"{HEADER_LENGTH} must be the byte length of the JSON header (at most {len(body)}), "
                f"got {shown(header_length)}"
            )
        split = int(header_length)
        json_part, binary = body[:split], memoryview(body)[split:]
    request = parsed_request(json_part)
    model_name, model_version = request.get("model_name"), request.get("model_version")
    if model_name is not None and name is not None and model_name != name:
        raise InvalidInputError(f"model_name {shown(model_name)} in the body, {shown(name)} in the path")
    if model_version and version is not None and model_version != version:
        raise InvalidInputError(
            f"model_version {shown(model_version)} in the body, {shown(version)} in the path"
        )
    tensors = []
    position = 0
    for tensor in request["inputs"]:
        decoded, position = _json_tensor(
            tensor["name"],
            tensor["datatype"],
            tensor["shape"],
            tensor.get("parameters"),
            tensor.get("data"),
            binary,
            position,
        )
        tensors.append(decoded)
    outputs = [(output["name"], output.get("parameters") or {}) for output in request.get("outputs") or ()]
    inference = inference_from(
        tensors, request.get("parameters") or {}, outputs, request.get("id"), version or model_version or None
    )
    if position != len(binary):
        raise InvalidInputError(f"the body has {len(binary) - position} bytes no input claims")
    return inference


def infer(
    store: TableStore, metrics: Metrics, name: str, decode: Callable[[], Inference]
) -> tuple[Inference, LookupResult]:
    """The inference, for every transport (the REST route and the gRPC servicer call this): the request
    ``decode`` gives, looked up in table ``name`` (rows, or pooled bags), its stage times recorded."""
    inference = decode()
    if inference.version is not None:
        served_version(store, name, inference.version)
    result = store.lookup(
        name, inference.ids, inference.offsets, inference.pooling, inference.per_sample_weights
    )
    if inference.version is not None and str(result.version) != inference.version:  # an update came between
        raise NotFoundError(_not_served(name, inference.version, result.version))
    stages = metrics.stages(name)
    stages.hash_seconds.observe(result.hash_seconds)
    stages.lookup_seconds.observe(result.lookup_seconds)
    return inference, result


# The binary answer's JSON header, the same fields in the same order as ``orjson.dumps`` of the JSON
# answer's, formatted in one step: model name (JSON), version, the ``"id":...,`` member (or nothing), rows,
# dimension, bytes.
_BINARY_HEAD = (
    b'{"model_name":%b,"model_version":"%d",%b"outputs":[{"name":"embeddings","datatype":"FP32",'
    b'"shape":[%d,%d],"parameters":{"binary_data_size":%d}}]}'
)


def encode_infer(name: str, inference: Inference, result: LookupResult) -> tuple[bytes, int | None]:
    """The response body, and the length of its JSON header when tensors follow it as bytes."""
    rows = result.rows
    if inference.binary_output:
        data = rows_view(rows)  # no copy of its own: the one copy is into the body, after the header
        request_id = inference.request_id
        header = _BINARY_HEAD % (
            orjson.dumps(name),
            result.version,
            b"" if request_id is None else b'"id":%b,' % orjson.dumps(request_id),
            rows.shape[0],
            rows.shape[1],
            data.nbytes,
        )
        return header + data, len(header)
    head: dict[str, Any] = {"model_name": name, "model_version": str(result.version)}
    if inference.request_id is not None:
        head["id"] = inference.request_id
    head["outputs"] = [
        {
            "name": EMBEDDINGS,
            "datatype": "FP32",
            "shape": [int(rows.shape[0]), int(rows.shape[1])],
            "data": rows.reshape(-1),
        }
    ]
    return orjson.dumps(head, option=orjson.OPT_SERIALIZE_NUMPY), None
