"""Server-side optimizer state and fused steps (sgd, adagrad, lazy adam) over a ROBE-Z array.

An update arrives as ids already hashed to chunk offsets (N, C) plus the gradient of each output row
(N, d). It is coalesced first (every touched array location once, duplicates summed: ``K`` locations),
then the optimizer moves only those ``K`` locations. No dense (m,) gradient is ever built, so the cost
is O(N * d) whatever the array size m.

State layout (``state_layout``), the tensors a ``Table`` keeps beside its ``weight`` (m,):

- ``sgd``:     ``{}``
- ``adagrad``: ``{"sum": float32 (m,)}``, filled with ``initial_accumulator_value``
- ``adam``:    ``{"exp_avg": float32 (m,), "exp_avg_sq": float32 (m,), "step": int64 (1,)}``; lazy like
  ``torch.optim.SparseAdam``: untouched locations keep their moments; ``step`` counts updates per table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from . import kernels
from .config import OptimizerConfig
from .errors import ConfigError, InvalidInputError
from .kernels import serial

__all__ = [
    "PreparedStep",
    "apply_coalesced",
    "count_nonfinite",
    "fused_update",
    "init_state",
    "small_step",
    "state_layout",
    "validate_state",
]

StateLayout = dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass(frozen=True)
class PreparedStep:
    """An update coalesced by ``Table.prepare_step``: distinct array ``locations`` int64 (K,), their summed
    gradients ``values`` float32 (K,), and the lr to apply."""

    locations: Tensor
    values: Tensor
    lr: float
    # The table's ``small.SmallPath`` when prepared on the small-batch path: ``check_step`` and
    # ``apply_step`` then call the serial kernels directly too (the same arithmetic as the general path,
    # bit for bit). Only compared by identity, so typed ``object``: optim does not import small.
    small: object | None = None


def state_layout(optimizer: OptimizerConfig, memory_size: int) -> StateLayout:
    """Name -> (shape, dtype) of each state tensor ``optimizer`` needs for an array of ``memory_size``."""
    if optimizer.name == "sgd":
        return {}
    if optimizer.name == "adagrad":
        return {"sum": ((memory_size,), torch.float32)}
    if optimizer.name == "adam":
        return {
            "exp_avg": ((memory_size,), torch.float32),
            "exp_avg_sq": ((memory_size,), torch.float32),
            "step": ((1,), torch.int64),
        }
    raise ConfigError(f"unknown optimizer {optimizer.name!r}")


def init_state(
    optimizer: OptimizerConfig, memory_size: int, *, out: dict[str, Tensor] | None = None
) -> dict[str, Tensor]:
    """Fresh state tensors for ``optimizer`` (zeros; adagrad's ``sum`` at its initial accumulator value);
    ``out``: tensors of the layout (``validate_state``) to set instead of allocating new ones."""
    if out is None:
        state = {
            name: torch.zeros(shape, dtype=dtype)
            for name, (shape, dtype) in state_layout(optimizer, memory_size).items()
        }
    else:
        validate_state(optimizer, memory_size, out)
        state = {name: tensor.zero_() for name, tensor in out.items()}
    if optimizer.name == "adagrad" and optimizer.initial_accumulator_value:
        state["sum"].fill_(optimizer.initial_accumulator_value)
    return state


def validate_state(optimizer: OptimizerConfig, memory_size: int, state: dict[str, Tensor]) -> None:
    """Raise ``ConfigError`` unless ``state`` matches the layout's names, shapes and dtypes, contiguous."""
    layout = state_layout(optimizer, memory_size)
    if set(state) != set(layout):
        raise ConfigError(f"optimizer {optimizer.name!r} needs state {sorted(layout)}, got {sorted(state)}")
    for name, (shape, dtype) in layout.items():
        tensor = state[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype or not tensor.is_contiguous():
            raise ConfigError(
                f"state {name!r} must be a contiguous {dtype} tensor of shape {shape}, "
                f"got {tensor.dtype} {tuple(tensor.shape)}"
            )
        if tensor.device.type != "cpu":
            raise ConfigError(f"state {name!r} must live on the CPU")


def _check_lr(lr: float) -> float:
    lr = float(lr)
    if not (lr > 0 and math.isfinite(lr)):
        raise InvalidInputError(f"lr must be a positive finite number, got {lr}")
    return lr


def apply_coalesced(
    optimizer: OptimizerConfig,
    weight: Tensor,
    state: dict[str, Tensor],
    locations: Tensor,
    values: Tensor,
    lr: float | None = None,
) -> None:
    """One step at distinct ``locations`` int64 (K,) with summed gradients ``values`` float32 (K,), in place.

    ``lr`` overrides ``optimizer.lr`` for this step. Adam increments ``state["step"]`` first, so the first
    update is step 1 (as in torch).
    """
    step_lr = optimizer.lr if lr is None else _check_lr(lr)
    with torch.no_grad():
        if optimizer.name == "sgd":
            kernels.sgd_step(weight, locations, values, step_lr)
        elif optimizer.name == "adagrad":
            kernels.adagrad_step(weight, state["sum"], locations, values, step_lr, optimizer.eps)
        elif optimizer.name == "adam":
            step = int(state["step"][0]) + 1
            beta1, beta2 = optimizer.betas
            kernels.adam_step(
                weight,
                state["exp_avg"],
                state["exp_avg_sq"],
                locations,
                values,
                step_lr,
                beta1,
                beta2,
                optimizer.eps,
                step,
            )
            state["step"][0] = step
        else:
            raise ConfigError(f"unknown optimizer {optimizer.name!r}")


def count_nonfinite(
    optimizer: OptimizerConfig,
    weight: Tensor,
    state: dict[str, Tensor],
    locations: Tensor,
    values: Tensor,
    lr: float | None = None,
) -> int:
    """How many of ``locations`` the step ``apply_coalesced`` would take with the same arguments would
    leave with a non-finite weight or optimizer state (or has a non-finite summed gradient). Reads only:
    the same float32 arithmetic as the step, on the K touched locations, nothing written."""
    step_lr = optimizer.lr if lr is None else _check_lr(lr)
    if optimizer.name == "sgd":
        return kernels.sgd_nonfinite(weight, locations, values, step_lr)
    if optimizer.name == "adagrad":
        return kernels.adagrad_nonfinite(weight, state["sum"], locations, values, step_lr, optimizer.eps)
    if optimizer.name == "adam":
        beta1, beta2 = optimizer.betas
        step = int(state["step"][0]) + 1
        return kernels.adam_nonfinite(
            weight,
            state["exp_avg"],
            state["exp_avg_sq"],
            locations,
            values,
            step_lr,
            beta1,
            beta2,
            optimizer.eps,
            step,
        )
    raise ConfigError(f"unknown optimizer {optimizer.name!r}")


def apply_coalesced_checked(
    optimizer: OptimizerConfig,
    weight: Tensor,
    state: dict[str, Tensor],
    locations: Tensor,
    values: Tensor,
    lr: float | None = None,
) -> int:
    """``count_nonfinite`` then, if it is 0, ``apply_coalesced``, in one pass (``kernels.checked_step``):
    returns that count; when it is not 0 nothing changed (Adam's step count neither). The same bits."""
    step_lr = optimizer.lr if lr is None else _check_lr(lr)
    with torch.no_grad():
        if optimizer.name == "sgd":
            return kernels.checked_step("sgd", weight, [], locations, values, (step_lr,))
        if optimizer.name == "adagrad":
            sums = [state["sum"]]
            return kernels.checked_step("adagrad", weight, sums, locations, values, (step_lr, optimizer.eps))
        if optimizer.name == "adam":
            step = int(state["step"][0]) + 1
            moments = [state["exp_avg"], state["exp_avg_sq"]]
            scalars = (step_lr, *optimizer.betas, optimizer.eps, float(step))
            bad = kernels.checked_step("adam", weight, moments, locations, values, scalars)
            if not bad:
                state["step"][0] = step
            return bad
    raise ConfigError(f"unknown optimizer {optimizer.name!r}")


# (sgd, adagrad, adam) serial kernels of a step and of its dry run: the same arguments, in the same order.
_STEP_KERNELS = (serial.sgd, serial.adagrad, serial.adam)
_NONFINITE_KERNELS = (serial.sgd_nonfinite, serial.adagrad_nonfinite, serial.adam_nonfinite)


def _small_call(
    kernel_set: tuple[Any, Any, Any],
    optimizer: OptimizerConfig,
    weight: np.ndarray,
    state_np: dict[str, np.ndarray],
    locations: np.ndarray,
    values: np.ndarray,
    lr: float,
) -> Any:
    """Call ``optimizer``'s serial kernel of ``kernel_set`` directly, as step ``state["step"] + 1`` for
    Adam (the caller advances the counter)."""
    sgd, adagrad, adam = kernel_set
    if optimizer.name == "sgd":
        return sgd(weight, locations, values, np.float32(lr))
    if optimizer.name == "adagrad":
        return adagrad(weight, state_np["sum"], locations, values, np.float32(lr), np.float32(optimizer.eps))
    if optimizer.name == "adam":
        step = int(state_np["step"][0]) + 1  # the numpy view: a torch scalar read costs ~2 us
        beta1, beta2 = optimizer.betas
        return adam(
            weight,
            state_np["exp_avg"],
            state_np["exp_avg_sq"],
            locations,
            values,
            np.float32(beta1),
            np.float32(beta2),
            np.float32(optimizer.eps),
            np.float32(kernels.adam_step_size(lr, beta1, beta2, step)),
        )
    raise ConfigError(f"unknown optimizer {optimizer.name!r}")


def small_step(
    optimizer: OptimizerConfig,
    weight: np.ndarray,
    state_np: dict[str, np.ndarray],
    locations: np.ndarray,
    values: np.ndarray,
    lr: float,
) -> None:
    """``apply_coalesced`` for a few locations (numpy views, ``lr`` already checked): the same serial
    kernels, called directly, without the per-call checks and thread set-up that cost more than a few
    hundred values' arithmetic. Bit-identical to ``apply_coalesced`` (tests/core/test_table.py)."""
    _small_call(_STEP_KERNELS, optimizer, weight, state_np, locations, values, lr)
    if optimizer.name == "adam":
        state_np["step"][0] += 1


def small_nonfinite(
    optimizer: OptimizerConfig,
    weight: np.ndarray,
    state_np: dict[str, np.ndarray],
    locations: np.ndarray,
    values: np.ndarray,
    lr: float,
) -> int:
    """``count_nonfinite`` for a few locations (numpy views, ``lr`` already checked), as ``small_step`` is
    ``apply_coalesced``: the same serial kernels, called directly. The same count."""
    return int(_small_call(_NONFINITE_KERNELS, optimizer, weight, state_np, locations, values, lr))


def fused_update(
    optimizer: OptimizerConfig,
    weight: Tensor,
    state: dict[str, Tensor],
    offsets: Tensor,
    grad_rows: Tensor,
    chunk_size: int,
    lr: float | None = None,
) -> None:
    """Coalesce output-row gradients (N, d) at chunk ``offsets`` (N, C), then step in place.

    Rows hashed to overlapping locations (duplicate ids included) have their gradients summed before the
    step, so an update equals one ``torch.optim`` step on the sparse gradient of the same batch.
    """
    step_lr = optimizer.lr if lr is None else _check_lr(lr)
    locations, values = kernels.coalesce_grad(grad_rows, offsets, chunk_size, weight.numel())
    # An empty batch still counts as an adam step, as an empty sparse grad does for SparseAdam.
    apply_coalesced(optimizer, weight, state, locations, values, step_lr)
