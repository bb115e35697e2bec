"""``RobezEmbeddingBagCollection``: every categorical feature of a model over one shared ROBE-Z array.

The ROBE-Z paper's layout for a whole model: one array of ``memory_size`` floats holds all of a DLRM's
tables, each table reading it at its own ``val_offset``. This module takes a torchrec-shaped batch (keys,
values and lengths or offsets: a torchrec ``KeyedJaggedTensor`` as it is, by duck typing) and pools every
feature in **one** kernel call, forward and backward (the table-batched idea of FBGEMM's TBE), with one
optimizer step for the whole array. Configs are dataclasses apart from the module, as in torchrec.

Bit for bit: each feature's pooled output is the one ``RobezEmbeddingBag`` (same array, same
``val_offset``, same pooling) gives; the array's gradient, and the step, is one coalesced update of every
feature's per-id gradients in feature order (``kernels.coalesce_chunk_rows``), which is what a server
applies for a multi-table push (``prepare_shared_step``). The per-feature modules' summed gradients agree
with it to float rounding: autograd adds their separate gradients in its own order.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
import torch
from torch import Tensor, nn

from . import buffers, kernels, optim
from .config import DEFAULT_INIT_SCALE, OptimizerConfig, TableConfig
from .errors import ConfigError, InvalidInputError
from .hashing import DEFAULT_SEED, HashName, paper_random_numbers, validate_random_numbers
from .init import init_weight
from .modules import RobezEmbeddingBag, keep_coalesced_flag, sparse_from_coalesced
from .optim import PreparedStep
from .table import Table

__all__ = [
    "EmbeddingBagConfig",
    "JaggedFeatures",
    "PooledEmbeddings",
    "RobezEmbeddingBagCollection",
    "check_table_configs",
    "parse_jagged",
    "per_id_gradients",
    "prepare_shared_step",
]

Pooling = Literal["sum", "mean"]
_INTEGER_DTYPES = (torch.int64, torch.int32)


def _pooling_name(pooling: object) -> str:
    """``"sum"``/``"mean"``, also from torchrec's ``PoolingType.SUM`` / ``.MEAN`` (by its ``name``)."""
    name = getattr(pooling, "name", pooling)
    return str(name).lower()


@dataclass(frozen=True)
class EmbeddingBagConfig:
    """One table of a collection (torchrec's ``EmbeddingBagConfig``, minus what ROBE-Z does not need).

    Args:
        name: the table's name, unique in the collection.
        num_embeddings: n, ids of its features must lie in ``[0, n)``.
        embedding_dim: d, values per pooled row.
        feature_names: the features (input keys) that look up this table; each has its own output.
        pooling: ``"sum"`` (torchrec's default) or ``"mean"``; torchrec's ``PoolingType`` is accepted.
        val_offset: added to every id before hashing; None places the table after the previous ones
            (the sum of their ``num_embeddings``), so no two tables read the same hashed rows by design.
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...] = field(default=())
    pooling: Pooling = "sum"
    val_offset: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("a table needs a name")
        names = (self.feature_names,) if isinstance(self.feature_names, str) else self.feature_names
        object.__setattr__(self, "feature_names", tuple(names) or (self.name,))
        pooling = _pooling_name(self.pooling)
        if pooling not in ("sum", "mean"):
            raise ConfigError(f"table {self.name!r}: pooling must be 'sum' or 'mean', got {self.pooling!r}")
        object.__setattr__(self, "pooling", pooling)
        if self.num_embeddings < 1 or self.embedding_dim < 1:
            raise ConfigError(f"table {self.name!r}: num_embeddings and embedding_dim must be >= 1")


class JaggedFeatures(Protocol):
    """What the collection reads of its input: torchrec's ``KeyedJaggedTensor`` has all of it."""

    def keys(self) -> list[str]: ...
    def values(self) -> Tensor: ...


