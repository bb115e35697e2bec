"""robez_core: ROBE-Z compressed embedding tables with fused CPU kernels."""

from .allocator import MallocTuning, tune_malloc
from .collection import EmbeddingBagConfig, PooledEmbeddings, RobezEmbeddingBagCollection
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
from .modules import RobezEmbedding, RobezEmbeddingBag
from .table import Table, import_paper_state_dict

__all__ = [
    "PAPER_PRIME",
    "BusyError",
    "ConfigError",
    "ConflictError",
    "CorruptionError",
    "EmbeddingBagConfig",
    "InvalidInputError",
    "LimitExceededError",
    "MallocTuning",
    "NotFoundError",
    "OptimizerConfig",
    "PooledEmbeddings",
    "RobezEmbedding",
    "RobezEmbeddingBag",
    "RobezEmbeddingBagCollection",
    "RobezError",
    "Table",
    "TableConfig",
    "import_paper_state_dict",
    "paper_random_numbers",
    "tune_malloc",
]
