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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch import Tensor

from robez_core.errors import InvalidInputError

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
SERVER_METADATA = {"name": "robez", "version": "1", "extensions": ["binary_tensor_data"]}
PLATFORM = "robez"


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


def model_metadata(name: str, embedding_dim: int) -> dict[str, Any]:
    """``GET /v2/models/{name}``: the inputs and output of a table of dimension ``embedding_dim``."""
    return {
        "name": name,
        "platform": PLATFORM,
        "inputs": [
            {"name": IDS, "datatype": "INT64", "shape": [-1]},
            {"name": OFFSETS, "datatype": "INT64", "shape": [-1]},
            {"name": WEIGHTS, "datatype": "FP32", "shape": [-1]},
        ],
        "outputs": [{"name": EMBEDDINGS, "datatype": "FP32", "shape": [-1, embedding_dim]}],
    }


MAX_ECHO_CHARS = 64


def shown(text: Any) -> str:
    """Client text as an error message quotes it: its repr, cut to ``MAX_ECHO_CHARS`` characters (a
    message may travel in a header, and a name may be a megabyte)."""
    text = str(text)
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
    *,
    binary_by_default: bool = False,
) -> Inference:
    """An infer request from its parts, checked the same way whatever transport carried it: the inputs,
    the request ``parameters``, the outputs asked for (name, parameters) and the request id.
    ``binary_by_default``: the answer is binary unless a parameter says otherwise (gRPC with raw inputs)."""
    unknown = set(parameters) - _REQUEST_PARAMETERS
    if unknown:
        raise InvalidInputError(
            f"unknown request parameters {[shown(key) for key in sorted(unknown)[:8]]}; "
            f"known: {sorted(_REQUEST_PARAMETERS)}"
        )
    pooling = parameters.get("pooling", "none")
    if pooling not in _POOLINGS:
        raise InvalidInputError(f"parameter pooling must be one of {_POOLINGS}, got {shown(pooling)}")
    binary_output = binary_by_default
    if "binary_data_output" in parameters:
        binary_output = _flag(parameters["binary_data_output"], "parameter binary_data_output")
    for output_name, output_parameters in outputs:
        if output_name != EMBEDDINGS:
            raise InvalidInputError(f"unknown output {shown(output_name)}; the output is {EMBEDDINGS!r}")
        if set(output_parameters) - {"binary_data"}:
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
    offsets, weights = arrays.get(OFFSETS), arrays.get(WEIGHTS)
    return Inference(
        ids=arrays[IDS].astype(np.int64, copy=False),
        offsets=None if offsets is None else torch.from_numpy(offsets.astype(np.int64)),
        pooling=pooling,
        per_sample_weights=None if weights is None else torch.from_numpy(weights.astype(np.float32)),
        request_id=request_id,
        binary_output=binary_output,
    )


def _json_tensor(tensor: InferTensor, binary: memoryview, position: int) -> tuple[TensorInput, int]:
    """A JSON input as a ``TensorInput`` (its raw bytes sliced from ``binary`` at ``position`` when it
    says ``binary_data_size``), and the position after its bytes."""
    parameters = tensor.parameters or {}
    unknown = set(parameters) - {"binary_data_size"}
    if unknown:
        raise InvalidInputError(
            f"input {shown(tensor.name)}: unknown parameters {[shown(key) for key in sorted(unknown)[:8]]}"
        )
    size = parameters.get("binary_data_size")
    if size is None:
        return TensorInput(tensor.name, tensor.datatype, tensor.shape, data=tensor.data), position
    expected, count = checked_type(tensor.name, tensor.datatype, tensor.shape)
    itemsize = _DTYPES[expected].itemsize
    if tensor.data is not None:
        raise InvalidInputError(f"input {shown(tensor.name)} has both data and binary_data_size")
    if type(size) is not int or size != count * itemsize:
        raise InvalidInputError(
            f"input {shown(tensor.name)}: binary_data_size must be {count * itemsize} "
            f"({count} x {itemsize} bytes), got {shown(size)}"
        )
    if position + size > len(binary):
        raise InvalidInputError(
            f"input {shown(tensor.name)}: the body holds {len(binary) - position} more bytes, not {size}"
        )
    raw = binary[position : position + size]
    return TensorInput(tensor.name, tensor.datatype, tensor.shape, raw=raw), position + size


def decode_infer(body: bytes, header_length: str | None) -> Inference:
    """An infer request from its HTTP body (and ``Inference-Header-Content-Length`` in binary mode)."""
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
    try:
        request = InferRequest.model_validate_json(json_part)
    except ValidationError as exc:
        raise InvalidInputError(summarize_validation_errors(list(exc.errors()))) from exc
    tensors = []
    position = 0
    for tensor in request.inputs:
        decoded, position = _json_tensor(tensor, binary, position)
        tensors.append(decoded)
    outputs = [(output.name, output.parameters or {}) for output in request.outputs or []]
    inference = inference_from(tensors, request.parameters or {}, outputs, request.id)
    if position != len(binary):
        raise InvalidInputError(f"the body has {len(binary) - position} bytes no input claims")
    return inference


def infer(
    store: TableStore, metrics: Metrics, name: str, decode: Callable[[], Inference]
) -> tuple[Inference, LookupResult]:
    """The inference, for every transport (the REST route and the gRPC servicer call this): the request
    ``decode`` gives, looked up in table ``name`` (rows, or pooled bags), its stage times recorded."""
    inference = decode()
    result = store.lookup(
        name, inference.ids, inference.offsets, inference.pooling, inference.per_sample_weights
    )
    stages = metrics.stages(name)
    stages.hash_seconds.observe(result.hash_seconds)
    stages.lookup_seconds.observe(result.lookup_seconds)
    return inference, result


def encode_infer(name: str, inference: Inference, result: LookupResult) -> tuple[bytes, int | None]:
    """The response body, and the length of its JSON header when tensors follow it as bytes."""
    rows = result.rows
    output: dict[str, Any] = {
        "name": EMBEDDINGS,
        "datatype": "FP32",
        "shape": [int(rows.shape[0]), int(rows.shape[1])],
    }
    head: dict[str, Any] = {"model_name": name, "model_version": str(result.version)}
    if inference.request_id is not None:
        head["id"] = inference.request_id
    head["outputs"] = [output]
    if not inference.binary_output:
        output["data"] = rows.reshape(-1)
        return orjson.dumps(head, option=orjson.OPT_SERIALIZE_NUMPY), None
    data = rows_view(rows)  # no copy of its own: the one copy is into the body, after the header
    output["parameters"] = {"binary_data_size": data.nbytes}
    header = orjson.dumps(head)
    return header + data, len(header)
