"""The paper's CPU benchmark, side by side: full ``nn.Embedding``, reference ROBE-Z and fused ROBE-Z.

Run ``python -m benchmarks.core.paper_tables`` (or ``make bench``); ``--quick`` runs a small subset in under
a minute. It reproduces the "pair model" benchmark of the seed notes (``../shared/seeds/000_*.txt`` and
``004_*.txt``):

- two lookups per forward (ids ``x[:, 0]`` and ``x[:, 1]``), output = row-wise dot product, MSE loss
  against random targets; n = 1,000,000 rows, d = 100, Z = 32, batch 32768, lr 0.001;
- ROBE-Z memory sizes 262144 (1 MB), 2621440 (10 MB) and 100,000,000 (381.5 MB), arrays U(-0.001, 0.001);
- sparse and dense gradients; SGD, Adagrad and Adam (``SparseAdam`` when sparse; dense Adam is torch's
  default ``torch.optim.Adam`` for full ``nn.Embedding`` and the reference, as in the paper's benchmark, and
  ``torch.optim.Adam(fused=True)``, one pass over the array, for the fused model, which is what a robez
  user trains the array with);
- 8 iterations, the first dropped, the median of the rest reported; at 1 thread and at all threads.

Columns (milliseconds, per training step):

- ``forward``: the model's forward and the loss (two lookups, dot product, MSE);
- ``hashing`` / ``lookup`` (ROBE-Z only): the forward's two hash and two gather steps, timed on their own
  right after the step (reference: the (N, d) index tensor and ``weight[index]``; fused: the (N, C)
  chunk offsets and the chunk gather);
- ``gradcomp``: ``loss.backward()``; ``backward``: ``optimizer.step()`` (the seed's names);
- ``total``: forward + gradcomp + backward.

It also times the issue's targets at 1 thread (one lookup of a batch, hashing alone) and prints the
ratios, then writes a markdown report and a PNG plot under ``docs/benchmarks/``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import itertools
import math
import os
import platform
import resource
import shutil
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.common import DEFAULT_OUTPUT_DIR, EMULATION_MARK, REPO, avx2_emulation_env
from benchmarks.core.share import (
    FloorReading,
    PieceTimings,
    memory_floor_runner,
    timed_calls,
    timed_share_step,
    trivial_offsets,
)
from robez_core import buffers, kernels
from robez_core.allocator import tune_malloc
from robez_core.hashing import reference_indices
from robez_core.hostinfo import load_average, machine_facts
from robez_core.modules import RobezEmbedding

MODELS = ("full", "reference", "fused")
MODEL_LABELS = {"full": "full nn.Embedding", "reference": "ROBE-Z reference", "fused": "ROBE-Z fused"}
OPTIMIZERS = ("sgd", "adagrad", "adam")
PAPER_MEMORY_SIZES = (262_144, 2_621_440, 100_000_000)
TARGET_MEMORY_SIZE = 262_144
# The reference path with a dense Adam over a 100M array needs several seconds a step on a small machine;
# ``--skip-slow`` leaves those rows out (and the report says so).
SLOW_MEMORY_SIZE = 50_000_000


@dataclass(frozen=True)
class BenchSettings:
    """What to run. Defaults are the paper's configuration; ``quick()`` is the under-a-minute subset."""

    num_embeddings: int = 1_000_000
    embedding_dim: int = 100
    chunk_size: int = 32
    batch_size: int = 32_768
    memory_sizes: tuple[int, ...] = PAPER_MEMORY_SIZES
    optimizers: tuple[str, ...] = OPTIMIZERS
    sparse_modes: tuple[bool, ...] = (True, False)
    models: tuple[str, ...] = MODELS
    threads: tuple[int, ...] = (1, 0)  # 0 = all threads torch would use
    iterations: int = 8
    target_repeats: int = 15
    lr: float = 0.001
    seed: int = 0
    skip_slow: bool = False
    quick: bool = False
    profile: bool = False  # also when a target is missed (full runs): where the fused step's time goes
    only: tuple[tuple[str, bool, str], ...] = ()  # (model, sparse, optimizer) subset; empty = all

    @classmethod
    def quick_mode(cls, **overrides: object) -> BenchSettings:
        """The target rows only (m = 262144, Adam), 1 thread, 4 iterations."""
        base = cls(
            memory_sizes=(TARGET_MEMORY_SIZE,),
            optimizers=("adam",),
            threads=(1,),
            iterations=4,
            target_repeats=7,
            quick=True,
            only=(
                ("full", True, "adam"),
                ("reference", False, "adam"),
                ("fused", False, "adam"),
                ("fused", True, "adam"),
            ),
        )
        return replace(base, **overrides)  # type: ignore[arg-type]


@dataclass(frozen=True)
class RunConfig:
    """One row of the table."""

    model: str
    sparse: bool
    optimizer: str
    memory_size: int | None  # None for the full table

    @property
    def label(self) -> str:
        memory = "" if self.memory_size is None else f" m={self.memory_size}"
        return f"{self.model} {'sparse' if self.sparse else 'dense'} {self.optimizer}{memory}"


@dataclass
class RunResult:
    config: RunConfig
    threads: int
    forward_ms: float = math.nan
    hashing_ms: float = math.nan
    lookup_ms: float = math.nan
    gradcomp_ms: float = math.nan
    backward_ms: float = math.nan
    total_ms: float = math.nan
    skipped: str | None = None


@dataclass
class TargetResult:
    name: str
    baseline_ms: float
    fused_ms: float
    goal: float

    @property
    def ratio(self) -> float:
        return self.baseline_ms / self.fused_ms if self.fused_ms > 0 else math.nan

    @property
    def met(self) -> bool:
        return self.ratio >= self.goal


