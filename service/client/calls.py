"""Requests as data: each client method builds a ``Call``, the sync or async client sends it, and
``Call.parse`` reads the answer. Nothing here does I/O, so both clients share every request builder."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx
import numpy as np
import torch
from torch import Tensor

from .wire import (
    IDEMPOTENCY_HEADER,
    IDS_DTYPE,
    LOOKUP_HEADER,
    MIN_VERSION_HEADER,
    OCTET_STREAM,
    ROWS_DTYPE,
    SHAPE_HEADER,
    SHAPES_HEADER,
    TABLES_HEADER,
    VERSION_HEADER,
    IdsLike,
    RobezClientError,
    decode_rows,
    encode_ids,
    encode_rows,
    ids_array,
    parse_shape,
    rows_array,
)

T = TypeVar("T")


@dataclass(frozen=True)
class Call(Generic[T]):
    method: str
    path: str
    parse: Callable[[httpx.Response], T]
    # bytes, or the body's consecutive parts: sent one after the other, never joined into one copy
    content: bytes | tuple[bytes, ...] | None = None
    json: Any = None
    headers: Mapping[str, str] = field(default_factory=dict)
    params: Mapping[str, str] = field(default_factory=dict)
    resend_safe: bool = False  # carries an Idempotency-Key: may be resent after a transport error

    def body(self) -> bytes:
        """The whole body as one bytes object (a copy where ``content`` is parts)."""
        return b"".join(self.content) if isinstance(self.content, tuple) else self.content or b""


def table_path(table: str, suffix: str = "") -> str:
    # quote() with safe="" so a name can never add path segments, whatever the server accepts.
    return f"/v1/tables/{quote(table, safe='')}{suffix}"


def parse_json(response: httpx.Response) -> Any:
    return response.json()


def parse_rows(response: httpx.Response) -> Tensor:
    try:
        return decode_rows(response.content, parse_shape(response.headers.get(SHAPE_HEADER)))
    except ValueError as exc:
        raise RobezClientError(response.status_code, str(exc), "ClientDecodeError") from exc


def parse_version(response: httpx.Response) -> int:
    return int(response.json()["version"])


def parse_tables(response: httpx.Response) -> list[dict[str, Any]]:
    body = response.json()
    return list(body["tables"] if isinstance(body, dict) else body)


def _lr_params(lr: float | None) -> dict[str, str]:
    return {} if lr is None else {"lr": repr(float(lr))}


def lookup_call(table: str, ids: IdsLike, min_version: int | None = None) -> Call[Tensor]:
    body, _ = encode_ids(ids)
    headers = {"Content-Type": OCTET_STREAM, "Accept": OCTET_STREAM}
    if min_version is not None:
        headers[MIN_VERSION_HEADER] = str(int(min_version))
    return Call("POST", table_path(table, "/lookup"), parse_rows, content=body, headers=headers)


def _rows_from_json(body: Mapping[str, Any]) -> Tensor:
    n, d = body["shape"]
    return torch.tensor(body["embeddings"], dtype=torch.float32).reshape(n, d)


def lookup_pooled_call(
    table: str,
    ids: IdsLike,
    offsets: IdsLike,
    pooling: str,
    per_sample_weights: Tensor | Sequence[float] | None,
) -> Call[Tensor]:
    payload: dict[str, Any] = {
        "ids": _int_list(ids),
        "offsets": _int_list(offsets),
        "pooling": pooling,
        "per_sample_weights": None if per_sample_weights is None else _float_list(per_sample_weights),
    }
    return Call("POST", table_path(table, "/lookup"), lambda r: _rows_from_json(r.json()), json=payload)


def lookup_many_call(
    requests: Mapping[str, IdsLike], min_versions: Mapping[str, int] | None = None
) -> Call[dict[str, Tensor]]:
    """``POST /v1/lookup`` (binary): {table: ids (n_t,)} -> {table: rows (n_t, d_t)}; ``min_versions``:
    the server first waits until each named table has that version (read-your-writes)."""
    names = list(requests)
    encoded = [encode_ids(requests[name]) for name in names]
    tables_header = ",".join(f"{name}={count}" for name, (_, count) in zip(names, encoded, strict=True))

    def parse(response: httpx.Response) -> dict[str, Tensor]:
        return _rows_of(response, names)

    headers = {"Content-Type": OCTET_STREAM, "Accept": OCTET_STREAM, TABLES_HEADER: tables_header}
    if min_versions:
        headers[MIN_VERSION_HEADER] = ",".join(f"{name}={int(v)}" for name, v in min_versions.items())
    return Call("POST", "/v1/lookup", parse, content=b"".join(body for body, _ in encoded), headers=headers)


def _rows_of(response: httpx.Response, names: Sequence[str]) -> dict[str, Tensor]:
    """{table: rows} of a binary multi-table lookup answer (``X-Robez-Shapes``, the rows in order)."""
    try:
        shapes = [parse_shape(shape) for shape in response.headers.get(SHAPES_HEADER, "").split(";")]
        if len(shapes) != len(names):
            raise ValueError(f"{SHAPES_HEADER} has {len(shapes)} shapes for {len(names)} tables")
        rows: dict[str, Tensor] = {}
        start = 0
        body = memoryview(response.content)  # slices of it are views: each table's rows copied once
        for name, shape in zip(names, shapes, strict=True):
            size = shape[0] * shape[1] * ROWS_DTYPE.itemsize
            rows[name] = decode_rows(body[start : start + size], shape)
            start += size
        if start != len(response.content):
            raise ValueError(f"body has {len(response.content)} bytes; the shapes need {start}")
    except ValueError as exc:
        raise RobezClientError(response.status_code, str(exc), "ClientDecodeError") from exc
    return rows


def update_calls(
    table: str,
    ids: IdsLike,
    grads: Tensor | np.ndarray,
    lr: float | None,
    key: str,
    max_update_bytes: int | None,
) -> list[Call[int]]:
    """The requests of one push: one, or (a body over ``max_update_bytes``) consecutive parts of the ids
    in order, each with its own key derived from ``key`` (``f"{key}.{i}"``)."""
    ids_body, num_ids = encode_ids(ids)
    grads_body, (grad_rows, dim) = encode_rows(grads)
    if grad_rows != num_ids:
        raise ValueError(f"grads has {grad_rows} rows for {num_ids} ids")
    row_bytes = IDS_DTYPE.itemsize + dim * ROWS_DTYPE.itemsize
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
            ids_body[start * IDS_DTYPE.itemsize : stop * IDS_DTYPE.itemsize]
            + grads_body[start * dim * ROWS_DTYPE.itemsize : stop * dim * ROWS_DTYPE.itemsize]
        )
        calls.append(_update_call(table, body, f"{stop - start},{dim}", lr, f"{key}.{index}"))
    return calls


def _update_call(table: str, body: bytes, shape: str, lr: float | None, key: str) -> Call[int]:
    return Call(
        "POST",
        table_path(table, "/update"),
        parse_version,
        content=body,
        # A fresh key per push: a resend of this call (after a lost answer) is applied once by a replica.
        headers={"Content-Type": OCTET_STREAM, SHAPE_HEADER: shape, IDEMPOTENCY_HEADER: key},
        params=_lr_params(lr),
        resend_safe=True,
    )


@dataclass(frozen=True)
class _Piece:
    """The rows [start, stop) of one table's push: the caller's arrays, not yet copied."""

    table: str
    ids: np.ndarray  # (n,) little-endian int64
    grads: np.ndarray  # (n, d) little-endian float32, any strides
    start: int
    stop: int

    @property
    def dim(self) -> int:
        return int(self.grads.shape[1])

    @property
    def size(self) -> int:
        return (self.stop - self.start) * (IDS_DTYPE.itemsize + self.dim * ROWS_DTYPE.itemsize)

    def chunks(self) -> tuple[bytes, bytes]:
        """Its ids' bytes then its gradients' bytes, each gathered from the caller's arrays in one copy."""
        return self.ids[self.start : self.stop].tobytes(), self.grads[self.start : self.stop].tobytes()