class PooledEmbeddings:
    """The collection's output, like torchrec's ``KeyedTensor``: ``values()`` float32 (B, sum of dims)
    with the features' columns in key order, ``keys()``, ``length_per_key()``, ``offset_per_key()``,
    ``self[key]`` (B, d_key) (a view) and ``to_dict()``."""

    def __init__(self, keys: list[str], length_per_key: list[int], values: Tensor) -> None:
        self._keys = keys
        self._lengths = length_per_key
        self._offsets = [0]
        for length in length_per_key:
            self._offsets.append(self._offsets[-1] + length)
        self._index = {key: i for i, key in enumerate(keys)}
        self._values = values

    def keys(self) -> list[str]:
        return list(self._keys)

    def values(self) -> Tensor:
        return self._values

    def length_per_key(self) -> list[int]:
        return list(self._lengths)

    def offset_per_key(self) -> list[int]:
        return list(self._offsets)

    def __getitem__(self, key: str) -> Tensor:
        i = self._index[key]
        return self._values[:, self._offsets[i] : self._offsets[i + 1]]

    def to_dict(self) -> dict[str, Tensor]:
        return {key: self[key] for key in self._keys}

    def __repr__(self) -> str:
        return f"PooledEmbeddings(keys={self._keys}, values={tuple(self._values.shape)})"


