"""A ``ModelInferRequest`` read straight from its protobuf wire bytes, bounded before anything is built.

The generated parser (``pb.ModelInferRequest.FromString``) builds every repeated value first: 33 million
``int64_contents`` in a 63 MiB message became a C array, then a Python list, then an array, seconds and
gigabytes before ``max_ids_per_request`` could refuse them. Here the message is walked field by field:

- ``raw_input_contents`` and packed ``fp32_contents`` are handed on as views of the message (no copy);
- packed ``int64_contents`` are counted from their bytes (one terminator byte per varint) and refused past
  ``max_ids`` before they are decoded, then decoded at once into a numpy array;
- the message may hold only so many fields, inputs, outputs, parameters and dimensions (``_MAX_*``), so a
  message of a million tiny fields costs no more than a short one.

Field numbers are KServe's ``grpc_predict_v2.proto`` (Triton's ``service_pb2``: the same).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from robez_core.errors import InvalidInputError, LimitExceededError

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5
_MAX_FIELDS = 256  # top-level fields of one request; a real one has ~10
_MAX_TENSORS = 16  # inputs (3 known) or outputs (1 known)
_MAX_PARAMETERS = 64
_MAX_DIMS = 8
_MAX_VARINT_BYTES = 10
_CHUNK_BYTES = 1 << 20  # varints are counted this many bytes at a time (bounded temporaries)
# InferTensorContents' fields, by number.
CONTENTS_FIELDS = {
    1: "bool_contents",
    2: "int_contents",
    3: "int64_contents",
    4: "uint_contents",
    5: "uint64_contents",
    6: "fp32_contents",
    7: "fp64_contents",
    8: "bytes_contents",
}
_INT64_CONTENTS, _FP32_CONTENTS = 3, 6
_DOUBLE = struct.Struct("<d")


class WireError(InvalidInputError):
    """The message is not a well-formed ``ModelInferRequest`` (422, INVALID_ARGUMENT)."""


@dataclass
class WireTensor:
    """One ``InferInputTensor``: ``contents`` maps a field of ``InferTensorContents`` (its number) to the
    bytes it carries (packed values)."""

    name: str = ""
    datatype: str = ""
    shape: list[int] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)
    contents: dict[int, memoryview] = field(default_factory=dict)


@dataclass
class WireRequest:
    """The fields of a ``ModelInferRequest`` (shapes and values as the message gives them)."""

    model_name: str = ""
    model_version: str = ""
    id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    inputs: list[WireTensor] = field(default_factory=list)
    outputs: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    raw_input_contents: list[memoryview] = field(default_factory=list)


def _varint(data: bytes | memoryview, position: int) -> tuple[int, int]:
    """The varint at ``position`` (as an unsigned 64-bit value) and the position after it."""
    end = len(data)
    if position < end and data[position] < 0x80:  # one byte: tags, lengths and dimensions of small calls
        return data[position], position + 1
    result = shift = 0
    while position < end:
        byte = data[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & 0xFFFFFFFFFFFFFFFF, position
        shift += 7
        if shift >= 7 * _MAX_VARINT_BYTES:
            break
    raise WireError("invalid request message: a varint is truncated or longer than 10 bytes")


def _fields(data: memoryview, limit: int, what: str) -> Any:
    """(field number, wire type, value) of each field of the message ``data``: an int for varints and
    fixed-size values (their bytes for fixed32/64), a memoryview for length-delimited ones."""
    position, end, count = 0, len(data), 0
    while position < end:
        count += 1
        if count > limit:
            raise WireError(f"invalid request message: {what} has more than {limit} fields")
        key, position = _varint(data, position)
        number, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            value, position = _varint(data, position)
            yield number, wire_type, value
        elif wire_type == _LENGTH:
            size, position = _varint(data, position)
            if size > end - position:
                raise WireError(f"invalid request message: a field of {what} runs past its end")
            yield number, wire_type, data[position : position + size]
            position += size
        elif wire_type in (_FIXED64, _FIXED32):
            size = 8 if wire_type == _FIXED64 else 4
            if size > end - position:
                raise WireError(f"invalid request message: a field of {what} runs past its end")
            yield number, wire_type, data[position : position + size]
            position += size
        else:
            raise WireError(f"invalid request message: wire type {wire_type} in {what}")


def _string(value: Any, what: str) -> str:
    if not isinstance(value, memoryview):
        raise WireError(f"invalid request message: {what} must be a string")
    try:
        return str(value, "utf-8")
    except UnicodeDecodeError:
        raise WireError(f"invalid request message: {what} is not UTF-8") from None


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _parameter(data: memoryview) -> Any:
    """An ``InferParameter``'s value (bool, int, str or float; None when it sets none)."""
    value: Any = None
    for number, wire_type, raw in _fields(data, _MAX_PARAMETERS, "a parameter"):
        if number == 1 and wire_type == _VARINT:
            value = bool(raw)
        elif number == 2 and wire_type == _VARINT:
            value = _signed(raw)
        elif number == 3:
            value = _string(raw, "a string parameter")
        elif number == 4 and wire_type == _FIXED64:
            value = _DOUBLE.unpack(raw)[0]
        elif number == 5 and wire_type == _VARINT:
            value = raw
    return value


