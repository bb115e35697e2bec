"""DenseAdam against torch.optim.Adam: the moments bit for bit, the parameter within its last bit.

torch's CPU Adam takes the square root through MKL's vsSqrt (within one ulp, not correctly rounded);
DenseAdam takes the IEEE one. So each step is compared from one common state:

- with torch.optim.Adam: ``exp_avg`` and ``exp_avg_sq`` equal bit for bit (they do not depend on the
  root), the parameter within one ulp of torch's plus 2**-20 of the update (a one-ulp root moves the
  update by about 2**-22 of itself);
- with ``_torch_adam_ieee_sqrt``, torch's own op sequence (``_single_tensor_adam``'s ops, torch's
  kernels) with only the root taken by numpy (IEEE): everything bit for bit, which pins the order of
  every operation in the fused kernel.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from robez_core import DenseAdam, RobezEmbedding, kernels

# On x86-64, torch's vector kernels round lerp_, addcmul_ and add(alpha) as fused multiply-adds from AVX2
# up (ATEN_CPU_CAPABILITY avx2 / avx512; every CPU with AVX2 has FMA); its DEFAULT build rounds the product
# first, and only there would the moments differ from DenseAdam's in the last bit.
torch_fmadd = pytest.mark.skipif(
    kernels._X86 and torch.backends.cpu.get_cpu_capability() == "DEFAULT",
    reason="torch's DEFAULT x86 kernels do not fuse multiply-adds",
)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _assert_param_close(ours: torch.Tensor, theirs: torch.Tensor, before: torch.Tensor) -> None:
    """Within torch's last bit: non-finite values equal, finite ones within one ulp + 2**-20 of the update."""
    a, b, p = (t.detach().double().numpy().ravel() for t in (ours, theirs, before))
    finite = np.isfinite(b)
    assert np.array_equal(a[~finite], b[~finite], equal_nan=True)
    with np.errstate(over="ignore"):  # the ulp of float32's largest finite value is inf: allowed
        allowed = np.spacing(np.abs(b[finite]).astype(np.float32)).astype(np.float64)
    allowed += 2.0**-20 * np.abs(b[finite] - p[finite])
    excess = np.abs(a[finite] - b[finite]) - allowed
    assert not (excess > 0).any(), f"{int((excess > 0).sum())} params off torch by more than the root's ulp"


def _assert_same_bits(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)


