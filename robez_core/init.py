"""``init_weight``: the initial ROBE-Z array, shared by the modules, ``Table`` and ``compress``."""

from __future__ import annotations

import torch
from torch import Tensor

from .config import DEFAULT_INIT_SCALE
from .hashing import DEFAULT_SEED

__all__ = ["init_weight"]


def init_weight(
    memory_size: int,
    init_scale: float = DEFAULT_INIT_SCALE,
    seed: int = DEFAULT_SEED,
    *,
    out: Tensor | None = None,
) -> Tensor:
    """A new array float32 (m,) drawn U(-init_scale, init_scale) from ``torch.Generator`` seeded ``seed``.

    Seeded on its own generator so that a module and a ``Table`` built from the same config start from
    the same array, whatever else used torch's global generator. ``out``: a contiguous float32 (m,)
    tensor to draw into instead (the service's shared memory), with the same values.
    """
    generator = torch.Generator().manual_seed(seed)
    if out is None:
        out = torch.empty(memory_size, dtype=torch.float32)
    elif tuple(out.shape) != (memory_size,) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 ({memory_size},) tensor")
    return out.uniform_(-init_scale, init_scale, generator=generator)
