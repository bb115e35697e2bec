"""How an update travels in the log: the binary wire format of a push, plus its lr.

Payload: n little-endian int64 ids, then n*d little-endian float32 gradients. Headers: ``Robez-Shape:
n,d`` and ``Robez-Lr`` (``float.hex``, so every replica applies exactly the same lr); with tracing on,
also the push's W3C ``traceparent`` (and ``tracestate``), so every replica's apply joins its trace.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

from robez_core.errors import CorruptionError

from ..errors import UpdateTooLargeError
from ..store.journal import UpdateRecord

SHAPE = "Robez-Shape"
LR = "Robez-Lr"
_IDS = np.dtype("<i8")
_GRADS = np.dtype("<f4")
# Room left in the 413's hint for the longer Idempotency-Key of a split part (``f"{key}.{i}"``).
_PART_KEY_ROOM = 32


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
    num_rows = int(ids.numel())
    dim = int(grads.shape[1]) if grads.dim() == 2 else 0
    payload = (
        ids.reshape(-1).numpy().astype(_IDS, copy=False).tobytes()
        + grads.reshape(num_rows, dim).numpy().astype(_GRADS, copy=False).tobytes()
    )
    return payload, {SHAPE: f"{num_rows},{dim}", LR: float(lr).hex(), **(trace or {})}


def decode_update(table: str, position: int, payload: bytes, headers: dict[str, str]) -> UpdateRecord:
    """The ``UpdateRecord`` at log position ``position`` (= the version it produces)."""
    try:
        num_rows, dim = (int(part) for part in headers[SHAPE].split(","))
        lr = float.fromhex(headers[LR])
    except (KeyError, ValueError) as exc:
        raise CorruptionError(f"table {table!r}: log entry {position} has bad headers {headers}") from exc
    ids_bytes = num_rows * _IDS.itemsize
    if len(payload) != ids_bytes + num_rows * dim * _GRADS.itemsize:
        raise CorruptionError(
            f"table {table!r}: log entry {position} has {len(payload)} bytes for {num_rows}x{dim}"
        )
    ids = torch.from_numpy(np.frombuffer(payload, dtype=_IDS, count=num_rows).astype(np.int64))
    grads = torch.from_numpy(
        np.frombuffer(payload, dtype=_GRADS, offset=ids_bytes).astype(np.float32).reshape(num_rows, dim)
    )
    return UpdateRecord(table, position, ids, grads, lr)