def _torch_adam_ieee_sqrt(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: float,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """torch 2.13's ``_single_tensor_adam`` (its CPU path for a float32 tensor), op for op, in place,
    with ``exp_avg_sq.sqrt()`` replaced by numpy's correctly rounded square root."""
    beta1, beta2 = betas
    if weight_decay != 0:
        grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    with np.errstate(invalid="ignore"):
        root = torch.from_numpy(np.sqrt(exp_avg_sq.numpy()))
    denom = (root / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def _assert_matches_ieee_oracle(
    optimizer: DenseAdam,
    param: torch.Tensor,
    before: torch.Tensor,
    grad: torch.Tensor,
    state_before: dict,
    **options: float,
) -> None:
    expected = before.clone()
    exp_avg, exp_avg_sq = state_before["exp_avg"].clone(), state_before["exp_avg_sq"].clone()
    _torch_adam_ieee_sqrt(
        expected,
        grad,
        exp_avg,
        exp_avg_sq,
        step=float(state_before["step"]) + 1,
        **options,  # type: ignore[arg-type]
    )
    _assert_same_bits(param.detach(), expected)
    _assert_same_bits(optimizer.state[param]["exp_avg"], exp_avg)
    _assert_same_bits(optimizer.state[param]["exp_avg_sq"], exp_avg_sq)


def _pair(
    param: torch.Tensor, **options: float
) -> tuple[torch.nn.Parameter, DenseAdam, torch.nn.Parameter, torch.optim.Adam]:
    ours = torch.nn.Parameter(param.clone())
    theirs = torch.nn.Parameter(param.clone())
    return ours, DenseAdam([ours], **options), theirs, torch.optim.Adam([theirs], **options)  # type: ignore[arg-type]


@torch_fmadd
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.3, 0.5)], ids=["default-betas", "large-lerp-weight"])
@pytest.mark.parametrize("size", [1, 37, 100_003])
def test_each_step_matches_torch_adam(
    size: int, betas: tuple[float, float], weight_decay: float, threads: int
) -> None:
    generator = torch.Generator().manual_seed(size)
    options = {"lr": 1e-2, "betas": betas, "eps": 1e-8, "weight_decay": weight_decay}
    ours, ours_opt, theirs, theirs_opt = _pair(torch.randn(size, generator=generator), **options)
    exact = 0
    for _ in range(6):
        grad = torch.randn(size, generator=generator) * 10.0 ** torch.randint(
            -6, 3, (size,), generator=generator
        )
        before = theirs.detach().clone()
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        state_before = copy.deepcopy(ours_opt.state[ours]) or {
            "step": 0.0,
            "exp_avg": torch.zeros(size),
            "exp_avg_sq": torch.zeros(size),
        }
        ours_opt.step()
        _assert_matches_ieee_oracle(ours_opt, ours, before, grad, state_before, **options)
        theirs_opt.step()
        for name in ("exp_avg", "exp_avg_sq"):
            _assert_same_bits(ours_opt.state[ours][name], theirs_opt.state[theirs][name])
        assert ours_opt.state[ours]["step"].item() == theirs_opt.state[theirs]["step"].item()
        _assert_param_close(ours, theirs, before)
        exact += int((ours == theirs).sum())
        with torch.no_grad():
            ours.copy_(theirs)  # next step from one common state
    assert exact >= 0.95 * 6 * size  # the roots that differ are a minority


@torch_fmadd
def test_grad_is_read_only_and_params_of_any_shape_step() -> None:
    generator = torch.Generator().manual_seed(3)
    ours, ours_opt, theirs, theirs_opt = _pair(torch.randn(7, 5, generator=generator), lr=0.1)
    grad = torch.randn(5, 7, generator=generator).t()  # non-contiguous: copied first
    ours.grad, theirs.grad = grad, grad.clone()
    ours_opt.step()
    theirs_opt.step()
    assert torch.equal(ours.grad, theirs.grad)
    _assert_same_bits(ours_opt.state[ours]["exp_avg_sq"], theirs_opt.state[theirs]["exp_avg_sq"])
    _assert_param_close(ours, theirs, grad * 0)  # before is irrelevant here: allowed = ulp + 2**-20 |p|


def test_thread_count_does_not_change_the_bits() -> None:
    generator = torch.Generator().manual_seed(5)
    start, grads = (
        torch.randn(300_001, generator=generator),
        [torch.randn(300_001, generator=generator) for _ in range(3)],
    )
    results = []
    before = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            param = torch.nn.Parameter(start.clone())
            optimizer = DenseAdam([param], lr=1e-3, weight_decay=0.1)
            for grad in grads:
                param.grad = grad
                optimizer.step()
            results.append(param.detach())
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1])


_floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)


