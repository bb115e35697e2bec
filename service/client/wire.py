"""The wire format of the robez HTTP API as the clients speak it: headers, binary encodings, errors.

Binary bodies are little-endian whatever the host: ids int64, rows and gradients float32 row-major.
One table: ``X-Robez-Shape: n,d``. Several tables in one request: ``X-Robez-Tables: name=n,...`` and
``X-Robez-Shapes: n,d;...`` in the same order (``docs/api.md``). Nothing here does I/O, so the load test
and other tools may use it on its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import httpx
import numpy as np
import torch
from torch import Tensor

OCTET_STREAM = "application/octet-stream"
SHAPE_HEADER = "X-Robez-Shape"
SHAPES_HEADER = "X-Robez-Shapes"  # several tables: "n,d;n,d;..." in request order
TABLES_HEADER = "X-Robez-Tables"  # several tables: "name=n,name=n,..." in body order
VERSION_HEADER = "X-Robez-Version"  # several tables: "v,v,..." in request order
LOOKUP_HEADER = "X-Robez-Lookup"  # a push's lookup part: "name=n,..."; its ids follow the push's parts
LOOKUP_VERSION_HEADER = "X-Robez-Lookup-Version"  # the versions a push's lookup part was read at
MIN_VERSION_HEADER = "X-Robez-Min-Version"  # read-your-writes: wait until the server has this version
IDEMPOTENCY_HEADER = "Idempotency-Key"
REPLICA_HEADER = "X-Robez-Replica"  # set by replicas, which apply a resent Idempotency-Key once
# On a replica's 413 for a push over one log entry: the largest update body that fits (the client splits).
MAX_UPDATE_BYTES_HEADER = "X-Robez-Max-Update-Bytes"
# Explicit byte orders: the wire format is little-endian whatever the host is.
IDS_DTYPE = np.dtype("<i8")
ROWS_DTYPE = np.dtype("<f4")

IdsLike = Tensor | np.ndarray | Sequence[int]


class RobezClientError(Exception):
    """A request the server answered with an error status (or a response the client cannot read).

    Attributes:
        status: HTTP status code of the answer (also for ``"ClientDecodeError"``: a 2xx answer whose
            body or shape headers the client could not read).
        error: the server's message (``body["error"]``), or the raw body text when it is not JSON.
        error_type: the server's error class name (``body["error_type"]``, e.g. ``"NotFoundError"``).
        retry_after: seconds from a ``Retry-After`` header (503 when the server is saturated), or None.
        max_update_bytes: from a replica's 413 for a push over one log entry, the largest update body
            (ids * 8 + ids * dim * 4 bytes) it takes; None otherwise.
    """

    def __init__(
        self,
        status: int,
        error: str,
        error_type: str | None = None,
        retry_after: float | None = None,
        max_update_bytes: int | None = None,
    ):
        super().__init__(f"{status} {error_type or 'error'}: {error}")
        self.status = status
        self.error = error
        self.error_type = error_type
        self.retry_after = retry_after
        self.max_update_bytes = max_update_bytes


def ids_array(ids: IdsLike) -> np.ndarray:
    """``ids`` as a 1-D little-endian int64 array (a view where they already are one, else a copy).

    Raises:
        ValueError: ids not 1-D, not integers, or outside int64.
    """
    if isinstance(ids, Tensor):
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(f"ids must be an integer tensor, got {ids.dtype}")
        array = ids.detach().to(device="cpu", dtype=torch.int64).numpy()
    else:
        try:
            array = np.asarray(ids)
        except OverflowError as exc:
            raise ValueError("ids must fit in int64") from exc
        if array.size == 0:
            array = array.astype(np.int64)
        if array.dtype.kind not in "iu":
            raise ValueError(f"ids must be integers, got dtype {array.dtype}")
        if array.dtype == np.uint64 and array.size and int(array.max()) > np.iinfo(np.int64).max:
            raise ValueError("ids must fit in int64")
    if array.ndim != 1:
        raise ValueError(f"ids must be 1-D, got shape {tuple(array.shape)}")
    return array.astype(IDS_DTYPE, copy=False)


def rows_array(rows: Tensor | np.ndarray) -> np.ndarray:
    """A float (n, d) matrix as a little-endian float32 array: a view (strides kept) where it already
    is one, so that ``tobytes()`` gathers it into the body in one pass."""
    array = rows.detach().to(device="cpu", dtype=torch.float32).numpy() if isinstance(rows, Tensor) else rows
    array = np.asarray(array)
    if array.ndim != 2:
        raise ValueError(f"rows must be 2-D (n, d), got shape {tuple(array.shape)}")
    return array.astype(ROWS_DTYPE, copy=False)


def encode_ids(ids: IdsLike) -> tuple[bytes, int]:
    """Encodes a 1-D sequence of ids as little-endian int64 bytes; returns (body, n).

    Raises:
        ValueError: ids not 1-D, not integers, or outside int64.
    """
    array = ids_array(ids)
    return array.tobytes(), int(array.shape[0])


def encode_rows(rows: Tensor | np.ndarray) -> tuple[bytes, tuple[int, int]]:
    """Encodes a float (n, d) matrix as little-endian float32 row-major bytes; returns (body, (n, d))."""
    array = rows_array(rows)
    n, d = array.shape
    return array.tobytes(), (int(n), int(d))


def encode_update(ids: IdsLike, grads: Tensor | np.ndarray) -> tuple[bytes, str]:
    """Encodes a gradient push: n int64 ids then n*d float32 gradients; returns (body, shape header).

    Args:
        ids: (n,) integer ids.
        grads: (n, d) gradients of the looked-up rows (dLoss/dRow).
    """
    ids_body, n = encode_ids(ids)
    grads_body, (grad_rows, d) = encode_rows(grads)
    if grad_rows != n:
        raise ValueError(f"grads has {grad_rows} rows for {n} ids")
    return ids_body + grads_body, f"{n},{d}"


def parse_shape(header: str | None) -> tuple[int, int]:
    """Parses ``X-Robez-Shape: n,d``."""
    if header is None:
        raise ValueError(f"response has no {SHAPE_HEADER} header")
    parts = header.split(",")
    try:
        n, d = (int(part) for part in parts)
    except ValueError:
        raise ValueError(f"malformed {SHAPE_HEADER} header {header!r}; expected 'n,d'") from None
    if n < 0 or d < 0:
        raise ValueError(f"negative {SHAPE_HEADER} {header!r}")
    return n, d


def decode_rows(body: bytes | memoryview, shape: tuple[int, int]) -> Tensor:
    """Decodes little-endian float32 row-major bytes into a new float32 (n, d) tensor."""
    n, d = shape
    if len(body) != n * d * ROWS_DTYPE.itemsize:
        raise ValueError(f"body has {len(body)} bytes; shape {n},{d} needs {n * d * ROWS_DTYPE.itemsize}")
    # astype copies into a writable native-order array, so the tensor owns its memory.
    array = np.frombuffer(body, dtype=ROWS_DTYPE).astype(np.float32)
    return torch.from_numpy(array).reshape(n, d)


def error_from_response(response: httpx.Response) -> RobezClientError:
    error: str = response.text or response.reason_phrase
    error_type: str | None = None
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = str(body.get("error", body.get("detail", error)))
        error_type = body.get("error_type")
    retry_after: float | None = None
    if "Retry-After" in response.headers:
        try:
            retry_after = float(response.headers["Retry-After"])
        except ValueError:
            retry_after = None
    hint = response.headers.get(MAX_UPDATE_BYTES_HEADER, "")
    max_update_bytes = int(hint) if hint.isdigit() else None
    return RobezClientError(response.status_code, error, error_type, retry_after, max_update_bytes)
