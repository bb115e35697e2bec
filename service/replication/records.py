"""How an update travels in the log: the binary wire format of a push, plus its lr.

Payload: n little-endian int64 ids, then n*d little-endian float32 gradients. Headers: ``Robez-Shape:
n,d`` and ``Robez-Lr`` (``float.hex``, so every replica applies exactly the same lr); with tracing on,
also the push's W3C ``traceparent`` (and ``tracestate``), so every replica's apply joins its trace.

A load (``Robez-Kind: load``) has no payload: ``Robez-Object`` names the checkpoint in the Object Store
and ``Robez-Sha256`` its bytes' digest; every replica switches the table to it at that position.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..errors import UpdateTooLargeError
from ..log.entry import SkippedRecord, UpdateRecord

SHAPE = "Robez-Shape"
LR = "Robez-Lr"
KIND = "Robez-Kind"
OBJECT = "Robez-Object"
SHA256 = "Robez-Sha256"
UPDATE, LOAD = "update", "load"
_IDS = np.dtype("<i8")
_GRADS = np.dtype("<f4")
# Room left in the 413's hint for the longer Idempotency-Key of a split part (``f"{key}.{i}"``).
_PART_KEY_ROOM = 32


@dataclass(frozen=True)
class LoadRecord:
    """A load at log position ``version``: the table becomes the checkpoint ``object_name`` of the
    Object Store (SHA-256 ``sha256``, hex) at that version."""

    table: str
    version: int
    object_name: str
    sha256: str


def payload_bytes(num_rows: int, dim: int) -> int:
    """Bytes of the payload of a push of ``num_rows`` ids x ``dim``: the binary update body's size too."""
    return num_rows * (_IDS.itemsize + dim * _GRADS.itemsize)


def update_too_large(
    table: str, num_rows: int, dim: int, size: int, limit: int, overhead: int
) -> UpdateTooLargeError:
    """The 413 of a push whose log entry (``size`` bytes, ``overhead`` of them headers) is over ``limit``."""
    max_update_bytes = max(0, limit - overhead - _PART_KEY_ROOM)
    fit = max_update_bytes // payload_bytes(1, dim)
    return UpdateTooLargeError(
        f"table {table!r}: a push of {num_rows} ids x {dim} is {size:,} bytes as a replicated log entry "
        f"(ids*8 + ids*dim*4 + {overhead} bytes of headers), over the {limit:,}-byte limit of one entry: "
        f"at most {fit} ids fit in one push at dim {dim}. Split the push (the Python client does), or "
        "raise max_payload in the NATS servers' configuration (robez ships 8 MiB; NATS allows 64 MiB)",
        max_update_bytes,
    )


def encode_update(
    ids: Tensor, grads: Tensor, lr: float, trace: Mapping[str, str] | None = None
) -> tuple[bytes, dict[str, str]]:
    """(payload, headers) of one validated push: ids int64 (n,), grads float32 (n, d); ``trace``: the
    W3C trace headers of the push (``tracing.inject``), carried as they are."""
    num_rows, dim = update_shape(ids, grads)
    payload = (
        ids.reshape(-1).numpy().astype(_IDS, copy=False).tobytes()
        + grads.reshape(num_rows, dim).numpy().astype(_GRADS, copy=False).tobytes()
    )
    return payload, update_headers(num_rows, dim, lr, trace)


def update_shape(ids: Tensor, grads: Tensor) -> tuple[int, int]:
    """(ids, dim) of a push: what its entry's ``SHAPE`` header says."""
    return int(ids.numel()), int(grads.shape[1]) if grads.dim() == 2 else 0


def update_headers(
    num_rows: int, dim: int, lr: float, trace: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The headers of a push's entry (``encode_update``'s, also for its size before it is encoded)."""
    return {SHAPE: f"{num_rows},{dim}", LR: float(lr).hex(), **(trace or {})}


def encode_load(object_name: str, sha256: str) -> tuple[bytes, dict[str, str]]:
    """(payload, headers) of a load: the checkpoint is the Object Store's object ``object_name``, whose
    bytes have SHA-256 ``sha256`` (hex)."""
    return b"", {KIND: LOAD, OBJECT: object_name, SHA256: sha256}


def decode_entry(
    table: str, position: int, payload: bytes, headers: dict[str, str]
) -> UpdateRecord | LoadRecord | SkippedRecord:
    """The record at log position ``position`` (= the version it produces). An entry whose headers or
    payload do not decode (it reached the log by a direct publish, or was damaged) is a
    ``SkippedRecord``, never an error: applied as an empty version alike on every replica."""
    kind = headers.get(KIND, UPDATE)
    if kind == LOAD:
        object_name, sha256 = headers.get(OBJECT, ""), headers.get(SHA256, "")
        if not object_name or len(sha256) != 64 or payload:
            return SkippedRecord(table, position, "bad_headers", f"a load entry with headers {headers}")
        return LoadRecord(table, position, object_name, sha256.lower())
    if kind != UPDATE:
        return SkippedRecord(table, position, "bad_headers", f"unknown {KIND} {kind!r}")
    try:
        num_rows, dim = (int(part) for part in headers[SHAPE].split(","))
        lr = float.fromhex(headers[LR])
    except (KeyError, ValueError) as exc:
        return SkippedRecord(table, position, "bad_headers", f"headers {headers}: {exc!r}")
    if num_rows < 0 or dim < 0:
        return SkippedRecord(table, position, "bad_headers", f"shape {num_rows},{dim}")
    ids_bytes = num_rows * _IDS.itemsize
    if len(payload) != ids_bytes + num_rows * dim * _GRADS.itemsize:
        return SkippedRecord(
            table, position, "bad_payload", f"{len(payload)} bytes of payload for {num_rows}x{dim}"
        )
    ids = torch.from_numpy(np.frombuffer(payload, dtype=_IDS, count=num_rows).astype(np.int64))
    grads = torch.from_numpy(
        np.frombuffer(payload, dtype=_GRADS, offset=ids_bytes).astype(np.float32).reshape(num_rows, dim)
    )
    return UpdateRecord(table, position, ids, grads, lr)
