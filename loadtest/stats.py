"""Statistics of a load-test run: percentiles, rates, and the skewed id sampler.

Latencies are kept as every individual sample (runs are bounded in request count), so percentiles are
exact order statistics rather than histogram estimates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)


def percentile(samples: Sequence[float] | np.ndarray, q: float) -> float:
    """The q-th percentile (0 <= q <= 100) by linear interpolation between order statistics.

    Same definition as ``numpy.percentile(..., method="linear")``: with the n samples sorted, rank
    ``q / 100 * (n - 1)`` is interpolated between its two neighbours. NaN for no samples.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    values = np.sort(np.asarray(samples, dtype=np.float64))
    if values.size == 0:
        return math.nan
    rank = q / 100.0 * (values.size - 1)
    below = math.floor(rank)
    above = min(below + 1, values.size - 1)
    fraction = rank - below
    return float(values[below] + (values[above] - values[below]) * fraction)


def rate(count: float, seconds: float) -> float:
    """Events per second; 0 for an empty window (a run that never started has no rate)."""
    if seconds <= 0.0:
        return 0.0
    return count / seconds


@dataclass(frozen=True)
class Summary:
    """Order statistics of one sample set (same unit as the samples; NaN when empty)."""

    count: int
    p50: float
    p90: float
    p99: float
    max: float
    mean: float

    @classmethod
    def of(cls, samples: Sequence[float] | np.ndarray) -> Summary:
        """Summarise finite samples; NaN entries (for example a missing Server-Timing metric) are skipped."""
        values = np.asarray(samples, dtype=np.float64)
        values = values[np.isfinite(values)]
        if values.size == 0:
            return cls(0, math.nan, math.nan, math.nan, math.nan, math.nan)
        return cls(
            count=int(values.size),
            p50=percentile(values, 50.0),
            p90=percentile(values, 90.0),
            p99=percentile(values, 99.0),
            max=float(values.max()),
            mean=float(values.mean()),
        )


class ZipfSampler:
    """Draws ids in ``[0, num_ids)`` with P(rank r) proportional to ``1 / r**exponent``.

    Real embedding traffic is skewed: a few ids are most of the lookups. The rank -> id map is a fixed
    random permutation, so the hot ids are scattered over the id space rather than being 0, 1, 2, ...
    Sampling inverts the exact cumulative distribution (8 bytes per id of memory), so any exponent >= 0
    works, including the common s ~ 1 where ``numpy.random.zipf`` (s > 1, unbounded) does not.
    """

    MAX_IDS = 1 << 24  # 128 MiB of cumulative weights; larger id spaces use the uniform sampler

    def __init__(self, num_ids: int, exponent: float, seed: int) -> None:
        if not 1 <= num_ids <= self.MAX_IDS:
            raise ValueError(f"num_ids must be in [1, {self.MAX_IDS}], got {num_ids}")
        if not exponent >= 0.0:
            raise ValueError(f"exponent must be >= 0, got {exponent}")
        self.num_ids = num_ids
        self.exponent = exponent
        self._rng = np.random.default_rng(seed)
        weights = np.arange(1, num_ids + 1, dtype=np.float64) ** -exponent
        cumulative = np.cumsum(weights)
        self._cumulative = cumulative / cumulative[-1]
        self._rank_to_id = self._rng.permutation(num_ids).astype(np.int64)

    def sample(self, size: int) -> np.ndarray:
        """int64 (size,) ids, each in ``[0, num_ids)``."""
        uniforms = self._rng.random(size)
        ranks = np.searchsorted(self._cumulative, uniforms, side="right")
        # a uniform that rounds to exactly the last cumulative value would index one past the end
        np.minimum(ranks, self.num_ids - 1, out=ranks)
        return self._rank_to_id[ranks]


class UniformSampler:
    """Draws ids uniformly in ``[0, num_ids)`` (int64)."""

    def __init__(self, num_ids: int, seed: int) -> None:
        if num_ids < 1:
            raise ValueError(f"num_ids must be >= 1, got {num_ids}")
        self.num_ids = num_ids
        self._rng = np.random.default_rng(seed)

    def sample(self, size: int) -> np.ndarray:
        """int64 (size,) ids, each in ``[0, num_ids)``."""
        return self._rng.integers(0, self.num_ids, size=size, dtype=np.int64)


IdSampler = ZipfSampler | UniformSampler


def make_sampler(distribution: str, num_ids: int, zipf_exponent: float, seed: int) -> IdSampler:
    """``"uniform"`` or ``"zipf"`` id sampler over ``[0, num_ids)``."""
    if distribution == "uniform":
        return UniformSampler(num_ids, seed)
    if distribution == "zipf":
        return ZipfSampler(num_ids, zipf_exponent, seed)
    raise ValueError(f"unknown id distribution {distribution!r}; expected 'uniform' or 'zipf'")


def efficiency(throughput: float, cores: int, throughput_at_one: float) -> float:
    """Scaling efficiency: throughput / (cores x throughput at one core); NaN without a baseline."""
    if cores < 1 or not throughput_at_one > 0.0:
        return math.nan
    return throughput / (cores * throughput_at_one)