def _huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Zeros in memory numpy allocated: numpy asks the kernel for transparent huge pages on large arrays
    and torch does not, and the random reads and steps over a 100 MB array then miss the TLB far less
    (forward -15%, adagrad step -50% CPU on the DLRM benchmark's array: docs/benchmarks/dlrm-*.md)."""
    return torch.from_numpy(np.zeros(shape, dtype=torch.empty(0, dtype=dtype).numpy().dtype))


def _int_tensor(value: Any, what: str) -> Tensor:
    if not isinstance(value, Tensor) or value.dtype not in _INTEGER_DTYPES or value.dim() != 1:
        raise InvalidInputError(f"{what} must be a 1-D int64 (or int32) tensor")
    if value.device.type != "cpu" or value.layout != torch.strided:
        raise InvalidInputError(f"{what} must be a dense CPU tensor")
    return value.to(torch.int64).contiguous()


def parse_jagged(
    features: JaggedFeatures | None = None,
    *,
    keys: Sequence[str] | None = None,
    values: Tensor | None = None,
    lengths: Tensor | None = None,
    offsets: Tensor | None = None,
) -> tuple[tuple[str, ...], Tensor, Tensor]:
    """A collection's input, checked: (keys, ids int64 (N,), bag bounds int64 (F * B + 1,)).

    ``features`` is a torchrec ``KeyedJaggedTensor`` (or anything with ``keys()``, ``values()`` and
    ``offsets()`` or ``lengths()``), else ``keys`` + ``values`` + ``lengths`` (F * B,) or ``offsets``
    (F * B + 1,). Bag ``f * B + b`` is sample b of key f. ``InvalidInputError`` on a malformed batch
    (what a remote collection checks before it sends anything, as the local one does)."""
    if features is not None:
        if keys is not None or values is not None or lengths is not None or offsets is not None:
            raise InvalidInputError("give either features or keys/values/lengths|offsets, not both")
        keys, values = list(features.keys()), features.values()
        # torchrec's KJT keeps whichever it was built with and computes the other on demand
        get_offsets = getattr(features, "offsets", None)
        offsets = get_offsets() if callable(get_offsets) else None
        if offsets is None:
            lengths = features.lengths()  # type: ignore[attr-defined]
    if keys is None or values is None:
        raise InvalidInputError("keys and values are required")
    key_tuple = tuple(keys)
    ids = _int_tensor(values, "values")
    if (lengths is None) == (offsets is None):
        raise InvalidInputError("give exactly one of lengths and offsets")
    if offsets is not None:
        bounds = _int_tensor(offsets, "offsets")
        if bounds.numel() == 0 or int(bounds[0]) != 0 or bool((bounds[1:] < bounds[:-1]).any()):
            raise InvalidInputError("offsets must start at 0 and be non-decreasing")
        if int(bounds[-1]) != ids.numel():
            raise InvalidInputError(f"offsets end at {int(bounds[-1])} but there are {ids.numel()} values")
    else:
        counts = _int_tensor(lengths, "lengths")
        if counts.numel() and int(counts.min()) < 0:
            raise InvalidInputError("lengths must be >= 0")
        bounds = torch.zeros(counts.numel() + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=bounds[1:])
        if int(bounds[-1]) != ids.numel():
            raise InvalidInputError(f"lengths sum to {int(bounds[-1])} but there are {ids.numel()} values")
    if (bounds.numel() - 1) % max(len(key_tuple), 1):
        raise InvalidInputError(
            f"{bounds.numel() - 1} bags do not split into {len(key_tuple)} keys of B bags each"
        )
    return key_tuple, ids, bounds


@dataclass(frozen=True)
class _Feature:
    name: str
    table: EmbeddingBagConfig
    val_offset: int
    column: int


class _CollectionBag(torch.autograd.Function):
    """All features pooled by one kernel; backward: one coalesce (sparse grad or fused step) or one
    dense scatter over every feature's chunks."""

    @staticmethod
    def forward(
        ctx: Any,
        weight: Tensor,
        ids: Tensor,
        bounds: Tensor,
        layout: kernels.FeatureLayout,
        module: RobezEmbeddingBagCollection,
    ) -> Tensor:
        start, start_cpu = time.perf_counter(), time.thread_time()
        pooled, chunk_offsets, _ = kernels.collection_lookup(
            weight, ids, bounds, layout, module.random_numbers, module.hash
        )
        # Intermediates no caller can modify in place: plain attributes, no version checks needed.
        ctx.ids, ctx.bounds, ctx.layout, ctx.chunk_offsets = ids, bounds, layout, chunk_offsets
        ctx.module = module
        module._record("lookup", start, start_cpu)
        return pooled

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, None, None, None, None]:
        module: RobezEmbeddingBagCollection = ctx.module
        weight = module.weight
        start, start_cpu = time.perf_counter(), time.thread_time()
        grad_output = grad_output.contiguous()
        grad: Tensor | None = None
        if module.optimizer is not None or module.sparse:
            locations, values = kernels.collection_coalesce_grad(
                grad_output, ctx.ids, ctx.bounds, ctx.layout, ctx.chunk_offsets, weight.numel()
            )
            coalesced, coalesced_cpu = module._record("backward", start, start_cpu)
            if module.optimizer is not None:
                optim.apply_coalesced(module.optimizer, weight, module.optimizer_state, locations, values)
                module._record("optimizer", coalesced, coalesced_cpu)
            else:
                grad = sparse_from_coalesced(locations, values, weight.numel())
        else:
            # buffers' pool hands the (m,) array back to the next backward once .grad lets it go
            grad = torch.from_numpy(buffers.zeros((weight.numel(),), np.float32))
            kernels.collection_scatter_grad(
                grad_output, ctx.ids, ctx.bounds, ctx.layout, ctx.chunk_offsets, grad
            )
            module._record("backward", start, start_cpu)
        return grad, None, None, None, None


def check_table_configs(tables: Sequence[EmbeddingBagConfig]) -> list[EmbeddingBagConfig]:
    """The tables of a collection (local or remote) as a list: a non-empty sequence of
    ``EmbeddingBagConfig`` with unique names, else ``ConfigError``."""
    tables = list(tables)
    if not tables or not all(isinstance(t, EmbeddingBagConfig) for t in tables):
        raise ConfigError("tables must be a non-empty sequence of EmbeddingBagConfig")
    if len({t.name for t in tables}) != len(tables):
        raise ConfigError("table names must be unique")
    return tables


