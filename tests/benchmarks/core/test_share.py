"""The share's yardsticks: the memory floor, the timed pieces and the prefetch comparison, on toy sizes."""

from __future__ import annotations

import types

import pytest
import torch

from benchmarks.core import share
from benchmarks.core.share import FloorReading, PieceTimings


def test_memory_floor_runner_times_each_step_after_the_first():
    grads = (torch.randn(64, 8), torch.randn(64, 8))
    run = share.memory_floor_runner(grads, memory_size=256, steps=5)
    timings = run()
    assert len(timings) == 4
    assert all(0 < rows <= total for rows, total in timings)


def test_timed_calls_records_every_call_and_puts_the_original_back():
    owner = types.SimpleNamespace(double=lambda x: 2 * x)
    original = owner.double
    with share.timed_calls({"double": (owner, "double")}) as durations:
        assert owner.double(3) == 6 and owner.double(4) == 8
        assert owner.double is not original
    assert owner.double is original
    assert len(durations["double"]) == 2 and all(d >= 0 for d in durations["double"])


def test_timed_calls_restores_the_originals_when_the_block_raises():
    owner = types.SimpleNamespace(f=lambda: 1)
    original = owner.f
    with pytest.raises(RuntimeError), share.timed_calls({"f": (owner, "f")}):
        raise RuntimeError("boom")
    assert owner.f is original


def test_pieces_are_summed_per_step_and_the_rest_is_what_they_leave():
    # two steps; "hash" is called twice a step, "scatter" once; uneven pieces are left out
    durations = {"hash": [0.001, 0.002, 0.003, 0.004], "scatter": [0.010, 0.030], "odd": [0.1, 0.2, 0.3]}
    pieces = PieceTimings.from_durations(durations, steps=2, adam_ms=0.5)
    assert pieces.pieces == pytest.approx({"hash x2": 5.0, "scatter": 20.0})
    text = pieces.reading(share_ms=30.0)
    assert "fused share's 30.00 ms" in text and "hash x2 5.00, scatter 20.00" in text
    assert "Adam(fused=True)'s step 0.50" in text and "Python) 4.50." in text


def test_floor_reading_prints_ratios_and_reach_from_its_data():
    reading = FloorReading(
        floor_ms=2.0, rows_floor_ms=1.5, reference_ms=40.0, fused_ms=4.0, adam_ms=0.5, goal=15.0
    )
    text = reading.reading(batch_size=32768, embedding_dim=100, memory_size=262144)
    assert "took 2.00 ms" in text and "(13.1 MB each" in text and "1.50 ms" in text and "0.50 ms" in text
    assert "2.00x the floor" in text
    assert "20.0x if the whole share ran at the floor, 20.0x with lookups" in text
    assert "goal is within reach at that floor." in text
    slower = FloorReading(2.0, 1.5, 20.0, 4.0, 0.5, 15.0).reading(32768, 100, 262144)
    assert "10.0x with lookups" in slower and "goal is out of reach even at that floor." in slower


def test_prefetch_comparison_steps_every_variant_and_keeps_the_thresholds():
    from robez_core import kernels

    names = ("_PREFETCH_READ_MIN_BYTES", "_PREFETCH_WRITE_MIN_BYTES", "_WARM_TABLE_RATIO")
    before = [getattr(kernels, name) for name in names]
    result = share.prefetch_comparison(
        512, batch_size=64, embedding_dim=16, chunk_size=4, num_embeddings=1000, rounds=2
    )
    assert set(result) == {"thresholds as set", "no table pass", "write never", "read always"}
    assert result["thresholds as set"][1] == 1.0
    assert all(median > 0 for median, _ in result.values())
    assert before == [getattr(kernels, name) for name in names]


def test_adam_comparison_steps_both_optimizers_and_reads_its_figures():
    before = torch.get_num_threads()
    result = share.adam_comparison(
        512, batch_size=64, embedding_dim=16, chunk_size=4, num_embeddings=1000, rounds=2
    )
    assert set(result) == {"torch.optim.Adam", "torch.optim.Adam(fused=True)"}
    assert result["torch.optim.Adam(fused=True)"][1] == 1.0
    assert all(share > step > 0 for share, _, step in result.values())
    assert torch.get_num_threads() == before
    text = share.adam_reading(
        {"torch.optim.Adam": (3.5, 1.25, 0.6), "torch.optim.Adam(fused=True)": (3.0, 1.0, 0.2)}
    )
    assert "torch.optim.Adam(fused=True)'s step took 0.200 ms, the default's 0.600 ms (3.00x)" in text
    assert "20.0% shorter per batch (paired: default / fused=True = 1.250; -0.500 ms" in text
    slower = share.adam_reading(
        {"torch.optim.Adam": (2.9, 0.8, 0.3), "torch.optim.Adam(fused=True)": (3.0, 1.0, 0.2)}
    )
    assert "25.0% longer per batch" in slower and "+0.100 ms" in slower


def test_trivial_offsets_still_hash_then_read_every_row_from_the_array_start():
    from robez_core import RobezEmbedding, kernels

    table = RobezEmbedding(1000, 10, memory_size=64, chunk_size=4)
    ids = torch.tensor([3, 999, 3, 12])
    original = kernels.chunk_offsets
    with share.timed_calls({"hash": (kernels, "chunk_offsets")}) as durations:
        with share.trivial_offsets():
            offsets = table.hash_ids(ids)
            rows = table(ids)
            rows.sum().backward()
        hashed_calls = durations["hash"]
    assert kernels.chunk_offsets is original
    assert len(hashed_calls) == 2  # the real hash still ran for both calls
    assert offsets.dtype == torch.int64 and offsets.shape == (4, 3)
    assert offsets.tolist() == [[0, 4, 8]] * 4
    weight = table.weight.detach()
    assert torch.equal(rows.detach(), weight[:10].expand(4, 10))  # chunk c at c * Z: the first d floats
    grad = table.weight.grad
    assert grad is not None and torch.equal(grad[:10], torch.full((10,), 4.0)) and not grad[10:].any()
    assert not torch.equal(table.hash_ids(ids), offsets)  # outside the block the ids hash again


def test_trivial_offsets_stay_inside_a_small_array_and_restore_on_error():
    from robez_core import RobezEmbedding, kernels

    table = RobezEmbedding(10, 12, memory_size=6, chunk_size=4)  # d > m: chunks overlap at the end
    original = kernels.chunk_offsets
    with pytest.raises(RuntimeError, match="boom"), share.trivial_offsets():
        offsets = table.hash_ids(torch.tensor([1, 2]))
        raise RuntimeError("boom")
    assert offsets.tolist() == [[0, 2, 2]] * 2  # clamped to m - Z
    assert kernels.chunk_offsets is original
