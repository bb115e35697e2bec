"""Configuration dataclasses for ROBE-Z tables and their server-side optimizers.

Configs are plain frozen dataclasses, kept apart from the modules and tables that use them; invalid
values raise ``ConfigError`` (a ``ValueError``) at construction.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from .errors import ConfigError
from .hashing import DEFAULT_SEED, HASH_NAMES, MAX_FAST_RANGE, HashName

OptimizerName = Literal["sgd", "adagrad", "adam"]
OPTIMIZER_NAMES: tuple[str, ...] = ("sgd", "adagrad", "adam")
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# The paper initialises the shared array U(-0.001, 0.001); small, so pooled rows start near zero.
DEFAULT_INIT_SCALE = 0.001
# The largest lr a table accepts unless its config says otherwise (``OptimizerConfig.max_lr``): far above
# any useful step size (embedding lrs are ~1e-4..10), far below where lr alone overflows float32.
DEFAULT_MAX_LR = 1000.0
FLOAT32_MAX = 3.4028234663852886e38  # kernels apply lr as float32: a larger lr would be inf there
# A new array is drawn U(-init_scale, init_scale) in float32: the interval's width must be a float32 too.
MAX_INIT_SCALE = FLOAT32_MAX / 2


@dataclass(frozen=True)
class TableConfig:
    """Shape and hash of one ROBE-Z table.

    Args:
        num_embeddings: logical number of rows n (only used for reporting the compression ratio and for
            ``nn.Embedding``-style bounds; every int64 id hashes to a valid row).
        embedding_dim: d, values per row.
        memory_size: m, float32 values in the shared array.
        chunk_size: Z, contiguous values per block (Z = 1 is the plain hashing trick); m >= Z.
        seed: seeds the hash constants (``numpy.random.RandomState(seed)``) and the array init.
        val_offset: added to every id before hashing, so tables sharing one array read different rows.
        hash: ``"paper"`` (bit-exact with the paper's code) or ``"fast"`` (mixer + multiply-high).
        init_scale: a new array is initialised U(-init_scale, init_scale).
        random_numbers: the 11 hash constants ``[P, r0..r9]``; derived from ``seed`` when None (set it
            when importing a table whose constants did not come from a seed).
    """

    num_embeddings: int
    embedding_dim: int
    memory_size: int
    chunk_size: int = 32
    seed: int = DEFAULT_SEED
    val_offset: int = 0
    hash: HashName = "paper"
    init_scale: float = DEFAULT_INIT_SCALE
    random_numbers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.num_embeddings < 1:
            raise ConfigError(f"num_embeddings must be >= 1, got {self.num_embeddings}")
        if self.embedding_dim < 1:
            raise ConfigError(f"embedding_dim must be >= 1, got {self.embedding_dim}")
        if self.chunk_size < 1:
            raise ConfigError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.memory_size < self.chunk_size:
            raise ConfigError(f"memory_size ({self.memory_size}) must be >= chunk_size ({self.chunk_size})")
        if self.hash not in HASH_NAMES:
            raise ConfigError(f"unknown hash {self.hash!r}; expected one of {HASH_NAMES}")
        if self.hash == "fast" and self.memory_size - self.chunk_size + 1 > MAX_FAST_RANGE:
            raise ConfigError("hash='fast' needs memory_size - chunk_size + 1 <= 2**32")
        if not INT64_MIN <= self.val_offset <= INT64_MAX:
            raise ConfigError(f"val_offset must fit in int64, got {self.val_offset}")
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"seed must be in [0, 2**32) (numpy RandomState), got {self.seed}")
        if not 0 <= self.init_scale <= MAX_INIT_SCALE:
            raise ConfigError(
                f"init_scale must be in [0, {MAX_INIT_SCALE:.4g}] (float32 values), got {self.init_scale}"
            )
        if self.random_numbers is not None:
            if len(self.random_numbers) != 11 or self.random_numbers[0] <= 0:
                raise ConfigError("random_numbers must be 11 ints [P, r0..r9] with P > 0")
            object.__setattr__(self, "random_numbers", tuple(int(v) for v in self.random_numbers))

    @property
    def num_chunks(self) -> int:
        """Blocks per row: ceil(d / Z); the last one is shorter when Z does not divide d."""
        return -(-self.embedding_dim // self.chunk_size)

    @property
    def compression_ratio(self) -> float:
        """Size of the equivalent full table (n x d) over the shared array (m)."""
        return self.num_embeddings * self.embedding_dim / self.memory_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TableConfig:
        data = dict(data)
        if data.get("random_numbers") is not None:
            data["random_numbers"] = tuple(data["random_numbers"])
        return cls(**data)


@dataclass(frozen=True)
class OptimizerConfig:
    """A server-side optimizer applied by the fused update.

    ``adam`` is applied lazily, like ``torch.optim.SparseAdam``: only the array locations an update
    touches have their moments decayed and their values changed; ``step`` is counted per table.
    """

    name: OptimizerName = "sgd"
    lr: float = 0.01
    betas: tuple[float, float] = field(default=(0.9, 0.999))
    eps: float = 1e-8
    initial_accumulator_value: float = 0.0  # adagrad
    # The largest lr an update may use (the table's own lr and every per-update override); at most
    # FLOAT32_MAX. Updates whose step would overflow are refused whatever the lr (Table.check_step).
    max_lr: float = DEFAULT_MAX_LR

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZER_NAMES:
            raise ConfigError(f"unknown optimizer {self.name!r}; expected one of {OPTIMIZER_NAMES}")
        if not 0 < self.max_lr <= FLOAT32_MAX:
            raise ConfigError(f"max_lr must be in (0, {FLOAT32_MAX:.4g}] (float32), got {self.max_lr}")
        if not 0 < self.lr <= self.max_lr:
            raise ConfigError(f"lr must be a positive number at most max_lr={self.max_lr:g}, got {self.lr}")
        b1, b2 = self.betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ConfigError(f"betas must be in [0, 1), got {self.betas}")
        if not self.eps > 0:
            raise ConfigError(f"eps must be > 0, got {self.eps}")
        if not self.initial_accumulator_value >= 0:
            raise ConfigError("initial_accumulator_value must be >= 0")
        object.__setattr__(self, "betas", (float(b1), float(b2)))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OptimizerConfig:
        data = dict(data)
        if "betas" in data:
            data["betas"] = tuple(data["betas"])
        return cls(**data)
