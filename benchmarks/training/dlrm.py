"""A DLRM-shaped model trained with each way of holding its embeddings, in one run (issue 37).

Synthetic Criteo-Kaggle-shaped data with a planted click model: 26 categorical features with the
Criteo-Kaggle cardinalities (as DLRM's preprocessing counts them) capped at 6M, ids drawn Zipf(1.1) per
feature (then scattered over the feature's range), 13 dense features N(0, 1); a click's logit is a
fixed linear function of the dense features plus a fixed per-(feature, id) score. The model: bottom MLP
13 -> 64 -> 16, pairwise dot interaction of the 27 vectors (351 pairs + the 16 dense outputs = 367),
top MLP 367 -> 128 -> 64 -> 1; batch 2048, d = 16, Adagrad for the embeddings (lr 0.05), Adam for the
MLPs (lr 1e-3); 1 thread (``torch.set_num_threads(1)``, which the kernels follow).

Variants (``VARIANTS``, a registry of builders; each runs in a child process of its own, one after the
other, so that its memory is its own): full ``nn.EmbeddingBag(sparse=True)`` tables; torchrec's
``EmbeddingBagCollection`` (its bags made sparse) and its fused FBGEMM TBE variant (when torchrec is
installed: the ``torchrec`` extra, else skipped with a message); 26 ``RobezEmbeddingBag`` on one array
(16x smaller than the full tables); robez's ``RobezEmbeddingBagCollection`` on the same array. Every
variant sees the same batches. A step is timed in four parts: the embedding lookup; the dense model's
forward + backward + Adam step (fed the pooled rows detached, so its backward stops there); the
embedding backward (the pooled rows' gradient handed back); the embedding optimizer step (inside the
backward for the fused variants: robez's collection reports its split, torchrec's fused one cannot).

    python -m benchmarks.training.dlrm          # the issue's sizes: docs/benchmarks/dlrm-<date>.md
    python -m benchmarks.training.dlrm --quick  # CI sizes, a few seconds a variant
    python -m benchmarks.training.dlrm --variants robez_collection,full

Run it alone on the machine (``flock /tmp/robez-bench.lock ...``); the goals are ratios of one run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import itertools
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from benchmarks.common import DEFAULT_OUTPUT_DIR

# Criteo Kaggle (Display Advertising Challenge) categorical cardinalities C1..C26, as DLRM counts them.
CRITEO_KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
NUM_DENSE = 13
ZIPF_EXPONENT = 1.1


@dataclass(frozen=True)
class Settings:
    """One run's sizes; ``--quick`` shrinks them for CI."""

    batch_size: int = 2048
    steps: int = 120
    warmup: int = 20  # steps left out of the medians (compilation, first page faults)
    eval_batches: int = 8
    cardinality_cap: int = 6_000_000
    embedding_dim: int = 16
    compression: int = 16  # ROBE-Z array = sum(n) * d / compression floats
    chunk_size: int = 32
    embedding_lr: float = 0.05
    dense_lr: float = 1e-3
    init_scale: float = 0.01
    seed: int = 0
    threads: int = 1
    data_offset: int = 0  # training batch i is batch i + data_offset (a second trainer's own data)

    @property
    def cardinalities(self) -> list[int]:
        return [min(n, self.cardinality_cap) for n in CRITEO_KAGGLE_CARDINALITIES]

    @property
    def memory_size(self) -> int:
        return sum(self.cardinalities) * self.embedding_dim // self.compression


QUICK = Settings(batch_size=256, steps=14, warmup=4, eval_batches=2, cardinality_cap=20_000)


# ------------------------------------------------------------------------------------------ data


@dataclass
class Batch:
    dense: Tensor  # float32 (B, 13)
    values: Tensor  # int64 (26 * B,), key-major: feature f's ids are values[f * B:(f + 1) * B]
    lengths: Tensor  # int64 (26 * B,), all ones: one id per feature per sample, as in Criteo
    labels: Tensor  # float32 (B,)
    keys: list[str] = field(default_factory=lambda: [f"C{i + 1}" for i in range(26)])


def _id_scores(ids: np.ndarray, feature: int) -> np.ndarray:
    """The planted per-(feature, id) score in [-1, 1): a fixed hash of the pair."""
    with np.errstate(over="ignore"):  # wrapping uint64 arithmetic is the point
        key = (ids.astype(np.uint64) + np.uint64(feature * 0x632BE59B)) * np.uint64(0x9E3779B97F4A7C15)
    key ^= key >> np.uint64(29)
    return (key >> np.uint64(11)).astype(np.float64) / float(1 << 53) * 2.0 - 1.0


