"""``RobezEmbedding`` and ``RobezEmbeddingBag``: drop-in ROBE-Z replacements for ``nn.Embedding(Bag)``.

A ROBE-Z table of ``num_embeddings`` logical rows of ``embedding_dim`` d reads each row from one shared
float32 array ``weight`` of ``memory_size`` m, in blocks of ``chunk_size`` Z contiguous values whose
start is hashed from the id (see ``hashing.py``). Every int64 id is a valid row.

The modules are thin: configuration is a ``TableConfig``; the numerics are the fused kernels
(``backend="fused"``) or the pure-torch reference (``backend="reference"``), both behind custom autograd
Functions that give either a dense (m,) gradient or, with ``sparse=True``, a coalesced ``torch.sparse_coo``
gradient of shape (m,) for ``torch.optim.SparseAdam`` / ``SGD`` / ``Adagrad``. For the dense gradient,
``torch.optim.Adam(..., fused=True)`` steps the array in one pass over the parameter, its gradient and both
moments (torch's default CPU Adam makes several passes): what the bench's fused rows step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Self

import numpy as np
import torch
from torch import Tensor, nn

from . import buffers, kernels, reference
from .config import DEFAULT_INIT_SCALE, TableConfig
from .errors import ConfigError, InvalidInputError
from .hashing import DEFAULT_SEED, HashName, paper_random_numbers, validate_random_numbers
from .init import init_weight

__all__ = ["BACKENDS", "RobezEmbedding", "RobezEmbeddingBag", "init_weight"]

Backend = Literal["fused", "reference"]
BagMode = Literal["sum", "mean"]
BACKENDS: tuple[str, ...] = ("fused", "reference")
_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _as_int64_ids(ids: Tensor, what: str = "ids", contiguous: bool = True) -> Tensor:
    """Checked int64 ``ids``; with ``contiguous=False`` a strided int64 tensor is passed on uncopied."""
    if not isinstance(ids, Tensor):
        raise InvalidInputError(f"{what} must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype not in _INTEGER_DTYPES:
        raise InvalidInputError(f"{what} must be an integer tensor (int64 preferred), got {ids.dtype}")
    if ids.device.type != "cpu":
        raise InvalidInputError(f"{what} must be on the CPU, got {ids.device}")
    if ids.layout != torch.strided:
        raise InvalidInputError(f"{what} must be a dense tensor, got layout {ids.layout}")
    ids = ids.to(torch.int64)
    return ids.contiguous() if contiguous else ids


def sparse_from_coalesced(locations: Tensor, values: Tensor, memory_size: int) -> Tensor:
    return torch.sparse_coo_tensor(
        locations.unsqueeze(0), values, (memory_size,), is_coalesced=True, check_invariants=False
    )


def keep_coalesced_flag(param: Tensor) -> None:
    """Post-accumulate hook: re-mark ``param.grad`` coalesced when its indices prove it is.

    Autograd rebuilds a sparse gradient when it stores it in ``.grad`` and drops the coalesced flag, so
    ``SparseAdam`` would sort the already sorted locations again (about 0.2 s for 2.4M locations). A strictly
    increasing index row is exactly the invariant, and checking it is O(nnz); grads summed from several
    tables sharing the array fail the check and stay unmarked.
    """
    grad = param.grad
    if grad is None or not grad.is_sparse or grad.is_coalesced() or grad.sparse_dim() != 1:
        return
    indices = grad._indices()[0]
    if indices.numel() < 2 or bool((indices[1:] > indices[:-1]).all()):
        grad._coalesced_(True)


def _weight_grad(
    grad_rows: Tensor, offsets: Tensor, chunk_size: int, memory_size: int, sparse: bool
) -> Tensor:
    """The (m,) gradient of ``weight`` from output-row gradients (N, d) at chunk ``offsets`` (N, C)."""
    if sparse:
        locations, values = kernels.coalesce_grad(grad_rows, offsets, chunk_size, memory_size)
        return sparse_from_coalesced(locations, values, memory_size)
    grad = torch.from_numpy(buffers.zeros((memory_size,), np.float32))  # reused once .grad lets go
    kernels.scatter_grad(grad_rows, offsets, chunk_size, grad)
    return grad


class _FusedLookup(torch.autograd.Function):
    """rows = gather(weight, chunk_offsets(ids)); keeps the (N, C) offsets, not an (N, d) index."""

    @staticmethod
    def forward(ctx: Any, weight: Tensor, ids: Tensor, table: _RobezBase) -> Tensor:
        """``ids`` int64 (N,), already checked by the module."""
        config = table.config
        offsets = kernels.chunk_offsets(
            ids,
            config.num_chunks,
            config.chunk_size,
            config.memory_size,
            table.random_numbers,
            config.val_offset,
            config.hash,
            # For the dense backward, int32 where they fit (arrays up to 8 GB): half the bytes to keep
            torch.int32
            if not table.sparse and kernels.fits_int32_offsets(config.memory_size, config.chunk_size)
            else torch.int64,
        )
        # The offsets are an intermediate no caller can modify in place, so a plain attribute keeps them:
        # save_for_backward's version checks are for inputs and outputs.
        ctx.offsets = offsets
        ctx.chunk_size, ctx.memory_size, ctx.sparse = config.chunk_size, weight.numel(), table.sparse
        return kernels.gather(weight, offsets, config.embedding_dim, config.chunk_size)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, None, None]:
        grad = _weight_grad(
            grad_output.contiguous(), ctx.offsets, ctx.chunk_size, ctx.memory_size, ctx.sparse
        )
        return grad, None, None


class _FusedBag(torch.autograd.Function):
    """Pooled rows by the fused bag kernel; backward spreads each bag's gradient back to its rows."""

    @staticmethod
    def forward(
        ctx: Any,
        weight: Tensor,
        per_sample_weights: Tensor | None,
        ids: Tensor,
        bag_starts: Tensor,
        mode: BagMode,
        table: _RobezBase,
    ) -> Tensor:
        pooled = kernels.lookup_bag(
            weight,
            ids,
            bag_starts,
            per_sample_weights,
            mode,
            table.embedding_dim,
            table.chunk_size,
            table.random_numbers,
            table.val_offset,
            table.hash,
        )
        offsets = table.hash_ids(ids)
        # The array itself is only needed for the per-sample-weight gradient; saving it otherwise would
        # make an in-place update between forward and backward an autograd error for nothing.
        saved_weight = weight if ctx.needs_input_grad[1] else None
        ctx.save_for_backward(saved_weight, offsets, bag_starts, per_sample_weights)
        ctx.mode, ctx.table, ctx.memory_size = mode, table, weight.numel()
        return pooled

    @staticmethod
    def backward(
        ctx: Any, grad_output: Tensor
    ) -> tuple[Tensor | None, Tensor | None, None, None, None, None]:
        weight, offsets, bag_starts, per_sample_weights = ctx.saved_tensors
        table: _RobezBase = ctx.table
        num_ids = offsets.shape[0]
        bounds = torch.cat([bag_starts, torch.tensor([num_ids], dtype=torch.int64)])
        bag_ids = reference.bag_ids_from_offsets(bounds, num_ids)
        grad_per_id = grad_output.contiguous()[bag_ids]  # (N, d)
        grad_psw = None
        if ctx.needs_input_grad[1]:
            rows = kernels.gather(weight, offsets, table.embedding_dim, table.chunk_size)
            grad_psw = (grad_per_id * rows).sum(dim=1)
        if ctx.mode == "mean":
            counts = (bounds[1:] - bounds[:-1]).to(torch.float32)
            grad_per_id = grad_per_id / counts[bag_ids].unsqueeze(1)
        if per_sample_weights is not None:
            grad_per_id = grad_per_id * per_sample_weights.unsqueeze(1)
        grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_weight = _weight_grad(
                grad_per_id.contiguous(), offsets, table.chunk_size, ctx.memory_size, table.sparse
            )
        return grad_weight, grad_psw, None, None, None, None


