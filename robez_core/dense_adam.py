"""``DenseAdam``: ``torch.optim.Adam`` for dense float32 CPU gradients, one fused pass per parameter.

A ``RobezEmbedding`` trained with dense gradients gets an (m,) gradient for its array every step, and
``torch.optim.Adam``'s CPU path walks that array eight times (``lerp_``, ``mul_``, ``addcmul_``,
``sqrt``, a division, ``add_``, ``addcdiv_``, two of them into fresh temporaries). ``DenseAdam`` runs the
same arithmetic in one numba pass (``kernels.dense_adam_step``: reads param, grad and both moments,
writes param and the moments), on every thread ``torch.get_num_threads()`` allows::

    model = torch.nn.Sequential(RobezEmbedding(1_000_000, 100, memory_size=262_144), ...)
    optimizer = robez_core.DenseAdam(model.parameters(), lr=1e-3)

It is a drop-in for ``torch.optim.Adam(params, lr, betas, eps, weight_decay)``:

- same hyper-parameters, defaults, parameter groups and state (``step`` a float32 0-d tensor,
  ``exp_avg``, ``exp_avg_sq``), so ``state_dict()`` loads into either class;
- same float32 operations in the same order, torch's fused multiply-adds included, so ``exp_avg`` and
  ``exp_avg_sq`` come out bit for bit as torch's AVX2 / AVX-512 kernels compute them (on x86-64, torch's
  DEFAULT build, for CPUs without AVX2, rounds those products first). The parameter may differ in its
  last bit: torch takes the square root through MKL's ``vsSqrt`` (high-accuracy mode: within one ulp,
  not correctly rounded, and its bits depend on MKL's code path for the CPU), ``DenseAdam`` the IEEE
  square root, as torch's own ``Adam(fused=True)`` on CPU does. ``tests/core/test_dense_adam.py`` checks
  both per step.

What it refuses (``ValueError`` when built, or when a loaded ``state_dict`` turns them on), because
they are not the dense ROBE-Z case and a silent fallback to torch would hide the slow path:
``amsgrad``, ``maximize``, ``capturable``, ``differentiable``, ``foreach``, ``fused``,
``decoupled_weight_decay`` (use ``torch.optim.AdamW``), a tensor ``lr`` or ``betas``; and, at
construction or step, parameters that are not contiguous float32 CPU tensors, and sparse gradients
(``torch.optim.SparseAdam``, or robez's server-side lazy Adam in ``optim.py``). A non-contiguous dense
gradient is copied to a contiguous one first (same values).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from . import kernels

__all__ = ["DenseAdam"]

# torch.optim.Adam's group options DenseAdam keeps (so a state_dict moves between the two) but only at
# these values.
_FIXED_OPTIONS: dict[str, Any] = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": False,
}


def _scalar_dtype() -> torch.dtype:
    """The dtype torch.optim.Adam gives its ``step`` counter (float32 unless float64 is the default)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _check_param(param: Tensor) -> None:
    if param.dtype != torch.float32 or param.device.type != "cpu" or not param.is_contiguous():
        raise ValueError(
            "DenseAdam steps contiguous float32 CPU tensors; got a "
            f"{'contiguous' if param.is_contiguous() else 'non-contiguous'} {param.dtype} tensor on "
            f"{param.device.type} of shape {tuple(param.shape)} (use torch.optim.Adam for it)"
        )


def _check_group(group: dict[str, Any]) -> None:
    for name, allowed in _FIXED_OPTIONS.items():
        value = group.get(name, allowed)
        if value != allowed and not (allowed is None and value is False):
            raise ValueError(f"DenseAdam does not support {name}={value!r} (torch.optim.Adam does)")
    for name in ("lr", "betas"):
        values = group[name] if name == "betas" else (group[name],)
        if any(isinstance(value, Tensor) for value in values):
            raise ValueError(f"DenseAdam takes {name} as Python floats, not tensors")


class DenseAdam(Optimizer):
    """Adam over dense float32 CPU gradients in one fused pass per parameter (see the module docs)."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
    ) -> None:
        if isinstance(lr, Tensor) or any(isinstance(beta, Tensor) for beta in betas):
            raise ValueError("DenseAdam takes lr and betas as Python floats, not tensors")
        if not lr >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not eps >= 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = {
            "lr": lr,
            "betas": (float(betas[0]), float(betas[1])),
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "foreach": foreach,
            "capturable": capturable,
            "differentiable": differentiable,
            "fused": fused,
            "decoupled_weight_decay": decoupled_weight_decay,
        }
        _check_group(defaults)
        super().__init__(params, defaults)
        for group in self.param_groups:
            _check_group(group)
            for param in group["params"]:
                _check_param(param)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """As ``torch.optim.Adam.__setstate__`` (``load_state_dict`` ends here): fill the group options an
        older state_dict lacks and turn a Python-number ``step`` into torch's float32 0-d tensor."""
        super().__setstate__(state)
        for group in self.param_groups:
            for name, value in _FIXED_OPTIONS.items():
                group.setdefault(name, value)
            for param in group["params"]:
                param_state = self.state.get(param, {})
                if param_state and not torch.is_tensor(param_state["step"]):
                    param_state["step"] = torch.tensor(float(param_state["step"]), dtype=_scalar_dtype())

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform a single optimization step (``closure`` re-evaluates the model and returns the loss)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            _check_group(group)
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                if grad.is_sparse:
                    raise RuntimeError(
                        "DenseAdam does not support sparse gradients, please consider SparseAdam instead"
                    )
                _check_param(param)
                state = self.state[param]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                for name in ("exp_avg", "exp_avg_sq"):
                    if not state[name].is_contiguous():  # e.g. loaded from a strided state_dict
                        state[name] = state[name].contiguous()
                state["step"] += 1
                kernels.dense_adam_step(
                    param,
                    grad.contiguous(),
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    step=state["step"].item(),
                )
        return loss