PushAnswer = tuple[dict[str, int], dict[str, Tensor]]
"""A multi-table push's answer: {table: its new version}, and its lookup part's {table: rows} ({}
without one)."""


def update_many_calls(
    updates: Mapping[str, tuple[IdsLike, Tensor | np.ndarray]],
    lr: float | None,
    key: str,
    max_update_bytes: int | None,
    lookups: Mapping[str, IdsLike] | None = None,
) -> list[Call[PushAnswer]]:
    """The requests of one multi-table push (``POST /v1/update``): one; or, when the body is over
    ``max_update_bytes`` (a replica's 413 named it), consecutive groups of tables in order, a table
    that alone is over the limit cut into consecutive parts of its ids as ``update_calls`` does. Each
    request gets its own key derived from ``key`` (``f"{key}.{i}"``) and is all-or-nothing on its own.
    ``lookups`` ({table: ids}): the lookup part, sent with the last request (read after every part)."""
    pieces: list[_Piece] = []
    for table, (ids, grads) in updates.items():
        ids_values, grads_values = ids_array(ids), rows_array(grads)
        num_ids, (grad_rows, dim) = len(ids_values), grads_values.shape
        if grad_rows != num_ids:
            raise ValueError(f"table {table!r}: grads has {grad_rows} rows for {num_ids} ids")
        row_bytes = IDS_DTYPE.itemsize + dim * ROWS_DTYPE.itemsize
        per_part = num_ids if max_update_bytes is None else max_update_bytes // row_bytes
        if per_part == 0 and num_ids:
            raise RobezClientError(
                413,
                f"table {table!r}: one id x {dim} is over the server's {max_update_bytes}-byte update limit",
                "UpdateTooLargeError",
            )
        for start in range(0, max(num_ids, 1), max(per_part, 1)):
            pieces.append(_Piece(table, ids_values, grads_values, start, min(num_ids, start + per_part)))
    groups: list[list[_Piece]] = []
    for piece in pieces:
        last = groups[-1] if groups else None
        fits = (
            last is not None
            and (max_update_bytes is None or sum(p.size for p in last) + piece.size <= max_update_bytes)
            and all(p.table != piece.table for p in last)
        )
        if last is not None and fits:
            last.append(piece)
        else:
            groups.append([piece])
    lookup = None if not lookups else {name: encode_ids(ids) for name, ids in lookups.items()}
    if len(groups) == 1:
        return [_update_many_call(groups[0], lr, key, lookup)]
    return [
        _update_many_call(group, lr, f"{key}.{index}", lookup if index == len(groups) - 1 else None)
        for index, group in enumerate(groups)
    ]