class RobezEmbeddingBagCollection(nn.Module):
    """Many pooled embedding features over one shared ROBE-Z array, in one kernel call per pass.

    Args:
        tables: ``EmbeddingBagConfig`` s; their features' outputs come in table order, then
            ``feature_names`` order.
        memory_size: m, floats in a new array (U(-init_scale, init_scale), seeded ``seed``); or give
            ``weight``, an existing float32 (m,) array (tensor or ``nn.Parameter``) to share.
        chunk_size, seed, hash, init_scale, random_numbers: as for ``RobezEmbeddingBag`` (one hash for
            the whole array).
        sparse: give ``weight`` a coalesced sparse COO gradient (m,) instead of a dense one.
        optimizer: an ``OptimizerConfig`` (sgd, adagrad, lazy adam): the array is then stepped inside
            ``backward`` (robez's fused step, the one a server runs) and never gets a ``.grad``; its
            state lives in ``optimizer_state`` (also buffers of this module, so in ``state_dict()``).
            Leave ``weight`` out of the dense optimizer (one holding it skips it: no grad).
        validate_ids: refuse ids outside ``[0, num_embeddings)`` (``InvalidInputError``); on by default.

    Shapes:
        ``forward(features)`` with ``features`` a ``KeyedJaggedTensor`` (or anything with ``keys()``,
        ``values()`` and ``offsets()`` or ``lengths()``), or ``forward(keys=..., values=..., lengths=...)``
        / ``offsets=...``: F keys (every feature of the collection, any order), ``values`` int64 (N,) key
        by key, ``lengths`` (F * B,) or ``offsets`` (F * B + 1,) bag by bag: sample b of key f is bag
        ``f * B + b``. Returns ``PooledEmbeddings``: ``values()`` float32 (B, sum of dims) in the
        collection's feature order, ``result[name]`` (B, d). Empty bags pool to zeros.

    Example::

        >>> tables = [EmbeddingBagConfig("t0", 1_000, 16, ["f0"]),
        ...           EmbeddingBagConfig("t1", 50_000, 16, ["f1", "f2"], pooling="mean")]
        >>> ebc = RobezEmbeddingBagCollection(tables, memory_size=1 << 16,
        ...                                   optimizer=OptimizerConfig("adagrad", lr=0.05))
        >>> out = ebc(keys=["f0", "f1", "f2"], values=torch.tensor([3, 7, 8, 9]),
        ...           lengths=torch.tensor([1, 0, 2, 0, 0, 1]))      # B = 2
        >>> out.values().shape, out["f1"].shape
        (torch.Size([2, 48]), torch.Size([2, 16]))
        >>> out.values().sum().backward()                            # one fused adagrad step
    """

    random_numbers: Tensor

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        memory_size: int | None = None,
        *,
        weight: Tensor | None = None,
        chunk_size: int = 32,
        seed: int = DEFAULT_SEED,
        hash: HashName = "paper",
        init_scale: float = DEFAULT_INIT_SCALE,
        random_numbers: Tensor | Sequence[int] | None = None,
        sparse: bool = False,
        optimizer: OptimizerConfig | None = None,
        validate_ids: bool = True,
    ) -> None:
        super().__init__()
        tables = check_table_configs(tables)
        if weight is None:
            if memory_size is None:
                raise ConfigError("give either memory_size (a new array) or weight (an array to share)")
        else:
            if (
                not isinstance(weight, Tensor)
                or weight.dim() != 1
                or weight.dtype != torch.float32
                or weight.device.type != "cpu"
                or not weight.is_contiguous()
            ):
                raise ConfigError("weight must be a contiguous 1-D float32 CPU tensor")
            if memory_size is not None and memory_size != weight.numel():
                raise ConfigError(
                    f"memory_size ({memory_size}) disagrees with len(weight) ({weight.numel()})"
                )
            memory_size = weight.numel()
        if sparse and optimizer is not None:
            raise ConfigError("sparse gradients and a fused optimizer exclude each other: pick one")
        if random_numbers is not None and not isinstance(random_numbers, Tensor):
            random_numbers = torch.tensor(list(random_numbers), dtype=torch.int64)
        rn_tuple = None if random_numbers is None else tuple(validate_random_numbers(random_numbers).tolist())
        features: list[_Feature] = []
        self.table_configs: dict[str, TableConfig] = {}
        next_offset, column = 0, 0
        for table in tables:
            val_offset = next_offset if table.val_offset is None else table.val_offset
            next_offset = val_offset + table.num_embeddings
            # The TableConfig checks the shape and hash against this array (memory_size >= chunk_size...)
            self.table_configs[table.name] = TableConfig(
                num_embeddings=table.num_embeddings,
                embedding_dim=table.embedding_dim,
                memory_size=memory_size,
                chunk_size=chunk_size,
                seed=seed,
                val_offset=val_offset,
                hash=hash,
                init_scale=init_scale,
                random_numbers=rn_tuple,
            )
            for name in table.feature_names:
                features.append(_Feature(name, table, val_offset, column))
                column += table.embedding_dim
        names = [f.name for f in features]
        if len(set(names)) != len(names):
            raise ConfigError(f"feature names must be unique across tables, got {names}")
        self.tables = tables
        self._features = {f.name: f for f in features}
        self.feature_names = names
        self.chunk_size, self.hash, self.sparse = chunk_size, hash, bool(sparse)
        self.memory_size: int = memory_size
        self.optimizer = optimizer
        self.validate_ids = bool(validate_ids)
        if weight is None:
            array = _huge_page_zeros((memory_size,), torch.float32)
            self.weight = nn.Parameter(init_weight(memory_size, init_scale, seed, out=array))
        elif isinstance(weight, nn.Parameter):
            self.weight = weight
        else:
            self.weight = nn.Parameter(weight)
        constants = (
            paper_random_numbers(seed) if rn_tuple is None else torch.tensor(rn_tuple, dtype=torch.int64)
        )
        self.register_buffer("random_numbers", constants)
        self.optimizer_state: dict[str, Tensor] = {}
        if optimizer is not None:
            layout = optim.state_layout(optimizer, memory_size)
            self.optimizer_state = optim.init_state(
                optimizer,
                memory_size,
                out={name: _huge_page_zeros(shape, dtype) for name, (shape, dtype) in layout.items()},
            )
            for name, tensor in self.optimizer_state.items():
                self.register_buffer(f"optimizer_{name}", tensor)
        if self.sparse and not getattr(self.weight, "_robez_coalesced_hook", False):
            self.weight.register_post_accumulate_grad_hook(keep_coalesced_flag)
            self.weight._robez_coalesced_hook = True  # type: ignore[attr-defined]
        self._layouts: dict[tuple[str, ...], kernels.FeatureLayout] = {}
        # Seconds of the last forward's kernel ("lookup"), backward's coalesce or scatter ("backward")
        # and fused step ("optimizer"): the step's split, for benchmarks and profiling; wall clock, and
        # this thread's CPU time (what a step costs on a machine whose other processes take the cores).
        self.timings: dict[str, float] = {}
        self.cpu_timings: dict[str, float] = {}

    def _record(self, part: str, start: float, start_cpu: float) -> tuple[float, float]:
        """Store the seconds of ``part`` since (``start``, ``start_cpu``); returns (now, now CPU)."""
        now, now_cpu = time.perf_counter(), time.thread_time()
        self.timings[part], self.cpu_timings[part] = now - start, now_cpu - start_cpu
        return now, now_cpu

    # ------------------------------------------------------------------ input

    def _layout(self, keys: tuple[str, ...]) -> kernels.FeatureLayout:
        """The kernels' layout for input keys in this order (outputs stay in the collection's order)."""
        layout = self._layouts.get(keys)
        if layout is None:
            unknown = [k for k in keys if k not in self._features]
            if unknown:
                raise InvalidInputError(
                    f"unknown feature keys {unknown}; this collection has {self.feature_names}"
                )
            if len(set(keys)) != len(keys) or len(keys) != len(self._features):
                missing = sorted(set(self._features) - set(keys))
                raise InvalidInputError(
                    f"the input must give every feature once: keys {list(keys)}, missing {missing}"
                )
            feats = [self._features[k] for k in keys]
            layout = self._layouts[keys] = kernels.FeatureLayout.build(
                [f.val_offset for f in feats],
                [f.table.embedding_dim for f in feats],
                [f.table.pooling == "mean" for f in feats],
                [f.table.num_embeddings for f in feats],
                self.chunk_size,
                columns=[f.column for f in feats],
            )
        return layout

    def _check_ids(
        self, keys: tuple[str, ...], ids: Tensor, bounds: Tensor, layout: kernels.FeatureLayout
    ) -> None:
        bad = kernels.collection_first_bad_id(ids, bounds, layout)
        if bad >= 0:
            batch_size = (bounds.numel() - 1) // len(keys)
            f = int(torch.searchsorted(bounds[::batch_size].contiguous(), bad, right=True)) - 1
            feature = self._features[keys[f]]
            raise InvalidInputError(
                f"feature {keys[f]!r}: id {int(ids[bad])} is outside [0, {feature.table.num_embeddings}) "
                f"(table {feature.table.name!r})"
            )

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        features: JaggedFeatures | None = None,
        *,
        keys: Sequence[str] | None = None,
        values: Tensor | None = None,
        lengths: Tensor | None = None,
        offsets: Tensor | None = None,
    ) -> PooledEmbeddings:
        key_tuple, ids, bounds = parse_jagged(
            features, keys=keys, values=values, lengths=lengths, offsets=offsets
        )
        layout = self._layout(key_tuple)
        if self.validate_ids:
            self._check_ids(key_tuple, ids, bounds, layout)
        if torch.is_grad_enabled() and self.weight.requires_grad:
            pooled = _CollectionBag.apply(self.weight, ids, bounds, layout, self)
        else:
            pooled, _, _ = kernels.collection_lookup(
                self.weight, ids, bounds, layout, self.random_numbers, self.hash
            )
        return PooledEmbeddings(
            list(self.feature_names),
            [self._features[k].table.embedding_dim for k in self.feature_names],
            pooled,
        )

    # ------------------------------------------------------------------ the same tables, one at a time

    def table(self, name: str) -> Table:
        """A ``Table`` over this collection's array for table ``name`` (its dim and ``val_offset``), with
        this collection's optimizer and state, shared: what a server holds for the table."""
        if name not in self.table_configs:
            raise ConfigError(f"no table {name!r}; tables: {list(self.table_configs)}")
        optimizer = self.optimizer or OptimizerConfig()
        state = self.optimizer_state if self.optimizer is not None else None
        return Table(self.table_configs[name], optimizer, weight=self.weight.data, state=state)

    def feature_module(self, feature: str, *, sparse: bool | None = None) -> RobezEmbeddingBag:
        """A ``RobezEmbeddingBag`` for one feature on the same ``weight`` Parameter (same ``val_offset`` and
        pooling): the per-feature module whose output this collection reproduces bit for bit."""
        if feature not in self._features:
            raise ConfigError(f"no feature {feature!r}; features: {self.feature_names}")
        f = self._features[feature]
        config = self.table_configs[f.table.name]
        return RobezEmbeddingBag(
            config.num_embeddings,
            config.embedding_dim,
            weight=self.weight,
            chunk_size=config.chunk_size,
            seed=config.seed,
            val_offset=config.val_offset,
            hash=config.hash,
            init_scale=config.init_scale,
            random_numbers=self.random_numbers,
            sparse=self.sparse if sparse is None else sparse,
            mode=f.table.pooling,
            include_last_offset=True,
        )

    def extra_repr(self) -> str:
        return (
            f"features={len(self.feature_names)}, tables={len(self.tables)}, memory_size={self.memory_size}, "
            f"chunk_size={self.chunk_size}, hash={self.hash!r}"
            + (", sparse=True" if self.sparse else "")
            + (f", optimizer={self.optimizer.name!r}" if self.optimizer is not None else "")
        )