@dataclass
class BenchResult:
    settings: BenchSettings
    command: str
    started: dt.datetime
    runs: list[RunResult] = field(default_factory=list)
    targets: list[TargetResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    profile: str | None = None
    load_before: tuple[float, float, float] = (math.nan, math.nan, math.nan)
    load_after: tuple[float, float, float] = (math.nan, math.nan, math.nan)


# --------------------------------------------------------------------------------------------------
# models


class PairModel(nn.Module):
    """The seed's model: rows of ``x[:, 0]`` and ``x[:, 1]`` from one table, row-wise dot product (B,)."""

    def __init__(self, embedding: nn.Module) -> None:
        super().__init__()
        self.embedding = embedding

    def forward(self, pairs: Tensor) -> Tensor:
        left = self.embedding(pairs[:, 0])
        right = self.embedding(pairs[:, 1])
        return (left * right).sum(dim=1)


def make_embedding(config: RunConfig, settings: BenchSettings) -> nn.Module:
    """The row's embedding module (``nn.Embedding``, the reference or the fused ROBE-Z), untrained."""
    if config.model == "full":
        return nn.Embedding(settings.num_embeddings, settings.embedding_dim, sparse=config.sparse)
    assert config.memory_size is not None
    return RobezEmbedding(
        settings.num_embeddings,
        settings.embedding_dim,
        memory_size=config.memory_size,
        chunk_size=settings.chunk_size,
        sparse=config.sparse,
        backend="fused" if config.model == "fused" else "reference",
    )


def make_optimizer(
    config: RunConfig, params: list[nn.Parameter], lr: float, *, default_adam: bool = False
) -> torch.optim.Optimizer:
    """The row's optimizer. Dense Adam is ``torch.optim.Adam(fused=True)`` (one pass over the array) for
    the fused model, unless ``default_adam`` (the share's comparison arm), and torch's default
    ``torch.optim.Adam`` (several passes on CPU) for the others, as in the paper's benchmark."""
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if config.optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=lr)
    if config.sparse:
        return torch.optim.SparseAdam(params, lr=lr)
    return torch.optim.Adam(params, lr=lr, fused=config.model == "fused" and not default_adam)


def _split_forward(
    embedding: nn.Module, model: str
) -> tuple[Callable[[Tensor], object], Callable[[object], Tensor]]:
    """(hash, gather) of one lookup, the two halves of a ROBE-Z forward, as each backend does them."""
    if model == "fused":
        assert isinstance(embedding, RobezEmbedding)
        return embedding.hash_ids, lambda offsets: embedding.gather(offsets)
    assert isinstance(embedding, RobezEmbedding)

    def reference_hash(ids: Tensor) -> Tensor:
        return reference_indices(
            ids,
            embedding.embedding_dim,
            embedding.chunk_size,
            embedding.memory_size,
            embedding.random_numbers,
            embedding.val_offset,
            embedding.hash,
        )

    def reference_gather(indices: object) -> Tensor:
        with torch.no_grad():
            return embedding.weight[indices]  # type: ignore[index]

    return reference_hash, reference_gather


# --------------------------------------------------------------------------------------------------
# running


@contextlib.contextmanager
def _torch_threads(threads: int) -> Iterator[int]:
    previous = torch.get_num_threads()
    count = threads if threads > 0 else _all_threads()
    torch.set_num_threads(count)
    try:
        yield count
    finally:
        torch.set_num_threads(previous)


def _all_threads() -> int:
    return os.cpu_count() or 1


def batches_of(settings: BenchSettings) -> list[tuple[Tensor, Tensor]]:
    """``settings.iterations`` seeded batches (ids ``(batch, 2)`` int64, targets ``(batch,)`` float32), the
    same for every row of a table."""
    generator = torch.Generator().manual_seed(settings.seed)
    return [
        (
            torch.randint(0, settings.num_embeddings, (settings.batch_size, 2), generator=generator),
            torch.randn(settings.batch_size, generator=generator),
        )
        for _ in range(settings.iterations)
    ]


def _ms(seconds: Sequence[float]) -> float:
    """Median in milliseconds of the timings after the first (warm-up: caches, lazy optimizer state)."""
    kept = list(seconds[1:]) or list(seconds)
    return 1e3 * statistics.median(kept)


def run_config(
    config: RunConfig, settings: BenchSettings, threads: int, batches: list[tuple[Tensor, Tensor]]
) -> RunResult:
    """Train the pair model ``settings.iterations`` steps and return the median phase times."""
    embedding = make_embedding(config, settings)
    model = PairModel(embedding)
    optimizer = make_optimizer(config, list(model.parameters()), settings.lr)
    split = _split_forward(embedding, config.model) if config.model != "full" else None
    phases: dict[str, list[float]] = {
        name: [] for name in ("forward", "hashing", "lookup", "gradcomp", "backward")
    }
    for pairs, targets in batches:
        optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = F.mse_loss(model(pairs), targets)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        phases["forward"].append(t1 - t0)
        phases["gradcomp"].append(t2 - t1)
        phases["backward"].append(t3 - t2)
        if split is not None:
            hash_fn, gather_fn = split
            h0 = time.perf_counter()
            left, right = hash_fn(pairs[:, 0]), hash_fn(pairs[:, 1])
            h1 = time.perf_counter()
            gather_fn(left), gather_fn(right)
            h2 = time.perf_counter()
            phases["hashing"].append(h1 - h0)
            phases["lookup"].append(h2 - h1)
        del loss
    result = RunResult(config, threads)
    result.forward_ms = _ms(phases["forward"])
    result.gradcomp_ms = _ms(phases["gradcomp"])
    result.backward_ms = _ms(phases["backward"])
    result.total_ms = result.forward_ms + result.gradcomp_ms + result.backward_ms
    if split is not None:
        result.hashing_ms = _ms(phases["hashing"])
        result.lookup_ms = _ms(phases["lookup"])
    del model, embedding, optimizer
    gc.collect()
    return result


def _configs(settings: BenchSettings) -> list[RunConfig]:
    configs: list[RunConfig] = []
    for model in settings.models:
        memory_sizes: tuple[int | None, ...] = (None,) if model == "full" else settings.memory_sizes
        for optimizer in settings.optimizers:
            for sparse in settings.sparse_modes:
                if settings.only and (model, sparse, optimizer) not in settings.only:
                    continue
                configs.extend(RunConfig(model, sparse, optimizer, m) for m in memory_sizes)
    return configs


