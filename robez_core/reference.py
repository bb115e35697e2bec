"""Pure-torch ROBE-Z, written straight from the formula: the oracle for tests and the benchmark.

Everything here builds the full (N, d) int64 index tensor of ``hashing.reference_indices`` and uses plain
torch indexing, exactly as the paper's code does. It is deliberately simple (and slow), never on the
service's path; ``kernels`` must agree with it (bit for bit on lookups, within float tolerance on
gradients and optimizer steps). The benchmark runs it as the "reference ROBE-Z" model.

Shapes: N ids, d = ``embedding_dim``, Z = ``chunk_size``, C = ceil(d / Z) chunks, m = ``memory_size``,
B bags, K distinct touched array locations.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .hashing import HashName, reference_chunk_offsets, reference_indices

__all__ = [
    "adagrad_step",
    "adam_step",
    "apply_gradients",
    "bag_ids_from_offsets",
    "chunk_offsets",
    "coalesce_grad",
    "dense_grad",
    "gather",
    "lookup",
    "lookup_bag",
    "sgd_step",
    "sparse_grad",
]


def chunk_offsets(
    ids: Tensor,
    num_chunks: int,
    chunk_size: int,
    memory_size: int,
    random_numbers: Tensor,
    val_offset: int = 0,
    hash: HashName = "paper",
) -> Tensor:
    """Start of every block of every id: int64 (N, C) in ``[0, m - Z]`` (same contract as the kernel)."""
    return reference_chunk_offsets(ids, num_chunks, chunk_size, memory_size, random_numbers, val_offset, hash)


def offsets_to_indices(offsets: Tensor, embedding_dim: int, chunk_size: int) -> Tensor:
    """Expand chunk offsets (N, C) to the index of every value: int64 (N, d)."""
    j = torch.arange(embedding_dim, dtype=torch.int64)
    return offsets[:, j // chunk_size] + (j % chunk_size)


def gather(weight: Tensor, offsets: Tensor, embedding_dim: int, chunk_size: int) -> Tensor:
    """Rows from already hashed chunk offsets (N, C): float32 (N, d). No autograd graph is kept."""
    with torch.no_grad():
        return weight[offsets_to_indices(offsets, embedding_dim, chunk_size)]


def dense_grad(grad_rows: Tensor, indices: Tensor, memory_size: int) -> Tensor:
    """Scatter-add output-row gradients (N, d) at their indices (N, d) into a dense float32 (m,)."""
    out = torch.zeros(memory_size, dtype=grad_rows.dtype)
    out.index_add_(0, indices.reshape(-1), grad_rows.reshape(-1))
    return out


def coalesce_grad(grad_rows: Tensor, indices: Tensor) -> tuple[Tensor, Tensor]:
    """Distinct touched locations, ascending, int64 (K,), and their summed gradients float32 (K,)."""
    locations, inverse = torch.unique(indices.reshape(-1), sorted=True, return_inverse=True)
    values = torch.zeros(locations.numel(), dtype=grad_rows.dtype)
    values.index_add_(0, inverse, grad_rows.reshape(-1))
    return locations, values


def sparse_grad(grad_rows: Tensor, indices: Tensor, memory_size: int) -> Tensor:
    """The same gradient as :func:`dense_grad` as a coalesced ``torch.sparse_coo`` tensor of shape (m,)."""
    locations, values = coalesce_grad(grad_rows, indices)
    return torch.sparse_coo_tensor(
        locations.unsqueeze(0), values, (memory_size,), is_coalesced=True, check_invariants=False
    )


class _ReferenceLookup(torch.autograd.Function):
    """``weight[indices]`` with the backward the paper's code uses: dense scatter-add or sparse COO."""

    @staticmethod
    def forward(ctx: Any, weight: Tensor, indices: Tensor, sparse: bool) -> Tensor:
        ctx.save_for_backward(indices)
        ctx.memory_size = weight.numel()
        ctx.sparse = sparse
        return weight[indices]

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, None, None]:
        (indices,) = ctx.saved_tensors
        grad_rows = grad_output.contiguous()
        if ctx.sparse:
            return sparse_grad(grad_rows, indices, ctx.memory_size), None, None
        return dense_grad(grad_rows, indices, ctx.memory_size), None, None


def lookup(
    weight: Tensor,
    ids: Tensor,
    embedding_dim: int,
    chunk_size: int,
    random_numbers: Tensor,
    val_offset: int = 0,
    hash: HashName = "paper",
    sparse: bool = False,
) -> Tensor:
    """Rows of ``ids`` (N,): float32 (N, d); differentiable w.r.t. ``weight`` (dense or sparse grad)."""
    indices = reference_indices(
        ids.reshape(-1), embedding_dim, chunk_size, weight.numel(), random_numbers, val_offset, hash
    )
    return _ReferenceLookup.apply(weight, indices, sparse)


