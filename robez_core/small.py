"""The small-batch path of a ``Table``: lookups and updates of a few ids without the general path's set-up.

A request of a few ids (the service's typical online request) costs more in per-call checks, tensor
wrapping and thread set-up than in arithmetic. ``SmallPath`` prepares once per table what every small
call needs and calls the kernels' serial compilations directly (``kernels.serial``), so results are
bit-identical to the general path (tests/core/test_table.py). ``SmallPath.checked_step`` goes one step
further for updates: coalescing, the non-finite dry run and the optimizer step in one compiled call.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from . import kernels, optim
from .config import OptimizerConfig, TableConfig
from .kernels import serial
from .optim import PreparedStep

__all__ = ["SMALL_BATCH_MAX_IDS", "SmallPath", "small_grads", "small_ids"]

# Requests of at most this many ids take the small-input path below: its result is bit-identical to the
# general path's, minus that path's per-call checks and set-up (~10 us a call, more than the arithmetic
# of a few rows). Far below the kernels' parallel cut-off, so these calls always ran serially anyway.
SMALL_BATCH_MAX_IDS = 64


class TableArrays(Protocol):
    """What ``SmallPath`` reads of a ``Table`` (a protocol, so that small does not import table)."""

    @property
    def config(self) -> TableConfig: ...
    @property
    def optimizer(self) -> OptimizerConfig: ...
    @property
    def random_numbers(self) -> Tensor: ...
    @property
    def weight(self) -> Tensor: ...
    @property
    def state(self) -> dict[str, Tensor]: ...


class SmallPath:
    """What every small call of one ``Table`` needs, prepared once: numpy views of the live tensors, the
    hash constants and mode, and the serial kernels (``kernels.serial``: the compiled functions, called
    directly). Valid while the table keeps the same ``weight`` tensor (checked by identity)."""

    def __init__(self, table: TableArrays) -> None:
        config = table.config
        self.weight = table.weight
        self.weight_np = table.weight.numpy()
        self.hash_mode, self.constants, self.range_size = serial.hash_setup(
            config.hash, table.random_numbers, config.memory_size, config.chunk_size, config.embedding_dim
        )
        self.val_offset = np.int64(serial.wrap_int64(config.val_offset))
        self.num_chunks = config.num_chunks
        self.embedding_dim = config.embedding_dim
        self.chunk_size = config.chunk_size
        self.state = table.state
        self.state_np = {name: tensor.numpy() for name, tensor in table.state.items()}
        self.optimizer = table.optimizer
        self.memory_size = config.memory_size
        self.hash_kernel = serial.chunk_offsets
        self.gather_kernel = serial.gather_for(config.chunk_size)
        self.lookup_kernel = serial.lookup_for(config.chunk_size)

    def hash(self, ids_np: np.ndarray) -> np.ndarray:
        out = np.empty((ids_np.shape[0], self.num_chunks), dtype=np.int64)
        if ids_np.shape[0]:
            self.hash_kernel(
                ids_np,
                self.val_offset,
                self.num_chunks,
                self.hash_mode,
                self.constants,
                self.range_size,
                out,
            )
        return out

    def gather(self, offsets_np: np.ndarray) -> np.ndarray:
        out = np.empty((offsets_np.shape[0], self.embedding_dim), dtype=np.float32)
        if offsets_np.shape[0]:
            self.gather_kernel(
                self.weight_np, offsets_np, self.embedding_dim, self.chunk_size, False, False, out
            )
        return out

    def apply(self, offsets_np: np.ndarray, grads_np: np.ndarray, lr: float) -> None:
        """``optim.fused_update`` for a small batch: the same coalescing, then ``optim.small_step``."""
        locations, values = self.coalesce(offsets_np, grads_np)
        optim.small_step(self.optimizer, self.weight_np, self.state_np, locations, values, lr)

    def checked_step(self, offsets_np: np.ndarray, grads_np: np.ndarray, lr: float) -> bool:
        """``Table.prepare_step`` + ``check_step`` + ``apply_step`` of a small batch in one compiled call:
        True when the step was applied; False, having changed nothing, when the general path must take
        it (it then raises the error a refused step gets, or coalesces through its dense scratch). The
        caller holds the table's update lock and has checked ``lr`` (positive, finite, <= max_lr)."""
        if self.memory_size <= serial.DENSE_COALESCE_FACTOR * grads_np.size:
            return False  # ``coalesce`` would take the general path's dense scratch
        optimizer = self.optimizer
        name = optimizer.name
        if name == "adam":
            beta1, beta2 = optimizer.betas
            step = int(self.state_np["step"][0]) + 1
            step_size = kernels.adam_step_size(lr, beta1, beta2, step)
            scalars = np.array([lr, optimizer.eps, beta1, beta2, step_size], dtype=np.float32)
            first, second = self.state_np["exp_avg"], self.state_np["exp_avg_sq"]
        else:
            scalars = np.array([lr, optimizer.eps, 0.0, 0.0, 0.0], dtype=np.float32)
            first = second = self.state_np["sum"] if name == "adagrad" else self.weight_np
        applied = serial.checked_step(
            offsets_np,
            grads_np,
            self.embedding_dim,
            self.chunk_size,
            serial.OPTIMIZER_CODES[name],
            scalars,
            self.weight_np,
            first,
            second,
        )
        if applied and name == "adam":
            self.state_np["step"][0] += 1
        return bool(applied)

    def step_arrays(
        self, step: PreparedStep
    ) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray, np.ndarray, float]:
        """What ``optim.small_step`` / ``small_nonfinite`` take after the optimizer, for ``step``."""
        return self.weight_np, self.state_np, step.locations.numpy(), step.values.numpy(), step.lr

    def coalesce(self, offsets_np: np.ndarray, grads_np: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``kernels.coalesce_grad`` for a small batch: (distinct locations, summed gradients)."""
        if self.memory_size <= serial.DENSE_COALESCE_FACTOR * grads_np.size:
            # the general path would coalesce through the dense scratch here: take it, same sums
            locations_t, values_t = kernels.coalesce_grad(
                torch.from_numpy(grads_np), torch.from_numpy(offsets_np), self.chunk_size, self.memory_size
            )
            locations, values = locations_t.numpy(), values_t.numpy()
        else:
            locations, values = serial.coalesce_sorted(
                grads_np, offsets_np, self.embedding_dim, self.chunk_size
            )
        return locations, values

    def lookup(self, ids_np: np.ndarray) -> np.ndarray:
        out = np.empty((ids_np.shape[0], self.embedding_dim), dtype=np.float32)
        if ids_np.shape[0]:
            self.lookup_kernel(
                self.weight_np,
                ids_np,
                self.val_offset,
                self.embedding_dim,
                self.chunk_size,
                self.hash_mode,
                self.constants,
                False,
                False,
                out,
            )
        return out


def small_ids(ids: object, *, arrays: bool = False) -> np.ndarray | None:
    """A numpy view of ``ids`` when it is a valid small batch (1-D int64 CPU, at most
    ``SMALL_BATCH_MAX_IDS``), else None (the general path then checks and reports it). With ``arrays``,
    a C-contiguous numpy int64 array of ids is taken as it is (the service's: no tensor is made for a
    small request); without, only a tensor is, as the general path takes only tensors."""
    if type(ids) is np.ndarray:
        if (
            arrays
            and ids.dtype == np.int64
            and ids.ndim == 1
            and 1 <= ids.shape[0] <= SMALL_BATCH_MAX_IDS
            and ids.flags.c_contiguous
        ):
            return ids
        return None
    if (
        type(ids) is Tensor
        and ids.dtype == torch.int64
        and ids.dim() == 1
        and ids.layout == torch.strided
        and 1 <= ids.shape[0] <= SMALL_BATCH_MAX_IDS
        and ids.device.type == "cpu"
    ):
        return ids.contiguous().numpy()
    return None


def small_grads(
    grads: object, num_rows: int, embedding_dim: int, *, arrays: bool = False
) -> np.ndarray | None:
    """A C-contiguous float32 (num_rows, embedding_dim) numpy view of ``grads``, a CPU tensor (or, with
    ``arrays``, a numpy array), else None (the general path then checks and reports it)."""
    if type(grads) is np.ndarray and arrays:
        array = grads
    elif (
        type(grads) is Tensor
        and grads.dtype == torch.float32  # checked before .numpy(), which refuses some dtypes
        and grads.layout == torch.strided
        and grads.device.type == "cpu"
    ):
        array = grads.detach().contiguous().numpy()
    else:
        return None
    if (
        array.dtype != np.float32
        or array.ndim != 2
        or array.shape[0] != num_rows
        or array.shape[1] != embedding_dim
        or not array.flags.c_contiguous
    ):
        return None
    return array