class _RobezBase(nn.Module):
    """Shared configuration, array and hashing of ``RobezEmbedding`` and ``RobezEmbeddingBag``."""

    random_numbers: Tensor

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        memory_size: int | None = None,
        *,
        weight: Tensor | None = None,
        chunk_size: int = 32,
        seed: int = DEFAULT_SEED,
        val_offset: int = 0,
        hash: HashName = "paper",
        sparse: bool = False,
        backend: Backend = "fused",
        init_scale: float = DEFAULT_INIT_SCALE,
        random_numbers: Tensor | Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ConfigError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
        if weight is None:
            if memory_size is None:
                raise ConfigError("give either memory_size (a new array) or weight (an array to share)")
        else:
            if not isinstance(weight, Tensor):
                raise ConfigError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
            if weight.dim() != 1 or weight.dtype != torch.float32 or weight.device.type != "cpu":
                raise ConfigError(
                    f"weight must be a 1-D float32 CPU tensor, got {weight.dtype} {tuple(weight.shape)} "
                    f"on {weight.device}"
                )
            if not weight.is_contiguous():
                raise ConfigError("weight must be contiguous (it is shared and updated in place)")
            if memory_size is not None and memory_size != weight.numel():
                raise ConfigError(
                    f"memory_size ({memory_size}) disagrees with len(weight) ({weight.numel()})"
                )
            memory_size = weight.numel()
        if random_numbers is not None and not isinstance(random_numbers, Tensor):
            random_numbers = torch.tensor(list(random_numbers), dtype=torch.int64)
        rn_tuple = None if random_numbers is None else tuple(validate_random_numbers(random_numbers).tolist())
        self.config = TableConfig(
            num_embeddings=num_embeddings,
            embedding_dim=embedding_dim,
            memory_size=memory_size,
            chunk_size=chunk_size,
            seed=seed,
            val_offset=val_offset,
            hash=hash,
            init_scale=init_scale,
            random_numbers=rn_tuple,
        )
        self.sparse = bool(sparse)
        self.backend: Backend = backend
        if weight is None:
            self.weight = nn.Parameter(init_weight(memory_size, init_scale, seed))
        elif isinstance(weight, nn.Parameter):
            self.weight = weight  # the very same Parameter: optimizers see one array, not one per table
        else:
            self.weight = nn.Parameter(weight)  # shares weight's storage
        constants = (
            paper_random_numbers(seed) if rn_tuple is None else torch.tensor(rn_tuple, dtype=torch.int64)
        )
        self.register_buffer("random_numbers", constants)
        if self.sparse and not getattr(self.weight, "_robez_coalesced_hook", False):
            self.weight.register_post_accumulate_grad_hook(keep_coalesced_flag)
            self.weight._robez_coalesced_hook = True  # type: ignore[attr-defined]  # one hook per array

    @classmethod
    def from_pretrained(
        cls,
        embeddings: Tensor,
        memory_size: int,
        *,
        freeze: bool = True,
        chunk_size: int = 32,
        seed: int = DEFAULT_SEED,
        val_offset: int = 0,
        hash: HashName = "paper",
        init_scale: float = DEFAULT_INIT_SCALE,
        random_numbers: Tensor | Sequence[int] | None = None,
        **kwargs: Any,
    ) -> Self:
        """A ROBE-Z table of ``memory_size`` floats that best reproduces a trained full table.

        Like ``nn.Embedding(Bag).from_pretrained``, but compressing: every slot of the new array is the
        mean of the values of ``embeddings`` (n, d) that the hash maps to it (the least-squares fit,
        ``compress.least_squares_array``); slots nothing maps to keep their initial value. Row i of
        ``embeddings`` is id i. ``freeze=True`` (torch's default) sets ``weight.requires_grad = False``;
        pass ``freeze=False`` to fine-tune. Other keyword arguments (``sparse``, ``backend``, and for the
        bag ``mode``, ``include_last_offset``) go to the constructor.

        Example::

            >>> full = nn.Embedding(100_000, 64)            # trained
            >>> small = RobezEmbedding.from_pretrained(full.weight, 100_000 * 64 // 16, chunk_size=32)
        """
        from .compress import least_squares_array

        if not isinstance(embeddings, Tensor) or embeddings.dim() != 2:
            raise ConfigError("embeddings must be a 2-D (num_embeddings, embedding_dim) tensor")
        if random_numbers is not None and not isinstance(random_numbers, Tensor):
            random_numbers = torch.tensor(list(random_numbers), dtype=torch.int64)
        array = least_squares_array(
            [embeddings],
            memory_size,
            val_offsets=[val_offset],
            chunk_size=chunk_size,
            seed=seed,
            hash=hash,
            init_scale=init_scale,
            random_numbers=random_numbers,
        )
        module = cls(
            int(embeddings.shape[0]),
            int(embeddings.shape[1]),
            weight=array,
            chunk_size=chunk_size,
            seed=seed,
            val_offset=val_offset,
            hash=hash,
            init_scale=init_scale,
            random_numbers=random_numbers,
            **kwargs,
        )
        module.weight.requires_grad_(not freeze)
        return module

    # configuration, read through the validated config
    @property
    def num_embeddings(self) -> int:
        return self.config.num_embeddings

    @property
    def embedding_dim(self) -> int:
        return self.config.embedding_dim

    @property
    def memory_size(self) -> int:
        return self.config.memory_size

    @property
    def chunk_size(self) -> int:
        return self.config.chunk_size

    @property
    def num_chunks(self) -> int:
        return self.config.num_chunks

    @property
    def val_offset(self) -> int:
        return self.config.val_offset

    @property
    def hash(self) -> HashName:
        return self.config.hash

    def hash_ids(self, ids: Tensor) -> Tensor:
        """Chunk offsets of ``ids`` (any shape, flattened to N): int64 (N, C) in ``[0, m - Z]``."""
        flat = _as_int64_ids(ids).reshape(-1)
        hash_fn = kernels.chunk_offsets if self.backend == "fused" else reference.chunk_offsets
        return hash_fn(
            flat,
            self.num_chunks,
            self.chunk_size,
            self.memory_size,
            self.random_numbers,
            self.val_offset,
            self.hash,
        )

    def gather(self, offsets: Tensor) -> Tensor:
        """Rows at chunk ``offsets`` int64 (N, C) from :meth:`hash_ids`: float32 (N, d). No autograd."""
        if offsets.dtype != torch.int64 or offsets.dim() != 2 or offsets.shape[1] != self.num_chunks:
            raise InvalidInputError(
                f"offsets must be int64 (N, {self.num_chunks}), got {offsets.dtype} {tuple(offsets.shape)}"
            )
        with torch.no_grad():
            if self.backend == "fused":
                return kernels.gather(self.weight, offsets, self.embedding_dim, self.chunk_size)
            return reference.gather(self.weight, offsets, self.embedding_dim, self.chunk_size)

    def _rows(self, flat_ids: Tensor) -> Tensor:
        """Rows of int64 ``flat_ids`` (N,): float32 (N, d), differentiable w.r.t. ``weight``."""
        if self.backend == "reference":
            return reference.lookup(
                self.weight,
                flat_ids,
                self.embedding_dim,
                self.chunk_size,
                self.random_numbers,
                self.val_offset,
                self.hash,
                self.sparse,
            )
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return _FusedLookup.apply(self.weight, flat_ids, self)
        return kernels.lookup(
            self.weight,
            flat_ids,
            self.embedding_dim,
            self.chunk_size,
            self.random_numbers,
            self.val_offset,
            self.hash,
        )

    def extra_repr(self) -> str:
        c = self.config
        text = (
            f"{c.num_embeddings}, {c.embedding_dim}, memory_size={c.memory_size}, chunk_size={c.chunk_size}, "
            f"hash={c.hash!r}, val_offset={c.val_offset}"
        )
        if self.sparse:
            text += ", sparse=True"
        if self.backend != "fused":
            text += f", backend={self.backend!r}"
        return text


