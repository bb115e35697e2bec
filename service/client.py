"""Python client for the robez service, and ``RemoteEmbedding`` for online training against it.

Lookups and updates travel as binary ``application/octet-stream`` (little-endian int64 ids, float32
row-major rows, ``X-Robez-Shape: n,d``); the smaller control calls use JSON. ``RobezClient`` and
``AsyncRobezClient`` share every request builder and response parser below, so the two differ only in
whether they ``await`` the send.

Example::

    client = RobezClient("http://127.0.0.1:8000")
    rows = client.lookup("demo", torch.tensor([1, 2, 3]))          # float32 (3, 64)
    version = client.update("demo", torch.tensor([1]), torch.ones(1, 64), lr=0.1)
    client.last_timing                                              # {"hash": 0.01, "apply": ..., ...} ms
"""

from __future__ import annotations

import asyncio
import ssl
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx
import numpy as np
import torch
from torch import Tensor, nn

from .servertiming import parse_server_timing

__all__ = [
    "AsyncRobezClient",
    "RemoteEmbedding",
    "RemoteEmbeddingBag",
    "RobezClient",
    "RobezClientError",
    "decode_rows",
    "encode_ids",
    "encode_update",
    "parse_server_timing",
]

OCTET_STREAM = "application/octet-stream"
SHAPE_HEADER = "X-Robez-Shape"
SHAPES_HEADER = "X-Robez-Shapes"  # multi-table lookup: "n,d;n,d;..." in request order
TABLES_HEADER = "X-Robez-Tables"  # multi-table lookup: "name=n,name=n,..." in body order
VERSION_HEADER = "X-Robez-Version"
MIN_VERSION_HEADER = "X-Robez-Min-Version"  # read-your-writes: wait until the server has this version
IDEMPOTENCY_HEADER = "Idempotency-Key"
REPLICA_HEADER = "X-Robez-Replica"  # set by replicas, which apply a resent Idempotency-Key once
# On a replica's 413 for a push over one log entry: the largest update body that fits (the client splits).
MAX_UPDATE_BYTES_HEADER = "X-Robez-Max-Update-Bytes"
DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_BUSY_RETRIES = 2
_BUSY_BACKOFF_S = 0.1
_MAX_BUSY_DELAY_S = 5.0
_MAX_SPLITS = 3  # a push is split again only when a 413 names a smaller limit than the one it was split by
# Explicit byte orders: the wire format is little-endian whatever the host is.
_IDS_DTYPE = np.dtype("<i8")
_ROWS_DTYPE = np.dtype("<f4")

T = TypeVar("T")
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


# --------------------------------------------------------------------------------------------------
# Wire encoding, shared by both clients (and usable on their own, e.g. by the load test).


