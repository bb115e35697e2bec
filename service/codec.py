"""Request decoding and response encoding: JSON (pydantic models, orjson out) and the binary wire format.

Binary format (little-endian, no framing beyond one header):

- lookup request: body = n int64 ids; response body = n*d float32 row-major, ``X-Robez-Shape: n,d``.
- update request: ``X-Robez-Shape: n,d``, body = n int64 ids then n*d float32 gradients.
- multi-table lookup request: ``X-Robez-Tables: name=n,name=n,...``, body = the ids of each table in
  that order; response body = the rows of each table in that order, ``X-Robez-Shapes: n,d;n,d;...``.
- multi-table update request: ``X-Robez-Tables: name=n,...`` and ``X-Robez-Shapes: n,d;...`` in the same
  order, body = each table's update body (n int64 ids then n*d float32 gradients) in that order.
  Optionally ``X-Robez-Lookup: name=n,...``: a lookup part, its ids (int64) appended after the push's
  parts, read once the push is applied; the response body is then its rows as a multi-table lookup's
  (``X-Robez-Shapes``), with ``X-Robez-Version`` the push's versions and ``X-Robez-Lookup-Version`` the
  versions the rows were read at.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

import numpy as np
import orjson
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import Response
from torch import Tensor

from robez_core.config import (
    DEFAULT_MAX_LR,
    FLOAT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_INIT_SCALE,
    OptimizerConfig,
    TableConfig,
)
from robez_core.errors import InvalidInputError

from .config import TableSpec
from .errors import summarize_validation_errors
from .store import TABLE_NAME_PATTERN, LookupResult, Pooling, TableInfo, UpdateResult

OCTET_STREAM = "application/octet-stream"
SHAPE_HEADER = "X-Robez-Shape"
SHAPES_HEADER = "X-Robez-Shapes"
TABLES_HEADER = "X-Robez-Tables"
LOOKUP_HEADER = "X-Robez-Lookup"  # a push's lookup part: "name=n,..."; its ids follow the push's parts
LOOKUP_VERSION_HEADER = "X-Robez-Lookup-Version"  # the versions a push's lookup part was read at
VERSION_HEADER = "X-Robez-Version"
_IDS_DTYPE = np.dtype("<i8")
_ROWS_DTYPE = np.dtype("<f4")

Int64 = Annotated[int, Field(strict=True, ge=INT64_MIN, le=INT64_MAX)]
TableName = Annotated[str, Field(pattern=TABLE_NAME_PATTERN.pattern, examples=["demo"])]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# -- requests -------------------------------------------------------------------------------------


class LookupRequest(_Model):
    """Rows of ``ids``; with ``pooling`` sum/mean, bags starting at ``offsets`` (as nn.EmbeddingBag)."""

    ids: list[Int64] = Field(examples=[[1, 2, 3]])
    offsets: list[Int64] | None = None
    pooling: Literal["none", "sum", "mean"] = "none"
    per_sample_weights: list[float] | None = None

    def inputs(self) -> tuple[np.ndarray, Tensor | None, Pooling, Tensor | None]:
        """(ids int64 (n,) as a numpy array, offsets int64 (B,) | None, pooling, per_sample_weights float32
        (n,) | None): ``TableStore.lookup``'s arguments."""
        offsets = None if self.offsets is None else ids_tensor(self.offsets)
        weights = (
            None
            if self.per_sample_weights is None
            else torch.from_numpy(np.array(self.per_sample_weights, dtype=np.float32))
        )
        return np.array(self.ids, dtype=np.int64), offsets, self.pooling, weights


class TableLookup(LookupRequest):
    table: TableName


class MultiLookupRequest(_Model):
    lookups: list[TableLookup]


class UpdateRequest(_Model):
    """Gradients ``grads`` (n, d) of the output rows of ``ids`` (n,); ``lr`` overrides the table's."""

    ids: list[Int64] = Field(examples=[[1, 2]])
    # NaN/Inf must reach the table's own check (422 with a clear message), so this field allows them.
    grads: list[list[Annotated[float, Field(allow_inf_nan=True)]]] = Field(examples=[[[0.1] * 4, [0.2] * 4]])
    lr: float | None = Field(default=None, gt=0)


class TableUpdate(UpdateRequest):
    table: TableName