class RobezEmbedding(_RobezBase):
    """A ROBE-Z embedding table: ``nn.Embedding(num_embeddings, embedding_dim)`` in ``memory_size`` floats.

    Args:
        num_embeddings: logical rows n (any int64 id is valid; n only sizes reports and the compression
            ratio n * d / m).
        embedding_dim: d, values per row.
        memory_size: m, floats in a new array initialised U(-init_scale, init_scale), ``init_scale``
            defaulting to ``config.DEFAULT_INIT_SCALE`` = 0.001 (the paper's choice). Give this or ``weight``.
        weight: an existing 1-D float32 array (tensor or ``nn.Parameter``) to share with other tables;
            give each sharing table its own ``val_offset``.
        chunk_size: Z, contiguous values per hashed block; Z = 1 is the plain hashing trick.
        seed: seeds the hash constants (``numpy.random.RandomState(seed)``, as the paper) and a new array.
        val_offset: added to every id before hashing.
        hash: ``"paper"`` (bit-exact with the paper's code) or ``"fast"``.
        sparse: give ``weight`` a coalesced sparse COO gradient of shape (m,) instead of a dense one.
        backend: ``"fused"`` (numba kernels) or ``"reference"`` (pure torch, for checking).
        random_numbers: the 11 hash constants ``[P, r0..r9]`` to use instead of deriving them from ``seed``.

    Shapes:
        ``forward(ids)``: ids int64 of any shape ``(*)`` -> float32 ``(*, d)``.

    Example::

        >>> emb = RobezEmbedding(1_000_000, 100, memory_size=262_144, chunk_size=32)
        >>> rows = emb(torch.tensor([[3, 14], [15, 92]]))
        >>> rows.shape
        torch.Size([2, 2, 100])
        >>> opt = torch.optim.Adam(emb.parameters(), lr=1e-3, fused=True)  # one pass over the array
    """

    def forward(self, ids: Tensor) -> Tensor:
        ids = _as_int64_ids(ids, contiguous=False)
        if ids.dim() == 1:
            # Rows are already (N, d): a reshape would add a view node for autograd to walk in backward.
            # A strided column (``pairs[:, 0]``) is not copied: the hash reads it where it lies.
            return self._rows(ids)
        rows = self._rows(ids.reshape(-1))
        return rows.reshape(*ids.shape, self.embedding_dim)


