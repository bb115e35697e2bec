"""How an update travels in the log: the binary wire format of a push, plus its lr.

Payload: n little-endian int64 ids, then n*d little-endian float32 gradients. Headers: ``Robez-Shape:
n,d`` and ``Robez-Lr`` (``float.hex``, so every replica applies exactly the same lr).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from robez_core.errors import CorruptionError

from ..store.journal import UpdateRecord

SHAPE = "Robez-Shape"
LR = "Robez-Lr"
_IDS = np.dtype("<i8")
_GRADS = np.dtype("<f4")


def encode_update(ids: Tensor, grads: Tensor, lr: float) -> tuple[bytes, dict[str, str]]:
    """(payload, headers) of one validated push: ids int64 (n,), grads float32 (n, d)."""
    num_rows = int(ids.numel())
    dim = int(grads.shape[1]) if grads.dim() == 2 else 0
    payload = (
        ids.reshape(-1).numpy().astype(_IDS, copy=False).tobytes()
        + grads.reshape(num_rows, dim).numpy().astype(_GRADS, copy=False).tobytes()
    )
    return payload, {SHAPE: f"{num_rows},{dim}", LR: float(lr).hex()}


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