def per_id_gradients(grad_pooled: Tensor, offsets: Tensor, pooling: str) -> Tensor:
    """Each id's gradient float32 (N, d) from its bag's gradient ``grad_pooled`` (B, d), bags given by
    ``offsets`` int64 (B + 1,): the bag's gradient, divided by its length for ``"mean"``, with the same
    float32 arithmetic as the modules' backward (what a client pushes to a server for one feature)."""
    counts = offsets[1:] - offsets[:-1]
    if int(offsets[-1]) == counts.numel() and bool((counts == 1).all()):
        # One id per bag (Criteo's features): each id's gradient is its bag's (x / 1 is x, bit for bit),
        # one copy where the general path below gathers and divides (~0.25 ms a feature at B = 2048).
        return grad_pooled.contiguous() if not grad_pooled.is_contiguous() else grad_pooled.clone()
    bag_of_id = torch.repeat_interleave(torch.arange(counts.numel()), counts, output_size=int(offsets[-1]))
    grads = grad_pooled.contiguous()[bag_of_id]
    if _pooling_name(pooling) == "mean":
        grads = grads / counts.to(torch.float32)[bag_of_id].unsqueeze(1)
    return grads


def prepare_shared_step(
    tables: Sequence[Table],
    ids: Sequence[Tensor],
    grads: Sequence[Tensor],
    lr: float | None = None,
) -> PreparedStep:
    """One coalesced step of several tables over one array: the update a collection's step makes.

    ``tables[t]`` (tables sharing one ``weight`` and optimizer state, e.g. ``collection.table(name)`` or a
    server's tables of one array) gets ids ``ids[t]`` int64 (N_t,) with per-id gradients ``grads[t]``
    float32 (N_t, d_t) (``per_id_gradients``). Checks every input, hashes each table's ids and coalesces
    all chunks at once in the order given; ``tables[0].check_step`` / ``apply_step`` then apply it, the
    same bits as the collection's own step when the tables and ids come in its feature order.
    """
    if not tables or not len(tables) == len(ids) == len(grads):
        raise InvalidInputError("give one ids and one grads tensor per table (at least one table)")
    first = tables[0]
    for table in tables:
        shares = table.weight.data_ptr() == first.weight.data_ptr() and table.optimizer == first.optimizer
        if not shares or {k: v.data_ptr() for k, v in table.state.items()} != {
            k: v.data_ptr() for k, v in first.state.items()
        }:
            raise InvalidInputError("the tables of one step must share one array, optimizer and state")
    for table, table_ids, table_grads in zip(tables, ids, grads, strict=True):
        table.validate_grads(table_ids, table_grads, finite=False)  # the values: in the kernel below
    step_lr = first.optimizer.lr if lr is None else float(lr)
    if not (step_lr > 0 and math.isfinite(step_lr)):
        raise InvalidInputError(f"lr must be a positive finite number, got {lr!r}")
    if step_lr > first.optimizer.max_lr:
        raise InvalidInputError(f"lr {step_lr:g} is over the tables' max_lr={first.optimizer.max_lr:g}")
    # Every table hashed, its gradients checked finite and all coalesced in one compiled call: the bits
    # of each table's ``hash`` then ``coalesce_chunk_rows`` of them all.
    locations, values = kernels.coalesce_table_pushes(
        [table.hash_spec() for table in tables],
        [table_ids.numpy() for table_ids in ids],
        [table_grads.detach().numpy() for table_grads in grads],
        first.config.chunk_size,
        first.config.memory_size,
    )
    return PreparedStep(locations, values, step_lr)