@torch_fmadd
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    size=st.integers(1, 70),
    lr=st.floats(0.0, 1.0),
    beta1=st.floats(0.0, 0.999),
    beta2=st.floats(0.0, 0.9999),
    eps=st.sampled_from([0.0, 1e-30, 1e-8, 1.0]),
    weight_decay=st.sampled_from([0.0, 1e-4, 0.5]),
    step=st.integers(0, 10_000),
)
def test_adversarial_values_match_torch(
    data: st.DataObject,
    size: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    """Any float32 values (zeros, subnormals, huge, infinities, NaN) in the parameter, gradient and moments,
    at any step count: torch's moments bit for bit, its parameter within the last bit."""
    arrays = [
        torch.tensor(data.draw(st.lists(_floats32, min_size=size, max_size=size)), dtype=torch.float32)
        for _ in range(4)
    ]
    param, grad, exp_avg, exp_avg_sq = arrays
    options = {"lr": lr, "betas": (beta1, beta2), "eps": eps, "weight_decay": weight_decay}
    ours, ours_opt, theirs, theirs_opt = _pair(param, **options)
    for p, optimizer in ((ours, ours_opt), (theirs, theirs_opt)):
        optimizer.state[p] = {
            "step": torch.tensor(float(step)),
            "exp_avg": exp_avg.clone(),
            "exp_avg_sq": exp_avg_sq.clone(),
        }
        p.grad = grad.clone()
        optimizer.step()
    for name in ("exp_avg", "exp_avg_sq"):
        _assert_same_bits(ours_opt.state[ours][name], theirs_opt.state[theirs][name])
    _assert_param_close(ours, theirs, param)
    state_before = {"step": float(step), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    _assert_matches_ieee_oracle(ours_opt, ours, param, grad, state_before, **options)


@pytest.mark.parametrize("direction", ["torch-to-robez", "robez-to-torch"])
def test_state_dict_moves_between_torch_adam_and_dense_adam(direction: str) -> None:
    generator = torch.Generator().manual_seed(11)
    start = torch.randn(1000, generator=generator)
    grads = [torch.randn(1000, generator=generator) for _ in range(5)]
    first_cls, second_cls = (
        (torch.optim.Adam, DenseAdam) if direction == "torch-to-robez" else (DenseAdam, torch.optim.Adam)
    )

    def run(classes: list[type[torch.optim.Optimizer]]) -> tuple[torch.Tensor, dict]:
        param = torch.nn.Parameter(start.clone())
        optimizer = classes[0]([param], lr=0.01, weight_decay=0.01)
        for k, grad in enumerate(grads):
            if k == 3:
                saved = copy.deepcopy(optimizer.state_dict())
                optimizer = classes[1]([param], lr=0.5)  # the loaded groups bring lr back to 0.01
                optimizer.load_state_dict(saved)
            param.grad = grad
            optimizer.step()
        return param.detach(), optimizer.state_dict()

    moved, moved_state = run([first_cls, second_cls])
    stayed, stayed_state = run([second_cls, second_cls])
    assert moved_state["param_groups"] == stayed_state["param_groups"]
    for key in ("step", "exp_avg", "exp_avg_sq"):
        mine, other = moved_state["state"][0][key], stayed_state["state"][0][key]
        assert mine.dtype == other.dtype and mine.shape == other.shape
    assert moved_state["state"][0]["step"].item() == 5.0
    assert (moved == stayed).float().mean() > 0.95
    torch.testing.assert_close(moved, stayed, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "option",
    [
        {"amsgrad": True},
        {"maximize": True},
        {"capturable": True},
        {"differentiable": True},
        {"foreach": True},
        {"fused": True},
        {"decoupled_weight_decay": True},
        {"lr": torch.tensor(0.01)},
        {"betas": (torch.tensor(0.9), torch.tensor(0.999))},
        {"lr": -1.0},
        {"eps": -1.0},
        {"betas": (1.0, 0.999)},
        {"betas": (0.9, -0.1)},
        {"weight_decay": -0.1},
    ],
)
def test_unsupported_options_are_refused(option: dict) -> None:
    with pytest.raises(ValueError):
        DenseAdam([torch.nn.Parameter(torch.zeros(3))], **option)


@pytest.mark.parametrize(
    "param",
    [torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.complex64), torch.zeros(4, 3).t()],
    ids=["float64", "complex", "non-contiguous"],
)
def test_unsupported_params_are_refused(param: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="contiguous float32 CPU"):
        DenseAdam([torch.nn.Parameter(param)])


def test_sparse_grads_and_unsupported_loaded_options_are_refused_at_step() -> None:
    embedding = RobezEmbedding(100, 8, memory_size=64, chunk_size=4, sparse=True)
    optimizer = DenseAdam(embedding.parameters())
    embedding(torch.arange(5)).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        optimizer.step()

    param = torch.nn.Parameter(torch.zeros(3))
    saved = torch.optim.Adam([param], amsgrad=True).state_dict()
    optimizer = DenseAdam([param])
    optimizer.load_state_dict(saved)
    param.grad = torch.ones(3)
    with pytest.raises(ValueError, match="amsgrad"):
        optimizer.step()
    assert torch.equal(param, torch.zeros(3))


def test_trains_a_robez_embedding_like_torch_adam() -> None:
    """The case it exists for: a dense-gradient RobezEmbedding, a few steps, close to torch.optim.Adam."""
    results = []
    for cls in (torch.optim.Adam, DenseAdam):
        torch.manual_seed(0)
        embedding = RobezEmbedding(10_000, 16, memory_size=4096, chunk_size=8)
        optimizer = cls(embedding.parameters(), lr=0.01)
        ids = torch.randint(0, 10_000, (512,), generator=torch.Generator().manual_seed(1))
        for _ in range(5):
            optimizer.zero_grad()
            embedding(ids).pow(2).sum().backward()
            optimizer.step()
        results.append(embedding.weight.detach().clone())
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-7)