class SyntheticCriteo:
    """Deterministic batches: the same seed gives every variant the same data."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.cardinalities = settings.cardinalities
        rng = np.random.default_rng(settings.seed + 1000)
        self.dense_weights = rng.normal(0.0, 0.4, NUM_DENSE)
        self.feature_strength = rng.uniform(0.2, 0.8, len(self.cardinalities))
        # scatter Zipf ranks over each feature's range, so the hot ids are not 0, 1, 2...
        self.scatter = [(int(rng.integers(1, n)) | 1, int(rng.integers(0, n))) for n in self.cardinalities]

    def _ids(self, rng: np.random.Generator, feature: int, size: int) -> np.ndarray:
        n = self.cardinalities[feature]
        ranks = (rng.zipf(ZIPF_EXPONENT, size) - 1) % n
        multiplier, shift = self.scatter[feature]
        if math.gcd(multiplier, n) != 1:
            multiplier = 1
        return (ranks.astype(np.int64) * multiplier + shift) % n

    def batch(self, index: int) -> Batch:
        """Batch ``index`` (training batches count from 0, evaluation ones from 10**6)."""
        size = self.settings.batch_size
        rng = np.random.default_rng([self.settings.seed, index])
        dense = rng.normal(0.0, 1.0, (size, NUM_DENSE))
        logit = dense @ self.dense_weights - 1.2
        values = []
        for f in range(len(self.cardinalities)):
            ids = self._ids(rng, f, size)
            logit = logit + self.feature_strength[f] * _id_scores(ids, f)
            values.append(ids)
        labels = rng.random(size) < 1.0 / (1.0 + np.exp(-logit))
        return Batch(
            torch.from_numpy(dense.astype(np.float32)),
            torch.from_numpy(np.concatenate(values)),
            torch.ones(size * len(self.cardinalities), dtype=torch.int64),
            torch.from_numpy(labels.astype(np.float32)),
        )


# ------------------------------------------------------------------------------------------ model


def _mlp(sizes: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DenseDLRM(nn.Module):
    """DLRM's dense part: bottom MLP 13 -> 64 -> d, dot interaction of the 27 vectors, top MLP -> 1."""

    def __init__(self, num_features: int, dim: int) -> None:
        super().__init__()
        self.bottom = _mlp([NUM_DENSE, 64, dim], last_relu=True)
        vectors = num_features + 1
        self.top = _mlp([dim + vectors * (vectors - 1) // 2, 128, 64, 1], last_relu=False)
        pairs = torch.triu_indices(vectors, vectors, offset=1)
        self.pair_rows: Tensor = pairs[0]
        self.pair_cols: Tensor = pairs[1]
        self.num_features, self.dim = num_features, dim

    def forward(self, dense: Tensor, pooled: Tensor) -> Tensor:
        """dense (B, 13), pooled (B, F * d) -> logits (B,)."""
        bottom = self.bottom(dense)
        vectors = torch.cat([bottom.unsqueeze(1), pooled.view(-1, self.num_features, self.dim)], dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.pair_rows, self.pair_cols]
        return self.top(torch.cat([bottom, dots], dim=1)).squeeze(1)


# ------------------------------------------------------------------------------------------ variants


@dataclass
class Embeddings:
    """What a variant gives the training loop: ``lookup(batch)`` -> pooled float32 (B, 26 * d) in key order
    (connected to autograd), ``step()`` the embedding optimizer after the backward, ``split()`` the (wall,
    CPU) seconds of the last backward that were its optimizer step when that ran inside the backward."""

    description: str
    lookup: Callable[[Batch], Tensor]
    step: Callable[[], None]
    split: Callable[[], tuple[float, float]] = lambda: (0.0, 0.0)
    keep: list[Any] = field(default_factory=list)  # modules and optimizers kept alive
    # Remote variants: pull the next batch's rows during this step (called right after ``lookup``), and
    # their own figures (requests and server time per step...) over the ``steps`` steps since last asked.
    prefetch: Callable[[Batch], None] | None = None
    extra: Callable[[int], dict[str, Any]] = lambda steps: {}


def _uniform_(tensor: Tensor, scale: float, seed: int) -> None:
    with torch.no_grad():
        tensor.uniform_(-scale, scale, generator=torch.Generator().manual_seed(seed))


def _one_bag_per_feature(
    name: str, bags: nn.ModuleList, optimizer: torch.optim.Optimizer, settings: Settings, keep: list[Any]
) -> Embeddings:
    """A variant with one bag module per feature (one id per bag) and a torch optimizer."""
    size = settings.batch_size

    def lookup(batch: Batch) -> Tensor:
        return torch.cat(
            [bag(batch.values[f * size : (f + 1) * size].view(size, 1)) for f, bag in enumerate(bags)], dim=1
        )

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Embeddings(name, lookup, step, keep=[*keep, bags, optimizer])


def full_tables(settings: Settings) -> Embeddings:
    dim = settings.embedding_dim
    bags = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum", sparse=True) for n in settings.cardinalities)
    for f, bag in enumerate(bags):
        _uniform_(bag.weight, settings.init_scale, f)  # type: ignore[arg-type]
    optimizer = torch.optim.Adagrad(bags.parameters(), lr=settings.embedding_lr)
    return _one_bag_per_feature(
        "26 x nn.EmbeddingBag(sparse=True) + torch Adagrad", bags, optimizer, settings, keep=[]
    )


def _torchrec_tables(settings: Settings) -> list[Any]:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    return [
        EmbeddingBagConfig(name=f"t{f}", num_embeddings=n, embedding_dim=settings.embedding_dim,
                           feature_names=[f"C{f + 1}"])
        for f, n in enumerate(settings.cardinalities)
    ]  # fmt: skip


def _kjt(batch: Batch) -> Any:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(keys=batch.keys, values=batch.values, lengths=batch.lengths)


def torchrec_ebc(settings: Settings) -> Embeddings:
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    ebc = EmbeddingBagCollection(_torchrec_tables(settings), device=torch.device("cpu"))
    for f, bag in enumerate(ebc.embedding_bags.values()):
        # torchrec builds dense-gradient bags (its trainers shard them); a dense (n, d) gradient of 6M rows
        # per step is no way to train on a CPU, so the bags are switched to sparse gradients
        bag.sparse = True
        _uniform_(bag.weight, settings.init_scale, f)
    optimizer = torch.optim.Adagrad(ebc.parameters(), lr=settings.embedding_lr)

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Embeddings(
        "torchrec EmbeddingBagCollection (bags sparse) + torch Adagrad",
        lambda batch: ebc(_kjt(batch)).values(),
        step,
        keep=[ebc, optimizer],
    )


def torchrec_fused(settings: Settings) -> Embeddings:
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

    ebc = FusedEmbeddingBagCollection(
        _torchrec_tables(settings),
        optimizer_type=torch.optim.Adagrad,
        optimizer_kwargs={"lr": settings.embedding_lr},
        device=torch.device("cpu"),
    )
    for f, (_, weight) in enumerate(ebc.named_parameters()):
        _uniform_(weight, settings.init_scale, f)
    return Embeddings(
        "torchrec FusedEmbeddingBagCollection (FBGEMM TBE, exact Adagrad in backward)",
        lambda batch: ebc(_kjt(batch)).values(),
        lambda: None,
        keep=[ebc],
    )


def robez_tables(settings: Settings) -> list[Any]:
    from robez_core import EmbeddingBagConfig

    return [
        EmbeddingBagConfig(f"t{f}", n, settings.embedding_dim, (f"C{f + 1}",), pooling="sum")
        for f, n in enumerate(settings.cardinalities)
    ]


def create_remote_tables(client: Any, settings: Settings) -> None:
    """The benchmark's tables on a robez server (one array, robez's Adagrad), as every remote run makes."""
    from robez_core import OptimizerConfig
    from service.client import RemoteEmbeddingBagCollection

    RemoteEmbeddingBagCollection.create_tables(
        client, robez_tables(settings), memory_size=settings.memory_size,
        optimizer=OptimizerConfig("adagrad", lr=settings.embedding_lr),
        chunk_size=settings.chunk_size, seed=1 + settings.seed, init_scale=settings.init_scale,
    )  # fmt: skip


def robez_per_feature(settings: Settings) -> Embeddings:
    from robez_core import RobezEmbeddingBagCollection

    # the collection only places the 26 tables on one array; the modules do the work, one per feature
    layout = RobezEmbeddingBagCollection(
        robez_tables(settings), settings.memory_size, chunk_size=settings.chunk_size,
        init_scale=settings.init_scale, seed=1 + settings.seed,
    )  # fmt: skip
    bags = nn.ModuleList(layout.feature_module(f"C{f + 1}", sparse=True) for f in range(26))
    optimizer = torch.optim.Adagrad([layout.weight], lr=settings.embedding_lr)
    return _one_bag_per_feature(
        f"26 x RobezEmbeddingBag on one array ({settings.memory_size * 4 / 1e6:.0f} MB) + torch Adagrad",
        bags,
        optimizer,
        settings,
        keep=[layout],
    )


def robez_collection(settings: Settings) -> Embeddings:
    from robez_core import OptimizerConfig, RobezEmbeddingBagCollection

    ebc = RobezEmbeddingBagCollection(
        robez_tables(settings), settings.memory_size, chunk_size=settings.chunk_size,
        init_scale=settings.init_scale, seed=1 + settings.seed,
        optimizer=OptimizerConfig("adagrad", lr=settings.embedding_lr),
    )  # fmt: skip
    return Embeddings(
        "RobezEmbeddingBagCollection, same array, robez's fused Adagrad in backward",
        lambda batch: ebc(keys=batch.keys, values=batch.values, lengths=batch.lengths).values(),
        lambda: None,
        split=lambda: (ebc.timings["optimizer"], ebc.cpu_timings["optimizer"]),
        keep=[ebc],
    )


VARIANTS: dict[str, Callable[[Settings], Embeddings]] = {
    "full": full_tables,
    "torchrec_ebc": torchrec_ebc,
    "torchrec_fused": torchrec_fused,
    "robez_per_feature": robez_per_feature,
    "robez_collection": robez_collection,
}
NEEDS_TORCHREC = {"torchrec_ebc", "torchrec_fused"}
# ---- remote variants: the service's RemoteEmbeddingBagCollection against a `robez serve` on this machine.
# The parent starts the server (``run_remote``: 127.0.0.1, no data dir, 1 kernel thread per worker),
# creates the 26 tables over one shared array as the local collection has them (same seed, init, Adagrad),
# and runs the trainer(s) in child processes that find it through REMOTE_URL_ENV.

REMOTE_URL_ENV = "ROBEZ_BENCH_URL"
REMOTE_WORKER_ENV = "ROBEZ_BENCH_WORKER"  # the server worker (pid) this trainer's connection should reach
REMOTE_WORKERS = {
    "remote_collection": 1, "remote_prefetch": 1, "remote_prefetch_after_push": 1,
    "remote_push_with_next_pull": 1, "remote_2_trainers": 2,
}  # fmt: skip
REMOTE_TRAINERS = {
    "remote_collection": 1, "remote_prefetch": 1, "remote_prefetch_after_push": 1,
    "remote_push_with_next_pull": 1, "remote_2_trainers": 2,
}  # fmt: skip
REMOTE_MEANS = {
    "requests_per_step", "server_ms_per_step", "pull_wait_ms_per_step", "push_wait_ms_per_step",
    "aggregate_samples_per_second", "server_rss_mib", "server_pss_mib",
}  # fmt: skip
_RECONNECTS = 50  # tries to reach the assigned worker (each a new connection: the kernel picks the worker)


def _remote(
    settings: Settings, *, prefetch: bool, after_push: bool = False, hold_push: bool = False
) -> Embeddings:
    from service.client import RemoteEmbeddingBagCollection, RobezClient

    client = RobezClient(os.environ[REMOTE_URL_ENV], timeout=300.0)
    wanted = os.environ.get(REMOTE_WORKER_ENV)
    tries = 0
    while wanted is not None and client.worker() != int(wanted) and tries < _RECONNECTS:
        client.reconnect()
        tries += 1
    worker = client.worker()
    # With prefetch the push does not block either (one in flight): the server applies step t's push
    # and pulls step t+2's rows while the trainer computes step t+1 (rows one step stale, as documented).
    # after_push: step t+1's pull goes with step t's push, one request (nothing stale; it overlaps only
    # the dense optimizer step). hold_push: no prefetch; step t's push is held until step t+1's forward
    # and sent with its pull (one request a step, nothing stale, nothing overlapped).
    ebc = RemoteEmbeddingBagCollection(
        client,
        robez_tables(settings),
        max_pending_pushes=1 if prefetch else 0,
        prefetch_after_push=after_push,
        push_with_next_pull=hold_push,
    )
    ebc.reset_stats()

    def extra(steps: int) -> dict[str, Any]:
        ebc.flush()  # after training: every push applied, a failed one raised
        stats = ebc.reset_stats()
        return {
            "requests_per_step": stats.requests / steps,
            "server_ms_per_step": stats.server_ms / steps,
            "pull_wait_ms_per_step": stats.pull_wait_ms / steps,
            "push_wait_ms_per_step": stats.push_wait_ms / steps,
            "server_worker": worker,
            "reached_assigned_worker": wanted is None or worker == int(wanted),
        }

    return Embeddings(
        "RemoteEmbeddingBagCollection, 1 server worker"
        + (", prefetch + 1 push in flight" if prefetch else "")
        + (", pull with the push" if after_push else "")
        + (", push held for the next pull" if hold_push else "")
        if os.environ.get(REMOTE_WORKER_ENV) is None
        else "RemoteEmbeddingBagCollection, trainer of 2 on 2 server workers",
        lambda batch: ebc(keys=batch.keys, values=batch.values, lengths=batch.lengths).values(),
        lambda: None,  # the server steps the tables; a push in flight is waited for by the next one
        prefetch=(
            (lambda batch: ebc.prefetch(keys=batch.keys, values=batch.values, lengths=batch.lengths))
            if prefetch
            else None
        ),
        extra=extra,
        keep=[ebc, client],
    )


VARIANTS["remote_collection"] = lambda settings: _remote(settings, prefetch=False)
VARIANTS["remote_prefetch"] = lambda settings: _remote(settings, prefetch=True)
VARIANTS["remote_prefetch_after_push"] = lambda settings: _remote(settings, prefetch=True, after_push=True)
VARIANTS["remote_push_with_next_pull"] = lambda settings: _remote(settings, prefetch=False, hold_push=True)
VARIANTS["remote_2_trainers"] = lambda settings: _remote(settings, prefetch=False)


def _pss_mib(pids: list[int]) -> float:
    """Proportional set size of ``pids``, summed (shared memory counted once across them)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as rollup:
                total += sum(int(line.split()[1]) for line in rollup if line.startswith("Pss:"))
        except OSError:
            continue
    return total / 1024


def _server_workers(url: str, wanted: int) -> list[int]:
    """Up to ``wanted`` distinct worker pids, each from a new connection's ``/healthz``."""
    import httpx

    pids: list[int] = []
    for _ in range(_RECONNECTS):
        pid = int(httpx.get(f"{url}/healthz", timeout=10.0).json()["pid"])
        if pid not in pids:
            pids.append(pid)
        if len(pids) == wanted:
            break
    return pids


def run_remote(name: str, settings: Settings) -> dict[str, Any]:
    """Start a server, create the tables, train ``REMOTE_TRAINERS[name]`` trainers at once in child
    processes; the first trainer's figures, with the others' and the server's memory added."""
    import tempfile

    from loadtest.server import start_server, stop_server, tree_pids, tree_rss_bytes
    from service.client import RobezClient

    workers, trainers = REMOTE_WORKERS[name], REMOTE_TRAINERS[name]
    env = {"ROBEZ_THREADS_PER_WORKER": "1", "ROBEZ_MAX_BODY_BYTES": str(256 << 20)}
    with tempfile.TemporaryDirectory(prefix="robez-dlrm-") as workdir:
        server = start_server(workers, None, Path(workdir), env=env)
        try:
            url = server.target.base_url
            with RobezClient(url, timeout=300.0) as client:
                create_remote_tables(client, settings)
            pids = _server_workers(url, trainers) if trainers > 1 else []
            children = []
            for index in range(trainers):
                child_env = {REMOTE_URL_ENV: url}
                if pids:
                    child_env[REMOTE_WORKER_ENV] = str(pids[index % len(pids)])
                child_settings = Settings(**{**asdict(settings), "data_offset": index * 10**5})
                children.append(_start_child(name, child_settings, child_env))
            results = [_finish_child(name, child) for child in children]
            server_rss = tree_rss_bytes(server.process.pid) / 2**20
            server_pss = _pss_mib(tree_pids(server.process.pid))
        finally:
            stop_server(server)
    first = results[0]
    first["server_rss_mib"], first["server_pss_mib"] = server_rss, server_pss
    first["trainers"] = [
        {k: r[k] for k in ("samples_per_second", "eval_loss", "median_seconds", "server_worker",
                           "reached_assigned_worker", "peak_rss_mib")}
        for r in results
    ]  # fmt: skip
    first["aggregate_samples_per_second"] = sum(r["samples_per_second"] for r in results)
    return first


# ------------------------------------------------------------------------------------------ one variant


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


CLOCKS = ("wall", "cpu")
PARTS = ("lookup", "dense", "backward", "optimizer", "step")
# variants whose optimizer step runs inside the backward without a split of its own
OPTIMIZER_IN_BACKWARD = {"torchrec_fused"}


def _now() -> tuple[float, float]:
    """(wall, this thread's CPU) seconds: on a shared machine a step's wall time includes waiting for a
    core; its CPU time is what it cost (1 thread: torch, numba and OpenMP all run in this one)."""
    return time.perf_counter(), time.thread_time()


def train(name: str, settings: Settings) -> dict[str, Any]:
    """Build variant ``name``, train it ``settings.steps`` steps, evaluate; the figures as a dict."""
    torch.set_num_threads(settings.threads)
    torch.manual_seed(settings.seed)
    data = SyntheticCriteo(settings)
    dense_model = DenseDLRM(len(settings.cardinalities), settings.embedding_dim)
    dense_optimizer = torch.optim.Adam(dense_model.parameters(), lr=settings.dense_lr)
    built = time.perf_counter()
    embeddings = VARIANTS[name](settings)
    build_seconds = time.perf_counter() - built
    loss_fn = nn.BCEWithLogitsLoss()
    # per clock ("wall": perf_counter, "cpu": this thread's CPU time), per part, one value a step
    parts: dict[str, dict[str, list[float]]] = {clock: {p: [] for p in PARTS} for clock in CLOCKS}
    losses = []
    # Every training batch made before the first step (~1 MB each): making one takes 16-21 ms, which
    # between two timed steps would be free time for a variant with requests in flight (a prefetch, a
    # push) and flatter it; so no untimed work runs between steps.
    batches = [data.batch(step + settings.data_offset) for step in range(settings.steps)]
    next_batch: Batch | None = None
    for step in range(settings.steps):
        if step == settings.warmup:
            embeddings.extra(max(step, 1))  # the variant's own figures count the timed steps only
        batch = next_batch if next_batch is not None else batches[step]
        prefetching = embeddings.prefetch is not None and step + 1 < settings.steps
        next_batch = batches[step + 1] if prefetching else None
        t0 = _now()
        pooled = embeddings.lookup(batch)
        if embeddings.prefetch is not None and next_batch is not None:
            embeddings.prefetch(next_batch)  # the same object the next step's lookup gets
        t1 = _now()
        rows = pooled.detach().requires_grad_(True)
        loss = loss_fn(dense_model(batch.dense, rows), batch.labels)
        dense_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        dense_optimizer.step()
        t2 = _now()
        pooled.backward(rows.grad)
        t3 = _now()
        embeddings.step()
        t4 = _now()
        split = embeddings.split()
        for c, clock in enumerate(CLOCKS):
            in_backward = split[c]
            for part, value in (
                ("lookup", t1[c] - t0[c]),
                ("dense", t2[c] - t1[c]),
                ("backward", t3[c] - t2[c] - in_backward),
                ("optimizer", t4[c] - t3[c] + in_backward),
                ("step", t4[c] - t0[c]),
            ):
                parts[clock][part].append(value)
        losses.append(float(loss.detach()))
        if (step + 1) % 20 == 0 or step + 1 == settings.steps:
            print(
                f"  {name}: step {step + 1}/{settings.steps}, {1e3 * (t4[0] - t0[0]):.1f} ms, "
                f"loss {losses[-1]:.4f}",
                file=sys.stderr,
                flush=True,
            )
    extra = embeddings.extra(settings.steps - settings.warmup)
    eval_losses = []
    with torch.no_grad():
        for i in range(settings.eval_batches):
            batch = data.batch(10**6 + i)
            eval_losses.append(
                float(loss_fn(dense_model(batch.dense, embeddings.lookup(batch)), batch.labels))
            )
    medians: dict[str, dict[str, float]] = {}
    for clock, by_part in parts.items():
        timed = {part: values[settings.warmup :] for part, values in by_part.items()}
        medians[clock] = {part: statistics.median(values) for part, values in timed.items()}
        embedding = [sum(v) for v in zip(timed["lookup"], timed["backward"], timed["optimizer"], strict=True)]
        medians[clock]["embedding"] = statistics.median(embedding)
    gc.collect()
    return {
        "name": name,
        "description": embeddings.description,
        "build_seconds": build_seconds,
        "median_seconds": medians,
        "samples_per_second": settings.batch_size / medians["wall"]["step"],
        "train_loss_last20": statistics.fmean(losses[-20:]),
        "eval_loss": statistics.fmean(eval_losses),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_mib": _rss_mib(),
        "optimizer_in_backward": name in OPTIMIZER_IN_BACKWARD,
        **extra,
    }


# ------------------------------------------------------------------------------------------ the run


def torchrec_available() -> str | None:
    """None when torchrec and its CPU fbgemm import, else why not."""
    try:
        import torchrec  # noqa: F401
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection  # noqa: F401
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def run_in_child(name: str, settings: Settings) -> dict[str, Any]:
    """Train one variant in a fresh process (its memory its own), 1 thread for torch, numba and OpenMP."""
    if name in REMOTE_TRAINERS:
        return run_remote(name, settings)
    return _finish_child(name, _start_child(name, settings, {}))


def _start_child(name: str, settings: Settings, env: dict[str, str]) -> subprocess.Popen[str]:
    threads = str(settings.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "NUMBA_NUM_THREADS": threads, **env}
    command = [
        sys.executable, "-m", "benchmarks.training.dlrm", "--worker", name,
        "--settings", json.dumps(asdict(settings)),
    ]  # fmt: skip
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)


def _finish_child(name: str, child: subprocess.Popen[str]) -> dict[str, Any]:
    stdout, _ = child.communicate()
    if child.returncode != 0:
        raise RuntimeError(f"variant {name} failed (exit {child.returncode})")
    return dict(json.loads(stdout.strip().splitlines()[-1]))


def combine(passes: list[dict[str, Any]], settings: Settings) -> dict[str, Any]:
    """One variant's passes as one result: times the mean of the passes' medians, the largest peak RSS,
    the first pass's eval loss (the same data and code give the same loss), each pass's wall step kept."""
    result = dict(passes[0])
    result["median_seconds"] = {
        clock: {part: statistics.fmean(p["median_seconds"][clock][part] for p in passes) for part in parts}
        for clock, parts in passes[0]["median_seconds"].items()
    }
    result["samples_per_second"] = settings.batch_size / result["median_seconds"]["wall"]["step"]
    result["peak_rss_mib"] = max(p["peak_rss_mib"] for p in passes)
    result["pass_wall_steps"] = [p["median_seconds"]["wall"]["step"] for p in passes]
    for key in REMOTE_MEANS & result.keys():  # a remote variant's own figures: the passes' mean
        result[key] = statistics.fmean(p[key] for p in passes)
    result["pass_eval_losses"] = [p["eval_loss"] for p in passes]
    return result


def goals(results: dict[str, dict[str, Any]]) -> list[str]:
    """The issue's local goals, as ratios of this run, by each clock."""
    lines = []
    coll, full, per = (results.get(k) for k in ("robez_collection", "full", "robez_per_feature"))
    for clock in CLOCKS:
        if coll and full:
            ratio = coll["median_seconds"][clock]["step"] / full["median_seconds"][clock]["step"]
            verdict = "met" if ratio <= 1.0 else "missed"
            lines.append(
                f"{clock}: collection step / full nn.EmbeddingBag step = {ratio:.2f} (goal <= 1.00): "
                f"{verdict}"
            )
        if coll and per:
            ratio = coll["median_seconds"][clock]["embedding"] / per["median_seconds"][clock]["embedding"]
            verdict = "met" if ratio <= 0.5 else "missed"
            lines.append(
                f"{clock}: collection embedding part / 26 RobezEmbeddingBag embedding part = {ratio:.2f} "
                f"(goal <= 0.50): {verdict}"
            )
    return lines + remote_goals(results)


def remote_goals(results: dict[str, dict[str, Any]]) -> list[str]:
    """The issue's remote goals, by the wall clock (the trainer thread's CPU time leaves out its request
    thread and the server, so it says nothing of a remote step)."""
    lines = []
    local = results.get("robez_collection")
    one, pre, two = (results.get(k) for k in ("remote_collection", "remote_prefetch", "remote_2_trainers"))
    fresh = results.get("remote_prefetch_after_push")
    held = results.get("remote_push_with_next_pull")
    for result, label, goal in (
        (one, "remote collection", 1.3),
        (held, "remote collection, push held for the next pull", 1.3),
        (pre, "remote collection + prefetch", 1.15),
        (fresh, "remote collection + prefetch after the push", 1.15),
    ):
        if result and local:
            ratio = result["median_seconds"]["wall"]["step"] / local["median_seconds"]["wall"]["step"]
            verdict = "met" if ratio <= goal else "missed"
            lines.append(
                f"wall: {label} step / local collection step = {ratio:.2f} (goal <= {goal}): {verdict}"
            )
    if pre and local:
        gap = abs(pre["eval_loss"] - local["eval_loss"])
        verdict = "met" if gap <= 0.002 else "missed"
        pair = f"|{pre['eval_loss']:.4f} - {local['eval_loss']:.4f}|"
        lines.append(f"eval loss, remote + prefetch vs local: {pair} = {gap:.4f} (goal <= 0.002): {verdict}")
    if fresh and local:
        same = "bit for bit the same" if fresh["eval_loss"] == local["eval_loss"] else "different"
        lines.append(
            f"eval loss, remote + prefetch after the push vs local: {same} ({fresh['eval_loss']:.6f})"
        )
    if one and local:
        same = "bit for bit the same" if one["eval_loss"] == local["eval_loss"] else "different"
        lines.append(f"eval loss, remote (no prefetch) vs local: {same} ({one['eval_loss']:.6f})")
    if held and local:
        same = "bit for bit the same" if held["eval_loss"] == local["eval_loss"] else "different"
        lines.append(
            f"eval loss, remote, push held for the next pull vs local: {same} ({held['eval_loss']:.6f})"
        )
    if two and one:
        ratio = two["aggregate_samples_per_second"] / one["samples_per_second"]
        verdict = "met" if ratio >= 1.4 else "missed"
        workers = sorted({t["server_worker"] for t in two["trainers"]})
        lines.append(
            f"2 trainers on 2 workers (pids {workers}) / 1 trainer samples/s = {ratio:.2f} "
            f"(goal >= 1.4): {verdict}"
        )
    for result in (one, held, pre, fresh):
        if result:
            lines.append(f"{result['name']}: {result['requests_per_step']:.2f} requests per step (goal <= 2)")
    return lines


def remote_rows(results: dict[str, dict[str, Any]], batch_size: int) -> list[str]:
    """The remote variants' own table: wall-clock split, requests, server time, memory."""
    remote = [r for n, r in results.items() if n in REMOTE_TRAINERS]
    if not remote:
        return []
    lines = [
        "### Remote collection (wall clock, medians, ms; the server on this machine)",
        "",
        "| variant | step | samples/s | lookup (pull wait) | dense | emb backward (push wait) "
        "| requests/step | server ms/step | eval loss | trainer peak RSS | server RSS / PSS |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in remote:
        m = {k: 1e3 * v for k, v in r["median_seconds"]["wall"].items()}
        trainers = r.get("trainers", [r])
        rate = f"{batch_size / m['step']:.1f}k"  # m is in ms: samples per ms = thousands per second
        if len(trainers) > 1:
            rate = " + ".join(f"{t['samples_per_second'] / 1e3:.1f}k" for t in trainers)
            rate += f" = {r['aggregate_samples_per_second'] / 1e3:.1f}k"
        losses = " / ".join(f"{t['eval_loss']:.4f}" for t in trainers)
        pull, push = r["pull_wait_ms_per_step"], r["push_wait_ms_per_step"]
        server_memory = f"{r['server_rss_mib'] / 1024:.2f} / {r['server_pss_mib'] / 1024:.2f} GiB"
        lines.append(
            f"| {r['description']} | {m['step']:.1f} | {rate} | {m['lookup']:.1f} ({pull:.1f}) "
            f"| {m['dense']:.1f} | {m['backward'] + m['optimizer']:.1f} ({push:.1f}) "
            f"| {r['requests_per_step']:.2f} | {r['server_ms_per_step']:.1f} | {losses} "
            f"| {r['peak_rss_mib'] / 1024:.2f} GiB | {server_memory} |"
        )
    lines += [
        "",
        "Pull and push waits are per-step means of the time the trainer's thread waited for the server's "
        "answer (a prefetched pull waits ~0); server ms/step is the sum of the requests' `Server-Timing` "
        "totals. The server's RSS counts its shared-memory tables once per process (supervisor and "
        "workers); PSS counts them once.",
        "",
    ]
    return lines


def write_report(
    results: dict[str, dict[str, Any]],
    skipped: dict[str, str],
    settings: Settings,
    command: str,
    load: tuple[tuple[float, ...], tuple[float, ...]],
    output_dir: Path,
    quick: bool,
) -> Path:
    from robez_core.hostinfo import machine_facts

    now = dt.datetime.now(dt.UTC)
    stem = f"dlrm-{now:%Y-%m-%d}" + ("-quick" if quick else "")
    output_dir.mkdir(parents=True, exist_ok=True)
    png = output_dir / f"{stem}.png"
    plotted = plot(results, png)
    lines = [
        f"# DLRM-shaped training, embeddings held five ways ({now:%Y-%m-%d %H:%M} UTC)",
        "",
        f"Command: `{command}` (each variant in its own process, one after the other).",
        "",
        f"Sizes: batch {settings.batch_size}, d = {settings.embedding_dim}, 26 features with the "
        f"Criteo-Kaggle cardinalities capped at {settings.cardinality_cap:,} "
        f"(sum {sum(settings.cardinalities):,} rows), "
        f"Zipf({ZIPF_EXPONENT}) ids; ROBE-Z array {settings.memory_size:,} floats "
        f"({settings.memory_size * 4 / 1e6:.0f} MB, {settings.compression}x), Z = {settings.chunk_size}; "
        f"{settings.steps} steps, medians of the last {settings.steps - settings.warmup}; eval loss over "
        f"{settings.eval_batches} held-out batches; {settings.threads} thread(s) (torch, numba, OpenMP). "
        f"The {settings.steps} training batches are made before the first step (no untimed work between "
        "steps while a variant's requests are in flight); the trainer's peak RSS includes them (~1 MB "
        "each).",
        f"Load average before / after: {load[0]} / {load[1]}.",
        "",
    ]
    for clock, title in (("wall", "Wall clock"), ("cpu", "CPU time of the trainer thread")):
        lines += [
            f"### {title} (medians, ms)",
            "",
            "| variant | step | samples/s | lookup | dense fwd+bwd+step | emb backward | emb optimizer "
            "| embedding part | eval loss | peak RSS |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in results.values():
            m = {k: 1e3 * v for k, v in r["median_seconds"][clock].items()}
            optimizer = "(in backward)" if r["optimizer_in_backward"] else f"{m['optimizer']:.1f}"
            lines.append(
                f"| {r['description']} | {m['step']:.1f} | {settings.batch_size / m['step']:.1f}k "
                f"| {m['lookup']:.1f} | {m['dense']:.1f} | {m['backward']:.1f} | {optimizer} "
                f"| {m['embedding']:.1f} | {r['eval_loss']:.4f} | {r['peak_rss_mib'] / 1024:.2f} GiB |"
            )
        lines.append("")
    passes = max((len(r["pass_wall_steps"]) for r in results.values()), default=0)
    lines += [
        f"Each time is the mean over {passes} passes (every other "
        "one in reverse order) of the pass's median. Wall ms/step per pass, and eval loss per pass:",
        "",
    ]
    lines += [
        f"- {r['description']}: "
        + " / ".join(f"{1e3 * v:.1f}" for v in r["pass_wall_steps"])
        + "; eval loss "
        + " / ".join(f"{v:.4f}" for v in r["pass_eval_losses"])
        for r in results.values()
    ]
    lines += ["", *remote_rows(results, settings.batch_size)]
    lines += ["Goals (issue 37), by both clocks where they mean something:", ""]
    lines += [f"- {line}" for line in goals(results)] or ["- (not all variants ran)"]
    if skipped:
        lines += ["", "Skipped:", ""] + [f"- {name}: {why}" for name, why in skipped.items()]
    if plotted:
        lines += ["", f"![step split]({png.name})"]
    lines += ["", "## Machine", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in machine_facts().items()]
    path = output_dir / f"{stem}.md"
    path.write_text("\n".join(lines) + "\n")
    (output_dir / f"{stem}.json").write_text(
        json.dumps({"settings": asdict(settings), "results": results}, indent=1)
    )
    return path


def plot(results: dict[str, dict[str, Any]], path: Path) -> bool:
    """Stacked bars of each variant's step split; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(results)
    fig, ax = plt.subplots(figsize=(9, 4.5 + 0.3 * max(0, len(names) - 5)))
    bottom = np.zeros(len(names))
    for part, label in (
        ("lookup", "lookup"),
        ("dense", "dense fwd+bwd+step"),
        ("backward", "embedding backward"),
        ("optimizer", "embedding optimizer"),
    ):
        # remote variants by the wall clock: their work is on the server and a second thread
        heights = np.array(
            [
                1e3 * results[n]["median_seconds"]["wall" if n in REMOTE_TRAINERS else "cpu"][part]
                for n in names
            ]
        )
        ax.barh(names, heights, left=bottom, label=label)
        bottom += heights
    for i, n in enumerate(names):
        ax.text(bottom[i], i, f" {results[n]['samples_per_second'] / 1e3:.1f}k samples/s", va="center")
    ax.set_xlabel(
        "CPU ms per training step (median, 1 thread; remote_*: wall ms, the server's share in the waits); "
        "label: wall-clock samples/s",
        fontsize=8,
    )
    ax.set_xlim(0, bottom.max() * 1.35)
    ax.invert_yaxis()
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("DLRM-shaped training step, split by part")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI sizes (batch 256, cardinalities <= 20k)")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated, from: " + ", ".join(VARIANTS)
    )
    parser.add_argument("--steps", type=int, help="training steps (default 120, quick 14)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="passes over the variants, every other one reversed (default 2)",
    )
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        settings = Settings(**json.loads(args.settings))
        print(json.dumps(train(args.worker, settings)))
        return 0
    settings = QUICK if args.quick else Settings()
    if args.steps:
        settings = Settings(
            **{**asdict(settings), "steps": args.steps, "warmup": min(settings.warmup, args.steps // 4)}
        )
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    skipped: dict[str, str] = {}
    why = torchrec_available()
    if why is not None:
        for n in names:
            if n in NEEDS_TORCHREC:
                skipped[n] = (
                    f"torchrec is not installed (the `torchrec` extra, see benchmarks/README.md): {why}"
                )
                print(f"skipping {n}: {skipped[n]}", file=sys.stderr)
    load_before = os.getloadavg()
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names if n not in skipped}
    for repeat in range(args.repeats):
        # every other pass in reverse order, so a drift in the machine's load favours no variant
        order = list(runs) if repeat % 2 == 0 else list(reversed(runs))
        for n in order:
            print(
                f"{n} (pass {repeat + 1}/{args.repeats}): training {settings.steps} steps of "
                f"{settings.batch_size}...",
                file=sys.stderr,
                flush=True,
            )
            r = run_in_child(n, settings)
            runs[n].append(r)
            print(
                f"{n}: {1e3 * r['median_seconds']['wall']['step']:.1f} ms/step, "
                f"{r['samples_per_second']:.0f} samples/s, "
                f"eval loss {r['eval_loss']:.4f}, peak RSS {r['peak_rss_mib']:.0f} MiB",
                file=sys.stderr,
                flush=True,
            )
    results = {n: combine(passes, settings) for n, passes in runs.items()}
    command = "python -m benchmarks.training.dlrm " + " ".join(sys.argv[1:] if argv is None else argv)
    path = write_report(results, skipped, settings, command.strip(), (load_before, os.getloadavg()),
                        args.output_dir, args.quick)  # fmt: skip
    for line in goals(results):
        print(line)
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