def _update_many_call(
    pieces: list[_Piece], lr: float | None, key: str, lookup: Mapping[str, tuple[bytes, int]] | None
) -> Call[PushAnswer]:
    names = [piece.table for piece in pieces]

    def parse(response: httpx.Response) -> PushAnswer:
        if lookup is not None:  # binary: the rows, the push's versions in X-Robez-Version
            header = response.headers.get(VERSION_HEADER, "").split(",")
            if len(header) != len(names) or not all(part.isdigit() for part in header):
                raise RobezClientError(
                    response.status_code,
                    f"{VERSION_HEADER} {header} does not name a version for each of {names}",
                    "ClientDecodeError",
                )
            return dict(zip(names, map(int, header), strict=True)), _rows_of(response, list(lookup))
        results = response.json()["results"]
        versions = {str(result["table"]): int(result["version"]) for result in results}
        if list(versions) != names:
            raise RobezClientError(
                response.status_code, f"answer names {list(versions)}, sent {names}", "ClientDecodeError"
            )
        return versions, {}

    headers = {
        "Content-Type": OCTET_STREAM,
        TABLES_HEADER: ",".join(f"{p.table}={p.stop - p.start}" for p in pieces),
        SHAPES_HEADER: ";".join(f"{p.stop - p.start},{p.dim}" for p in pieces),
        IDEMPOTENCY_HEADER: key,
    }
    # The parts as they are: a 2048-row, 26-table push is 3.8 MB, which joining would copy again.
    content = tuple(chunk for piece in pieces for chunk in piece.chunks() if chunk)
    if lookup is not None:
        headers[LOOKUP_HEADER] = ",".join(f"{name}={count}" for name, (_, count) in lookup.items())
        headers["Accept"] = OCTET_STREAM
        content += tuple(body for body, _ in lookup.values() if body)
    return Call(
        "POST", "/v1/update", parse, content=content, headers=headers, params=_lr_params(lr), resend_safe=True
    )


def create_call(
    name: str, config: Mapping[str, Any], optimizer: Mapping[str, Any] | None, share_array_with: str | None
) -> Call[dict[str, Any]]:
    payload: dict[str, Any] = {"name": name, "config": dict(config)}
    if optimizer is not None:
        payload["optimizer"] = dict(optimizer)
    if share_array_with is not None:
        payload["share_array_with"] = share_array_with
    return Call("POST", "/v1/tables", parse_json, json=payload)


def _int_list(values: IdsLike) -> list[int]:
    if isinstance(values, Tensor):
        return [int(v) for v in values.detach().cpu().reshape(-1).tolist()]
    return [int(v) for v in np.asarray(values).reshape(-1).tolist()]


def _float_list(values: Tensor | Sequence[float]) -> list[float]:
    if isinstance(values, Tensor):
        return [float(v) for v in values.detach().cpu().reshape(-1).tolist()]
    return [float(v) for v in values]