_AVX2_PROBE = """
import json, re, torch
torch.set_num_threads(1)
from robez_core import DenseAdam, kernels
g = torch.Generator().manual_seed(0)
ours = torch.nn.Parameter(torch.randn(100_003, generator=g))
theirs = torch.nn.Parameter(ours.detach().clone())
a, b = DenseAdam([ours], lr=0.01, weight_decay=0.01), torch.optim.Adam([theirs], lr=0.01, weight_decay=0.01)
same_moments, max_rel = True, 0.0
for _ in range(3):
    grad = torch.randn(100_003, generator=g); before = theirs.detach().clone()
    ours.grad, theirs.grad = grad, grad.clone(); a.step(); b.step()
    same_moments &= all(torch.equal(a.state[ours][k], b.state[theirs][k]) for k in ("exp_avg", "exp_avg_sq"))
    max_rel = max(max_rel, ((ours - theirs).abs() / (theirs - before).abs().clamp_min(1e-30)).max().item())
    with torch.no_grad(): ours.copy_(theirs)
asm = "".join(kernels._dense_adam_kernel.serial.inspect_asm().values())
print(json.dumps({**kernels.compile_target(), "same_moments": same_moments, "max_rel": max_rel,
                  "zmm": len(re.findall("%zmm", asm)), "ymm": len(re.findall("%ymm", asm)),
                  "fma": len(re.findall("vfmadd", asm)), "sqrtps": len(re.findall("vsqrtps", asm))}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not kernels._X86, reason="the emulated AVX2 target is an x86-64 CPU")
def test_avx2_build_vectorises_and_matches_torch(tmp_path: Path) -> None:
    """Under the bench's --emulate-avx2 environment the step compiles to 8-lane AVX2 code (ymm registers,
    vfmadd, vsqrtps, no zmm) and still gives torch's moments bit for bit."""
    from robez_core.bench import avx2_emulation_env

    env = {**os.environ, **avx2_emulation_env(), "NUMBA_CACHE_DIR": str(tmp_path)}
    completed = subprocess.run(
        [sys.executable, "-c", _AVX2_PROBE],
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr
    probe = json.loads(completed.stdout.strip().splitlines()[-1])
    assert probe["emulated"] == "yes" and "avx512f" not in probe["vector_extensions"].split()
    assert probe["same_moments"] and probe["max_rel"] < 0.1
    assert probe["zmm"] == 0 and probe["ymm"] > 0 and probe["fma"] > 0 and probe["sqrtps"] > 0