class MultiUpdateRequest(_Model):
    """One training step's pushes: each table at most once; applied all-or-nothing. ``lookups``: read
    once the push is applied (read-your-writes), answered in ``lookups`` of the response."""

    updates: list[TableUpdate]
    lookups: list[TableLookup] | None = None


class OptimizerModel(_Model):
    name: Literal["sgd", "adagrad", "adam"] = "sgd"
    lr: float = Field(default=0.01, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0)
    initial_accumulator_value: float = Field(default=0.0, ge=0)
    max_lr: float = Field(default=DEFAULT_MAX_LR, gt=0, le=FLOAT32_MAX)


class TableConfigModel(_Model):
    num_embeddings: int = Field(ge=1, le=INT64_MAX, examples=[1_000_000])
    embedding_dim: int = Field(ge=1, le=INT64_MAX, examples=[16])
    memory_size: int = Field(ge=1, le=INT64_MAX, examples=[65536])
    chunk_size: int = Field(default=32, ge=1, le=INT64_MAX)
    seed: int = Field(default=1024, ge=0, lt=2**32)
    val_offset: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    hash: Literal["paper", "fast"] = "paper"
    init_scale: float = Field(default=0.001, ge=0, le=MAX_INIT_SCALE)
    random_numbers: list[Int64] | None = None


class CreateTableRequest(_Model):
    """A new table: its config, optimizer (default sgd lr 0.01), optionally another table's array."""

    name: TableName
    config: TableConfigModel
    optimizer: OptimizerModel | None = None
    share_array_with: str | None = None

    def spec(self) -> TableSpec:
        """The core configs (ConfigError when the combination is invalid)."""
        config = TableConfig.from_dict(self.config.model_dump())
        optimizer = (
            OptimizerConfig.from_dict(self.optimizer.model_dump()) if self.optimizer else OptimizerConfig()
        )
        return TableSpec(config, optimizer, self.share_array_with)


# -- responses (documentation of what the encoders below write) --------------------------------------


class LookupTiming(_Model):
    hash_ms: float
    lookup_ms: float
    total_ms: float


class UpdateTiming(_Model):
    hash_ms: float
    apply_ms: float
    total_ms: float


class LookupResponse(_Model):
    table: str
    shape: tuple[int, int]
    embeddings: list[list[float]]
    version: int
    timing: LookupTiming


class MultiLookupResponse(_Model):
    results: list[LookupResponse]
    timing: LookupTiming


class UpdateResponse(_Model):
    table: str
    version: int
    timing: UpdateTiming


class MultiUpdateResponse(_Model):
    results: list[UpdateResponse]
    timing: UpdateTiming
    lookups: list[LookupResponse] | None = None  # the request's lookup part, if it had one


class TableInfoResponse(_Model):
    name: str
    config: TableConfigModel
    optimizer: OptimizerModel
    version: int
    compression_ratio: float
    memory_bytes: int
    array: str
    array_tables: list[str]


class TableListResponse(_Model):
    tables: list[TableInfoResponse]


class JSONBytesResponse(Response):
    """JSON rendered by orjson (numpy arrays natively, so embeddings never become Python floats)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


class RawResponse(Response):
    """A response of ready bytes whose extra headers come already encoded, lower-case names first.

    The hot routes answer thousands of small requests per second per core; Starlette's ``Response`` would
    lower-case and encode every header name and value of each (``init_headers``). Content-Length and
    Content-Type are appended last, as Starlette does."""

    def __init__(
        self,
        body: bytes | memoryview,
        content_type: bytes,
        headers: list[tuple[bytes, bytes]],
        status_code: int = 200,
    ) -> None:
        self.status_code = status_code
        self.background = None
        self.body = body  # a memoryview is sent as is by the ASGI server
        headers.append((b"content-length", b"%d" % len(body)))
        headers.append((b"content-type", content_type))
        self.raw_headers = headers


def json_bytes(content: Any) -> bytes:
    """``JSONBytesResponse``'s rendering, for a ``RawResponse``."""
    return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


# -- decoding ---------------------------------------------------------------------------------------


