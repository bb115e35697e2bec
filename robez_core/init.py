"""``init_weight``: the initial ROBE-Z array, shared by the modules, ``Table`` and ``compress``."""

from __future__ import annotations

import torch
from torch import Tensor

from .config import DEFAULT_INIT_SCALE
from .hashing import DEFAULT_SEED

__all__ = ["init_weight"]


def init_weight(memory_size: int, init_scale: float = DEFAULT_INIT_SCALE, seed: int = DEFAULT_SEED) -> Tensor:
    """A new array float32 (m,) drawn U(-init_scale, init_scale) from ``torch.Generator`` seeded ``seed``.

    Seeded on its own generator so that a module and a ``Table`` built from the same config start from
    the same array, whatever else used torch's global generator.
    """
    generator = torch.Generator().manual_seed(seed)
    return torch.empty(memory_size, dtype=torch.float32).uniform_(
        -init_scale, init_scale, generator=generator
    )
