"""The names, limits and results of ``TableStore``'s API: what the routes and the codecs import."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import numpy as np
from torch import Tensor

from robez_core.config import OptimizerConfig, TableConfig
from robez_core.errors import (
    InvalidInputError,
    LimitExceededError,
)

from ..config import Settings

TABLE_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
Pooling = Literal["none", "sum", "mean"]
POOLINGS: tuple[str, ...] = ("none", "sum", "mean")


def validate_table_name(name: str) -> str:
    """Table names become registry keys and WAL file names: letters, digits, '_' and '-', at most 64."""
    if not isinstance(name, str) or not TABLE_NAME_PATTERN.fullmatch(name):
        raise InvalidInputError(
            f"invalid table name {name!r}: use 1-64 letters, digits, '_' or '-', "
            "starting with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class Limits:
    """Request and capacity limits (see ``Settings``); exceeding one raises ``LimitExceededError``."""

    max_ids_per_request: int
    max_values_per_request: int
    max_tables: int
    max_embedding_dim: int
    max_memory_size: int
    max_total_memory_bytes: int

    @classmethod
    def from_settings(cls, settings: Settings) -> Limits:
        return cls(
            max_ids_per_request=settings.max_ids_per_request,
            max_values_per_request=settings.max_values_per_request,
            max_tables=settings.max_tables,
            max_embedding_dim=settings.max_embedding_dim,
            max_memory_size=settings.max_memory_size,
            max_total_memory_bytes=settings.max_total_memory_bytes,
        )

    def max_checkpoint_bytes(self) -> tuple[int, str]:
        """The most tensor bytes an uploaded checkpoint may declare, and how that figure is made: a table's
        array and up to two optimizer states of its size (adam), float32, plus 1 MiB for the hash
        constants, never over ``max_total_memory_bytes``."""
        largest = 3 * self.max_memory_size * 4 + (1 << 20)
        if largest >= self.max_total_memory_bytes:
            return self.max_total_memory_bytes, f"max_total_memory_bytes={self.max_total_memory_bytes}"
        return largest, f"3 x max_memory_size={self.max_memory_size} float32 values + 1 MiB"

    def check_request(self, num_ids: int, embedding_dim: int) -> None:
        """A lookup or update of ``num_ids`` rows of ``embedding_dim`` values."""
        if num_ids > self.max_ids_per_request:
            raise LimitExceededError(
                f"{num_ids} ids in one request; the limit is max_ids_per_request={self.max_ids_per_request}"
            )
        if num_ids * embedding_dim > self.max_values_per_request:
            raise LimitExceededError(
                f"{num_ids} rows x {embedding_dim} values = {num_ids * embedding_dim} values in one request; "
                f"the limit is max_values_per_request={self.max_values_per_request}"
            )


@dataclass(frozen=True)
class TableInfo:
    """What ``GET /v1/tables/{name}`` reports about a table."""

    name: str
    config: TableConfig
    optimizer: OptimizerConfig
    version: int
    array: str
    array_tables: tuple[str, ...]  # every table reading this array (itself included)
    memory_bytes: int  # the array and its optimizer state


@dataclass(frozen=True)
class LookupResult:
    """Rows (n, d) float32 (or pooled bags (B, d)) as a numpy array (what the routes encode), the version
    read before gathering, stage times (s)."""

    rows: np.ndarray
    version: int
    hash_seconds: float
    lookup_seconds: float


@dataclass(frozen=True)
class LookupRequestItem:
    """One table's part of a multi-table lookup (arguments as ``TableStore.lookup``)."""

    table: str
    ids: Tensor | np.ndarray
    offsets: Tensor | None = None
    pooling: Pooling = "none"
    per_sample_weights: Tensor | None = None


@dataclass(slots=True)
class UpdateResult:
    """The version the update produced and its stage times in seconds. Made for every push, so not
    frozen: a frozen dataclass's constructor took 0.9 us against 0.3 us (a percent of a small push);
    nothing changes one after it is made."""

    version: int
    hash_seconds: float
    apply_seconds: float