def _validated(model: type[_Model], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise InvalidInputError(summarize_validation_errors(list(exc.errors()))) from exc


def ids_tensor(ids: list[int]) -> Tensor:
    """int64 (n,) from already range-checked ints (through numpy: 2-3x faster than torch.tensor)."""
    return torch.from_numpy(np.array(ids, dtype=np.int64))


def decode_lookup_json(body: bytes) -> LookupRequest:
    request: LookupRequest = _validated(LookupRequest, body)
    return request


def decode_create_json(body: bytes) -> CreateTableRequest:
    request: CreateTableRequest = _validated(CreateTableRequest, body)
    return request


def decode_multi_lookup_json(body: bytes) -> MultiLookupRequest:
    request: MultiLookupRequest = _validated(MultiLookupRequest, body)
    return request


def decode_update_json(body: bytes, embedding_dim: int) -> tuple[np.ndarray, np.ndarray, float | None]:
    """(ids int64 (n,), grads float32 (n, d), lr) from a JSON update, the arrays as numpy arrays."""
    request: UpdateRequest = _validated(UpdateRequest, body)
    return (*_update_arrays(request, embedding_dim), request.lr)


def _update_arrays(request: UpdateRequest, embedding_dim: int) -> tuple[np.ndarray, np.ndarray]:
    if any(len(row) != embedding_dim for row in request.grads):
        raise InvalidInputError(f"grads must be rows of embedding_dim = {embedding_dim} values")
    if len(request.grads) != len(request.ids):
        raise InvalidInputError(f"grads has {len(request.grads)} rows for {len(request.ids)} ids")
    grads = np.asarray(request.grads, dtype=np.float64).reshape(len(request.grads), embedding_dim)
    # Values beyond float32's range become Inf here, which the table then rejects like any Inf.
    with np.errstate(over="ignore"):
        grads32 = grads.astype(np.float32)
    return np.array(request.ids, dtype=np.int64), grads32


TableArrays = tuple[str, np.ndarray, np.ndarray, float | None]
"""(table, ids int64 (n,), grads float32 (n, d), lr or None) of one table's part of a multi-table push."""


def decode_multi_update_json(
    body: bytes, embedding_dim: Callable[[str], int]
) -> tuple[list[TableArrays], list[TableLookup]]:
    """The parts of a JSON multi-table push and its lookup part (empty without one); ``embedding_dim
    (table)`` resolves each table (NotFoundError for an unknown one)."""
    request: MultiUpdateRequest = _validated(MultiUpdateRequest, body)
    parts = []
    for item in request.updates:
        try:
            ids, grads = _update_arrays(item, embedding_dim(item.table))
        except InvalidInputError as error:
            raise InvalidInputError(f"table {item.table!r}: {error}") from error
        parts.append((item.table, ids, grads, item.lr))
    _check_distinct([part[0] for part in parts])
    return parts, request.lookups or []


def split_lookup_part(
    body: bytes, lookup_header: str | None
) -> tuple[bytes | memoryview, list[tuple[str, np.ndarray]]]:
    """A binary push's body without its lookup part, and that part: (table, ids int64 (n,)) per
    ``X-Robez-Lookup: name=n,...`` entry, the ids being the body's last 8 * sum(n) bytes. No header: the
    body as it is and no lookups."""
    if lookup_header is None:
        return body, []
    tables = parse_tables_header(lookup_header, LOOKUP_HEADER)
    size = sum(count for _, count in tables) * _IDS_DTYPE.itemsize
    if size > len(body):
        raise InvalidInputError(
            f"{LOOKUP_HEADER}: {lookup_header} needs {size} bytes of ids after the push; "
            f"the body has {len(body)}"
        )
    view = memoryview(body)
    split = len(body) - size
    ids = split_ids(view[split:], [count for _, count in tables])
    return view[:split], [(name, part) for (name, _), part in zip(tables, ids, strict=True)]


def decode_multi_update_binary(
    body: bytes | memoryview, tables_header: str | None, shapes_header: str | None
) -> list[TableArrays]:
    """The parts of a binary multi-table push: ``X-Robez-Tables: name=n,...`` and ``X-Robez-Shapes:
    n,d;...`` in body order, each table's body n int64 ids then n*d float32 (as one-table updates)."""
    tables = parse_tables_header(tables_header)
    if not shapes_header:
        raise InvalidInputError(f"a binary multi-table update needs the header {SHAPES_HEADER}: n,d;n,d;...")
    shapes = [parse_shape(part, SHAPES_HEADER) for part in shapes_header.split(";")]
    if len(shapes) != len(tables):
        raise InvalidInputError(
            f"{TABLES_HEADER} names {len(tables)} tables, {SHAPES_HEADER} has {len(shapes)} shapes"
        )
    _check_distinct([name for name, _ in tables])
    sizes = []
    for (name, count), (n, d) in zip(tables, shapes, strict=True):
        if count != n:
            raise InvalidInputError(f"table {name!r}: {TABLES_HEADER} says {count} ids, {SHAPES_HEADER} {n}")
        sizes.append(n * _IDS_DTYPE.itemsize + n * d * _ROWS_DTYPE.itemsize)
    if len(body) != sum(sizes):
        raise InvalidInputError(
            f"{SHAPES_HEADER}: {shapes_header} needs {sum(sizes)} bytes (per table n int64 ids, "
            f"n*d float32), got {len(body)}"
        )
    # Every table's ids into one array and its gradients into another, one table after the other: each
    # table's arrays are views of them (writable, their own copies of the body), and a step of tables
    # over one array reads them all as one (kernels.coalesce_table_pushes: no copy of the 3.4 MB of a
    # DLRM push's gradients to join them).
    all_ids = np.empty(sum(n for n, _ in shapes), dtype=np.int64)
    all_grads = np.empty(sum(n * d for n, d in shapes), dtype=np.float32)
    parts: list[TableArrays] = []
    start = ids_at = grads_at = 0
    for (name, _), (n, d) in zip(tables, shapes, strict=True):
        ids = all_ids[ids_at : ids_at + n]
        grads = all_grads[grads_at : grads_at + n * d]
        ids[:] = np.frombuffer(body, dtype=_IDS_DTYPE, count=n, offset=start)
        start += n * _IDS_DTYPE.itemsize
        grads[:] = np.frombuffer(body, dtype=_ROWS_DTYPE, count=n * d, offset=start)
        start += n * d * _ROWS_DTYPE.itemsize
        parts.append((name, ids, grads.reshape(n, d), None))
        ids_at += n
        grads_at += n * d
    return parts


def _check_distinct(names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise InvalidInputError(f"table {name!r} appears twice in one multi-table update; send it once")
        seen.add(name)


def decode_ids(body: bytes | memoryview) -> np.ndarray:
    """int64 (n,) numpy array (writable, its own copy) from a little-endian int64 body."""
    if len(body) % _IDS_DTYPE.itemsize:
        raise InvalidInputError(f"a binary ids body must be a multiple of 8 bytes, got {len(body)}")
    return np.frombuffer(body, dtype=_IDS_DTYPE).astype(np.int64)


def is_count(text: str) -> bool:
    """Whether ``text`` is a non-negative integer in ASCII digits: ``str.isdigit`` also takes "²" or
    "٣", which ``int`` then refuses (or reads), so header integers are checked with this."""
    return text.isascii() and text.isdigit()


def parse_shape(header: str | None, header_name: str = SHAPE_HEADER) -> tuple[int, int]:
    """``"n,d"`` -> (n, d); ``header_name`` for the message."""
    if header is None:
        raise InvalidInputError(f"a binary update needs the header {SHAPE_HEADER}: n,d")
    parts = header.split(",")
    if len(parts) != 2 or not all(is_count(part.strip()) for part in parts):
        raise InvalidInputError(f"{header_name} must be 'n,d' with non-negative integers, got {header!r}")
    return int(parts[0]), int(parts[1])


def decode_update_binary(body: bytes | memoryview, shape_header: str | None) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64 (n,), grads float32 (n, d)) numpy arrays (writable, their own copies) from n int64 ids
    followed by n*d float32 values."""
    n, d = parse_shape(shape_header)
    expected = n * _IDS_DTYPE.itemsize + n * d * _ROWS_DTYPE.itemsize
    if len(body) != expected:
        raise InvalidInputError(
            f"{SHAPE_HEADER}: {n},{d} needs {expected} bytes (n int64 ids, n*d float32), got {len(body)}"
        )
    split = n * _IDS_DTYPE.itemsize
    ids = np.frombuffer(body, dtype=_IDS_DTYPE, count=n).astype(np.int64)
    grads = np.frombuffer(body, dtype=_ROWS_DTYPE, offset=split).astype(np.float32).reshape(n, d)
    return ids, grads


def parse_tables_header(header: str | None, header_name: str = TABLES_HEADER) -> list[tuple[str, int]]:
    """``"name=n,name=n"`` -> [(name, n), ...] for a binary multi-table request; ``header_name`` for the
    message."""
    if not header:
        raise InvalidInputError(f"a binary multi-table request needs the header {header_name}: name=n,...")
    items = []
    for part in header.split(","):
        name, sep, count = part.strip().partition("=")
        if not sep or not is_count(count) or not TABLE_NAME_PATTERN.fullmatch(name):
            raise InvalidInputError(f"{header_name} must be 'name=n,name=n,...', got {header!r}")
        items.append((name, int(count)))
    return items


def split_ids(body: bytes | memoryview, counts: list[int]) -> list[np.ndarray]:
    """Cut one binary ids body into one int64 array per table."""
    ids = decode_ids(body)
    if int(ids.shape[0]) != sum(counts):
        raise InvalidInputError(
            f"{TABLES_HEADER} names {sum(counts)} ids, the body holds {int(ids.shape[0])}"
        )
    return np.split(ids, np.cumsum(counts[:-1])) if counts else []


# -- encoding ---------------------------------------------------------------------------------------


def milliseconds(seconds: float) -> float:
    """``seconds`` in milliseconds to 4 decimals: the float nearest a whole number of 0.1 us, within half
    of one of ``seconds * 1000`` (``round(seconds * 1000.0, 4)`` costs three times as much, and three of
    these are in every JSON answer; the two differ only at exact ties)."""
    return round(seconds * 1e7) / 1e4


def lookup_timing(hash_seconds: float, lookup_seconds: float, total_seconds: float) -> dict[str, float]:
    return {
        "hash_ms": milliseconds(hash_seconds),
        "lookup_ms": milliseconds(lookup_seconds),
        "total_ms": milliseconds(total_seconds),
    }


def lookup_json(table: str, result: LookupResult, total_seconds: float) -> dict[str, Any]:
    rows = result.rows
    return {
        "table": table,
        "shape": [int(rows.shape[0]), int(rows.shape[1])],
        "embeddings": rows,
        "version": result.version,
        "timing": lookup_timing(result.hash_seconds, result.lookup_seconds, total_seconds),
    }


def rows_bytes(rows: np.ndarray | Tensor) -> bytes:
    """float32 (n, d) -> little-endian row-major bytes."""
    return np.ascontiguousarray(_array(rows), dtype=_ROWS_DTYPE).tobytes()


def multi_rows_binary(rows: Sequence[np.ndarray | Tensor]) -> tuple[str, bytes]:
    """A binary multi-table rows answer: the ``X-Robez-Shapes`` value (``n,d;...``) and the body (each
    table's rows in that order)."""
    shapes = ";".join(f"{int(r.shape[0])},{int(r.shape[1])}" for r in rows)
    return shapes, b"".join(rows_bytes(r) for r in rows)


def _array(rows: np.ndarray | Tensor) -> np.ndarray:
    return rows if isinstance(rows, np.ndarray) else rows.numpy()


def rows_view(rows: np.ndarray | Tensor) -> memoryview:
    """float32 (n, d) -> its little-endian row-major bytes as a view, without copying them when ``rows``
    already is that (a response body: a 4096-id lookup's rows are 1 MiB). ``rows`` must not be written
    afterwards: the transport may still be sending from it after the handler returns."""
    array = _array(rows)
    if array.dtype == _ROWS_DTYPE and array.flags.c_contiguous and array.size:  # the usual case
        return array.data.cast("B")
    return np.ascontiguousarray(array, dtype=_ROWS_DTYPE).reshape(-1).data.cast("B")


def update_json(table: str, result: UpdateResult, total_seconds: float) -> dict[str, Any]:
    return {
        "table": table,
        "version": result.version,
        "timing": {
            "hash_ms": milliseconds(result.hash_seconds),
            "apply_ms": milliseconds(result.apply_seconds),
            "total_ms": milliseconds(total_seconds),
        },
    }


def table_info_json(info: TableInfo) -> dict[str, Any]:
    config = info.config.to_dict()
    if config.get("random_numbers") is not None:
        config["random_numbers"] = list(config["random_numbers"])
    return {
        "name": info.name,
        "config": config,
        "optimizer": info.optimizer.to_dict(),
        "version": info.version,
        "compression_ratio": info.config.compression_ratio,
        "memory_bytes": info.memory_bytes,
        "array": info.array,
        "array_tables": list(info.array_tables),
    }