def bag_ids_from_offsets(bag_offsets: Tensor, num_ids: int) -> Tensor:
    """Bag of every id, int64 (N,), from ``bag_offsets`` of length B + 1 (start of each bag, then N)."""
    counts = bag_offsets[1:] - bag_offsets[:-1]
    return torch.repeat_interleave(
        torch.arange(counts.numel(), dtype=torch.int64), counts, output_size=num_ids
    )


def lookup_bag(
    weight: Tensor,
    ids: Tensor,
    bag_offsets: Tensor,
    per_sample_weights: Tensor | None,
    mode: str,
    embedding_dim: int,
    chunk_size: int,
    random_numbers: Tensor,
    val_offset: int = 0,
    hash: HashName = "paper",
    sparse: bool = False,
) -> Tensor:
    """Pooled rows: float32 (B, d). ``bag_offsets`` has B + 1 entries (the last is N).

    ``mode="sum"`` adds the (optionally ``per_sample_weights``-scaled) rows of each bag; ``"mean"`` divides
    by the bag's length. Empty bags give zeros, as in ``torch.nn.EmbeddingBag``.
    """
    rows = lookup(weight, ids, embedding_dim, chunk_size, random_numbers, val_offset, hash, sparse)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.reshape(-1, 1)
    num_bags = bag_offsets.numel() - 1
    bag_ids = bag_ids_from_offsets(bag_offsets, ids.numel())
    pooled = torch.zeros(num_bags, embedding_dim, dtype=rows.dtype).index_add(0, bag_ids, rows)
    if mode == "mean":
        counts = (bag_offsets[1:] - bag_offsets[:-1]).clamp(min=1).to(rows.dtype)
        pooled = pooled / counts.reshape(-1, 1)
    return pooled


# Optimizer steps on the touched locations only. ``locations`` must be distinct (coalesced), so each
# location sees one update per step, as torch.optim's sparse paths do after ``grad.coalesce()``.


def sgd_step(weight: Tensor, locations: Tensor, values: Tensor, lr: float) -> None:
    """``weight[k] -= lr * g[k]`` at each location (in place)."""
    weight.index_add_(0, locations, values, alpha=-lr)


def adagrad_step(
    weight: Tensor, state_sum: Tensor, locations: Tensor, values: Tensor, lr: float, eps: float
) -> None:
    """``torch.optim.Adagrad`` (no lr decay, no weight decay) restricted to ``locations`` (in place)."""
    new_sum = state_sum[locations] + values * values
    state_sum[locations] = new_sum
    weight[locations] = weight[locations] - lr * values / (new_sum.sqrt() + eps)


def adam_step(
    weight: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    locations: Tensor,
    values: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
) -> None:
    """Lazy Adam, as ``torch.optim.SparseAdam``: only ``locations`` decay their moments and move.

    ``step`` is the 1-based count of this update (bias correction uses it).
    """
    m = exp_avg[locations] * beta1 + values * (1.0 - beta1)
    v = exp_avg_sq[locations] * beta2 + values * values * (1.0 - beta2)
    exp_avg[locations] = m
    exp_avg_sq[locations] = v
    step_size = lr * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)
    weight[locations] = weight[locations] - step_size * m / (v.sqrt() + eps)


def apply_gradients(
    weight: Tensor,
    state: dict[str, Tensor],
    optimizer_name: str,
    indices: Tensor,
    grad_rows: Tensor,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> None:
    """One optimizer step from output-row gradients (N, d) at value indices (N, d), duplicates summed.

    ``state`` follows ``Table.state_layout``: sgd ``{}``, adagrad ``{"sum"}``, adam ``{"exp_avg",
    "exp_avg_sq", "step"}`` (``step`` (1,) int64 is incremented here).
    """
    locations, values = coalesce_grad(grad_rows, indices)
    if optimizer_name == "sgd":
        sgd_step(weight, locations, values, lr)
    elif optimizer_name == "adagrad":
        adagrad_step(weight, state["sum"], locations, values, lr, eps)
    elif optimizer_name == "adam":
        state["step"] += 1
        adam_step(
            weight,
            state["exp_avg"],
            state["exp_avg_sq"],
            locations,
            values,
            lr,
            betas[0],
            betas[1],
            eps,
            int(state["step"].item()),
        )
    else:
        raise ValueError(f"unknown optimizer {optimizer_name!r}")
