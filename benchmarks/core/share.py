"""The embedding share's yardsticks, timed beside the share itself in ``paper_tables``' alternating rounds.

- :func:`memory_floor_runner`: the time a plain memory copy (``numpy.copyto``: glibc's ``memcpy``) takes to
  move the bytes the fused share has to move at least once per step: both lookups' (N, d) float32 rows
  written and their (N, d) output gradients read (two copies of N x d floats), and the array's (m,)
  float32 gradient, the array and Adam's two moment arrays each read and written (four copies of m
  floats). No kernel that writes the rows and reads their gradients can beat it by much, so fused share
  / floor says how far the kernels are from the memory system's limit, and reference share / floor is
  the best ratio any kernel could reach against the reference on that machine.
- :func:`timed_calls`: wraps named functions (the kernels and buffer calls the fused path makes) for one
  instrumented round, so the share is split into hash, gather, dense-gradient zeroing and scatter on the
  real code path, whatever calls it makes, beside the share's optimizer step (``Adam(fused=True)``);
  the rest of the share (autograd, its sum of the two dense gradients, Python) is the share's median
  minus the pieces' and the step's.
- :func:`trivial_offsets`: within the block, the fused lookups still hash their ids but then read every
  row from, and add its gradient to, the array's first ``embedding_dim`` floats: the share's random
  accesses made as cheap as they can be (L1-resident), while the rows are written, their gradients read
  and Adam steps the array as before. What the share takes then bounds what faster table accesses could
  gain; the rest is the streaming of rows and gradients, the optimizer step and the fixed costs.
- :func:`prefetch_comparison` (``python -m benchmarks.core.share --prefetch [--emulate-avx2]``): the
  share stepped under several settings of the kernels' prefetch thresholds in turn, the evidence for the
  thresholds in ``robez_core/kernels/__init__.py``.
- :func:`adam_comparison` (``python -m benchmarks.core.share --adam [--emulate-avx2]``): the fused share
  stepped with torch's default ``torch.optim.Adam`` and with ``torch.optim.Adam(fused=True)`` in turn, the
  evidence for training the array (and stepping the bench's fused rows) with ``fused=True``.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "FloorReading",
    "PieceTimings",
    "adam_comparison",
    "adam_reading",
    "memory_floor_runner",
    "timed_calls",
    "timed_share_step",
    "trivial_offsets",
]


def memory_floor_runner(
    output_grads: Sequence[Tensor], memory_size: int, steps: int
) -> Callable[[], list[tuple[float, float]]]:
    """A function that returns ``steps - 1`` timings (s) of copying the share's minimum traffic once:
    (the two row-sized copies, all of it).

    Sources are the share's own output gradients (read) into buffers shaped like its rows (written),
    then four (m,) float32 arrays into four others; the first step of a round is dropped, as the share's.
    """
    sources = [grad.detach().contiguous().numpy() for grad in output_grads]
    rows = [np.empty_like(source) for source in sources]
    rng = np.random.default_rng(0)
    arrays = [
        (np.empty(memory_size, np.float32), rng.random(memory_size, dtype=np.float32)) for _ in range(4)
    ]
    for destination, source in zip(rows, sources, strict=True):
        np.copyto(destination, source)  # touch every page once: the share's buffers are mapped too
    for destination, source in arrays:
        np.copyto(destination, source)

    def run() -> list[tuple[float, float]]:
        timings = []
        for _ in range(steps):
            start = time.perf_counter()
            for destination, source in zip(rows, sources, strict=True):
                np.copyto(destination, source)
            rows_done = time.perf_counter()
            for destination, source in arrays:
                np.copyto(destination, source)
            timings.append((rows_done - start, time.perf_counter() - start))
        return timings[1:]

    return run


@contextlib.contextmanager
def timed_calls(targets: dict[str, tuple[Any, str]]) -> Iterator[dict[str, list[float]]]:
    """Within the block, every call of ``getattr(owner, attribute)`` for each ``name: (owner, attribute)``
    appends its duration (s) to ``durations[name]``; the originals are put back on exit."""
    durations: dict[str, list[float]] = {name: [] for name in targets}
    originals = {name: getattr(owner, attribute) for name, (owner, attribute) in targets.items()}

    def timed(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        record = durations[name].append

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                record(time.perf_counter() - start)

        return wrapper

    try:
        for name, (owner, attribute) in targets.items():
            setattr(owner, attribute, timed(name, originals[name]))
        yield durations
    finally:
        for name, (owner, attribute) in targets.items():
            setattr(owner, attribute, originals[name])


def timed_share_step(
    embedding: Any, optimizer: Any, pairs: Tensor, output_grads: tuple[Tensor, Tensor]
) -> tuple[float, float, tuple[Tensor, Tensor]]:
    """One embedding share, the region every share timing here and in ``bench`` measures: both lookups
    of the id pairs, their backward fed ``output_grads`` (so none of the model's ops run) and
    ``optimizer.step()``. Returns the seconds of the whole share and of its step, and the rows, which the
    caller keeps until the next step has allocated its own, as in training."""
    start = time.perf_counter()
    rows = (embedding(pairs[:, 0]), embedding(pairs[:, 1]))
    torch.autograd.backward(rows, output_grads)
    stepping = time.perf_counter()
    optimizer.step()
    end = time.perf_counter()
    return end - start, end - stepping, rows


@contextlib.contextmanager
def trivial_offsets() -> Iterator[None]:
    """Within the block, ``kernels.chunk_offsets`` hashes as usual, then answers chunk c of every row at
    offset c * Z: each row is read from the array's first d floats and its gradient added back there.
    The offsets are the same shape and dtype as the hashed ones, so every kernel after the hash runs its
    usual path; they are built once per shape (read-only to every caller), so that making them costs the
    timed share nothing the hashed one does not pay. The original is put back on exit."""
    from robez_core import kernels

    original = kernels.chunk_offsets
    built: dict[tuple[int, int, int, int], Tensor] = {}

    def chunk_offsets(
        ids: Tensor, num_chunks: int, chunk_size: int, memory_size: int, *args: Any, **kwargs: Any
    ) -> Tensor:
        hashed = original(ids, num_chunks, chunk_size, memory_size, *args, **kwargs)
        key = (hashed.shape[0], num_chunks, chunk_size, memory_size)
        if key not in built:
            starts = torch.arange(num_chunks, dtype=torch.int64) * chunk_size
            built[key] = starts.clamp(max=memory_size - chunk_size).expand(key[0], num_chunks).contiguous()
        return built[key]

    kernels.chunk_offsets = chunk_offsets
    try:
        yield
    finally:
        kernels.chunk_offsets = original


@dataclass(frozen=True)
class PieceTimings:
    """Median ms per step of each piece of the fused share (summed over the calls of a step)."""

    pieces: dict[str, float]
    adam_ms: float

    @classmethod
    def from_durations(cls, durations: dict[str, list[float]], steps: int, adam_ms: float) -> PieceTimings:
        """Per-call durations -> median per step: the calls of a step are consecutive in each list."""
        pieces = {}
        for name, values in durations.items():
            if not values or len(values) % steps:
                continue  # a piece this path does not call (or calls unevenly) is left out
            per_step = len(values) // steps
            sums = [sum(values[i * per_step : (i + 1) * per_step]) for i in range(steps)]
            pieces[f"{name} x{per_step}" if per_step > 1 else name] = 1e3 * statistics.median(sums)
        return cls(pieces, adam_ms)

    def reading(self, share_ms: float) -> str:
        listed = ", ".join(f"{name} {ms:.2f}" for name, ms in self.pieces.items())
        rest = share_ms - sum(self.pieces.values()) - self.adam_ms
        return (
            f"Where the fused share's {share_ms:.2f} ms go (median ms per step, one instrumented round per "
            f"alternating round): {listed}, Adam(fused=True)'s step {self.adam_ms:.2f}; the rest "
            f"(autograd, its sum of the two dense gradients, Python) {rest:.2f}."
        )


@dataclass(frozen=True)
class FloorReading:
    """The share against the memory floor measured in the same rounds."""

    floor_ms: float
    rows_floor_ms: float  # the part of the floor that copies the rows / output gradients
    reference_ms: float
    fused_ms: float
    adam_ms: float
    goal: float

    def reading(self, batch_size: int, embedding_dim: int, memory_size: int) -> str:
        rows_mb = batch_size * embedding_dim * 4 / 1e6
        best = self.reference_ms / (self.rows_floor_ms + self.adam_ms)
        reach = "within reach at that floor" if best >= self.goal else "out of reach even at that floor"
        return (
            f"Memory floor of the share: copying its minimum traffic once (numpy.copyto, in the same "
            f"alternating rounds) took {self.floor_ms:.2f} ms: two {batch_size} x {embedding_dim} float32 "
            f"copies ({rows_mb:.1f} MB each: the rows written, their gradients read) "
            f"{self.rows_floor_ms:.2f} ms, four of {memory_size} floats (dense gradient, array, Adam's two "
            f"moments) {self.floor_ms - self.rows_floor_ms:.2f} ms. The fused share took "
            f"{self.fused_ms / self.floor_ms:.2f}x the floor. Best ratio any kernel could reach against the "
            f"reference's {self.reference_ms:.2f} ms: {self.reference_ms / self.floor_ms:.1f}x if the whole "
            f"share ran at the floor, {best:.1f}x with lookups and backward at the rows' floor and the "
            f"share's Adam(fused=True) step as measured ({self.adam_ms:.2f} ms), so the {self.goal:.0f}x "
            f"goal is {reach}."
        )


# --------------------------------------------------------------------------------------------------
# variants of the share (kernel thresholds, optimizers), judged in the training loop


@dataclass(frozen=True)
class _PairedShares:
    """Seconds of each kept share and of its ``optimizer.step()``, per variant, and the tables stepped."""

    shares: dict[str, list[float]]
    steps: dict[str, list[float]]
    tables: list[Any]

    def medians(self, base: str) -> dict[str, tuple[float, float, float]]:
        """Per variant: median ms of the share, median of its share / ``base``'s share of the same batch
        (the paired ratio), median ms of its step."""
        base_shares = np.asarray(self.shares[base])
        return {
            name: (
                1e3 * float(np.median(values)),
                float(np.median(np.asarray(values) / base_shares)),
                1e3 * float(np.median(self.steps[name])),
            )
            for name, values in self.shares.items()
        }


def _paired_shares(
    memory_size: int,
    variants: Sequence[str],
    optimizers_for: Callable[[Any], dict[str, Any]],
    set_variant: Callable[[str], None],
    *,
    batch_size: int,
    embedding_dim: int,
    chunk_size: int,
    num_embeddings: int,
    rounds: int,
    seed: int,
) -> _PairedShares:
    """The fused embedding share (two lookups, their backward, ``optimizer.step()``) stepped with each
    variant in turn on the same batches, so that load changes hit all alike. One table per variant, each
    with the optimizer of every variant (``optimizers_for``), and each round hands the variants the next
    table in turn, so where an array and its state sit in memory does not follow one variant.
    ``set_variant(name)`` runs before each of its steps, untimed. The first round warms up (compilation,
    pool, caches) and is not kept."""
    import torch

    from robez_core.modules import RobezEmbedding

    generator = torch.Generator().manual_seed(seed)
    shape = (batch_size, embedding_dim)
    grads = (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
    batches = [torch.randint(0, num_embeddings, (batch_size, 2), generator=generator) for _ in range(8)]
    tables = []
    for _ in variants:
        table = RobezEmbedding(num_embeddings, embedding_dim, memory_size=memory_size, chunk_size=chunk_size)
        tables.append((table, optimizers_for(table)))
    shares: dict[str, list[float]] = {name: [] for name in variants}
    steps: dict[str, list[float]] = {name: [] for name in variants}
    kept = {}
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for round_index in range(rounds):
            for pairs in batches:
                for index, name in enumerate(variants):
                    set_variant(name)
                    table, optimizers = tables[(index + round_index) % len(tables)]
                    optimizer = optimizers[name]
                    optimizer.zero_grad(set_to_none=True)
                    share, step, kept[name] = timed_share_step(table, optimizer, pairs, grads)
                    if round_index:
                        shares[name].append(share)
                        steps[name].append(step)
    finally:
        torch.set_num_threads(previous_threads)
    return _PairedShares(shares, steps, [table for table, _ in tables])


def prefetch_comparison(
    memory_size: int,
    *,
    batch_size: int = 32_768,
    embedding_dim: int = 100,
    chunk_size: int = 32,
    num_embeddings: int = 1_000_000,
    rounds: int = 15,
    seed: int = 0,
) -> dict[str, tuple[float, float]]:
    """The embedding share (two lookups, their backward, torch's default Adam) of one table per variant of
    the kernels' prefetch thresholds, stepped in turn so that load changes hit all alike: per variant the
    median ms and the median of its step / the default's step of the same batch (paired ratio).

    Variants: the thresholds as they are, no sequential pass over a small table before a gather
    (``_WARM_TABLE_RATIO``), no write (dense backward) prefetch at any size, read (gather) prefetch at any
    size. Neither prefetching nor the pass changes a value, so the tables stay
    bit-identical whatever ran them, and each round hands the variants the next table in turn: where an
    array or its pooled buffers happen to sit in memory does not follow one variant.
    """
    import torch

    from robez_core import kernels

    never = 1 << 62
    variants: dict[str, dict[str, int]] = {
        "thresholds as set": {},
        "no table pass": {"_WARM_TABLE_RATIO": never},
        "write never": {"_PREFETCH_WRITE_MIN_BYTES": never},
        "read always": {"_PREFETCH_READ_MIN_BYTES": 0},
    }
    as_set = {name: getattr(kernels, name) for settings in variants.values() for name in settings}

    def set_variant(name: str) -> None:
        for attribute, value in (as_set | variants[name]).items():
            setattr(kernels, attribute, value)

    def one_adam(table: Any) -> dict[str, Any]:
        return dict.fromkeys(variants, torch.optim.Adam(table.parameters(), lr=1e-3))

    try:
        paired = _paired_shares(
            memory_size,
            list(variants),
            one_adam,
            set_variant,
            batch_size=batch_size,
            embedding_dim=embedding_dim,
            chunk_size=chunk_size,
            num_embeddings=num_embeddings,
            rounds=rounds,
            seed=seed,
        )
    finally:
        for attribute, value in as_set.items():
            setattr(kernels, attribute, value)
    reference = paired.tables[0].weight
    if not all(torch.equal(table.weight, reference) for table in paired.tables):
        raise AssertionError("prefetching changed the trained array")
    return {
        name: (median_ms, ratio)
        for name, (median_ms, ratio, _) in paired.medians("thresholds as set").items()
    }


ADAM_VARIANTS = ("torch.optim.Adam", "torch.optim.Adam(fused=True)")  # the last is the paired base


def adam_comparison(
    memory_size: int,
    *,
    batch_size: int = 32_768,
    embedding_dim: int = 100,
    chunk_size: int = 32,
    num_embeddings: int = 1_000_000,
    rounds: int = 15,
    seed: int = 0,
    lr: float = 1e-3,
) -> dict[str, tuple[float, float, float]]:
    """The fused embedding share (two lookups, their backward, the optimizer's step over the array) with
    each optimizer of ``ADAM_VARIANTS``, stepped in turn on the same batches so that load changes hit both
    alike: per variant the median ms of the share, the median of its share / the ``fused=True`` share of
    the same batch (paired ratio) and the median ms of its ``optimizer.step()`` alone.

    Every table has an optimizer of each kind, and each round hands the variants the next table in turn,
    so where an array and its state sit in memory does not follow one variant.
    """
    import torch

    def both_adams(table: Any) -> dict[str, Any]:
        return {
            variant: torch.optim.Adam(table.parameters(), lr=lr, fused=variant.endswith("(fused=True)"))
            for variant in ADAM_VARIANTS
        }

    paired = _paired_shares(
        memory_size,
        ADAM_VARIANTS,
        both_adams,
        lambda _: None,
        batch_size=batch_size,
        embedding_dim=embedding_dim,
        chunk_size=chunk_size,
        num_embeddings=num_embeddings,
        rounds=rounds,
        seed=seed,
    )
    return paired.medians(ADAM_VARIANTS[-1])


def adam_reading(results: dict[str, tuple[float, float, float]]) -> str:
    """What ``adam_comparison``'s figures say, from the figures: the share with ``fused=True`` against
    the share with torch's default Adam."""
    default, one_pass = ADAM_VARIANTS
    default_share, ratio, default_step = results[default]
    fused_share, _, fused_step = results[one_pass]
    change = 100 * (1 - 1 / ratio)
    return (
        f"{one_pass}'s step took {fused_step:.3f} ms, the default's {default_step:.3f} ms "
        f"({default_step / fused_step:.2f}x); the share with fused=True is {abs(change):.1f}% "
        f"{'shorter' if change >= 0 else 'longer'} per batch (paired: default / fused=True = {ratio:.3f}; "
        f"{fused_share - default_share:+.3f} ms at the medians)."
    )


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    import os
    import sys

    parser = argparse.ArgumentParser(prog="python -m benchmarks.core.share", description=__doc__)
    parser.add_argument(
        "--prefetch", action="store_true", help="compare the prefetch thresholds and the table pass"
    )
    parser.add_argument(
        "--adam", action="store_true", help="compare torch.optim.Adam's default and fused=True steps"
    )
    parser.add_argument("--memory-sizes", type=int, nargs="+", default=[262_144])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--emulate-avx2", action="store_true", help="as python -m benchmarks.core.paper_tables"
    )
    args = parser.parse_args(argv)
    if not (args.prefetch or args.adam):
        parser.error("nothing to do: pass --prefetch and/or --adam")
    from benchmarks.common import EMULATION_MARK, avx2_emulation_env
    from robez_core.hostinfo import load_average, machine_facts

    given = list(sys.argv[1:] if argv is None else argv)
    if args.emulate_avx2 and os.environ.get(EMULATION_MARK) != "avx2":
        os.execve(
            sys.executable,
            [sys.executable, "-m", "benchmarks.core.share", *given],
            {**os.environ, **avx2_emulation_env()},
        )
    load_before = load_average()
    print(f"python -m benchmarks.core.share {' '.join(given)}")
    for key, value in machine_facts().items():
        print(f"{key}: {value}")
    for memory_size in args.memory_sizes if args.prefetch else ():
        print(f"\nm = {memory_size}: embedding share per step, 1 thread, {args.rounds - 1} x 8 paired steps")
        for name, (median_ms, ratio) in prefetch_comparison(memory_size, rounds=args.rounds).items():
            print(
                f"  {name:18s} median {median_ms:7.3f} ms   paired ratio to the thresholds as set {ratio:.3f}"
            )
    for memory_size in args.memory_sizes if args.adam else ():
        print(
            f"\nm = {memory_size}: fused embedding share per step by optimizer, 1 thread, "
            f"{args.rounds - 1} x 8 paired steps"
        )
        results = adam_comparison(memory_size, rounds=args.rounds)
        for name, (median_ms, ratio, step_ms) in results.items():
            print(
                f"  {name:28s} share median {median_ms:7.3f} ms   paired ratio to fused=True {ratio:.3f}   "
                f"optimizer.step() median {step_ms:6.3f} ms"
            )
        print(f"  reading: {adam_reading(results)}")
    load_after = load_average()
    print(
        "\nload average (1/5/15 min): before "
        + " ".join(f"{x:.2f}" for x in load_before)
        + ", after "
        + " ".join(f"{x:.2f}" for x in load_after)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
