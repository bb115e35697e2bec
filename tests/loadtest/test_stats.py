"""Statistics of the load test: percentiles, summaries, rates, efficiency and the id samplers."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtest.stats import (
    Summary,
    UniformSampler,
    ZipfSampler,
    efficiency,
    make_sampler,
    percentile,
    rate,
)

finite_floats = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


def test_percentile_known_values() -> None:
    samples = [1.0, 2.0, 3.0, 4.0]
    assert percentile(samples, 0) == 1.0
    assert percentile(samples, 100) == 4.0
    assert percentile(samples, 50) == pytest.approx(2.5)
    # rank 0.9 * 3 = 2.7: 3 + 0.7 * (4 - 3)
    assert percentile(samples, 90) == pytest.approx(3.7)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_percentile_ignores_input_order() -> None:
    assert percentile([5.0, 1.0, 3.0], 50) == 3.0


@pytest.mark.parametrize("bad", [-0.1, 100.5])
def test_percentile_rejects_out_of_range(bad: float) -> None:
    with pytest.raises(ValueError):
        percentile([1.0], bad)


@settings(max_examples=200, deadline=None)
@given(st.lists(finite_floats, min_size=1, max_size=200), st.floats(min_value=0, max_value=100))
def test_percentile_matches_numpy_linear(samples: list[float], q: float) -> None:
    assert percentile(samples, q) == pytest.approx(np.percentile(samples, q, method="linear"), abs=1e-6)


@settings(max_examples=200, deadline=None)
@given(st.lists(finite_floats, min_size=1, max_size=200))
def test_percentiles_are_ordered_and_bounded(samples: list[float]) -> None:
    summary = Summary.of(samples)
    assert min(samples) <= summary.p50 <= summary.p90 <= summary.p99 <= summary.max == max(samples)
    assert summary.count == len(samples)


@settings(max_examples=100, deadline=None)
@given(st.lists(finite_floats, min_size=1, max_size=100), st.floats(min_value=0, max_value=100))
def test_percentile_is_at_least_that_share_of_samples(samples: list[float], q: float) -> None:
    """The value lies at or above the order statistic at floor(rank): that many + 1 samples are <= it."""
    value = percentile(samples, q)
    rank = q / 100 * (len(samples) - 1)
    at_or_below = sum(1 for s in samples if s <= value + 1e-9)
    assert at_or_below >= math.floor(rank) + 1


def test_summary_skips_missing_values() -> None:
    summary = Summary.of([1.0, math.nan, 3.0])
    assert summary.count == 2
    assert summary.p50 == pytest.approx(2.0)
    assert summary.mean == pytest.approx(2.0)
    empty = Summary.of([math.nan])
    assert empty.count == 0 and math.isnan(empty.p50) and math.isnan(empty.max)


def test_rate() -> None:
    assert rate(500, 2.0) == 250.0
    assert rate(10, 0.0) == 0.0
    assert rate(0, 1.0) == 0.0


def test_efficiency() -> None:
    assert efficiency(400.0, 4, 100.0) == pytest.approx(1.0)
    assert efficiency(300.0, 4, 100.0) == pytest.approx(0.75)
    assert efficiency(100.0, 1, 100.0) == pytest.approx(1.0)
    assert math.isnan(efficiency(100.0, 2, 0.0))


@settings(max_examples=30, deadline=None)
@given(
    num_ids=st.integers(min_value=1, max_value=5000),
    exponent=st.floats(min_value=0.0, max_value=3.0),
    seed=st.integers(min_value=0, max_value=2**31),
)
def test_zipf_sampler_stays_in_bounds(num_ids: int, exponent: float, seed: int) -> None:
    ids = ZipfSampler(num_ids, exponent, seed).sample(2000)
    assert ids.dtype == np.int64
    assert ids.shape == (2000,)
    assert ids.min() >= 0 and ids.max() < num_ids


def test_zipf_sampler_is_skewed_like_zipf() -> None:
    num_ids, exponent = 1000, 1.0
    sampler = ZipfSampler(num_ids, exponent, seed=1)
    ids = sampler.sample(200_000)
    counts = np.bincount(ids, minlength=num_ids)
    ranked = np.sort(counts)[::-1]
    harmonic = sum(1.0 / r for r in range(1, num_ids + 1))
    # the hottest id gets ~1/H(1000) ~ 13% of the draws; a uniform sampler would give it ~0.1%
    assert ranked[0] / ids.size == pytest.approx(1.0 / harmonic, rel=0.05)
    # rank 2 gets about half of rank 1 (1 / 2**s)
    assert ranked[1] / ranked[0] == pytest.approx(0.5, rel=0.1)


def test_zipf_exponent_zero_is_uniform() -> None:
    ids = ZipfSampler(10, 0.0, seed=3).sample(100_000)
    counts = np.bincount(ids, minlength=10)
    assert counts.min() > 9000 and counts.max() < 11000


def test_zipf_hot_ids_are_scattered() -> None:
    """The rank -> id permutation means the hottest id is not simply id 0 for every seed."""
    hottest = {int(np.bincount(ZipfSampler(1000, 1.2, seed=s).sample(5000)).argmax()) for s in range(8)}
    assert len(hottest) > 1


def test_samplers_are_reproducible() -> None:
    assert np.array_equal(ZipfSampler(100, 1.1, 7).sample(50), ZipfSampler(100, 1.1, 7).sample(50))
    assert np.array_equal(UniformSampler(100, 7).sample(50), UniformSampler(100, 7).sample(50))


def test_uniform_sampler_bounds() -> None:
    ids = UniformSampler(17, seed=0).sample(10_000)
    assert ids.dtype == np.int64
    assert ids.min() == 0 and ids.max() == 16


@pytest.mark.parametrize(
    ("args", "error"),
    [((0, 1.0, 0), ValueError), ((ZipfSampler.MAX_IDS + 1, 1.0, 0), ValueError), ((10, -1.0, 0), ValueError)],
)
def test_zipf_sampler_rejects_bad_arguments(args: tuple[int, float, int], error: type[Exception]) -> None:
    with pytest.raises(error):
        ZipfSampler(*args)


def test_make_sampler() -> None:
    assert isinstance(make_sampler("uniform", 10, 1.0, 0), UniformSampler)
    assert isinstance(make_sampler("zipf", 10, 1.0, 0), ZipfSampler)
    with pytest.raises(ValueError):
        make_sampler("pareto", 10, 1.0, 0)