def _is_slow(config: RunConfig) -> bool:
    return config.model == "reference" and not config.sparse and (config.memory_size or 0) >= SLOW_MEMORY_SIZE


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()
    fn()  # warm-up: numba cache load, allocator
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        timings.append(time.perf_counter() - start)
    return 1e3 * statistics.median(timings)


def _time_single_lookups(
    settings: BenchSettings, memory_size: int, ids: Tensor
) -> tuple[float, float, float, float, float]:
    """Median ms of one forward lookup (full, reference, fused) and of hashing (reference, fused)."""
    full = nn.Embedding(settings.num_embeddings, settings.embedding_dim)
    reference, fused = (
        RobezEmbedding(
            settings.num_embeddings,
            settings.embedding_dim,
            memory_size=memory_size,
            chunk_size=settings.chunk_size,
            backend=backend,
        )
        for backend in ("reference", "fused")
    )
    repeats = settings.target_repeats
    slow_repeats = max(3, repeats // 3)  # the reference path is ~50x slower; fewer runs keep --quick quick
    reference_hash, _ = _split_forward(reference, "reference")
    return (
        _median_time(lambda: full(ids), repeats),
        _median_time(lambda: reference(ids), slow_repeats),
        _median_time(lambda: fused(ids), repeats),
        _median_time(lambda: reference_hash(ids), slow_repeats),
        _median_time(lambda: fused.hash_ids(ids), repeats),
    )


def _target_memory_size(settings: BenchSettings) -> int:
    return TARGET_MEMORY_SIZE if TARGET_MEMORY_SIZE in settings.memory_sizes else settings.memory_sizes[0]


# Alternating rounds of the reference's and the fused share. The reference allocates (N, d) index and
# gradient tensors every step and page-faults on some steps and not others (glibc's thresholds move with
# every large free), so its steps split into a fast and a slow group; 3 rounds (21 steps) let the median
# land anywhere between them from one run to the next, 8 rounds make it steadier, and the report prints
# the spread and the faults so that what remains is visible.
SHARE_ROUNDS = 8
SHARE_GOAL = 15.0  # the goal for the embedding share, fused vs reference


@dataclass(frozen=True)
class ShareStep:
    """One timed embedding share: whole share and its ``optimizer.step()`` in seconds, minor faults."""

    total: float
    step: float
    faults: int


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _embedding_share_runner(
    settings: BenchSettings, memory_size: int, model: str, *, default_adam: bool = False
) -> Callable[[], list[ShareStep]]:
    """A function that times the embedding's own part of a dense-Adam pair step over every batch. The
    share is both lookups, their backward (fed fixed output gradients, so none of the model's ops run)
    and ``optimizer.step()`` over the array (``make_optimizer``'s: ``Adam(fused=True)`` for the fused
    model unless ``default_adam``)."""
    config = RunConfig(model, False, "adam", memory_size)
    embedding = make_embedding(config, settings)
    optimizer = make_optimizer(config, list(embedding.parameters()), settings.lr, default_adam=default_adam)
    generator = torch.Generator().manual_seed(settings.seed + 2)
    shape = (settings.batch_size, settings.embedding_dim)
    output_grads = (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
    batches = batches_of(settings)

    def run() -> list[ShareStep]:
        timings = []
        for pairs, _ in batches:
            optimizer.zero_grad(set_to_none=True)
            faults = _minor_faults()
            # _kept: this step's rows, alive while the next step allocates, as in training
            share, step, _kept = timed_share_step(embedding, optimizer, pairs, output_grads)
            timings.append(ShareStep(share, step, _minor_faults() - faults))
        return timings[1:]  # the first of a round finds the other model's data in the caches

    return run


@dataclass(frozen=True)
class ShareTimings:
    """Milliseconds of the embedding shares over all kept steps (median, p10, p90), faults per step, and
    the yardsticks timed in the same rounds: the memory floor and the fused share's pieces.

    ``fused`` steps ``torch.optim.Adam(fused=True)`` (``adam_ms``: its step's median);
    ``fused_default_adam`` is the same fused share stepping torch's default ``torch.optim.Adam`` instead
    (``default_adam_ms``), the reference's optimizer, and ``adam_paired_ratio`` the median over steps of
    that share / the ``fused=True`` share of the same batch in the same round."""

    reference: tuple[float, float, float]
    fused: tuple[float, float, float]
    adam_ms: float
    reference_faults: float
    fused_faults: float
    steps: int
    fused_default_adam: tuple[float, float, float] = (math.nan, math.nan, math.nan)
    default_adam_ms: float = math.nan
    adam_paired_ratio: float = math.nan
    floor_ms: float = math.nan  # median of copying the share's minimum traffic (``benchmarks.core.share``)
    rows_floor_ms: float = math.nan  # of which the two row-sized copies
    pieces: PieceTimings | None = None
    # median ms of the fused share with its table accesses made trivial (``share.trivial_offsets``)
    trivial_accesses_ms: float = math.nan

    def reading(self) -> str:
        ref_median, ref_p10, ref_p90 = self.reference
        fused_median, fused_p10, fused_p90 = self.fused
        return (
            f"Embedding share over {self.steps} steps each ({SHARE_ROUNDS} alternating rounds): reference "
            f"median {ref_median:.2f} ms (p10 {ref_p10:.2f}, p90 {ref_p90:.2f}), "
            f"{self.reference_faults:.0f} minor page faults per step; fused median {fused_median:.2f} ms "
            f"(p10 {fused_p10:.2f}, p90 {fused_p90:.2f}), {self.fused_faults:.1f} faults per step. The "
            f"target compares medians ({ref_median / fused_median:.1f}x); against the reference's fast "
            f"steps (its p10, fewest faults) the fused median is {ref_p10 / fused_median:.1f}x faster, "
            f"against its slow ones (p90) {ref_p90 / fused_median:.1f}x."
        )

    def accesses_reading(self, goal: float) -> str:
        """What faster table accesses could bring: the fused share with every chunk at the array's start."""
        (reference, reference_fast, _), fused = self.reference, self.fused[0]
        trivial = self.trivial_accesses_ms
        best = reference / trivial
        verdict = (
            "so faster table accesses alone could reach"
            if best >= goal
            else "so no change to how the kernels reach the table could reach"
        )
        return (
            f"Table accesses: in the same alternating rounds the fused share with every row read from, and "
            f"its gradient added to, the array's first d floats (ids still hashed; the rows written, their "
            f"gradients read and Adam(fused=True)'s step unchanged) took {trivial:.2f} ms, against "
            f"{fused:.2f} ms with the hashed offsets: the random accesses cost {fused - trivial:.2f} ms of "
            f"the share, and with them free it would be {best:.1f}x faster than the reference's median "
            f"({reference_fast / trivial:.1f}x against its fast steps, p10), {verdict} the {goal:.0f}x "
            f"goal in this run."
        )

    def floor(self, goal: float) -> FloorReading:
        return FloorReading(
            self.floor_ms, self.rows_floor_ms, self.reference[0], self.fused[0], self.adam_ms, goal
        )

    def optimizer_reading(self) -> str:
        """What the optimizer flag brings: the fused share with ``Adam(fused=True)`` vs with torch's
        default ``Adam``, from the same alternating rounds."""
        reference, fused, fused_default = self.reference[0], self.fused[0], self.fused_default_adam[0]
        return (
            f"Optimizer: the fused share steps torch.optim.Adam(fused=True) (one pass over the array), the "
            f"reference torch's default torch.optim.Adam. In the same alternating rounds the fused share "
            f"with the default Adam took {fused_default:.2f} ms ({reference / fused_default:.1f}x vs the "
            f"reference), with Adam(fused=True) {fused:.2f} ms ({reference / fused:.1f}x; paired per batch, "
            f"default-Adam share / fused=True share = {self.adam_paired_ratio:.3f}); their step over the "
            f"array (median): default Adam {self.default_adam_ms:.2f} ms, Adam(fused=True) "
            f"{self.adam_ms:.2f} ms ({self.default_adam_ms / self.adam_ms:.1f}x). The lookups and their "
            f"backward took the other {fused - self.adam_ms:.2f} ms of the fused=True share: with them "
            f"free, the share could be at most {reference / self.adam_ms:.1f}x faster than the reference's "
            f"{reference:.2f} ms."
        )


def _spread_ms(values: Sequence[float]) -> tuple[float, float, float]:
    p50, p10, p90 = np.percentile(np.asarray(values), [50, 10, 90])
    return 1e3 * float(p50), 1e3 * float(p10), 1e3 * float(p90)


# The calls of the fused path that the instrumented round times one by one (the rest is autograd).
FUSED_SHARE_PIECES: dict[str, tuple[object, str]] = {
    "hash": (kernels, "chunk_offsets"),
    "gather": (kernels, "gather"),
    "dense gradient zeroed": (buffers, "zeros"),
    "scatter": (kernels, "scatter_grad"),
}


def _time_embedding_shares(
    settings: BenchSettings, memory_size: int, rounds: int = SHARE_ROUNDS
) -> ShareTimings:
    """The reference's and the fused embedding share, timed in alternating rounds so that a change of
    machine load hits both alike, and the fused share's ``optimizer.step()`` (``Adam(fused=True)`` over
    the array). A third arm, the fused share stepping torch's default ``torch.optim.Adam`` (the
    reference's optimizer), runs in the same rounds, so the report shows what the ``fused=True`` flag
    brings. Each round also
    times the memory floor (``share.memory_floor_runner``) and one more fused round with its
    kernel calls timed one by one, kept apart from the share's own figures."""
    runners = {
        "reference": _embedding_share_runner(settings, memory_size, "reference"),
        "fused": _embedding_share_runner(settings, memory_size, "fused"),
        "fused default adam": _embedding_share_runner(settings, memory_size, "fused", default_adam=True),
        "fused trivial accesses": _embedding_share_runner(settings, memory_size, "fused"),
    }
    generator = torch.Generator().manual_seed(settings.seed + 2)
    shape = (settings.batch_size, settings.embedding_dim)
    floor_grads = (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
    floor_run = memory_floor_runner(floor_grads, memory_size, settings.iterations)
    timings: dict[str, list[ShareStep]] = {model: [] for model in runners}
    floors: list[tuple[float, float]] = []
    durations: dict[str, list[float]] = {name: [] for name in FUSED_SHARE_PIECES}
    for _ in range(rounds):
        for model, run in runners.items():
            with trivial_offsets() if model == "fused trivial accesses" else contextlib.nullcontext():
                timings[model] += run()
        floors += floor_run()
        with timed_calls(FUSED_SHARE_PIECES) as calls:
            runners["fused"]()
        for name, values in calls.items():
            per_step = len(values) // settings.iterations
            durations[name] += values[per_step:]  # the round's first step is dropped, as the share's
    reference, fused, fused_default = timings["reference"], timings["fused"], timings["fused default adam"]
    adam_ms = 1e3 * statistics.median(step.step for step in fused)
    return ShareTimings(
        reference=_spread_ms([step.total for step in reference]),
        fused=_spread_ms([step.total for step in fused]),
        adam_ms=adam_ms,
        reference_faults=statistics.mean(step.faults for step in reference),
        fused_faults=statistics.mean(step.faults for step in fused),
        steps=len(fused),
        fused_default_adam=_spread_ms([step.total for step in fused_default]),
        default_adam_ms=1e3 * statistics.median(step.step for step in fused_default),
        adam_paired_ratio=statistics.median(
            default.total / one_pass.total for default, one_pass in zip(fused_default, fused, strict=True)
        ),
        floor_ms=1e3 * statistics.median(total for _, total in floors),
        rows_floor_ms=1e3 * statistics.median(rows for rows, _ in floors),
        pieces=PieceTimings.from_durations(durations, len(fused), adam_ms),
        trivial_accesses_ms=1e3 * statistics.median(step.total for step in timings["fused trivial accesses"]),
    )


def _time_model_own_work(settings: BenchSettings) -> float:
    """Median ms of the pair model's own part of a step, the same whatever the embedding: the product,
    the row sums, the MSE loss and their backward, on rows that are plain leaf tensors."""
    generator = torch.Generator().manual_seed(settings.seed + 3)
    shape = (settings.batch_size, settings.embedding_dim)
    left = torch.randn(shape, generator=generator).requires_grad_()
    right = torch.randn(shape, generator=generator).requires_grad_()
    timings = []
    for _, targets in batches_of(settings):
        left.grad = right.grad = None
        start = time.perf_counter()
        loss = F.mse_loss((left * right).sum(dim=1), targets)
        loss.backward()
        timings.append(time.perf_counter() - start)
    return _ms(timings)


def measure_targets(
    settings: BenchSettings, runs: list[RunResult], notes: list[str] | None = None
) -> list[TargetResult]:
    """The issue's ratios at 1 thread: one lookup, hashing alone, the embedding's share of the dense-Adam
    step and the whole step. ``notes`` gets the floor the model's own work sets for the whole step."""
    memory_size = _target_memory_size(settings)
    generator = torch.Generator().manual_seed(settings.seed + 1)
    ids = torch.randint(0, settings.num_embeddings, (settings.batch_size,), generator=generator)
    targets: list[TargetResult] = []
    with _torch_threads(1):
        timings = _time_single_lookups(settings, memory_size, ids)
    full_ms, reference_ms, fused_ms, reference_hash_ms, fused_hash_ms = timings
    gc.collect()
    label = f"{settings.batch_size} ids, d={settings.embedding_dim}, Z={settings.chunk_size}, m={memory_size}"
    targets.append(
        TargetResult(f"forward, one lookup ({label}): fused vs reference", reference_ms, fused_ms, 20.0)
    )
    targets.append(
        TargetResult(f"forward, one lookup ({label}): fused vs full nn.Embedding", full_ms, fused_ms, 1.0)
    )
    targets.append(
        TargetResult(f"hashing alone ({label}): fused vs reference", reference_hash_ms, fused_hash_ms, 50.0)
    )

    def step_ms(model: str, sparse: bool) -> float:
        for run in runs:
            c = run.config
            if (
                run.threads == 1
                and c.model == model
                and c.sparse == sparse
                and c.optimizer == "adam"
                and c.memory_size in (memory_size, None)
                and run.skipped is None
            ):
                return run.total_ms
        return math.nan

    fused_step = step_ms("fused", False)
    if not math.isnan(fused_step):
        name = f"pair-model training step, m={memory_size}: fused (dense grads, Adam(fused=True)) vs"
        reference_step = step_ms("reference", False)
        if not math.isnan(reference_step):
            with _torch_threads(1):
                shares = _time_embedding_shares(settings, memory_size)
                reference_share, fused_share = shares.reference[0], shares.fused[0]
                model_ms = _time_model_own_work(settings)
            targets.append(
                TargetResult(
                    f"embedding's share of that step (2 lookups, their backward, dense Adam over the "
                    f"array), m={memory_size}: fused + Adam(fused=True) vs reference + default Adam",
                    reference_share,
                    fused_share,
                    SHARE_GOAL,
                )
            )
            step_name = f"{name} reference (dense grads, default Adam)"
            targets.append(TargetResult(step_name, reference_step, fused_step, 10.0))
            if notes is not None:
                notes.append(
                    f"The pair model's own work in a step (product, row sums, MSE and their backward, the "
                    f"same for any embedding) measured {model_ms:.2f} ms at 1 thread: even an embedding that "
                    f"cost nothing would make the whole dense-Adam step at most "
                    f"{reference_step / model_ms:.1f}x faster than the reference's {reference_step:.2f} ms. "
                    f"The fused step's remainder beyond its embedding share and that work: "
                    f"{fused_step - fused_share - model_ms:.2f} ms (autograd, allocations)."
                )
                notes.append(shares.optimizer_reading())
                notes.append(shares.reading())
                if shares.pieces is not None:
                    notes.append(shares.pieces.reading(fused_share))
                notes.append(shares.accesses_reading(SHARE_GOAL))
                notes.append(
                    shares.floor(SHARE_GOAL).reading(settings.batch_size, settings.embedding_dim, memory_size)
                )
        full_step = step_ms("full", True)
        if not math.isnan(full_step):
            targets.append(
                TargetResult(f"{name} full nn.Embedding (sparse, SparseAdam)", full_step, fused_step, 5.0)
            )
    return targets


def _phase_split(
    embedding: nn.Module, optimizer: torch.optim.Optimizer, batches: list[tuple[Tensor, Tensor]]
) -> dict[str, float]:
    """Median ms of each phase of the pair-model step, the forward taken apart op by op."""
    phases: dict[str, list[float]] = {}
    for pairs, targets in batches:
        optimizer.zero_grad(set_to_none=True)
        marks = [("start", time.perf_counter())]
        left = embedding(pairs[:, 0])
        marks.append(("lookup x[:, 0]", time.perf_counter()))
        right = embedding(pairs[:, 1])
        marks.append(("lookup x[:, 1]", time.perf_counter()))
        product = left * right
        marks.append(("left * right", time.perf_counter()))
        output = product.sum(dim=1)
        marks.append(("sum(dim=1)", time.perf_counter()))
        loss = F.mse_loss(output, targets)
        marks.append(("mse_loss", time.perf_counter()))
        loss.backward()
        marks.append(("loss.backward()", time.perf_counter()))
        optimizer.step()
        marks.append(("optimizer.step()", time.perf_counter()))
        for (_, before), (name, after) in itertools.pairwise(marks):
            phases.setdefault(name, []).append(after - before)
        phases.setdefault("total", []).append(marks[-1][1] - marks[0][1])
    return {name: _ms(values) for name, values in phases.items()}


def profile_training_step(settings: BenchSettings, memory_size: int, steps: int = 6) -> str:
    """Markdown: where a dense-Adam pair-model step spends its time at 1 thread (fused and reference
    phase splits side by side, then torch.profiler's operator table for the fused step)."""
    batches = batches_of(replace(settings, iterations=steps))
    lines = [
        f"# Where the time goes: pair-model step, dense gradients + Adam, m = {memory_size}, 1 thread",
        "",
        f"Batch {settings.batch_size}, d = {settings.embedding_dim}, Z = {settings.chunk_size}; "
        f"median ms of {steps - 1} steps after a warm-up step. `optimizer.step()` is torch's default "
        "`torch.optim.Adam` for the reference, `torch.optim.Adam(fused=True)` for the fused model.",
        "",
        "| phase | reference ROBE-Z | fused ROBE-Z |",
        "|---|---:|---:|",
    ]
    splits = {}
    table = ""
    profiler = None
    with _torch_threads(1):
        for model in ("reference", "fused"):
            config = RunConfig(model, False, "adam", memory_size)
            embedding = make_embedding(config, settings)
            optimizer = make_optimizer(config, list(embedding.parameters()), settings.lr)
            splits[model] = _phase_split(embedding, optimizer, batches)
            if model == "fused":
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
                    _phase_split(embedding, optimizer, batches[:3])
                table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    for name in splits["fused"]:
        lines.append(f"| {name} | {splits['reference'][name]:.2f} | {splits['fused'][name]:.2f} |")
    assert profiler is not None
    events = {event.key: event.self_cpu_time_total / 1e3 / 3 for event in profiler.key_averages()}
    kernels_ms = events.get("_FusedLookup", math.nan) + events.get("_FusedLookupBackward", math.nan)
    lines += [
        "",
        f"Under the profiler, the fused embedding itself (two hash + gather calls in `_FusedLookup`, two "
        f"scatters in `_FusedLookupBackward`) takes {kernels_ms:.2f} ms of a step; the rest is the pair "
        "model's own torch ops (the product, its two backward multiplies, sum, loss) and autograd, the same "
        "whatever the embedding, and the optimizer step (`torch.optim.Adam(fused=True)` for the fused "
        "model, torch's default `torch.optim.Adam` for the reference).",
        "",
        "torch.profiler, fused step (3 steps; numba kernels appear inside `_FusedLookup` / "
        "`_FusedLookupBackward`):",
        "",
        "```",
        table.rstrip(),
        "```",
    ]
    return "\n".join(lines)


def run_benchmark(
    settings: BenchSettings, command: str, log: Callable[[str], None] | None = None
) -> BenchResult:
    """Run every configuration at every thread count, then the targets; progress goes to ``log``."""
    say = log or (lambda message: print(message, file=sys.stderr, flush=True))
    result = BenchResult(settings, command, dt.datetime.now(dt.UTC), load_before=load_average())
    started = time.perf_counter()
    batches = batches_of(settings)
    configs = _configs(settings)
    total = len(configs) * len(settings.threads)
    done = 0
    for threads in settings.threads:
        with _torch_threads(threads) as count:
            for config in configs:
                done += 1
                if settings.skip_slow and _is_slow(config):
                    result.runs.append(RunResult(config, count, skipped="--skip-slow"))
                    say(f"[{done}/{total}] threads={count} {config.label}: skipped (--skip-slow)")
                    continue
                run = run_config(config, settings, count, batches)
                result.runs.append(run)
                say(
                    f"[{done}/{total}] threads={count} {config.label}: total {run.total_ms:.1f} ms (forward "
                    f"{run.forward_ms:.1f}, gradcomp {run.gradcomp_ms:.1f}, backward {run.backward_ms:.1f})"
                )
    if 1 in settings.threads or settings.threads == (1,):
        say("targets at 1 thread ...")
        result.targets = measure_targets(settings, result.runs, result.notes)
    else:
        result.notes.append(
            "Targets are defined at 1 thread; 1 was not among --threads, so none were measured."
        )
    wants_profile = settings.profile or (not settings.quick and any(not t.met for t in result.targets))
    if wants_profile:
        say("profiling the fused dense-Adam step ...")
        memory_size = _target_memory_size(settings)
        result.profile = profile_training_step(settings, memory_size)
    if any(run.skipped for run in result.runs):
        result.notes.append(
            "Rows marked skipped (reference ROBE-Z, dense gradients, m >= 50M) were left out (--skip-slow)."
        )
    result.seconds = time.perf_counter() - started
    result.load_after = load_average()
    return result


# --------------------------------------------------------------------------------------------------
# reporting


SEED_NOTES = REPO.parent / "shared" / "seeds" / "004_6b056f2124eb0811.txt"
SeedKey = tuple[str, bool, int, str]  # (model "full" | "robez", sparse, parameters, optimizer)


def read_seed_totals(path: Path, cpus: int = 1) -> dict[SeedKey, float]:
    """Total ms per row of the seed notes' pair-model table for ``cpus`` CPUs ("1CPU:" / "10CPU").

    The seed's ``RobezEmbedding`` is the paper-style pure-torch implementation, closest to our reference
    row. Returns {} when the notes are not there (they live beside the repository, not in it).
    """
    try:
        text = path.read_text()
    except OSError:
        return {}
    totals: dict[SeedKey, float] = {}
    section = None
    for line in text.splitlines():
        header = line.strip().rstrip(":").upper()
        if header.endswith("CPU") and header[:-3].isdigit():
            section = int(header[:-3])
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if section != cpus or len(cells) != 14 or cells[1] not in ("FullEmbedding", "RobezEmbedding"):
            continue
        with contextlib.suppress(ValueError):
            model = "full" if cells[1] == "FullEmbedding" else "robez"
            totals[(model, cells[2] == "True", int(cells[4]), cells[13])] = float(cells[11])
    return totals


def _seed_total(seed: dict[SeedKey, float], config: RunConfig, settings: BenchSettings) -> float:
    if config.model == "full":
        key = ("full", config.sparse, settings.num_embeddings * settings.embedding_dim, config.optimizer)
    else:
        key = ("robez", config.sparse, config.memory_size or 0, config.optimizer)
    return seed.get(key, math.nan)


def _fmt(value: float) -> str:
    return "" if math.isnan(value) else f"{value:.2f}"


def _memory_label(config: RunConfig, settings: BenchSettings) -> str:
    params = (
        settings.num_embeddings * settings.embedding_dim if config.memory_size is None else config.memory_size
    )
    return f"{params} ({params * 4 / 2**20:.1f} MB)"


def render_markdown(
    result: BenchResult, plot_name: str | None = None, profile_name: str | None = None
) -> str:
    """The report: machine, command, targets, then one table per thread count (times in ms)."""
    s = result.settings
    lines = [
        f"# ROBE-Z CPU benchmark, {result.started:%Y-%m-%d %H:%M} UTC",
        "",
        f"Produced by `{result.command}` in {result.seconds:.0f} s"
        + (" (quick mode: a subset, fewer iterations)" if s.quick else "")
        + ". Regenerate with `make bench` (`python -m benchmarks.core.paper_tables`).",
        "",
        "| | |",
        "|---|---|",
    ]
    lines += [f"| {key} | {value} |" for key, value in machine_facts().items()]
    thread_counts = sorted({run.threads for run in result.runs}) or [1]
    lines.append(f"| threads | {', '.join(str(t) for t in thread_counts)} (torch and numba alike) |")
    lines.append(
        "| load average (1/5/15 min) | "
        f"before {' '.join(f'{v:.2f}' for v in result.load_before)}, "
        f"after {' '.join(f'{v:.2f}' for v in result.load_after)} |"
    )
    lines += [
        "",
        f"Pair model: two lookups of a batch of {s.batch_size} id pairs, row-wise dot product, MSE against "
        f"random targets; n = {s.num_embeddings}, d = {s.embedding_dim}, Z = {s.chunk_size}, lr = {s.lr}. "
        f"{s.iterations} iterations, the first dropped, median of the rest. `forward` = model + loss, "
        "`hashing` / `lookup` = the forward's two hash / gather steps timed on their own, "
        "`gradcomp` = `loss.backward()`, "
        "`backward` = `optimizer.step()` (the seed's column names), `total` = forward + gradcomp + backward. "
        "Sparse Adam is `torch.optim.SparseAdam`; dense Adam is torch's default `torch.optim.Adam` for "
        "full nn.Embedding and the reference, `torch.optim.Adam(fused=True)` (one pass over the array) for "
        "the fused rows. "
        "Wall-clock milliseconds; the machine may be shared, so "
        "compare rows of one run rather than runs.",
        "",
    ]
    if result.targets:
        lines += ["## Targets (1 thread)", "", "| target | baseline ms | fused ms | ratio | goal | met |"]
        lines.append("|---|---:|---:|---:|---:|---|")
        for target in result.targets:
            lines.append(
                f"| {target.name} | {target.baseline_ms:.3f} | {target.fused_ms:.3f} | {target.ratio:.1f}x "
                f"| >= {target.goal:g}x | {'yes' if target.met else '**no**'} |"
            )
        lines.append("")
    if profile_name:
        lines += [f"Where the fused step's time goes: [{profile_name}]({profile_name}).", ""]
    for note in result.notes:
        lines += [f"Note: {note}", ""]
    if plot_name:
        lines += [f"![time split per training step]({plot_name})", ""]
    seed = read_seed_totals(SEED_NOTES) if s.num_embeddings == 1_000_000 and s.batch_size == 32_768 else {}
    if seed:
        lines += [
            f"`seed total`: the total ms of the same row in the seed notes (`{SEED_NOTES.name}`, 1 CPU, "
            "their pure-torch `RobezEmbedding` for both ROBE-Z rows), read from the file by the bench.",
            "",
        ]
    for threads in sorted({run.threads for run in result.runs}):
        seed_column = bool(seed) and threads == 1
        lines += [
            f"## {threads} thread{'s' if threads != 1 else ''}",
            "",
            "| model | sparse | batch | params | optimizer | forward | hashing | lookup | gradcomp "
            "| backward | total |" + (" seed total |" if seed_column else ""),
            "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if seed_column else ""),
        ]
        for run in (r for r in result.runs if r.threads == threads):
            c = run.config
            head = (
                f"| {MODEL_LABELS[c.model]} | {c.sparse} | {s.batch_size} | {_memory_label(c, s)} "
                f"| {c.optimizer} |"
            )
            if run.skipped:
                lines.append(f"{head} skipped ({run.skipped}) | | | | | |" + (" |" if seed_column else ""))
                continue
            cells = [
                run.forward_ms,
                run.hashing_ms,
                run.lookup_ms,
                run.gradcomp_ms,
                run.backward_ms,
                run.total_ms,
            ]
            if seed_column:
                cells.append(_seed_total(seed, c, s))
            lines.append(head + " " + " | ".join(_fmt(v) for v in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def render_plot(result: BenchResult, path: Path) -> None:
    """Per row, the share of a training step spent in forward / gradcomp / backward (100% stacked bars,
    so rows of very different totals stay readable), the total step time written at the bar's end; one
    panel per thread count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    thread_counts = sorted({run.threads for run in result.runs if not run.skipped})
    if not thread_counts:
        return
    rows_per_panel = max(
        sum(1 for r in result.runs if r.threads == t and not r.skipped) for t in thread_counts
    )
    fig, axes = plt.subplots(
        1, len(thread_counts), figsize=(7.5 * len(thread_counts), 1.5 + 0.28 * rows_per_panel), squeeze=False
    )
    colors = {"forward": "#4c72b0", "gradcomp": "#dd8452", "backward": "#55a868"}
    for ax, threads in zip(axes[0], thread_counts, strict=True):
        runs = [r for r in result.runs if r.threads == threads and not r.skipped]
        labels = [r.config.label for r in runs]
        totals = np.array([r.total_ms for r in runs])
        left = np.zeros(len(runs))
        for phase, color in colors.items():
            share = 100 * np.array([getattr(r, f"{phase}_ms") for r in runs]) / totals
            ax.barh(labels, share, left=left, color=color, label=phase)
            left += share
        for y, total in enumerate(totals):
            ax.text(101, y, f"{total:.1f} ms", va="center", fontsize=7)
        ax.set_xlim(0, 125)
        ax.invert_yaxis()
        ax.set_xlabel("% of a training step (total at the right)")
        ax.set_title(f"{threads} thread{'s' if threads != 1 else ''}")
        ax.tick_params(axis="y", labelsize=7)
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="upper center", ncol=len(colors), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_figheight()))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(result: BenchResult, output_dir: Path) -> Path:
    """``<date>-<host>.md`` + ``.png`` under ``output_dir``, and ``latest.md`` / ``latest.png`` copies."""
    output_dir.mkdir(parents=True, exist_ok=True)
    host = "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in socket.gethostname()) or "host"
    emulated = "-avx2-emulated" if os.environ.get(EMULATION_MARK) == "avx2" else ""
    stem = f"{result.started:%Y-%m-%d}-{host}{emulated}" + ("-quick" if result.settings.quick else "")
    plot_path = output_dir / f"{stem}.png"
    render_plot(result, plot_path)
    profile_name = None
    if result.profile:
        profile_name = f"{stem}-profile.md"
        (output_dir / profile_name).write_text(result.profile + "\n")
    report_path = output_dir / f"{stem}.md"
    plot_name = plot_path.name if plot_path.exists() else None
    report_path.write_text(render_markdown(result, plot_name, profile_name) + "\n")
    if not result.settings.quick and not emulated:
        latest_plot = output_dir / "latest.png"
        if plot_path.exists():
            shutil.copyfile(plot_path, latest_plot)
        latest = render_markdown(result, latest_plot.name if plot_path.exists() else None, profile_name)
        (output_dir / "latest.md").write_text(latest + "\n")
    return report_path


def format_targets(targets: list[TargetResult]) -> str:
    return "\n".join(
        f"{'ok ' if t.met else 'MISS'} {t.ratio:7.1f}x (goal >= {t.goal:g}x)  {t.name}: "
        f"{t.baseline_ms:.3f} ms -> {t.fused_ms:.3f} ms"
        for t in targets
    )


# --------------------------------------------------------------------------------------------------
# command line


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(part.replace("_", "")) for part in text.split(",") if part)


def _thread_list(text: str) -> tuple[int, ...]:
    return tuple(0 if part == "all" else int(part) for part in text.split(",") if part)


def _name_list(allowed: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(part for part in text.split(",") if part)
        unknown = [name for name in names if name not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {list(allowed)}")
        return names

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.core.paper_tables",
        description="The paper's CPU benchmark: nn.Embedding, reference and fused ROBE-Z side by side.",
    )
    parser.add_argument(
        "--quick", action="store_true", help="the target rows only, 1 thread (under a minute)"
    )
    parser.add_argument(
        "--threads", type=_thread_list, help="comma list of thread counts, 'all' = every core"
    )
    parser.add_argument(
        "--memory-sizes", type=_int_list, help="ROBE-Z array sizes (default: the paper's three)"
    )
    parser.add_argument("--optimizers", type=_name_list(OPTIMIZERS), help="comma list of sgd,adagrad,adam")
    parser.add_argument("--models", type=_name_list(MODELS), help="comma list of full,reference,fused")
    parser.add_argument("--sparse", choices=["both", "true", "false"], help="gradient kinds to run")
    parser.add_argument("--iterations", type=int, help="training steps per row (the first is dropped)")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--num-embeddings", type=int)
    parser.add_argument("--embedding-dim", type=int)
    parser.add_argument("--chunk-size", type=int)
    parser.add_argument(
        "--skip-slow", action="store_true", help="leave out reference dense rows with m >= 50M"
    )
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR)
    parser.add_argument("--no-report", action="store_true", help="print only; write no files")
    parser.add_argument(
        "--emulate-avx2",
        action="store_true",
        help="compile the kernels for, and hold torch to, an AVX2-only CPU (znver2) on an AVX-512 host",
    )
    parser.add_argument(
        "--small",
        action="store_true",
        help="instead: the small-batch micro-benchmark (lookup of 1 id, update of 8; --small --help)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile the fused dense-Adam step (automatic on a missed target)",
    )
    parser.add_argument(
        "--tune-malloc",
        action="store_true",
        help="run every row with robez_core.allocator.tune_malloc() "
        "(see python -m benchmarks.core.page_faults)",
    )
    return parser


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    overrides: dict[str, object] = {}
    for name in ("threads", "memory_sizes", "optimizers", "models", "iterations", "batch_size"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    for name in ("num_embeddings", "embedding_dim", "chunk_size"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    if args.sparse is not None:
        overrides["sparse_modes"] = {"both": (True, False), "true": (True,), "false": (False,)}[args.sparse]
    if args.skip_slow:
        overrides["skip_slow"] = True
    if args.profile:
        overrides["profile"] = True
    if args.quick:
        return BenchSettings.quick_mode(**overrides)
    return replace(BenchSettings(), **overrides)  # type: ignore[arg-type]


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    if "--small" in given:  # the small-batch micro-benchmark has options of its own
        from benchmarks.core.small_batches import main as small_main

        return small_main([arg for arg in given if arg != "--small"])
    args = build_parser().parse_args(argv)
    if args.emulate_avx2 and os.environ.get(EMULATION_MARK) != "avx2":
        if platform.machine().lower() not in ("x86_64", "amd64"):
            raise SystemExit("--emulate-avx2 needs an x86-64 host")
        # numba and torch read these at import: run the bench again in a process that has them
        arguments = list(argv if argv is not None else sys.argv[1:])
        os.execve(
            sys.executable,
            [sys.executable, "-m", "benchmarks.core.paper_tables", *arguments],
            {**os.environ, **avx2_emulation_env()},
        )
    if args.tune_malloc and not tune_malloc():
        raise SystemExit("--tune-malloc needs glibc's mallopt")
    settings = settings_from_args(args)
    command = "python -m benchmarks.core.paper_tables" + (
        " " + " ".join(argv if argv is not None else sys.argv[1:])
    )
    result = run_benchmark(settings, command.strip())
    print(render_markdown(result))
    if result.targets:
        print("\nTargets (1 thread):\n" + format_targets(result.targets))
    if result.profile and args.no_report:
        print("\n" + result.profile)
    if not args.no_report:
        path = write_report(result, args.output_dir)
        print(f"\nreport: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
