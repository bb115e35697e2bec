"""robez_core: ROBE-Z compressed embedding tables with fused CPU kernels."""

from .config import OptimizerConfig, TableConfig
from .errors import (
    BusyError,
    ConfigError,
    ConflictError,
    CorruptionError,
    InvalidInputError,
    LimitExceededError,
    NotFoundError,
    RobezError,
)
from .hashing import PAPER_PRIME, paper_random_numbers

__all__ = [
    "PAPER_PRIME",
    "BusyError",
    "ConfigError",
    "ConflictError",
    "CorruptionError",
    "InvalidInputError",
    "LimitExceededError",
    "NotFoundError",
    "OptimizerConfig",
    "RobezError",
    "TableConfig",
    "paper_random_numbers",
]