def encode_ids(ids: IdsLike) -> tuple[bytes, int]:
    """Encodes a 1-D sequence of ids as little-endian int64 bytes; returns (body, n).

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
    return np.ascontiguousarray(array, dtype=_IDS_DTYPE).tobytes(), int(array.shape[0])


def encode_rows(rows: Tensor | np.ndarray) -> tuple[bytes, tuple[int, int]]:
    """Encodes a float (n, d) matrix as little-endian float32 row-major bytes; returns (body, (n, d))."""
    array = rows.detach().to(device="cpu", dtype=torch.float32).numpy() if isinstance(rows, Tensor) else rows
    array = np.asarray(array)
    if array.ndim != 2:
        raise ValueError(f"rows must be 2-D (n, d), got shape {tuple(array.shape)}")
    n, d = array.shape
    return np.ascontiguousarray(array, dtype=_ROWS_DTYPE).tobytes(), (int(n), int(d))


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


def decode_rows(body: bytes, shape: tuple[int, int]) -> Tensor:
    """Decodes little-endian float32 row-major bytes into a new float32 (n, d) tensor."""
    n, d = shape
    if len(body) != n * d * _ROWS_DTYPE.itemsize:
        raise ValueError(f"body has {len(body)} bytes; shape {n},{d} needs {n * d * _ROWS_DTYPE.itemsize}")
    # astype copies into a writable native-order array, so the tensor owns its memory.
    array = np.frombuffer(body, dtype=_ROWS_DTYPE).astype(np.float32)
    return torch.from_numpy(array).reshape(n, d)


def _error_from_response(response: httpx.Response) -> RobezClientError:
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


# --------------------------------------------------------------------------------------------------
# Requests as data: each public method builds a _Call, the sync/async client sends it, _Call.parse
# reads the response. Nothing here does I/O.


@dataclass(frozen=True)
class _Call(Generic[T]):
    method: str
    path: str
    parse: Callable[[httpx.Response], T]
    content: bytes | None = None
    json: Any = None
    headers: Mapping[str, str] = field(default_factory=dict)
    params: Mapping[str, str] = field(default_factory=dict)
    resend_safe: bool = False  # carries an Idempotency-Key: may be resent after a transport error


def _table_path(table: str, suffix: str = "") -> str:
    # quote() with safe="" so a name can never add path segments, whatever the server accepts.
    return f"/v1/tables/{quote(table, safe='')}{suffix}"


def _parse_json(response: httpx.Response) -> Any:
    return response.json()


def _parse_rows(response: httpx.Response) -> Tensor:
    try:
        return decode_rows(response.content, parse_shape(response.headers.get(SHAPE_HEADER)))
    except ValueError as exc:
        raise RobezClientError(response.status_code, str(exc), "ClientDecodeError") from exc


def _parse_version(response: httpx.Response) -> int:
    return int(response.json()["version"])


def _parse_tables(response: httpx.Response) -> list[dict[str, Any]]:
    body = response.json()
    return list(body["tables"] if isinstance(body, dict) else body)


def _lr_params(lr: float | None) -> dict[str, str]:
    return {} if lr is None else {"lr": repr(float(lr))}


def _lookup_call(table: str, ids: IdsLike, min_version: int | None = None) -> _Call[Tensor]:
    body, _ = encode_ids(ids)
    headers = {"Content-Type": OCTET_STREAM, "Accept": OCTET_STREAM}
    if min_version is not None:
        headers[MIN_VERSION_HEADER] = str(int(min_version))
    return _Call("POST", _table_path(table, "/lookup"), _parse_rows, content=body, headers=headers)


def _rows_from_json(body: Mapping[str, Any]) -> Tensor:
    n, d = body["shape"]
    return torch.tensor(body["embeddings"], dtype=torch.float32).reshape(n, d)


def _lookup_pooled_call(
    table: str,
    ids: IdsLike,
    offsets: IdsLike,
    pooling: str,
    per_sample_weights: Tensor | Sequence[float] | None,
) -> _Call[Tensor]:
    payload: dict[str, Any] = {
        "ids": _int_list(ids),
        "offsets": _int_list(offsets),
        "pooling": pooling,
        "per_sample_weights": None if per_sample_weights is None else _float_list(per_sample_weights),
    }
    return _Call("POST", _table_path(table, "/lookup"), lambda r: _rows_from_json(r.json()), json=payload)


def _lookup_many_call(requests: Mapping[str, IdsLike]) -> _Call[dict[str, Tensor]]:
    names = list(requests)
    encoded = [encode_ids(requests[name]) for name in names]
    tables_header = ",".join(f"{name}={count}" for name, (_, count) in zip(names, encoded, strict=True))

    def parse(response: httpx.Response) -> dict[str, Tensor]:
        try:
            shapes = [parse_shape(shape) for shape in response.headers.get(SHAPES_HEADER, "").split(";")]
            if len(shapes) != len(names):
                raise ValueError(f"{SHAPES_HEADER} has {len(shapes)} shapes for {len(names)} tables")
            rows: dict[str, Tensor] = {}
            start = 0
            for name, shape in zip(names, shapes, strict=True):
                size = shape[0] * shape[1] * _ROWS_DTYPE.itemsize
                rows[name] = decode_rows(response.content[start : start + size], shape)
                start += size
            if start != len(response.content):
                raise ValueError(f"body has {len(response.content)} bytes; the shapes need {start}")
        except ValueError as exc:
            raise RobezClientError(response.status_code, str(exc), "ClientDecodeError") from exc
        return rows

    return _Call(
        "POST",
        "/v1/lookup",
        parse,
        content=b"".join(body for body, _ in encoded),
        headers={"Content-Type": OCTET_STREAM, "Accept": OCTET_STREAM, TABLES_HEADER: tables_header},
    )


def _update_calls(
    table: str,
    ids: IdsLike,
    grads: Tensor | np.ndarray,
    lr: float | None,
    key: str,
    max_update_bytes: int | None,
) -> list[_Call[int]]:
    """The requests of one push: one, or (a body over ``max_update_bytes``) consecutive parts of the ids
    in order, each with its own key derived from ``key`` (``f"{key}.{i}"``)."""
    ids_body, num_ids = encode_ids(ids)
    grads_body, (grad_rows, dim) = encode_rows(grads)
    if grad_rows != num_ids:
        raise ValueError(f"grads has {grad_rows} rows for {num_ids} ids")
    row_bytes = _IDS_DTYPE.itemsize + dim * _ROWS_DTYPE.itemsize
    if max_update_bytes is None or num_ids * row_bytes <= max_update_bytes:
        return [_update_call(table, ids_body + grads_body, f"{num_ids},{dim}", lr, key)]
    per_part = max_update_bytes // row_bytes
    if per_part == 0:
        raise RobezClientError(
            413,
            f"one id x {dim} is over the server's {max_update_bytes}-byte update limit",
            "UpdateTooLargeError",
        )
    calls = []
    for index, start in enumerate(range(0, num_ids, per_part)):
        stop = min(num_ids, start + per_part)
        body = (
            ids_body[start * _IDS_DTYPE.itemsize : stop * _IDS_DTYPE.itemsize]
            + grads_body[start * dim * _ROWS_DTYPE.itemsize : stop * dim * _ROWS_DTYPE.itemsize]
        )
        calls.append(_update_call(table, body, f"{stop - start},{dim}", lr, f"{key}.{index}"))
    return calls


def _update_call(table: str, body: bytes, shape: str, lr: float | None, key: str) -> _Call[int]:
    return _Call(
        "POST",
        _table_path(table, "/update"),
        _parse_version,
        content=body,
        # A fresh key per push: a resend of this call (after a lost answer) is applied once by a replica.
        headers={"Content-Type": OCTET_STREAM, SHAPE_HEADER: shape, IDEMPOTENCY_HEADER: key},
        params=_lr_params(lr),
        resend_safe=True,
    )


def _create_call(
    name: str, config: Mapping[str, Any], optimizer: Mapping[str, Any] | None, share_array_with: str | None
) -> _Call[dict[str, Any]]:
    payload: dict[str, Any] = {"name": name, "config": dict(config)}
    if optimizer is not None:
        payload["optimizer"] = dict(optimizer)
    if share_array_with is not None:
        payload["share_array_with"] = share_array_with
    return _Call("POST", "/v1/tables", _parse_json, json=payload)


def _int_list(values: IdsLike) -> list[int]:
    if isinstance(values, Tensor):
        return [int(v) for v in values.detach().cpu().reshape(-1).tolist()]
    return [int(v) for v in np.asarray(values).reshape(-1).tolist()]


def _float_list(values: Tensor | Sequence[float]) -> list[float]:
    if isinstance(values, Tensor):
        return [float(v) for v in values.detach().cpu().reshape(-1).tolist()]
    return [float(v) for v in values]


TLSVerify = bool | str | Path | ssl.SSLContext


def tls_verify(verify: TLSVerify, cert: tuple[str | Path, str | Path] | None = None) -> ssl.SSLContext | bool:
    """What httpx's ``verify=`` takes for a CA bundle path (or context, or bool) and an optional client
    certificate + key."""
    if isinstance(verify, ssl.SSLContext):
        context = verify
    elif verify is False:
        if cert is None:
            return False
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        cafile = None if verify is True else str(verify)
        context = ssl.create_default_context(cafile=cafile)
    if cert is not None:
        context.load_cert_chain(str(cert[0]), str(cert[1]))
    return context


class _ClientBase:
    """What both clients share: the auth header, the request builders, and response bookkeeping."""

    def __init__(self, api_key: str | None, busy_retries: int) -> None:
        if busy_retries < 0:
            raise ValueError(f"busy_retries must be >= 0, got {busy_retries}")
        self._auth_headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.busy_retries = busy_retries
        self.last_timing: dict[str, float] = {}
        """Server-Timing figures (ms by stage) of the last completed request; {} when it had none."""
        self.last_version: int | None = None
        """The table version reported by the last response that carried one."""
        self._server_dedups = False
        self.max_update_bytes: int | None = None
        """The largest update body the server takes in one request, once a 413 told it (a replica's
        log entry limit); larger pushes are then split before sending."""

    def _split_limit(self, error: RobezClientError, tried: int | None, parts_sent: int) -> int | None:
        """The update size to split a push by after ``error``, or None to raise it: only a 413 that
        names a smaller limit, and only while no part of the push was applied (a resplit would give the
        same part keys other contents)."""
        hint = error.max_update_bytes
        if error.status != 413 or hint is None or parts_sent or (tried is not None and hint >= tried):
            return None
        self.max_update_bytes = hint
        return hint

    def _request_kwargs(self, call: _Call[Any]) -> dict[str, Any]:
        return {
            "content": call.content,
            "json": call.json,
            "headers": {**self._auth_headers, **call.headers},
            "params": dict(call.params) or None,
        }

    def _busy_delay(self, response: httpx.Response, attempt: int) -> float | None:
        """Seconds to wait before resending after a 503, or None when the answer is final.

        A 503 means the server refused the request before doing anything (saturated), so resending an
        update cannot apply it twice.
        """
        if response.status_code != 503 or attempt >= self.busy_retries:
            return None
        retry_after = _error_from_response(response).retry_after
        delay = retry_after if retry_after is not None else _BUSY_BACKOFF_S * 2**attempt
        return min(max(delay, 0.0), _MAX_BUSY_DELAY_S)

    def _resend_after(self, call: _Call[Any], error: httpx.TransportError, attempt: int) -> float | None:
        """Seconds to wait before resending after a transport error, or None to raise it.

        Nothing reached the server after a connect error, so any call may be resent. After other
        errors the request may have been applied: only a push with an Idempotency-Key to a server that
        said it is a replica (which applies the key once) is resent.
        """
        if attempt >= self.busy_retries:
            return None
        if not isinstance(error, httpx.ConnectError | httpx.ConnectTimeout) and not (
            call.resend_safe and self._server_dedups
        ):
            return None
        return min(_BUSY_BACKOFF_S * 2**attempt, _MAX_BUSY_DELAY_S)

    def _finish(self, call: _Call[T], response: httpx.Response) -> T:
        if REPLICA_HEADER in response.headers:
            self._server_dedups = True
        self.last_timing = parse_server_timing(response.headers.get("Server-Timing"))
        if response.is_error:
            raise _error_from_response(response)
        result = call.parse(response)
        version_header = response.headers.get(VERSION_HEADER)
        if version_header is not None and version_header.isdigit():
            self.last_version = int(version_header)
        elif isinstance(result, int) and not isinstance(result, bool):
            self.last_version = result
        return result


class RobezClient(_ClientBase):
    """Blocking client for one robez server.

    Args:
        base_url: e.g. ``"http://127.0.0.1:8000"``.
        api_key: sent as ``Authorization: Bearer <key>`` on every request when set.
        timeout: seconds for connect/read/write.
        busy_retries: times a request the server refused as saturated (503) is sent again, after its
            ``Retry-After`` (at most 5 s) or an exponential backoff from 0.1 s; 0 raises at once.
        transport: an ``httpx`` transport (e.g. ``httpx.MockTransport`` in tests).
        http_client: an existing ``httpx.Client`` to send through instead (e.g. FastAPI's ``TestClient``);
            its own base URL is used and the client is not closed by ``close()``.
        verify: for ``https://`` URLs: a CA bundle file the server's certificate must chain to (a
            server started with ``--tls-cert``), an ``ssl.SSLContext``, True (the system's CAs) or False
            (no check; never across a network you do not own).
        cert: (certificate file, key file) presented to a server that requires client certificates
            (``--tls-client-ca``).

    Errors: every non-2xx answer (after ``busy_retries`` for 503s) raises ``RobezClientError``; transport
    failures raise ``httpx`` errors.
    """

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        *,
        busy_retries: int = DEFAULT_BUSY_RETRIES,
        transport: httpx.BaseTransport | None = None,
        http_client: httpx.Client | None = None,
        verify: TLSVerify = True,
        cert: tuple[str | Path, str | Path] | None = None,
    ) -> None:
        super().__init__(api_key, busy_retries)
        self._owns_http = http_client is None
        self._http = http_client or httpx.Client(
            base_url=base_url, timeout=timeout, transport=transport, verify=tls_verify(verify, cert)
        )

    def _send(self, call: _Call[T]) -> T:
        for attempt in range(self.busy_retries + 1):
            try:
                response = self._http.request(call.method, call.path, **self._request_kwargs(call))
            except httpx.TransportError as error:
                wait = self._resend_after(call, error, attempt)
                if wait is None:
                    raise
                time.sleep(wait)
                continue
            delay = self._busy_delay(response, attempt)
            if delay is None:
                break
            time.sleep(delay)
        return self._finish(call, response)

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> RobezClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def health(self) -> dict[str, Any]:
        """``GET /healthz``: the liveness body; raises ``RobezClientError`` when the server is not live."""
        return self._send(_Call("GET", "/healthz", _parse_json))

    def ready(self) -> dict[str, Any]:
        """``GET /readyz``: raises ``RobezClientError`` (503) until the tables are loaded."""
        return self._send(_Call("GET", "/readyz", _parse_json))

    def tables(self) -> list[dict[str, Any]]:
        """``GET /v1/tables``: one description per table (config, version, compression ratio)."""
        return self._send(_Call("GET", "/v1/tables", _parse_tables))

    def table(self, name: str) -> dict[str, Any]:
        """``GET /v1/tables/{name}``: config, optimizer and version of one table."""
        return self._send(_Call("GET", _table_path(name), _parse_json))

    def create_table(
        self,
        name: str,
        config: Mapping[str, Any],
        optimizer: Mapping[str, Any] | None = None,
        share_array_with: str | None = None,
    ) -> dict[str, Any]:
        """``POST /v1/tables``: creates a table from a ``TableConfig``-shaped dict; returns its description.

        Args:
            config: e.g. ``{"num_embeddings": 10**6, "embedding_dim": 64, "memory_size": 2**20}``.
            optimizer: e.g. ``{"name": "adagrad", "lr": 0.05}``; the server's default when None.
            share_array_with: name of an existing table whose array the new one reads and trains too
                (give the two different ``val_offset`` values).
        """
        return self._send(_create_call(name, config, optimizer, share_array_with))

    def delete_table(self, name: str) -> None:
        """``DELETE /v1/tables/{name}``."""
        self._send(_Call("DELETE", _table_path(name), lambda response: None))

    def lookup(self, table: str, ids: IdsLike, *, min_version: int | None = None) -> Tensor:
        """Rows of ``ids`` over the binary path: int64 (n,) -> float32 (n, d). ``min_version``: the
        server first waits (bounded) until it has that table version (read-your-writes on replicas)."""
        return self._send(_lookup_call(table, ids, min_version))

    def lookup_pooled(
        self,
        table: str,
        ids: IdsLike,
        offsets: IdsLike,
        pooling: str = "sum",
        per_sample_weights: Tensor | Sequence[float] | None = None,
    ) -> Tensor:
        """Server-pooled bags (JSON), like ``nn.EmbeddingBag``: ids (N,), offsets (B,) -> (B, d)."""
        return self._send(_lookup_pooled_call(table, ids, offsets, pooling, per_sample_weights))

    def lookup_many(self, requests: Mapping[str, IdsLike]) -> dict[str, Tensor]:
        """Several tables in one binary request (``POST /v1/lookup``): {table: (n_t,)} -> {table: (n_t, d_t)}.

        A DLRM-style request touching many tables costs one round trip instead of one per table.
        """
        return self._send(_lookup_many_call(requests))

    def update(self, table: str, ids: IdsLike, grads: Tensor | np.ndarray, lr: float | None = None) -> int:
        """Pushes gradients of rows (binary path); the server applies the table's optimizer.

        A push over what the server takes in one update (a replica's 413 names it; remembered in
        ``max_update_bytes``) is sent as consecutive parts of the ids, each its own update and version;
        duplicates of an id in two parts are then two optimizer steps.

        Args:
            ids: (n,) ids; duplicates have their gradients summed by the server.
            grads: (n, d) float gradients dLoss/dRow.
            lr: overrides the table's learning rate for this update only.

        Returns:
            The table version this update (its last part) produced.
        """
        key, limit = uuid.uuid4().hex, self.max_update_bytes
        for _ in range(_MAX_SPLITS):
            sent = 0
            try:
                version = 0
                for call in _update_calls(table, ids, grads, lr, key, limit):
                    version = self._send(call)
                    sent += 1
                return version
            except RobezClientError as error:
                limit = self._split_limit(error, limit, sent)
                if limit is None:
                    raise
        raise RobezClientError(
            413, f"the server lowered its update limit {_MAX_SPLITS} times", "UpdateTooLargeError"
        )


class AsyncRobezClient(_ClientBase):
    """The ``asyncio`` twin of ``RobezClient``: same methods, awaited; same arguments and errors."""

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        *,
        busy_retries: int = DEFAULT_BUSY_RETRIES,
        transport: httpx.AsyncBaseTransport | None = None,
        http_client: httpx.AsyncClient | None = None,
        verify: TLSVerify = True,
        cert: tuple[str | Path, str | Path] | None = None,
    ) -> None:
        super().__init__(api_key, busy_retries)
        self._owns_http = http_client is None
        self._http = http_client or httpx.AsyncClient(
            base_url=base_url, timeout=timeout, transport=transport, verify=tls_verify(verify, cert)
        )

    async def _send(self, call: _Call[T]) -> T:
        for attempt in range(self.busy_retries + 1):
            try:
                response = await self._http.request(call.method, call.path, **self._request_kwargs(call))
            except httpx.TransportError as error:
                wait = self._resend_after(call, error, attempt)
                if wait is None:
                    raise
                await asyncio.sleep(wait)
                continue
            delay = self._busy_delay(response, attempt)
            if delay is None:
                break
            await asyncio.sleep(delay)
        return self._finish(call, response)

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncRobezClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def health(self) -> dict[str, Any]:
        return await self._send(_Call("GET", "/healthz", _parse_json))

    async def ready(self) -> dict[str, Any]:
        return await self._send(_Call("GET", "/readyz", _parse_json))

    async def tables(self) -> list[dict[str, Any]]:
        return await self._send(_Call("GET", "/v1/tables", _parse_tables))

    async def table(self, name: str) -> dict[str, Any]:
        return await self._send(_Call("GET", _table_path(name), _parse_json))

    async def create_table(
        self,
        name: str,
        config: Mapping[str, Any],
        optimizer: Mapping[str, Any] | None = None,
        share_array_with: str | None = None,
    ) -> dict[str, Any]:
        return await self._send(_create_call(name, config, optimizer, share_array_with))

    async def delete_table(self, name: str) -> None:
        await self._send(_Call("DELETE", _table_path(name), lambda response: None))

    async def lookup(self, table: str, ids: IdsLike, *, min_version: int | None = None) -> Tensor:
        return await self._send(_lookup_call(table, ids, min_version))

    async def lookup_pooled(
        self,
        table: str,
        ids: IdsLike,
        offsets: IdsLike,
        pooling: str = "sum",
        per_sample_weights: Tensor | Sequence[float] | None = None,
    ) -> Tensor:
        return await self._send(_lookup_pooled_call(table, ids, offsets, pooling, per_sample_weights))

    async def lookup_many(self, requests: Mapping[str, IdsLike]) -> dict[str, Tensor]:
        return await self._send(_lookup_many_call(requests))

    async def update(
        self, table: str, ids: IdsLike, grads: Tensor | np.ndarray, lr: float | None = None
    ) -> int:
        key, limit = uuid.uuid4().hex, self.max_update_bytes
        for _ in range(_MAX_SPLITS):
            sent = 0
            try:
                version = 0
                for call in _update_calls(table, ids, grads, lr, key, limit):
                    version = await self._send(call)
                    sent += 1
                return version
            except RobezClientError as error:
                limit = self._split_limit(error, limit, sent)
                if limit is None:
                    raise
        raise RobezClientError(
            413, f"the server lowered its update limit {_MAX_SPLITS} times", "UpdateTooLargeError"
        )


# --------------------------------------------------------------------------------------------------
# Online training: modules whose rows live on the server.


class _RemoteLookup(torch.autograd.Function):
    """Forward: rows of unique ids from the server. Backward: pushes their gradients to the server.

    ``anchor`` is an empty tensor that requires grad: it is the only reason autograd calls backward,
    since the real "weights" are on the server and have no local leaf.
    """

    @staticmethod
    def forward(
        ctx: Any, anchor: Tensor, unique_ids: Tensor, module: RemoteEmbedding, lr: float | None
    ) -> Tensor:
        ctx.unique_ids = unique_ids
        ctx.module = module
        ctx.lr = lr
        return module.client.lookup(module.table, unique_ids, min_version=module.last_version)

    @staticmethod
    def backward(ctx: Any, grad_rows: Tensor) -> tuple[None, None, None, None]:
        ctx.module._push(ctx.unique_ids, grad_rows, ctx.lr)
        return None, None, None, None


class RemoteEmbedding(nn.Module):
    """An embedding whose table lives on a robez server: an online-training ``nn.Embedding``.

    ``forward`` looks up the rows of ``ids`` (each distinct id crosses the wire once). When autograd is
    on, ``loss.backward()`` pushes dLoss/dRow for those ids back with ``client.update``: the **server**
    applies the table's optimizer (sgd, adagrad or adam, with the table's lr unless ``lr`` overrides it)
    and the next lookup, by this or any other client, sees the change. There are no local parameters,
    so a local ``torch.optim`` optimizer never sees this module; it trains only the rest of the model.

    The gradient pushed is exactly what autograd computed (a mean-reduced loss divides it by the batch
    size), so pick the table's lr with that scale in mind. Pushes happen inside ``backward`` and block
    until the server has applied them; a failed push raises ``RobezClientError`` out of ``backward``.
    Lookups after a push ask for at least the version it produced (``X-Robez-Min-Version``), so behind
    a load balancer over replicas the module still reads its own writes.

    Args:
        client: a ``RobezClient`` connected to the server, or the server's URL (a client is made with
            ``api_key`` and ``verify``).
        table: the table's name on the server.
        lr: learning rate sent with every push (None: the table's own).
        embedding_dim: d, when known; otherwise read from the server once.
        api_key, verify: for a URL ``client``: as for ``RobezClient`` (``verify``: the CA bundle of an
            ``https://`` server).

    Shape:
        ids (*) int64 -> (*, d) float32.

    Example::

        users = RemoteEmbedding(RobezClient(url), "users")
        loss = model(users(user_ids)).mean()
        loss.backward()            # users' rows updated on the server here
    """

    def __init__(
        self,
        client: RobezClient | str,
        table: str,
        *,
        lr: float | None = None,
        embedding_dim: int | None = None,
        api_key: str | None = None,
        verify: TLSVerify = True,
    ) -> None:
        super().__init__()
        self.client = (
            client if isinstance(client, RobezClient) else RobezClient(client, api_key, verify=verify)
        )
        self.table = table
        self.lr = lr
        self.embedding_dim = (
            embedding_dim if embedding_dim is not None else _table_dim(self.client.table(table))
        )
        self.pushes = 0
        """Gradient pushes made so far (one per backward through a forward of this module)."""
        self.last_version: int | None = None
        """The table version the last push produced."""
        self.last_push_timing: dict[str, float] = {}
        """Server-Timing of the last push (ms by stage: hash, apply, total)."""

    def forward(self, ids: Tensor, lr: float | None = None) -> Tensor:
        """Rows of ``ids`` (*) -> (*, d); ``lr`` overrides ``self.lr`` for the push of this call only."""
        if ids.is_floating_point():
            raise ValueError(f"ids must be integers, got {ids.dtype}")
        flat = ids.reshape(-1).to(torch.int64)
        if flat.numel() == 0:
            return torch.zeros(*ids.shape, self.embedding_dim)
        unique_ids, inverse = torch.unique(flat, return_inverse=True)
        if torch.is_grad_enabled():
            anchor = torch.empty(0, requires_grad=True)
            rows = _RemoteLookup.apply(anchor, unique_ids, self, self.lr if lr is None else lr)
        else:
            rows = self.client.lookup(self.table, unique_ids, min_version=self.last_version)
        # Indexing scatters gradients of repeated ids back onto their one unique row before the push.
        return rows[inverse].reshape(*ids.shape, rows.shape[1])

    def _push(self, unique_ids: Tensor, grad_rows: Tensor, lr: float | None) -> None:
        self.last_version = self.client.update(self.table, unique_ids, grad_rows, lr=lr)
        self.last_push_timing = dict(self.client.last_timing)
        self.pushes += 1

    def extra_repr(self) -> str:
        return f"table={self.table!r}, embedding_dim={self.embedding_dim}, lr={self.lr}"


class RemoteEmbeddingBag(nn.Module):
    """``nn.EmbeddingBag`` over a remote table: rows are fetched and trained like ``RemoteEmbedding``,
    and pooled locally, so the pooling's backward feeds the push.

    Args:
        client, table, lr, embedding_dim: as for ``RemoteEmbedding``.
        mode: ``"sum"`` or ``"mean"`` (empty bags give zeros).

    Shape:
        ``input`` (B, L) with ``offsets=None`` (fixed-size bags), or ``input`` (N,) with ``offsets`` (B,)
        bag starts -> (B, d). ``per_sample_weights`` (like ``input``) only with ``mode="sum"``.
    """

    def __init__(
        self,
        client: RobezClient,
        table: str,
        *,
        mode: str = "sum",
        lr: float | None = None,
        embedding_dim: int | None = None,
    ) -> None:
        super().__init__()
        if mode not in ("sum", "mean"):
            raise ValueError(f"mode must be 'sum' or 'mean', got {mode!r}")
        self.mode = mode
        self.embedding = RemoteEmbedding(client, table, lr=lr, embedding_dim=embedding_dim)

    def forward(
        self,
        input: Tensor,
        offsets: Tensor | None = None,
        per_sample_weights: Tensor | None = None,
        lr: float | None = None,
    ) -> Tensor:
        if per_sample_weights is not None and self.mode != "sum":
            raise ValueError("per_sample_weights is only supported with mode='sum'")
        if offsets is None:
            if input.dim() != 2:
                raise ValueError(f"input must be 2-D (B, L) when offsets is None, got {tuple(input.shape)}")
            num_bags, bag_len = input.shape
            bag_index = torch.arange(num_bags).repeat_interleave(bag_len)
        else:
            if input.dim() != 1 or offsets.dim() != 1:
                raise ValueError("with offsets, input and offsets must be 1-D")
            num_bags = int(offsets.shape[0])
            bag_index = _bag_index(offsets.to(torch.int64), int(input.shape[0]))
        flat = input.reshape(-1)
        rows = self.embedding(flat, lr=lr)
        if per_sample_weights is not None:
            rows = rows * per_sample_weights.reshape(-1, 1).to(rows.dtype)
        pooled = torch.zeros(num_bags, self.embedding.embedding_dim).index_add(0, bag_index, rows)
        if self.mode == "mean":
            counts = torch.bincount(bag_index, minlength=num_bags).clamp(min=1)
            pooled = pooled / counts.unsqueeze(1).to(pooled.dtype)
        return pooled


def _bag_index(offsets: Tensor, num_ids: int) -> Tensor:
    """Bag of each id from bag start offsets (B,) -> (N,), as ``nn.EmbeddingBag`` reads them."""
    if offsets.numel() and (int(offsets[0]) != 0 or bool((offsets[1:] < offsets[:-1]).any())):
        raise ValueError("offsets must start at 0 and be non-decreasing")
    if offsets.numel() and int(offsets[-1]) > num_ids:
        raise ValueError(f"offsets point past the {num_ids} ids")
    lengths = torch.diff(offsets, append=torch.tensor([num_ids]))
    return torch.arange(offsets.numel()).repeat_interleave(lengths)


def _table_dim(info: Mapping[str, Any]) -> int:
    config = info.get("config", info)
    return int(config["embedding_dim"])
