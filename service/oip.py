"""The Open Inference Protocol v2 (KServe / Triton REST) over robez tables: decoding and encoding.

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
from .store import LookupResult, Pooling

HEADER_LENGTH = "Inference-Header-Content-Length"
IDS, OFFSETS, WEIGHTS, EMBEDDINGS = "ids", "offsets", "per_sample_weights", "embeddings"
_INPUT_TYPES = {IDS: "INT64", OFFSETS: "INT64", WEIGHTS: "FP32"}
_DTYPES: dict[str, np.dtype[Any]] = {"INT64": np.dtype("<i8"), "FP32": np.dtype("<f4")}
_POOLINGS: tuple[str, ...] = ("none", "sum", "mean")
_REQUEST_PARAMETERS = frozenset({"pooling", "binary_data_output"})


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
        "platform": "robez",
        "inputs": [
            {"name": IDS, "datatype": "INT64", "shape": [-1]},
            {"name": OFFSETS, "datatype": "INT64", "shape": [-1]},
            {"name": WEIGHTS, "datatype": "FP32", "shape": [-1]},
        ],
        "outputs": [{"name": EMBEDDINGS, "datatype": "FP32", "shape": [-1, embedding_dim]}],
    }


def _flag(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidInputError(f"{what} must be true or false, got {value!r}")
    return value


def _tensor(tensor: InferTensor, binary: memoryview, position: int) -> tuple[np.ndarray, int]:
    """The tensor's values (1-D, little-endian) and the position after its bytes in ``binary``."""
    expected = _INPUT_TYPES.get(tensor.name)
    if expected is None:
        raise InvalidInputError(
            f"unknown input {tensor.name!r}; the inputs are {', '.join(sorted(_INPUT_TYPES))}"
        )
    if tensor.datatype != expected:
        raise InvalidInputError(f"input {tensor.name!r} must be {expected}, got {tensor.datatype!r}")
    if len(tensor.shape) != 1 or tensor.shape[0] < 0:
        raise InvalidInputError(f"input {tensor.name!r} must have shape [n], got {tensor.shape}")
    count = tensor.shape[0]
    dtype = _DTYPES[expected]
    parameters = tensor.parameters or {}
    unknown = set(parameters) - {"binary_data_size"}
    if unknown:
        raise InvalidInputError(f"input {tensor.name!r}: unknown parameters {sorted(unknown)}")
    size = parameters.get("binary_data_size")
    if size is not None:
        if tensor.data is not None:
            raise InvalidInputError(f"input {tensor.name!r} has both data and binary_data_size")
        if type(size) is not int or size != count * dtype.itemsize:
            raise InvalidInputError(
                f"input {tensor.name!r}: binary_data_size must be {count * dtype.itemsize} "
                f"({count} x {dtype.itemsize} bytes), got {size!r}"
            )
        if position + size > len(binary):
            raise InvalidInputError(
                f"input {tensor.name!r}: the body holds {len(binary) - position} more bytes, not {size}"
            )
        return np.frombuffer(binary, dtype=dtype, count=count, offset=position), position + size
    if tensor.data is None:
        raise InvalidInputError(f"input {tensor.name!r} needs data (or binary_data_size with binary data)")
    data = tensor.data
    if len(data) != count:
        raise InvalidInputError(f"input {tensor.name!r}: shape [{count}] but {len(data)} values (flat)")
    if expected == "INT64":
        if not all(type(value) is int for value in data):
            raise InvalidInputError(f"input {tensor.name!r}: INT64 data must be a flat list of integers")
        try:
            return np.array(data, dtype=np.int64), position
        except OverflowError:
            raise InvalidInputError(f"input {tensor.name!r}: a value is outside the int64 range") from None
    if not all(type(value) in (int, float) for value in data):
        raise InvalidInputError(f"input {tensor.name!r}: FP32 data must be a flat list of numbers")
    with np.errstate(over="ignore"):  # beyond float32's range: Inf, which the lookup rejects
        return np.array(data, dtype=np.float64).astype(np.float32), position


def decode_infer(body: bytes, header_length: str | None) -> Inference:
    """An infer request from its body (and ``Inference-Header-Content-Length`` in binary mode)."""
    if header_length is None:
        json_part, binary = body, memoryview(b"")
    else:
        if not is_count(header_length.strip()) or int(header_length) > len(body):
            raise InvalidInputError(
                f"{HEADER_LENGTH} must be the byte length of the JSON header (at most {len(body)}), "
                f"got {header_length!r}"
            )
        split = int(header_length)
        json_part, binary = body[:split], memoryview(body)[split:]
    try:
        request = InferRequest.model_validate_json(json_part)
    except ValidationError as exc:
        raise InvalidInputError(summarize_validation_errors(list(exc.errors()))) from exc
    parameters = request.parameters or {}
    unknown = set(parameters) - _REQUEST_PARAMETERS
    if unknown:
        raise InvalidInputError(
            f"unknown request parameters {sorted(unknown)}; known: {sorted(_REQUEST_PARAMETERS)}"
        )
    pooling = parameters.get("pooling", "none")
    if pooling not in _POOLINGS:
        raise InvalidInputError(f"parameter pooling must be one of {_POOLINGS}, got {pooling!r}")
    binary_output = _flag(parameters.get("binary_data_output", False), "parameter binary_data_output")
    for output in request.outputs or []:
        if output.name != EMBEDDINGS:
            raise InvalidInputError(f"unknown output {output.name!r}; the output is {EMBEDDINGS!r}")
        output_parameters = output.parameters or {}
        if set(output_parameters) - {"binary_data"}:
            raise InvalidInputError(f"output {EMBEDDINGS!r}: the only parameter is binary_data")
        if "binary_data" in output_parameters:
            binary_output = _flag(output_parameters["binary_data"], "output parameter binary_data")
    arrays: dict[str, np.ndarray] = {}
    position = 0
    for tensor in request.inputs:
        if tensor.name in arrays:
            raise InvalidInputError(f"input {tensor.name!r} is given twice")
        arrays[tensor.name], position = _tensor(tensor, binary, position)
    if position != len(binary):
        raise InvalidInputError(f"the body has {len(binary) - position} bytes no input claims")
    if IDS not in arrays:
        raise InvalidInputError(f"the input {IDS!r} (INT64, shape [n]) is required")
    offsets, weights = arrays.get(OFFSETS), arrays.get(WEIGHTS)
    return Inference(
        ids=arrays[IDS].astype(np.int64),
        offsets=None if offsets is None else torch.from_numpy(offsets.astype(np.int64)),
        pooling=pooling,
        per_sample_weights=None if weights is None else torch.from_numpy(weights.astype(np.float32)),
        request_id=request.id,
        binary_output=binary_output,
    )


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