def _parameter_entry(data: memoryview, parameters: dict[str, Any]) -> None:
    """One entry of a ``map<string, InferParameter>`` into ``parameters``."""
    if len(parameters) >= _MAX_PARAMETERS:
        raise WireError(f"invalid request message: more than {_MAX_PARAMETERS} parameters")
    key, value = "", None
    for number, _, raw in _fields(data, 8, "a parameter entry"):
        if number == 1:
            key = _string(raw, "a parameter's name")
        elif number == 2:
            value = _parameter(raw)
    parameters[key] = value


def _shape(value: Any, wire_type: int, shape: list[int]) -> None:
    if wire_type == _VARINT:
        shape.append(_signed(value))
    else:
        position = 0
        while position < len(value):
            dim, position = _varint(value, position)
            shape.append(_signed(dim))
            if len(shape) > _MAX_DIMS:
                break
    if len(shape) > _MAX_DIMS:
        raise WireError(f"an input has more than {_MAX_DIMS} dimensions")


def _tensor(data: memoryview) -> WireTensor:
    tensor = WireTensor()
    for number, wire_type, value in _fields(data, _MAX_FIELDS, "an input"):
        if number == 1:
            tensor.name = _string(value, "an input's name")
        elif number == 2:
            tensor.datatype = _string(value, "an input's datatype")
        elif number == 3:
            _shape(value, wire_type, tensor.shape)
        elif number == 4:
            _parameter_entry(value, tensor.parameters)
        elif number == 5:
            for contents_number, contents_type, values in _fields(value, 16, "an input's contents"):
                if contents_number in tensor.contents or contents_type != _LENGTH:
                    # Proto3 writers pack repeated numbers into one field; robez takes only that form.
                    what = CONTENTS_FIELDS.get(contents_number, str(contents_number))
                    raise WireError(f"input contents: {what} must be sent packed, once (proto3's encoding)")
                tensor.contents[contents_number] = values
    return tensor


def _output(data: memoryview) -> tuple[str, dict[str, Any]]:
    name = ""
    parameters: dict[str, Any] = {}
    for number, _, value in _fields(data, _MAX_FIELDS, "an output"):
        if number == 1:
            name = _string(value, "an output's name")
        elif number == 2:
            _parameter_entry(value, parameters)
    return name, parameters


def parse_request(message: bytes) -> WireRequest:
    """The fields of the ``ModelInferRequest`` serialized in ``message``; its tensors' bytes stay views of
    it. Raises ``WireError`` (422) when it is malformed or holds more fields than a request may."""
    request = WireRequest()
    for number, _, value in _fields(memoryview(message), _MAX_FIELDS, "the request"):
        if number == 1:
            request.model_name = _string(value, "model_name")
        elif number == 2:
            request.model_version = _string(value, "model_version")
        elif number == 3:
            request.id = _string(value, "id")
        elif number == 4:
            _parameter_entry(value, request.parameters)
        elif number == 5:
            if len(request.inputs) >= _MAX_TENSORS:
                raise WireError(f"invalid request message: more than {_MAX_TENSORS} inputs")
            request.inputs.append(_tensor(value))
        elif number == 6:
            if len(request.outputs) >= _MAX_TENSORS:
                raise WireError(f"invalid request message: more than {_MAX_TENSORS} outputs")
            request.outputs.append(_output(value))
        elif number == 7:
            if len(request.raw_input_contents) >= _MAX_TENSORS:
                raise WireError(f"invalid request message: more than {_MAX_TENSORS} raw_input_contents")
            request.raw_input_contents.append(value)
    return request


def count_varints(packed: memoryview) -> int:
    """How many varints the packed bytes hold (their terminator bytes), counted without decoding them."""
    raw = np.frombuffer(packed, dtype=np.uint8)
    count = 0
    for start in range(0, raw.size, _CHUNK_BYTES):
        count += int(np.count_nonzero(raw[start : start + _CHUNK_BYTES] < 0x80))
    return count


def decode_int64s(packed: memoryview, max_count: int, what: str) -> np.ndarray:
    """Packed int64 varints as an int64 array, refused (``LimitExceededError``, before any array of them is
    made) when there are more than ``max_count``."""
    count = count_varints(packed)
    if count > max_count:
        raise LimitExceededError(
            f"{what}: {count} values in one request; the limit is max_ids_per_request={max_count}"
        )
    raw = np.frombuffer(packed, dtype=np.uint8)
    if raw.size == 0:
        return np.zeros(0, dtype=np.int64)
    if raw[-1] >= 0x80 or raw.size > _MAX_VARINT_BYTES * count:
        raise WireError(f"invalid request message: {what} holds a truncated or over-long varint")
    if raw.size == count:  # every value below 128: one byte each
        return raw.astype(np.int64)
    ends = np.flatnonzero(raw < 0x80)
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if int(lengths.max()) > _MAX_VARINT_BYTES:
        raise WireError(f"invalid request message: {what} holds a varint longer than 10 bytes")
    place = np.arange(raw.size) - np.repeat(starts, lengths)
    groups = (raw & 0x7F).astype(np.uint64) << (place * 7).astype(np.uint64)
    decoded: np.ndarray = np.bitwise_or.reduceat(groups, starts).view(np.int64)
    return decoded


def fp32_values(packed: memoryview, what: str) -> memoryview:
    """Packed ``fp32_contents`` as they are: little-endian float32, the raw tensor format (no copy)."""
    if len(packed) % 4:
        raise WireError(f"invalid request message: {what} is not a whole number of float32 values")
    return packed