class RobezEmbeddingBag(_RobezBase):
    """Pooled ROBE-Z lookups, following ``torch.nn.EmbeddingBag`` conventions.

    Takes the arguments of :class:`RobezEmbedding` plus ``mode`` (``"sum"`` or ``"mean"``) and
    ``include_last_offset``.

    Shapes:
        ``forward(ids, offsets=None, per_sample_weights=None)``:

        - ids int64 ``(B, L)`` with ``offsets=None``: B bags of L ids each;
        - ids int64 ``(N,)`` with ``offsets`` int64 ``(B,)``: bag b holds ``ids[offsets[b]:offsets[b+1]]``
          (the last runs to N); with ``include_last_offset=True``, ``offsets`` is ``(B + 1,)`` and its last
          entry must be N;
        - ``per_sample_weights`` float32 shaped like ids scales each row (``mode="sum"`` only);

        returns float32 ``(B, d)``; an empty bag gives zeros.

    Example::

        >>> bag = RobezEmbeddingBag(1_000_000, 64, memory_size=1 << 20, mode="mean")
        >>> pooled = bag(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 3]))   # bags [1, 2, 3] and [4]
        >>> pooled.shape
        torch.Size([2, 64])
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        memory_size: int | None = None,
        *,
        mode: BagMode = "mean",
        include_last_offset: bool = False,
        **kwargs: Any,
    ) -> None:
        if mode not in ("sum", "mean"):
            raise ConfigError(f"mode must be 'sum' or 'mean', got {mode!r}")
        super().__init__(num_embeddings, embedding_dim, memory_size, **kwargs)
        self.mode: BagMode = mode
        self.include_last_offset = bool(include_last_offset)

    def _bags(
        self, ids: Tensor, offsets: Tensor | None, per_sample_weights: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """(flat ids (N,), bag starts (B,), flat per-sample weights (N,) or None) per torch's rules."""
        ids = _as_int64_ids(ids)
        if per_sample_weights is not None:
            if self.mode != "sum":
                raise InvalidInputError("per_sample_weights is only supported with mode='sum'")
            if per_sample_weights.shape != ids.shape or per_sample_weights.dtype != torch.float32:
                raise InvalidInputError("per_sample_weights must be float32 with the shape of ids")
        if ids.dim() == 2:
            if offsets is not None:
                raise InvalidInputError("offsets must be None when ids is 2-D (fixed-size bags)")
            num_bags, bag_len = ids.shape
            starts = torch.arange(num_bags, dtype=torch.int64) * bag_len
            flat_psw = None if per_sample_weights is None else per_sample_weights.reshape(-1)
            return ids.reshape(-1), starts, flat_psw
        if ids.dim() != 1:
            raise InvalidInputError(f"ids must be 1-D (with offsets) or 2-D, got shape {tuple(ids.shape)}")
        if offsets is None:
            raise InvalidInputError("offsets are required when ids is 1-D")
        starts = _as_int64_ids(offsets, "offsets")
        if starts.dim() != 1:
            raise InvalidInputError("offsets must be 1-D")
        num_ids = ids.numel()
        if self.include_last_offset:
            if starts.numel() == 0 or int(starts[-1]) != num_ids:
                raise InvalidInputError("with include_last_offset, offsets must end with len(ids)")
            starts = starts[:-1]
        if starts.numel() and (
            int(starts[0]) != 0 or int(starts[-1]) > num_ids or bool((starts[1:] < starts[:-1]).any())
        ):
            raise InvalidInputError("offsets must start at 0, be non-decreasing and not exceed len(ids)")
        if starts.numel() == 0 and num_ids:
            raise InvalidInputError("ids given but no bags (offsets is empty)")
        return ids, starts.contiguous(), per_sample_weights

    def forward(
        self, ids: Tensor, offsets: Tensor | None = None, per_sample_weights: Tensor | None = None
    ) -> Tensor:
        flat_ids, starts, psw = self._bags(ids, offsets, per_sample_weights)
        if self.backend == "reference":
            bounds = torch.cat([starts, torch.tensor([flat_ids.numel()], dtype=torch.int64)])
            return reference.lookup_bag(
                self.weight,
                flat_ids,
                bounds,
                psw,
                self.mode,
                self.embedding_dim,
                self.chunk_size,
                self.random_numbers,
                self.val_offset,
                self.hash,
                self.sparse,
            )
        needs_grad = torch.is_grad_enabled() and (
            self.weight.requires_grad or (psw is not None and psw.requires_grad)
        )
        if needs_grad:
            return _FusedBag.apply(self.weight, psw, flat_ids, starts, self.mode, self)
        return kernels.lookup_bag(
            self.weight,
            flat_ids,
            starts,
            psw,
            self.mode,
            self.embedding_dim,
            self.chunk_size,
            self.random_numbers,
            self.val_offset,
            self.hash,
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode!r}"
